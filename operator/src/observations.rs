//! What the broker has told us about each proplet since its status was last written.
//!
//! The MQTT side only records here and names the proplet whose reconcile should run; it
//! never calls the API server. The reconciler peeks at the pending observation to plan, and
//! clears what it wrote once the status patch succeeded. Only the latest
//! [`ALIVE_HISTORY_LEN`] heartbeats are kept per proplet: older ones could not reach
//! `aliveHistory` anyway.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use propeller_broker::server::{BrokerEvent, EventKind};

use crate::crd::common::{MetricsSample, PropletResources};
use crate::crd::proplet::PropletMetadata;
use crate::decision::liveness::{ExternalObservation, ALIVE_HISTORY_LEN};

use crate::decision::proplet::DeviceReport;

/// Pending liveness observations and the latest device reports, per MQTT client id.
#[derive(Debug, Default)]
pub struct ObservationStore {
    pending: Mutex<HashMap<String, ExternalObservation>>,
    reports: Mutex<HashMap<String, DeviceReport>>,
    silence: Mutex<SilenceDeadlines>,
}

/// When each proplet shown Running goes Offline unless heard from again, by client id, and
/// the same in deadline order.
#[derive(Debug, Default)]
struct SilenceDeadlines {
    by_client: HashMap<String, DateTime<Utc>>,
    due: BTreeSet<(DateTime<Utc>, String)>,
}

impl SilenceDeadlines {
    fn set(&mut self, client_id: &str, deadline: Option<DateTime<Utc>>) {
        if let Some(old) = self.by_client.remove(client_id) {
            self.due.remove(&(old, client_id.to_owned()));
        }
        if let Some(at) = deadline {
            self.by_client.insert(client_id.to_owned(), at);
            self.due.insert((at, client_id.to_owned()));
        }
    }
}

fn metadata_of(m: &propeller_broker::protocol::PropletMetadata) -> PropletMetadata {
    PropletMetadata {
        description: m.description.clone(),
        tags: m.tags.clone(),
        location: m.location.clone(),
        ip: m.ip.clone(),
        environment: m.environment.clone(),
        os: m.os.clone(),
        hostname: m.hostname.clone(),
        cpu_arch: m.cpu_arch.clone(),
        total_memory_bytes: m.total_memory_bytes.and_then(|b| i64::try_from(b).ok()),
        proplet_version: m.proplet_version.clone(),
        wasm_runtime: m.wasm_runtime.clone(),
        attester: m.attester.clone(),
    }
}

fn milli(percent: Option<f64>) -> i64 {
    percent.map_or(0, |p| (p * 1000.0).round() as i64)
}

