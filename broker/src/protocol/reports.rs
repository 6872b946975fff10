//! Messages agents publish under `control/proplet/*`: discovery, heartbeat, Last Will, host and
//! task metrics, results and invoke results.

use serde_json::Value;

use super::error::DecodeError;
use super::fields::{excerpt, to_bytes, Fields, ObjectBuilder};
use super::fl::FlUpdate;
use super::Inbound;

/// Describes the device an agent runs on; sent in discovery and, optionally, in heartbeats.
/// All keys are optional on the wire (the embedded agent sends none of them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PropletMetadata {
    /// `description`: free text from the agent's configuration.
    pub description: Option<String>,
    /// `tags`: labels for scheduling; omitted when empty.
    pub tags: Vec<String>,
    /// `location`: free text.
    pub location: Option<String>,
    /// `ip`: the agent's outbound address.
    pub ip: Option<String>,
    /// `environment`: `docker`, `binary`, `embedded`, `k8s`, ...
    pub environment: Option<String>,
    /// `os`: e.g. `linux`, `zephyr`.
    pub os: Option<String>,
    /// `hostname`.
    pub hostname: Option<String>,
    /// `cpu_arch`: e.g. `x86_64`, `aarch64`, `xtensa`.
    pub cpu_arch: Option<String>,
    /// `total_memory_bytes`.
    pub total_memory_bytes: Option<u64>,
    /// `proplet_version`: agent version.
    pub proplet_version: Option<String>,
    /// `wasm_runtime`: e.g. `wasmtime-internal`, `wamr`.
    pub wasm_runtime: Option<String>,
    /// `attester`: the TEE attester this agent proves itself with to its Key Broker Service
    /// (e.g. `sample`); absent when it cannot run encrypted tasks. Propeller's extension.
    pub attester: Option<String>,
}

impl PropletMetadata {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            description: f.opt_str("description")?,
            tags: f.str_list("tags")?,
            location: f.opt_str("location")?,
            ip: f.opt_str("ip")?,
            environment: f.opt_str("environment")?,
            os: f.opt_str("os")?,
            hostname: f.opt_str("hostname")?,
            cpu_arch: f.opt_str("cpu_arch")?,
            total_memory_bytes: f.opt_u64("total_memory_bytes")?,
            proplet_version: f.opt_str("proplet_version")?,
            wasm_runtime: f.opt_str("wasm_runtime")?,
            attester: f.opt_str("attester")?,
        })
    }

    fn decode_at(f: &Fields<'_>, key: &str) -> Result<Option<Self>, DecodeError> {
        match f.opt_object(key)? {
            None => Ok(None),
            Some(obj) => {
                let path = f.key(key);
                Self::from_fields(Fields::nested(obj, &path)).map(Some)
            }
        }
    }

    /// The JSON object, absent values omitted as the upstream agent does.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put_opt("description", self.description.clone())
            .put_strs_nonempty("tags", &self.tags)
            .put_opt("location", self.location.clone())
            .put_opt("ip", self.ip.clone())
            .put_opt("environment", self.environment.clone())
            .put_opt("os", self.os.clone())
            .put_opt("hostname", self.hostname.clone())
            .put_opt("cpu_arch", self.cpu_arch.clone())
            .put_opt("total_memory_bytes", self.total_memory_bytes)
            .put_opt("proplet_version", self.proplet_version.clone())
            .put_opt("wasm_runtime", self.wasm_runtime.clone())
            .put_opt("attester", self.attester.clone())
            .build()
    }
}

/// Discovery (`control/proplet/create`): an agent announces itself once at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Discovery {
    /// `proplet_id` (required, non-empty): the agent's entity id.
    pub proplet_id: String,
    /// `namespace`: upstream's Kubernetes namespace hint (`default`, `embedded`).
    pub namespace: Option<String>,
    /// `metadata`: device description.
    pub metadata: Option<PropletMetadata>,
}

impl Discovery {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            proplet_id: f.req_id("proplet_id")?,
            namespace: f.opt_str("namespace")?,
            metadata: PropletMetadata::decode_at(&f, "metadata")?,
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("proplet_id", self.proplet_id.clone())
            .put_opt("namespace", self.namespace.clone())
            .put_opt(
                "metadata",
                self.metadata.as_ref().map(PropletMetadata::to_json),
            )
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// Decoding and encoding for records whose fields are all optional numbers, named exactly as
/// their JSON keys: `from_fields` reads each with the given getter, `to_json` writes the
/// present ones.
macro_rules! optional_figures {
    ($record:ident { $($field:ident: $getter:ident),+ $(,)? }) => {
        impl $record {
            pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
                Ok(Self {
                    $($field: f.$getter(stringify!($field))?,)+
                })
            }

            pub(crate) fn to_json(&self) -> Value {
                ObjectBuilder::new()
                    $(.put_opt(stringify!($field), self.$field))+
                    .build()
            }
        }
    };
}

