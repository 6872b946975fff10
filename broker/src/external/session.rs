//! The client session on the external broker: connect, subscribe, turn publishes into
//! events, and on failure move to the next node with backoff.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rumqttc::{
    Event, EventLoop, Incoming, Outgoing, QoS, Request, Subscribe, SubscribeFilter,
    SubscribeReasonCode,
};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::attribution::{attribute, Attributed};
use super::metrics::ReasonLabel;
use super::{options_for, ExternalConfig, ExternalMetrics};
use crate::protocol::{refused_filters, Decoder};
use crate::server::{BrokerEvent, CredentialStore};

/// How long to wait before subscribing again after the broker refused a filter (a NATS node
/// refuses QoS 1 subscriptions while its JetStream leaders are being re-elected).
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

pub(super) struct Session {
    pub config: ExternalConfig,
    pub tls: Option<Arc<rustls::ClientConfig>>,
    pub eventloop: EventLoop,
    pub devices: CredentialStore,
    pub decoder: Decoder,
    pub events: UnboundedSender<BrokerEvent>,
    pub ready: watch::Sender<bool>,
    pub metrics: ExternalMetrics,
}

impl Session {
    pub async fn run(mut self) {
        let nodes = self.config.addresses.len();
        let mut index = 0usize;
        let mut failures = 0u32;
        let mut connected_before = false;
        // Publishes not acknowledged when a connection dropped: sent again on the next one
        // (rumqttc would drop them on a node where the session is not present).
        let mut unacknowledged: VecDeque<Request> = VecDeque::new();
        let mut resubscribe_at: Option<Instant> = None;
        // The filters of the SUBSCRIBE in flight (one at a time: the next goes after its
        // SUBACK), so a refusal is answered for the refused filters alone: on NATS each
        // filter subscribed again goes through its JetStream consumer again.
        let mut asked: Vec<String> = Vec::new();
        loop {
            let polled = match resubscribe_at {
                Some(at) => tokio::select! {
                    polled = self.eventloop.poll() => polled,
                    _ = tokio::time::sleep_until(at) => {
                        resubscribe_at = None;
                        self.subscribe(&asked);
                        continue;
                    }
                },
                None => self.eventloop.poll().await,
            };
            match polled {
                Ok(Event::Incoming(Incoming::ConnAck(ack))) => {
                    let address = &self.config.addresses[index % nodes];
                    info!(%address, session_present = ack.session_present, "connected to the MQTT broker");
                    if connected_before {
                        self.metrics.reconnects.inc();
                    }
                    connected_before = true;
                    failures = 0;
                    for request in unacknowledged.drain(..) {
                        if let Request::Publish(mut publish) = request {
                            publish.pkid = 0;
                            publish.dup = false;
                            self.eventloop.pending.push_back(Request::Publish(publish));
                        }
                    }
                    asked = self.config.filters.clone();
                    self.subscribe(&asked);
                }
                Ok(Event::Incoming(Incoming::SubAck(ack))) => {
                    let refusals: Vec<bool> = ack
                        .return_codes
                        .iter()
                        .map(|code| matches!(code, SubscribeReasonCode::Failure))
                        .collect();
                    let refused =
                        refused_filters(&asked, &refusals).unwrap_or_else(|| asked.clone());
                    if refused.is_empty() {
                        self.ready.send_replace(true);
                        self.metrics.connected.set(1);
                    } else {
                        warn!(
                            ?refused,
                            "the broker refused subscriptions; trying again in {RESUBSCRIBE_AFTER:?}"
                        );
                        asked = refused;
                        resubscribe_at = Some(Instant::now() + RESUBSCRIBE_AFTER);
                    }
                }
                Ok(Event::Incoming(Incoming::Publish(publish))) => {
                    self.metrics.received.inc();
                    self.deliver(&publish.topic, &publish.payload);
                }
                Ok(Event::Outgoing(Outgoing::Publish(_))) => {
                    self.metrics.published.inc();
                }
                Ok(_) => {}
                Err(error) => {
                    self.ready.send_replace(false);
                    self.metrics.connected.set(0);
                    self.metrics.connect_failures.inc();
                    unacknowledged.extend(self.eventloop.pending.drain(..));
                    resubscribe_at = None;
                    let failed = &self.config.addresses[index % nodes];
                    index = (index + 1) % nodes;
                    let next = &self.config.addresses[index];
                    let delay = backoff(&self.config, failures);
                    failures = failures.saturating_add(1);
                    warn!(address = %failed, %error, next = %next, ?delay, "MQTT broker connection failed; trying the next node");
                    self.eventloop.mqtt_options =
                        options_for(&self.config, index, self.tls.clone());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    /// Queues the subscriptions ahead of anything else waiting to be sent.
    /// Puts a SUBSCRIBE for `filters` first in line.
    fn subscribe(&mut self, filters: &[String]) {
        let filters = filters
            .iter()
            .map(|f| SubscribeFilter::new(f.clone(), QoS::AtLeastOnce));
        self.eventloop
            .pending
            .push_front(Request::Subscribe(Subscribe::new_many(filters)));
    }

    fn deliver(&self, topic: &str, payload: &[u8]) {
        match attribute(
            &self.decoder,
            &self.devices,
            self.config.trust,
            topic,
            payload,
        ) {
            Attributed::Event(event) => {
                // The receiver is gone only while shutting down.
                let _ = self.events.send(*event);
            }
            Attributed::NotAReport => debug!(%topic, "not a device report; ignored"),
            Attributed::Dropped(reason) => {
                warn!(%topic, reason = reason.as_str(), "device report refused");
                self.metrics
                    .dropped
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str().to_owned(),
                    })
                    .inc();
            }
        }
    }
}

/// The delay after `failures` failures in a row: doubling from the minimum to the maximum.
fn backoff(config: &ExternalConfig, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.min(16));
    config
        .min_backoff
        .saturating_mul(factor)
        .min(config.max_backoff)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::BrokerAddress;

    #[test]
    fn backoff_doubles_up_to_the_maximum() {
        let config = ExternalConfig::new(
            vec![BrokerAddress::parse("mqtt://a:1").unwrap()],
            "propeller",
        );
        assert_eq!(backoff(&config, 0), Duration::from_millis(100));
        assert_eq!(backoff(&config, 1), Duration::from_millis(200));
        assert_eq!(backoff(&config, 3), Duration::from_millis(800));
        assert_eq!(backoff(&config, 40), Duration::from_secs(5));
    }
}
