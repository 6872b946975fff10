//! Messages the operator publishes under `control/manager/*`: start, stop and invoke.
//!
//! Encoding follows what the upstream *agents* accept: intervals in whole seconds, inputs as
//! strings, every `monitoring_profile` key present, and `name`/`state` strings in stop messages
//! for the embedded agent.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Map, Value};

use super::error::DecodeError;
use super::fields::{b64_encode, to_bytes, Fields, ObjectBuilder};
use super::time::{interval_secs, NANOSECOND_INTERVAL_THRESHOLD};

/// `state` written into stop messages; the embedded agent requires some string there.
pub const DEFAULT_STOP_STATE: &str = "stopped";

/// How an agent samples and reports a task's process metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MonitoringProfile {
    /// `enabled`: sample at all.
    pub enabled: bool,
    /// `interval`: seconds between samples (written as an integer; at least 1).
    pub interval_secs: u64,
    /// `collect_cpu`.
    pub collect_cpu: bool,
    /// `collect_memory`.
    pub collect_memory: bool,
    /// `collect_disk_io`.
    pub collect_disk_io: bool,
    /// `collect_threads`.
    pub collect_threads: bool,
    /// `collect_file_descriptors`.
    pub collect_file_descriptors: bool,
    /// `export_to_mqtt`: publish samples on `control/proplet/task_metrics`.
    pub export_to_mqtt: bool,
    /// `retain_history`: keep samples for the `aggregated` summary.
    pub retain_history: bool,
    /// `history_size`: samples kept.
    pub history_size: u64,
}

impl MonitoringProfile {
    /// The upstream agent's "standard" profile: everything on, every 10 s, 100 samples.
    pub const fn standard() -> Self {
        Self {
            enabled: true,
            interval_secs: 10,
            collect_cpu: true,
            collect_memory: true,
            collect_disk_io: true,
            collect_threads: true,
            collect_file_descriptors: true,
            export_to_mqtt: true,
            retain_history: true,
            history_size: 100,
        }
    }

    /// The upstream agent's profile for daemons: every 120 s, 500 samples.
    pub const fn long_running_daemon() -> Self {
        Self {
            interval_secs: 120,
            history_size: 500,
            ..Self::standard()
        }
    }

    /// The sampling period.
    pub fn interval(&self) -> Duration {
        Duration::from_secs(self.interval_secs.max(1))
    }

    /// Missing keys take the [`MonitoringProfile::standard`] value, because the Go operator
    /// sends partial profiles that the upstream agent would reject outright.
    fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let d = Self::standard();
        Ok(Self {
            enabled: f.bool_or("enabled", d.enabled)?,
            interval_secs: match f.get("interval") {
                None => d.interval_secs,
                Some(v) => interval_secs(v, &f.key("interval"))?,
            },
            collect_cpu: f.bool_or("collect_cpu", d.collect_cpu)?,
            collect_memory: f.bool_or("collect_memory", d.collect_memory)?,
            collect_disk_io: f.bool_or("collect_disk_io", d.collect_disk_io)?,
            collect_threads: f.bool_or("collect_threads", d.collect_threads)?,
            collect_file_descriptors: f
                .bool_or("collect_file_descriptors", d.collect_file_descriptors)?,
            export_to_mqtt: f.bool_or("export_to_mqtt", d.export_to_mqtt)?,
            retain_history: f.bool_or("retain_history", d.retain_history)?,
            history_size: f.opt_u64("history_size")?.unwrap_or(d.history_size),
        })
    }

    /// Every key, `interval` as integer seconds. The interval is kept between 1 (zero crashes
    /// the upstream agent's timer) and just below [`NANOSECOND_INTERVAL_THRESHOLD`] (larger
    /// numbers would be read back as Go nanoseconds).
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("enabled", self.enabled)
            .put(
                "interval",
                self.interval_secs
                    .clamp(1, NANOSECOND_INTERVAL_THRESHOLD - 1),
            )
            .put("collect_cpu", self.collect_cpu)
            .put("collect_memory", self.collect_memory)
            .put("collect_disk_io", self.collect_disk_io)
            .put("collect_threads", self.collect_threads)
            .put("collect_file_descriptors", self.collect_file_descriptors)
            .put("export_to_mqtt", self.export_to_mqtt)
            .put("retain_history", self.retain_history)
            .put("history_size", self.history_size)
            .build()
    }
}

impl Default for MonitoringProfile {
    fn default() -> Self {
        Self::standard()
    }
}

