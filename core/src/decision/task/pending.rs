//! Planning a pending Task: dependencies, schedule, image, candidates, the choice of
//! proplet(s) and the dispatch.

use chrono::{DateTime, Utc};

use crate::crd::proplet::PropletType;
use crate::crd::task::{RunIf, Task, TaskPhase, TaskStatus};
use crate::decision::conditions::{from_k8s_time, set_condition, DesiredCondition};
use crate::decision::dag::{evaluate, Readiness};
use crate::decision::recurrence::{gate, ScheduleGate};
use crate::decision::scheduler::{
    filter_candidates, select_proplet, CandidateProplet, Schedulable as _,
};
use crate::decision::task::commands::{selector_of, start_for, targets_of, view};
use crate::decision::task_observations::{
    needs_image_resolution, runs_on, ImageObservation, TaskObservations,
};

use super::{
    finish, later, look_again_by, waiting, Note, TaskPlan, TaskSettings, CAPACITY_RETRY,
    NO_CANDIDATE_RETRY, SCHEDULED,
};

pub(super) fn plan_pending(
    task: &Task,
    observed: &TaskObservations,
    settings: &TaskSettings,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let gen = task.metadata.generation;
    let created = desired
        .created_at
        .or(task
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| from_k8s_time(t).unwrap_or(now)))
        .unwrap_or(now);
    if let Some(at) = desired.retry_at.filter(|at| now < *at) {
        waiting(
            desired,
            "BackingOff",
            format!("the last run failed; retrying at {}", at.to_rfc3339()),
            gen,
            now,
        );
        look_again_by(plan, at);
        return;
    }
    let mut following = None;
    match gate(&task.spec, desired, created, now) {
        ScheduleGate::Unscheduled => {}
        ScheduleGate::Invalid(message) => {
            waiting(desired, "InvalidSchedule", message, gen, now);
            return;
        }
        ScheduleGate::Exhausted => {
            waiting(
                desired,
                "ScheduleExhausted",
                "the schedule never fires again".into(),
                gen,
                now,
            );
            return;
        }
        ScheduleGate::Wait { next_run } => {
            desired.next_run = Some(next_run);
            waiting(
                desired,
                "WaitingForSchedule",
                format!("next run at {}", next_run.to_rfc3339()),
                gen,
                now,
            );
            plan.requeue_at = Some(next_run);
            return;
        }
        ScheduleGate::Due { following: f } => following = Some(f),
    }
    if let Some(path) = &observed.cycle {
        waiting(
            desired,
            "CycleDetected",
            format!("dependency cycle: {}", path.join(" -> ")),
            gen,
            now,
        );
        return;
    }
    let run_if = task.spec.run_if.unwrap_or(RunIf::Success);
    match evaluate(&task.spec.depends_on, run_if, |name| {
        observed.dependencies.get(name).copied()
    }) {
        Readiness::Wait {
            missing,
            unfinished,
        } => {
            let mut parts = Vec::new();
            if !missing.is_empty() {
                parts.push(format!("missing: {}", missing.join(", ")));
            }
            if !unfinished.is_empty() {
                parts.push(format!("unfinished: {}", unfinished.join(", ")));
            }
            waiting(
                desired,
                "DependencyPending",
                format!("waiting for dependencies ({})", parts.join("; ")),
                gen,
                now,
            );
            return;
        }
        Readiness::Skip { reason } => {
            finish(desired, TaskPhase::Skipped, Some(reason.clone()), gen, now);
            plan.notes.push(Note::normal("Skipped", reason));
            return;
        }
        Readiness::Ready => {}
    }

    let selector = selector_of(task);
    let namespace = task
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let candidates: Vec<CandidateProplet> = observed
        .proplets
        .iter()
        .filter(|p| runs_on(task, p.candidate.proplet_type))
        .map(|p| p.candidate.clone())
        .collect();
    let chosen: Result<Vec<String>, String> = if task.spec.broadcast {
        filter_candidates(&namespace, &candidates, &selector)
            .map(|c| c.iter().map(|p| p.name.clone()).collect())
            .map_err(|e| e.to_string())
    } else {
        let mut rr = observed.round_robin.clone();
        select_proplet(
            settings.strategy,
            &namespace,
            &candidates,
            &selector,
            &mut rr,
        )
        .map(|p| vec![p.name.clone()])
        .map_err(|e| e.to_string())
    };
    let names = match chosen {
        Ok(names) => names,
        Err(message) => {
            plan.no_candidates = true;
            waiting(desired, "NoCandidates", message, gen, now);
            // A full proplet frees a slot when one of its tasks finishes: look again soon.
            let full = candidates.iter().any(|c| c.full().is_some());
            let retry = if full {
                CAPACITY_RETRY
            } else {
                NO_CANDIDATE_RETRY
            };
            plan.requeue_at = Some(now + retry);
            return;
        }
    };
    let to_device = names.iter().any(|name| {
        view(observed, name).is_some_and(|v| v.candidate.proplet_type == PropletType::External)
    });
    if to_device && needs_image_resolution(task) && desired.image_digest.is_none() {
        let image = task.spec.image_url.as_deref().unwrap_or_default();
        match &observed.image {
            Some(ImageObservation::Resolved { digest }) => {
                desired.image_digest = Some(digest.clone());
            }
            Some(ImageObservation::Failed(message)) => {
                // Counted as a run, so a recurring task's next run resolves afresh.
                desired.run_count = Some(desired.run_count.unwrap_or(0) + 1);
                finish(desired, TaskPhase::Failed, Some(message.clone()), gen, now);
                plan.notes
                    .push(Note::warning("ImageUnavailable", message.clone()));
                return;
            }
            Some(ImageObservation::Resolving) | None => {
                waiting(
                    desired,
                    "ResolvingImage",
                    format!("resolving {image} in its registry"),
                    gen,
                    now,
                );
                plan.resolve_image = true;
                // The outcome triggers a reconcile; this look is a safety net.
                plan.requeue_at = Some(now + NO_CANDIDATE_RETRY);
                return;
            }
        }
    }
    if let Some(f) = following {
        desired.next_run = f;
    }
    desired.phase = TaskPhase::Scheduled;
    desired.run_count = Some(desired.run_count.unwrap_or(0) + 1);
    plan.reserve = names
        .iter()
        .filter(|name| view(observed, name).is_some_and(|v| v.candidate.capacity.is_some()))
        .cloned()
        .collect();
    if task.spec.broadcast {
        desired.assigned_proplet = None;
        desired.broadcast_proplets = names.clone();
    } else {
        desired.assigned_proplet = names.first().cloned();
        plan.chosen = names.first().cloned();
    }
    set_condition(
        &mut desired.conditions,
        &DesiredCondition::new(
            SCHEDULED,
            true,
            "PropletAssigned",
            format!("assigned to {}", names.join(", ")),
        ),
        gen,
        now,
    );
    // No `Scheduled` Event: the condition above says the same, and at one more API call
    // per task the Event was a fifth of a burst's cost to the API server.
    dispatch(task, observed, settings, now, desired, plan);
}

