//! What a driver keeps in memory between reconciles. Both drivers hold one of these, so the
//! MQTT side records device reports the same way whatever stores the objects.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use propeller_broker::protocol::{ResultValue, UpgradeReport};
use propeller_broker::server::{BrokerEvent, EventKind};
use tracing::warn;

use crate::crd::common::MetricsSample;
use crate::crd::proplet::{Proplet, PropletType};
use crate::crd::task::Task;
use crate::decision::liveness::heartbeat_can_wait;
use crate::decision::proplet::PropletSettings;
use crate::decision::scheduler::RoundRobinState;
use crate::decision::task::{ReportedResult, TaskObservations};
use crate::inbox::{DispatchLedger, LiveSessions, Queued, TaskInbox};
use crate::observations::ObservationStore;

/// In-memory driver state: device reports not yet written, starts already sent, and the
/// scheduler's rotation.
#[derive(Debug, Default)]
pub struct DriverState {
    /// Liveness reports and device descriptions.
    pub liveness: ObservationStore,
    /// Task results and metrics.
    pub inbox: TaskInbox,
    /// Starts already published.
    pub ledger: DispatchLedger,
    /// Devices that are listening for starts.
    pub sessions: LiveSessions,
    /// The scheduler's rotation.
    pub round_robin: Mutex<RoundRobinState>,
    /// When each Proplet's status was last written (`namespace/name`).
    pub proplet_writes: Mutex<HashMap<String, DateTime<Utc>>>,
    /// FL updates that name no task, by (round number, sender), until the participant's
    /// task claims them.
    unclaimed_updates: Mutex<Vec<(u64, ReportedResult)>>,
    /// Upgrade reports not yet written, by rollout id, with the client that sent each.
    upgrade_reports: Mutex<HashMap<String, Vec<(String, UpgradeReport)>>>,
    /// The latest phase seen of each proplet another replica owns (sharding).
    foreign_phases:
        Mutex<HashMap<propeller_core::object_name::ObjectName, crate::crd::proplet::PropletPhase>>,
}

/// What a broker event concerns, for the driver to trigger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Concerns {
    /// The proplet with this MQTT client id.
    Proplet(String),
    /// The task with this UID.
    Task(String),
    /// The tasks running on the proplet with this MQTT client id.
    TasksOf(String),
    /// The proplet with this MQTT client id began a new session: it and its tasks.
    Rejoined(String),
    /// The PropletUpgrade with this rollout id.
    Upgrade(String),
    /// Nothing a reconciler handles.
    Nothing,
}

