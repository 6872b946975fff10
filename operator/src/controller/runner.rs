//! The glue between kube-runtime's `Controller` and the shared reconciles, the same for
//! both drivers: the reconcile functions a `Controller` calls (the newest object this process
//! knows, the shared reconcile, its next look as an [`Action`]), the error policy, and how a
//! controller's stream is run to its end.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use kube::runtime::controller::Action;
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::debug;

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;

use super::{retry_policy, wait_until, Cluster, Next, ObjectName, ReconcileError, Retry, Stored};

/// The `Controller`'s answer to a reconcile that wants to look again at `next` (`None`: at
/// the driver's resync, or only on a change when it has none).
fn action<C: Cluster>(next: Next, now: DateTime<Utc>) -> Action {
    match (next, C::RESYNC) {
        (None, None) => Action::await_change(),
        (next, resync) => Action::requeue(wait_until(next, now, resync.unwrap_or(Duration::MAX))),
    }
}

/// Reconciles one Proplet (what a `Controller` calls).
pub async fn reconcile_proplet<C: Cluster>(
    proplet: Arc<Proplet>,
    cluster: Arc<C>,
) -> Result<Action, ReconcileError> {
    let common = cluster.common();
    let Some(_turn) = common.turn(&*proplet).await else {
        let phase = proplet.status.as_ref().map(|s| s.phase);
        let before = common.state.phase_seen(&ObjectName::of(&*proplet), phase);
        super::proplet::wake_after_change_elsewhere(&*cluster, &proplet, before);
        return Ok(Action::await_change());
    };
    let proplet = cluster.newest_proplet((*proplet).clone());
    let now = Utc::now();
    let next = super::proplet::reconcile(&*cluster, proplet, now).await?;
    Ok(action::<C>(next, now))
}

/// Reconciles one Task.
pub async fn reconcile_task<C: Cluster>(
    task: Arc<Task>,
    cluster: Arc<C>,
) -> Result<Action, ReconcileError> {
    let common = cluster.common();
    let Some(_turn) = common.turn(&*task).await else {
        debug!(task = %ObjectName::of(&*task), "owned by another replica");
        super::task::wake_after_change_elsewhere(&*cluster, &task);
        let finished =
            task.status.as_ref().is_some_and(|s| s.phase.is_terminal()) && !task.spec.is_recurring;
        if finished || task.metadata.deletion_timestamp.is_some() {
            // Its owner finished it: what this replica heard for it is not needed, and kept
            // it would be reported as late results if this replica takes the task over.
            common
                .state
                .forget_task(task.metadata.uid.as_deref().unwrap_or_default());
        }
        return Ok(Action::await_change());
    };
    let task = cluster.newest_task(task);
    let now = Utc::now();
    let next = super::task::reconcile(&*cluster, &task, now).await?;
    Ok(action::<C>(next, now))
}

/// Reconciles one PropellerJob.
pub async fn reconcile_propeller_job<C: Cluster>(
    job: Arc<PropellerJob>,
    cluster: Arc<C>,
) -> Result<Action, ReconcileError> {
    let Some(_turn) = cluster.common().turn(&*job).await else {
        return Ok(Action::await_change());
    };
    let now = Utc::now();
    let next = super::jobs::reconcile_propeller_job(&*cluster, &job, now).await?;
    Ok(action::<C>(next, now))
}

/// Reconciles one FederatedJob.
pub async fn reconcile_federated_job<C: Cluster>(
    job: Arc<FederatedJob>,
    cluster: Arc<C>,
) -> Result<Action, ReconcileError> {
    let Some(_turn) = cluster.common().turn(&*job).await else {
        return Ok(Action::await_change());
    };
    let now = Utc::now();
    let next = super::jobs::reconcile_federated_job(&*cluster, &job, now).await?;
    Ok(action::<C>(next, now))
}

/// Reconciles one TrainingRound.
pub async fn reconcile_training_round<C: Cluster>(
    round: Arc<TrainingRound>,
    cluster: Arc<C>,
) -> Result<Action, ReconcileError> {
    let Some(_turn) = cluster.common().turn(&*round).await else {
        return Ok(Action::await_change());
    };
    let now = Utc::now();
    let next = super::jobs::reconcile_training_round(&*cluster, &round, now).await?;
    Ok(action::<C>(next, now))
}

/// The shared [`retry_policy`] as kube-runtime's error policy.
pub fn error_policy<K: Stored, C: Cluster>(
    object: Arc<K>,
    error: &ReconcileError,
    _: Arc<C>,
) -> Action {
    let refusal = error.refusal::<C>();
    match retry_policy(&K::kind(&()), &ObjectName::of(&*object), error, refusal) {
        Retry::Reread => Action::requeue(C::CONFLICT_REREAD),
        Retry::Never => Action::await_change(),
        Retry::After(wait) => Action::requeue(wait),
    }
}

/// Runs a controller's stream to its end. Failed reconciles were already logged and retried
/// by the error policy; what reaches here (watch errors, a wake for an object deleted
/// meanwhile) is logged at debug.
pub async fn drive<T, E: std::fmt::Display>(
    stream: impl futures::Stream<Item = Result<T, E>>,
    controller: &'static str,
) {
    stream
        .for_each(|r| async move {
            if let Err(e) = r {
                debug!(%e, controller, "controller stream");
            }
        })
        .await;
}

/// A channel's receiving end as a stream (for `Controller::reconcile_on`).
pub fn stream_of<T: Send + 'static>(
    rx: UnboundedReceiver<T>,
) -> impl futures::Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}
