//! The Task executor: applies a [`TaskPlan`] through the Kubernetes API and the broker.
//!
//! Order matters for idempotent dispatch: the assignment is written (conditionally on the
//! resourceVersion) before any start is published, and a start is published at most once per
//! run in this process (the [`DispatchLedger`]).

use kube::api::{Api, Patch, PatchParams};
use propeller_broker::protocol::{Channel, TopicError};
use propeller_broker::server::{BrokerError, Publisher};

use crate::crd::task::{Task, TaskStatus, TASK_FINALIZER};
use crate::decision::task::{FinalizerChange, TaskPlan};
use crate::inbox::{DispatchLedger, TaskInbox};

use super::patch::{finalizers_patch, status_patch};

/// Why applying a Task plan stopped part-way (the next reconcile plans again from there).
#[derive(Debug, thiserror::Error)]
pub enum TaskApplyError {
    /// The API server refused or could not be reached.
    #[error("Kubernetes API: {0}")]
    Api(#[from] kube::Error),
    /// The broker could not take a command.
    #[error("broker: {0}")]
    Broker(#[from] BrokerError),
    /// A proplet's domain or channel cannot form a topic.
    #[error("topic: {0}")]
    Topic(#[from] TopicError),
}

/// The process-wide parts the executor uses besides the API client.
pub struct TaskEffects<'a> {
    /// Publishes starts and stops.
    pub publisher: &'a Publisher,
    /// Starts already published by this process.
    pub ledger: &'a DispatchLedger,
    /// Results and metrics waiting to be written.
    pub inbox: &'a TaskInbox,
}

/// Applies `plan` to `task`: finalizer, status, starts, status after dispatch, stops, and
/// finally the finalizer's removal.
pub async fn apply(
    client: &kube::Client,
    task: &Task,
    plan: &TaskPlan,
    fx: &TaskEffects<'_>,
) -> Result<(), TaskApplyError> {
    let namespace = task.metadata.namespace.as_deref().unwrap_or("default");
    let name = task.metadata.name.as_deref().unwrap_or_default();
    let uid = task.metadata.uid.as_deref().unwrap_or_default();
    let api: Api<Task> = Api::namespaced(client.clone(), namespace);
    let mut version = task.metadata.resource_version.clone();
    let mut finalizers = task.metadata.finalizers.clone().unwrap_or_default();
    let mut current: TaskStatus = task.status.clone().unwrap_or_default();

    if plan.finalizer == Some(FinalizerChange::Add) {
        finalizers.push(TASK_FINALIZER.to_owned());
        let updated = api
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(finalizers_patch(&finalizers, version.as_deref())),
            )
            .await?;
        version = updated.metadata.resource_version;
    }
    if let Some(status) = &plan.status {
        let updated = api
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(status_patch(&current, status, version.as_deref())),
            )
            .await?;
        version = updated.metadata.resource_version;
        current = status.clone();
        let metrics = plan
            .consumed_metrics
            .then_some(current.latest_metrics.as_ref())
            .flatten();
        fx.inbox.consume(uid, plan.consumed_results, metrics);
    }
    if plan.create_job {
        super::task_job::create(client, task).await?;
    }
    if !plan.starts.is_empty() {
        let run = current.run_count.unwrap_or(0);
        if !fx.ledger.contains(uid, run) {
            for start in &plan.starts {
                let channel = Channel::new(start.domain.clone(), start.channel.clone())?;
                fx.publisher.start(&channel, &start.request).await?;
            }
            fx.ledger.record(uid, run);
        }
    }
    if let Some(after) = &plan.after_dispatch {
        let updated = api
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(status_patch(&current, after, version.as_deref())),
            )
            .await?;
        version = updated.metadata.resource_version;
    }
    for stop in &plan.stops {
        let channel = Channel::new(stop.domain.clone(), stop.channel.clone())?;
        fx.publisher.stop(&channel, &stop.request).await?;
    }
    if plan.finalizer == Some(FinalizerChange::Remove) {
        finalizers.retain(|f| f != TASK_FINALIZER);
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(finalizers_patch(&finalizers, version.as_deref())),
        )
        .await?;
        fx.ledger.forget(uid);
        fx.inbox.forget(uid);
    }
    Ok(())
}
