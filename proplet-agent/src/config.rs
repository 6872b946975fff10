//! Agent configuration: flags, then environment (upstream names and aliases), then an optional
//! TOML file, then defaults. A bad value stops start-up with the variable's name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
pub use propeller_broker::protocol::{AddressError, BrokerAddress};

mod addresses;
mod file;
mod values;

pub use addresses::*;
use file::*;
pub use values::*;

/// A configuration problem, naming the setting at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// A value does not parse.
    #[error("{name}: {message}")]
    Invalid {
        /// Flag or variable name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// A required setting is missing everywhere.
    #[error("{name} is required (flag {flag}, or set it in the config file as `{key}`)")]
    Missing {
        /// Variable name.
        name: &'static str,
        /// Flag.
        flag: &'static str,
        /// Key in the TOML file.
        key: &'static str,
    },
    /// The TOML file cannot be used.
    #[error("config file {path}: {message}")]
    File {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// An entry of the broker address list is unusable.
    #[error("{origin}: {}", describe_entry(*.entry, *.count, .value, .problem))]
    Address {
        /// Where the list came from: `PROPLET_MQTT_ADDRESS` (flag or environment), or the
        /// `mqtt_address` key of a config file.
        origin: String,
        /// Position of the bad entry, from 1.
        entry: usize,
        /// Entries in the list.
        count: usize,
        /// The entry as given.
        value: String,
        /// What is wrong with it.
        problem: AddressError,
    },
}

/// `proplet`: runs WebAssembly tasks sent by Propeller over MQTT.
///
/// Every flag can also be set through the environment variable shown, or in the TOML file
/// given by --config (keys are the flag names with `_` instead of `-`). Flags win over the
/// environment, which wins over the file.
#[derive(Parser, Debug, Default, Clone)]
#[command(name = "proplet", version, about, long_about = None)]
pub struct Flags {
    /// TOML configuration file.
    #[arg(long, env = "PROPLET_CONFIG_FILE")]
    pub config: Option<PathBuf>,
    /// Broker URL: tcp://host:1883, mqtt://…, or ssl:// / tls:// / mqtts:// for TLS (8883);
    /// several, comma-separated, to fail over between them in turn.
    #[arg(long, env = "PROPLET_MQTT_ADDRESS")]
    pub mqtt_address: Option<String>,
    /// Domain id, the `{domain}` topic level (alias: PROPLET_TENANT_ID).
    #[arg(long, env = "PROPLET_DOMAIN_ID")]
    pub domain_id: Option<String>,
    /// Channel id, the `{channel}` topic level.
    #[arg(long, env = "PROPLET_CHANNEL_ID")]
    pub channel_id: Option<String>,
    /// This proplet's id: MQTT client id and username (alias: PROPLET_ENTITY_ID).
    #[arg(long, env = "PROPLET_CLIENT_ID")]
    pub client_id: Option<String>,
    /// MQTT password (alias: PROPLET_API_KEY).
    #[arg(long, env = "PROPLET_CLIENT_KEY", hide_env_values = true)]
    pub client_key: Option<String>,
    /// QoS for subscriptions and results: 0, 1 or 2 (results are sent at least at QoS 1).
    #[arg(long, env = "PROPLET_MQTT_QOS")]
    pub mqtt_qos: Option<String>,
    /// Heartbeat interval: `10` or `10s`, `500ms`, `1m`.
    #[arg(long, env = "PROPLET_LIVELINESS_INTERVAL")]
    pub liveliness_interval: Option<String>,
    /// Proplet metrics interval (`0` disables them).
    #[arg(long, env = "PROPLET_METRICS_INTERVAL")]
    pub metrics_interval: Option<String>,
    /// Serve /health, /ready and /metrics over HTTP: true or false (default false).
    #[arg(long, env = "PROPLET_METRICS_ENABLED")]
    pub metrics_enabled: Option<String>,
    /// Port of that endpoint (default 9092), on all interfaces.
    #[arg(long, env = "PROPLET_METRICS_PORT")]
    pub metrics_port: Option<String>,
    /// MQTT keep-alive.
    #[arg(long, env = "PROPLET_MQTT_KEEP_ALIVE")]
    pub mqtt_keep_alive: Option<String>,
    /// Log level: trace, debug, info, warn, error.
    #[arg(long, env = "PROPLET_LOG_LEVEL")]
    pub log_level: Option<String>,
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
    pub tags: Option<String>,
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
    pub dirs: Option<String>,
    /// Directory for the result spool and caches.
    #[arg(long, env = "PROPLET_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Tasks running at once; more wait their turn.
    #[arg(long, env = "PROPLET_MAX_CONCURRENT_TASKS")]
    pub max_concurrent_tasks: Option<String>,
    /// Linear-memory cap per task, bytes (suffixes Ki, Mi, Gi accepted).
    #[arg(long, env = "PROPLET_TASK_MEMORY_LIMIT")]
    pub task_memory_limit: Option<String>,
    /// Wall-clock limit for non-daemon tasks (`300s`).
    #[arg(long, env = "PROPLET_TASK_TIMEOUT")]
    pub task_timeout: Option<String>,
    /// Instruction budget per task run (unset: no metering).
    #[arg(long, env = "PROPLET_TASK_FUEL")]
    pub task_fuel: Option<String>,
    /// Results kept on disk while the broker is unreachable.
    #[arg(long, env = "PROPLET_SPOOL_MAX_RESULTS")]
    pub spool_max_results: Option<String>,
    /// How long to wait for registry chunks (`60s`).
    #[arg(long, env = "PROPLET_CHUNK_TIMEOUT")]
    pub chunk_timeout: Option<String>,
    /// Largest task binary accepted, bytes (suffixes Ki, Mi, Gi; default 64Mi), whether inline,
    /// over HTTP(S) or in registry chunks.
    #[arg(long, env = "PROPLET_MAX_MODULE_SIZE")]
    pub max_module_size: Option<String>,
    /// Serve components that export `wasi:http/incoming-handler` (`false`).
    #[arg(long, env = "PROPLET_HTTP_ENABLED")]
    pub http_enabled: Option<String>,
    /// Address HTTP components listen on (`0.0.0.0`).
    #[arg(long, env = "PROPLET_HTTP_BIND")]
    pub http_bind: Option<String>,
    /// Ports tried for HTTP components that ask for none, `FIRST-LAST` (`8222-8321`).
    #[arg(long, env = "PROPLET_HTTP_PORTS")]
    pub http_ports: Option<String>,
    /// Hosts guests may reach with outgoing `wasi:http`, comma-separated, `*.domain` allowed
    /// (unset: any).
    #[arg(long, env = "PROPLET_HTTP_ALLOW_HOSTS")]
    pub http_allow_hosts: Option<String>,
    /// Where guests' outgoing `wasi:http` connects instead, comma-separated
    /// `HOST:PORT:ADDRESS[:PORT]` (like curl's --connect-to); Host and TLS name are kept.
    #[arg(long, env = "PROPLET_HTTP_RESOLVE")]
    pub http_resolve: Option<String>,
    /// PEM file of CA certificates trusted for guests' outgoing HTTPS, besides the Mozilla
    /// roots.
    #[arg(long, env = "PROPLET_HTTP_CA_FILE")]
    pub http_ca_file: Option<String>,
}

/// TLS material for the broker connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// CA bundle; system roots are not used, so it is required for TLS.
    pub ca_cert: PathBuf,
    /// Client certificate and key for mutual TLS.
    pub client: Option<(PathBuf, PathBuf)>,
}

