//! The Task resource: one WebAssembly workload and its result.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    bounded_string_map, conditions_schema, free_form_json, int_or_string_list, Condition,
    MetricsSample, PropletResources, DURATION_PATTERN,
};

/// Desired state of a Task. The same shape is embedded in `PropellerJob.spec.tasks`, so
/// rules that only make sense for a stand-alone Task live on the root, not here.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "propeller.propeller.absmach.eu",
    version = "v1",
    kind = "Task",
    plural = "tasks",
    namespaced,
    status = "TaskStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode"}"#,
    printcolumn = r#"{"name":"Proplet","type":"string","jsonPath":".status.assignedProplet"}"#,
    printcolumn = r#"{"name":"Start Time","type":"date","jsonPath":".status.startedAt"}"#,
    printcolumn = r#"{"name":"Finish Time","type":"date","jsonPath":".status.finishedAt"}"#,
    printcolumn = r#"{"name":"Preferred Type","type":"string","jsonPath":".spec.preferredPropletType"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("!has(self.spec.dependsOn) || size(self.spec.dependsOn) == 0 || has(self.spec.workflowId) || has(self.spec.jobId)").message("workflowId or jobId is required when dependsOn is specified").field_path(".spec.workflowId")
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(has(self.encrypted) && self.encrypted) ? (has(self.imageUrl) && !has(self.file)) : (has(self.file) != has(self.imageUrl))").message("set exactly one of file or imageUrl; an encrypted task needs imageUrl and no file"))]
#[x_kube(validation = Rule::new("!(has(self.broadcast) && self.broadcast && has(self.propletSelector) && has(self.propletSelector.propletId))").message("broadcast must not be set when propletSelector.propletId is specified").field_path(".broadcast"))]
#[x_kube(validation = Rule::new("!(has(self.isRecurring) && self.isRecurring) || has(self.schedule)").message("schedule is required when isRecurring is true").field_path(".schedule"))]
pub struct TaskSpec {
    /// Human name of the task.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Exported Wasm function to call; the Task's name when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub function_name: Option<String>,
    /// `standard`, or `federated` for federated-learning rounds.
    #[serde(default)]
    pub kind: TaskKind,
    /// Wasm module, standard base64 with padding. Checked by a pattern, not `format: byte`:
    /// the API server hands `format: byte` strings to CEL rules decoded as URL-safe base64,
    /// so every module containing `/` or `+` would fail the spec's rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1500000), regex(pattern = BASE64_PATTERN))]
    pub file: Option<String>,
    /// OCI reference or http(s) URL of the Wasm module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048))]
    pub image_url: Option<String>,
    /// Arguments for WASI command modules.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 4096)))]
    pub cli_args: Vec<String>,
    /// Arguments of the function; numbers and strings are both accepted and sent as strings.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(schema_with = "int_or_string_list")]
    pub inputs: Vec<IntOrString>,
    /// Environment the module sees (never the agent's own).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "bounded_string_map::<64, 65536>")]
    pub env: BTreeMap<String, String>,
    /// Run on every candidate proplet instead of one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub broadcast: bool,
    /// Inference or training, forwarded to the proplet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<TaskMode>,
    /// Free-form JSON forwarded to the proplet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_json")]
    pub metadata: Option<serde_json::Value>,
    /// Which proplets may run the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proplet_selector: Option<PropletSelector>,
    /// Restricts the proplet type.
    #[serde(default)]
    pub preferred_proplet_type: PreferredPropletType,
    /// Pod resources for tasks run as Kubernetes Jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_requirements: Option<PropletResources>,
    /// Runs until stopped; exempt from the time limit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub daemon: bool,
    /// For a daemon: seconds its proplet may be Offline before the daemon is placed on
    /// another proplet that matches (300 when unset, as a pod's `tolerationSeconds` for an
    /// unreachable node; 0 moves it as soon as the proplet is Offline). A daemon pinned by
    /// `propletSelector.propletId` has nowhere else to go and stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub offline_toleration_seconds: Option<i64>,
    /// Seconds after the task finished (completed, failed, skipped or interrupted) at which
    /// it is deleted, as a Job's field of the same name: its results, status and Events go
    /// with it. Unset: kept until deleted. Not for recurring tasks, daemons, tasks of a
    /// workflow (`workflowId`) or tasks a job owns, whose lives their schedule or their
    /// job decides: the field is ignored there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 31536000))]
    pub ttl_seconds_after_finished: Option<i64>,
    /// Held: nothing is dispatched, and a run that is out is stopped (the task goes back to
    /// Pending and runs again once this is false). A PropellerJob sets it on its children
    /// while it is suspended or waiting for Kueue.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
    /// How many times a failed run is retried before the task fails (as a Job's
    /// `backoffLimit`); a failure is final when unset. Each retry is a new run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub backoff_limit: Option<i32>,
    /// Seconds before the first retry (10 when unset); each next retry waits twice as
    /// long, at most 6 minutes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 3600))]
    pub backoff_seconds: Option<i64>,
    /// Pod restart policy for tasks run as Kubernetes Jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<RestartPolicy>,
    /// The module is encrypted and must be fetched by `imageUrl`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub encrypted: bool,
    /// `kubernetes.io/dockerconfigjson` Secrets (in the task's namespace) holding the
    /// registry login for an OCI `imageUrl`; the operator's own login is used otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub image_pull_secrets: Vec<PullSecretRef>,
    /// Key Broker Service path for decrypting the module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub kbs_resource_path: Option<String>,
    /// Names of Tasks (in this namespace, or sibling names in a PropellerJob) to wait for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 253)))]
    pub depends_on: Vec<String>,
    /// Run when dependencies succeeded (default) or when one failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_if: Option<RunIf>,
    /// Groups tasks into a workflow.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub workflow_id: Option<String>,
    /// UID of the PropellerJob that created this task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub job_id: Option<String>,
    /// Five-field cron expression.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256))]
    pub schedule: Option<String>,
    /// Run again at every tick of `schedule`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_recurring: bool,
    /// IANA time zone of `schedule`.
    #[serde(default = "default_timezone")]
    #[schemars(length(min = 1, max = 64))]
    pub timezone: String,
    /// Dispatch order among waiting tasks; higher runs first.
    #[serde(default = "default_priority")]
    #[schemars(range(min = 0, max = 100))]
    pub priority: i32,
    /// Per-task metrics collection on the proplet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitoring_profile: Option<MonitoringProfile>,
    /// Root directory for HAL storage on the proplet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub hal_storage_path: Option<String>,
    /// Fails the task when no result came this long after its start, or after its assignment while its device is away; daemons are exempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 2592000))]
    pub timeout_seconds: Option<i64>,
}

