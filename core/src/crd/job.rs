//! The PropellerJob resource: a batch of tasks run in parallel, in sequence or as a DAG.

use chrono::{DateTime, Utc};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{conditions_schema, Condition};
use super::task::TaskSpec;

/// Desired state of a PropellerJob.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "propeller.propeller.absmach.eu",
    version = "v1",
    kind = "PropellerJob",
    plural = "propellerjobs",
    shortname = "pjob",
    namespaced,
    status = "PropellerJobStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.executionMode"}"#,
    printcolumn = r#"{"name":"Tasks","type":"integer","jsonPath":".status.taskCount"}"#,
    printcolumn = r#"{"name":"Completed","type":"integer","jsonPath":".status.completedCount"}"#,
    printcolumn = r#"{"name":"Failed","type":"integer","jsonPath":".status.failedCount"}"#,
    printcolumn = r#"{"name":"Suspended","type":"string","jsonPath":".status.conditions[?(@.type==\"Suspended\")].status"}"#,
    printcolumn = r#"{"name":"Quota","type":"string","jsonPath":".status.conditions[?(@.type==\"QuotaReserved\")].status","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct PropellerJobSpec {
    /// Human name of the job.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// How the inline tasks are run.
    #[serde(default)]
    pub execution_mode: ExecutionMode,
    /// Inline task definitions; each becomes a Task owned by the job.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub tasks: Vec<TaskSpec>,
    /// Existing Tasks whose outcome counts towards the job (not owned, not started by it).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100), inner(length(min = 1, max = 253)))]
    pub task_refs: Vec<String>,
    /// Held: no task is created or dispatched and runs that are out are stopped; they start
    /// again when this is false. With the `kueue.x-k8s.io/queue-name` label the job is also
    /// held until Kueue admits its Workload.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
}

/// How a job's inline tasks run.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ExecutionMode {
    /// All at once.
    Parallel,
    /// One after another in list order; the first failure skips the rest.
    Sequential,
    /// As their `dependsOn` graph allows.
    #[default]
    Configurable,
}

/// Lifecycle phase shared by jobs and federated jobs.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default, JsonSchema)]
pub enum JobPhase {
    #[default]
    Pending,
    Running,
    Completed,
    Failed,
}

/// Observed state of a PropellerJob.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropellerJobStatus {
    #[serde(default)]
    pub phase: JobPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<DateTime<Utc>>,
    /// Inline tasks plus task references.
    #[serde(default)]
    pub task_count: i32,
    #[serde(default)]
    pub completed_count: i32,
    #[serde(default)]
    pub failed_count: i32,
    #[serde(default)]
    pub skipped_count: i32,
    #[serde(default)]
    pub interrupted_count: i32,
    /// Ready (and Failed reasons) for tools that wait on conditions.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}