/// The resolved configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Brokers, tried in turn: the agent connects to the first and moves to the next one
    /// (round-robin) whenever a connection fails or drops.
    pub brokers: BrokerAddresses,
    /// TLS material, present when any broker address asks for TLS.
    pub tls: Option<TlsFiles>,
    /// `{domain}`.
    pub domain_id: String,
    /// `{channel}`.
    pub channel_id: String,
    /// Client id.
    pub client_id: String,
    /// Password.
    pub client_key: String,
    /// 0, 1 or 2.
    pub qos: u8,
    /// Heartbeat period.
    pub liveliness_interval: Duration,
    /// Proplet metrics period; `None` when disabled.
    pub metrics_interval: Option<Duration>,
    /// MQTT keep-alive.
    pub keep_alive: Duration,
    /// Log filter.
    pub log_level: String,
    /// Plugin directory (reported, not loaded).
    pub plugin_dir: Option<PathBuf>,
    /// Tags.
    pub tags: Vec<String>,
    /// Location.
    pub location: Option<String>,
    /// Description.
    pub description: Option<String>,
    /// Namespace.
    pub namespace: String,
    /// State directory.
    pub state_dir: PathBuf,
    /// Concurrency cap.
    pub max_concurrent_tasks: usize,
    /// Memory cap per task.
    pub task_memory_limit: usize,
    /// Default wall-clock limit.
    pub task_timeout: Duration,
    /// Fuel per run.
    pub task_fuel: Option<u64>,
    /// Spool bound.
    pub spool_max_results: usize,
    /// Chunk wait.
    pub chunk_timeout: Duration,
    /// Largest task binary accepted: a larger one fails its task before it is compiled, and
    /// before it is downloaded whole when its size is announced.
    pub max_module_size: usize,
    /// Where the health and metrics endpoint listens, when enabled.
    pub telemetry: Option<std::net::SocketAddr>,
    /// Directories tasks may be granted.
    pub preopen_dirs: Vec<PathBuf>,
    /// Where HTTP components may listen.
    pub http_serving: crate::http_server::HttpServing,
    /// Hosts guests may reach over `wasi:http` (empty: any).
    pub http_allow_hosts: Vec<String>,
    /// Host overrides for guests' `wasi:http`.
    pub http_resolve: Vec<crate::outgoing_http::HostOverride>,
    /// Extra roots for guests' HTTPS, read from `PROPLET_HTTP_CA_FILE`.
    pub http_ca_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
}

