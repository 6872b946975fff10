//! Agent configuration: flags, then environment (upstream names and aliases), then an optional
//! TOML file, then defaults. A bad value stops start-up with the variable's name.

use std::collections::HashMap;
use std::path::PathBuf;
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
    /// `join` (enrol with a bootstrap token) or `configured` (for systemd); none: run.
    #[command(subcommand)]
    pub command: Option<AgentCommand>,
    /// TOML configuration file.
    #[arg(long, env = "PROPLET_CONFIG_FILE", global = true)]
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
    /// How long to wait for registry chunks (`60s`).
    #[arg(long, env = "PROPLET_CHUNK_TIMEOUT")]
    pub chunk_timeout: Option<Interval>,
    /// Largest task binary accepted, bytes (suffixes Ki, Mi, Gi; default 64Mi), whether inline,
    /// over HTTP(S) or in registry chunks.
    #[arg(long, env = "PROPLET_MAX_MODULE_SIZE")]
    pub max_module_size: Option<Size>,
    /// Serve components that export `wasi:http/incoming-handler` (`false`).
    #[arg(long, env = "PROPLET_HTTP_ENABLED")]
    pub http_enabled: Option<Switch>,
    /// Address HTTP components listen on (`0.0.0.0`).
    #[arg(long, env = "PROPLET_HTTP_BIND")]
    pub http_bind: Option<std::net::IpAddr>,
    /// Ports tried for HTTP components that ask for none, `FIRST-LAST` (`8222-8321`).
    #[arg(long, env = "PROPLET_HTTP_PORTS")]
    pub http_ports: Option<PortRange>,
    /// Hosts guests may reach with outgoing `wasi:http`, comma-separated, `*.domain` allowed
    /// (unset: any).
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
}

/// The agent's subcommands.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum AgentCommand {
    /// Enrol this device with a bootstrap token (`propeller token create`), keep its own
    /// credentials in the state directory, then run. As root on a host with the packaged
    /// proplet.service, the service is enabled and (re)started instead of running here.
    Join(JoinArgs),
    /// Exit 0 when this device can run (enrolled, configured by hand, or given a bootstrap
    /// token), 1 otherwise: the unit's ExecCondition, so an unconfigured device does not
    /// crash-loop.
    Configured,
}

/// Flags of `proplet join`.
#[derive(clap::Args, Debug, Clone)]
pub struct JoinArgs {
    /// The broker: mqtts://host:8883 (or tcp:// with --insecure-enrol).
    #[arg(long, env = "PROPLET_BOOTSTRAP_SERVER")]
    pub server: String,
    /// The bootstrap token, `<id>.<secret>`.
    #[arg(long, env = "PROPLET_BOOTSTRAP_TOKEN", hide_env_values = true)]
    pub token: String,
    /// CA bundle (PEM) that signed the broker's certificate.
    #[arg(long, env = "PROPLET_MQTT_TLS_CA_CERT")]
    pub tls_ca_cert: Option<PathBuf>,
    /// Send the token over plain tcp:// (the token must allow it too).
    #[arg(long)]
    pub insecure_enrol: bool,
    /// A stable id of this machine, instead of /etc/machine-id.
    #[arg(long)]
    pub machine_id: Option<String>,
    /// Where the credentials go (default: the configured state directory, else
    /// /var/lib/proplet).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Run the agent here even where the packaged service could run it.
    #[arg(long)]
    pub foreground: bool,
    /// Only enrol: write the credentials and exit.
    #[arg(long, conflicts_with = "foreground")]
    pub no_run: bool,
}

/// Where a device stands before it can run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// It enrolled: its credentials are in this file.
    Enrolled(PathBuf),
    /// A client id and key are configured by hand.
    Configured,
    /// It has a bootstrap token to enrol with first.
    Bootstrap {
        /// The broker to enrol through.
        server: String,
        /// The token.
        token: String,
    },
    /// Nothing to connect with.
    Unconfigured,
}

impl Flags {
    /// The state directory named by a flag, its variable or the config file.
    pub fn chosen_state_dir(&self) -> Result<Option<PathBuf>, ConfigError> {
        let file = match &self.config {
            Some(path) => load_file(path)?,
            None => FileConfig::default(),
        };
        Ok(self.state_dir.clone().or(file.state_dir))
    }

