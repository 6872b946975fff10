//! The Proplet resource: one worker (a pod the operator manages, or an external device).

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::SecretKeySelector;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::common::{
    conditions_schema, resource_list, Condition, MetricsSample, PropletResources, DURATION_PATTERN,
};

/// Desired state of a Proplet.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "propeller.propeller.absmach.eu",
    version = "v1",
    kind = "Proplet",
    plural = "proplets",
    namespaced,
    status = "PropletStatus",
    printcolumn = r#"{"name":"Type","type":"string","jsonPath":".spec.type"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Tasks","type":"integer","jsonPath":".status.taskCount"}"#,
    printcolumn = r#"{"name":"Replicas","type":"string","jsonPath":".status.k8sStatus.readyReplicas"}"#,
    printcolumn = r#"{"name":"Last Seen","type":"date","jsonPath":".status.lastSeen"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.type != 'k8s' || has(self.k8s)").message("spec.k8s (with k8s.image) is required when type is k8s").field_path(".k8s"))]
pub struct PropletSpec {
    /// Whether the operator runs the proplet as a Deployment (`k8s`) or only tracks a device (`external`).
    #[serde(rename = "type")]
    pub type_: PropletType,
    /// Pod settings for a `k8s` proplet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k8s: Option<K8sPropletSpec>,
    /// Device facts for an `external` proplet, used by task selectors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external: Option<ExternalPropletSpec>,
    /// CPU and memory requests of the proplet pod; for external proplets, what it offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "resource_list")]
    pub resources: Option<BTreeMap<String, Quantity>>,
    /// How the proplet reaches the broker and who it is there.
    pub connection_config: ConnectionConfig,
    /// The most tasks scheduled or running on this proplet at once (none: no limit). Every
    /// replica honours it: a task takes one of `status.slots` with a conditional write
    /// before it is assigned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub capacity: Option<u32>,
}

/// The two kinds of proplet.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum PropletType {
    /// A Deployment in this cluster, created and owned by the operator.
    K8s,
    /// A device or process outside the cluster, known only through MQTT.
    External,
}

/// Log level handed to the proplet agent.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Default, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Debug,
    #[default]
    Info,
    Warn,
    Error,
}

fn default_replicas() -> i32 {
    1
}

/// Pod settings of a `k8s` proplet.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct K8sPropletSpec {
    /// Container image running the proplet agent.
    #[schemars(length(min = 1, max = 512))]
    pub image: String,
    /// Agent log level.
    #[serde(default)]
    pub log_level: LogLevel,
    /// Number of agent pods.
    #[serde(default = "default_replicas")]
    #[schemars(range(min = 0, max = 100))]
    pub replicas: i32,
    /// Directory inside the container holding Wasm plugins (`PROPLET_PLUGIN_DIR`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub plugin_dir: Option<String>,
    /// Optional agent settings passed as environment variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<K8sPropletEnv>,
}

/// Agent feature flags and settings a `k8s` proplet's pod receives as `PROPLET_*` variables.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct K8sPropletEnv {
    /// Heartbeat period, e.g. `10s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub liveliness_interval: Option<String>,
    /// Metrics period, e.g. `10s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub metrics_interval: Option<String>,
    /// Port of the agent's own metrics endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub metrics_port: Option<i32>,
    /// Whether the agent serves metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_enabled: Option<bool>,
    /// External Wasm runtime binary; empty and unset differ (empty means in-process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub external_wasm_runtime: Option<String>,
    /// Enables the hardware abstraction host functions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hal_enabled: Option<bool>,
    /// Enables outgoing HTTP for tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_enabled: Option<bool>,
    /// Enables USB access for tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usb_enabled: Option<bool>,
    /// OpenTelemetry collector URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub otel_url: Option<String>,
    /// Trace sampling ratio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub trace_ratio: Option<String>,
    /// Comma-separated tags the agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub tags: Option<String>,
    /// Location the agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub location: Option<String>,
    /// Description the agent reports.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub description: Option<String>,
    /// Key broker service URL for encrypted workloads.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub kbs_uri: Option<String>,
    /// Attestation agent configuration path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub aa_config_path: Option<String>,
    /// CA certificate path for the agent's MQTT TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub mqtt_tls_ca_cert: Option<String>,
    /// Client certificate path for the agent's MQTT TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub mqtt_tls_client_cert: Option<String>,
    /// Client key path for the agent's MQTT TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub mqtt_tls_client_key: Option<String>,
    /// Skips broker certificate verification (testing only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mqtt_tls_insecure_skip_verify: Option<bool>,
}

