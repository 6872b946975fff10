//! The Task reconcile step: from (task, observations, now) to a plan of status writes, MQTT
//! commands and a requeue time. Both drivers execute these plans, so dispatch, result and
//! timeout rules live here once.
//!
//! Dispatch is split so a retried reconcile can never start a task twice or on a second
//! proplet: the plan first persists the choice (`scheduled` with `assignedProplet`), the
//! executor publishes only after that write succeeded, and a task already `scheduled` is only
//! ever sent to the proplet its status names. The executor's dispatch ledger stops a repeat
//! publish within one process; after a restart a repeated start reaches the same proplet,
//! which ignores a start for a task it already has.

use std::time::Duration;

use chrono::{DateTime, Utc};
use propeller_broker::protocol::{StartRequest, StopRequest};

use super::conditions::{is_true, remove_condition, set_condition, DesiredCondition};
use super::recurrence::rerun_at;
use super::scheduler::Strategy;
use crate::crd::proplet::PropletType;
use crate::crd::task::{
    FailedAttempt, Task, TaskPhase, TaskStatus, RERUN_ANNOTATION, TASK_FINALIZER,
};

mod commands;
mod pending;
mod relocation;
mod retention;
mod running;
pub use relocation::DEFAULT_OFFLINE_TOLERATION;
pub use running::RESULT_OVERDUE;

pub use commands::{selector_of, start_request, start_request_pinned};

pub use super::task_observations::{
    could_take, needs_image_resolution, observe_indexed, occupied, occupies, proplet_scope,
    proplet_view, runs_on, ImageObservation, JobOutcome, PropletScope, PropletView, ReportedResult,
    TaskObservations,
};
use crate::decision::task::commands::{stop_for, targets_of, view};
use crate::decision::task::pending::plan_pending;
use crate::decision::task::relocation::{fence_displaced, relocate_if_offline};
use crate::decision::task::retention::delete_if_expired;
use crate::decision::task::running::{plan_running, plan_scheduled};

/// Condition: a proplet has been assigned.
pub const SCHEDULED: &str = "Scheduled";
/// Condition: the start was sent.
pub const STARTED: &str = "Started";
/// Condition: the task finished successfully.
pub const COMPLETED: &str = "Completed";
/// Condition type: the task is held by `spec.suspend` (its own or its job's).
pub const SUSPENDED: &str = "Suspended";

/// How often a task that waits for a proplet looks again even without an event.
pub const NO_CANDIDATE_RETRY: Duration = Duration::from_secs(30);
/// How often a task that waits for room on a proplet at its capacity looks again.
pub const CAPACITY_RETRY: Duration = Duration::from_secs(1);

/// Operator settings the Task plan depends on.
#[derive(Debug, Clone, Copy)]
pub struct TaskSettings {
    /// Scoring strategy of the scheduler.
    pub strategy: Strategy,
    /// Time limit for tasks without `spec.timeoutSeconds` (daemons are exempt).
    pub default_timeout: Duration,
    /// How long after its start a task's result may come before `running` is written: a
    /// result within it makes `completed` the only status write after the assignment.
    pub running_write_delay: Duration,
    /// When a live task gets the Task finalizer.
    pub finalizer: FinalizerTiming,
}

/// When a live task gets the Task finalizer, which holds its deletion until its run is
/// stopped on its devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FinalizerTiming {
    /// At its first reconcile. For a backend that writes it in the same transaction as the
    /// first status (the embedded store), where it costs nothing.
    #[default]
    FirstReconcile,
    /// Only once the task is written `running` (its result is overdue by
    /// [`TaskSettings::running_write_delay`]), and to daemons. For the API server, where it
    /// is a request of its own: a quick task never gets one, and the driver stops a run
    /// whose task was deleted without it when its watch shows the deletion
    /// ([`stops_for_deleted`]).
    WhileRunning,
}

impl FinalizerTiming {
    /// Whether a live task whose status is (about to be) `status` should hold the finalizer.
    fn wanted(self, task: &Task, status: &TaskStatus) -> bool {
        match self {
            Self::FirstReconcile => true,
            Self::WhileRunning => {
                status.phase == TaskPhase::Running
                    || (task.spec.daemon
                        && matches!(
                            status.phase,
                            TaskPhase::Scheduled | TaskPhase::Running | TaskPhase::Completed
                        ))
            }
        }
    }
}

/// Where one start goes.
#[derive(Debug, Clone, PartialEq)]
pub struct StartCommand {
    /// Proplet resource name.
    pub proplet: String,
    /// Topic domain.
    pub domain: String,
    /// Topic channel.
    pub channel: String,
    /// The message.
    pub request: StartRequest,
}

/// Where one stop goes.
#[derive(Debug, Clone, PartialEq)]
pub struct StopCommand {
    /// Topic domain.
    pub domain: String,
    /// Topic channel.
    pub channel: String,
    /// The message.
    pub request: StopRequest,
}

/// Finalizer bookkeeping the executor must do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinalizerChange {
    /// Nothing.
    Keep,
    /// Add [`TASK_FINALIZER`] before anything else.
    Add,
    /// Remove it: the task may go.
    Remove,
}

/// A Kubernetes Event worth emitting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Note {
    /// Warning rather than Normal.
    pub warning: bool,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human message.
    pub message: String,
}

impl Note {
    /// A Normal Event.
    pub fn normal(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warning: false,
            reason,
            message: message.into(),
        }
    }

    /// A Warning Event.
    pub fn warning(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warning: true,
            reason,
            message: message.into(),
        }
    }
}

/// What to do for one task now. The executor applies, in order: finalizer, `status`,
/// `starts` (only if `status` was written or is `None`), `stops`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskPlan {
    /// Finalizer change.
    pub finalizer: Option<FinalizerChange>,
    /// Status to write first.
    pub status: Option<TaskStatus>,
    /// Starts to publish once `status` is persisted.
    pub starts: Vec<StartCommand>,
    /// The starts repeat a run this process already started (its result is overdue), so
    /// they go out although the run is in the dispatch ledger.
    pub repeat_start: bool,
    /// Create the task's ConfigMap and Job (a `k8s` proplet) once `status` is persisted,
    /// or bring an existing Job's `suspend` in line with the task's.
    pub create_job: bool,
    /// Stops to publish.
    pub stops: Vec<StopCommand>,
    /// How many of the observed results the written status includes (to forget them).
    pub consumed_results: usize,
    /// The observed metrics are included in the written status.
    pub consumed_metrics: bool,
    /// Look again at this time even without an event.
    pub requeue_at: Option<DateTime<Utc>>,
    /// The proplet a new dispatch chose (the round-robin memory should record it).
    pub chosen: Option<String>,
    /// Start resolving the OCI `imageUrl` for the next run (its outcome triggers a reconcile).
    pub resolve_image: bool,
    /// The task was to be scheduled and none of the observed proplets could take it.
    pub no_candidates: bool,
    /// Proplets with a `spec.capacity` the assignment needs a slot of: the driver takes
    /// each (see [`super::capacity`]) before it writes the assignment, and holds the plan
    /// back if one is full.
    pub reserve: Vec<String>,
    /// Events for users.
    pub notes: Vec<Note>,
    /// Delete the task (its `ttlSecondsAfterFinished` has passed), conditionally on the
    /// version the plan was made from.
    pub delete: bool,
}

fn finish(
    status: &mut TaskStatus,
    phase: TaskPhase,
    error: Option<String>,
    gen: Option<i64>,
    now: DateTime<Utc>,
) {
    status.phase = phase;
    status.finished_at = Some(now);
    status.error = error;
    let (ok, reason, message) = match phase {
        TaskPhase::Completed => (
            true,
            "Succeeded",
            "the task finished successfully".to_owned(),
        ),
        TaskPhase::Skipped => (false, "Skipped", status.error.clone().unwrap_or_default()),
        TaskPhase::Interrupted => (false, "Interrupted", "the task was stopped".to_owned()),
        _ => (false, "Failed", status.error.clone().unwrap_or_default()),
    };
    set_condition(
        &mut status.conditions,
        &DesiredCondition::new(COMPLETED, ok, reason, message),
        gen,
        now,
    );
}

/// Back to pending for another run: what the last run left is cleared, the history of runs
/// stays in `runCount`.
fn reset_for_rerun(status: &mut TaskStatus) {
    status.phase = TaskPhase::Pending;
    status.assigned_proplet = None;
    status.broadcast_proplets.clear();
    status.started_at = None;
    status.finished_at = None;
    status.results = None;
    status.error = None;
    status.latest_metrics = None;
    status.image_digest = None;
    remove_condition(&mut status.conditions, SCHEDULED);
    remove_condition(&mut status.conditions, STARTED);
    remove_condition(&mut status.conditions, COMPLETED);
}

/// Reasons a task waits, with whether the wait needs the user's attention (a Warning
/// Event) rather than time (a Normal one).
const WAIT_REASONS: [(&str, bool); 7] = [
    ("ResolvingImage", false),
    ("NoCandidates", true),
    ("CycleDetected", true),
    ("InvalidSchedule", true),
    ("DependencyPending", false),
    ("WaitingForSchedule", false),
    ("ScheduleExhausted", false),
];

/// An Event when the task starts waiting, or waits for another reason: once per change,
/// so a task that keeps waiting records one Event, not one per reconcile.
fn note_new_wait(written: &TaskStatus, desired: &TaskStatus, plan: &mut TaskPlan) {
    let waiting_on = |status: &TaskStatus| {
        status
            .conditions
            .iter()
            .find(|c| c.type_ == SCHEDULED && c.status == "False")
            .map(|c| (c.reason.clone(), c.message.clone()))
    };
    let Some((reason, message)) = waiting_on(desired) else {
        return;
    };
    if waiting_on(written).is_some_and(|(before, _)| before == reason) {
        return;
    }
    if let Some((name, warning)) = WAIT_REASONS.iter().find(|(r, _)| *r == reason) {
        plan.notes.push(if *warning {
            Note::warning(name, message)
        } else {
            Note::normal(name, message)
        });
    }
}

fn waiting(
    status: &mut TaskStatus,
    reason: &'static str,
    message: String,
    gen: Option<i64>,
    now: DateTime<Utc>,
) {
    set_condition(
        &mut status.conditions,
        &DesiredCondition::new(SCHEDULED, false, reason, message),
        gen,
        now,
    );
}

fn runs_as_job(observed: &TaskObservations, status: &TaskStatus) -> bool {
    status.broadcast_proplets.is_empty()
        && status
            .assigned_proplet
            .as_deref()
            .and_then(|name| view(observed, name))
            .is_some_and(|v| v.candidate.proplet_type == PropletType::K8s)
}