fn lock_silence(silence: &Mutex<SilenceDeadlines>) -> std::sync::MutexGuard<'_, SilenceDeadlines> {
    silence.lock().unwrap_or_else(|e| e.into_inner())
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
        self.record_report(event, now);
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

    fn record_report(&self, event: &BrokerEvent, now: DateTime<Utc>) {
        let mut reports = self.reports.lock().unwrap_or_else(|e| e.into_inner());
        let (metadata, metrics) = match &event.kind {
            EventKind::Discovered(d) => (d.metadata.as_ref(), None),
            EventKind::Heartbeat(h) => (h.metadata.as_ref(), h.metrics.as_ref()),
            _ => return,
        };
        let report = reports.entry(event.client_id.clone()).or_default();
        if let Some(m) = metadata {
            report.metadata = Some(metadata_of(m));
        }
        if let Some(m) = metrics {
            report.metrics = Some(MetricsSample {
                timestamp: Some(now),
                cpu_milli_percent: milli(m.cpu_percent),
                memory_milli_percent: milli(m.memory_percent),
                memory_bytes: m
                    .memory_bytes
                    .and_then(|b| i64::try_from(b).ok())
                    .unwrap_or(0),
            });
            let total = report.metadata.as_ref().and_then(|m| m.total_memory_bytes);
            if let (Some(total), Some(used)) = (total, m.memory_percent) {
                let free = (total as f64 * (1.0 - used / 100.0)).max(0.0) as i64;
                report.available = Some(PropletResources {
                    memory: Some(free.to_string()),
                    ..PropletResources::default()
                });
            }
        }
    }

    /// The latest device report of `client_id`.
    pub fn report(&self, client_id: &str) -> DeviceReport {
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(client_id)
            .cloned()
            .unwrap_or_default()
    }

    /// Watches `client_id`'s silence deadline (`None`: stops watching): see
    /// [`ObservationStore::silent`].
    pub fn watch_silence(&self, client_id: &str, deadline: Option<DateTime<Utc>>) {
        lock_silence(&self.silence).set(client_id, deadline);
    }

    /// The clients whose silence deadline passed by `now` with no heartbeat recorded since
    /// it was set: their proplets' reconciles decide they are Offline. A client heard from
    /// meanwhile is watched again at its latest heartbeat + `threshold`, with no reconcile.
    pub fn silent(&self, now: DateTime<Utc>, threshold: chrono::Duration) -> Vec<String> {
        let mut silence = lock_silence(&self.silence);
        let mut passed = Vec::new();
        while let Some((at, _)) = silence.due.first() {
            if *at > now {
                break;
            }
            if let Some((at, client)) = silence.due.pop_first() {
                silence.by_client.remove(&client);
                passed.push((at, client));
            }
        }
        drop(silence);
        let mut gone = Vec::new();
        for (at, client) in passed {
            let heard = self
                .last_heartbeat(&client)
                .and_then(|seen| seen.checked_add_signed(threshold))
                .filter(|deadline| *deadline > at);
            match heard {
                Some(deadline) if deadline > now => {
                    let mut silence = lock_silence(&self.silence);
                    // A reconcile meanwhile set its own deadline, which stands.
                    if !silence.by_client.contains_key(&client) {
                        silence.set(&client, Some(deadline));
                    }
                }
                _ => gone.push(client),
            }
        }
        gone
    }

    /// Forgets a proplet that was deleted.
    pub fn forget(&self, client_id: &str) {
        lock_silence(&self.silence).set(client_id, None);
        self.lock().remove(client_id);
        self.reports
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(client_id);
    }

    /// The observation pending for `client_id` (empty if none).
    pub fn peek(&self, client_id: &str) -> ExternalObservation {
        self.lock().get(client_id).cloned().unwrap_or_default()
    }

    /// The latest heartbeat recorded and not yet written, if any.
    pub fn last_heartbeat(&self, client_id: &str) -> Option<DateTime<Utc>> {
        self.lock()
            .get(client_id)
            .and_then(|o| o.heartbeats.last().copied())
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
    fn heartbeat_metadata_and_metrics_become_the_latest_device_report() {
        let store = ObservationStore::new();
        let described = event(
            "pi",
            EventKind::Heartbeat(Heartbeat {
                proplet_id: "pi".into(),
                namespace: None,
                metadata: Some(propeller_broker::protocol::PropletMetadata {
                    os: Some("linux".into()),
                    total_memory_bytes: Some(1000),
                    ..Default::default()
                }),
                metrics: Some(propeller_broker::protocol::HeartbeatMetrics {
                    cpu_percent: Some(12.5),
                    memory_bytes: Some(64),
                    memory_percent: Some(25.0),
                }),
            }),
        );
        store.record(&described, at(0));
        // A later heartbeat without metadata keeps the metadata already reported.
        store.record(&beat("pi"), at(1));
        let report = store.report("pi");
        assert_eq!(
            report.metadata.as_ref().and_then(|m| m.os.as_deref()),
            Some("linux")
        );
        let metrics = report.metrics.unwrap_or_default();
        assert_eq!(metrics.cpu_milli_percent, 12_500);
        assert_eq!(metrics.memory_milli_percent, 25_000);
        assert_eq!(metrics.memory_bytes, 64);
        assert_eq!(
            report.available.and_then(|a| a.memory),
            Some("750".to_owned())
        );
        store.forget("pi");
        assert_eq!(store.report("pi"), DeviceReport::default());
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

    #[test]
    fn a_silence_deadline_wakes_only_when_nothing_was_heard_since() {
        let store = ObservationStore::new();
        let threshold = chrono::Duration::seconds(30);
        store.watch_silence("quiet", Some(at(30)));
        store.watch_silence("talker", Some(at(30)));
        store.watch_silence("later", Some(at(90)));
        assert!(
            store.silent(at(29), threshold).is_empty(),
            "nothing due yet"
        );
        // The talker is heard at 20 s: its deadline moves to 50 s without a reconcile.
        store.record(&beat("talker"), at(20));
        assert_eq!(store.silent(at(30), threshold), vec!["quiet".to_owned()]);
        assert!(
            store.silent(at(49), threshold).is_empty(),
            "quiet is not asked twice"
        );
        assert_eq!(store.silent(at(50), threshold), vec!["talker".to_owned()]);
        // A reconcile that stops watching (Offline, deleted) is never asked about.
        store.watch_silence("later", None);
        assert!(store.silent(at(1_000), threshold).is_empty());
        store.watch_silence("gone", Some(at(10)));
        store.forget("gone");
        assert!(store.silent(at(1_000), threshold).is_empty());
    }
}
