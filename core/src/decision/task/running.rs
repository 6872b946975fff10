//! Planning a scheduled or running Task: its device's report, results, time limits, stops,
//! and a start sent again after a restart.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

use crate::crd::common::find_condition;
use crate::crd::proplet::PropletType;
use crate::crd::task::{Task, TaskPhase, TaskStatus};
use crate::decision::conditions::{from_k8s_time, set_condition, DesiredCondition};
use crate::decision::recurrence::rerun_at;
use crate::decision::task::commands::{client_of, start_for, stop_for, targets_of, view};
use crate::decision::task::pending::dispatch;
use crate::decision::task_observations::{JobOutcome, TaskObservations};

use super::{
    finish, later, look_again_by, runs_as_job, Note, TaskPlan, TaskSettings, SCHEDULED, STARTED,
};

/// A scheduled task: dispatch it, or, once this process has dispatched it, treat it as the
/// running task it is and write `running` only when its result is overdue.
pub(super) fn plan_scheduled(
    task: &Task,
    observed: &TaskObservations,
    settings: &TaskSettings,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    if runs_as_job(observed, desired) {
        if observed.job.is_some() {
            mark_running(task, desired, now);
            plan_running(task, observed, settings, now, desired, plan);
        } else {
            dispatch(task, observed, settings, now, desired, plan);
        }
        return;
    }
    let Some(sent) = observed.dispatched_at else {
        // Not sent by this process: a first reconcile after the assignment was written, a
        // restart, or a start held while its device is not connected. A start sent again
        // reaches an agent that already has the run; it answers with the result it has
        // instead of running the task twice. The time limit counts from the assignment, so
        // a run whose device went away before its start could go out still ends.
        let scheduled = find_condition(&desired.conditions, SCHEDULED)
            .filter(|c| c.status == "True")
            .and_then(|c| from_k8s_time(&c.last_transition_time));
        let limit = time_limit(task, settings);
        let deadline = scheduled.and_then(|at| deadline(at, limit));
        if deadline.is_some_and(|d| now >= d) && !task.spec.daemon {
            let message = format!(
                "no result within the time limit of {}s: the start never went out \
                 (assigned to {}, whose device was not connected)",
                limit.as_secs(),
                targets_of(desired).join(", ")
            );
            time_out(task, observed, desired, now, plan, message);
            return;
        }
        dispatch(task, observed, settings, now, desired, plan);
        if let Some(deadline) = deadline {
            look_again_by(plan, deadline);
        }
        return;
    };
    let mut running = desired.clone();
    mark_running(task, &mut running, sent);
    plan_running(task, observed, settings, now, &mut running, plan);
    let overdue = later(sent, settings.running_write_delay);
    let consumed = plan.consumed_results > 0 || plan.consumed_metrics;
    if running.phase.is_terminal() || consumed || now >= overdue {
        *desired = running;
    } else {
        look_again_by(plan, overdue);
    }
}

/// Marks a dispatched run as running since `since`.
fn mark_running(task: &Task, status: &mut TaskStatus, since: DateTime<Utc>) {
    status.phase = TaskPhase::Running;
    status.started_at = Some(since);
    set_condition(
        &mut status.conditions,
        &DesiredCondition::new(
            STARTED,
            true,
            "StartSent",
            "the start was sent to the proplet",
        ),
        task.metadata.generation,
        since,
    );
}

pub(super) fn plan_running(
    task: &Task,
    observed: &TaskObservations,
    settings: &TaskSettings,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let gen = task.metadata.generation;
    if let Some(m) = &observed.metrics {
        desired.latest_metrics = Some(m.clone());
        plan.consumed_metrics = true;
    }
    if runs_as_job(observed, desired) {
        match &observed.job {
            Some(JobOutcome::Succeeded { result }) => {
                desired.results = Some(Value::String(result.clone().unwrap_or_default()));
                finish(desired, TaskPhase::Completed, None, gen, now);
            }
            Some(JobOutcome::Failed { message }) => {
                finish(desired, TaskPhase::Failed, Some(message.clone()), gen, now);
            }
            Some(JobOutcome::Running) | None => {}
        }
    }
    let targets = targets_of(desired);
    let broadcast = !desired.broadcast_proplets.is_empty();
    let finished_by_job = desired.phase.is_terminal();
    for (i, result) in observed.results.iter().enumerate() {
        plan.consumed_results = i + 1;
        if finished_by_job {
            continue;
        }
        let Some(from) = targets
            .iter()
            .find(|name| client_of(observed, name) == result.client_id)
        else {
            plan.notes.push(Note::warning(
                "ResultIgnored",
                format!(
                    "result from {} ignored: the task was not sent there",
                    result.client_id
                ),
            ));
            continue;
        };
        let error = result.error.clone().filter(|e| !e.is_empty());
        if broadcast {
            let mut per = match desired.results.take() {
                Some(Value::Object(map)) => map,
                _ => Map::new(),
            };
            let mut entry = Map::new();
            entry.insert("results".into(), result.value.clone());
            if let Some(e) = &error {
                entry.insert("error".into(), Value::String(e.clone()));
            }
            per.insert(from.clone(), Value::Object(entry));
            let answered = targets.iter().all(|t| per.contains_key(t));
            let failures: Vec<String> = per
                .iter()
                .filter_map(|(k, v)| {
                    v.get("error")
                        .and_then(Value::as_str)
                        .map(|e| format!("{k}: {e}"))
                })
                .collect();
            desired.results = Some(Value::Object(per));
            if answered {
                if failures.is_empty() {
                    finish(desired, TaskPhase::Completed, None, gen, now);
                } else {
                    finish(
                        desired,
                        TaskPhase::Failed,
                        Some(failures.join("; ")),
                        gen,
                        now,
                    );
                }
                break;
            }
        } else {
            desired.results = Some(result.value.clone());
            match error {
                None => finish(desired, TaskPhase::Completed, None, gen, now),
                Some(e) => finish(desired, TaskPhase::Failed, Some(e), gen, now),
            }
            break;
        }
    }
    if desired.phase.is_terminal() {
        // A success is in the status (phase, result, the Completed condition) and on every
        // watch; only a failure also gets an Event, so a burst of tasks costs the API server
        // no Event per success.
        if desired.phase != TaskPhase::Completed {
            plan.notes.push(Note::warning(
                "Failed",
                desired.error.clone().unwrap_or_default(),
            ));
        }
        if task.spec.is_recurring {
            if let Some(at) = rerun_at(&task.spec, desired, now) {
                desired.next_run = Some(at);
                plan.requeue_at = Some(at);
            }
        }
        return;
    }
    if task.spec.daemon {
        return;
    }
    let limit = time_limit(task, settings);
    let started = desired.started_at.unwrap_or(now);
    let Some(deadline) = deadline(started, limit) else {
        return;
    };
    if now >= deadline {
        let message = format!("no result within the time limit of {}s", limit.as_secs());
        time_out(task, observed, desired, now, plan, message);
    } else {
        plan.requeue_at = Some(deadline);
        resend_after_restart(task, observed, desired, plan);
    }
    resend_when_overdue(task, observed, desired, now, plan);
}