/// The same defaults as a manifest that leaves the fields out gets (serde's), so objects the
/// operator builds itself (PropellerJob and federated-round tasks) pass the CRD's schema:
/// a derived default would give `timezone: ""`, which the API server refuses.
impl Default for TaskSpec {
    fn default() -> Self {
        Self {
            name: Default::default(),
            function_name: Default::default(),
            kind: Default::default(),
            file: Default::default(),
            image_url: Default::default(),
            cli_args: Default::default(),
            inputs: Default::default(),
            env: Default::default(),
            broadcast: Default::default(),
            mode: Default::default(),
            metadata: Default::default(),
            proplet_selector: Default::default(),
            preferred_proplet_type: Default::default(),
            resource_requirements: Default::default(),
            daemon: Default::default(),
            offline_toleration_seconds: None,
            ttl_seconds_after_finished: None,
            suspend: false,
            backoff_limit: None,
            backoff_seconds: None,
            restart_policy: Default::default(),
            encrypted: Default::default(),
            image_pull_secrets: Default::default(),
            kbs_resource_path: Default::default(),
            depends_on: Default::default(),
            run_if: Default::default(),
            workflow_id: Default::default(),
            job_id: Default::default(),
            schedule: Default::default(),
            is_recurring: Default::default(),
            timezone: default_timezone(),
            priority: default_priority(),
            monitoring_profile: None,
            hal_storage_path: None,
            timeout_seconds: None,
        }
    }
}

fn default_timezone() -> String {
    "UTC".to_string()
}

/// Default priority for tasks that do not set one.
pub const DEFAULT_PRIORITY: i32 = 50;

/// Standard base64 with padding, as Go's `base64.StdEncoding` (and so upstream's `[]byte`
/// field) accepts it.
pub const BASE64_PATTERN: &str =
    r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$";

fn default_priority() -> i32 {
    DEFAULT_PRIORITY
}

/// Whether a task is ordinary or part of a federated round.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    #[default]
    Standard,
    Federated,
}

impl TaskKind {
    /// The wire and YAML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskKind::Standard => "standard",
            TaskKind::Federated => "federated",
        }
    }
}

/// Purpose of the task, forwarded to the proplet.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum TaskMode {
    Infer,
    Train,
}

impl TaskMode {
    /// The wire and YAML spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskMode::Infer => "infer",
            TaskMode::Train => "train",
        }
    }
}

/// Proplet type a task may run on.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PreferredPropletType {
    K8s,
    External,
    #[default]
    Any,
}

/// When a dependent task runs.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RunIf {
    /// Every dependency completed.
    #[default]
    Success,
    /// At least one dependency failed, was skipped or was interrupted.
    Failure,
}

/// Kubernetes pod restart policy.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum RestartPolicy {
    Always,
    OnFailure,
    Never,
}

/// Which proplets may receive a task. Every set criterion must hold.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropletSelector {
    /// Name of one Proplet resource in the task's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub proplet_id: Option<String>,
    /// Labels the Proplet resource must carry.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "bounded_string_map::<32, 63>")]
    pub match_labels: BTreeMap<String, String>,
    /// Accepted device types; proplets without a device type never match.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 253)))]
    pub match_device_types: Vec<String>,
    /// Capabilities the proplet must all offer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 253)))]
    pub match_capabilities: Vec<String>,
}

