//! PropellerJob: which child Tasks must exist, and the job's phase and counts.
//!
//! Every inline task becomes a Task named `<job>-<task name>` (see
//! [`names::job_task_name`]), owned by the job, labelled with the job and annotated with its
//! index. All children are created up front in every mode; ordering comes from the DAG
//! rules the Task reconciler already applies:
//!
//! - `parallel`: only the dependencies the user wrote.
//! - `sequential`: each task also depends on the one before it (`runIf: success`), so the
//!   first failure skips everything after it, and the skip cascades.
//! - `configurable`: the dependencies the user wrote.
//!
//! In every mode a `dependsOn` entry naming a sibling is rewritten to that sibling's Task
//! name (upstream only did this in `configurable` mode). Entries that name no sibling refer
//! to Tasks of the namespace and are kept. Duplicate child names and dependency cycles among
//! siblings fail the job with a reason instead of leaving it pending forever.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::conditions::{set_condition, DesiredCondition};
use super::dag;
use super::names;
use super::task::Note;
use crate::crd::job::{ExecutionMode, JobPhase, PropellerJob, PropellerJobStatus};
use crate::crd::task::{RunIf, Task, TaskPhase, TaskSpec};
use crate::crd::PREFIX;

/// Label on child Tasks naming their job.
pub const JOB_LABEL: &str = "propeller.propeller.absmach.eu/job";
/// Annotation on child Tasks: index into `spec.tasks`.
pub const SPEC_INDEX_ANNOTATION: &str = "propeller.propeller.absmach.eu/spec-index";
/// Annotation on child Tasks: `spec.tasks[i].name`.
pub const SPEC_NAME_ANNOTATION: &str = "propeller.propeller.absmach.eu/spec-name";

/// What the reconciler observed about the job's children.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobObservation {
    /// Phases of existing owned Tasks, by Task name.
    pub children: BTreeMap<String, TaskPhase>,
    /// Phases of the `taskRefs` Tasks; `None` when a referenced Task does not exist.
    pub refs: BTreeMap<String, Option<TaskPhase>>,
    /// Owned Tasks whose `spec.suspend` is set.
    pub suspended: BTreeSet<String>,
    /// Whether the job may run now (Kueue's admission; see [`super::kueue`]).
    pub gate: Gate,
}

/// Whether a job may run, besides its own `spec.suspend`.
#[derive(Debug, Clone, PartialEq)]
pub enum Gate {
    /// It may: its tasks are restricted to the proplets carrying `node_labels` (the labels
    /// of the ResourceFlavor Kueue admitted it to; empty when not Kueue-managed).
    Open {
        node_labels: BTreeMap<String, String>,
    },
    /// It may not, for this reason (Kueue's words, e.g. `Pending` or `Preempted`).
    Held { reason: String, message: String },
}

impl Default for Gate {
    fn default() -> Self {
        Gate::Open {
            node_labels: BTreeMap::new(),
        }
    }
}

impl Gate {
    /// The node labels an open gate restricts the job's tasks to (none when held).
    pub fn node_labels(&self) -> BTreeMap<String, String> {
        match self {
            Gate::Open { node_labels } => node_labels.clone(),
            Gate::Held { .. } => BTreeMap::new(),
        }
    }
}

impl JobObservation {
    /// Whether a child's run is out on a device (scheduled or running).
    pub fn runs_out(&self) -> bool {
        self.children
            .values()
            .any(|p| matches!(p, TaskPhase::Scheduled | TaskPhase::Running))
    }
}

