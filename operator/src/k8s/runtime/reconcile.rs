//! The reconcile functions kube-runtime's Controllers call: each reads the newest object this
//! process knows, runs the shared controller (`crate::controller`), and turns its answer into
//! an [`Action`]; and the error policy.

use super::*;
use crate::controller::{self, retry_policy, wait_until, Next, ObjectName, Retry, Stored};

/// How long a conflicting write waits before its object is read again: the watch shows the
/// newer version within a few milliseconds.
const CONFLICT_REREAD: Duration = Duration::from_millis(200);

fn requeue(next: Next, now: chrono::DateTime<Utc>) -> Action {
    Action::requeue(wait_until(next, now, RESYNC))
}

/// Reconciles one Proplet (what the controller calls).
pub async fn reconcile_proplet(
    proplet: Arc<Proplet>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let proplet = ctx.newest(&object_key(&*proplet), (*proplet).clone());
    let now = Utc::now();
    let next = controller::proplet::reconcile(&*ctx, proplet, now).await?;
    Ok(requeue(next, now))
}

/// Reconciles one Task (what the controller calls).
pub async fn reconcile_task(task: Arc<Task>, ctx: Arc<Shared>) -> Result<Action, ReconcileError> {
    let task = ctx.newest_task(task);
    let now = Utc::now();
    let next = controller::task::reconcile(&*ctx, &task, now).await?;
    Ok(requeue(next, now))
}

/// Reconciles one PropellerJob.
pub async fn reconcile_propeller_job(
    job: Arc<PropellerJob>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::jobs::reconcile_propeller_job(&*ctx, &job, now).await?;
    Ok(requeue(next, now))
}

/// Reconciles one FederatedJob.
pub async fn reconcile_federated_job(
    job: Arc<FederatedJob>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::jobs::reconcile_federated_job(&*ctx, &job, now).await?;
    Ok(requeue(next, now))
}

/// Reconciles one TrainingRound.
pub async fn reconcile_training_round(
    round: Arc<TrainingRound>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let now = Utc::now();
    let next = controller::jobs::reconcile_training_round(&*ctx, &round, now).await?;
    Ok(requeue(next, now))
}

/// The shared [`retry_policy`] as kube-runtime's error policy.
pub(super) fn error_policy<K: Stored>(
    object: Arc<K>,
    error: &ReconcileError,
    _: Arc<Shared>,
) -> Action {
    match retry_policy(&K::kind(&()), &ObjectName::of(&*object), error) {
        Retry::Reread => Action::requeue(CONFLICT_REREAD),
        Retry::Never => Action::await_change(),
        Retry::After(wait) => Action::requeue(wait),
    }
}