/// Per-task metrics collection on the proplet.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MonitoringProfile {
    #[serde(default)]
    pub enabled: bool,
    /// Sampling period, e.g. `10s`; 10 s when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub interval: Option<String>,
    #[serde(default)]
    pub collect_cpu: bool,
    #[serde(default)]
    pub collect_memory: bool,
    #[serde(default)]
    pub collect_disk_io: bool,
    #[serde(default)]
    pub collect_threads: bool,
    #[serde(default)]
    pub collect_file_descriptors: bool,
    #[serde(default)]
    pub export_to_mqtt: bool,
    #[serde(default)]
    pub retain_history: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10000))]
    pub history_size: Option<i32>,
}

/// Lifecycle phase of a task; the decision core's `task_phase` lists the allowed moves.
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Hash,
    Default,
    PartialOrd,
    Ord,
    JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum TaskPhase {
    #[default]
    Pending,
    Scheduled,
    Running,
    Completed,
    Failed,
    Skipped,
    Interrupted,
}

impl TaskPhase {
    /// Every phase, for exhaustive tests and tables.
    pub const ALL: [TaskPhase; 7] = [
        TaskPhase::Pending,
        TaskPhase::Scheduled,
        TaskPhase::Running,
        TaskPhase::Completed,
        TaskPhase::Failed,
        TaskPhase::Skipped,
        TaskPhase::Interrupted,
    ];

    /// Finished phases: nothing more happens unless the task is retried or recurs.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskPhase::Completed | TaskPhase::Failed | TaskPhase::Skipped | TaskPhase::Interrupted
        )
    }

    /// `Some(true)` for success (completed), `Some(false)` for failure (failed, skipped,
    /// interrupted), `None` while unfinished. A skipped dependency counts as a failure, which
    /// is what makes skips cascade down a DAG.
    pub fn outcome(self) -> Option<bool> {
        match self {
            TaskPhase::Completed => Some(true),
            TaskPhase::Failed | TaskPhase::Skipped | TaskPhase::Interrupted => Some(false),
            TaskPhase::Pending | TaskPhase::Scheduled | TaskPhase::Running => None,
        }
    }

    /// Lower-case name as stored.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskPhase::Pending => "pending",
            TaskPhase::Scheduled => "scheduled",
            TaskPhase::Running => "running",
            TaskPhase::Completed => "completed",
            TaskPhase::Failed => "failed",
            TaskPhase::Skipped => "skipped",
            TaskPhase::Interrupted => "interrupted",
        }
    }
}

impl std::fmt::Display for TaskPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Secret of the task's namespace, by name.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
pub struct PullSecretRef {
    /// Secret name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// Observed state of a Task.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TaskStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: TaskPhase,
    /// Name of the Proplet resource running the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub assigned_proplet: Option<String>,
    /// Manifest digest an OCI `imageUrl` resolved to for this run: every device and retry
    /// of the run gets exactly these bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 200))]
    pub image_digest: Option<String>,
    /// Proplets a broadcast task was sent to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1000), inner(length(max = 253)))]
    pub broadcast_proplets: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime<Utc>>,
    /// Next tick of a scheduled task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_run: Option<DateTime<Utc>>,
    /// What the module returned; per proplet (an object keyed by proplet) for broadcast tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_json")]
    pub results: Option<serde_json::Value>,
    /// Why the task failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32768))]
    pub error: Option<String>,
    /// Scheduled, Started and Completed.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Latest metrics the proplet reported while running the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_metrics: Option<MetricsSample>,
    /// How many times the task has been dispatched (retries and recurrences count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_count: Option<i64>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The last value of the rerun annotation that was honoured, so one request runs once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub rerun_token: Option<String>,
    /// Failed runs retried so far (see `spec.backoffLimit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<i32>,
    /// When the next retry may start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_at: Option<DateTime<Utc>>,
    /// The failed runs that were retried, oldest first (the last 10).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub failed_attempts: Vec<FailedAttempt>,
    /// Runs of a daemon left on proplets that went Offline when it was placed elsewhere:
    /// each is stopped as soon as its proplet is Running again, and its result and log
    /// lines are refused meanwhile (the fence).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub displaced_runs: Vec<DisplacedRun>,
}

/// A daemon's run left behind on a proplet that went Offline.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DisplacedRun {
    /// The proplet it was left on.
    #[schemars(length(max = 253))]
    pub proplet: String,
    /// Its run number (`runCount` then).
    pub run: i64,
    /// When the daemon was placed elsewhere.
    pub displaced_at: DateTime<Utc>,
}

/// A failed run that was retried.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FailedAttempt {
    /// Its run number (`runCount` then).
    pub run: i64,
    /// Why it failed.
    #[schemars(length(max = 4096))]
    pub error: String,
    /// When it was found failed.
    pub finished_at: DateTime<Utc>,
}

/// Annotation that asks for a finished task to run again: set it to any new value, e.g.
/// `kubectl annotate task NAME propeller.propeller.absmach.eu/rerun="$(date +%s)" --overwrite`.
pub const RERUN_ANNOTATION: &str = "propeller.propeller.absmach.eu/rerun";

/// Finalizer that lets a deleted task stop on its proplet first.
pub const TASK_FINALIZER: &str = "propeller.propeller.absmach.eu/task-stop";
