//! Daemons that move. A daemon whose proplet has been Offline for its
//! `offlineTolerationSeconds` goes back to Pending, to be placed on another proplet that
//! matches; the run it left behind is recorded in `status.displacedRuns` and fenced: the
//! task is no longer assigned there, so its result is refused and its log lines dropped,
//! and it is sent a stop as soon as it is Running again.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::crd::proplet::PropletPhase;
use crate::crd::task::{DisplacedRun, Task, TaskStatus};
use crate::decision::task::commands::{stop_for, view};
use crate::decision::task_observations::TaskObservations;

use super::{later, look_again_by, reset_for_rerun, waiting, Note, TaskPlan};

/// How long a daemon's proplet may be Offline before the daemon moves, when the task does
/// not say (a pod's default `tolerationSeconds` for an unreachable node).
pub const DEFAULT_OFFLINE_TOLERATION: Duration = Duration::from_secs(300);
/// How many displaced runs a status lists (the oldest are forgotten).
const DISPLACED_KEPT: usize = 10;
/// How often a task with a displaced run looks at its proplet again, besides being woken
/// when the proplet is Running again (a wake lost to a stale cache costs at most this).
const FENCE_RECHECK: Duration = Duration::from_secs(10);
/// How long a displaced run whose proplet never comes back is remembered.
const DISPLACED_FORGOTTEN_AFTER: Duration = Duration::from_secs(24 * 3600);

/// The daemon's toleration of an Offline proplet.
fn toleration(task: &Task) -> Duration {
    task.spec
        .offline_toleration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(DEFAULT_OFFLINE_TOLERATION, Duration::from_secs)
}

/// For a running daemon on one proplet: once that proplet has been Offline for the
/// toleration, the run is left there, fenced, and the task goes back to Pending to be
/// placed again; before that, the plan looks again when the toleration ends. Nothing is
/// decided on a proplet the observations lack: after a restart the caches may not have
/// listed it yet, and a daemon moved then would run twice.
pub(super) fn relocate_if_offline(
    task: &Task,
    observed: &TaskObservations,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let pinned = task
        .spec
        .proplet_selector
        .as_ref()
        .and_then(|s| s.proplet_id.as_deref())
        .is_some_and(|id| !id.is_empty());
    if pinned || !desired.broadcast_proplets.is_empty() {
        return;
    }
    let Some(name) = desired.assigned_proplet.clone() else {
        return;
    };
    let Some(since) = view(observed, &name).and_then(|t| t.offline_since) else {
        return;
    };
    let toleration = toleration(task);
    let due = later(since, toleration);
    if now < due {
        look_again_by(plan, due);
        return;
    }
    let run = desired.run_count.unwrap_or(0);
    desired.displaced_runs.push(DisplacedRun {
        proplet: name.clone(),
        run,
        displaced_at: now,
    });
    let excess = desired.displaced_runs.len().saturating_sub(DISPLACED_KEPT);
    desired.displaced_runs.drain(..excess);
    let message = format!(
        "proplet {name} has been Offline since {} (toleration {}s): run {run} is left \
         there, fenced (stopped when it is back), and the daemon is placed again",
        since.to_rfc3339(),
        toleration.as_secs()
    );
    reset_for_rerun(desired);
    waiting(
        desired,
        "Relocating",
        message.clone(),
        task.metadata.generation,
        now,
    );
    plan.notes.push(Note::warning("Relocated", message));
    look_again_by(plan, now);
}

/// The fence: a stop for each displaced run whose proplet is Running again, which is then
/// forgotten, as is one on the proplet the task is now assigned to (its new run replaces
/// the old there) or one a day old (its proplet never came back; what it reports is refused
/// all the same). A proplet the observations lack is waited for, as an Offline one.
pub(super) fn fence_displaced(
    task: &Task,
    observed: &TaskObservations,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    if desired.displaced_runs.is_empty() {
        return;
    }
    let forgotten_before =
        now - chrono::Duration::from_std(DISPLACED_FORGOTTEN_AFTER).unwrap_or_default();
    let assigned = desired.assigned_proplet.clone();
    let mut kept = Vec::with_capacity(desired.displaced_runs.len());
    for displaced in desired.displaced_runs.drain(..) {
        if assigned.as_deref() == Some(displaced.proplet.as_str())
            || displaced.displaced_at < forgotten_before
        {
            continue;
        }
        match view(observed, &displaced.proplet) {
            Some(target) if target.candidate.phase == PropletPhase::Running => {
                plan.stops.push(stop_for(task, target));
                plan.notes.push(Note::normal(
                    "Fenced",
                    format!(
                        "proplet {} is back: its displaced run {} was sent a stop",
                        displaced.proplet, displaced.run
                    ),
                ));
            }
            _ => kept.push(displaced),
        }
    }
    if !kept.is_empty() {
        look_again_by(plan, later(now, FENCE_RECHECK));
    }
    desired.displaced_runs = kept;
}
