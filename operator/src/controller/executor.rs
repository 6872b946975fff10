//! The Task executor, shared by both drivers: applies a [`TaskPlan`] through the driver's
//! [`Backend`](super::Backend) (kube-rs or the embedded store), its Jobs and the broker.
//!
//! Order matters for idempotent dispatch: the assignment is written (conditionally on the
//! resourceVersion) before any start is published, and a start is published at most once per
//! run in this process (the [`DispatchLedger`]).

use std::future::Future;

use propeller_broker::protocol::{Channel, TopicError};
use propeller_broker::server::{BrokerError, Publisher};
use serde_json::Value;

use crate::crd::task::{Task, TASK_FINALIZER};
use crate::decision::task::{FinalizerChange, JobOutcome, TaskPlan};
use crate::inbox::{DispatchLedger, LiveSessions, TaskInbox};

use super::{BackendError, Cluster};

/// Running a task as a Kubernetes Job: a capability of the API-server backend only.
pub trait JobRunner: Sync {
    /// Creates the ConfigMap and Job that run `task` on a `k8s` proplet.
    fn create_task_job(&self, task: &Task)
        -> impl Future<Output = Result<(), BackendError>> + Send;

    /// How the Job running `task` is doing (`None`: there is no such Job).
    fn observe_task_job(
        &self,
        task: &Task,
    ) -> impl Future<Output = Result<Option<JobOutcome>, BackendError>> + Send;
}

/// The Job runner of a backend without Jobs: it has no values, so it never runs one.
pub enum NoJobs {}

impl JobRunner for NoJobs {
    async fn create_task_job(&self, _: &Task) -> Result<(), BackendError> {
        match *self {}
    }

    async fn observe_task_job(&self, _: &Task) -> Result<Option<JobOutcome>, BackendError> {
        match *self {}
    }
}

/// Why applying a Task plan stopped part-way (the next reconcile plans again from there).
#[derive(Debug, thiserror::Error)]
pub enum TaskApplyError {
    /// The backend refused a write or could not be reached.
    #[error("{0}")]
    Backend(BackendError),
    /// The broker could not take a command.
    #[error("broker: {0}")]
    Broker(#[from] BrokerError),
    /// A proplet's domain or channel cannot form a topic.
    #[error("topic: {0}")]
    Topic(#[from] TopicError),
    /// The plan runs the task as a Job and the backend has none.
    #[error("task {0} was assigned to a k8s proplet, whose tasks run as Jobs: only `propeller run` on Kubernetes has those")]
    NoJobs(String),
}

/// The process-wide parts the executor uses besides the backend.
pub struct TaskEffects<'a> {
    /// Publishes starts and stops.
    pub publisher: &'a Publisher,
    /// Starts already published by this process.
    pub ledger: &'a DispatchLedger,
    /// Results and metrics waiting to be written.
    pub inbox: &'a TaskInbox,
    /// Devices listening for starts.
    pub sessions: &'a LiveSessions,
}

/// How far a plan's dispatch got.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum Dispatch {
    /// Everything in the plan was applied.
    Done,
    /// The starts were held back because this device has not been heard from since it (or
    /// this process) last went away; the task stays `scheduled`. Reconcile again shortly.
    WaitingFor(String),
}

fn json<T: serde::Serialize>(value: &T) -> Value {
    serde_json::to_value(value).unwrap_or(Value::Null)
}

/// Applies `plan` to `task` through `cluster`: finalizer, status, Job or starts, stops, and
/// finally the finalizer's removal. Each write is conditional on the version the previous
/// one left.
pub async fn apply_task<C: Cluster>(
    cluster: &C,
    task: &Task,
    plan: &TaskPlan,
) -> Result<Dispatch, TaskApplyError> {
    let fx = cluster.common().effects();
    let uid = task.metadata.uid.as_deref().unwrap_or_default();
    // The name and the version the next write is conditional on.
    let mut meta = task.metadata.clone();
    let mut finalizers = meta.finalizers.clone().unwrap_or_default();
    let mut current = task.status.clone().unwrap_or_default();

    let adds_finalizer = plan.finalizer == Some(FinalizerChange::Add);
    if adds_finalizer {
        finalizers.push(TASK_FINALIZER.to_owned());
        if plan.status.is_none() {
            meta.resource_version = cluster
                .set_finalizers::<Task>(&meta, &finalizers)
                .await
                .map_err(TaskApplyError::Backend)?;
        }
    }
    if let Some(status) = &plan.status {
        let (old, new) = (json(&current), json(status));
        meta.resource_version = if adds_finalizer {
            cluster
                .set_finalizers_and_status::<Task>(&meta, &finalizers, &old, &new)
                .await
        } else {
            cluster.write_status::<Task>(&meta, &old, &new).await
        }
        .map_err(TaskApplyError::Backend)?;
        if status.phase.is_terminal() && !current.phase.is_terminal() {
            let ran = status
                .started_at
                .zip(status.finished_at)
                .map(|(start, end)| (end - start).as_seconds_f64());
            cluster
                .common()
                .metrics
                .task_finished(status.phase.as_str(), ran);
        }
        current = status.clone();
        let metrics = plan
            .consumed_metrics
            .then_some(current.latest_metrics.as_ref())
            .flatten();
        fx.inbox.consume(uid, plan.consumed_results, metrics);
    }
    if plan.create_job {
        let jobs = cluster
            .jobs()
            .ok_or_else(|| TaskApplyError::NoJobs(meta.name.clone().unwrap_or_default()))?;
        jobs.create_task_job(task)
            .await
            .map_err(TaskApplyError::Backend)?;
    }
    if !plan.starts.is_empty() {
        let run = current.run_count.unwrap_or(0);
        if plan.repeat_start || !fx.ledger.contains(uid, run) {
            let absent = plan
                .starts
                .iter()
                .filter_map(|s| s.request.proplet_id.as_deref())
                .find(|client| !fx.sessions.contains(client));
            if let Some(client) = absent {
                return Ok(Dispatch::WaitingFor(client.to_owned()));
            }
            for start in &plan.starts {
                let channel = Channel::new(start.domain.clone(), start.channel.clone())?;
                fx.publisher.start(&channel, &start.request).await?;
            }
            let clients = plan
                .starts
                .iter()
                .filter_map(|s| s.request.proplet_id.clone())
                .collect();
            fx.ledger.record(uid, run, chrono::Utc::now(), clients);
        }
    }
    for stop in &plan.stops {
        let channel = Channel::new(stop.domain.clone(), stop.channel.clone())?;
        fx.publisher.stop(&channel, &stop.request).await?;
    }
    if plan.finalizer == Some(FinalizerChange::Remove) {
        finalizers.retain(|f| f != TASK_FINALIZER);
        cluster
            .set_finalizers::<Task>(&meta, &finalizers)
            .await
            .map_err(TaskApplyError::Backend)?;
        fx.ledger.forget(uid);
        fx.inbox.forget(uid);
    }
    if plan.delete {
        cluster
            .delete::<Task>(&meta)
            .await
            .map_err(TaskApplyError::Backend)?;
        tracing::info!(
            task = meta.name.as_deref().unwrap_or_default(),
            "deleted: its ttlSecondsAfterFinished passed"
        );
        fx.ledger.forget(uid);
        fx.inbox.forget(uid);
    }
    Ok(Dispatch::Done)
}