/// Sends the starts (or creates the Job) for a run whose assignment is (about to be)
/// persisted. The `running` status is not written here: the next reconcile writes it once
/// the result is overdue by [`TaskSettings::running_write_delay`], or writes the result
/// instead, so a quick task costs one status write after its assignment, not two.
pub(super) fn dispatch(
    task: &Task,
    observed: &TaskObservations,
    settings: &TaskSettings,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let gen = task.metadata.generation;
    let mut missing = Vec::new();
    for name in targets_of(desired) {
        match view(observed, &name) {
            Some(target) if target.candidate.proplet_type == PropletType::K8s => {
                // Creating the Job is idempotent (it has a fixed name), so it needs no ledger.
                plan.create_job = true;
            }
            Some(target) => {
                plan.starts.push(start_for(task, target, desired));
            }
            None => missing.push(name),
        }
    }
    if !missing.is_empty() {
        // The assigned proplet disappeared between assignment and start: fail rather than
        // choose another, so a start can never reach two proplets. (One that went offline
        // keeps the run: the start waits until its device is heard from again.)
        let why = format!("assigned proplet(s) {} no longer exist", missing.join(", "));
        finish(desired, TaskPhase::Failed, Some(why), gen, now);
        plan.starts.clear();
        plan.create_job = false;
        return;
    }
    if !plan.starts.is_empty() {
        look_again_by(plan, later(now, settings.running_write_delay));
    }
}