    /// Where this device stands: enrolled, configured by hand, holding a bootstrap token
    /// (`PROPLET_BOOTSTRAP_TOKEN`, or a `[bootstrap]` table in the config file), or none.
    pub fn readiness(&self, env: &HashMap<String, String>) -> Result<Readiness, ConfigError> {
        let file = match &self.config {
            Some(path) => load_file(path)?,
            None => FileConfig::default(),
        };
        if let Some(dir) = self.state_dir.clone().or(file.state_dir.clone()) {
            if crate::credentials::load(&dir)
                .map_err(|e| invalid("credentials", &e.to_string()))?
                .is_some()
            {
                return Ok(Readiness::Enrolled(
                    dir.join(crate::credentials::CREDENTIALS_FILE),
                ));
            }
        }
        let given = |v: &Option<String>| v.as_deref().is_some_and(|v| !v.is_empty());
        let id = given(&self.client_id)
            || given(&file.client_id)
            || given(&env.get("PROPLET_ENTITY_ID").cloned());
        let key = given(&self.client_key)
            || given(&file.client_key)
            || given(&env.get("PROPLET_API_KEY").cloned());
        if id && key {
            return Ok(Readiness::Configured);
        }
        let bootstrap = file.bootstrap.unwrap_or_default();
        let token = env
            .get("PROPLET_BOOTSTRAP_TOKEN")
            .cloned()
            .filter(|t| !t.is_empty())
            .or(bootstrap.token);
        let server = env
            .get("PROPLET_BOOTSTRAP_SERVER")
            .cloned()
            .filter(|t| !t.is_empty())
            .or(bootstrap.server);
        Ok(match (token, server) {
            (Some(token), Some(server)) => Readiness::Bootstrap { server, token },
            _ => Readiness::Unconfigured,
        })
    }
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
            None => FileConfig::default(),
        };
        let text = |flag: Option<String>, file: Option<String>| {
            flag.filter(|v| !v.is_empty())
                .or(file.filter(|v| !v.is_empty()))
        };
        // An enrolled device's own credentials (`proplet join`) come before the file's.
        let enrolled = match flags.state_dir.clone().or(file.state_dir.clone()) {
            Some(dir) => crate::credentials::load(&dir)
                .map_err(|e| invalid("credentials", &e.to_string()))?,
            None => None,
        };
        let mut file = file;
        if let Some(enrolled) = &enrolled {
            file.domain_id = Some(enrolled.domain_id.clone());
            file.channel_id = Some(enrolled.channel_id.clone());
            file.client_id = Some(enrolled.client_id.clone());
            file.client_key = Some(enrolled.client_key.clone());
            file.namespace = Some(enrolled.namespace.clone());
            file.tls_ca_cert = enrolled.tls_ca_cert.clone().or(file.tls_ca_cert);
        }
        let enrolled_brokers = match (&enrolled, flags.mqtt_address.as_deref()) {
            (Some(e), None | Some("")) => Some(BrokerAddresses::parse_list(
                &e.mqtt_address,
                crate::credentials::CREDENTIALS_FILE,
            )?),
            _ => None,
        };

        let given_address = flags.mqtt_address.as_deref().filter(|v| !v.is_empty());
        let brokers = match (given_address, enrolled_brokers) {
            (Some(list), _) => BrokerAddresses::parse_list(list, "PROPLET_MQTT_ADDRESS")?,
            (None, Some(enrolled)) => enrolled,
            (None, None) => match flags.config.as_deref().and_then(|path| file.brokers(path)) {
                Some(parsed) => parsed?,
                None => BrokerAddresses::single(BrokerAddress {
                    host: "localhost".into(),
                    port: 1883,
                    tls: false,
                }),
            },
        };
        let tls = match brokers.first_tls() {
            None => None,
            Some(address) => {
                let ca_cert = flags.tls_ca_cert.or(file.tls_ca_cert).ok_or(ConfigError::Invalid {
                    name: "PROPLET_MQTT_TLS_CA_CERT".into(),
                    message: format!("{address} uses TLS; give the CA bundle that signed the broker's certificate"),
                })?;
                let cert = flags.tls_client_cert.or(file.tls_client_cert);
                let key = flags.tls_client_key.or(file.tls_client_key);
                let client = match (cert, key) {
                    (Some(c), Some(k)) => Some((c, k)),
                    (None, None) => None,
                    _ => {
                        return Err(invalid(
                            "PROPLET_MQTT_TLS_CLIENT_CERT",
                            "client certificate and client key must be given together",
                        ))
                    }
                };
                Some(TlsFiles { ca_cert, client })
            }
        };

        let required = |value: Option<String>,
                        name: &'static str,
                        flag: &'static str,
                        key: &'static str|
         -> Result<String, ConfigError> {
            value.ok_or(ConfigError::Missing { name, flag, key })
        };
        let domain_id = required(
            text(flags.domain_id, file.domain_id),
            "PROPLET_DOMAIN_ID",
            "--domain-id",
            "domain_id",
        )?;
        let channel_id = required(
            text(flags.channel_id, file.channel_id),
            "PROPLET_CHANNEL_ID",
            "--channel-id",
            "channel_id",
        )?;
        let client_id = required(
            text(flags.client_id, file.client_id),
            "PROPLET_CLIENT_ID",
            "--client-id",
            "client_id",
        )?;
        let client_key = required(
            text(flags.client_key, file.client_key),
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

        let interval = |flag: Option<Interval>, file: Option<Interval>, default: u64| {
            flag.or(file).map_or(Duration::from_secs(default), |i| i.0)
        };
        let liveliness_interval = interval(flags.liveliness_interval, file.liveliness_interval, 10);
        if liveliness_interval.is_zero() {
            return Err(invalid("PROPLET_LIVELINESS_INTERVAL", "must be positive"));
        }
        let metrics_interval = interval(flags.metrics_interval, file.metrics_interval, 10);
        let keep_alive = interval(flags.mqtt_keep_alive, file.mqtt_keep_alive, 30);
        if keep_alive < Duration::from_secs(1) {
            return Err(invalid("PROPLET_MQTT_KEEP_ALIVE", "must be at least 1s"));
        }
        let size = |flag: Option<Size>, file: Option<Size>, default: u64| {
            flag.or(file).map_or(default, |s| s.0)
        };
        let max_concurrent_tasks = size(flags.max_concurrent_tasks, file.max_concurrent_tasks, 4);
        if max_concurrent_tasks == 0 {
            return Err(invalid("PROPLET_MAX_CONCURRENT_TASKS", "must be positive"));
        }
        let max_module_size = size(
            flags.max_module_size,
            file.max_module_size,
            DEFAULT_MAX_MODULE_SIZE as u64,
        );
        if max_module_size < 8 {
            return Err(invalid(
                "PROPLET_MAX_MODULE_SIZE",
                "must be at least 8 bytes (a Wasm header)",
            ));
        }
        let telemetry_enabled = flags
            .metrics_enabled
            .or(file.metrics_enabled)
            .is_some_and(|s| s.0);
        let telemetry_port = flags.metrics_port.or(file.metrics_port).unwrap_or(9092);
        let mut http_serving = crate::http_server::HttpServing::default();
        if let Some(Switch(enabled)) = flags.http_enabled.or(file.http_enabled) {
            http_serving.enabled = enabled;
        }
        if let Some(bind) = flags.http_bind.or(file.http_bind) {
            http_serving.bind = bind;
        }
        if let Some(PortRange(ports)) = flags.http_ports.or(file.http_ports) {
            http_serving.ports = ports;
        }
        let http_ca_roots = match flags.http_ca_file.or(file.http_ca_file) {
            None => Vec::new(),
            Some(path) => crate::outgoing_http::load_roots(&path)
                .map_err(|e| invalid("PROPLET_HTTP_CA_FILE", &e.to_string()))?,
        };
        let state_dir = flags
            .state_dir
            .or(file.state_dir)
            .unwrap_or_else(|| std::env::temp_dir().join(format!("proplet-{client_id}")));
        Ok(Self {
            brokers,
            tls,
            domain_id,
            channel_id,
            client_id,
            client_key,
            qos: flags.mqtt_qos.or(file.mqtt_qos).map_or(1, |q| q.0),
            liveliness_interval,
            metrics_interval: (!metrics_interval.is_zero()).then_some(metrics_interval),
            keep_alive,
            log_level: flags
                .log_level
                .or(file.log_level)
                .map_or_else(|| "info".into(), |l| l.0),
            plugin_dir: flags.plugin_dir.or(file.plugin_dir),
            tags: flags.tags.or(file.tags).unwrap_or_default().0,
            location: text(flags.location, file.location),
            description: text(flags.description, file.description),
            namespace: text(flags.namespace, file.namespace).unwrap_or_else(|| "default".into()),
            state_dir,
            max_concurrent_tasks: usize::try_from(max_concurrent_tasks).unwrap_or(usize::MAX),
            task_memory_limit: usize::try_from(size(
                flags.task_memory_limit,
                file.task_memory_limit,
                256 * 1024 * 1024,
            ))
            .unwrap_or(usize::MAX),
            task_timeout: interval(flags.task_timeout, file.task_timeout, 300),
            task_fuel: flags.task_fuel.or(file.task_fuel).map(|s| s.0),
            spool_max_results: usize::try_from(size(
                flags.spool_max_results,
                file.spool_max_results,
                10_000,
            ))
            .unwrap_or(usize::MAX),
            chunk_timeout: interval(flags.chunk_timeout, file.chunk_timeout, 60),
            max_module_size: usize::try_from(max_module_size).unwrap_or(usize::MAX),
            telemetry: telemetry_enabled
                .then(|| std::net::SocketAddr::from(([0, 0, 0, 0], telemetry_port))),
            preopen_dirs: flags.dirs.or(file.dirs).unwrap_or_default().0,
            http_serving,
            http_allow_hosts: flags
                .http_allow_hosts
                .or(file.http_allow_hosts)
                .unwrap_or_default()
                .0,
            http_resolve: flags
                .http_resolve
                .or(file.http_resolve)
                .unwrap_or_default()
                .0,
            http_ca_roots,
        })
    }
}

