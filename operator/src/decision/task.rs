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

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use propeller_broker::protocol::{MonitoringProfile as WireProfile, StartRequest, StopRequest};
use serde_json::{Map, Value};

use super::conditions::{remove_condition, set_condition, DesiredCondition};
use super::dag::{evaluate, Readiness};
use super::recurrence::{gate, rerun_at, ScheduleGate};
use super::scheduler::{
    filter_candidates, select_proplet, CandidateProplet, RoundRobinState, SelectorView, Strategy,
};
use crate::crd::common::MetricsSample;
use crate::crd::proplet::PropletType;
use crate::crd::task::{RunIf, Task, TaskPhase, TaskStatus, RERUN_ANNOTATION, TASK_FINALIZER};

/// Condition: a proplet has been assigned.
pub const SCHEDULED: &str = "Scheduled";
/// Condition: the start was sent.
pub const STARTED: &str = "Started";
/// Condition: the task finished successfully.
pub const COMPLETED: &str = "Completed";

/// How often a task that waits for a proplet looks again even without an event.
pub const NO_CANDIDATE_RETRY: Duration = Duration::from_secs(30);

/// Operator settings the Task plan depends on.
#[derive(Debug, Clone, Copy)]
pub struct TaskSettings {
    /// Scoring strategy of the scheduler.
    pub strategy: Strategy,
    /// Time limit for tasks without `spec.timeoutSeconds` (daemons are exempt).
    pub default_timeout: Duration,
}

/// A proplet the task may be sent to, with the identity its messages carry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PropletView {
    /// What the scheduler matches against.
    pub candidate: CandidateProplet,
    /// The MQTT client id (`connectionConfig.clientId`), which results are checked against.
    pub client_id: String,
    /// Topic domain of the proplet.
    pub domain: String,
    /// Topic channel of the proplet.
    pub channel: String,
}

/// A result the broker received for this task and the status does not hold yet.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportedResult {
    /// The authenticated MQTT client id that sent it.
    pub client_id: String,
    /// `results` as sent (a string for ordinary tasks, an object for FL envelopes).
    pub value: Value,
    /// The reported error, if any (an empty string is no error).
    pub error: Option<String>,
}

/// What the driver knows beyond the Task object.
#[derive(Debug, Clone, Default)]
pub struct TaskObservations {
    /// Proplets of the task's namespace.
    pub proplets: Vec<PropletView>,
    /// Phases of the tasks named in `dependsOn` that exist.
    pub dependencies: BTreeMap<String, TaskPhase>,
    /// A dependency cycle through this task, as a path.
    pub cycle: Option<Vec<String>>,
    /// Results received and not yet written, in arrival order.
    pub results: Vec<ReportedResult>,
    /// The latest task metrics received and not yet written.
    pub metrics: Option<MetricsSample>,
    /// The start of the current run was already published by this process.
    pub dispatched: bool,
    /// Round-robin memory of the scheduler.
    pub round_robin: RoundRobinState,
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
    fn normal(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warning: false,
            reason,
            message: message.into(),
        }
    }

    fn warning(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            warning: true,
            reason,
            message: message.into(),
        }
    }
}

/// What to do for one task now. The executor applies, in order: finalizer, `status`,
/// `starts` (only if `status` was written or is `None`), `after_dispatch`, `stops`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskPlan {
    /// Finalizer change.
    pub finalizer: Option<FinalizerChange>,
    /// Status to write first.
    pub status: Option<TaskStatus>,
    /// Starts to publish once `status` is persisted.
    pub starts: Vec<StartCommand>,
    /// Status to write after the starts went out.
    pub after_dispatch: Option<TaskStatus>,
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
    /// Events for users.
    pub notes: Vec<Note>,
}

/// The identity results of a proplet carry: its client id, or its name when unknown.
fn client_of<'a>(observed: &'a TaskObservations, proplet: &'a str) -> &'a str {
    observed
        .proplets
        .iter()
        .find(|p| p.candidate.name == proplet)
        .map_or(proplet, |p| p.client_id.as_str())
}

fn view<'a>(observed: &'a TaskObservations, proplet: &str) -> Option<&'a PropletView> {
    observed
        .proplets
        .iter()
        .find(|p| p.candidate.name == proplet)
}

/// The selector in the scheduler's terms.
pub fn selector_of(task: &Task) -> SelectorView {
    let sel = task.spec.proplet_selector.clone().unwrap_or_default();
    SelectorView {
        proplet_id: sel.proplet_id.filter(|s| !s.is_empty()),
        match_labels: sel.match_labels,
        match_device_types: sel.match_device_types,
        match_capabilities: sel.match_capabilities,
        preferred_type: task.spec.preferred_proplet_type,
    }
}