/// Default of `PROPLET_MAX_MODULE_SIZE`. Real task modules are a few MiB (an interpreter
/// such as CPython is about 30 MiB); compiling a module takes several times its size in
/// memory, which a 64 MiB module already costs a Raspberry Pi dearly.
pub const DEFAULT_MAX_MODULE_SIZE: usize = 64 * 1024 * 1024;

/// Environment aliases accepted for upstream compatibility: (alias, canonical).
pub const ALIASES: [(&str, &str); 3] = [
    ("PROPLET_TENANT_ID", "PROPLET_DOMAIN_ID"),
    ("PROPLET_ENTITY_ID", "PROPLET_CLIENT_ID"),
    ("PROPLET_API_KEY", "PROPLET_CLIENT_KEY"),
];

impl Config {
    /// Resolves flags (already merged with the canonical environment by clap), aliases from
    /// `env`, and the TOML file.
    pub fn resolve(mut flags: Flags, env: &HashMap<String, String>) -> Result<Self, ConfigError> {
        for (alias, canonical) in ALIASES {
            let slot = match canonical {
                "PROPLET_DOMAIN_ID" => &mut flags.domain_id,
                "PROPLET_CLIENT_ID" => &mut flags.client_id,
                _ => &mut flags.client_key,
            };
            if slot.is_none() {
                if let Some(v) = env.get(alias).filter(|v| !v.is_empty()) {
                    *slot = Some(v.clone());
                }
            }
        }
        let file = match &flags.config {
            Some(path) => load_file(path)?,
            None => FileValues::default(),
        };
        let pick = |flag: &Option<String>, key: &str| -> Option<String> {
            flag.clone()
                .filter(|v| !v.is_empty())
                .or_else(|| file.get(key))
        };

        let brokers = match flags.mqtt_address.as_deref().filter(|v| !v.is_empty()) {
            Some(text) => BrokerAddresses::parse_list(text, "PROPLET_MQTT_ADDRESS")?,
            None => match file.brokers(flags.config.as_deref()) {
                Some(parsed) => parsed?,
                None => BrokerAddresses::single(BrokerAddress {
                    host: "localhost".into(),
                    port: 1883,
                    tls: false,
                }),
            },
        };
        let tls = if let Some(address) = brokers.first_tls() {
            let ca = flags
                .tls_ca_cert
                .clone()
                .or_else(|| file.get("tls_ca_cert").map(PathBuf::from))
                .ok_or(ConfigError::Invalid {
                    name: "PROPLET_MQTT_TLS_CA_CERT".into(),
                    message: format!("{address} uses TLS; give the CA bundle that signed the broker's certificate"),
                })?;
            let cert = flags
                .tls_client_cert
                .clone()
                .or_else(|| file.get("tls_client_cert").map(PathBuf::from));
            let key = flags
                .tls_client_key
                .clone()
                .or_else(|| file.get("tls_client_key").map(PathBuf::from));
            let client = match (cert, key) {
                (Some(c), Some(k)) => Some((c, k)),
                (None, None) => None,
                _ => {
                    return Err(ConfigError::Invalid {
                        name: "PROPLET_MQTT_TLS_CLIENT_CERT".into(),
                        message: "client certificate and client key must be given together".into(),
                    })
                }
            };
            Some(TlsFiles {
                ca_cert: ca,
                client,
            })
        } else {
            None
        };

        let required = |value: Option<String>,
                        name: &'static str,
                        flag: &'static str,
                        key: &'static str|
         -> Result<String, ConfigError> {
            value.ok_or(ConfigError::Missing { name, flag, key })
        };
        let domain_id = required(
            pick(&flags.domain_id, "domain_id").or_else(|| file.get("tenant_id")),
            "PROPLET_DOMAIN_ID",
            "--domain-id",
            "domain_id",
        )?;
        let channel_id = required(
            pick(&flags.channel_id, "channel_id"),
            "PROPLET_CHANNEL_ID",
            "--channel-id",
            "channel_id",
        )?;
        let client_id = required(
            pick(&flags.client_id, "client_id").or_else(|| file.get("entity_id")),
            "PROPLET_CLIENT_ID",
            "--client-id",
            "client_id",
        )?;
        let client_key = required(
            pick(&flags.client_key, "client_key").or_else(|| file.get("api_key")),
            "PROPLET_CLIENT_KEY",
            "--client-key",
            "client_key",
        )?;
        for (name, value) in [
            ("PROPLET_DOMAIN_ID", &domain_id),
            ("PROPLET_CHANNEL_ID", &channel_id),
            ("PROPLET_CLIENT_ID", &client_id),
        ] {
            if value.contains(['/', '+', '#']) {
                return Err(invalid(
                    name,
                    "must not contain `/`, `+` or `#` (it is a topic level)",
                ));
            }
        }

        let qos = match pick(&flags.mqtt_qos, "mqtt_qos").as_deref() {
            None => 1,
            Some("0") => 0,
            Some("1") => 1,
            Some("2") => 2,
            Some(other) => {
                return Err(invalid(
                    "PROPLET_MQTT_QOS",
                    &format!("{other:?} is not 0, 1 or 2"),
                ))
            }
        };
        let duration =
            |flag: &Option<String>, key: &str, name: &str, default: Duration| match pick(flag, key)
            {
                None => Ok(default),
                Some(text) => parse_duration(&text).map_err(|m| invalid(name, &m)),
            };
        let liveliness_interval = duration(
            &flags.liveliness_interval,
            "liveliness_interval",
            "PROPLET_LIVELINESS_INTERVAL",
            Duration::from_secs(10),
        )?;
        if liveliness_interval.is_zero() {
            return Err(invalid("PROPLET_LIVELINESS_INTERVAL", "must be positive"));
        }
        let metrics_interval = duration(
            &flags.metrics_interval,
            "metrics_interval",
            "PROPLET_METRICS_INTERVAL",
            Duration::from_secs(10),
        )?;
        let keep_alive = duration(
            &flags.mqtt_keep_alive,
            "mqtt_keep_alive",
            "PROPLET_MQTT_KEEP_ALIVE",
            Duration::from_secs(30),
        )?;
        if keep_alive < Duration::from_secs(1) {
            return Err(invalid("PROPLET_MQTT_KEEP_ALIVE", "must be at least 1s"));
        }
        let log_level = pick(&flags.log_level, "log_level").unwrap_or_else(|| "info".into());
        if !["trace", "debug", "info", "warn", "error"]
            .contains(&log_level.to_ascii_lowercase().as_str())
        {
            return Err(invalid(
                "PROPLET_LOG_LEVEL",
                &format!("{log_level:?} is not trace, debug, info, warn or error"),
            ));
        }
        let number =
            |flag: &Option<String>, key: &str, name: &str, default: u64| match pick(flag, key) {
                None => Ok(default),
                Some(text) => parse_size(&text).map_err(|m| invalid(name, &m)),
            };
        let max_concurrent_tasks = number(
            &flags.max_concurrent_tasks,
            "max_concurrent_tasks",
            "PROPLET_MAX_CONCURRENT_TASKS",
            4,
        )?;
        if max_concurrent_tasks == 0 {
            return Err(invalid("PROPLET_MAX_CONCURRENT_TASKS", "must be positive"));
        }
        let task_memory_limit = number(
            &flags.task_memory_limit,
            "task_memory_limit",
            "PROPLET_TASK_MEMORY_LIMIT",
            256 * 1024 * 1024,
        )?;
        let task_timeout = duration(
            &flags.task_timeout,
            "task_timeout",
            "PROPLET_TASK_TIMEOUT",
            Duration::from_secs(300),
        )?;
        let task_fuel = match pick(&flags.task_fuel, "task_fuel") {
            None => None,
            Some(text) => Some(parse_size(&text).map_err(|m| invalid("PROPLET_TASK_FUEL", &m))?),
        };
        let spool_max_results = number(
            &flags.spool_max_results,
            "spool_max_results",
            "PROPLET_SPOOL_MAX_RESULTS",
            10_000,
        )?;
        let chunk_timeout = duration(
            &flags.chunk_timeout,
            "chunk_timeout",
            "PROPLET_CHUNK_TIMEOUT",
            Duration::from_secs(60),
        )?;
        let max_module_size = number(
            &flags.max_module_size,
            "max_module_size",
            "PROPLET_MAX_MODULE_SIZE",
            DEFAULT_MAX_MODULE_SIZE as u64,
        )?;
        if max_module_size < 8 {
            return Err(invalid(
                "PROPLET_MAX_MODULE_SIZE",
                "must be at least 8 bytes (a Wasm header)",
            ));
        }
        let telemetry_enabled = match pick(&flags.metrics_enabled, "metrics_enabled") {
            None => false,
            Some(text) => parse_bool(&text).ok_or_else(|| {
                invalid(
                    "PROPLET_METRICS_ENABLED",
                    &format!("{text:?} is not true or false"),
                )
            })?,
        };
        let telemetry_port = match pick(&flags.metrics_port, "metrics_port") {
            None => 9092,
            Some(text) => text.trim().parse::<u16>().map_err(|_| {
                invalid(
                    "PROPLET_METRICS_PORT",
                    &format!("{text:?} is not a port number"),
                )
            })?,
        };
        let tags = comma_list(pick(&flags.tags, "tags"));
        let http_serving = http_serving(&flags, &pick)?;
        let http_allow_hosts = comma_list(pick(&flags.http_allow_hosts, "http_allow_hosts"));
        let http_resolve = match pick(&flags.http_resolve, "http_resolve") {
            None => Vec::new(),
            Some(text) => crate::outgoing_http::parse_overrides(&text)
                .map_err(|m| invalid("PROPLET_HTTP_RESOLVE", &m))?,
        };
        let http_ca_roots = match pick(&flags.http_ca_file, "http_ca_file") {
            None => Vec::new(),
            Some(path) => crate::outgoing_http::load_roots(Path::new(path.trim()))
                .map_err(|e| invalid("PROPLET_HTTP_CA_FILE", &e.to_string()))?,
        };
        let state_dir = flags
            .state_dir
            .clone()
            .or_else(|| file.get("state_dir").map(PathBuf::from))
            .unwrap_or_else(|| std::env::temp_dir().join(format!("proplet-{client_id}")));
        Ok(Self {
            brokers,
            tls,
            domain_id,
            channel_id,
            client_id,
            client_key,
            qos,
            liveliness_interval,
            metrics_interval: (!metrics_interval.is_zero()).then_some(metrics_interval),
            keep_alive,
            log_level,
            plugin_dir: flags
                .plugin_dir
                .clone()
                .or_else(|| file.get("plugin_dir").map(PathBuf::from)),
            tags,
            location: pick(&flags.location, "location"),
            description: pick(&flags.description, "description"),
            namespace: pick(&flags.namespace, "namespace").unwrap_or_else(|| "default".into()),
            state_dir,
            max_concurrent_tasks: max_concurrent_tasks as usize,
            task_memory_limit: task_memory_limit as usize,
            task_timeout,
            task_fuel,
            spool_max_results: spool_max_results as usize,
            chunk_timeout,
            max_module_size: usize::try_from(max_module_size).unwrap_or(usize::MAX),
            telemetry: telemetry_enabled
                .then(|| std::net::SocketAddr::from(([0, 0, 0, 0], telemetry_port))),
            preopen_dirs: pick(&flags.dirs, "dirs")
                .map(|d| {
                    d.split([':', ','])
                        .map(str::trim)
                        .filter(|p| !p.is_empty())
                        .map(PathBuf::from)
                        .collect()
                })
                .unwrap_or_default(),
            http_serving,
            http_allow_hosts,
            http_resolve,
            http_ca_roots,
        })
    }
}

