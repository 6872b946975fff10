//! What a driver keeps in memory between reconciles. Both drivers hold one of these, so the
//! MQTT side records device reports the same way whatever stores the objects.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use chrono::{DateTime, Utc};
use propeller_broker::protocol::ResultValue;
use propeller_broker::server::{BrokerEvent, EventKind, Publisher};
use tracing::warn;

use crate::crd::common::MetricsSample;
use crate::crd::task::Task;
use crate::decision::scheduler::RoundRobinState;
use crate::decision::task::{ReportedResult, TaskObservations};
use crate::executor::TaskEffects;
use crate::inbox::{DispatchLedger, Queued, TaskInbox};
use crate::k8s::observations::ObservationStore;

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
    /// The scheduler's rotation.
    pub round_robin: Mutex<RoundRobinState>,
    /// When each Proplet's status was last written (`namespace/name`).
    pub proplet_writes: Mutex<HashMap<String, DateTime<Utc>>>,
}

/// What a broker event concerns, for the driver to trigger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Concerns {
    /// The proplet with this MQTT client id.
    Proplet(String),
    /// The task with this UID.
    Task(String),
    /// Nothing a reconciler handles.
    Nothing,
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl DriverState {
    /// Fresh, empty state.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records what a device reported and says which object should be reconciled. Never
    /// touches the object store or the API server.
    pub fn record(&self, event: &BrokerEvent, now: DateTime<Utc>) -> Concerns {
        match &event.kind {
            EventKind::Heartbeat(_) | EventKind::Discovered(_) | EventKind::Offline(_) => {
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
                        warn!(
                            client = %event.client_id,
                            "FL update without task_id cannot be matched to a task; send it as the task's result"
                        );
                        Concerns::Nothing
                    }
                }
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

    /// Adds what this state knows about `task` to observations built from the caches.
    pub fn complete(&self, task: &Task, observed: &mut TaskObservations) {
        let uid = task.metadata.uid.as_deref().unwrap_or_default();
        let (results, metrics) = self.inbox.peek(uid);
        observed.results = results;
        observed.metrics = metrics;
        let run = task.status.as_ref().and_then(|s| s.run_count).unwrap_or(0);
        observed.dispatched = self.ledger.contains(uid, run);
        observed.round_robin = lock(&self.round_robin).clone();
    }

    /// The executor's effects through `publisher`.
    pub fn effects<'a>(&'a self, publisher: &'a Publisher) -> TaskEffects<'a> {
        TaskEffects {
            publisher,
            ledger: &self.ledger,
            inbox: &self.inbox,
        }
    }

    /// Remembers the scheduler's choice once the assignment is written.
    pub fn chose(&self, namespace: &str, proplet: &str) {
        lock(&self.round_robin).record(namespace, proplet);
    }
}
