//! Daemons that move. A daemon whose proplet has been Offline for its
//! `offlineTolerationSeconds` goes back to Pending, to be placed on another proplet that
//! matches; the run it left behind is recorded in `status.displacedRuns` and fenced: the
//! task is no longer assigned there, so its result is refused and its log lines dropped,
//! and it is sent a stop as soon as it is Running again.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::crd::task::{DisplacedRun, Task, TaskStatus};
use crate::decision::task::commands::{stop_for, view};
use crate::decision::task_observations::{proplet_scope, PropletScope, TaskObservations};

use super::{later, look_again_by, reset_for_rerun, waiting, Note, TaskPlan};
use crate::crd::proplet::PropletPhase;

/// How long a daemon's proplet may be Offline before the daemon moves, when the task does
/// not say (a pod's default `tolerationSeconds` for an unreachable node).
pub const DEFAULT_OFFLINE_TOLERATION: Duration = Duration::from_secs(300);
/// How many displaced runs a status lists (the oldest are forgotten).
const DISPLACED_KEPT: usize = 10;
/// How often a task with a displaced run looks at its proplet again, besides being woken
/// when the proplet is Running again (a wake lost to a stale cache costs at most this).
const FENCE_RECHECK: Duration = Duration::from_secs(10);

/// The daemon's toleration of an Offline proplet.
fn toleration(task: &Task) -> Duration {
    task.spec
        .offline_toleration_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(DEFAULT_OFFLINE_TOLERATION, Duration::from_secs)
}

/// For a running daemon on one proplet: once that proplet has been Offline for the
/// toleration (or is gone), the run is left there, fenced, and the task goes back to
/// Pending to be placed again; before that, the plan looks again when the toleration ends.
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
    let Some(name) = desired.assigned_proplet.clone() else {
        return;
    };
    if pinned || !desired.broadcast_proplets.is_empty() {
        return;
    }
    let target = view(observed, &name);
    let since = match target {
        // Deleted: nothing is left to wait for.
        None => now,
        Some(t) => match t.offline_since {
            Some(since) => since,
            None => return,
        },
    };
    let toleration = toleration(task);
    let due = later(since, toleration);
    if now < due {
        look_again_by(plan, due);
        return;
    }
    let run = desired.run_count.unwrap_or(0);
    let message = match target {
        Some(_) => {
            desired.displaced_runs.push(DisplacedRun {
                proplet: name.clone(),
                run,
                displaced_at: now,
            });
            let excess = desired.displaced_runs.len().saturating_sub(DISPLACED_KEPT);
            desired.displaced_runs.drain(..excess);
            format!(
                "proplet {name} has been Offline since {} (toleration {}s): run {run} is \
                 left there, fenced (stopped when it is back), and the daemon is placed again",
                since.to_rfc3339(),
                toleration.as_secs()
            )
        }
        None => format!("proplet {name} is gone: the daemon is placed again"),
    };
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
/// the old there) or on a proplet that is gone.
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
    // Under a named scope every displaced proplet was asked for: one missing is gone.
    let named = matches!(proplet_scope(task), PropletScope::Named(_));
    let assigned = desired.assigned_proplet.clone();
    let mut kept = Vec::with_capacity(desired.displaced_runs.len());
    for displaced in desired.displaced_runs.drain(..) {
        if assigned.as_deref() == Some(displaced.proplet.as_str()) {
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
            None if named => {}
            _ => kept.push(displaced),
        }
    }
    if !kept.is_empty() {
        look_again_by(plan, later(now, FENCE_RECHECK));
    }
    desired.displaced_runs = kept;
}