impl Flags {
    /// The command line over the environment (as clap reads them). A value that does not
    /// parse is reported with where it came from: the flag, or its environment variable.
    pub fn from_command_line() -> Result<Self, ConfigError> {
        Self::try_from_args(std::env::args_os())
    }

    /// [`Flags::from_command_line`] with these arguments (the environment is the process's).
    pub fn try_from_args<I, T>(args: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        match Self::try_parse_from(&args) {
            Ok(flags) => Ok(flags),
            Err(e)
                if matches!(
                    e.kind(),
                    clap::error::ErrorKind::ValueValidation | clap::error::ErrorKind::InvalidValue
                ) =>
            {
                Err(value_error(&e, &args))
            }
            Err(e) => e.exit(),
        }
    }
}

/// A clap value error as a [`ConfigError`] naming the flag given on the command line, or the
/// environment variable the value came from.
fn value_error(e: &clap::Error, args: &[std::ffi::OsString]) -> ConfigError {
    use clap::error::{ContextKind, ContextValue};
    use clap::CommandFactory;
    let context = |kind| match e.get(kind) {
        Some(ContextValue::String(s)) => s.clone(),
        _ => String::new(),
    };
    let shown = context(ContextKind::InvalidArg);
    let long = shown
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    let on_command_line = args
        .iter()
        .filter_map(|a| a.to_str())
        .any(|a| a == long || a.starts_with(&format!("{long}=")));
    let command = Flags::command();
    let env = command
        .get_arguments()
        .find(|a| a.get_long().is_some_and(|l| format!("--{l}") == long))
        .and_then(|a| a.get_env())
        .map(|v| v.to_string_lossy().into_owned());
    let name = match (on_command_line, env) {
        (false, Some(variable)) => variable,
        _ => long,
    };
    // The parser's reason names the value; clap's kind is the fallback.
    let reason = std::error::Error::source(e).map_or_else(
        || format!("{:?}: {}", context(ContextKind::InvalidValue), e.kind()),
        |s| s.to_string(),
    );
    invalid(&name, &reason)
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

    fn flag_error(args: &[&str]) -> String {
        let mut all = vec!["proplet"];
        all.extend(args);
        Flags::try_from_args(all)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    }

    #[test]
    fn values_are_typed_when_read_and_a_bad_one_names_its_flag() {
        let e = flag_error(&["--liveliness-interval", "soon"]);
        assert!(
            e.starts_with("--liveliness-interval: \"soon\" is not"),
            "{e}"
        );
        let e = flag_error(&["--mqtt-qos=3"]);
        assert_eq!(e, "--mqtt-qos: \"3\" is not 0, 1 or 2");
        let e = flag_error(&["--task-memory-limit", "lots"]);
        assert!(e.contains("suffixes Ki, Mi, Gi"), "{e}");
        let e = flag_error(&["--http-ports", "9-1"]);
        assert!(e.contains("is not FIRST-LAST"), "{e}");
        let parsed = Flags::try_from_args(["proplet", "--task-timeout", "2m", "--tags", "a, b"]);
        let parsed = parsed.unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            parsed.task_timeout,
            Some(Interval(Duration::from_secs(120)))
        );
        assert_eq!(parsed.tags, Some(Words(vec!["a".into(), "b".into()])));
    }

    #[test]
    fn a_bad_value_in_the_file_names_the_file_and_its_line() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("proplet.toml");
        let text = "[proplet]\ndomain_id = \"d\"\n\nmax_concurrent_tasks = \"many\"\n";
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        let mut f = base();
        f.config = Some(path.clone());
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(
            e,
            format!(
                "config file {}:4: \"many\" is not a whole number (suffixes Ki, Mi, Gi allowed)",
                path.display()
            )
        );
    }

    #[test]
    fn bad_values_name_the_variable() {
        let mut f = base();
        f.liveliness_interval = Some(Interval(Duration::ZERO));
        let e = resolve(f).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("PROPLET_LIVELINESS_INTERVAL"), "{e}");

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
        let e = flag_error(&[
            "--http-resolve",
            "httpbin.org:443:127.0.0.1:40123,httpbin.org:80",
        ]);
        assert!(
            e.starts_with("--http-resolve: \"httpbin.org:80\": missing address"),
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
        f.http_resolve = "httpbin.org:443:127.0.0.1:40123".parse().ok();
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
