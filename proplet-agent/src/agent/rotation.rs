//! Failover between brokers: which one the event loop dials next, and the reconnect backoff.

use std::time::Duration;

use rumqttc::{EventLoop, MqttOptions};

use crate::config::BrokerAddress;

/// Which broker the event loop is pointed at, and the options of each.
pub(super) struct Rotation<'a> {
    pub(super) brokers: &'a [BrokerAddress],
    pub(super) options: &'a [MqttOptions],
    pub(super) current: usize,
}

impl<'a> Rotation<'a> {
    /// Starts at the broker `initial` (the event loop's options) connects to; the first when
    /// none matches.
    pub(super) fn new(
        brokers: &'a [BrokerAddress],
        options: &'a [MqttOptions],
        initial: &MqttOptions,
    ) -> Self {
        let current = options
            .iter()
            .position(|o| o.broker_address() == initial.broker_address())
            .unwrap_or(0);
        Self {
            brokers,
            options,
            current,
        }
    }

    pub(super) fn current(&self) -> &'a BrokerAddress {
        &self.brokers[self.current]
    }

    /// Points `eventloop` at the next broker, round-robin, and returns it; `None` (and the
    /// event loop unchanged) with a single broker.
    pub(super) fn advance(&mut self, eventloop: &mut EventLoop) -> Option<&'a BrokerAddress> {
        let count = self.options.len().min(self.brokers.len());
        if count < 2 {
            return None;
        }
        self.current = (self.current + 1) % count;
        eventloop.mqtt_options = self.options[self.current].clone();
        Some(self.current())
    }
}

/// Reconnect delays: exponential from 1 s to 60 s with ±20 % jitter, so a fleet that lost
/// its broker does not reconnect in lockstep.
#[derive(Debug, Default)]
pub(super) struct Backoff {
    pub(super) attempt: u32,
}

impl Backoff {
    pub(super) fn next_delay(&mut self) -> Duration {
        let base = Duration::from_secs(1u64 << self.attempt.min(6)).min(Duration::from_secs(60));
        self.attempt = self.attempt.saturating_add(1);
        let jitter = 0.8 + 0.4 * fastrand::f64();
        base.mul_f64(jitter)
    }

    pub(super) fn reset(&mut self) {
        self.attempt = 0;
    }
}