/// The start message for `target` (`None` builds the upstream-style broadcast start).
pub fn start_request(task: &Task, target: Option<&PropletView>) -> StartRequest {
    let spec = &task.spec;
    let uid = task.metadata.uid.clone().unwrap_or_default();
    let mut env = spec.env.clone();
    if let Some(t) = target {
        env.insert("PROPLET_ID".into(), t.client_id.clone());
        env.insert("TASK_ID".into(), uid.clone());
    }
    let monitoring_profile = spec.monitoring_profile.as_ref().map(|m| {
        let interval_secs = m
            .interval
            .as_deref()
            .and_then(|s| propeller_broker::protocol::parse_duration(s).ok())
            .map_or(10, |d| d.as_secs().max(1));
        WireProfile {
            enabled: m.enabled,
            interval_secs,
            collect_cpu: m.collect_cpu,
            collect_memory: m.collect_memory,
            collect_disk_io: m.collect_disk_io,
            collect_threads: m.collect_threads,
            collect_file_descriptors: m.collect_file_descriptors,
            export_to_mqtt: m.export_to_mqtt,
            retain_history: m.retain_history,
            history_size: m.history_size.map_or(0, |n| n.max(0) as u64),
        }
    });
    let file = spec.file.as_deref().and_then(|b64| {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.decode(b64).ok()
    });
    let metadata = match &spec.metadata {
        Some(Value::Object(map)) => Some(map.clone()),
        _ => None,
    };
    StartRequest {
        id: uid,
        name: spec
            .function_name
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| task.metadata.name.clone().unwrap_or_default()),
        state: 1,
        image_url: spec.image_url.clone(),
        file,
        inputs: spec
            .inputs
            .iter()
            .map(|i| match i {
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(n) => n.to_string(),
                k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::String(s) => s.clone(),
            })
            .collect(),
        cli_args: spec.cli_args.clone(),
        broadcast: target.is_none(),
        daemon: spec.daemon,
        latent: false,
        env,
        encrypted: spec.encrypted,
        kbs_resource_path: spec.kbs_resource_path.clone(),
        monitoring_profile,
        proplet_id: target.map(|t| t.client_id.clone()),
        hal_storage_path: spec.hal_storage_path.clone(),
        mode: spec.mode.map(|m| m.as_str().to_owned()),
        kind: Some(spec.kind.as_str().to_owned()),
        priority: Some(i64::from(spec.priority)),
        metadata,
        parent_results: None,
    }
}

fn stop_for(task: &Task, target: &PropletView) -> StopCommand {
    StopCommand {
        domain: target.domain.clone(),
        channel: target.channel.clone(),
        request: StopRequest::new(
            task.metadata.uid.clone().unwrap_or_default(),
            task.metadata.name.clone().unwrap_or_default(),
            Some(target.client_id.clone()),
        ),
    }
}

fn start_for(task: &Task, target: &PropletView) -> StartCommand {
    StartCommand {
        proplet: target.candidate.name.clone(),
        domain: target.domain.clone(),
        channel: target.channel.clone(),
        request: start_request(task, Some(target)),
    }
}

/// Proplets the current run was sent to.
fn targets_of(status: &TaskStatus) -> Vec<String> {
    if !status.broadcast_proplets.is_empty() {
        status.broadcast_proplets.clone()
    } else {
        status.assigned_proplet.iter().cloned().collect()
    }
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
    remove_condition(&mut status.conditions, SCHEDULED);
    remove_condition(&mut status.conditions, STARTED);
    remove_condition(&mut status.conditions, COMPLETED);
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
        if has_finalizer {
            plan.finalizer = Some(FinalizerChange::Remove);
        }
        if desired != written {
            plan.status = Some(desired);
        }
        return plan;
    }
    if !has_finalizer {
        plan.finalizer = Some(FinalizerChange::Add);
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

    match desired.phase {
        TaskPhase::Pending => plan_pending(task, observed, settings, now, &mut desired, &mut plan),
        TaskPhase::Scheduled => plan_scheduled(task, observed, now, &mut desired, &mut plan),
        TaskPhase::Running => plan_running(task, observed, settings, now, &mut desired, &mut plan),
        _ => {}
    }

    desired.observed_generation = gen;
    if let Some(after) = plan.after_dispatch.as_mut() {
        after.observed_generation = gen;
    }
    if desired != written || plan.after_dispatch.is_some() {
        desired.updated_at = Some(now);
        plan.status = Some(desired);
    }
    if let Some(after) = plan.after_dispatch.as_mut() {
        after.updated_at = Some(now);
    }
    plan
}