/// The task's time limit: its `timeoutSeconds`, or the operator's default.
fn time_limit(task: &Task, settings: &TaskSettings) -> Duration {
    task.spec
        .timeout_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(settings.default_timeout, Duration::from_secs)
}

/// When a run counted from `since` reaches `limit`. A limit beyond the representable
/// calendar (e.g. `--task-timeout` set absurdly high to mean "never") has no deadline,
/// rather than overflowing the addition.
fn deadline(since: DateTime<Utc>, limit: Duration) -> Option<DateTime<Utc>> {
    chrono::Duration::from_std(limit)
        .ok()
        .and_then(|d| since.checked_add_signed(d))
}

/// Fails a run at its time limit, stopping it wherever it was sent.
fn time_out(
    task: &Task,
    observed: &TaskObservations,
    desired: &mut TaskStatus,
    now: DateTime<Utc>,
    plan: &mut TaskPlan,
    message: String,
) {
    for name in &targets_of(desired) {
        if let Some(target) = view(observed, name) {
            plan.stops.push(stop_for(task, target));
        }
    }
    plan.starts.clear();
    finish(
        desired,
        TaskPhase::Failed,
        Some(message.clone()),
        task.metadata.generation,
        now,
    );
    plan.notes.push(Note::warning("TimedOut", message));
}

/// How long after its start (or its last repeat) a run's result is overdue: the start goes
/// again then.
pub const RESULT_OVERDUE: chrono::TimeDelta = chrono::TimeDelta::seconds(10);

/// A run this process started whose result has not come [`RESULT_OVERDUE`] after the start:
/// the result, or the start, may have been lost on the way (a broker cluster that dropped a
/// delivery to one of its subscribers was seen doing so under load). The start goes again,
/// numbered with the same run, to the proplets that have not answered: an agent that finished
/// the run answers with the result it kept, one still running it ignores the repeat. Daemons
/// answer only when stopped, so they are not asked.
fn resend_when_overdue(
    task: &Task,
    observed: &TaskObservations,
    desired: &TaskStatus,
    now: DateTime<Utc>,
    plan: &mut TaskPlan,
) {
    let Some(sent) = observed.dispatched_at else {
        return;
    };
    if task.spec.daemon || desired.phase.is_terminal() || runs_as_job(observed, desired) {
        return;
    }
    let due = sent + RESULT_OVERDUE;
    if now < due {
        look_again_by(plan, due);
        return;
    }
    ask_again(task, observed, desired, plan);
    plan.repeat_start = !plan.starts.is_empty();
    look_again_by(plan, now + RESULT_OVERDUE);
}

/// A run recorded as `running` that this process never started was started by a process
/// that is gone, and its result may have died with it (received, not yet written). The start
/// goes again, numbered with the same run: our agent answers a run it finished with the
/// result it kept and ignores a start of a run in progress, so nothing runs twice. Broadcast
/// runs ask again only the proplets that have not answered.
pub(super) fn resend_after_restart(
    task: &Task,
    observed: &TaskObservations,
    desired: &TaskStatus,
    plan: &mut TaskPlan,
) {
    if observed.dispatched_at.is_some() || runs_as_job(observed, desired) {
        return;
    }
    ask_again(task, observed, desired, plan);
}

/// Starts of the current run, with its number, to the proplets that have not answered it
/// (a broadcast's answered ones are skipped; `k8s` proplets run Jobs, not starts).
fn ask_again(task: &Task, observed: &TaskObservations, desired: &TaskStatus, plan: &mut TaskPlan) {
    let answered = match &desired.results {
        Some(Value::Object(per)) if !desired.broadcast_proplets.is_empty() => Some(per),
        _ => None,
    };
    for name in targets_of(desired) {
        if answered.is_some_and(|per| per.contains_key(&name)) {
            continue;
        }
        if let Some(target) =
            view(observed, &name).filter(|t| t.candidate.proplet_type != PropletType::K8s)
        {
            plan.starts.push(start_for(task, target, desired));
        }
    }
}