/// Device facts of an external proplet that task selectors match against.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExternalPropletSpec {
    /// Device category, e.g. `raspberry-pi-4`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub device_type: Option<String>,
    /// Capabilities the device offers, e.g. `wasm`, `gpu`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 253)))]
    pub capabilities: Vec<String>,
}

fn default_qos() -> i32 {
    0
}

fn default_mqtt_timeout() -> String {
    "30s".to_string()
}

/// Broker address and identity of a proplet. Seed names and upstream aliases are both accepted.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("has(self.domainId) || has(self.tenantId)").message("domainId (or its alias tenantId) is required"))]
#[x_kube(validation = Rule::new("has(self.clientId) || has(self.entityId)").message("clientId (or its alias entityId) is required"))]
#[x_kube(validation = Rule::new("(has(self.clientKey) ? 1 : 0) + (has(self.apiKey) ? 1 : 0) + (has(self.clientKeySecretRef) ? 1 : 0) + (has(self.apiKeySecretRef) ? 1 : 0) == 1").message("exactly one of clientKey, clientKeySecretRef (or their aliases apiKey, apiKeySecretRef) must be set"))]
#[x_kube(validation = Rule::new("!has(self.domainId) || !has(self.tenantId) || self.domainId == self.tenantId").message("domainId and its alias tenantId differ"))]
#[x_kube(validation = Rule::new("!has(self.clientId) || !has(self.entityId) || self.clientId == self.entityId").message("clientId and its alias entityId differ"))]
pub struct ConnectionConfig {
    /// Broker URL the proplet dials, e.g. `tcp://propeller:1883`.
    #[schemars(length(min = 1, max = 1024))]
    pub mqtt_address: String,
    /// Domain part of the topic prefix `m/{domain}/c/{channel}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub domain_id: Option<String>,
    /// Upstream name of `domainId`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub tenant_id: Option<String>,
    /// Channel part of the topic prefix.
    #[schemars(length(min = 1, max = 253))]
    pub channel_id: String,
    /// MQTT client id and username; must equal `proplet_id` in the proplet's messages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub client_id: Option<String>,
    /// Upstream name of `clientId`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub entity_id: Option<String>,
    /// MQTT password, inline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub client_key: Option<String>,
    /// Upstream name of `clientKey`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub api_key: Option<String>,
    /// MQTT password, from a Secret in the proplet's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_key_secret_ref: Option<SecretKeySelector>,
    /// Upstream name of `clientKeySecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<SecretKeySelector>,
    /// MQTT QoS the proplet uses.
    #[serde(default = "default_qos")]
    #[schemars(range(min = 0, max = 2))]
    pub mqtt_qos: i32,
    /// Broker operation timeout, e.g. `30s`.
    #[serde(default = "default_mqtt_timeout")]
    #[schemars(regex(pattern = DURATION_PATTERN), length(max = 32))]
    pub mqtt_timeout: String,
}

impl Proplet {
    /// The proplet's MQTT identity: `connectionConfig.clientId` (or its alias), else its name.
    /// Broker logins, start targets and report routing all use this one rule.
    pub fn client_id(&self) -> &str {
        self.spec
            .connection_config
            .client()
            .unwrap_or(self.metadata.name.as_deref().unwrap_or_default())
    }
}

