//! What a Task reconcile observes besides the Task itself: the proplets it may go to, the
//! reports and Job outcome waiting for it, its image resolution, and the lookups the drivers
//! build these from (their caches and indexes).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde_json::Value;

use super::scheduler::{CandidateProplet, RoundRobinState};
use crate::crd::common::MetricsSample;
use crate::crd::proplet::PropletType;
use crate::crd::task::{Task, TaskPhase};

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
    /// When it went Offline, by propeller's clock (its `Ready` condition turning false),
    /// while it is Offline.
    pub offline_since: Option<DateTime<Utc>>,
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
    /// When this process published the start of the current run (None: not by this
    /// process, which after a restart means it may have to be sent again).
    pub dispatched_at: Option<DateTime<Utc>>,
    /// Round-robin memory of the scheduler.
    pub round_robin: RoundRobinState,
    /// The Kubernetes Job of a task running on a `k8s` proplet, once the driver saw it.
    pub job: Option<JobOutcome>,
    /// The registry resolution of this run's OCI `imageUrl`, once asked for.
    pub image: Option<ImageObservation>,
}

/// Where the registry resolution of a run's OCI `imageUrl` stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageObservation {
    /// Asked for, not finished.
    Resolving,
    /// The manifest digest, with the Wasm layer cached and ready to serve.
    Resolved {
        /// `sha256:…` of the manifest.
        digest: String,
    },
    /// Why the image cannot be used.
    Failed(String),
}

/// Whether the task's binary comes from an OCI registry through propeller (not inline, not
/// an HTTP(S) URL the device fetches itself).
pub fn needs_image_resolution(task: &Task) -> bool {
    task.spec.file.as_deref().is_none_or(str::is_empty)
        && task
            .spec
            .image_url
            .as_deref()
            .and_then(crate::image_reference::registry_reference)
            .is_some()
}

/// What the driver saw of the Kubernetes Job that runs a task on a `k8s` proplet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobOutcome {
    /// Still running (or not started).
    Running,
    /// Finished successfully; the result found by the extraction order, if any.
    Succeeded {
        /// The extracted result.
        result: Option<String>,
    },
    /// Failed for good.
    Failed {
        /// Why, from the Job's conditions.
        message: String,
    },
}

/// Which proplets a plan for a task reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PropletScope {
    /// The proplets of the task's namespace that could take it now ([`could_take`]): the
    /// plan may schedule it, and chooses among these alone. When none could, the plan says
    /// so (`TaskPlan::no_candidates`) and is made again over [`PropletScope::Namespace`], so
    /// that its wait names why each proplet was passed over.
    Candidates,
    /// Every proplet of the task's namespace.
    Namespace,
    /// Only these, the proplets its run occupies (the plan addresses its starts and stops
    /// to them and checks its results' senders against them): a task that cannot be
    /// scheduled now costs the same whatever the fleet's size.
    Named(Vec<String>),
}

/// The proplets [`super::task::plan`] reads for `task`: only those its run occupies while
/// it is out (scheduled, running, being deleted) or finished for good; those that could take
/// it when it may be scheduled (new, pending, due to run again).
pub fn proplet_scope(task: &Task) -> PropletScope {
    let Some(status) = task.status.as_ref() else {
        return PropletScope::Candidates;
    };
    let rerun_asked = task
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(crate::crd::task::RERUN_ANNOTATION))
        .is_some_and(|token| !token.is_empty() && status.rerun_token.as_ref() != Some(token));
    let settled = status.phase.is_terminal() && !task.spec.is_recurring && !rerun_asked;
    let out = matches!(status.phase, TaskPhase::Scheduled | TaskPhase::Running);
    if task.metadata.deletion_timestamp.is_some() || out || settled {
        let mut names: Vec<String> = status
            .assigned_proplet
            .iter()
            .chain(&status.broadcast_proplets)
            .chain(status.displaced_runs.iter().map(|d| &d.proplet))
            .cloned()
            .collect();
        names.sort_unstable();
        names.dedup();
        PropletScope::Named(names)
    } else {
        PropletScope::Candidates
    }
}

