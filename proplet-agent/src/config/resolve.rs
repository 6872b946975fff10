//! The resolved configuration: the layers of [`Settings`] stacked (flags, environment,
//! enrolled credentials, file), then checked and completed with the defaults.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use propeller_broker::protocol::BrokerAddress;

use crate::config::addresses::{AddressSetting, BrokerAddresses};
use crate::config::settings::Settings;
use crate::config::values::{
    invalid, AttesterChoice, Interval, LogLevel, PortRange, Qos, Size, Switch,
};
use crate::credentials::{Credentials, CREDENTIALS_FILE};
use crate::http_server::HttpServing;
use crate::outgoing_http::HostOverride;

use super::{ConfigError, Flags};

/// Default of `PROPLET_MAX_MODULE_SIZE`. Real task modules are a few MiB (an interpreter
/// such as CPython is about 30 MiB); compiling a module takes several times its size in
/// memory, which a 64 MiB module already costs a Raspberry Pi dearly.
pub const DEFAULT_MAX_MODULE_SIZE: usize = 64 * 1024 * 1024;

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
    /// QoS of subscriptions and results (results at least [`Qos::AtLeastOnce`]).
    pub qos: Qos,
    /// Heartbeat period.
    pub liveliness_interval: Duration,
    /// Proplet metrics period; `None` when disabled.
    pub metrics_interval: Option<Duration>,
    /// MQTT keep-alive.
    pub keep_alive: Duration,
    /// Log filter.
    pub log_level: LogLevel,
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
    /// How much of each task run's output is logged (`None`: none).
    pub task_log: Option<crate::task_log::LogLimits>,
    /// Log spool bound, in batches.
    pub log_spool_max_batches: usize,
    /// Chunk wait.
    pub chunk_timeout: Duration,
    /// Largest task binary accepted: a larger one fails its task before it is compiled, and
    /// before it is downloaded whole when its size is announced.
    pub max_module_size: usize,
    /// Where the health and metrics endpoint listens, when enabled.
    pub telemetry: Option<SocketAddr>,
    /// Directories tasks may be granted.
    pub preopen_dirs: Vec<PathBuf>,
    /// Where HTTP components may listen.
    pub http_serving: HttpServing,
    /// Hosts guests may reach over `wasi:http` (empty: any).
    pub http_allow_hosts: Vec<String>,
    /// Host overrides for guests' `wasi:http`.
    pub http_resolve: Vec<HostOverride>,
    /// Extra roots for guests' HTTPS, read from `PROPLET_HTTP_CA_FILE`.
    pub http_ca_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// The Key Broker Service for encrypted tasks, when one is set.
    pub kbs: Option<KbsSettings>,
}

/// Where and how the agent gets the keys of encrypted tasks.
#[derive(Debug, Clone, PartialEq)]
pub struct KbsSettings {
    /// The service's base URL, without a trailing `/`.
    pub url: String,
    /// Extra roots for its TLS, from `PROPLET_KBS_CA_FILE`.
    pub ca_roots: Vec<rustls::pki_types::CertificateDer<'static>>,
    /// The evidence source.
    pub attester: AttesterChoice,
}

/// The KBS settings: a URL that is https, or http when allowed in so many words.
fn kbs_settings(s: &Settings) -> Result<Option<KbsSettings>, ConfigError> {
    let Some(url) = s.kbs_uri.as_deref().map(str::trim) else {
        return Ok(None);
    };
    let insecure = s.kbs_insecure_http.is_some_and(|Switch(on)| on);
    let rest = if let Some(rest) = url.strip_prefix("https://") {
        rest
    } else if let Some(rest) = url.strip_prefix("http://") {
        if !insecure {
            return Err(invalid(
                "PROPLET_KBS_URI",
                "is plain http: use https:// (with PROPLET_KBS_CA_FILE for a private CA), or set PROPLET_KBS_INSECURE_HTTP=true on a network you trust",
            ));
        }
        rest
    } else {
        return Err(invalid(
            "PROPLET_KBS_URI",
            "must start with https:// (or http:// with PROPLET_KBS_INSECURE_HTTP=true)",
        ));
    };
    if rest.trim_end_matches('/').is_empty() {
        return Err(invalid("PROPLET_KBS_URI", "names no host"));
    }
    let ca_roots = match &s.kbs_ca_file {
        None => Vec::new(),
        Some(path) => crate::outgoing_http::load_roots(path)
            .map_err(|e| invalid("PROPLET_KBS_CA_FILE", &e.to_string()))?,
    };
    Ok(Some(KbsSettings {
        url: url.trim_end_matches('/').to_owned(),
        ca_roots,
        attester: s.attester.unwrap_or(AttesterChoice::None),
    }))
}

