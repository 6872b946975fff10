//! The Proplet controller: the finalizer that lets a deleted Proplet's broker login be
//! revoked, the liveness plan from what its device said, the writes, and what a phase change
//! wakes and records.

use std::time::Instant;

use chrono::{DateTime, Utc};
use tracing::info;

use crate::crd::proplet::{Proplet, PropletPhase};
use crate::crd::task::{Task, TaskPhase};
use crate::decision::proplet::{
    approval_granted, phase_change_note, plan, wakes_occupants, wakes_waiting_tasks,
    PropletObservations,
};
use crate::decision::task::Note;

use super::finalizer::{self, Step};
use super::{count, CacheReads, Cluster, Next, ObjectName, ReconcileError, Signals, Wake};

/// Finalizer that lets the operator revoke a deleted Proplet's broker login.
pub const PROPLET_FINALIZER: &str = "propeller.propeller.absmach.eu/proplet-cleanup";

/// Reconciles `proplet` as read from the driver's cache.
#[tracing::instrument(
    name = "reconcile",
    skip_all,
    fields(object.kind = "Proplet", object.ref = %ObjectName::of(&proplet))
)]
pub async fn reconcile<C: Cluster>(
    cluster: &C,
    proplet: Proplet,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let started = Instant::now();
    let result = reconcile_once(cluster, proplet, now).await;
    count(cluster.common(), "proplet", started, &result);
    result
}

async fn reconcile_once<C: Cluster>(
    cluster: &C,
    proplet: Proplet,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let common = cluster.common();
    let name = ObjectName::of(&proplet);
    let key = name.to_string();
    let proplet = match finalizer::step(cluster, PROPLET_FINALIZER, proplet).await? {
        Step::Apply(proplet) => proplet,
        Step::Cleanup(proplet) => {
            // The credential refresh drops its login (it skips Proplets being deleted).
            common.state.liveness.forget(proplet.client_id());
            crate::state::lock(&common.state.proplet_writes).remove(&key);
            finalizer::release(cluster, PROPLET_FINALIZER, &proplet).await?;
            return Ok(None);
        }
        Step::Gone => return Ok(None),
    };
    let client_id = proplet.client_id();
    let observed = PropletObservations {
        external: common.state.liveness.peek(client_id),
        deployment: cluster.deployment_of(&proplet),
        last_write: crate::state::lock(&common.state.proplet_writes)
            .get(&key)
            .copied(),
        report: common.state.liveness.report(client_id),
        task_count: i64::from(cluster.load_of(&proplet)),
        fleet_size: cluster.fleet_size(),
    };
    let plan = plan(&proplet, &observed, &common.proplet, now);
    if let Some(problem) = &plan.problem {
        let note = Note {
            warning: true,
            reason: "InvalidDeployment",
            message: problem.to_string(),
        };
        cluster.note(&proplet, &note).await;
    }
    cluster.apply_proplet(&proplet, &plan).await?;
    common
        .state
        .liveness
        .watch_silence(client_id, plan.offline_at);
    let Some(status) = &plan.status else {
        return Ok(plan.requeue_at);
    };
    common
        .state
        .liveness
        .clear_written(client_id, &observed.external);
    crate::state::lock(&common.state.proplet_writes).insert(key, now);
    let before = proplet.status.as_ref().map(|s| s.phase);
    if before != Some(status.phase) {
        info!(proplet = %name, phase = %status.phase, "proplet phase");
    }
    let fell_silent = status.phase == PropletPhase::Offline
        && before == Some(PropletPhase::Running)
        && observed.external.offline_at.is_none();
    if let (true, Some(seen)) = (fell_silent, status.last_seen) {
        let threshold = chrono::Duration::from_std(common.proplet.last_seen_threshold)
            .unwrap_or(chrono::Duration::MAX);
        if let Some(deadline) = seen.checked_add_signed(threshold) {
            let late = |at: DateTime<Utc>| (at - deadline).as_seconds_f64();
            common.metrics.observe_offline(late(now), late(Utc::now()));
        }
    }
    if wakes_waiting_tasks(before, status.phase)
        || approval_granted(proplet.status.as_ref(), status)
    {
        wake_waiting_tasks(cluster, &name);
    }
    if wakes_occupants(before, status.phase) {
        wake_occupants(cluster, &proplet);
    }
    // Written first, recorded after: 1,000 proplets going Offline together are not each held
    // for an Event.
    if let Some(note) = phase_change_note(before, status.phase) {
        cluster.note_later(&proplet, note);
    }
    Ok(plan.requeue_at)
}

/// Wakes the pending tasks of the proplet's namespace (a proplet they may run on became
/// Running), and the tasks that left a displaced run on it (the fence stops it).
fn wake_waiting_tasks<C: CacheReads + Signals>(cluster: &C, proplet: &ObjectName) {
    for task in cluster.tasks_in(&proplet.namespace) {
        let woken = task.status.as_ref().is_none_or(|s| {
            s.phase == TaskPhase::Pending
                || s.displaced_runs.iter().any(|d| d.proplet == proplet.name)
        });
        if woken {
            cluster.wake(Wake::of::<Task>(ObjectName::of(task.as_ref())));
        }
    }
}

/// Wakes the tasks occupying `proplet` (a daemon's toleration of its Offline proplet starts).
fn wake_occupants<C: CacheReads + Signals>(cluster: &C, proplet: &Proplet) {
    let namespace = ObjectName::of(proplet).namespace;
    for task in cluster.tasks_on(proplet) {
        cluster.wake(Wake::of::<Task>(ObjectName::new(&namespace, &task)));
    }
}

/// What a change of `proplet` written by another replica wakes here: the pending tasks,
/// when it is newly Running (the replica that wrote it wakes only the tasks it owns).
pub fn wake_after_change_elsewhere<C: CacheReads + Signals>(
    cluster: &C,
    proplet: &Proplet,
    before: Option<PropletPhase>,
) {
    let phase = proplet.status.as_ref().map(|s| s.phase);
    if let Some(phase) = phase {
        if wakes_waiting_tasks(before, phase) {
            wake_waiting_tasks(cluster, &ObjectName::of(proplet));
        }
        if wakes_occupants(before, phase) {
            wake_occupants(cluster, proplet);
        }
    }
}