fn plan_pending(
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
            .map(|t| DateTime::<Utc>::from_timestamp(t.0.as_second(), 0).unwrap_or(now)))
        .unwrap_or(now);
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
        .filter(|p| p.candidate.proplet_type == PropletType::External)
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
            waiting(desired, "NoCandidates", message, gen, now);
            plan.requeue_at = Some(now + NO_CANDIDATE_RETRY);
            return;
        }
    };
    if let Some(f) = following {
        desired.next_run = f;
    }
    desired.phase = TaskPhase::Scheduled;
    desired.run_count = Some(desired.run_count.unwrap_or(0) + 1);
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
    plan.notes.push(Note::normal(
        "Scheduled",
        format!("assigned to {}", names.join(", ")),
    ));
    dispatch(task, observed, now, desired, plan);
}

/// Sends the starts for a run whose assignment is (about to be) persisted.
fn dispatch(
    task: &Task,
    observed: &TaskObservations,
    now: DateTime<Utc>,
    desired: &TaskStatus,
    plan: &mut TaskPlan,
) {
    let gen = task.metadata.generation;
    let mut after = desired.clone();
    let mut missing = Vec::new();
    if !observed.dispatched {
        for name in targets_of(desired) {
            match view(observed, &name) {
                Some(target) => plan.starts.push(start_for(task, target)),
                None => missing.push(name),
            }
        }
    }
    if !missing.is_empty() {
        // The assigned proplet disappeared between assignment and start: fail rather than
        // choose another, so a start can never reach two proplets.
        finish(
            &mut after,
            TaskPhase::Failed,
            Some(format!(
                "assigned proplet(s) {} no longer exist",
                missing.join(", ")
            )),
            gen,
            now,
        );
        plan.starts.clear();
        plan.after_dispatch = Some(after);
        return;
    }
    after.phase = TaskPhase::Running;
    after.started_at = Some(now);
    set_condition(
        &mut after.conditions,
        &DesiredCondition::new(
            STARTED,
            true,
            "StartSent",
            "the start was sent to the proplet",
        ),
        gen,
        now,
    );
    plan.after_dispatch = Some(after);
}

fn plan_scheduled(
    task: &Task,
    observed: &TaskObservations,
    now: DateTime<Utc>,
    desired: &mut TaskStatus,
    plan: &mut TaskPlan,
) {
    let snapshot = desired.clone();
    dispatch(task, observed, now, &snapshot, plan);
}

fn plan_running(
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
    let targets = targets_of(desired);
    let broadcast = !desired.broadcast_proplets.is_empty();
    for (i, result) in observed.results.iter().enumerate() {
        plan.consumed_results = i + 1;
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
        plan.notes.push(if desired.phase == TaskPhase::Completed {
            Note::normal("Completed", "the task finished successfully")
        } else {
            Note::warning("Failed", desired.error.clone().unwrap_or_default())
        });
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
    let limit = task
        .spec
        .timeout_seconds
        .and_then(|s| u64::try_from(s).ok())
        .map_or(settings.default_timeout, Duration::from_secs);
    let started = desired.started_at.unwrap_or(now);
    let deadline = started + chrono::Duration::from_std(limit).unwrap_or(chrono::Duration::MAX);
    if now >= deadline {
        let message = format!("no result within the time limit of {}s", limit.as_secs());
        for name in &targets {
            if let Some(target) = view(observed, name) {
                plan.stops.push(stop_for(task, target));
            }
        }
        finish(desired, TaskPhase::Failed, Some(message.clone()), gen, now);
        plan.notes.push(Note::warning("TimedOut", message));
    } else {
        plan.requeue_at = Some(deadline);
    }
}

/// How a Proplet looks to the Task plan; `active_tasks` is counted by the driver.
pub fn proplet_view(proplet: &crate::crd::proplet::Proplet, active_tasks: u32) -> PropletView {
    let name = proplet.metadata.name.clone().unwrap_or_default();
    let conn = &proplet.spec.connection_config;
    let external = proplet.spec.external.clone().unwrap_or_default();
    PropletView {
        candidate: CandidateProplet {
            name: name.clone(),
            namespace: proplet
                .metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "default".into()),
            phase: proplet.status.as_ref().map(|s| s.phase).unwrap_or_default(),
            proplet_type: proplet.spec.type_,
            labels: proplet.metadata.labels.clone().unwrap_or_default(),
            device_type: external.device_type,
            capabilities: external.capabilities,
            active_tasks,
        },
        client_id: conn.client().unwrap_or(&name).to_owned(),
        domain: conn.domain().unwrap_or_default().to_owned(),
        channel: conn.channel_id.clone(),
    }
}

/// Whether `task` occupies proplet `name` now (it counts towards the proplet's `taskCount`).
pub fn occupies(task: &Task, name: &str) -> bool {
    task.status.as_ref().is_some_and(|s| {
        matches!(s.phase, TaskPhase::Scheduled | TaskPhase::Running)
            && (s.assigned_proplet.as_deref() == Some(name)
                || s.broadcast_proplets.iter().any(|p| p == name))
    })
}