impl Config {
    /// Resolves the settings: `flags` (the command line), then `env` (canonical names, then
    /// upstream's aliases), then an enrolled device's credentials, then the file
    /// `flags.config`, then the defaults. Text given empty counts as unset, except that an
    /// empty flag still hides its variable, and an empty variable its alias.
    pub fn resolve(flags: Flags, env: &HashMap<String, String>) -> Result<Self, ConfigError> {
        let from_env = Settings::from_env(env)?;
        let file = flags.file()?;
        let given = flags.settings.or(from_env);
        // An enrolled device's own credentials (`proplet join`) come before the file's.
        let enrolled = match given.state_dir.as_ref().or(file.state_dir.as_ref()) {
            Some(dir) => crate::credentials::load(dir)
                .map_err(|e| invalid("credentials", &e.to_string()))?
                .map(enrolled)
                .unwrap_or_default(),
            None => Settings::default(),
        };
        let file_origin = flags
            .config
            .as_ref()
            .map(|path| format!("`mqtt_address` in config file {}", path.display()));
        let brokers = [
            (&given, Some("PROPLET_MQTT_ADDRESS".to_owned())),
            (&enrolled, Some(CREDENTIALS_FILE.to_owned())),
            (&file, file_origin),
        ]
        .into_iter()
        .find_map(|(layer, origin)| {
            let address = layer.mqtt_address.as_ref().filter(|a| a.is_given())?;
            Some(address.brokers(&origin?))
        })
        .transpose()?;
        let settings = given
            .given_only()
            .or(enrolled.given_only())
            .or(file.given_only());
        Self::complete(settings, brokers)
    }

    /// Checks the stacked settings and fills in the defaults. `brokers` were read from
    /// `settings.mqtt_address` with the name of their source.
    fn complete(s: Settings, brokers: Option<BrokerAddresses>) -> Result<Self, ConfigError> {
        let task_log = task_log_limits(&s);
        let brokers = brokers.unwrap_or_else(|| {
            BrokerAddresses::single(BrokerAddress {
                host: "localhost".into(),
                port: 1883,
                tls: false,
            })
        });
        let kbs = kbs_settings(&s)?;
        let tls = tls_files(&brokers, s.tls_ca_cert, s.tls_client_cert, s.tls_client_key)?;

        let required =
            |value: Option<String>, name: &'static str, flag: &'static str, key: &'static str| {
                value.ok_or(ConfigError::Missing { name, flag, key })
            };
        let domain_id = required(s.domain_id, "PROPLET_DOMAIN_ID", "--domain-id", "domain_id")?;
        let channel_id = required(
            s.channel_id,
            "PROPLET_CHANNEL_ID",
            "--channel-id",
            "channel_id",
        )?;
        let client_id = required(s.client_id, "PROPLET_CLIENT_ID", "--client-id", "client_id")?;
        let client_key = required(
            s.client_key,
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

        let interval = |value: Option<Interval>, default: u64| {
            value.map_or(Duration::from_secs(default), |Interval(d)| d)
        };
        let size = |value: Option<Size>, default: usize| {
            value.map_or(default, |Size(n)| usize::try_from(n).unwrap_or(usize::MAX))
        };
        let liveliness_interval = interval(s.liveliness_interval, 10);
        if liveliness_interval.is_zero() {
            return Err(invalid("PROPLET_LIVELINESS_INTERVAL", "must be positive"));
        }
        let metrics_interval = interval(s.metrics_interval, 10);
        let keep_alive = interval(s.mqtt_keep_alive, 30);
        if keep_alive < Duration::from_secs(1) {
            return Err(invalid("PROPLET_MQTT_KEEP_ALIVE", "must be at least 1s"));
        }
        let max_concurrent_tasks = size(s.max_concurrent_tasks, 4);
        if max_concurrent_tasks == 0 {
            return Err(invalid("PROPLET_MAX_CONCURRENT_TASKS", "must be positive"));
        }
        let max_module_size = size(s.max_module_size, DEFAULT_MAX_MODULE_SIZE);
        if max_module_size < 8 {
            return Err(invalid(
                "PROPLET_MAX_MODULE_SIZE",
                "must be at least 8 bytes (a Wasm header)",
            ));
        }
        let mut http_serving = HttpServing::default();
        if let Some(Switch(enabled)) = s.http_enabled {
            http_serving.enabled = enabled;
        }
        if let Some(bind) = s.http_bind {
            http_serving.bind = bind;
        }
        if let Some(PortRange(ports)) = s.http_ports {
            http_serving.ports = ports;
        }
        let http_ca_roots = match s.http_ca_file {
            None => Vec::new(),
            Some(path) => crate::outgoing_http::load_roots(&path)
                .map_err(|e| invalid("PROPLET_HTTP_CA_FILE", &e.to_string()))?,
        };
        let telemetry_port = s.metrics_port.unwrap_or(9092);
        let state_dir = s
            .state_dir
            .unwrap_or_else(|| std::env::temp_dir().join(format!("proplet-{client_id}")));
        Ok(Self {
            brokers,
            tls,
            domain_id,
            channel_id,
            client_id,
            client_key,
            qos: s.mqtt_qos.unwrap_or(Qos::AtLeastOnce),
            liveliness_interval,
            metrics_interval: (!metrics_interval.is_zero()).then_some(metrics_interval),
            keep_alive,
            log_level: s.log_level.unwrap_or(LogLevel::Info),
            plugin_dir: s.plugin_dir,
            tags: s.tags.unwrap_or_default().0,
            location: s.location,
            description: s.description,
            namespace: s.namespace.unwrap_or_else(|| "default".into()),
            state_dir,
            max_concurrent_tasks,
            task_memory_limit: size(s.task_memory_limit, 256 * 1024 * 1024),
            task_timeout: interval(s.task_timeout, 300),
            task_fuel: s.task_fuel.map(|Size(n)| n),
            spool_max_results: size(s.spool_max_results, 10_000),
            task_log,
            log_spool_max_batches: size(s.log_spool_max_batches, 2048),
            chunk_timeout: interval(s.chunk_timeout, 60),
            max_module_size,
            telemetry: s
                .metrics_enabled
                .is_some_and(|Switch(on)| on)
                .then(|| SocketAddr::from(([0, 0, 0, 0], telemetry_port))),
            preopen_dirs: s.dirs.unwrap_or_default().0,
            http_serving,
            http_allow_hosts: s.http_allow_hosts.unwrap_or_default().0,
            http_resolve: s.http_resolve.unwrap_or_default().0,
            http_ca_roots,
            kbs,
        })
    }
}

