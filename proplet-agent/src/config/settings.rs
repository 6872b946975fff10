//! Every setting of the agent, declared once: each field is a flag (clap), the flag's
//! environment variable, and a key of the TOML file (serde). Each source gives a
//! [`Settings`] of its own, a layer; [`Settings::or`] stacks them.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;

use clap::{Args, FromArgMatches};
use serde::Deserialize;

use crate::config::addresses::AddressSetting;
use crate::config::values::{
    AttesterChoice, Dirs, Interval, LogLevel, Overrides, PortRange, Qos, Size, Switch, Words,
};

use super::{value_error, ConfigError};

/// Environment aliases accepted for upstream compatibility: (alias, canonical).
pub const ALIASES: [(&str, &str); 4] = [
    ("PROPLET_TENANT_ID", "PROPLET_DOMAIN_ID"),
    ("PROPLET_ENTITY_ID", "PROPLET_CLIENT_ID"),
    ("PROPLET_API_KEY", "PROPLET_CLIENT_KEY"),
    ("PROPLET_KBS_URL", "PROPLET_KBS_URI"),
];

/// Declares [`Settings`] from one list of fields, with the merges its layers need.
macro_rules! settings {
    (
        $(#[$outer:meta])*
        pub struct Settings {
            $( $(#[$meta:meta])* pub $field:ident: Option<$ty:ty>, )*
        }
    ) => {
        $(#[$outer])*
        pub struct Settings {
            $( $(#[$meta])* pub $field: Option<$ty>, )*
        }

        impl Settings {
            /// Each setting `self` has, and `lower`'s where `self` has none.
            pub fn or(self, lower: Self) -> Self {
                Self { $( $field: self.$field.or(lower.$field), )* }
            }

            /// `self` without the settings given as empty text, which count as unset.
            pub fn given_only(self) -> Self {
                Self { $( $field: self.$field.filter(Given::is_given), )* }
            }
        }
    };
}

settings! {
    /// The agent's settings as one source gives them; `None` where it gives nothing.
    ///
    /// The help of each flag names its variable; a file's keys are the flags' names with `_`
    /// for `-` (and upstream's `tenant_id`, `entity_id` and `api_key`); other keys are
    /// ignored, except in `[bootstrap]`.
    #[derive(Args, Deserialize, Debug, Default, Clone)]
    #[serde(default)]
    pub struct Settings {
        /// Broker URL: tcp://host:1883, mqtt://…, or ssl:// / tls:// / mqtts:// for TLS (8883);
        /// several, comma-separated, to fail over between them in turn.
        #[arg(long, env = "PROPLET_MQTT_ADDRESS")]
        pub mqtt_address: Option<AddressSetting>,
        /// Domain id, the `{domain}` topic level (alias: PROPLET_TENANT_ID).
        #[arg(long, env = "PROPLET_DOMAIN_ID")]
        #[serde(alias = "tenant_id")]
        pub domain_id: Option<String>,
        /// Channel id, the `{channel}` topic level.
        #[arg(long, env = "PROPLET_CHANNEL_ID")]
        pub channel_id: Option<String>,
        /// This proplet's id: MQTT client id and username (alias: PROPLET_ENTITY_ID).
        #[arg(long, env = "PROPLET_CLIENT_ID")]
        #[serde(alias = "entity_id")]
        pub client_id: Option<String>,
        /// MQTT password (alias: PROPLET_API_KEY).
        #[arg(long, env = "PROPLET_CLIENT_KEY", hide_env_values = true)]
        #[serde(alias = "api_key")]
        pub client_key: Option<String>,
        /// QoS for subscriptions and results: 0, 1 or 2 (results are sent at least at QoS 1).
        #[arg(long, env = "PROPLET_MQTT_QOS")]
        pub mqtt_qos: Option<Qos>,
        /// Heartbeat interval: `10` or `10s`, `500ms`, `1m`.
        #[arg(long, env = "PROPLET_LIVELINESS_INTERVAL")]
        pub liveliness_interval: Option<Interval>,
        /// Proplet metrics interval (`0` disables them).
        #[arg(long, env = "PROPLET_METRICS_INTERVAL")]
        pub metrics_interval: Option<Interval>,
        /// Serve /health, /ready and /metrics over HTTP: true or false (default false).
        #[arg(long, env = "PROPLET_METRICS_ENABLED")]
        pub metrics_enabled: Option<Switch>,
        /// Port of that endpoint (default 9092), on all interfaces.
        #[arg(long, env = "PROPLET_METRICS_PORT")]
        pub metrics_port: Option<u16>,
        /// MQTT keep-alive.
        #[arg(long, env = "PROPLET_MQTT_KEEP_ALIVE")]
        pub mqtt_keep_alive: Option<Interval>,
        /// Log level: trace, debug, info, warn, error.
        #[arg(long, env = "PROPLET_LOG_LEVEL")]
        pub log_level: Option<LogLevel>,
        /// Directory of proplet plugins (accepted for compatibility; plugins are not loaded).
        #[arg(long, env = "PROPLET_PLUGIN_DIR")]
        pub plugin_dir: Option<PathBuf>,
        /// CA bundle (PEM) to verify the broker's certificate.
        #[arg(long, env = "PROPLET_MQTT_TLS_CA_CERT")]
        pub tls_ca_cert: Option<PathBuf>,
        /// Client certificate (PEM) for mutual TLS.
        #[arg(long, env = "PROPLET_MQTT_TLS_CLIENT_CERT")]
        pub tls_client_cert: Option<PathBuf>,
        /// Client key (PEM) for mutual TLS.
        #[arg(long, env = "PROPLET_MQTT_TLS_CLIENT_KEY")]
        pub tls_client_key: Option<PathBuf>,
        /// Comma-separated tags reported in discovery and heartbeats.
        #[arg(long, env = "PROPLET_TAGS")]
        pub tags: Option<Words>,
        /// Free-text location.
        #[arg(long, env = "PROPLET_LOCATION")]
        pub location: Option<String>,
        /// Free-text description.
        #[arg(long, env = "PROPLET_DESCRIPTION")]
        pub description: Option<String>,
        /// Namespace reported in heartbeats (`default`).
        #[arg(long, env = "PROPLET_MANAGER_K8S_NAMESPACE")]
        pub namespace: Option<String>,
        /// Host directories tasks may ask to have preopened (colon-separated); none by default.
        #[arg(long, env = "PROPLET_DIRS")]
        pub dirs: Option<Dirs>,
        /// Directory for the result spool and caches.
        #[arg(long, env = "PROPLET_STATE_DIR")]
        pub state_dir: Option<PathBuf>,
        /// Tasks running at once; more wait their turn.
        #[arg(long, env = "PROPLET_MAX_CONCURRENT_TASKS")]
        pub max_concurrent_tasks: Option<Size>,
        /// Linear-memory cap per task, bytes (suffixes Ki, Mi, Gi accepted).
        #[arg(long, env = "PROPLET_TASK_MEMORY_LIMIT")]
        pub task_memory_limit: Option<Size>,
        /// Wall-clock limit for non-daemon tasks (`300s`).
        #[arg(long, env = "PROPLET_TASK_TIMEOUT")]
        pub task_timeout: Option<Interval>,
        /// Instruction budget per task run (unset: no metering).
        #[arg(long, env = "PROPLET_TASK_FUEL")]
        pub task_fuel: Option<Size>,
        /// Results kept on disk while the broker is unreachable.
        #[arg(long, env = "PROPLET_SPOOL_MAX_RESULTS")]
        pub spool_max_results: Option<Size>,
        /// Lines a second each task run may log, bursting to twice that (`100`; `0`: task
        /// output is not logged).
        #[arg(long, env = "PROPLET_LOG_LINES_PER_SECOND")]
        pub log_lines_per_second: Option<Size>,
        /// Bytes of output each task run may log per hour (`1Mi`); a line past them says the
        /// rest of the hour was not logged.
        #[arg(long, env = "PROPLET_LOG_RUN_BYTES")]
        pub log_run_bytes: Option<Size>,
        /// Batches of task log lines kept on disk while the broker is unreachable (`2048`);
        /// past them the oldest batch goes.
        #[arg(long, env = "PROPLET_LOG_SPOOL_MAX_BATCHES")]
        pub log_spool_max_batches: Option<Size>,
        /// How long to wait for registry chunks (`60s`).
        #[arg(long, env = "PROPLET_CHUNK_TIMEOUT")]
        pub chunk_timeout: Option<Interval>,
        /// Largest task binary accepted, bytes (suffixes Ki, Mi, Gi; default 64Mi), whether
        /// inline, over HTTP(S) or in registry chunks.
        #[arg(long, env = "PROPLET_MAX_MODULE_SIZE")]
        pub max_module_size: Option<Size>,
        /// Serve components that export `wasi:http/incoming-handler` (`false`).
        #[arg(long, env = "PROPLET_HTTP_ENABLED")]
        pub http_enabled: Option<Switch>,
        /// Address HTTP components listen on (`0.0.0.0`).
        #[arg(long, env = "PROPLET_HTTP_BIND")]
        pub http_bind: Option<IpAddr>,
        /// Ports tried for HTTP components that ask for none, `FIRST-LAST` (`8222-8321`).
        #[arg(long, env = "PROPLET_HTTP_PORTS")]
        pub http_ports: Option<PortRange>,
        /// Hosts guests may reach with outgoing `wasi:http`, comma-separated, `*.domain`
        /// allowed (unset: any).
        #[arg(long, env = "PROPLET_HTTP_ALLOW_HOSTS")]
        pub http_allow_hosts: Option<Words>,
        /// Where guests' outgoing `wasi:http` connects instead, comma-separated
        /// `HOST:PORT:ADDRESS[:PORT]` (like curl's --connect-to); Host and TLS name are kept.
        #[arg(long, env = "PROPLET_HTTP_RESOLVE")]
        pub http_resolve: Option<Overrides>,
        /// PEM file of CA certificates trusted for guests' outgoing HTTPS, besides the Mozilla
        /// roots.
        #[arg(long, env = "PROPLET_HTTP_CA_FILE")]
        pub http_ca_file: Option<PathBuf>,
        /// Key Broker Service that releases the keys of encrypted tasks, `https://HOST[:PORT]`
        /// (alias: PROPLET_KBS_URL); unset: encrypted tasks are not taken.
        #[arg(long, env = "PROPLET_KBS_URI")]
        pub kbs_uri: Option<String>,
        /// PEM file of CA certificates trusted for the Key Broker Service, besides the
        /// Mozilla roots.
        #[arg(long, env = "PROPLET_KBS_CA_FILE")]
        pub kbs_ca_file: Option<PathBuf>,
        /// Allow an `http://` Key Broker Service (`false`): keys then cross the network
        /// wrapped for this device only, but requests and refusals travel in the clear.
        #[arg(long, env = "PROPLET_KBS_INSECURE_HTTP")]
        pub kbs_insecure_http: Option<Switch>,
        /// Evidence for the Key Broker Service: `none` (default) or `sample`, which attests
        /// nothing (any process can produce it): for tests and development only.
        #[arg(long, env = "PROPLET_ATTESTER")]
        pub attester: Option<AttesterChoice>,
        /// Only in the file: the `[bootstrap]` table, a token to enrol with on first boot.
        #[arg(skip)]
        pub bootstrap: Option<BootstrapSection>,
    }
}

/// The `[bootstrap]` table: `server` and `token` for `proplet join` on first boot.
#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootstrapSection {
    /// The broker to enrol through.
    pub server: Option<String>,
    /// The bootstrap token.
    pub token: Option<String>,
}

impl Settings {
    /// What the environment gives: each setting's variable, and upstream's [`ALIASES`] where
    /// the canonical variable is absent.
    pub fn from_env(env: &HashMap<String, String>) -> Result<Self, ConfigError> {
        Ok(Self::from_variables(env)?.or(Self::from_aliases(env)))
    }

    /// Each setting's canonical variable in `env` (its flag's `env`), read as the flag is
    /// read; a bad value names its variable. Only `env` is read, not the process's
    /// environment.
    pub(super) fn from_variables(env: &HashMap<String, String>) -> Result<Self, ConfigError> {
        let command = Self::augment_args(clap::Command::new("proplet"));
        let mut args = vec!["proplet".to_owned()];
        for arg in command.get_arguments() {
            let (Some(variable), Some(long)) = (arg.get_env(), arg.get_long()) else {
                continue;
            };
            if let Some(value) = variable.to_str().and_then(|v| env.get(v)) {
                args.push(format!("--{long}={value}"));
            }
        }
        let matches = command
            .mut_args(|arg| arg.env(None::<&'static str>))
            .try_get_matches_from(&args)
            .map_err(|e| value_error(&e, &[]))?;
        Self::from_arg_matches(&matches).map_err(|e| value_error(&e, &[]))
    }

    /// Upstream's names in `env` ([`ALIASES`]); empty ones count as unset.
    pub(super) fn from_aliases(env: &HashMap<String, String>) -> Self {
        let mut aliases = Self::default();
        for (alias, canonical) in ALIASES {
            let slot = match canonical {
                "PROPLET_DOMAIN_ID" => &mut aliases.domain_id,
                "PROPLET_CLIENT_ID" => &mut aliases.client_id,
                "PROPLET_CLIENT_KEY" => &mut aliases.client_key,
                "PROPLET_KBS_URI" => &mut aliases.kbs_uri,
                _ => continue,
            };
            *slot = env.get(alias).filter(|v| !v.is_empty()).cloned();
        }
        aliases
    }
}

/// Whether a value counts as given: empty text does not.
trait Given {
    fn is_given(&self) -> bool {
        true
    }
}

impl Given for String {
    fn is_given(&self) -> bool {
        !self.is_empty()
    }
}

impl Given for AddressSetting {
    fn is_given(&self) -> bool {
        AddressSetting::is_given(self)
    }
}

impl Given for PathBuf {}
impl Given for IpAddr {}
impl Given for u16 {}
impl Given for Interval {}
impl Given for Size {}
impl Given for Switch {}
impl Given for AttesterChoice {}
impl Given for Qos {}
impl Given for LogLevel {}
impl Given for Words {}
impl Given for Dirs {}
impl Given for PortRange {}
impl Given for Overrides {}
impl Given for BootstrapSection {}
