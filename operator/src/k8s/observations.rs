//! What the broker has told us about each proplet since its status was last written.
//!
//! The MQTT side only records here and names the proplet whose reconcile should run; it
//! never calls the API server. The reconciler peeks at the pending observation to plan, and
//! clears what it wrote once the status patch succeeded. Only the latest
//! [`ALIVE_HISTORY_LEN`] heartbeats are kept per proplet: older ones could not reach
//! `aliveHistory` anyway.

use std::collections::HashMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use propeller_broker::server::{BrokerEvent, EventKind};

use crate::decision::liveness::{ExternalObservation, ALIVE_HISTORY_LEN};

/// Pending liveness observations per MQTT client id.
#[derive(Debug, Default)]
pub struct ObservationStore {
    pending: Mutex<HashMap<String, ExternalObservation>>,
}

impl ObservationStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, ExternalObservation>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a liveness event received at `now`; returns the client id whose proplet
    /// should be reconciled, or `None` for events that are not about liveness.
    pub fn record(&self, event: &BrokerEvent, now: DateTime<Utc>) -> Option<String> {
        let mut pending = self.lock();
        match &event.kind {
            EventKind::Heartbeat(_) | EventKind::Discovered(_) => {
                let entry = pending.entry(event.client_id.clone()).or_default();
                entry.heartbeats.push(now);
                let excess = entry.heartbeats.len().saturating_sub(ALIVE_HISTORY_LEN);
                entry.heartbeats.drain(..excess);
            }
            EventKind::Offline(_) => {
                let entry = pending.entry(event.client_id.clone()).or_default();
                entry.offline_at = Some(now);
            }
            _ => return None,
        }
        Some(event.client_id.clone())
    }

    /// The observation pending for `client_id` (empty if none).
    pub fn peek(&self, client_id: &str) -> ExternalObservation {
        self.lock().get(client_id).cloned().unwrap_or_default()
    }

    /// Forgets what a successful status write included; anything recorded after `written`
    /// was taken stays pending.
    pub fn clear_written(&self, client_id: &str, written: &ExternalObservation) {
        let mut pending = self.lock();
        let Some(entry) = pending.get_mut(client_id) else {
            return;
        };
        entry
            .heartbeats
            .retain(|at| !written.heartbeats.contains(at));
        if entry.offline_at == written.offline_at {
            entry.offline_at = None;
        }
        if entry.heartbeats.is_empty() && entry.offline_at.is_none() {
            pending.remove(client_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use propeller_broker::protocol::Heartbeat;
    use propeller_broker::server::OfflineCause;

    fn at(secs: i64) -> DateTime<Utc> {
        match Utc.timestamp_opt(1_800_000_000 + secs, 0) {
            chrono::LocalResult::Single(t) => t,
            _ => panic!("bad time"),
        }
    }

    fn event(client: &str, kind: EventKind) -> BrokerEvent {
        BrokerEvent {
            client_id: client.into(),
            domain: None,
            channel: None,
            kind,
        }
    }

    fn beat(client: &str) -> BrokerEvent {
        event(
            client,
            EventKind::Heartbeat(Heartbeat {
                proplet_id: client.into(),
                namespace: None,
                metadata: None,
                metrics: None,
            }),
        )
    }

    #[test]
    fn heartbeats_are_bounded_and_trigger_their_proplet() {
        let store = ObservationStore::new();
        for i in 0..25 {
            assert_eq!(store.record(&beat("pi"), at(i)), Some("pi".to_owned()));
        }
        let seen = store.peek("pi");
        assert_eq!(seen.heartbeats.len(), ALIVE_HISTORY_LEN);
        assert_eq!(seen.heartbeats.last(), Some(&at(24)));
        assert_eq!(store.peek("other"), ExternalObservation::default());
    }

    #[test]
    fn clearing_keeps_what_arrived_after_the_write_was_planned() {
        let store = ObservationStore::new();
        store.record(&beat("pi"), at(0));
        store.record(
            &event("pi", EventKind::Offline(OfflineCause::ConnectionLost)),
            at(1),
        );
        let planned = store.peek("pi");
        store.record(&beat("pi"), at(2));
        store.clear_written("pi", &planned);
        let left = store.peek("pi");
        assert_eq!(left.heartbeats, vec![at(2)]);
        assert_eq!(left.offline_at, None);
        store.clear_written("pi", &left);
        assert_eq!(store.peek("pi"), ExternalObservation::default());
    }

    #[test]
    fn non_liveness_events_trigger_nothing_here() {
        let store = ObservationStore::new();
        let result = event(
            "pi",
            EventKind::Result(propeller_broker::protocol::TaskResult {
                task_id: "t".into(),
                proplet_id: Some("pi".into()),
                results: propeller_broker::protocol::ResultValue::Text("1".into()),
                error: None,
            }),
        );
        assert_eq!(store.record(&result, at(0)), None);
    }
}
