//! FederatedJob and TrainingRound: multi-round federated learning across proplets.

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{LocalObjectReference, ObjectReference};
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{conditions_schema, free_form_json, Condition};
pub use super::job::JobPhase;

/// Desired state of a FederatedJob.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "propeller.propeller.absmach.eu",
    version = "v1",
    kind = "FederatedJob",
    plural = "federatedjobs",
    namespaced,
    status = "FederatedJobStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Current Round","type":"integer","jsonPath":".status.currentRound"}"#,
    printcolumn = r#"{"name":"Completed Rounds","type":"integer","jsonPath":".status.completedRounds"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.kOfN <= size(self.participants)").message("kOfN cannot be greater than the number of participants").field_path(".kOfN"))]
pub struct FederatedJobSpec {
    /// Experiment identifier, passed to participants as `FL_JOB_ID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub experiment_id: Option<String>,
    /// Initial global model reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    pub model_ref: Option<String>,
    /// Wasm module (OCI reference or URL) each participant runs.
    #[schemars(length(min = 1, max = 2048))]
    pub task_wasm_image: String,
    /// Proplets that train in every round.
    #[schemars(length(min = 1, max = 100))]
    pub participants: Vec<Participant>,
    /// Hyperparameters passed to participants as `HYPERPARAMS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_json")]
    pub hyperparams: Option<serde_json::Value>,
    /// Updates needed before a round aggregates.
    #[serde(rename = "kOfN")]
    #[schemars(range(min = 1))]
    pub k_of_n: i32,
    /// Longest a round may wait for its updates; 0 or unset waits for ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2592000))]
    pub timeout_seconds: Option<i64>,
    /// How many rounds to run.
    pub rounds: RoundsSpec,
    /// How updates are combined.
    #[serde(default)]
    pub aggregator: AggregatorSpec,
}

/// One participant of a federated job.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Participant {
    /// Name of a Proplet resource in the job's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub proplet_id: String,
}

/// Round settings of a federated job.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoundsSpec {
    /// Number of rounds.
    #[schemars(range(min = 1, max = 10000))]
    pub total: i32,
    /// Only `sequential` rounds exist; kept for upstream manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub strategy: Option<String>,
}

/// Aggregation settings of a federated job.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AggregatorSpec {
    /// `fedavg` (weighted mean of vectors) or `concat` (opaque updates joined).
    #[serde(default)]
    pub algorithm: AggregationAlgorithm,
    /// Algorithm-specific settings, kept for upstream manifests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_json")]
    pub config: Option<serde_json::Value>,
}

/// Aggregation algorithms.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum AggregationAlgorithm {
    #[default]
    Fedavg,
    Concat,
}

/// Observed state of a FederatedJob.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FederatedJobStatus {
    #[serde(default)]
    pub phase: JobPhase,
    /// Round being run, starting at 1.
    #[serde(default)]
    pub current_round: i32,
    #[serde(default)]
    pub completed_rounds: i32,
    /// Model produced by the latest completed round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    pub aggregated_model_ref: Option<String>,
    /// Per-participant progress across rounds.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub participants: Vec<FederatedParticipantStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_time: Option<DateTime<Utc>>,
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Progress of one participant across rounds.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FederatedParticipantStatus {
    #[schemars(length(max = 253))]
    pub proplet_id: String,
    /// Status in the current round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ParticipantPhase>,
    /// When the participant last delivered an update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_update: Option<DateTime<Utc>>,
    /// Updates delivered over all rounds.
    #[serde(default)]
    pub updates_delivered: i32,
}

/// Desired state of a TrainingRound.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "propeller.propeller.absmach.eu",
    version = "v1",
    kind = "TrainingRound",
    plural = "trainingrounds",
    namespaced,
    status = "TrainingRoundStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Job","type":"string","jsonPath":".spec.federatedJobRef.name"}"#,
    printcolumn = r#"{"name":"Updates","type":"integer","jsonPath":".status.updatesReceived"}"#,
    printcolumn = r#"{"name":"Required","type":"integer","jsonPath":".status.updatesRequired"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.kOfN <= size(self.participants)").message("kOfN cannot be greater than the number of participants").field_path(".kOfN"))]
pub struct TrainingRoundSpec {
    /// Round identifier, e.g. `round-1`.
    #[schemars(length(min = 1, max = 63))]
    pub round_id: String,
    /// Parent FederatedJob.
    pub federated_job_ref: LocalObjectReference,
    /// Global model this round starts from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    pub model_ref: Option<String>,
    /// Wasm module each participant runs.
    #[schemars(length(min = 1, max = 2048))]
    pub task_wasm_image: String,
    /// Proplet names taking part.
    #[schemars(length(min = 1, max = 100), inner(length(min = 1, max = 253)))]
    pub participants: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "free_form_json")]
    pub hyperparams: Option<serde_json::Value>,
    /// Updates needed before aggregation.
    #[serde(rename = "kOfN")]
    #[schemars(range(min = 1))]
    pub k_of_n: i32,
    /// Longest the round waits for updates; 0 or unset waits for ever.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 2592000))]
    pub timeout_seconds: Option<i64>,
}

/// Lifecycle phase of a training round.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, Default, JsonSchema)]
pub enum RoundPhase {
    #[default]
    Pending,
    Running,
    Aggregating,
    Completed,
    Failed,
}

/// Status of one participant within a round.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
pub enum ParticipantPhase {
    #[default]
    Pending,
    Running,
    Completed,
    Failed,
}

/// Observed state of a TrainingRound.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TrainingRoundStatus {
    #[serde(default)]
    pub phase: RoundPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<DateTime<Utc>>,
    #[serde(default)]
    pub updates_received: i32,
    #[serde(default)]
    pub updates_required: i32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 100))]
    pub participants: Vec<RoundParticipantStatus>,
    /// Where the aggregated model of this round is stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048))]
    pub aggregated_model_ref: Option<String>,
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Progress of one participant in a round.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RoundParticipantStatus {
    #[schemars(length(max = 253))]
    pub proplet_id: String,
    /// The participant's Task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_ref: Option<ObjectReference>,
    #[serde(default)]
    pub status: ParticipantPhase,
    /// True once a valid update from this participant was collected.
    #[serde(default)]
    pub update_received: bool,
}