/// Upstream targeting: a broadcast, or a message without a (non-empty) `proplet_id`, is for
/// every agent; otherwise only for the named one. Public for agents that must apply it to a
/// message that did not decode.
pub fn targets(broadcast: bool, target: Option<&str>, proplet_id: &str) -> bool {
    match target {
        _ if broadcast => true,
        None | Some("") => true,
        Some(t) => t == proplet_id,
    }
}

/// The `proplet_id` to put on the wire: none for broadcasts, whose absence is what upstream
/// agents read as "every proplet".
fn wire_target(broadcast: bool, proplet_id: Option<&String>) -> Option<String> {
    if broadcast {
        None
    } else {
        proplet_id.cloned()
    }
}

fn opt_map(f: &Fields<'_>, key: &str) -> Result<Option<Map<String, Value>>, DecodeError> {
    Ok(f.opt_object(key)?.cloned())
}

/// Start a task (`control/manager/start`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartRequest {
    /// `id` (required, non-empty): the task id results will carry.
    pub id: String,
    /// `name` (required, non-empty): also the export the agent calls.
    pub name: String,
    /// `state`: the sender's task state number; agents ignore it.
    pub state: u8,
    /// `image_url`: OCI reference (fetched via the registry topics) or `http(s)://` URL.
    pub image_url: Option<String>,
    /// `file`: the inline Wasm binary, base64 on the wire.
    pub file: Option<Vec<u8>>,
    /// `inputs`: arguments, always strings on the wire (numbers are converted on decode).
    pub inputs: Vec<String>,
    /// `cli_args`: `null` decodes as empty.
    pub cli_args: Vec<String>,
    /// `broadcast`: run on every agent.
    pub broadcast: bool,
    /// `daemon`: long-running.
    pub daemon: bool,
    /// `latent`: pre-compile only, run later through invoke.
    pub latent: bool,
    /// `env`: environment for the task.
    pub env: BTreeMap<String, String>,
    /// `encrypted`: TEE path.
    pub encrypted: bool,
    /// `kbs_resource_path`: key broker resource for encrypted images.
    pub kbs_resource_path: Option<String>,
    /// `monitoring_profile`.
    pub monitoring_profile: Option<MonitoringProfile>,
    /// `proplet_id`: the target agent; never written for broadcasts.
    pub proplet_id: Option<String>,
    /// `hal_storage_path`: root directory for HAL storage.
    pub hal_storage_path: Option<String>,
    /// `mode`: free-form execution mode.
    pub mode: Option<String>,
    /// `kind`: task kind (e.g. `standard`).
    pub kind: Option<String>,
    /// `priority`: scheduling priority.
    pub priority: Option<i64>,
    /// `metadata`: free-form object.
    pub metadata: Option<Map<String, Value>>,
    /// `parent_results`: results of dependency tasks, by task.
    pub parent_results: Option<Map<String, Value>>,
    /// `run` (ours, optional): which run of the task this start is, counting from 1. A start
    /// sent again for the same run (an operator restarted between publishing it and recording
    /// it) must not run the task again: our agent answers it with the result it already has.
    /// Upstream agents ignore the key; a start without it is always run.
    pub run: Option<u64>,
}