mod metrics;

pub use metrics::{
    AggregatedMetrics, CpuMetrics, MemoryMetrics, ProcessMetrics, PropletMetrics, TaskMetrics,
};

/// Resource use carried in our heartbeats (`metrics`); upstream ignores the key.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeartbeatMetrics {
    /// `cpu_percent`: host CPU use, 0–100.
    pub cpu_percent: Option<f64>,
    /// `memory_bytes`: agent resident memory.
    pub memory_bytes: Option<u64>,
    /// `memory_percent`: host memory use, 0–100.
    pub memory_percent: Option<f64>,
}

optional_figures!(HeartbeatMetrics {
    cpu_percent: opt_f64,
    memory_bytes: opt_u64,
    memory_percent: opt_f64,
});

/// A heartbeat (`control/proplet/alive` with `status:"alive"`): the agent is up.
///
/// `metadata` and `metrics` are our optional additions; upstream consumers ignore unknown keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Heartbeat {
    /// `proplet_id` (required, non-empty).
    pub proplet_id: String,
    /// `namespace`.
    pub namespace: Option<String>,
    /// `metadata`: same shape as in discovery, so metadata can be refreshed after a restart.
    pub metadata: Option<PropletMetadata>,
    /// `metrics`: current resource use.
    pub metrics: Option<HeartbeatMetrics>,
}

impl Heartbeat {
    /// The JSON object, with `status:"alive"`.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("proplet_id", self.proplet_id.clone())
            .put("status", STATUS_ALIVE)
            .put_opt("namespace", self.namespace.clone())
            .put_opt(
                "metadata",
                self.metadata.as_ref().map(PropletMetadata::to_json),
            )
            .put_opt(
                "metrics",
                self.metrics.as_ref().map(HeartbeatMetrics::to_json),
            )
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// An offline notice (`control/proplet/alive` with `status:"offline"`): the Last Will of the
/// embedded agent, the upstream manager and proxy. It is *not* a heartbeat; upstream counted it
/// as one, which made dead devices look alive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OfflineNotice {
    /// `proplet_id` (required, non-empty): whoever went away.
    pub proplet_id: String,
    /// `namespace`.
    pub namespace: Option<String>,
}

impl OfflineNotice {
    /// The JSON object, with `status:"offline"`; usable as an MQTT Last Will payload.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("status", STATUS_OFFLINE)
            .put("proplet_id", self.proplet_id.clone())
            .put_opt("namespace", self.namespace.clone())
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

const STATUS_ALIVE: &str = "alive";
const STATUS_OFFLINE: &str = "offline";

/// Decodes the alive topic into a heartbeat or an offline notice. A missing `status` counts as
/// alive (upstream never relied on it); anything other than `alive`/`offline` is refused.
pub(crate) fn decode_alive(f: Fields<'_>) -> Result<Inbound, DecodeError> {
    let proplet_id = f.req_id("proplet_id")?;
    let namespace = f.opt_str("namespace")?;
    match f.opt_str("status")?.as_deref() {
        None | Some(STATUS_ALIVE) => Ok(Inbound::Heartbeat(Heartbeat {
            proplet_id,
            namespace,
            metadata: PropletMetadata::decode_at(&f, "metadata")?,
            metrics: match f.opt_object("metrics")? {
                None => None,
                Some(obj) => Some(HeartbeatMetrics::from_fields(Fields::nested(
                    obj, "metrics",
                ))?),
            },
        })),
        Some(STATUS_OFFLINE) => Ok(Inbound::Offline(OfflineNotice {
            proplet_id,
            namespace,
        })),
        Some(other) => Err(DecodeError::InvalidValue {
            key: "status".into(),
            reason: format!("expected \"alive\" or \"offline\", got {}", excerpt(other)),
        }),
    }
}

/// The `results` of a task: text for normal tasks, a JSON value for FL tasks (whose envelope is
/// an object). Kept raw so nothing a sender reported is lost.
#[derive(Debug, Clone, PartialEq)]
pub enum ResultValue {
    /// A string result (absent or `null` decodes as the empty string).
    Text(String),
    /// Any other JSON value (object, array, number, boolean).
    Json(Value),
}

impl Default for ResultValue {
    fn default() -> Self {
        Self::Text(String::new())
    }
}

impl ResultValue {
    fn from_fields(f: &Fields<'_>, key: &str) -> Self {
        match f.get(key) {
            None => Self::Text(String::new()),
            Some(Value::String(s)) => Self::Text(s.clone()),
            Some(other) => Self::Json(other.clone()),
        }
    }