/// Decides what to do for `task` at `now`.
pub fn plan(
    task: &Task,
    observed: &TaskObservations,
    settings: &TaskSettings,
    now: DateTime<Utc>,
) -> TaskPlan {
    let mut plan = TaskPlan::default();
    let written = task.status.clone().unwrap_or_default();
    let mut desired = written.clone();
    let gen = task.metadata.generation;
    let has_finalizer = task
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|x| x == TASK_FINALIZER));

    if task.metadata.deletion_timestamp.is_some() {
        // A daemon that reported (an HTTP component's "started at port N") keeps serving
        // after its task completed: deleting the task is what stops it.
        if task.spec.daemon && written.phase == TaskPhase::Completed {
            for name in targets_of(&written) {
                if let Some(target) = view(observed, &name) {
                    plan.stops.push(stop_for(task, target));
                }
            }
        }
        if matches!(written.phase, TaskPhase::Scheduled | TaskPhase::Running) {
            for name in targets_of(&written) {
                if let Some(target) = view(observed, &name) {
                    plan.stops.push(stop_for(task, target));
                }
            }
            finish(&mut desired, TaskPhase::Interrupted, None, gen, now);
            plan.notes.push(Note::normal(
                "Stopped",
                "the task was deleted while it ran; stop sent",
            ));
        }
        fence_displaced(task, observed, now, &mut desired, &mut plan);
        if has_finalizer {
            plan.finalizer = Some(FinalizerChange::Remove);
        }
        if desired != written {
            plan.status = Some(desired);
        }
        return plan;
    }
    if desired.created_at.is_none() {
        desired.created_at = Some(now);
    }

    // A user's rerun request, honoured once per annotation value.
    let token = task
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RERUN_ANNOTATION))
        .filter(|v| !v.is_empty());
    if let Some(token) = token {
        if desired.rerun_token.as_deref() != Some(token.as_str()) {
            if desired.phase.is_terminal() {
                reset_for_rerun(&mut desired);
                desired.next_run = None;
                desired.retries = None;
                desired.retry_at = None;
                desired.failed_attempts.clear();
                plan.notes
                    .push(Note::normal("Rerun", format!("rerun requested ({token})")));
            } else {
                plan.notes.push(Note::warning(
                    "RerunIgnored",
                    format!(
                        "rerun request {token} ignored: the task is still {}",
                        desired.phase
                    ),
                ));
            }
            desired.rerun_token = Some(token.clone());
        }
    }

    // A finished recurring task waits for its next tick, then runs again.
    if desired.phase.is_terminal() && task.spec.is_recurring {
        if let Some(at) = rerun_at(&task.spec, &desired, now) {
            if now >= at {
                reset_for_rerun(&mut desired);
                desired.next_run = Some(at);
            } else {
                desired.next_run = Some(at);
                plan.requeue_at = Some(at);
            }
        }
    }

    // Results are awaited only while a run is out; one arriving otherwise belongs to a run
    // already finished (an agent answering a repeated start sends its result again) and is
    // dropped, or it would be taken for the next run's.
    let awaiting = matches!(desired.phase, TaskPhase::Scheduled | TaskPhase::Running);
    if !awaiting && !observed.results.is_empty() {
        plan.consumed_results = observed.results.len();
        plan.notes.push(Note::normal(
            "ResultIgnored",
            format!(
                "{} result(s) for a run that already finished ignored",
                observed.results.len()
            ),
        ));
    }
    if task.spec.suspend {
        hold(task, observed, gen, now, &mut desired, &mut plan);
    } else {
        resume(gen, now, &mut desired, &mut plan);
    }
    // A daemon whose proplet stayed Offline goes back to Pending here, and is placed again
    // at the next reconcile, over the proplets that could take it (this one read only
    // those its run occupied).
    let relocated = task.spec.daemon
        && !task.spec.suspend
        && matches!(desired.phase, TaskPhase::Scheduled | TaskPhase::Running)
        && !runs_as_job(observed, &desired)
        && {
            relocate_if_offline(task, observed, now, &mut desired, &mut plan);
            desired.phase == TaskPhase::Pending
        };
    match desired.phase {
        _ if task.spec.suspend || relocated => {}
        TaskPhase::Pending => plan_pending(task, observed, settings, now, &mut desired, &mut plan),
        TaskPhase::Scheduled => {
            plan_scheduled(task, observed, settings, now, &mut desired, &mut plan)
        }
        TaskPhase::Running => plan_running(task, observed, settings, now, &mut desired, &mut plan),
        _ => {}
    }

    if desired.phase == TaskPhase::Failed && written.phase != TaskPhase::Failed {
        retry(task, gen, now, &mut desired, &mut plan);
    }
    fence_displaced(task, observed, now, &mut desired, &mut plan);
    note_new_wait(&written, &desired, &mut plan);
    if !has_finalizer && settings.finalizer.wanted(task, &desired) {
        plan.finalizer = Some(FinalizerChange::Add);
    }
    desired.observed_generation = gen;
    // The executor forgets consumed reports only after a status write, so consuming one
    // (even an ignored result) must write, or it would be re-read at every reconcile.
    let consumed = plan.consumed_results > 0 || plan.consumed_metrics;
    if desired != written || consumed {
        desired.updated_at = Some(now);
        plan.status = Some(desired);
    }
    delete_if_expired(task, &written, now, &mut plan);
    plan
}

/// How many failed attempts a task's status lists.
const ATTEMPTS_KEPT: usize = 10;
/// The longest wait between retries.
const MAX_BACKOFF: Duration = Duration::from_secs(360);

/// A run that just failed, retried if `spec.backoffLimit` allows: the attempt is recorded
/// and the task goes back to Pending until its backoff has passed (never through `Failed`,
/// so a job or a dependent does not take it for finished).
fn retry(
    task: &Task,
    gen: Option<i64>,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let limit = task.spec.backoff_limit.unwrap_or(0);
    let retries = desired.retries.unwrap_or(0);
    if task.spec.is_recurring || retries >= limit {
        return;
    }
    let run = desired.run_count.unwrap_or(0);
    let error = desired.error.clone().unwrap_or_default();
    desired.failed_attempts.push(FailedAttempt {
        run,
        error: error.chars().take(4096).collect(),
        finished_at: now,
    });
    let excess = desired.failed_attempts.len().saturating_sub(ATTEMPTS_KEPT);
    desired.failed_attempts.drain(..excess);
    let first =
        Duration::from_secs(u64::try_from(task.spec.backoff_seconds.unwrap_or(10)).unwrap_or(10));
    let factor = 2u32.saturating_pow(u32::try_from(retries).unwrap_or(u32::MAX).min(16));
    let wait = first.saturating_mul(factor).min(MAX_BACKOFF);
    let at = later(now, wait);
    reset_for_rerun(desired);
    desired.retries = Some(retries + 1);
    desired.retry_at = Some(at);
    let message = format!(
        "run {run} failed ({error}); retry {} of {limit} at {}",
        retries + 1,
        at.to_rfc3339()
    );
    waiting(desired, "BackingOff", message.clone(), gen, now);
    plan.notes.push(Note::warning("BackOff", message));
    look_again_by(plan, at);
}

/// A suspended task: a run that is out is stopped on its devices (the path deletion takes)
/// and the task goes back to Pending, to run again when resumed; nothing is dispatched.
fn hold(
    task: &Task,
    observed: &TaskObservations,
    gen: Option<i64>,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let out = matches!(desired.phase, TaskPhase::Scheduled | TaskPhase::Running);
    if out {
        // A run on a `k8s` proplet is its Job: suspended with the task (its pod goes), and
        // resumed when the task is dispatched again.
        plan.create_job = runs_as_job(observed, desired);
        for name in targets_of(desired) {
            if let Some(target) = view(observed, &name) {
                plan.stops.push(stop_for(task, target));
            }
        }
        reset_for_rerun(desired);
    }
    if desired.phase.is_terminal() {
        return;
    }
    let already = is_true(&desired.conditions, SUSPENDED);
    let message = "suspended: nothing is dispatched until spec.suspend is false";
    if out {
        plan.notes.push(Note::normal(
            "Suspended",
            "suspended while it ran: the run was stopped and starts again when resumed",
        ));
    } else if !already {
        plan.notes.push(Note::normal("Suspended", message));
    }
    set_condition(
        &mut desired.conditions,
        &DesiredCondition::new(SUSPENDED, true, "Suspended", message),
        gen,
        now,
    );
}

/// A task no longer suspended says so once; it then runs as any pending task.
fn resume(gen: Option<i64>, now: DateTime<Utc>, desired: &mut TaskStatus, plan: &mut TaskPlan) {
    let was = is_true(&desired.conditions, SUSPENDED);
    if !was {
        return;
    }
    let message = "resumed: the task is dispatched again";
    plan.notes.push(Note::normal("Resumed", message));
    set_condition(
        &mut desired.conditions,
        &DesiredCondition::new(SUSPENDED, false, "Resumed", message),
        gen,
        now,
    );
}

