//! Schema pieces shared by several resources.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// The value of `key` in a Secret, as the API server would hand it out: `stringData`
/// (which a write merges over `data`) first, then `data`. Every reader of a Secret's keys
/// goes through this, whatever store the Secret came from.
pub fn secret_entry(secret: &k8s_openapi::api::core::v1::Secret, key: &str) -> Option<String> {
    if let Some(text) = secret.string_data.as_ref().and_then(|d| d.get(key)) {
        return Some(text.clone());
    }
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

/// API group of every Propeller resource; kept identical to upstream so manifests carry over.
pub const GROUP: &str = "propeller.propeller.absmach.eu";
/// The only served and stored version.
pub const VERSION: &str = "v1";
/// Prefix of every annotation, label and finalizer the operator owns.
pub const PREFIX: &str = "propeller.propeller.absmach.eu/";

/// Pattern of a Kubernetes resource quantity ("100m", "1.5Gi", "2"), as the API server's
/// own `resource.Quantity` accepts it.
pub const QUANTITY_PATTERN: &str = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$";

/// Pattern of a Go-style duration ("30s", "1m30s", "250ms"), which upstream manifests use.
pub const DURATION_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// CPU and memory figures: requested by a task's pod, or reported as available by a proplet.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PropletResources {
    /// CPU quantity, e.g. `100m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = QUANTITY_PATTERN), length(max = 64))]
    pub cpu: Option<String>,
    /// Memory quantity, e.g. `256Mi`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = QUANTITY_PATTERN), length(max = 64))]
    pub memory: Option<String>,
    /// Other named resources passed through to the workload.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "bounded_string_map::<32, 253>")]
    pub custom: BTreeMap<String, String>,
}

/// A point-in-time CPU and memory sample, from a heartbeat or a task-metrics message.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MetricsSample {
    /// When the operator accepted the sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp: Option<DateTime<Utc>>,
    /// CPU use in percent × 1000, so integers keep three decimals.
    #[serde(default)]
    pub cpu_milli_percent: i64,
    /// Memory use in percent × 1000.
    #[serde(default)]
    pub memory_milli_percent: i64,
    /// Resident memory in bytes.
    #[serde(default)]
    pub memory_bytes: i64,
}

/// Schema for free-form JSON the operator forwards without interpreting.
pub fn free_form_json(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// Schema for an optional list of `metav1.Condition`, keyed by type as Kubernetes recommends.
pub fn conditions_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let item = generator.subschema_for::<Condition>();
    schemars::json_schema!({
        "type": "array",
        "maxItems": 16,
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
    })
}

/// Schema for an int-or-string value such as a task input (`10` or `"10"`).
pub fn int_or_string_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "array",
        "maxItems": 64,
        "items": { "x-kubernetes-int-or-string": true, "maxLength": 65536 },
    })
}

/// Schema for a Kubernetes resource list (`cpu: 50m`, `memory: 128Mi`, `nvidia.com/gpu: 1`).
pub fn resource_list(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": 16,
        "additionalProperties": {
            "x-kubernetes-int-or-string": true,
            "maxLength": 64,
            "pattern": QUANTITY_PATTERN,
        },
    })
}

/// Schema for a string-to-string map with bounded size and value length, which CEL cost
/// estimation on real API servers requires.
pub fn bounded_string_map<const MAX_ENTRIES: u32, const MAX_LEN: u32>(
    _: &mut schemars::SchemaGenerator,
) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "maxProperties": MAX_ENTRIES,
        "additionalProperties": { "type": "string", "maxLength": MAX_LEN },
    })
}

/// Finds a condition by type.
pub fn find_condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}