    /// The JSON form.
    pub fn to_json(&self) -> Value {
        match self {
            Self::Text(s) => Value::String(s.clone()),
            Self::Json(v) => v.clone(),
        }
    }

    /// The text, for string results.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Self::Text(s) => Some(s),
            Self::Json(_) => None,
        }
    }

    /// True for an empty string (what failures carry).
    pub fn is_empty(&self) -> bool {
        matches!(self, Self::Text(s) if s.is_empty())
    }

    /// The FL update envelope inside an object result, looked for where the upstream operator
    /// looks: `update_envelope`, then `results.update_envelope`, then the object itself (the
    /// upstream agents' FL result form). `None` when the result is not an object or holds no
    /// envelope-shaped object.
    pub fn fl_update(&self) -> Option<Result<FlUpdate, DecodeError>> {
        let Self::Json(Value::Object(obj)) = self else {
            return None;
        };
        if let Some(Value::Object(env)) = obj.get("update_envelope") {
            return Some(FlUpdate::from_fields(Fields::nested(
                env,
                "results.update_envelope",
            )));
        }
        if let Some(Value::Object(inner)) = obj.get("results") {
            if let Some(Value::Object(env)) = inner.get("update_envelope") {
                return Some(FlUpdate::from_fields(Fields::nested(
                    env,
                    "results.results.update_envelope",
                )));
            }
        }
        if obj.contains_key("update_b64") || obj.contains_key("round_id") {
            return Some(FlUpdate::from_fields(Fields::nested(obj, "results")));
        }
        None
    }
}

fn error_at(f: &Fields<'_>) -> Result<Option<String>, DecodeError> {
    match f.get("error") {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(DecodeError::WrongType {
            key: f.key("error"),
            expected: "string or null",
        }),
    }
}

/// A task result (`control/proplet/results`): success with results, or failure with an error.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskResult {
    /// `task_id` (required, non-empty).
    pub task_id: String,
    /// `proplet_id`: absent from embedded and FL results.
    pub proplet_id: Option<String>,
    /// `results`.
    pub results: ResultValue,
    /// `error`: kept as sent; use [`TaskResult::failure`] to interpret it.
    pub error: Option<String>,
}

impl TaskResult {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            task_id: f.req_id("task_id")?,
            proplet_id: f.opt_str("proplet_id")?,
            results: ResultValue::from_fields(&f, "results"),
            error: error_at(&f)?,
        })
    }

    /// The error text when the task failed; an empty string means success, as upstream.
    pub fn failure(&self) -> Option<&str> {
        self.error.as_deref().filter(|e| !e.is_empty())
    }

    /// The JSON object; `error` is `null` on success, like the Rust agent.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("task_id", self.task_id.clone())
            .put_opt("proplet_id", self.proplet_id.clone())
            .put("results", self.results.to_json())
            .put(
                "error",
                self.error.clone().map_or(Value::Null, Value::String),
            )
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// The result of one invocation of a latent task (`control/proplet/invoke_results`).
#[derive(Debug, Clone, PartialEq)]
pub struct InvokeResult {
    /// `task_id` (required, non-empty).
    pub task_id: String,
    /// `invocation_id`: echoes the request's id, `""` when it had none.
    pub invocation_id: String,
    /// `proplet_id`.
    pub proplet_id: Option<String>,
    /// `results`.
    pub results: ResultValue,
    /// `error`: kept as sent; see [`InvokeResult::failure`].
    pub error: Option<String>,
}

impl InvokeResult {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            task_id: f.req_id("task_id")?,
            invocation_id: f.opt_str("invocation_id")?.unwrap_or_default(),
            proplet_id: f.opt_str("proplet_id")?,
            results: ResultValue::from_fields(&f, "results"),
            error: error_at(&f)?,
        })
    }

    /// The error text when the invocation failed; empty means success.
    pub fn failure(&self) -> Option<&str> {
        self.error.as_deref().filter(|e| !e.is_empty())
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("task_id", self.task_id.clone())
            .put("invocation_id", self.invocation_id.clone())
            .put_opt("proplet_id", self.proplet_id.clone())
            .put("results", self.results.to_json())
            .put(
                "error",
                self.error.clone().map_or(Value::Null, Value::String),
            )
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}