fn http_serving(
    flags: &Flags,
    pick: &dyn Fn(&Option<String>, &str) -> Option<String>,
) -> Result<crate::http_server::HttpServing, ConfigError> {
    let mut serving = crate::http_server::HttpServing::default();
    if let Some(text) = pick(&flags.http_enabled, "http_enabled") {
        serving.enabled = parse_bool(&text).ok_or_else(|| {
            invalid(
                "PROPLET_HTTP_ENABLED",
                &format!("{text:?} is not true or false"),
            )
        })?;
    }
    if let Some(text) = pick(&flags.http_bind, "http_bind") {
        serving.bind = text.trim().parse().map_err(|_| {
            invalid(
                "PROPLET_HTTP_BIND",
                &format!("{text:?} is not an IP address"),
            )
        })?;
    }
    if let Some(text) = pick(&flags.http_ports, "http_ports") {
        let bad = || invalid("PROPLET_HTTP_PORTS", &format!("{text:?} is not FIRST-LAST"));
        let (first, last) = text.trim().split_once('-').ok_or_else(bad)?;
        let first: u16 = first.trim().parse().map_err(|_| bad())?;
        let last: u16 = last.trim().parse().map_err(|_| bad())?;
        if first == 0 || first > last {
            return Err(bad());
        }
        serving.ports = first..=last;
    }
    Ok(serving)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Flags {
        Flags {
            domain_id: Some("d".into()),
            channel_id: Some("c".into()),
            client_id: Some("p1".into()),
            client_key: Some("k".into()),
            ..Flags::default()
        }
    }

    fn resolve(flags: Flags) -> Result<Config, ConfigError> {
        Config::resolve(flags, &HashMap::new())
    }

    #[test]
    fn defaults_fill_everything_optional() {
        let c = match resolve(base()) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(
            c.brokers.as_slice(),
            [BrokerAddress {
                host: "localhost".into(),
                port: 1883,
                tls: false
            }]
        );
        assert_eq!(c.liveliness_interval, Duration::from_secs(10));
        assert_eq!(c.metrics_interval, Some(Duration::from_secs(10)));
        assert_eq!(c.namespace, "default");
        assert_eq!(c.qos, 1);
    }

    #[test]
    fn intervals_accept_plain_seconds_and_units() {
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("10x").is_err());
    }

    #[test]
    fn bad_values_name_the_variable() {
        let mut f = base();
        f.liveliness_interval = Some("soon".into());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("PROPLET_LIVELINESS_INTERVAL"), "{e}");

        let mut f = base();
        f.mqtt_qos = Some("3".into());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("PROPLET_MQTT_QOS"), "{e}");

        let mut f = base();
        f.client_key = None;
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("PROPLET_CLIENT_KEY"), "{e}");

        let mut f = base();
        f.mqtt_address = Some("http://x".into());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("PROPLET_MQTT_ADDRESS"), "{e}");
    }

    #[test]
    fn upstream_aliases_are_accepted() {
        let env: HashMap<String, String> = [
            ("PROPLET_TENANT_ID", "tenant"),
            ("PROPLET_ENTITY_ID", "entity"),
            ("PROPLET_API_KEY", "apikey"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let flags = Flags {
            channel_id: Some("c".into()),
            ..Flags::default()
        };
        let c = match Config::resolve(flags, &env) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(
            (
                c.domain_id.as_str(),
                c.client_id.as_str(),
                c.client_key.as_str()
            ),
            ("tenant", "entity", "apikey")
        );
    }

    #[test]
    fn file_fills_only_what_flags_and_env_leave_empty() {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        };
        let path = dir.path().join("proplet.toml");
        let written = std::fs::write(
            &path,
            "[proplet]\ntenant_id = \"file-domain\"\nchannel_id = \"file-chan\"\nentity_id = \"file-id\"\napi_key = \"file-key\"\nliveliness_interval = \"3s\"\ntags = [\"gpu\", \"arm\"]\n",
        );
        if let Err(e) = written {
            panic!("{e}");
        }
        let flags = Flags {
            config: Some(path),
            client_id: Some("flag-id".into()),
            ..Flags::default()
        };
        let c = match resolve(flags) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(c.client_id, "flag-id");
        assert_eq!(c.domain_id, "file-domain");
        assert_eq!(c.liveliness_interval, Duration::from_secs(3));
        assert_eq!(c.tags, vec!["gpu", "arm"]);
    }

    #[test]
    fn addresses_parse_like_upstream() {
        assert_eq!(parse_address("tcp://h:1"), Ok(("h".into(), 1, false)));
        assert_eq!(parse_address("mqtts://h"), Ok(("h".into(), 8883, true)));
        assert_eq!(parse_address("[::1]:1884"), Ok(("::1".into(), 1884, false)));
        assert_eq!(
            parse_address("localhost:1883"),
            Ok(("localhost".into(), 1883, false))
        );
        assert!(parse_address("tcp://:1").is_err());
    }

    #[test]
    fn outgoing_http_settings_are_checked_at_start_up() {
        let mut f = base();
        f.http_resolve = Some("httpbin.org:443:127.0.0.1:40123,httpbin.org:80".into());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.starts_with("PROPLET_HTTP_RESOLVE: \"httpbin.org:80\": missing address"),
            "{e}"
        );

        let mut f = base();
        f.http_ca_file = Some("/nonexistent/ca.pem".into());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.starts_with("PROPLET_HTTP_CA_FILE: /nonexistent/ca.pem"),
            "{e}"
        );

        let mut f = base();
        f.http_resolve = Some("httpbin.org:443:127.0.0.1:40123".into());
        let c = match resolve(f) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(c.http_resolve.len(), 1);
        assert_eq!(c.http_resolve[0].to_port, 40123);
        let defaults = match resolve(base()) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        };
        assert!(defaults.http_resolve.is_empty() && defaults.http_ca_roots.is_empty());
    }

    fn address(host: &str, port: u16, tls: bool) -> BrokerAddress {
        BrokerAddress {
            host: host.into(),
            port,
            tls,
        }
    }

    fn with_address(text: &str) -> Result<Config, ConfigError> {
        let mut f = base();
        f.mqtt_address = Some(text.into());
        resolve(f)
    }

    /// Resolves `base()` with a config file holding `toml` (and no address flag).
    fn with_file(toml: &str) -> Result<Config, ConfigError> {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("proplet.toml");
        std::fs::write(&path, toml).unwrap_or_else(|e| panic!("{e}"));
        let mut f = base();
        f.config = Some(path);
        resolve(f)
    }

    fn brokers(outcome: Result<Config, ConfigError>) -> Vec<BrokerAddress> {
        match outcome {
            Ok(c) => c.brokers.as_slice().to_vec(),
            Err(e) => panic!("{e}"),
        }
    }

    fn error(outcome: Result<Config, ConfigError>) -> String {
        match outcome {
            Ok(c) => panic!("accepted: {:?}", c.brokers),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_single_address_reads_as_before() {
        assert_eq!(
            brokers(with_address("tcp://broker:1884")),
            [address("broker", 1884, false)]
        );
        assert_eq!(
            error(with_address("http://x")),
            "PROPLET_MQTT_ADDRESS: \"http://x\": unknown scheme \"http\" (use tcp, mqtt, ssl, tls or mqtts)"
        );
        assert_eq!(
            error(with_address("tcp://x:port")),
            "PROPLET_MQTT_ADDRESS: \"tcp://x:port\": bad port"
        );
    }

    #[test]
    fn a_comma_separated_list_keeps_its_order_and_ignores_spaces() {
        assert_eq!(
            brokers(with_address("tcp://a:1883, mqtt://b:1884 ,c,  [::1]:1885")),
            [
                address("a", 1883, false),
                address("b", 1884, false),
                address("c", 1883, false),
                address("::1", 1885, false),
            ]
        );
    }

    #[test]
    fn empty_entries_are_refused_with_their_position() {
        assert_eq!(
            error(with_address("tcp://a:1,,tcp://b:2")),
            "PROPLET_MQTT_ADDRESS: entry 2 of 3: empty address (give one or more addresses \
             separated by commas, e.g. tcp://a:1883,tcp://b:1883)"
        );
        let e = error(with_address("tcp://a:1,"));
        assert!(
            e.starts_with("PROPLET_MQTT_ADDRESS: entry 2 of 2: empty address"),
            "{e}"
        );
        let e = error(with_address(" , "));
        assert!(
            e.starts_with("PROPLET_MQTT_ADDRESS: entry 1 of 2: empty address"),
            "{e}"
        );
        let e = error(with_address("   "));
        assert!(e.starts_with("PROPLET_MQTT_ADDRESS: empty address"), "{e}");
    }

    #[test]
    fn a_bad_entry_is_named_with_its_source() {
        let e = error(with_address("tcp://a:1, ftp://b:2"));
        assert_eq!(
            e,
            "PROPLET_MQTT_ADDRESS: entry 2 of 2, \"ftp://b:2\": unknown scheme \"ftp\" \
             (use tcp, mqtt, ssl, tls or mqtts)"
        );
        match with_address("tcp://a:1,tcp://:2") {
            Err(ConfigError::Address {
                entry: 2,
                count: 2,
                problem: AddressError::MissingHost,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_file_accepts_a_string_list_or_an_array() {
        assert_eq!(
            brokers(with_file("mqtt_address = \"tcp://a:1, tcp://b:2\"\n")),
            [address("a", 1, false), address("b", 2, false)]
        );
        assert_eq!(
            brokers(with_file(
                "[proplet]\nmqtt_address = [\"tcp://a:1\", \" tcp://b:2 \"]\n"
            )),
            [address("a", 1, false), address("b", 2, false)]
        );
        assert_eq!(
            brokers(with_file("mqtt_address = \"tcp://solo:7\"\n")),
            [address("solo", 7, false)]
        );
        // The flag (or environment) wins over the file.
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("proplet.toml");
        std::fs::write(&path, "mqtt_address = [\"tcp://file:1\"]\n")
            .unwrap_or_else(|e| panic!("{e}"));
        let mut f = base();
        f.config = Some(path);
        f.mqtt_address = Some("tcp://flag:2".into());
        assert_eq!(brokers(resolve(f)), [address("flag", 2, false)]);
    }

    #[test]
    fn file_errors_name_the_key_and_the_file() {
        let e = error(with_file("mqtt_address = [\"tcp://a:1\", \"\"]\n"));
        assert!(
            e.starts_with("`mqtt_address` in config file ")
                && e.contains("proplet.toml: entry 2 of 2: empty address"),
            "{e}"
        );
        let e = error(with_file("mqtt_address = []\n"));
        assert!(
            e.starts_with("`mqtt_address` in config file ") && e.contains(": empty address"),
            "{e}"
        );
        let e = error(with_file("mqtt_address = [\"tcp://a:1\", 1883]\n"));
        assert!(e.ends_with("entry 2 of 2, \"1883\": not a string"), "{e}");
        let e = error(with_file("mqtt_address = \"tcp://a:1,tcp://b:x\"\n"));
        assert!(e.ends_with("entry 2 of 2, \"tcp://b:x\": bad port"), "{e}");
    }

    #[test]
    fn addresses_display_as_urls() {
        let list = BrokerAddresses::parse_list("a, mqtts://b, [fe80::1]:9", "x")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            list.to_string(),
            "tcp://a:1883,ssl://b:8883,tcp://[fe80::1]:9"
        );
        assert_eq!(list.len(), 3);
        assert_eq!(list.primary(), &address("a", 1883, false));
        assert_eq!(BrokerAddresses::new(Vec::new()), None);
    }

    #[test]
    fn any_tls_address_needs_the_ca() {
        let e = error(with_address("tcp://a:1883,mqtts://b"));
        assert!(
            e.starts_with("PROPLET_MQTT_TLS_CA_CERT: ssl://b:8883 uses TLS"),
            "{e}"
        );
        let mut f = base();
        f.mqtt_address = Some("tcp://a:1883,mqtts://b".into());
        f.tls_ca_cert = Some("/etc/proplet/ca.pem".into());
        let c = resolve(f).unwrap_or_else(|e| panic!("{e}"));
        assert!(c.tls.is_some());
        assert_eq!(
            c.brokers.as_slice(),
            [address("a", 1883, false), address("b", 8883, true)]
        );
    }

    #[test]
    fn tls_scheme_needs_a_ca() {
        let mut f = base();
        f.mqtt_address = Some("ssl://broker:8883".into());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("PROPLET_MQTT_TLS_CA_CERT"), "{e}");
    }
}