impl JobObservation {
    /// What `job` sees among `tasks` (its namespace's): its children by owner uid, and its
    /// `taskRefs` by name. A Task listed twice counts as its last listing, so a caller can
    /// put a fresher source after a staler one.
    pub fn of<'a>(job: &PropellerJob, tasks: impl IntoIterator<Item = &'a Task>) -> Self {
        let uid = job.metadata.uid.as_deref().unwrap_or_default();
        let wanted: BTreeSet<&str> = job.spec.task_refs.iter().map(String::as_str).collect();
        let mut observed = JobObservation {
            children: BTreeMap::new(),
            refs: job
                .spec
                .task_refs
                .iter()
                .map(|r| (r.clone(), None))
                .collect(),
            ..JobObservation::default()
        };
        for task in tasks {
            let name = task.metadata.name.clone().unwrap_or_default();
            let phase = task.status.as_ref().map(|s| s.phase).unwrap_or_default();
            let owned = task
                .metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == uid);
            if owned {
                observed.children.insert(name.clone(), phase);
                if task.spec.suspend {
                    observed.suspended.insert(name.clone());
                }
            }
            if wanted.contains(name.as_str()) {
                observed.refs.insert(name, Some(phase));
            }
        }
        observed
    }
}

/// The status to write after `plan`: the plan's, keeping the `createdAt` already written.
pub fn status_to_write(old: &PropellerJobStatus, plan: &JobPlan) -> PropellerJobStatus {
    let mut new = plan.status.clone();
    if old.created_at.is_some() {
        new.created_at = old.created_at;
    }
    new
}

/// What the executor must do for a job.
#[derive(Debug, Clone)]
pub struct JobPlan {
    /// Tasks to create (already complete objects: metadata, owner, labels, spec).
    pub create: Vec<Task>,
    /// The status to write.
    pub status: PropellerJobStatus,
    /// Owned Tasks to hold (`spec.suspend` set): the job is suspended.
    pub suspend: Vec<String>,
    /// Owned Tasks to release (`spec.suspend` cleared, the gate's node labels added to
    /// their selector): the job runs again.
    pub resume: Vec<String>,
    /// Events for users.
    pub notes: Vec<Note>,
}