impl StartRequest {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let state = match f.opt_u64("state")? {
            None => 0,
            Some(n) => u8::try_from(n).map_err(|_| DecodeError::InvalidValue {
                key: "state".into(),
                reason: format!("{n} exceeds {}", u8::MAX),
            })?,
        };
        let monitoring_profile = match f.opt_object("monitoring_profile")? {
            None => None,
            Some(o) => Some(MonitoringProfile::from_fields(Fields::nested(
                o,
                "monitoring_profile",
            ))?),
        };
        Ok(Self {
            id: f.req_id("id")?,
            name: f.req_id("name")?,
            state,
            image_url: f.opt_str("image_url")?,
            file: f.opt_base64("file")?,
            inputs: f.text_list("inputs")?,
            cli_args: f.str_list("cli_args")?,
            broadcast: f.bool_or("broadcast", false)?,
            daemon: f.bool_or("daemon", false)?,
            latent: f.bool_or("latent", false)?,
            env: f.str_map("env")?,
            encrypted: f.bool_or("encrypted", false)?,
            kbs_resource_path: f.opt_str("kbs_resource_path")?,
            monitoring_profile,
            proplet_id: f.opt_str("proplet_id")?,
            hal_storage_path: f.opt_str("hal_storage_path")?,
            mode: f.opt_str("mode")?,
            kind: f.opt_str("kind")?,
            priority: f.opt_i64("priority")?,
            metadata: opt_map(&f, "metadata")?,
            parent_results: opt_map(&f, "parent_results")?,
            run: f.opt_u64("run")?,
        })
    }

    /// Whether the agent `proplet_id` should run this start (upstream targeting rules).
    pub fn is_for(&self, proplet_id: &str) -> bool {
        targets(self.broadcast, self.proplet_id.as_deref(), proplet_id)
    }

    /// The inline binary, if one was sent and is not empty.
    pub fn inline_binary(&self) -> Option<&[u8]> {
        self.file.as_deref().filter(|b| !b.is_empty())
    }

    /// The image reference, if one was sent and is not empty.
    pub fn image_ref(&self) -> Option<&str> {
        self.image_url.as_deref().filter(|u| !u.is_empty())
    }

    /// The profile to apply: the one sent, else the daemon or standard default, as upstream.
    pub fn effective_monitoring_profile(&self) -> MonitoringProfile {
        match self.monitoring_profile {
            Some(p) => p,
            None if self.daemon => MonitoringProfile::long_running_daemon(),
            None => MonitoringProfile::standard(),
        }
    }

    /// The JSON object. Keys with no value are omitted (as the upstream manager does); `inputs`
    /// are strings, `monitoring_profile` carries every key, `proplet_id` is left out for
    /// broadcasts.
    pub fn to_json(&self) -> Value {
        let target = wire_target(self.broadcast, self.proplet_id.as_ref());
        ObjectBuilder::new()
            .put("id", self.id.clone())
            .put("name", self.name.clone())
            .put("state", self.state)
            .put_opt("image_url", self.image_url.clone())
            .put_opt("file", self.file.as_deref().map(b64_encode))
            .put_strs_nonempty("inputs", &self.inputs)
            .put_strs("cli_args", &self.cli_args)
            .put("broadcast", self.broadcast)
            .put("daemon", self.daemon)
            .put("latent", self.latent)
            .put_str_map_nonempty("env", &self.env)
            .put("encrypted", self.encrypted)
            .put_opt("kbs_resource_path", self.kbs_resource_path.clone())
            .put_opt(
                "monitoring_profile",
                self.monitoring_profile
                    .as_ref()
                    .map(MonitoringProfile::to_json),
            )
            .put_opt("proplet_id", target)
            .put_opt("hal_storage_path", self.hal_storage_path.clone())
            .put_opt("mode", self.mode.clone())
            .put_opt("kind", self.kind.clone())
            .put_opt("priority", self.priority)
            .put_opt("metadata", self.metadata.clone().map(Value::Object))
            .put_opt(
                "parent_results",
                self.parent_results.clone().map(Value::Object),
            )
            .put_opt("run", self.run)
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// Stop a task (`control/manager/stop`).
///
/// Besides upstream's `id`, `proplet_id` and `broadcast`, the encoder always writes `name` and
/// `state` as strings: the embedded agent drops stop messages without them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopRequest {
    /// `id` (required, non-empty): the task to stop.
    pub id: String,
    /// `proplet_id`: the agent running it; never written for broadcasts.
    pub proplet_id: Option<String>,
    /// `broadcast`.
    pub broadcast: bool,
    /// `name`: the task name (decodes as `""` when absent, as upstream managers send it).
    pub name: String,
    /// `state`: informational; decodes as `""` when absent, numbers become decimal text.
    pub state: String,
}

impl StopRequest {
    /// A stop for `proplet_id`, or for every agent when `None`, with [`DEFAULT_STOP_STATE`].
    pub fn new(id: impl Into<String>, name: impl Into<String>, proplet_id: Option<String>) -> Self {
        Self {
            id: id.into(),
            broadcast: proplet_id.is_none(),
            proplet_id,
            name: name.into(),
            state: DEFAULT_STOP_STATE.to_owned(),
        }
    }

    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            id: f.req_id("id")?,
            proplet_id: f.opt_str("proplet_id")?,
            broadcast: f.bool_or("broadcast", false)?,
            name: f.opt_str("name")?.unwrap_or_default(),
            state: f.opt_text("state")?.unwrap_or_default(),
        })
    }

    /// Whether the agent `proplet_id` is addressed (upstream targeting rules).
    pub fn is_for(&self, proplet_id: &str) -> bool {
        targets(self.broadcast, self.proplet_id.as_deref(), proplet_id)
    }

    /// The JSON object: `id`, `broadcast`, `proplet_id` (not for broadcasts), `name`, `state`.
    pub fn to_json(&self) -> Value {
        let target = wire_target(self.broadcast, self.proplet_id.as_ref());
        ObjectBuilder::new()
            .put("id", self.id.clone())
            .put("broadcast", self.broadcast)
            .put_opt("proplet_id", target)
            .put("name", self.name.clone())
            .put("state", self.state.clone())
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// Invoke a latent (pre-compiled) task (`control/manager/invoke`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InvokeRequest {
    /// `id` (required, non-empty): the latent task.
    pub id: String,
    /// `broadcast`.
    pub broadcast: bool,
    /// `proplet_id`: the target agent; never written for broadcasts.
    pub proplet_id: Option<String>,
    /// `invocation_id`: echoed in the invoke result so replies can be matched.
    pub invocation_id: Option<String>,
    /// `inputs`: strings on the wire (numbers are converted on decode).
    pub inputs: Vec<String>,
    /// `env`.
    pub env: BTreeMap<String, String>,
}