/// Whether `proplet` could take `task` now by the scheduler's rules (its type, phase and the
/// task's selector, see [`super::scheduler::admits`]); `selector` is
/// [`super::task::selector_of`]`(task)`. Checked on the object itself, with no copy.
pub fn could_take(
    task: &Task,
    selector: &super::scheduler::SelectorView,
    proplet: &crate::crd::proplet::Proplet,
) -> bool {
    runs_on(task, proplet.spec.type_) && super::scheduler::admits(proplet, selector)
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
            attester: proplet
                .status
                .as_ref()
                .and_then(|s| s.metadata.as_ref())
                .and_then(|m| m.attester.clone()),
            active_tasks,
            capacity: proplet.spec.capacity,
        },
        client_id: proplet.client_id().to_owned(),
        domain: conn.domain().unwrap_or_default().to_owned(),
        channel: conn.channel_id.clone(),
        offline_since: offline_since(proplet),
    }
}

/// When `proplet` went Offline, while it is: the time its `Ready` condition turned false.
fn offline_since(proplet: &crate::crd::proplet::Proplet) -> Option<DateTime<Utc>> {
    let status = proplet.status.as_ref()?;
    if status.phase != crate::crd::proplet::PropletPhase::Offline {
        return None;
    }
    crate::crd::common::find_condition(&status.conditions, "Ready")
        .filter(|c| c.status == "False")
        .and_then(|c| super::conditions::from_k8s_time(&c.last_transition_time))
}

/// A task's observations from what a driver's caches answer: the phase of a task of the
/// same namespace by name, the namespace's dependency graph (asked only when the task has
/// dependencies), and the views of the proplets the plan reads (see [`proplet_scope`]).
/// The inbox, ledger and Job parts are filled in by the driver state and the executor.
pub fn observe_indexed(
    task: &Task,
    phase_of: impl Fn(&str) -> Option<TaskPhase>,
    graph: impl FnOnce() -> super::dag::Graph,
    proplets: Vec<PropletView>,
) -> TaskObservations {
    let dependencies = task
        .spec
        .depends_on
        .iter()
        .filter_map(|dep| phase_of(dep).map(|phase| (dep.clone(), phase)))
        .collect();
    let cycle = if task.spec.depends_on.is_empty() {
        None
    } else {
        super::dag::cycle_through(&graph(), task.metadata.name.as_deref().unwrap_or_default())
    };
    TaskObservations {
        proplets,
        dependencies,
        cycle,
        ..TaskObservations::default()
    }
}

/// The proplets `task` occupies now (see [`occupies`]), each once.
pub fn occupied(task: &Task) -> Vec<&str> {
    let Some(status) = task.status.as_ref() else {
        return Vec::new();
    };
    if !matches!(status.phase, TaskPhase::Scheduled | TaskPhase::Running) {
        return Vec::new();
    }
    let mut names: Vec<&str> = status
        .assigned_proplet
        .as_deref()
        .into_iter()
        .chain(status.broadcast_proplets.iter().map(String::as_str))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Whether `task` occupies proplet `name` now (it counts towards the proplet's `taskCount`).
pub fn occupies(task: &Task, name: &str) -> bool {
    task.status.as_ref().is_some_and(|s| {
        matches!(s.phase, TaskPhase::Scheduled | TaskPhase::Running)
            && (s.assigned_proplet.as_deref() == Some(name)
                || s.broadcast_proplets.iter().any(|p| p == name))
    })
}

/// Whether a proplet of this type can run `task`: a `k8s` proplet runs it as a Kubernetes Job
/// of `imageUrl`, so it needs an image and cannot take part in a broadcast.
pub fn runs_on(task: &Task, proplet_type: PropletType) -> bool {
    match proplet_type {
        PropletType::External => true,
        PropletType::K8s => task.spec.image_url.is_some() && !task.spec.broadcast,
    }
}