impl JobPlan {
    fn only(status: PropellerJobStatus) -> Self {
        JobPlan {
            create: Vec::new(),
            status,
            suspend: Vec::new(),
            resume: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// Condition type on a job: it is held (by `spec.suspend` or by Kueue).
pub const SUSPENDED: &str = "Suspended";

/// `spec` restricted to proplets carrying `node_labels` (added to its selector's labels).
pub fn restrict(spec: &mut TaskSpec, node_labels: &BTreeMap<String, String>) {
    if node_labels.is_empty() {
        return;
    }
    let selector = spec.proplet_selector.get_or_insert_with(Default::default);
    for (key, value) in node_labels {
        selector.match_labels.insert(key.clone(), value.clone());
    }
}

/// Why a job's spec cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobSpecError {
    /// Two inline tasks map to the same Task name.
    #[error("tasks {first:?} and {second:?} would both be created as Task {child:?}; rename one")]
    DuplicateChild {
        /// First spec name.
        first: String,
        /// Second spec name.
        second: String,
        /// The shared child name.
        child: String,
    },
    /// The inline tasks depend on each other in a cycle.
    #[error("dependency cycle among the job's tasks: {}", .0.join(" -> "))]
    Cycle(Vec<String>),
}

/// The child Tasks a job must own, in spec order.
pub fn desired_children(job: &PropellerJob) -> Result<Vec<Task>, JobSpecError> {
    let job_name = job.metadata.name.clone().unwrap_or_default();
    let mut child_of: BTreeMap<&str, String> = BTreeMap::new();
    for t in &job.spec.tasks {
        let child = names::job_task_name(&job_name, &t.name);
        if let Some((first, _)) = child_of.iter().find(|(_, c)| **c == child) {
            return Err(JobSpecError::DuplicateChild {
                first: (*first).to_string(),
                second: t.name.clone(),
                child,
            });
        }
        child_of.insert(t.name.as_str(), child);
    }
    let mut children = Vec::with_capacity(job.spec.tasks.len());
    let mut graph = dag::Graph::new();
    for (index, t) in job.spec.tasks.iter().enumerate() {
        let name = names::job_task_name(&job_name, &t.name);
        let mut spec: TaskSpec = t.clone();
        let mut depends_on: Vec<String> = spec
            .depends_on
            .iter()
            .map(|d| {
                child_of
                    .get(d.as_str())
                    .cloned()
                    .unwrap_or_else(|| d.clone())
            })
            .collect();
        if job.spec.execution_mode == ExecutionMode::Sequential && index > 0 {
            if let Some(prev) = job.spec.tasks.get(index - 1) {
                let prev_child = names::job_task_name(&job_name, &prev.name);
                if !depends_on.contains(&prev_child) {
                    depends_on.push(prev_child);
                }
                spec.run_if = Some(RunIf::Success);
            }
        }
        spec.depends_on = depends_on.clone();
        spec.job_id = job.metadata.uid.clone();
        graph.insert(name.clone(), depends_on);
        children.push(Task {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: job.metadata.namespace.clone(),
                labels: Some(BTreeMap::from([(
                    JOB_LABEL.to_string(),
                    names::label_value(&job_name),
                )])),
                annotations: Some(BTreeMap::from([
                    (SPEC_INDEX_ANNOTATION.to_string(), index.to_string()),
                    (SPEC_NAME_ANNOTATION.to_string(), t.name.clone()),
                ])),
                owner_references: Some(vec![controller_ref(job)]),
                ..ObjectMeta::default()
            },
            spec,
            status: None,
        });
    }
    if let Some(cycle) = dag::find_cycle(&graph) {
        return Err(JobSpecError::Cycle(cycle));
    }
    Ok(children)
}

/// A controller owner reference to the job, so deleting the job deletes its Tasks.
pub fn controller_ref(job: &PropellerJob) -> OwnerReference {
    OwnerReference {
        api_version: format!("{}{}", PREFIX.trim_end_matches('/'), "/v1"),
        kind: "PropellerJob".to_string(),
        name: job.metadata.name.clone().unwrap_or_default(),
        uid: job.metadata.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// Decides the children to create and the status of a job.
pub fn reconcile(job: &PropellerJob, observed: &JobObservation, now: DateTime<Utc>) -> JobPlan {
    let mut status = job.status.clone().unwrap_or_default();
    let generation = job.metadata.generation;
    status.observed_generation = generation;
    status.created_at.get_or_insert(now);
    status.task_count =
        i32::try_from(job.spec.tasks.len() + job.spec.task_refs.len()).unwrap_or(i32::MAX);

    if matches!(status.phase, JobPhase::Completed | JobPhase::Failed) {
        return JobPlan::only(status);
    }

    let children = match desired_children(job) {
        Ok(children) => children,
        Err(e) => {
            status.phase = JobPhase::Failed;
            status.finish_time = Some(now);
            status.updated_at = Some(now);
            set_condition(
                &mut status.conditions,
                &DesiredCondition::new("Completed", false, "InvalidSpec", e.to_string()),
                generation,
                now,
            );
            return JobPlan::only(status);
        }
    };
    let held = if job.spec.suspend {
        Some((
            "Suspended".to_owned(),
            "spec.suspend is true: no task runs until it is false".to_owned(),
        ))
    } else {
        match &observed.gate {
            Gate::Held { reason, message } => Some((reason.clone(), message.clone())),
            Gate::Open { .. } => None,
        }
    };
    let mut plan = JobPlan::only(PropellerJobStatus::default());
    let was_held = super::conditions::is_true(&status.conditions, SUSPENDED);
    match (&held, &observed.gate) {
        (Some((reason, message)), _) => {
            plan.suspend = observed
                .children
                .iter()
                .filter(|(n, p)| !p.is_terminal() && !observed.suspended.contains(*n))
                .map(|(n, _)| n.clone())
                .collect();
            let change = set_condition(
                &mut status.conditions,
                &DesiredCondition::new(SUSPENDED, true, reason.clone(), message.clone()),
                generation,
                now,
            );
            if change == super::conditions::ConditionChange::Transition {
                plan.notes.push(Note::normal("Suspended", message.clone()));
            }
        }
        (None, gate) => {
            let node_labels = gate.node_labels();
            plan.create = children
                .into_iter()
                .filter(|c| {
                    c.metadata
                        .name
                        .as_ref()
                        .is_some_and(|n| !observed.children.contains_key(n))
                })
                .map(|mut c| {
                    restrict(&mut c.spec, &node_labels);
                    c
                })
                .collect();
            plan.resume = observed.suspended.iter().cloned().collect();
            if was_held {
                let message = "the job runs".to_owned();
                set_condition(
                    &mut status.conditions,
                    &DesiredCondition::new(SUSPENDED, false, "Resumed", message.clone()),
                    generation,
                    now,
                );
                plan.notes.push(Note::normal("Resumed", message));
            }
        }
    }

    let mut phases: Vec<(String, Option<TaskPhase>)> = Vec::new();
    for t in &job.spec.tasks {
        let child = names::job_task_name(job.metadata.name.as_deref().unwrap_or_default(), &t.name);
        let phase = observed.children.get(&child).copied();
        phases.push((child, phase));
    }
    for r in &job.spec.task_refs {
        phases.push((r.clone(), observed.refs.get(r).copied().flatten()));
    }
    let count = |p: TaskPhase| {
        i32::try_from(phases.iter().filter(|(_, x)| *x == Some(p)).count()).unwrap_or(i32::MAX)
    };
    status.completed_count = count(TaskPhase::Completed);
    status.failed_count = count(TaskPhase::Failed);
    status.skipped_count = count(TaskPhase::Skipped);
    status.interrupted_count = count(TaskPhase::Interrupted);
    let finished = phases
        .iter()
        .filter(|(_, p)| p.is_some_and(TaskPhase::is_terminal))
        .count();
    let missing_refs: Vec<&str> = job
        .spec
        .task_refs
        .iter()
        .filter(|r| observed.refs.get(*r).copied().flatten().is_none())
        .map(String::as_str)
        .collect();

    if status.phase == JobPhase::Pending && held.is_none() {
        status.phase = JobPhase::Running;
        status.start_time = Some(now);
    }
    status.updated_at = Some(now);
    let total = phases.len();
    let condition = if finished == total {
        status.finish_time = Some(now);
        let failed: Vec<&str> = phases
            .iter()
            .filter(|(_, p)| matches!(p, Some(TaskPhase::Failed | TaskPhase::Interrupted)))
            .map(|(n, _)| n.as_str())
            .collect();
        if failed.is_empty() {
            status.phase = JobPhase::Completed;
            DesiredCondition::new(
                "Completed",
                true,
                "AllTasksFinished",
                format!("{total} tasks finished without failure"),
            )
        } else {
            status.phase = JobPhase::Failed;
            DesiredCondition::new(
                "Completed",
                false,
                "TasksFailed",
                format!("failed or interrupted: {}", summarize(&failed)),
            )
        }
    } else if !missing_refs.is_empty() {
        DesiredCondition::new(
            "Completed",
            false,
            "TaskRefMissing",
            format!(
                "waiting for referenced Tasks that do not exist: {}",
                summarize(&missing_refs)
            ),
        )
    } else {
        DesiredCondition::new(
            "Completed",
            false,
            "TasksRunning",
            format!("{finished}/{total} tasks finished"),
        )
    };
    set_condition(&mut status.conditions, &condition, generation, now);
    plan.status = status;
    plan
}

fn summarize(names: &[&str]) -> String {
    const MAX: usize = 5;
    let shown = names
        .iter()
        .take(MAX)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX {
        format!("{shown} and {} more", names.len() - MAX)
    } else {
        shown
    }
}

/// Names of the children in spec order, for drivers that list owned Tasks.
pub fn child_names(job: &PropellerJob) -> BTreeSet<String> {
    let job_name = job.metadata.name.clone().unwrap_or_default();
    job.spec
        .tasks
        .iter()
        .map(|t| names::job_task_name(&job_name, &t.name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::common::find_condition;
    use crate::crd::job::PropellerJobSpec;
    use crate::decision::dag::{evaluate, Readiness};
    use chrono::TimeZone;

    fn now() -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000, 0).unwrap()
    }

    fn spec(name: &str, deps: &[&str]) -> TaskSpec {
        TaskSpec {
            name: name.into(),
            file: Some("AGFzbQEAAAA=".into()),
            depends_on: deps.iter().map(|d| d.to_string()).collect(),
            ..TaskSpec::default()
        }
    }

    fn job(mode: ExecutionMode, tasks: Vec<TaskSpec>, refs: &[&str]) -> PropellerJob {
        let mut j = PropellerJob::new(
            "etl",
            PropellerJobSpec {
                name: "etl".into(),
                execution_mode: mode,
                tasks,
                task_refs: refs.iter().map(|r| r.to_string()).collect(),
                suspend: false,
            },
        );
        j.metadata.namespace = Some("edge".into());
        j.metadata.uid = Some("uid-1".into());
        j.metadata.generation = Some(1);
        j
    }

    fn deps_of(plan: &JobPlan) -> Vec<(String, Vec<String>)> {
        plan.create
            .iter()
            .map(|t| (t.metadata.name.clone().unwrap(), t.spec.depends_on.clone()))
            .collect()
    }

    /// Runs the job's children to completion under the DAG rules, failing the named tasks.
    fn simulate(job: &PropellerJob, failing: &[&str]) -> BTreeMap<String, TaskPhase> {
        let children = desired_children(job).unwrap();
        let mut phases: BTreeMap<String, TaskPhase> = children
            .iter()
            .map(|c| (c.metadata.name.clone().unwrap(), TaskPhase::Pending))
            .collect();
        loop {
            let mut progressed = false;
            for c in &children {
                let name = c.metadata.name.clone().unwrap();
                if phases[&name] != TaskPhase::Pending {
                    continue;
                }
                let snapshot = phases.clone();
                let verdict =
                    evaluate(&c.spec.depends_on, c.spec.run_if.unwrap_or_default(), |d| {
                        snapshot.get(d).copied()
                    });
                let next = match verdict {
                    Readiness::Ready if failing.iter().any(|f| name.ends_with(f)) => {
                        TaskPhase::Failed
                    }
                    Readiness::Ready => TaskPhase::Completed,
                    Readiness::Skip { .. } => TaskPhase::Skipped,
                    Readiness::Wait { .. } => continue,
                };
                phases.insert(name, next);
                progressed = true;
            }
            if !progressed {
                return phases;
            }
        }
    }

    #[test]
    fn parallel_creates_everything_and_rewrites_sibling_dependencies() {
        let j = job(
            ExecutionMode::Parallel,
            vec![spec("a", &[]), spec("b", &["a", "outside"])],
            &[],
        );
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert_eq!(
            deps_of(&plan),
            vec![
                ("etl-a".into(), vec![]),
                ("etl-b".into(), vec!["etl-a".into(), "outside".into()])
            ]
        );
        let child = &plan.create[0];
        assert_eq!(child.spec.job_id.as_deref(), Some("uid-1"));
        assert_eq!(child.metadata.namespace.as_deref(), Some("edge"));
        assert_eq!(child.metadata.labels.as_ref().unwrap()[JOB_LABEL], "etl");
        assert_eq!(
            child.metadata.annotations.as_ref().unwrap()[SPEC_INDEX_ANNOTATION],
            "0"
        );
        let owner = &child.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("PropellerJob", "uid-1", Some(true))
        );
        assert_eq!(owner.api_version, "propeller.propeller.absmach.eu/v1");
        assert_eq!(plan.status.phase, JobPhase::Running);
        assert_eq!(plan.status.task_count, 2);
    }

    #[test]
    fn existing_children_are_not_created_again() {
        let j = job(
            ExecutionMode::Parallel,
            vec![spec("a", &[]), spec("b", &[])],
            &[],
        );
        let observed = JobObservation {
            children: BTreeMap::from([("etl-a".into(), TaskPhase::Running)]),
            ..Default::default()
        };
        let plan = reconcile(&j, &observed, now());
        assert_eq!(plan.create.len(), 1);
        assert_eq!(plan.create[0].metadata.name.as_deref(), Some("etl-b"));
    }

    #[test]
    fn sequential_chains_tasks_and_stops_at_the_first_failure() {
        let j = job(
            ExecutionMode::Sequential,
            vec![
                spec("a", &[]),
                spec("b", &[]),
                spec("c", &[]),
                spec("d", &[]),
            ],
            &[],
        );
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert_eq!(deps_of(&plan)[1].1, vec!["etl-a".to_string()]);
        assert_eq!(deps_of(&plan)[3].1, vec!["etl-c".to_string()]);
        let phases = simulate(&j, &["-b"]);
        assert_eq!(phases["etl-a"], TaskPhase::Completed);
        assert_eq!(phases["etl-b"], TaskPhase::Failed);
        assert_eq!(phases["etl-c"], TaskPhase::Skipped);
        assert_eq!(phases["etl-d"], TaskPhase::Skipped);
        let observed = JobObservation {
            children: phases,
            ..Default::default()
        };
        let plan = reconcile(&j, &observed, now());
        assert_eq!(plan.status.phase, JobPhase::Failed);
        assert_eq!(
            (
                plan.status.completed_count,
                plan.status.failed_count,
                plan.status.skipped_count
            ),
            (1, 1, 2)
        );
        let c = &plan.status.conditions[0];
        assert_eq!(
            (c.reason.as_str(), c.message.as_str()),
            ("TasksFailed", "failed or interrupted: etl-b")
        );
    }

    #[test]
    fn configurable_follows_the_dag_with_skip_cascade() {
        // a -> b (success), a -> c (runIf failure), b -> d
        let mut c = spec("c", &["a"]);
        c.run_if = Some(RunIf::Failure);
        let j = job(
            ExecutionMode::Configurable,
            vec![spec("a", &[]), spec("b", &["a"]), c, spec("d", &["b"])],
            &[],
        );
        let phases = simulate(&j, &[]);
        assert_eq!(phases["etl-b"], TaskPhase::Completed);
        assert_eq!(phases["etl-c"], TaskPhase::Skipped);
        assert_eq!(phases["etl-d"], TaskPhase::Completed);
        let plan = reconcile(
            &j,
            &JobObservation {
                children: phases,
                ..Default::default()
            },
            now(),
        );
        assert_eq!(
            plan.status.phase,
            JobPhase::Completed,
            "skips do not fail a job"
        );

        let phases = simulate(&j, &["-a"]);
        assert_eq!(phases["etl-b"], TaskPhase::Skipped);
        assert_eq!(phases["etl-c"], TaskPhase::Completed);
        assert_eq!(
            phases["etl-d"],
            TaskPhase::Skipped,
            "skip cascades down the graph"
        );
    }

    #[test]
    fn all_three_modes_complete_when_every_task_completes() {
        for mode in [
            ExecutionMode::Parallel,
            ExecutionMode::Sequential,
            ExecutionMode::Configurable,
        ] {
            let j = job(mode, vec![spec("a", &[]), spec("b", &[])], &[]);
            let phases = simulate(&j, &[]);
            let plan = reconcile(
                &j,
                &JobObservation {
                    children: phases,
                    ..Default::default()
                },
                now(),
            );
            assert_eq!(plan.status.phase, JobPhase::Completed, "{mode:?}");
            assert_eq!(plan.status.completed_count, 2);
            assert!(plan.status.finish_time.is_some());
        }
    }

    #[test]
    fn task_refs_count_and_missing_ones_are_reported() {
        let j = job(
            ExecutionMode::Parallel,
            vec![spec("a", &[])],
            &["wasm-addition"],
        );
        let observed = JobObservation {
            children: BTreeMap::from([("etl-a".into(), TaskPhase::Completed)]),
            refs: BTreeMap::from([("wasm-addition".into(), None)]),
            ..JobObservation::default()
        };
        let plan = reconcile(&j, &observed, now());
        assert_eq!(plan.status.phase, JobPhase::Running);
        assert_eq!(plan.status.conditions[0].reason, "TaskRefMissing");
        let observed = JobObservation {
            children: BTreeMap::from([("etl-a".into(), TaskPhase::Completed)]),
            refs: BTreeMap::from([("wasm-addition".into(), Some(TaskPhase::Interrupted))]),
            ..JobObservation::default()
        };
        let plan = reconcile(&j, &observed, now());
        assert_eq!(plan.status.phase, JobPhase::Failed);
        assert_eq!(plan.status.interrupted_count, 1);
        assert_eq!(plan.status.task_count, 2);
    }

    #[test]
    fn cycles_and_name_collisions_fail_the_job_with_a_reason() {
        let j = job(
            ExecutionMode::Configurable,
            vec![spec("a", &["b"]), spec("b", &["a"])],
            &[],
        );
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert_eq!(plan.status.phase, JobPhase::Failed);
        assert!(plan.create.is_empty());
        let c = &plan.status.conditions[0];
        assert_eq!(c.reason, "InvalidSpec");
        assert_eq!(
            c.message,
            "dependency cycle among the job's tasks: etl-a -> etl-b -> etl-a"
        );

        let j = job(
            ExecutionMode::Parallel,
            vec![spec("my_task", &[]), spec("my-task", &[])],
            &[],
        );
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert_eq!(plan.status.phase, JobPhase::Failed);
        assert!(plan.status.conditions[0]
            .message
            .contains("\"my_task\" and \"my-task\""));
    }

    #[test]
    fn a_finished_job_stays_finished() {
        let mut j = job(ExecutionMode::Parallel, vec![spec("a", &[])], &[]);
        j.status = Some(PropellerJobStatus {
            phase: JobPhase::Completed,
            ..Default::default()
        });
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert_eq!(plan.status.phase, JobPhase::Completed);
        assert!(
            plan.create.is_empty(),
            "a deleted child of a finished job is not recreated"
        );
    }

    #[test]
    fn an_empty_job_completes_at_once() {
        let j = job(ExecutionMode::Parallel, vec![], &[]);
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert_eq!(plan.status.phase, JobPhase::Completed);
    }

    #[test]
    fn the_observation_finds_children_by_owner_and_refs_by_name_with_later_listings_winning() {
        let j = job(
            ExecutionMode::Parallel,
            vec![spec("a", &[])],
            &["mine", "absent"],
        );
        let task = |name: &str, owner: Option<&str>, phase: TaskPhase| {
            let mut t = Task::new(name, TaskSpec::default());
            t.metadata.owner_references = owner.map(|uid| {
                vec![OwnerReference {
                    uid: uid.into(),
                    ..OwnerReference::default()
                }]
            });
            t.status = Some(crate::crd::task::TaskStatus {
                phase,
                ..Default::default()
            });
            t
        };
        let stale = task("etl-a", Some("uid-1"), TaskPhase::Running);
        let fresh = task("etl-a", Some("uid-1"), TaskPhase::Completed);
        let other = task("etl-b", Some("uid-2"), TaskPhase::Running);
        let referenced = task("mine", None, TaskPhase::Failed);
        let seen = JobObservation::of(&j, [&stale, &other, &referenced, &fresh]);
        assert_eq!(
            seen.children,
            BTreeMap::from([("etl-a".to_owned(), TaskPhase::Completed)])
        );
        assert_eq!(
            seen.refs,
            BTreeMap::from([
                ("absent".to_owned(), None),
                ("mine".to_owned(), Some(TaskPhase::Failed))
            ])
        );
    }

    #[test]
    fn the_first_created_at_is_kept_whatever_the_plan_says() {
        let j = job(ExecutionMode::Parallel, vec![spec("a", &[])], &[]);
        let plan = reconcile(&j, &JobObservation::default(), now());
        let first = PropellerJobStatus {
            created_at: Some(now() - chrono::Duration::hours(1)),
            ..PropellerJobStatus::default()
        };
        assert_eq!(status_to_write(&first, &plan).created_at, first.created_at);
        let mut without = plan.clone();
        without.status.created_at = None;
        assert_eq!(
            status_to_write(&first, &without).created_at,
            first.created_at
        );
        assert_eq!(
            status_to_write(&PropellerJobStatus::default(), &plan).created_at,
            plan.status.created_at
        );
    }

    #[test]
    fn a_held_job_creates_nothing_and_holds_the_children_still_out() {
        let j = job(
            ExecutionMode::Parallel,
            vec![spec("a", &[]), spec("b", &[]), spec("c", &[])],
            &[],
        );
        let fresh = JobObservation {
            gate: Gate::Held {
                reason: "Pending".into(),
                message: "insufficient quota".into(),
            },
            ..JobObservation::default()
        };
        let plan = reconcile(&j, &fresh, now());
        assert!(plan.create.is_empty());
        assert_eq!(plan.status.phase, JobPhase::Pending, "not started");
        let held = find_condition(&plan.status.conditions, SUSPENDED);
        assert_eq!(
            held.map(|c| (c.status.as_str(), c.reason.as_str(), c.message.as_str())),
            Some(("True", "Pending", "insufficient quota"))
        );
        assert_eq!(plan.notes.len(), 1);

        // Evicted while running: the children still out are held, the finished one kept.
        let evicted = JobObservation {
            children: BTreeMap::from([
                ("etl-a".into(), TaskPhase::Completed),
                ("etl-b".into(), TaskPhase::Running),
                ("etl-c".into(), TaskPhase::Pending),
            ]),
            suspended: BTreeSet::from(["etl-c".to_owned()]),
            gate: Gate::Held {
                reason: "Preempted".into(),
                message: "preempted".into(),
            },
            ..JobObservation::default()
        };
        let plan = reconcile(&j, &evicted, now());
        assert_eq!(plan.suspend, vec!["etl-b".to_owned()]);
        assert!(plan.create.is_empty() && plan.resume.is_empty());
    }

    #[test]
    fn an_open_job_resumes_its_held_children_on_the_flavors_proplets() {
        let mut j = job(
            ExecutionMode::Parallel,
            vec![spec("a", &[]), spec("b", &[])],
            &[],
        );
        let mut was = PropellerJobStatus::default();
        set_condition(
            &mut was.conditions,
            &DesiredCondition::new(SUSPENDED, true, "Pending", "waiting"),
            Some(1),
            now(),
        );
        j.status = Some(was);
        let labels = BTreeMap::from([("arch".to_owned(), "arm64".to_owned())]);
        let observed = JobObservation {
            children: BTreeMap::from([("etl-a".into(), TaskPhase::Pending)]),
            suspended: BTreeSet::from(["etl-a".to_owned()]),
            gate: Gate::Open {
                node_labels: labels.clone(),
            },
            ..JobObservation::default()
        };
        let plan = reconcile(&j, &observed, now());
        assert_eq!(plan.resume, vec!["etl-a".to_owned()]);
        assert_eq!(plan.create.len(), 1);
        let selector = plan.create[0]
            .spec
            .proplet_selector
            .clone()
            .unwrap_or_default();
        assert_eq!(selector.match_labels, labels);
        assert_eq!(plan.status.phase, JobPhase::Running);
        assert_eq!(
            find_condition(&plan.status.conditions, SUSPENDED).map(|c| c.status.as_str()),
            Some("False")
        );
    }

    #[test]
    fn spec_suspend_holds_a_job_whatever_its_gate() {
        let mut j = job(ExecutionMode::Parallel, vec![spec("a", &[])], &[]);
        j.spec.suspend = true;
        let plan = reconcile(&j, &JobObservation::default(), now());
        assert!(plan.create.is_empty());
        assert_eq!(
            find_condition(&plan.status.conditions, SUSPENDED).map(|c| c.reason.as_str()),
            Some("Suspended")
        );
    }
}