impl InvokeRequest {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            id: f.req_id("id")?,
            broadcast: f.bool_or("broadcast", false)?,
            proplet_id: f.opt_str("proplet_id")?,
            invocation_id: f.opt_str("invocation_id")?,
            inputs: f.text_list("inputs")?,
            env: f.str_map("env")?,
        })
    }

    /// Whether the agent `proplet_id` is addressed (upstream targeting rules).
    pub fn is_for(&self, proplet_id: &str) -> bool {
        targets(self.broadcast, self.proplet_id.as_deref(), proplet_id)
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        let target = wire_target(self.broadcast, self.proplet_id.as_ref());
        ObjectBuilder::new()
            .put("id", self.id.clone())
            .put("broadcast", self.broadcast)
            .put_opt("proplet_id", target)
            .put_opt("invocation_id", self.invocation_id.clone())
            .put_strs_nonempty("inputs", &self.inputs)
            .put_str_map_nonempty("env", &self.env)
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targeting_follows_upstream_rules() {
        let mut s = StartRequest {
            id: "t".into(),
            name: "main".into(),
            proplet_id: Some("p1".into()),
            ..StartRequest::default()
        };
        assert!(s.is_for("p1"));
        assert!(!s.is_for("p2"));
        s.broadcast = true;
        assert!(s.is_for("p2"));
        s.broadcast = false;
        s.proplet_id = None;
        assert!(s.is_for("p2"));
        s.proplet_id = Some(String::new());
        assert!(s.is_for("p2"));
    }

    #[test]
    fn effective_profile_defaults_like_upstream() {
        let mut s = StartRequest::default();
        assert_eq!(
            s.effective_monitoring_profile(),
            MonitoringProfile::standard()
        );
        s.daemon = true;
        assert_eq!(s.effective_monitoring_profile().interval_secs, 120);
        assert_eq!(s.effective_monitoring_profile().history_size, 500);
        let custom = MonitoringProfile {
            enabled: false,
            ..MonitoringProfile::standard()
        };
        s.monitoring_profile = Some(custom);
        assert_eq!(s.effective_monitoring_profile(), custom);
    }

    #[test]
    fn empty_binary_and_image_count_as_absent() {
        let s = StartRequest {
            file: Some(Vec::new()),
            image_url: Some(String::new()),
            ..StartRequest::default()
        };
        assert_eq!(s.inline_binary(), None);
        assert_eq!(s.image_ref(), None);
    }

    #[test]
    fn stop_constructor_sets_broadcast_and_state() {
        let s = StopRequest::new("t1", "main", None);
        assert!(s.broadcast);
        assert_eq!(s.state, DEFAULT_STOP_STATE);
        let s = StopRequest::new("t1", "main", Some("p1".into()));
        assert!(!s.broadcast);
        assert!(s.is_for("p1"));
        assert!(!s.is_for("p2"));
    }

    #[test]
    fn interval_is_clamped_on_encode() {
        let p = MonitoringProfile {
            interval_secs: 0,
            ..MonitoringProfile::standard()
        };
        assert_eq!(p.to_json().get("interval"), Some(&Value::from(1u64)));
        assert_eq!(p.interval(), Duration::from_secs(1));
        let huge = MonitoringProfile {
            interval_secs: u64::MAX,
            ..MonitoringProfile::standard()
        };
        assert_eq!(
            huge.to_json().get("interval"),
            Some(&Value::from(NANOSECOND_INTERVAL_THRESHOLD - 1))
        );
    }
}