fn later(at: DateTime<Utc>, by: Duration) -> DateTime<Utc> {
    chrono::Duration::from_std(by)
        .ok()
        .and_then(|d| at.checked_add_signed(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn look_again_by(plan: &mut TaskPlan, at: DateTime<Utc>) {
    plan.requeue_at = Some(plan.requeue_at.map_or(at, |t| t.min(at)));
}

/// The stops `task`, deleted without the finalizer (the driver saw it go in its watch, in
/// its last state), still needs: its run was out on the devices `observed` shows. Empty when
/// the finalizer held it (its reconcile stopped the run and wrote it interrupted) or when no
/// run was out.
pub fn stops_for_deleted(task: &Task, observed: &TaskObservations) -> Vec<StopCommand> {
    let finalized = task
        .metadata
        .finalizers
        .as_ref()
        .is_some_and(|f| f.iter().any(|x| x == TASK_FINALIZER));
    let Some(status) = task.status.as_ref() else {
        return Vec::new();
    };
    let out = matches!(status.phase, TaskPhase::Scheduled | TaskPhase::Running)
        || (task.spec.daemon && status.phase == TaskPhase::Completed);
    if finalized || !out {
        return Vec::new();
    }
    targets_of(status)
        .iter()
        .filter_map(|name| view(observed, name))
        .map(|target| stop_for(task, target))
        .collect()
}

/// Whether `task` runs now as a Job on a `k8s` proplet (the driver should look at the Job).
pub fn awaits_job(task: &Task, observed: &TaskObservations) -> bool {
    task.status.as_ref().is_some_and(|s| {
        matches!(s.phase, TaskPhase::Scheduled | TaskPhase::Running) && runs_as_job(observed, s)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::common::find_condition;
    use crate::crd::common::MetricsSample;
    use crate::crd::proplet::{Proplet, PropletPhase};
    use crate::decision::scheduler::filter_candidates;
    use chrono::TimeZone;
    use serde_json::json;
    use serde_json::Value;

    fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 3, 14, h, m, s)
            .single()
            .unwrap_or_else(|| panic!("invalid test time {h}:{m}:{s}"))
    }

    fn now() -> DateTime<Utc> {
        at(10, 0, 0)
    }

    fn settings() -> TaskSettings {
        TaskSettings {
            strategy: Strategy::RoundRobin,
            default_timeout: Duration::from_secs(3600),
            running_write_delay: Duration::from_secs(1),
            finalizer: Default::default(),
        }
    }

    fn task_value() -> Value {
        json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Task",
            "metadata": {"name": "add", "namespace": "iot", "uid": "task-uid-1", "generation": 1},
            "spec": {
                "name": "add",
                "functionName": "add",
                "imageUrl": "oci://registry.example/add:1",
                "file": "AGFzbQEAAAA=",
                "inputs": [10, "32"],
                "env": {"LOG": "debug"}
            }
        })
    }

    fn task_from(v: Value) -> Task {
        serde_json::from_value(v).unwrap_or_else(|e| panic!("invalid test task: {e}"))
    }

    /// A task as a user creates it: no finalizer, no status.
    fn new_task() -> Task {
        task_from(task_value())
    }

    /// Adds the finalizer and `status` to a task value.
    fn finalized(mut v: Value, status: Value) -> Value {
        v["metadata"]["finalizers"] = json!([TASK_FINALIZER]);
        v["status"] = status;
        v
    }

    /// A task that already carries the finalizer and this status.
    fn task_with_status(status: Value) -> Task {
        task_from(finalized(task_value(), status))
    }

    fn proplet_value(name: &str, client: &str) -> Value {
        json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Proplet",
            "metadata": {"name": name, "namespace": "iot", "uid": format!("{name}-uid"), "generation": 1},
            "spec": {
                "type": "external",
                "connectionConfig": {
                    "mqttAddress": "tcp://127.0.0.1:1883",
                    "domainId": "d1",
                    "channelId": "c1",
                    "clientId": client,
                    "clientKey": "secret"
                }
            },
            "status": {"phase": "Running"}
        })
    }

    fn proplet_from(v: Value) -> Proplet {
        serde_json::from_value(v).unwrap_or_else(|e| panic!("invalid test proplet: {e}"))
    }

    /// A Running external proplet of namespace `iot`.
    fn proplet(name: &str, client: &str) -> PropletView {
        proplet_view(&proplet_from(proplet_value(name, client)), 0)
    }

    fn observing(proplets: Vec<PropletView>) -> TaskObservations {
        TaskObservations {
            proplets,
            ..TaskObservations::default()
        }
    }

    fn running_status(proplet: &str, started: DateTime<Utc>) -> Value {
        json!({
            "phase": "running",
            "assignedProplet": proplet,
            "createdAt": at(9, 0, 0),
            "startedAt": started,
            "runCount": 1,
            "observedGeneration": 1
        })
    }

    fn result(client: &str, value: Value, error: Option<&str>) -> ReportedResult {
        ReportedResult {
            client_id: client.into(),
            value,
            error: error.map(str::to_owned),
        }
    }

    fn written(plan: &TaskPlan) -> &TaskStatus {
        plan.status
            .as_ref()
            .unwrap_or_else(|| panic!("the plan writes no status: {plan:?}"))
    }

    /// The status the reconcile after `first` writes once the running-write delay has
    /// passed without a result (the start went out at `now()`).
    fn after(task: &Task, observed: &TaskObservations, first: &TaskPlan) -> TaskStatus {
        let mut next = task.clone();
        next.metadata.finalizers = Some(vec![TASK_FINALIZER.to_owned()]);
        if first.status.is_some() {
            next.status = first.status.clone();
        }
        let mut seen = observed.clone();
        if !first.starts.is_empty() {
            seen.dispatched_at = Some(now());
        }
        if first.create_job {
            seen.job = Some(JobOutcome::Running);
        }
        let delay = settings().running_write_delay;
        let again = plan(&next, &seen, &settings(), later(now(), delay));
        match again.status {
            Some(status) => status,
            None => panic!("the follow-up writes no status: {:?}", again.notes),
        }
    }

    /// (status, reason, message) of a condition.
    fn condition<'a>(status: &'a TaskStatus, type_: &str) -> (&'a str, &'a str, &'a str) {
        find_condition(&status.conditions, type_)
            .map(|c| (c.status.as_str(), c.reason.as_str(), c.message.as_str()))
            .unwrap_or_else(|| panic!("no {type_} condition in {status:?}"))
    }

    fn reasons(plan: &TaskPlan) -> Vec<(bool, &'static str)> {
        plan.notes.iter().map(|n| (n.warning, n.reason)).collect()
    }

    // 0. An OCI imageUrl is resolved before the run is scheduled.

    fn oci_task(status: Option<Value>) -> Task {
        let mut v = task_value();
        v["spec"].as_object_mut().map(|spec| spec.remove("file"));
        match status {
            Some(status) => task_from(finalized(v, status)),
            None => task_from(v),
        }
    }

    const DIGEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn an_oci_image_is_resolved_before_anything_is_sent() {
        let task = oci_task(None);
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let plan = plan(&task, &observed, &settings(), now());
        assert!(plan.resolve_image);
        assert!(plan.starts.is_empty());
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(status.run_count, None);
        assert_eq!(
            condition(status, SCHEDULED),
            (
                "False",
                "ResolvingImage",
                "resolving oci://registry.example/add:1 in its registry"
            )
        );
        assert_eq!(reasons(&plan), vec![(false, "ResolvingImage")]);
        assert!(plan.requeue_at.is_some());
    }

    #[test]
    fn a_resolved_image_is_sent_pinned_to_its_digest_and_recorded() {
        let task = oci_task(Some(json!({"phase": "pending", "createdAt": at(9, 0, 0)})));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.image = Some(ImageObservation::Resolved {
            digest: DIGEST.into(),
        });
        let plan = plan(&task, &observed, &settings(), now());
        assert!(!plan.resolve_image);
        assert_eq!(written(&plan).image_digest.as_deref(), Some(DIGEST));
        assert_eq!(written(&plan).phase, TaskPhase::Scheduled);
        assert_eq!(plan.starts.len(), 1);
        assert_eq!(
            plan.starts[0].request.image_url.as_deref(),
            Some(format!("registry.example/add@{DIGEST}").as_str())
        );
        assert_eq!(
            after(&task, &observed, &plan).image_digest.as_deref(),
            Some(DIGEST)
        );
    }

    #[test]
    fn a_scheduled_run_after_a_restart_resends_the_recorded_digest() {
        let task = oci_task(Some(json!({
            "phase": "scheduled", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
            "runCount": 1, "imageDigest": DIGEST
        })));
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let plan = plan(&task, &observed, &settings(), now());
        assert!(!plan.resolve_image);
        assert_eq!(
            plan.starts[0].request.image_url.as_deref(),
            Some(format!("registry.example/add@{DIGEST}").as_str())
        );
    }

    #[test]
    fn an_unusable_image_fails_the_task_with_the_registry_reason() {
        let task = oci_task(Some(json!({"phase": "pending", "createdAt": at(9, 0, 0)})));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        let message = "image registry.example/add:1 not found in its registry";
        observed.image = Some(ImageObservation::Failed(message.into()));
        let plan = plan(&task, &observed, &settings(), now());
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Failed);
        assert_eq!(status.error.as_deref(), Some(message));
        assert_eq!(status.run_count, Some(1));
        assert!(plan.starts.is_empty());
        assert!(reasons(&plan).contains(&(true, "ImageUnavailable")));
    }

    #[test]
    fn a_rerun_resolves_the_tag_again() {
        let mut status = TaskStatus {
            image_digest: Some(DIGEST.into()),
            ..TaskStatus::default()
        };
        reset_for_rerun(&mut status);
        assert_eq!(status.image_digest, None);
    }

    #[test]
    fn inline_files_and_http_urls_need_no_resolution() {
        assert!(!needs_image_resolution(&new_task()));
        let mut v = task_value();
        v["spec"]["file"] = Value::Null;
        v["spec"]["imageUrl"] = json!("https://example.com/add.wasm");
        assert!(!needs_image_resolution(&task_from(v)));
        assert!(needs_image_resolution(&oci_task(None)));
    }

    #[test]
    fn a_task_without_proplets_does_not_pull() {
        let plan = plan(&oci_task(None), &observing(vec![]), &settings(), now());
        assert!(!plan.resolve_image);
    }

    // 1. A new task: finalizer, assignment, start, running.

    #[test]
    fn new_task_gets_finalizer_is_scheduled_and_started_on_the_matching_proplet() {
        let task = new_task();
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let plan = plan(&task, &observed, &settings(), now());

        assert_eq!(plan.finalizer, Some(FinalizerChange::Add));
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Scheduled);
        assert_eq!(status.assigned_proplet.as_deref(), Some("edge"));
        assert!(status.broadcast_proplets.is_empty());
        assert_eq!(status.run_count, Some(1));
        assert_eq!(status.created_at, Some(now()));
        assert_eq!(status.updated_at, Some(now()));
        assert_eq!(status.observed_generation, Some(1));
        assert_eq!(status.started_at, None);
        assert_eq!(
            condition(status, SCHEDULED),
            ("True", "PropletAssigned", "assigned to edge")
        );

        assert_eq!(plan.starts.len(), 1, "{:?}", plan.starts);
        let start = &plan.starts[0];
        assert_eq!(start.proplet, "edge");
        assert_eq!(start.domain, "d1");
        assert_eq!(start.channel, "c1");
        let req = &start.request;
        assert_eq!(req.id, "task-uid-1");
        assert_eq!(req.name, "add");
        assert_eq!(req.state, 1);
        assert_eq!(req.proplet_id.as_deref(), Some("edge-client"));
        assert!(!req.broadcast);
        assert_eq!(req.inputs, vec!["10".to_owned(), "32".to_owned()]);
        assert_eq!(
            req.image_url.as_deref(),
            Some("oci://registry.example/add:1")
        );
        assert_eq!(
            req.env.get("PROPLET_ID").map(String::as_str),
            Some("edge-client")
        );
        assert_eq!(
            req.env.get("TASK_ID").map(String::as_str),
            Some("task-uid-1")
        );
        assert_eq!(req.env.get("LOG").map(String::as_str), Some("debug"));
        assert_eq!(req.kind.as_deref(), Some("standard"));
        assert_eq!(req.priority, Some(50));

        let running = &after(&task, &observed, &plan);
        assert_eq!(running.phase, TaskPhase::Running);
        assert_eq!(running.started_at, Some(now()));
        assert_eq!(running.assigned_proplet.as_deref(), Some("edge"));
        assert_eq!(running.run_count, Some(1));
        assert_eq!(
            running.updated_at,
            Some(later(now(), settings().running_write_delay))
        );
        assert_eq!(running.observed_generation, Some(1));
        assert_eq!(condition(running, STARTED).0, "True");
        assert_eq!(condition(running, STARTED).1, "StartSent");
        assert_eq!(condition(running, SCHEDULED).0, "True");

        assert_eq!(plan.chosen.as_deref(), Some("edge"));
        assert!(plan.stops.is_empty());
        assert_eq!(
            plan.requeue_at,
            Some(later(now(), settings().running_write_delay)),
            "the running write waits for the delay"
        );
        assert!(
            reasons(&plan).is_empty(),
            "the Scheduled condition says it; no Event: {:?}",
            reasons(&plan)
        );
    }

    #[test]
    fn finalized_task_is_not_given_the_finalizer_again() {
        let task = task_with_status(json!({"phase": "pending", "createdAt": at(9, 0, 0)}));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(plan.finalizer, None);
        assert_eq!(written(&plan).phase, TaskPhase::Scheduled);
        assert_eq!(written(&plan).created_at, Some(at(9, 0, 0)));
    }

    fn while_running() -> TaskSettings {
        TaskSettings {
            finalizer: FinalizerTiming::WhileRunning,
            ..settings()
        }
    }

    /// `task` as the first plan left it, without the finalizer.
    fn as_written(task: &Task, first: &TaskPlan) -> Task {
        let mut next = task.clone();
        next.status = Some(written(first).clone());
        next
    }

    #[test]
    fn while_running_a_quick_task_never_gets_the_finalizer() {
        let task = new_task();
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        let first = plan(&task, &observed, &while_running(), now());
        assert_eq!(first.finalizer, None);
        assert_eq!(written(&first).phase, TaskPhase::Scheduled);
        assert_eq!(first.starts.len(), 1);

        observed.dispatched_at = Some(now());
        observed.results = vec![result("edge-client", json!(42), None)];
        let done = plan(
            &as_written(&task, &first),
            &observed,
            &while_running(),
            at(10, 0, 0) + chrono::Duration::milliseconds(300),
        );
        assert_eq!(done.finalizer, None);
        assert_eq!(written(&done).phase, TaskPhase::Completed);
    }

    #[test]
    fn while_running_the_finalizer_comes_with_the_running_write() {
        let task = new_task();
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        let first = plan(&task, &observed, &while_running(), now());
        observed.dispatched_at = Some(now());
        let scheduled = as_written(&task, &first);

        let early = plan(
            &scheduled,
            &observed,
            &while_running(),
            at(10, 0, 0) + chrono::Duration::milliseconds(500),
        );
        assert_eq!(early.finalizer, None);
        assert_eq!(early.status, None);

        let overdue = plan(&scheduled, &observed, &while_running(), at(10, 0, 2));
        assert_eq!(written(&overdue).phase, TaskPhase::Running);
        assert_eq!(overdue.finalizer, Some(FinalizerChange::Add));
    }

    #[test]
    fn while_running_a_daemon_gets_the_finalizer_at_once() {
        let mut v = task_value();
        v["spec"]["daemon"] = json!(true);
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("edge", "edge-client")]),
            &while_running(),
            now(),
        );
        assert_eq!(plan.finalizer, Some(FinalizerChange::Add));
    }

    #[test]
    fn a_run_deleted_without_the_finalizer_is_stopped_from_the_watch() {
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let unfinalized = |status: Value| {
            let mut v = task_value();
            v["status"] = status;
            task_from(v)
        };
        let stops = stops_for_deleted(
            &unfinalized(running_status("edge", at(9, 59, 0))),
            &observed,
        );
        assert_eq!(stops.len(), 1, "{stops:?}");
        assert_eq!(stops[0].request.proplet_id.as_deref(), Some("edge-client"));
        assert_eq!(
            (stops[0].domain.as_str(), stops[0].channel.as_str()),
            ("d1", "c1")
        );

        let mut scheduled = running_status("edge", at(9, 59, 0));
        scheduled["phase"] = json!("scheduled");
        assert_eq!(
            stops_for_deleted(&unfinalized(scheduled), &observed).len(),
            1
        );

        // The finalizer held it: its reconcile stopped the run.
        let held = task_with_status(running_status("edge", at(9, 59, 0)));
        assert!(stops_for_deleted(&held, &observed).is_empty());
        // No run was out.
        let mut finished = running_status("edge", at(9, 59, 0));
        finished["phase"] = json!("completed");
        assert!(stops_for_deleted(&unfinalized(finished), &observed).is_empty());
        assert!(stops_for_deleted(&new_task(), &observed).is_empty());
    }

    #[test]
    fn a_proplet_with_a_capacity_is_reserved_and_skipped_once_full() {
        let limited = |load: u32| {
            let mut v = proplet_value("edge", "edge-client");
            v["spec"]["capacity"] = json!(1);
            proplet_view(&proplet_from(v), load)
        };
        let plan_free = plan(
            &new_task(),
            &observing(vec![limited(0)]),
            &settings(),
            now(),
        );
        assert_eq!(
            written(&plan_free).assigned_proplet.as_deref(),
            Some("edge")
        );
        assert_eq!(plan_free.reserve, vec!["edge".to_owned()]);

        let plan_full = plan(
            &new_task(),
            &observing(vec![limited(1)]),
            &settings(),
            now(),
        );
        assert!(plan_full.no_candidates);
        assert!(plan_full.starts.is_empty() && plan_full.reserve.is_empty());
        let waiting = written(&plan_full);
        assert_eq!(waiting.phase, TaskPhase::Pending);
        assert!(
            waiting
                .conditions
                .iter()
                .any(|c| c.message.contains("at capacity")),
            "{waiting:?}"
        );
        assert_eq!(
            plan_full.requeue_at,
            Some(now() + chrono::Duration::from_std(CAPACITY_RETRY).unwrap_or_default())
        );

        // Without a capacity nothing is reserved.
        let plain = plan(
            &new_task(),
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert!(plain.reserve.is_empty());
    }

    #[test]
    fn k8s_proplets_do_not_take_tasks_without_an_image() {
        let mut v = task_value();
        if let Some(spec) = v["spec"].as_object_mut() {
            spec.remove("imageUrl");
            spec.insert("file".into(), json!("AGFzbQEAAAA="));
        }
        let inline = task_from(v);
        let mut k8s = proplet("cluster", "cluster-client");
        k8s.candidate.proplet_type = PropletType::K8s;
        let plan = plan(
            &inline,
            &observing(vec![k8s, proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(written(&plan).assigned_proplet.as_deref(), Some("edge"));
        assert_eq!(plan.starts.len(), 1);
        assert_eq!(plan.starts[0].proplet, "edge");
    }

    // 2. A scheduled task is only ever sent to its assigned proplet, and never twice.

    #[test]
    fn scheduled_task_already_dispatched_is_not_republished() {
        let task = task_with_status(json!({
            "phase": "scheduled", "assignedProplet": "b", "createdAt": at(9, 0, 0),
            "runCount": 1, "observedGeneration": 1
        }));
        let mut observed = observing(vec![proplet("a", "a-client"), proplet("b", "b-client")]);
        observed.dispatched_at = Some(now());
        let plan = plan(&task, &observed, &settings(), now());

        assert!(plan.starts.is_empty(), "{:?}", plan.starts);
        assert_eq!(plan.chosen, None);
        assert_eq!(plan.status, None, "within the delay nothing is written");
        let overdue = later(now(), settings().running_write_delay);
        assert_eq!(plan.requeue_at, Some(overdue));
        let plan = super::plan(&task, &observed, &settings(), overdue);
        assert!(plan.starts.is_empty(), "{:?}", plan.starts);
        let running = written(&plan);
        assert_eq!(running.phase, TaskPhase::Running);
        assert_eq!(running.assigned_proplet.as_deref(), Some("b"));
        assert_eq!(running.started_at, Some(now()), "since the start went out");
        assert_eq!(running.run_count, Some(1), "a retry is not another run");
        assert_eq!(condition(running, STARTED).0, "True");
    }

    #[test]
    fn scheduled_task_is_sent_only_to_its_assigned_proplet_not_the_round_robin_pick() {
        let task = task_with_status(json!({
            "phase": "scheduled", "assignedProplet": "b", "createdAt": at(9, 0, 0),
            "runCount": 1, "observedGeneration": 1
        }));
        // With no round-robin memory the scheduler would pick "a".
        let observed = observing(vec![proplet("a", "a-client"), proplet("b", "b-client")]);
        let plan = plan(&task, &observed, &settings(), now());

        assert_eq!(plan.starts.len(), 1, "{:?}", plan.starts);
        assert_eq!(plan.starts[0].proplet, "b");
        assert_eq!(
            plan.starts[0].request.proplet_id.as_deref(),
            Some("b-client")
        );
        assert_eq!(plan.chosen, None);
        let running = after(&task, &observed, &plan);
        assert_eq!(running.phase, TaskPhase::Running);
        assert_eq!(running.assigned_proplet.as_deref(), Some("b"));
        assert_eq!(running.run_count, Some(1));
    }

    // 3. The assigned proplet vanished before the start.

    #[test]
    fn scheduled_task_whose_proplet_vanished_fails_instead_of_moving() {
        let task = task_with_status(json!({
            "phase": "scheduled", "assignedProplet": "gone", "createdAt": at(9, 0, 0),
            "runCount": 1, "observedGeneration": 1
        }));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );

        assert!(plan.starts.is_empty(), "{:?}", plan.starts);
        assert_eq!(plan.chosen, None);
        let failed = written(&plan);
        assert_eq!(failed.phase, TaskPhase::Failed);
        assert_eq!(failed.finished_at, Some(now()));
        assert_eq!(failed.assigned_proplet.as_deref(), Some("gone"));
        let error = failed.error.as_deref().unwrap_or_default();
        assert!(error.contains("gone"), "{error}");
        let (ok, reason, message) = condition(failed, COMPLETED);
        assert_eq!((ok, reason), ("False", "Failed"));
        assert!(message.contains("gone"), "{message}");
    }

    /// `observed` cut down to what `proplet_scope(task)` names.
    fn scoped(task: &Task, observed: &TaskObservations) -> TaskObservations {
        let mut cut = observed.clone();
        match proplet_scope(task) {
            PropletScope::Named(names) => {
                cut.proplets.retain(|p| names.contains(&p.candidate.name));
            }
            PropletScope::Candidates => {
                let selector = selector_of(task);
                cut.proplets.retain(|p| {
                    runs_on(task, p.candidate.proplet_type)
                        && crate::decision::scheduler::exclusion(&p.candidate, &selector).is_none()
                });
            }
            PropletScope::Namespace => {}
        }
        cut
    }

    /// The plan a reconcile makes from the scoped observations: again over the whole
    /// namespace when no candidate could take the task.
    fn scoped_plan(task: &Task, observed: &TaskObservations, when: DateTime<Utc>) -> TaskPlan {
        let first = plan(task, &scoped(task, observed), &settings(), when);
        if first.no_candidates && proplet_scope(task) == PropletScope::Candidates {
            plan(task, observed, &settings(), when)
        } else {
            first
        }
    }

    #[test]
    fn the_candidates_filter_reads_proplet_objects_as_the_scheduler_reads_views() {
        let mut offline = proplet_value("off", "off-client");
        offline["status"]["phase"] = json!("Offline");
        let mut labelled = proplet_value("edge", "edge-client");
        labelled["metadata"]["labels"] = json!({"zone": "north"});
        labelled["spec"]["external"] = json!({"deviceType": "esp32", "capabilities": ["gpu"]});
        let mut selectors = vec![task_value(); 4];
        selectors[1]["spec"]["propletSelector"] = json!({"matchLabels": {"zone": "north"}});
        selectors[2]["spec"]["propletSelector"] =
            json!({"matchDeviceTypes": ["esp32"], "matchCapabilities": ["gpu"]});
        selectors[3]["spec"]["propletSelector"] = json!({"propletId": "off"});
        for value in [offline, labelled, proplet_value("plain", "plain-client")] {
            let object = proplet_from(value);
            let view = proplet_view(&object, 0);
            for selector in &selectors {
                let task = task_from(selector.clone());
                let wanted = selector_of(&task);
                assert_eq!(
                    crate::decision::scheduler::exclusion(&object, &wanted),
                    crate::decision::scheduler::exclusion(&view.candidate, &wanted),
                );
                assert_eq!(
                    could_take(&task, &wanted, &object),
                    runs_on(&task, view.candidate.proplet_type)
                        && crate::decision::scheduler::exclusion(&view.candidate, &wanted)
                            .is_none()
                );
            }
        }
    }

    #[test]
    fn a_plan_reads_only_the_proplets_of_its_scope() {
        let fleet = || {
            observing(vec![
                proplet("a", "a-client"),
                proplet("b", "b-client"),
                proplet("c", "c-client"),
            ])
        };
        let with_results = |results: Vec<ReportedResult>| TaskObservations {
            results,
            dispatched_at: Some(at(9, 50, 0)),
            ..fleet()
        };
        let completed = json!({"phase": "completed", "assignedProplet": "a", "runCount": 1,
            "createdAt": at(9, 0, 0), "finishedAt": at(9, 55, 0), "observedGeneration": 1});
        let mut rerun = finalized(task_value(), completed.clone());
        rerun["metadata"]["annotations"] = json!({ RERUN_ANNOTATION: "again" });
        let mut recurring = finalized(task_value(), completed.clone());
        recurring["spec"]["isRecurring"] = json!(true);
        recurring["spec"]["schedule"] = json!("* * * * *");
        let mut deleted = finalized(task_value(), running_status("a", at(9, 50, 0)));
        deleted["metadata"]["deletionTimestamp"] = json!(at(9, 58, 0));
        let mut north = task_value();
        north["spec"]["propletSelector"] = json!({"matchLabels": {"zone": "north"}});
        let mut nowhere = task_value();
        nowhere["spec"]["propletSelector"] = json!({"matchLabels": {"zone": "south"}});
        let mixed = || {
            let mut b = proplet_value("b", "b-client");
            b["metadata"]["labels"] = json!({"zone": "north"});
            let mut c = proplet_value("c", "c-client");
            c["status"]["phase"] = json!("Offline");
            c["metadata"]["labels"] = json!({"zone": "north"});
            observing(vec![
                proplet("a", "a-client"),
                proplet_view(&proplet_from(b), 0),
                proplet_view(&proplet_from(c), 0),
            ])
        };
        let cases: Vec<(&str, Task, TaskObservations, bool)> = vec![
            ("new", new_task(), fleet(), true),
            (
                "new, one proplet of three matches",
                task_from(north),
                mixed(),
                true,
            ),
            ("new, none matches", task_from(nowhere), mixed(), true),
            (
                "pending",
                task_with_status(json!({"phase": "pending", "createdAt": at(9, 0, 0)})),
                fleet(),
                true,
            ),
            (
                "scheduled, start not sent here",
                task_with_status(json!({"phase": "scheduled", "assignedProplet": "b",
                    "createdAt": at(9, 0, 0), "runCount": 1, "observedGeneration": 1})),
                fleet(),
                false,
            ),
            (
                "running, its proplet's result",
                task_with_status(running_status("a", at(9, 50, 0))),
                with_results(vec![result("a-client", json!("42"), None)]),
                false,
            ),
            (
                "running, another device's result",
                task_with_status(running_status("a", at(9, 50, 0))),
                with_results(vec![result("b-client", json!("42"), None)]),
                false,
            ),
            (
                "broadcast running, one result",
                broadcast_running(Value::Null),
                with_results(vec![result("b-client", json!("7"), None)]),
                false,
            ),
            ("deleted while running", task_from(deleted), fleet(), false),
            ("completed", task_with_status(completed), fleet(), false),
            ("completed, rerun asked", task_from(rerun), fleet(), true),
            ("completed, recurring", task_from(recurring), fleet(), true),
        ];
        for (case, task, observed, schedules) in cases {
            let scope = proplet_scope(&task);
            assert_eq!(
                scope == PropletScope::Candidates,
                schedules,
                "{case}: {scope:?}"
            );
            for when in [now(), at(10, 30, 0)] {
                assert_eq!(
                    scoped_plan(&task, &observed, when),
                    plan(&task, &observed, &settings(), when),
                    "{case} at {when}"
                );
            }
        }
    }

    // 4. Nowhere to run.

    #[test]
    fn task_without_proplets_stays_pending_and_retries() {
        let plan = plan(&new_task(), &observing(vec![]), &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(status.assigned_proplet, None);
        assert_eq!(status.run_count, None);
        assert_eq!(
            condition(status, SCHEDULED),
            (
                "False",
                "NoCandidates",
                "no proplets exist in namespace iot"
            )
        );
        assert!(plan.starts.is_empty());
        assert_eq!(plan.chosen, None);
        let retry = chrono::Duration::from_std(NO_CANDIDATE_RETRY)
            .unwrap_or_else(|e| panic!("retry interval: {e}"));
        assert_eq!(plan.requeue_at, Some(now() + retry));
    }

    #[test]
    fn a_task_that_starts_waiting_records_one_event_not_one_per_reconcile() {
        let first = plan(&new_task(), &observing(vec![]), &settings(), now());
        let notes: Vec<_> = first.notes.iter().map(|n| (n.warning, n.reason)).collect();
        assert_eq!(notes, vec![(true, "NoCandidates")]);

        let mut again = new_task();
        again.status = Some(written(&first).clone());
        let second = plan(&again, &observing(vec![]), &settings(), now());
        assert!(second.notes.is_empty(), "{:?}", second.notes);
    }

    #[test]
    fn task_without_candidates_reports_the_schedulers_explanation() {
        let mut v = task_value();
        v["spec"]["propletSelector"] = json!({"matchLabels": {"zone": "north"}});
        let task = task_from(v);
        let mut offline = proplet("a", "a-client");
        offline.candidate.phase = PropletPhase::Offline;
        let unlabelled = proplet("b", "b-client");
        let candidates = [offline.candidate.clone(), unlabelled.candidate.clone()];
        let expected = filter_candidates("iot", &candidates, &selector_of(&task))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_else(|| panic!("the scheduler found a candidate"));

        let plan = plan(
            &task,
            &observing(vec![offline, unlabelled]),
            &settings(),
            now(),
        );

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        let (ok, reason, message) = condition(status, SCHEDULED);
        assert_eq!((ok, reason), ("False", "NoCandidates"));
        assert_eq!(message, expected);
        assert!(message.contains('a') && message.contains('b'), "{message}");
        assert!(plan.starts.is_empty());
        let retry = chrono::Duration::from_std(NO_CANDIDATE_RETRY)
            .unwrap_or_else(|e| panic!("retry interval: {e}"));
        assert_eq!(plan.requeue_at, Some(now() + retry));
    }

    // 5. Dependencies.

    fn dependent_task(depends_on: Value, run_if: Option<&str>) -> Task {
        let mut v = task_value();
        v["spec"]["dependsOn"] = depends_on;
        v["spec"]["workflowId"] = json!("wf");
        if let Some(r) = run_if {
            v["spec"]["runIf"] = json!(r);
        }
        task_from(v)
    }

    #[test]
    fn unmet_dependencies_keep_the_task_pending_without_requeue() {
        let task = dependent_task(json!(["a", "b"]), None);
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.dependencies.insert("a".into(), TaskPhase::Running);

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(
            condition(status, SCHEDULED),
            (
                "False",
                "DependencyPending",
                "waiting for dependencies (missing: b; unfinished: a)"
            )
        );
        assert!(plan.starts.is_empty());
        assert_eq!(plan.requeue_at, None, "dependency changes trigger the task");
    }

    #[test]
    fn failed_dependency_with_run_if_success_skips_the_task() {
        let task = dependent_task(json!(["a"]), Some("success"));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.dependencies.insert("a".into(), TaskPhase::Failed);

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Skipped);
        assert_eq!(status.finished_at, Some(now()));
        let error = status.error.as_deref().unwrap_or_default();
        assert!(error.contains("a failed"), "{error}");
        let (ok, reason, message) = condition(status, COMPLETED);
        assert_eq!((ok, reason, message), ("False", "Skipped", error));
        assert!(plan.starts.is_empty());
        assert_eq!(reasons(&plan), vec![(false, "Skipped")]);
    }

    #[test]
    fn completed_dependencies_let_the_task_run() {
        let task = dependent_task(json!(["a"]), None);
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed
            .dependencies
            .insert("a".into(), TaskPhase::Completed);
        let plan = plan(&task, &observed, &settings(), now());
        assert_eq!(written(&plan).phase, TaskPhase::Scheduled);
        assert_eq!(plan.starts.len(), 1);
    }

    #[test]
    fn dependency_cycle_is_reported_and_blocks_dispatch() {
        let task = dependent_task(json!(["a"]), None);
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed
            .dependencies
            .insert("a".into(), TaskPhase::Completed);
        observed.cycle = Some(vec!["a".into(), "add".into(), "a".into()]);

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(
            condition(status, SCHEDULED),
            ("False", "CycleDetected", "dependency cycle: a -> add -> a")
        );
        assert!(plan.starts.is_empty());
        assert_eq!(plan.requeue_at, None);
    }

    // 6. Schedules.

    #[test]
    fn invalid_cron_schedule_is_reported() {
        let mut v = task_value();
        v["spec"]["schedule"] = json!("not a cron");
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        let (ok, reason, message) = condition(status, SCHEDULED);
        assert_eq!((ok, reason), ("False", "InvalidSchedule"));
        assert!(message.starts_with("spec.schedule:"), "{message}");
        assert!(plan.starts.is_empty());
        assert_eq!(plan.requeue_at, None);
    }

    #[test]
    fn future_schedule_waits_for_its_tick() {
        let mut v = task_value();
        v["spec"]["schedule"] = json!("0 12 * * *");
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(status.next_run, Some(at(12, 0, 0)));
        let (ok, reason, message) = condition(status, SCHEDULED);
        assert_eq!((ok, reason), ("False", "WaitingForSchedule"));
        assert!(message.contains("2026-03-14T12:00:00"), "{message}");
        assert_eq!(plan.requeue_at, Some(at(12, 0, 0)));
        assert!(plan.starts.is_empty());
    }

    #[test]
    fn due_schedule_dispatches() {
        let mut v = finalized(
            task_value(),
            json!({"phase": "pending", "createdAt": at(9, 0, 0), "nextRun": at(12, 0, 0)}),
        );
        v["spec"]["schedule"] = json!("0 12 * * *");
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            at(12, 0, 1),
        );
        assert_eq!(written(&plan).phase, TaskPhase::Scheduled);
        assert_eq!(plan.starts.len(), 1);
    }

    // 7. Results of an ordinary task.

    #[test]
    fn result_from_the_assigned_proplet_completes_the_task() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.results = vec![result("edge-client", json!("42"), Some(""))];

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Completed);
        assert_eq!(status.results, Some(json!("42")));
        assert_eq!(status.error, None, "an empty error is no error");
        assert_eq!(status.finished_at, Some(now()));
        assert_eq!(status.updated_at, Some(now()));
        assert_eq!(condition(status, COMPLETED).0, "True");
        assert_eq!(condition(status, COMPLETED).1, "Succeeded");
        assert_eq!(plan.consumed_results, 1);
        assert!(plan.starts.is_empty() && plan.stops.is_empty());
        assert_eq!(plan.requeue_at, None);
        assert!(reasons(&plan).is_empty(), "a success records no Event");
    }

    #[test]
    fn result_with_an_error_fails_the_task() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.results = vec![result("edge-client", json!(""), Some("wasm trap"))];

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Failed);
        assert_eq!(status.error.as_deref(), Some("wasm trap"));
        assert_eq!(status.finished_at, Some(now()));
        assert_eq!(
            condition(status, COMPLETED),
            ("False", "Failed", "wasm trap")
        );
        assert_eq!(plan.consumed_results, 1);
        assert_eq!(reasons(&plan), vec![(true, "Failed")]);
    }

    #[test]
    fn result_from_another_client_is_ignored_but_consumed() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let mut observed = observing(vec![
            proplet("edge", "edge-client"),
            proplet("other", "other-client"),
        ]);
        // The proplet's resource name is not its identity either.
        observed.results = vec![
            result("other-client", json!("1"), None),
            result("edge", json!("2"), None),
        ];

        let plan = plan(&task, &observed, &settings(), now());

        assert_eq!(plan.consumed_results, 2);
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Running);
        assert_eq!(status.results, None);
        assert_eq!(status.finished_at, None);
        assert_eq!(
            status.updated_at,
            Some(now()),
            "consumed results need a status write before the executor forgets them"
        );
        assert_eq!(
            reasons(&plan),
            vec![(true, "ResultIgnored"), (true, "ResultIgnored")]
        );
        assert!(plan.notes[0].message.contains("other-client"));
        assert_eq!(plan.requeue_at, Some(at(10, 50, 0)), "the time limit");
    }

    #[test]
    fn ignored_result_does_not_hide_a_later_valid_one() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.results = vec![
            result("intruder", json!("bad"), None),
            result("edge-client", json!("42"), None),
        ];
        let plan = plan(&task, &observed, &settings(), now());
        assert_eq!(plan.consumed_results, 2);
        assert_eq!(written(&plan).phase, TaskPhase::Completed);
        assert_eq!(written(&plan).results, Some(json!("42")));
    }

    // 8. Broadcast tasks.

    fn broadcast_value() -> Value {
        let mut v = task_value();
        v["spec"]["broadcast"] = json!(true);
        v
    }

    fn broadcast_running(results: Value) -> Task {
        let mut status = json!({
            "phase": "running",
            "broadcastProplets": ["a", "b"],
            "createdAt": at(9, 0, 0),
            "startedAt": at(9, 50, 0),
            "runCount": 1,
            "observedGeneration": 1
        });
        if !results.is_null() {
            status["results"] = results;
        }
        task_from(finalized(broadcast_value(), status))
    }

    fn two_proplets() -> TaskObservations {
        observing(vec![proplet("a", "a-client"), proplet("b", "b-client")])
    }

    #[test]
    fn broadcast_task_is_sent_to_every_candidate() {
        let task = task_from(broadcast_value());
        let observed = two_proplets();
        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Scheduled);
        assert_eq!(status.broadcast_proplets, vec!["a", "b"]);
        assert_eq!(status.assigned_proplet, None);
        assert_eq!(status.run_count, Some(1));
        let targets: Vec<(&str, Option<&str>)> = plan
            .starts
            .iter()
            .map(|s| (s.proplet.as_str(), s.request.proplet_id.as_deref()))
            .collect();
        assert_eq!(
            targets,
            vec![("a", Some("a-client")), ("b", Some("b-client"))]
        );
        assert_eq!(plan.chosen, None, "broadcasts do not move the round robin");
        let running = after(&task, &observed, &plan);
        assert_eq!(running.phase, TaskPhase::Running);
        assert_eq!(running.broadcast_proplets, vec!["a", "b"]);
    }

    #[test]
    fn broadcast_task_keeps_running_until_every_proplet_answered() {
        let task = broadcast_running(Value::Null);
        let mut observed = two_proplets();
        observed.results = vec![result("a-client", json!("1"), None)];

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Running);
        assert_eq!(status.results, Some(json!({"a": {"results": "1"}})));
        assert_eq!(status.finished_at, None);
        assert_eq!(plan.consumed_results, 1);
    }

    #[test]
    fn broadcast_task_completes_with_the_last_answer() {
        let task = broadcast_running(json!({"a": {"results": "1"}}));
        let mut observed = two_proplets();
        observed.results = vec![result("b-client", json!("2"), None)];

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Completed);
        assert_eq!(
            status.results,
            Some(json!({"a": {"results": "1"}, "b": {"results": "2"}}))
        );
        assert_eq!(status.error, None);
        assert_eq!(status.finished_at, Some(now()));
        assert_eq!(condition(status, COMPLETED).0, "True");
        assert_eq!(plan.consumed_results, 1);
    }

    #[test]
    fn broadcast_task_fails_when_a_proplet_reported_an_error() {
        let task = broadcast_running(Value::Null);
        let mut observed = two_proplets();
        observed.results = vec![
            result("a-client", json!("1"), None),
            result("b-client", json!(""), Some("out of memory")),
        ];

        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Failed);
        assert_eq!(status.error.as_deref(), Some("b: out of memory"));
        assert_eq!(
            status.results,
            Some(json!({
                "a": {"results": "1"},
                "b": {"results": "", "error": "out of memory"}
            }))
        );
        assert_eq!(plan.consumed_results, 2);
    }

    // 9. Time limits.

    #[test]
    fn running_task_past_its_time_limit_fails_and_is_stopped() {
        let task = task_with_status(running_status("edge", at(8, 0, 0)));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Failed);
        assert_eq!(status.finished_at, Some(now()));
        let error = status.error.as_deref().unwrap_or_default();
        assert!(error.contains("time limit"), "{error}");
        assert!(error.contains("3600s"), "{error}");
        assert_eq!(plan.stops.len(), 1, "{:?}", plan.stops);
        let stop = &plan.stops[0];
        assert_eq!((stop.domain.as_str(), stop.channel.as_str()), ("d1", "c1"));
        assert_eq!(stop.request.id, "task-uid-1");
        assert_eq!(stop.request.proplet_id.as_deref(), Some("edge-client"));
        assert!(!stop.request.broadcast);
        assert!(plan.starts.is_empty());
        assert_eq!(plan.requeue_at, None);
        assert_eq!(reasons(&plan), vec![(true, "TimedOut")]);
    }

    fn scheduled_status(proplet: &str, assigned: DateTime<Utc>) -> Value {
        json!({
            "phase": "scheduled",
            "assignedProplet": proplet,
            "createdAt": at(9, 0, 0),
            "runCount": 1,
            "observedGeneration": 1,
            "conditions": [{
                "type": SCHEDULED, "status": "True", "reason": "PropletAssigned",
                "message": format!("assigned to {proplet}"), "lastTransitionTime": assigned
            }]
        })
    }

    #[test]
    fn a_start_held_for_an_absent_device_ends_at_the_time_limit_counted_from_the_assignment() {
        let mut v = finalized(task_value(), scheduled_status("edge", at(9, 59, 30)));
        v["spec"]["timeoutSeconds"] = json!(20);
        let task = task_from(v);
        let observed = observing(vec![proplet("edge", "edge-client")]);

        // Before the limit: the start is (re)planned; the executor holds it while the device
        // is away, and the plan looks again at the deadline.
        let early = plan(&task, &observed, &settings(), at(9, 59, 40));
        assert_eq!(early.starts.len(), 1, "{early:?}");
        assert!(
            early.requeue_at.is_some_and(|t| t <= at(9, 59, 50)),
            "{early:?}"
        );
        assert!(early.status.is_none() || written(&early).phase == TaskPhase::Scheduled);

        // At the limit: failed, saying why, and stopped in case an earlier process sent it.
        let late = plan(&task, &observed, &settings(), at(9, 59, 50));
        let status = written(&late);
        assert_eq!(status.phase, TaskPhase::Failed);
        let error = status.error.as_deref().unwrap_or_default();
        assert!(error.contains("time limit of 20s"), "{error}");
        assert!(error.contains("edge"), "{error}");
        assert!(late.starts.is_empty(), "{late:?}");
        assert_eq!(late.stops.len(), 1, "{late:?}");
        assert_eq!(reasons(&late), vec![(true, "TimedOut")]);

        // Once this process sent the start, the limit counts from the send as before.
        let mut sent = observed.clone();
        sent.dispatched_at = Some(at(9, 59, 45));
        let running = plan(&task, &sent, &settings(), at(9, 59, 50));
        assert_ne!(
            running.status.as_ref().map(|s| s.phase),
            Some(TaskPhase::Failed),
            "{running:?}"
        );
    }

    #[test]
    fn daemon_task_has_no_time_limit() {
        let mut v = finalized(task_value(), running_status("edge", at(8, 0, 0)));
        v["spec"]["daemon"] = json!(true);
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(plan.status, None, "a daemon keeps running: {plan:?}");
        assert!(plan.stops.is_empty());
        assert_eq!(plan.requeue_at, None);
    }

    #[test]
    fn running_task_before_its_deadline_is_requeued_at_the_deadline() {
        let task = task_with_status(running_status("edge", at(9, 30, 0)));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert!(plan.stops.is_empty());
        assert_eq!(plan.status, None, "nothing changed");
        assert_eq!(plan.requeue_at, Some(at(10, 30, 0)));
    }

    #[test]
    fn spec_timeout_overrides_the_default() {
        let mut v = finalized(task_value(), running_status("edge", at(9, 30, 0)));
        v["spec"]["timeoutSeconds"] = json!(600);
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(written(&plan).phase, TaskPhase::Failed);
        assert!(written(&plan)
            .error
            .as_deref()
            .is_some_and(|e| e.contains("600s")));
        assert_eq!(plan.stops.len(), 1);
    }

    #[test]
    fn huge_default_timeout_never_expires_and_does_not_panic() {
        let task = task_with_status(running_status("edge", at(9, 30, 0)));
        let observed = observing(vec![proplet("edge", "edge-client")]);
        for limit in [Duration::MAX, Duration::from_secs(10_000_000_000_000)] {
            let settings = TaskSettings {
                default_timeout: limit,
                ..settings()
            };
            let plan = plan(&task, &observed, &settings, now());
            assert_eq!(plan.status, None, "{limit:?}");
            assert!(plan.stops.is_empty());
            assert_eq!(plan.requeue_at, None);
        }
    }

    // 10. Deletion.

    fn deleted(mut v: Value) -> Task {
        v["metadata"]["deletionTimestamp"] = json!("2026-03-14T09:59:00Z");
        task_from(v)
    }

    #[test]
    fn deleting_a_running_task_stops_it_and_releases_the_finalizer() {
        let task = deleted(finalized(
            task_value(),
            running_status("edge", at(9, 50, 0)),
        ));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );

        assert_eq!(plan.finalizer, Some(FinalizerChange::Remove));
        assert_eq!(plan.stops.len(), 1, "{:?}", plan.stops);
        assert_eq!(plan.stops[0].request.id, "task-uid-1");
        assert_eq!(
            plan.stops[0].request.proplet_id.as_deref(),
            Some("edge-client")
        );
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Interrupted);
        assert_eq!(status.finished_at, Some(now()));
        assert_eq!(condition(status, COMPLETED).1, "Interrupted");
        assert!(plan.starts.is_empty());
        assert_eq!(reasons(&plan), vec![(false, "Stopped")]);
    }

    #[test]
    fn deleting_a_finished_task_only_releases_the_finalizer() {
        let task = deleted(finalized(
            task_value(),
            json!({
                "phase": "completed", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
                "finishedAt": at(9, 30, 0), "results": "42", "observedGeneration": 1
            }),
        ));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(
            plan,
            TaskPlan {
                finalizer: Some(FinalizerChange::Remove),
                ..TaskPlan::default()
            }
        );
    }

    #[test]
    fn deleting_a_completed_daemon_stops_what_still_serves() {
        let mut value = task_value();
        value["spec"]["daemon"] = json!(true);
        let task = deleted(finalized(
            value,
            json!({
                "phase": "completed", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
                "finishedAt": at(9, 30, 0), "results": "started at port 8222",
                "observedGeneration": 1
            }),
        ));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(plan.finalizer, Some(FinalizerChange::Remove));
        assert_eq!(plan.stops.len(), 1, "{:?}", plan.stops);
        assert_eq!(
            plan.stops[0].request.proplet_id.as_deref(),
            Some("edge-client")
        );
        assert_eq!(plan.status, None, "the completed status stays as it is");
    }

    // 11. Reruns.

    fn completed_with_annotation(token: &str, recorded: Option<&str>) -> Task {
        let mut status = json!({
            "phase": "completed", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
            "startedAt": at(9, 10, 0), "finishedAt": at(9, 30, 0), "updatedAt": at(9, 30, 0),
            "results": "42", "runCount": 1, "observedGeneration": 1,
            "conditions": [{
                "type": "Completed", "status": "True", "reason": "Succeeded",
                "message": "the task finished successfully", "lastTransitionTime": "2026-03-14T09:30:00Z"
            }]
        });
        if let Some(r) = recorded {
            status["rerunToken"] = json!(r);
        }
        let mut v = finalized(task_value(), status);
        v["metadata"]["annotations"] = json!({ RERUN_ANNOTATION: token });
        task_from(v)
    }

    #[test]
    fn rerun_annotation_runs_a_finished_task_again() {
        let task = completed_with_annotation("1", None);
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let plan = plan(&task, &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.rerun_token.as_deref(), Some("1"));
        assert_eq!(status.phase, TaskPhase::Scheduled);
        assert_eq!(status.results, None);
        assert_eq!(status.error, None);
        assert_eq!(status.finished_at, None);
        assert_eq!(status.run_count, Some(2));
        assert!(find_condition(&status.conditions, COMPLETED).is_none());
        assert_eq!(plan.starts.len(), 1);
        assert_eq!(plan.starts[0].proplet, "edge");
        let running = after(&task, &observed, &plan);
        assert_eq!(running.phase, TaskPhase::Running);
        assert_eq!(running.started_at, Some(now()));
        assert_eq!(running.rerun_token.as_deref(), Some("1"));
        assert_eq!(reasons(&plan), vec![(false, "Rerun")]);
    }

    #[test]
    fn rerun_annotation_is_honoured_once_per_value() {
        let task = completed_with_annotation("1", Some("1"));
        let plan = plan(
            &task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            now(),
        );
        assert_eq!(plan, TaskPlan::default());
    }

    #[test]
    fn rerun_request_on_a_running_task_is_recorded_and_ignored() {
        let mut v = finalized(task_value(), running_status("edge", at(9, 50, 0)));
        v["metadata"]["annotations"] = json!({ RERUN_ANNOTATION: "7" });
        // Started by this process (a restarted one would send the run's start again).
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.dispatched_at = Some(now());
        let plan = plan(&task_from(v), &observed, &settings(), now());

        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Running);
        assert_eq!(status.rerun_token.as_deref(), Some("7"));
        assert_eq!(status.run_count, Some(1));
        assert!(plan.starts.is_empty());
        assert_eq!(reasons(&plan), vec![(true, "RerunIgnored")]);
        assert!(plan.notes[0].message.contains("running"));
    }

    // 12. Metrics.

    #[test]
    fn metrics_of_a_running_task_are_written() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let sample = MetricsSample {
            timestamp: Some(at(9, 59, 0)),
            cpu_milli_percent: 12_500,
            memory_milli_percent: 3_000,
            memory_bytes: 1 << 20,
        };
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.metrics = Some(sample.clone());

        let plan = plan(&task, &observed, &settings(), now());

        assert!(plan.consumed_metrics);
        let status = written(&plan);
        assert_eq!(status.latest_metrics, Some(sample.clone()));
        assert_eq!(status.phase, TaskPhase::Running);
        assert_eq!(status.updated_at, Some(now()));

        // The same sample again still writes, so the executor can drop it from its inbox.
        let mut v = finalized(task_value(), running_status("edge", at(9, 50, 0)));
        v["status"]["latestMetrics"] =
            serde_json::to_value(&sample).unwrap_or_else(|e| panic!("metrics sample: {e}"));
        let again = super::plan(&task_from(v), &observed, &settings(), now());
        assert!(again.consumed_metrics);
        assert_eq!(written(&again).latest_metrics, Some(sample));
    }

    // 13. Helpers.

    #[test]
    fn occupies_counts_only_scheduled_and_running_tasks_on_that_proplet() {
        let running = task_with_status(running_status("edge", at(9, 50, 0)));
        assert!(occupies(&running, "edge"));
        assert!(!occupies(&running, "other"));
        let scheduled = task_with_status(json!({"phase": "scheduled", "assignedProplet": "edge"}));
        assert!(occupies(&scheduled, "edge"));
        let broadcast = broadcast_running(Value::Null);
        assert!(occupies(&broadcast, "a") && occupies(&broadcast, "b"));
        assert!(!occupies(&broadcast, "c"));
        let done = task_with_status(json!({"phase": "completed", "assignedProplet": "edge"}));
        assert!(!occupies(&done, "edge"));
        assert!(!occupies(&new_task(), "edge"));
    }

    #[test]
    fn proplet_view_takes_identity_and_topics_from_the_connection_config() {
        let mut v = proplet_value("edge", "edge-client");
        v["metadata"]["labels"] = json!({"zone": "north"});
        v["spec"]["external"] = json!({"deviceType": "esp32", "capabilities": ["wasm", "gpu"]});
        v["spec"]["connectionConfig"]["domainId"] = json!("dom-7");
        v["spec"]["connectionConfig"]["channelId"] = json!("chan-9");
        let view = proplet_view(&proplet_from(v), 3);

        assert_eq!(view.client_id, "edge-client");
        assert_eq!(view.domain, "dom-7");
        assert_eq!(view.channel, "chan-9");
        let c = &view.candidate;
        assert_eq!(c.name, "edge");
        assert_eq!(c.namespace, "iot");
        assert_eq!(c.phase, PropletPhase::Running);
        assert_eq!(c.proplet_type, PropletType::External);
        assert_eq!(c.labels.get("zone").map(String::as_str), Some("north"));
        assert_eq!(c.device_type.as_deref(), Some("esp32"));
        assert_eq!(c.capabilities, vec!["wasm", "gpu"]);
        assert_eq!(c.active_tasks, 3);
    }

    #[test]
    fn proplet_view_accepts_upstream_aliases_and_defaults() {
        let mut v = proplet_value("edge", "unused");
        let conn = &mut v["spec"]["connectionConfig"];
        conn["domainId"] = Value::Null;
        conn["tenantId"] = json!("tenant-1");
        conn["clientId"] = Value::Null;
        conn["entityId"] = json!("entity-1");
        v["status"] = Value::Null;
        let view = proplet_view(&proplet_from(v.clone()), 0);
        assert_eq!(view.client_id, "entity-1");
        assert_eq!(view.domain, "tenant-1");
        assert_eq!(view.candidate.phase, PropletPhase::Initializing);

        v["spec"]["connectionConfig"]["entityId"] = Value::Null;
        let view = proplet_view(&proplet_from(v), 0);
        assert_eq!(
            view.client_id, "edge",
            "without a client id the name is used"
        );
    }

    // The k8s path: a task with an image on a `k8s` proplet runs as a Job.

    fn k8s_proplet(name: &str) -> PropletView {
        let mut v = proplet(name, name);
        v.candidate.proplet_type = PropletType::K8s;
        v
    }

    fn image_task(status: Option<Value>) -> Task {
        let mut v = task_value();
        if let Some(spec) = v["spec"].as_object_mut() {
            spec.remove("file");
            spec.insert("imageUrl".into(), json!("registry.local/add:1"));
        }
        match status {
            Some(s) => task_from(finalized(v, s)),
            None => task_from(v),
        }
    }

    #[test]
    fn a_task_with_an_image_on_a_k8s_proplet_creates_its_job_instead_of_publishing() {
        let task = image_task(None);
        let observed = observing(vec![k8s_proplet("cluster")]);
        let plan = plan(&task, &observed, &settings(), now());
        assert!(plan.create_job);
        assert!(plan.starts.is_empty());
        assert_eq!(written(&plan).assigned_proplet.as_deref(), Some("cluster"));
        assert_eq!(
            after(&task, &observed, &plan).phase,
            TaskPhase::Running,
            "running once the Job is seen"
        );
    }

    #[test]
    fn the_jobs_outcome_finishes_a_task_on_a_k8s_proplet() {
        let task = image_task(Some(running_status("cluster", at(9, 59, 0))));
        let mut observed = observing(vec![k8s_proplet("cluster")]);
        observed.job = Some(JobOutcome::Running);
        assert!(plan(&task, &observed, &settings(), now()).status.is_none());
        observed.job = Some(JobOutcome::Succeeded {
            result: Some("7".into()),
        });
        let done = plan(&task, &observed, &settings(), now());
        assert_eq!(written(&done).phase, TaskPhase::Completed);
        assert_eq!(written(&done).results, Some(json!("7")));
        observed.job = Some(JobOutcome::Failed {
            message: "Job failed: BackoffLimitExceeded".into(),
        });
        let failed = plan(&task, &observed, &settings(), now());
        assert_eq!(written(&failed).phase, TaskPhase::Failed);
        assert_eq!(
            written(&failed).error.as_deref(),
            Some("Job failed: BackoffLimitExceeded")
        );
    }

    // 12. Run counters on starts, and what a restart leaves to send again.

    #[test]
    fn starts_carry_the_number_of_the_run_they_start() {
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let first = plan(&new_task(), &observed, &settings(), now());
        assert_eq!(first.starts[0].request.run, Some(1));
        // A start sent again for a run still `scheduled` keeps its number.
        let task = task_with_status(json!({
            "phase": "scheduled", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
            "runCount": 1, "observedGeneration": 1
        }));
        let again = plan(&task, &observed, &settings(), now());
        assert_eq!(again.starts[0].request.run, Some(1));
        // A rerun is a new run, with a higher number.
        let rerun = plan(
            &completed_with_annotation("1", None),
            &observed,
            &settings(),
            now(),
        );
        assert_eq!(rerun.starts[0].request.run, Some(2));
    }

    #[test]
    fn a_running_run_this_process_never_started_is_sent_again_with_its_number() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        let plan_after_restart = plan(&task, &observed, &settings(), now());
        assert_eq!(plan_after_restart.starts.len(), 1);
        let start = &plan_after_restart.starts[0];
        assert_eq!(start.proplet, "edge");
        assert_eq!(start.request.run, Some(1), "the same run, not another");
        assert_eq!(plan_after_restart.status, None, "the run stays as it is");
        assert_eq!(plan_after_restart.requeue_at, Some(at(10, 50, 0)));

        observed.dispatched_at = Some(now());
        let plan_same_process = plan(&task, &observed, &settings(), now());
        assert!(plan_same_process.starts.is_empty());
    }

    #[test]
    fn a_run_whose_result_is_overdue_is_asked_again_and_again_until_it_answers() {
        let task = task_with_status(running_status("edge", at(9, 50, 0)));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.dispatched_at = Some(now());
        let waiting = plan(&task, &observed, &settings(), now() + RESULT_OVERDUE / 2);
        assert!(waiting.starts.is_empty());
        assert!(!waiting.repeat_start);
        assert_eq!(waiting.requeue_at, Some(now() + RESULT_OVERDUE));
        let overdue = plan(&task, &observed, &settings(), now() + RESULT_OVERDUE);
        assert_eq!(overdue.starts.len(), 1);
        assert!(overdue.repeat_start, "the ledger must let it go again");
        assert_eq!(overdue.starts[0].request.run, Some(1), "the same run");
        assert_eq!(overdue.status, None, "the run stays as it is");
        assert_eq!(overdue.requeue_at, Some(now() + RESULT_OVERDUE * 2));
        // A daemon answers only when stopped: never asked.
        let mut v = finalized(task_value(), running_status("edge", at(9, 50, 0)));
        v["spec"]["daemon"] = json!(true);
        let daemon = plan(
            &task_from(v),
            &observed,
            &settings(),
            now() + RESULT_OVERDUE,
        );
        assert!(daemon.starts.is_empty());
    }

    #[test]
    fn a_broadcast_run_is_sent_again_only_where_no_answer_arrived() {
        let task = broadcast_running(json!({"a": {"results": "1"}}));
        let plan = plan(&task, &two_proplets(), &settings(), now());
        let to: Vec<&str> = plan.starts.iter().map(|s| s.proplet.as_str()).collect();
        assert_eq!(to, ["b"]);
    }

    #[test]
    fn a_running_daemon_or_timed_out_run_is_not_sent_again() {
        let mut v = finalized(task_value(), running_status("edge", at(8, 0, 0)));
        v["spec"]["daemon"] = json!(true);
        let observed = observing(vec![proplet("edge", "edge-client")]);
        assert!(plan(&task_from(v), &observed, &settings(), now())
            .starts
            .is_empty());
        let late = task_with_status(running_status("edge", at(8, 0, 0)));
        let timed_out = plan(&late, &observed, &settings(), now());
        assert!(timed_out.starts.is_empty());
        assert_eq!(written(&timed_out).phase, TaskPhase::Failed);
    }

    #[test]
    fn a_result_arriving_after_the_run_finished_is_dropped_not_kept_for_the_next() {
        let task = task_with_status(json!({
            "phase": "completed", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
            "finishedAt": at(9, 30, 0), "results": "42", "runCount": 1, "observedGeneration": 1
        }));
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.results = vec![result("edge-client", json!("42"), None)];
        let plan = plan(&task, &observed, &settings(), now());
        assert_eq!(plan.consumed_results, 1);
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Completed);
        assert_eq!(status.finished_at, Some(at(9, 30, 0)), "finished once");
        assert_eq!(status.run_count, Some(1));
        assert!(plan.starts.is_empty());
        assert_eq!(reasons(&plan), vec![(false, "ResultIgnored")]);
    }

    // 11. Suspension.

    fn suspended(mut v: Value) -> Task {
        v["spec"]["suspend"] = json!(true);
        task_from(v)
    }

    #[test]
    fn a_suspended_task_stops_its_run_and_goes_back_to_pending() {
        let task = suspended(finalized(
            task_value(),
            running_status("edge", at(9, 50, 0)),
        ));
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let plan = plan(&task, &observed, &settings(), now());
        assert_eq!(plan.stops.len(), 1, "{:?}", plan.stops);
        assert_eq!(
            plan.stops[0].request.proplet_id.as_deref(),
            Some("edge-client")
        );
        assert!(plan.starts.is_empty());
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(status.assigned_proplet, None);
        assert_eq!(status.run_count, Some(1), "the stopped run stays counted");
        assert_eq!(condition(status, SUSPENDED).0, "True");
        assert_eq!(reasons(&plan), vec![(false, "Suspended")]);

        // Held: the next reconcile dispatches nothing and writes nothing.
        let mut held = task.clone();
        held.status = Some(status.clone());
        let again = plan_of(&held, &observed);
        assert_eq!(again.status, None, "{:?}", again.status);
        assert!(again.starts.is_empty() && again.stops.is_empty());
        assert!(again.notes.is_empty());
    }

    fn plan_of(task: &Task, observed: &TaskObservations) -> TaskPlan {
        plan(task, observed, &settings(), now())
    }

    #[test]
    fn a_resumed_task_is_dispatched_again_and_says_so() {
        let observed = observing(vec![proplet("edge", "edge-client")]);
        let first = plan_of(&suspended(task_value()), &observed);
        assert!(first.starts.is_empty() && first.chosen.is_none());
        let mut resumed = new_task();
        resumed.metadata.finalizers = Some(vec![TASK_FINALIZER.to_owned()]);
        resumed.status = first.status.clone();
        let plan = plan_of(&resumed, &observed);
        let status = written(&plan);
        assert_eq!(condition(status, SUSPENDED).0, "False");
        assert_eq!(status.assigned_proplet.as_deref(), Some("edge"));
        assert!(reasons(&plan).contains(&(false, "Resumed")));
    }

    #[test]
    fn suspending_a_finished_task_changes_nothing() {
        let task = suspended(finalized(
            task_value(),
            json!({
                "phase": "completed", "assignedProplet": "edge", "createdAt": at(9, 0, 0),
                "finishedAt": at(9, 30, 0), "results": "42", "observedGeneration": 1
            }),
        ));
        let plan = plan_of(&task, &observing(vec![proplet("edge", "edge-client")]));
        assert_eq!(plan, TaskPlan::default());
    }

    #[test]
    fn a_suspended_task_running_as_a_job_suspends_its_job() {
        let mut status = running_status("cluster", at(9, 50, 0));
        status["phase"] = json!("running");
        let task = suspended(finalized(task_value(), status));
        let plan = plan_of(&task, &observing(vec![k8s_proplet("cluster")]));
        assert!(plan.create_job, "the Job is brought in line: suspended");
        assert_eq!(written(&plan).phase, TaskPhase::Pending);
    }

    // 12. Retries.

    fn failing_run(limit: i32, retries: Option<i32>) -> (Task, TaskObservations) {
        let mut status = running_status("edge", at(9, 50, 0));
        if let Some(n) = retries {
            status["retries"] = json!(n);
            status["runCount"] = json!(n + 1);
        }
        let mut v = finalized(task_value(), status);
        v["spec"]["backoffLimit"] = json!(limit);
        v["spec"]["backoffSeconds"] = json!(5);
        let mut observed = observing(vec![proplet("edge", "edge-client")]);
        observed.results = vec![result("edge-client", json!(""), Some("wasm trap"))];
        (task_from(v), observed)
    }

    #[test]
    fn a_failed_run_under_the_backoff_limit_waits_and_runs_again() {
        let (task, observed) = failing_run(3, None);
        let plan = plan(&task, &observed, &settings(), now());
        let status = written(&plan);
        assert_eq!(status.phase, TaskPhase::Pending, "never Failed in between");
        assert_eq!(status.retries, Some(1));
        assert_eq!(status.retry_at, Some(at(10, 0, 5)));
        assert_eq!(
            status.failed_attempts,
            vec![FailedAttempt {
                run: 1,
                error: "wasm trap".into(),
                finished_at: now()
            }]
        );
        assert_eq!(condition(status, SCHEDULED).1, "BackingOff");
        assert!(reasons(&plan).contains(&(true, "BackOff")));
        assert_eq!(plan.requeue_at, Some(at(10, 0, 5)));

        // Before the backoff has passed nothing is dispatched; after it, the next run.
        let mut waiting_task = task.clone();
        waiting_task.status = Some(status.clone());
        let early = plan_of(
            &waiting_task,
            &observing(vec![proplet("edge", "edge-client")]),
        );
        assert!(early.starts.is_empty() && early.chosen.is_none());
        let due = super::plan(
            &waiting_task,
            &observing(vec![proplet("edge", "edge-client")]),
            &settings(),
            at(10, 0, 6),
        );
        assert_eq!(due.chosen.as_deref(), Some("edge"));
    }

    #[test]
    fn each_retry_waits_twice_as_long_and_the_last_failure_is_final() {
        let (task, observed) = failing_run(3, Some(2));
        let third = plan(&task, &observed, &settings(), now());
        let status = written(&third);
        assert_eq!(status.retries, Some(3));
        assert_eq!(status.retry_at, Some(at(10, 0, 20)), "5 s doubled twice");
        let (task, observed) = failing_run(3, Some(3));
        let last = plan(&task, &observed, &settings(), now());
        let status = written(&last);
        assert_eq!(status.phase, TaskPhase::Failed);
        assert_eq!(status.retries, Some(3));
        assert_eq!(status.error.as_deref(), Some("wasm trap"));
    }

    #[test]
    fn without_a_backoff_limit_a_failure_is_final() {
        let (mut task, observed) = failing_run(0, None);
        task.spec.backoff_limit = None;
        let status = written(&plan(&task, &observed, &settings(), now())).clone();
        assert_eq!(status.phase, TaskPhase::Failed);
        assert_eq!(status.retries, None);
    }

    // Daemons that move off an Offline proplet, and the fence on the run they leave.

    /// A daemon running on `proplet` (run 1) that tolerates 60 s of it Offline.
    fn daemon_on(proplet: &str) -> Value {
        let mut v = finalized(task_value(), running_status(proplet, at(8, 0, 0)));
        v["spec"]["daemon"] = json!(true);
        v["spec"]["offlineTolerationSeconds"] = json!(60);
        v
    }

    /// The Running external proplet `name`, Offline since `since`.
    fn offline(name: &str, since: DateTime<Utc>) -> PropletView {
        let mut v = proplet_value(name, &format!("{name}-client"));
        v["status"] = json!({"phase": "Offline", "conditions": [{
            "type": "Ready", "status": "False", "reason": "PropletOffline",
            "message": "external proplet is offline", "lastTransitionTime": since
        }]});
        proplet_view(&proplet_from(v), 0)
    }

    #[test]
    fn a_daemon_waits_out_its_toleration_then_moves_and_leaves_its_run_fenced() {
        let task = task_from(daemon_on("a"));
        let observed = observing(vec![offline("a", at(9, 59, 30))]);
        let early = plan(&task, &observed, &settings(), now());
        assert_eq!(early.status, None, "within its toleration: {early:?}");
        assert_eq!(early.requeue_at, Some(at(10, 0, 30)));

        let moved = plan(&task, &observed, &settings(), at(10, 0, 30));
        let status = written(&moved);
        assert_eq!(status.phase, TaskPhase::Pending);
        assert_eq!(status.assigned_proplet, None);
        assert_eq!(status.run_count, Some(1), "the next dispatch numbers run 2");
        assert_eq!(
            status.displaced_runs,
            vec![crate::crd::task::DisplacedRun {
                proplet: "a".into(),
                run: 1,
                displaced_at: at(10, 0, 30),
            }]
        );
        assert!(moved.notes.iter().any(|n| n.reason == "Relocated"));
        assert!(moved.starts.is_empty(), "placed at the next reconcile");
        assert!(moved.stops.is_empty(), "nothing reaches an Offline proplet");
        assert_eq!(moved.requeue_at, Some(at(10, 0, 30)));
    }

    #[test]
    fn a_daemon_whose_proplet_is_not_observed_is_not_moved() {
        let task = task_from(daemon_on("a"));
        let plan = plan(&task, &observing(Vec::new()), &settings(), at(23, 0, 0));
        assert!(
            plan.status
                .as_ref()
                .is_none_or(|s| s.phase == TaskPhase::Running && s.displaced_runs.is_empty()),
            "{plan:?}"
        );
    }

    #[test]
    fn a_pinned_daemon_or_a_plain_task_stays_on_its_offline_proplet() {
        let mut pinned = daemon_on("a");
        pinned["spec"]["propletSelector"] = json!({"propletId": "a"});
        let mut plain = daemon_on("a");
        plain["spec"]["daemon"] = json!(false);
        plain["status"]["startedAt"] = json!(at(9, 59, 0));
        let observed = observing(vec![offline("a", at(9, 0, 0))]);
        for v in [pinned, plain] {
            let plan = plan(&task_from(v), &observed, &settings(), now());
            assert!(
                plan.status
                    .as_ref()
                    .is_none_or(|s| s.phase != TaskPhase::Pending),
                "{plan:?}"
            );
        }
    }

    #[test]
    fn a_displaced_run_is_stopped_once_its_proplet_is_back_and_its_results_are_refused() {
        let mut v = daemon_on("b");
        v["status"]["runCount"] = json!(2);
        v["status"]["displacedRuns"] =
            json!([{"proplet": "a", "run": 1, "displacedAt": at(9, 0, 0)}]);
        let task = task_from(v);
        // Still Offline: kept, nothing sent.
        let away = plan(
            &task,
            &observing(vec![proplet("b", "b-client"), offline("a", at(8, 59, 0))]),
            &settings(),
            now(),
        );
        assert!(away.stops.is_empty(), "{away:?}");
        assert_eq!(
            away.requeue_at,
            Some(at(10, 0, 10)),
            "looks again for its return"
        );
        assert!(away
            .status
            .as_ref()
            .is_none_or(|s| s.displaced_runs.len() == 1));

        // Back: a stop to it alone, and the run forgotten; its result is not taken.
        let mut observed = observing(vec![proplet("b", "b-client"), proplet("a", "a-client")]);
        observed.results = vec![result("a-client", json!("stale"), None)];
        let back = plan(&task, &observed, &settings(), now());
        assert_eq!(back.stops.len(), 1, "{back:?}");
        assert_eq!(
            back.stops[0].request.proplet_id.as_deref(),
            Some("a-client")
        );
        let status = written(&back);
        assert!(status.displaced_runs.is_empty());
        assert_eq!(status.phase, TaskPhase::Running, "b still runs it");
        assert_eq!(status.assigned_proplet.as_deref(), Some("b"));
        assert_eq!(
            status.results, None,
            "the displaced run's result is refused"
        );
        assert!(back.notes.iter().any(|n| n.reason == "Fenced"));
        assert!(back.notes.iter().any(|n| n.reason == "ResultIgnored"));

        // Missing from the observations (not listed yet after a restart): waited for; a day
        // later, forgotten.
        let unseen = plan(
            &task,
            &observing(vec![proplet("b", "b-client")]),
            &settings(),
            now(),
        );
        assert!(unseen.stops.is_empty());
        assert!(unseen.status.is_none(), "{unseen:?}");
        let later = plan(
            &task,
            &observing(vec![proplet("b", "b-client")]),
            &settings(),
            at(10, 0, 0) + chrono::Duration::days(1),
        );
        assert!(written(&later).displaced_runs.is_empty());
    }

    #[test]
    fn a_displaced_run_on_the_proplet_the_daemon_returns_to_is_replaced_not_stopped() {
        let mut v = daemon_on("a");
        v["status"]["displacedRuns"] =
            json!([{"proplet": "a", "run": 1, "displacedAt": at(9, 0, 0)}]);
        v["status"]["runCount"] = json!(2);
        let plan = plan(
            &task_from(v),
            &observing(vec![proplet("a", "a-client")]),
            &settings(),
            now(),
        );
        assert!(plan.stops.is_empty(), "{plan:?}");
        assert!(written(&plan).displaced_runs.is_empty());
    }
}
