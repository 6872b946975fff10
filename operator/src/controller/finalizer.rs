//! The finalizer step, in kube-runtime's `finalizer` shape: an object being deleted gets its
//! cleanup and then loses the finalizer; any other object gets the finalizer first and then
//! its reconcile. Tasks are the exception: their finalizer is part of the Task plan, so it is
//! written in the same transaction as their first status where the backend can.

use super::{Cluster, ReconcileError, Stored};

/// What the reconcile does with the object after the finalizer step.
#[derive(Debug)]
pub enum Step<K> {
    /// The object is live and holds the finalizer (at the version the step left it).
    Apply(K),
    /// The object is being deleted: clean up, then [`release`] it.
    Cleanup(K),
    /// The object is being deleted and holds no finalizer of ours: nothing to do.
    Gone,
}

/// Adds `finalizer` to a live `object` (conditionally on the version it was read at), or
/// says that one being deleted needs its cleanup.
pub async fn step<C: Cluster, K: Stored>(
    cluster: &C,
    finalizer: &str,
    object: K,
) -> Result<Step<K>, ReconcileError> {
    let mut finalizers = object.meta().finalizers.clone().unwrap_or_default();
    let holds = finalizers.iter().any(|f| f == finalizer);
    if object.meta().deletion_timestamp.is_some() {
        return Ok(if holds {
            Step::Cleanup(object)
        } else {
            Step::Gone
        });
    }
    if holds {
        return Ok(Step::Apply(object));
    }
    finalizers.push(finalizer.to_owned());
    let version = cluster
        .set_finalizers::<K>(object.meta(), &finalizers)
        .await?;
    let mut object = object;
    object.meta_mut().finalizers = Some(finalizers);
    object.meta_mut().resource_version = version;
    Ok(Step::Apply(object))
}

/// Removes `finalizer` from `object` after its cleanup, so the deletion can finish.
pub async fn release<C: Cluster, K: Stored>(
    cluster: &C,
    finalizer: &str,
    object: &K,
) -> Result<(), ReconcileError> {
    let mut finalizers = object.meta().finalizers.clone().unwrap_or_default();
    finalizers.retain(|f| f != finalizer);
    cluster
        .set_finalizers::<K>(object.meta(), &finalizers)
        .await?;
    Ok(())
}