/// Upgrade reports kept per rollout until a status write takes them.
const MAX_UPGRADE_REPORTS: usize = 100_000;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DriverState {
    /// Fresh, empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether `event`, a heartbeat from `proplet`, can leave its reconcile to the time the
    /// last one chose (see [`heartbeat_can_wait`]), in both drivers: no reconcile and no
    /// status write for a routine heartbeat. The routine refresh interval comes from the
    /// fleet's size (`fleet_size`, asked only for heartbeats). Other events, and `k8s`
    /// proplets (their phase comes from their Deployment), never wait.
    pub fn heartbeat_waits(
        &self,
        event: &BrokerEvent,
        proplet: &Proplet,
        settings: &PropletSettings,
        fleet_size: impl FnOnce() -> usize,
        now: DateTime<Utc>,
    ) -> bool {
        if !matches!(event.kind, EventKind::Heartbeat(_))
            || proplet.spec.type_ != PropletType::External
            || proplet.metadata.deletion_timestamp.is_some()
        {
            return false;
        }
        let key = format!(
            "{}/{}",
            proplet.metadata.namespace.as_deref().unwrap_or("default"),
            proplet.metadata.name.as_deref().unwrap_or_default()
        );
        let last_write = lock(&self.proplet_writes).get(&key).copied();
        heartbeat_can_wait(
            proplet.status.as_ref(),
            self.liveness.report(&event.client_id).metadata.as_ref(),
            last_write,
            settings.routine_interval(fleet_size()),
            now,
        )
    }

    /// Records what a device reported and says which object should be reconciled. Never
    /// touches the object store or the API server.
    pub fn record(&self, event: &BrokerEvent, now: DateTime<Utc>) -> Concerns {
        match &event.kind {
            EventKind::Discovered(_) => {
                // A device announces itself on every new connection: what was sent to it
                // before may not have arrived, so its runs in flight are started again.
                self.sessions.heard_from(&event.client_id);
                self.liveness.record(event, now);
                if self.ledger.forget_client(&event.client_id).is_empty() {
                    Concerns::Proplet(event.client_id.clone())
                } else {
                    Concerns::Rejoined(event.client_id.clone())
                }
            }
            EventKind::Heartbeat(_) | EventKind::Offline(_) => {
                if matches!(event.kind, EventKind::Offline(_)) {
                    self.sessions.gone(&event.client_id);
                } else {
                    self.sessions.heard_from(&event.client_id);
                }
                self.liveness.record(event, now);
                Concerns::Proplet(event.client_id.clone())
            }
            EventKind::Result(result) => {
                let value = match &result.results {
                    ResultValue::Text(s) => serde_json::Value::String(s.clone()),
                    ResultValue::Json(v) => v.clone(),
                };
                self.queue_result(&result.task_id, &event.client_id, value, &result.error)
            }
            EventKind::FlUpdate(update) => {
                // An update on the FL topic counts as the participant task's result when it
                // names the task; aggregation reads results, so nothing else is needed.
                match update.envelope.task_id.as_deref().filter(|t| !t.is_empty()) {
                    Some(task_id) => self.queue_result(
                        task_id,
                        &event.client_id,
                        update.envelope.to_json(),
                        &update.envelope.error,
                    ),
                    None => {
                        // Upstream's embedded agent names only the round and itself: hold
                        // the update until that participant's task of that round claims it.
                        let round =
                            propeller_broker::protocol::round_number(update.round_id.as_str());
                        match round {
                            Some(round) => {
                                lock(&self.unclaimed_updates).push((
                                    round,
                                    ReportedResult {
                                        client_id: event.client_id.clone(),
                                        value: update.envelope.to_json(),
                                        error: update.envelope.error.clone(),
                                    },
                                ));
                                Concerns::TasksOf(event.client_id.clone())
                            }
                            None => {
                                warn!(
                                    client = %event.client_id,
                                    round = %update.round_id,
                                    "FL update for a round that is not a number; it names no task and no round"
                                );
                                Concerns::Nothing
                            }
                        }
                    }
                }
            }
            EventKind::Upgrade(report) => {
                let mut reports = lock(&self.upgrade_reports);
                let queued = reports.entry(report.id.clone()).or_default();
                if queued.len() >= MAX_UPGRADE_REPORTS {
                    warn!(rollout = %report.id, "too many unapplied upgrade reports; dropping one");
                    return Concerns::Nothing;
                }
                queued.push((event.client_id.clone(), report.clone()));
                Concerns::Upgrade(report.id.clone())
            }
            EventKind::TaskMetrics(m) => {
                let percent = |p: Option<f64>| p.map_or(0, |c| (c * 1000.0) as i64);
                let sample = MetricsSample {
                    timestamp: Some(now),
                    cpu_milli_percent: percent(m.metrics.cpu_percent),
                    memory_milli_percent: percent(m.metrics.memory_percent),
                    memory_bytes: m
                        .metrics
                        .memory_bytes
                        .map_or(0, |b| i64::try_from(b).unwrap_or(i64::MAX)),
                };
                self.inbox.push_metrics(&m.task_id, sample);
                Concerns::Task(m.task_id.clone())
            }
            _ => Concerns::Nothing,
        }
    }

    /// Takes the upgrade reports of rollout `id` (give them back with
    /// [`DriverState::restore_upgrade_reports`] if they could not be written).
    pub fn take_upgrade_reports(&self, id: &str) -> Vec<(String, UpgradeReport)> {
        lock(&self.upgrade_reports).remove(id).unwrap_or_default()
    }

    /// Puts back reports taken for a status write that failed, before any that came since.
    pub fn restore_upgrade_reports(&self, id: &str, mut taken: Vec<(String, UpgradeReport)>) {
        if taken.is_empty() {
            return;
        }
        let mut reports = lock(&self.upgrade_reports);
        let queued = reports.entry(id.to_owned()).or_default();
        taken.append(queued);
        *queued = taken;
    }

    fn queue_result(
        &self,
        task_id: &str,
        client_id: &str,
        value: serde_json::Value,
        error: &Option<String>,
    ) -> Concerns {
        let reported = ReportedResult {
            client_id: client_id.to_owned(),
            value,
            error: error.clone(),
        };
        if self.inbox.push_result(task_id, reported) == Queued::Full {
            warn!(task = %task_id, client = %client_id, "too many unapplied results; refusing more");
        }
        Concerns::Task(task_id.to_owned())
    }

    /// Moves held FL updates of this task's round from its assigned proplet into its inbox.
    fn claim_updates(&self, task: &Task, observed: &TaskObservations) {
        let Some(round) = task
            .spec
            .env
            .get("ROUND_ID")
            .and_then(|r| propeller_broker::protocol::round_number(r))
        else {
            return;
        };
        let Some(client) = task
            .status
            .as_ref()
            .and_then(|s| s.assigned_proplet.as_deref())
            .and_then(|name| observed.proplets.iter().find(|p| p.candidate.name == name))
            .map(|p| p.client_id.clone())
        else {
            return;
        };
        let uid = task.metadata.uid.as_deref().unwrap_or_default();
        let mut held = lock(&self.unclaimed_updates);
        let mut i = 0;
        while i < held.len() {
            if held[i].0 == round && held[i].1.client_id == client {
                let (_, update) = held.remove(i);
                self.inbox.push_result(uid, update);
            } else {
                i += 1;
            }
        }
    }

    /// Adds what this state knows about `task` to observations built from the caches.
    pub fn complete(&self, task: &Task, observed: &mut TaskObservations) {
        self.claim_updates(task, observed);
        let uid = task.metadata.uid.as_deref().unwrap_or_default();
        let (results, metrics) = self.inbox.peek(uid);
        observed.results = results;
        observed.metrics = metrics;
        let run = task.status.as_ref().and_then(|s| s.run_count).unwrap_or(0);
        observed.dispatched_at = self.ledger.dispatched_at(uid, run);
        observed.round_robin = lock(&self.round_robin).clone();
    }

    /// Forgets what was heard for the task `uid` (results, metrics, starts sent): another
    /// replica finishes it.
    pub fn forget_task(&self, uid: &str) {
        self.inbox.forget(uid);
        self.ledger.forget(uid);
    }

    /// Records `phase` as the latest phase seen of a proplet another replica owns; returns
    /// the one seen before.
    pub fn phase_seen(
        &self,
        proplet: &propeller_core::object_name::ObjectName,
        phase: Option<crate::crd::proplet::PropletPhase>,
    ) -> Option<crate::crd::proplet::PropletPhase> {
        let mut seen = lock(&self.foreign_phases);
        match phase {
            Some(phase) => seen.insert(proplet.clone(), phase),
            None => seen.remove(proplet),
        }
    }

    /// Remembers the scheduler's choice once the assignment is written.
    pub fn chose(&self, namespace: &str, proplet: &str) {
        lock(&self.round_robin).record(namespace, proplet);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decision::task::proplet_view;
    use propeller_broker::protocol::{FlUpdate, FlUpdateMessage, TopicSegment};
    use serde_json::json;

    fn segment(text: &str) -> TopicSegment {
        TopicSegment::new(text, "segment").unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn an_fl_update_without_task_id_waits_for_its_participants_task() {
        let state = DriverState::new();
        let event = BrokerEvent {
            client_id: "pi-client".into(),
            domain: None,
            channel: None,
            kind: EventKind::FlUpdate(Box::new(FlUpdateMessage {
                round_id: segment("1"),
                proplet_id: segment("pi-client"),
                envelope: FlUpdate {
                    num_samples: Some(4),
                    ..FlUpdate::default()
                },
            })),
        };
        assert_eq!(
            state.record(&event, Utc::now()),
            Concerns::TasksOf("pi-client".into())
        );
        let proplet = serde_json::from_value(json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
            "metadata": {"name": "pi", "namespace": "default"},
            "spec": {"type": "external", "connectionConfig": {"mqttAddress": "tcp://x:1",
                     "domainId": "d", "channelId": "c", "clientId": "pi-client", "clientKey": "k"}}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let task = |round: &str| -> Task {
            serde_json::from_value(json!({
                "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
                "metadata": {"name": format!("t-{round}"), "namespace": "default", "uid": format!("uid-{round}")},
                "spec": {"name": "t", "imageUrl": "http://x/m.wasm", "env": {"ROUND_ID": round}},
                "status": {"phase": "running", "assignedProplet": "pi"}
            }))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let mut observed = TaskObservations {
            proplets: vec![proplet_view(&proplet, 0)],
            ..TaskObservations::default()
        };
        // Another round's task does not take it.
        state.complete(&task("round-2"), &mut observed);
        assert!(observed.results.is_empty());
        state.complete(&task("round-1"), &mut observed);
        assert_eq!(observed.results.len(), 1);
        assert_eq!(observed.results[0].client_id, "pi-client");
        assert_eq!(observed.results[0].value["num_samples"], 4);
    }

    #[test]
    fn a_routine_heartbeat_waits_in_both_drivers_until_its_refresh_is_due() {
        let state = DriverState::new();
        let proplet = |type_: &str, phase: &str| -> Proplet {
            serde_json::from_value(json!({
                "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
                "metadata": {"name": "pi", "namespace": "default"},
                "spec": {"type": type_, "connectionConfig": {"mqttAddress": "tcp://x:1",
                         "domainId": "d", "channelId": "c", "clientId": "pi-client", "clientKey": "k"},
                         "k8s": {"image": "proplet:1"}},
                "status": {"phase": phase}
            }))
            .unwrap_or_else(|e| panic!("{e}"))
        };
        let now = Utc::now();
        let settings = PropletSettings {
            last_seen_threshold: std::time::Duration::from_secs(30),
            status_flush_interval: std::time::Duration::from_secs(500),
            routine_writes_per_second: 0,
        };
        let heartbeat = BrokerEvent {
            client_id: "pi-client".into(),
            domain: None,
            channel: None,
            kind: EventKind::Heartbeat(propeller_broker::protocol::Heartbeat {
                proplet_id: "pi-client".into(),
                namespace: None,
                metadata: None,
                metrics: None,
            }),
        };
        let waits = |p: &Proplet, at| state.heartbeat_waits(&heartbeat, p, &settings, || 1, at);
        let running = proplet("external", "Running");
        // Never written by this process: the heartbeat is reconciled (and written).
        assert!(!waits(&running, now));
        lock(&state.proplet_writes).insert("default/pi".into(), now);
        assert!(waits(&running, now));
        // Its refresh is due.
        let later = now + chrono::Duration::seconds(501);
        assert!(!waits(&running, later));
        // Not Running yet, or a k8s proplet (its phase comes from its Deployment).
        assert!(!waits(&proplet("external", "Initializing"), now));
        assert!(!waits(&proplet("k8s", "Running"), now));
    }
}
