//! The Task executor, shared by both drivers: applies a [`TaskPlan`] through an
//! [`ObjectWriter`] (kube-rs or the embedded store) and the broker.
//!
//! Order matters for idempotent dispatch: the assignment is written (conditionally on the
//! resourceVersion) before any start is published, and a start is published at most once per
//! run in this process (the [`DispatchLedger`]).

use std::future::Future;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use propeller_broker::protocol::{Channel, TopicError};
use propeller_broker::server::{BrokerError, Publisher};
use serde_json::Value;

use crate::crd::task::{Task, TASK_FINALIZER};
use crate::decision::task::{FinalizerChange, JobOutcome, TaskPlan};
use crate::inbox::{DispatchLedger, LiveSessions, TaskInbox};

/// An error of the object backend (API server or embedded store).
pub type BackendError = Box<dyn std::error::Error + Send + Sync>;

/// The writes an executor needs from a backend, each conditional on `version` when given
/// and returning the object's new resourceVersion.
pub trait ObjectWriter: Sync {
    /// Sets `metadata.finalizers` to exactly `finalizers`.
    fn set_finalizers(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        version: Option<&str>,
    ) -> impl Future<Output = Result<Option<String>, BackendError>> + Send;

    /// Replaces the status `old` (as written) with `new`.
    fn write_status(
        &self,
        meta: &ObjectMeta,
        old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> impl Future<Output = Result<Option<String>, BackendError>> + Send;

    /// Sets the finalizers, then replaces the status, as one step where the backend can
    /// (the embedded store writes both in one transaction; the API server needs two calls).
    fn set_finalizers_and_status(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> impl Future<Output = Result<Option<String>, BackendError>> + Send {
        async move {
            let version = self.set_finalizers(meta, finalizers, version).await?;
            self.write_status(meta, old, new, version.as_deref()).await
        }
    }

    /// Runs `k8s` proplets' tasks as Jobs, for a backend that can.
    type Jobs: JobRunner;

    /// The backend's Job runner; `None` where there are no Jobs (the embedded store).
    fn jobs(&self) -> Option<&Self::Jobs>;
}

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

/// Applies `plan` to `task`: finalizer, status, Job or starts, stops, and finally the
/// finalizer's removal.
pub async fn apply_task<W: ObjectWriter>(
    writer: &W,
    task: &Task,
    plan: &TaskPlan,
    fx: &TaskEffects<'_>,
) -> Result<Dispatch, TaskApplyError> {
    let meta = &task.metadata;
    let uid = meta.uid.as_deref().unwrap_or_default();
    let mut version = meta.resource_version.clone();
    let mut finalizers = meta.finalizers.clone().unwrap_or_default();
    let mut current = task.status.clone().unwrap_or_default();

    let adds_finalizer = plan.finalizer == Some(FinalizerChange::Add);
    if adds_finalizer {
        finalizers.push(TASK_FINALIZER.to_owned());
        if plan.status.is_none() {
            version = writer
                .set_finalizers(meta, &finalizers, version.as_deref())
                .await
                .map_err(TaskApplyError::Backend)?;
        }
    }
    if let Some(status) = &plan.status {
        let (old, new) = (json(&current), json(status));
        version = if adds_finalizer {
            writer
                .set_finalizers_and_status(meta, &finalizers, &old, &new, version.as_deref())
                .await
        } else {
            writer
                .write_status(meta, &old, &new, version.as_deref())
                .await
        }
        .map_err(TaskApplyError::Backend)?;
        current = status.clone();
        let metrics = plan
            .consumed_metrics
            .then_some(current.latest_metrics.as_ref())
            .flatten();
        fx.inbox.consume(uid, plan.consumed_results, metrics);
    }
    if plan.create_job {
        let jobs = writer
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
        writer
            .set_finalizers(meta, &finalizers, version.as_deref())
            .await
            .map_err(TaskApplyError::Backend)?;
        fx.ledger.forget(uid);
        fx.inbox.forget(uid);
    }
    Ok(Dispatch::Done)
}