/// What an enrolled device's credentials set: the broker, the ids, the key, the namespace
/// and the CA bundle they came with.
fn enrolled(credentials: Credentials) -> Settings {
    Settings {
        mqtt_address: Some(AddressSetting::Text(credentials.mqtt_address)),
        domain_id: Some(credentials.domain_id),
        channel_id: Some(credentials.channel_id),
        client_id: Some(credentials.client_id),
        client_key: Some(credentials.client_key),
        namespace: Some(credentials.namespace),
        tls_ca_cert: credentials.tls_ca_cert,
        ..Settings::default()
    }
}

/// The TLS material, when a broker asks for TLS: the CA bundle, and a client certificate
/// and key given together or not at all.
fn tls_files(
    brokers: &BrokerAddresses,
    ca_cert: Option<PathBuf>,
    client_cert: Option<PathBuf>,
    client_key: Option<PathBuf>,
) -> Result<Option<TlsFiles>, ConfigError> {
    let Some(address) = brokers.first_tls() else {
        return Ok(None);
    };
    let ca_cert = ca_cert.ok_or_else(|| {
        invalid(
            "PROPLET_MQTT_TLS_CA_CERT",
            &format!("{address} uses TLS; give the CA bundle that signed the broker's certificate"),
        )
    })?;
    let client = match (client_cert, client_key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(invalid(
                "PROPLET_MQTT_TLS_CLIENT_CERT",
                "client certificate and client key must be given together",
            ))
        }
    };
    Ok(Some(TlsFiles { ca_cert, client }))
}

/// The task log's limits from `settings` (`None`: a rate of 0 turns logging off).
fn task_log_limits(settings: &Settings) -> Option<crate::task_log::LogLimits> {
    let defaults = crate::task_log::LogLimits::default();
    let rate = settings
        .log_lines_per_second
        .map_or(u64::from(defaults.lines_per_second), |Size(n)| n);
    (rate > 0).then(|| crate::task_log::LogLimits {
        lines_per_second: u32::try_from(rate).unwrap_or(u32::MAX),
        run_bytes: settings
            .log_run_bytes
            .map_or(defaults.run_bytes, |Size(n)| n),
        ..defaults
    })
}
