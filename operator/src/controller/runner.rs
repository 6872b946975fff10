//! The glue between kube-runtime's `Controller` and the shared reconciles, the same for
//! both drivers: the reconcile functions a `Controller` calls (the newest object this process
//! knows, the shared reconcile, its next look as an [`Action`]), the error policy, and how a
//! controller's stream is run to its end.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use kube::runtime::controller::Action;
use tracing::debug;

use super::kinds::Reconciled;
use super::{retry_policy, wait_until, Cluster, Next, ObjectName, ReconcileError, Retry, Stored};

/// The `Controller`'s answer to a reconcile that wants to look again at `next` (`None`: at
/// the driver's resync, or only on a change when it has none).
fn action<C: Cluster>(next: Next, now: DateTime<Utc>) -> Action {
    match (next, C::RESYNC) {
        (None, None) => Action::await_change(),
        (next, resync) => Action::requeue(wait_until(next, now, resync.unwrap_or(Duration::MAX))),
    }
}

/// Reconciles one object of kind `K` (what a `Controller` calls): when this replica's turn
/// comes, through the kind's reconcile; when another replica owns it, only what its change
/// wakes here ([`Reconciled::changed_elsewhere`]).
pub async fn reconcile<K: Reconciled, C: Cluster>(
    object: Arc<K>,
    cluster: Arc<C>,
) -> Result<Action, ReconcileError> {
    let Some(_turn) = cluster.common().turn(&*object).await else {
        debug!(kind = %K::kind(&()), object = %ObjectName::of(&*object), "owned by another replica");
        K::changed_elsewhere(&*cluster, &object);
        return Ok(Action::await_change());
    };
    let now = Utc::now();
    let next = K::reconcile(&*cluster, object, now).await?;
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
    controller: &str,
) {
    stream
        .for_each(|r| async move {
            if let Err(e) = r {
                debug!(%e, controller, "controller stream");
            }
        })
        .await;
}