/// Where a proplet's MQTT password comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum ClientKeySource<'a> {
    /// The key is written in the resource.
    Inline(&'a str),
    /// The key is in a Secret.
    Secret(&'a SecretKeySelector),
}

impl ConnectionConfig {
    /// Domain id under either accepted name.
    pub fn domain(&self) -> Option<&str> {
        self.domain_id.as_deref().or(self.tenant_id.as_deref())
    }

    /// Client id under either accepted name; this is the proplet's MQTT identity.
    pub fn client(&self) -> Option<&str> {
        self.client_id.as_deref().or(self.entity_id.as_deref())
    }

    /// The credential source under either accepted name, if exactly one is usable.
    pub fn key_source(&self) -> Option<ClientKeySource<'_>> {
        if let Some(k) = self.client_key.as_deref().or(self.api_key.as_deref()) {
            return Some(ClientKeySource::Inline(k));
        }
        self.client_key_secret_ref
            .as_ref()
            .or(self.api_key_secret_ref.as_ref())
            .map(ClientKeySource::Secret)
    }
}

/// Lifecycle phase of a proplet.
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
pub enum PropletPhase {
    /// No heartbeat yet, or the Deployment is not ready yet.
    #[default]
    Initializing,
    /// Heartbeats are current, or every replica is ready.
    Running,
    /// Heartbeats stopped or the device said goodbye.
    Offline,
}

impl std::fmt::Display for PropletPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PropletPhase::Initializing => "Initializing",
            PropletPhase::Running => "Running",
            PropletPhase::Offline => "Offline",
        })
    }
}

impl std::fmt::Display for PropletType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PropletType::K8s => "k8s",
            PropletType::External => "external",
        })
    }
}

/// Observed state of a Proplet.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropletStatus {
    /// Lifecycle phase.
    #[serde(default)]
    pub phase: PropletPhase,
    /// True while heartbeats arrive within the last-seen threshold.
    #[serde(default)]
    pub alive: bool,
    /// Ready, Connected and Healthy.
    #[serde(default)]
    #[schemars(schema_with = "conditions_schema")]
    pub conditions: Vec<Condition>,
    /// Time of the latest heartbeat.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<DateTime<Utc>>,
    /// The last ten heartbeat times, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub alive_history: Vec<DateTime<Utc>>,
    /// Tasks assigned to this proplet that have not finished.
    #[serde(default)]
    pub task_count: i64,
    /// CPU and memory the proplet offers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub available_resources: Option<PropletResources>,
    /// Replica counts of a `k8s` proplet's Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k8s_status: Option<K8sPropletStatus>,
    /// What the device says about itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<PropletMetadata>,
    /// Most recent CPU and memory sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latest_metrics: Option<MetricsSample>,
    /// Generation of the spec this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The slots of `spec.capacity` taken, by the UID of the task holding each. A slot whose
    /// task has finished is given back by the next reservation.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub slots: BTreeMap<String, SlotHolder>,
}

/// The task holding one slot of a proplet's capacity.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SlotHolder {
    /// The task's name.
    pub task: String,
    /// When the slot was taken.
    pub since: DateTime<Utc>,
}

/// Replica counts of a proplet Deployment.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct K8sPropletStatus {
    /// Pods passing readiness.
    #[schemars(range(min = 0))]
    pub ready_replicas: i32,
    /// Pods available for at least minReadySeconds.
    #[schemars(range(min = 0))]
    pub available_replicas: i32,
}

/// Device metadata reported in discovery and heartbeat messages.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropletMetadata {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 253)))]
    pub tags: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256))]
    pub location: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub ip: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub environment: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub os: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub cpu_arch: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_memory_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub proplet_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub wasm_runtime: Option<String>,
    /// The TEE attester the agent proves itself with to its Key Broker Service; absent when
    /// it cannot run encrypted tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub attester: Option<String>,
}
