//! The optional TOML file, read into typed settings (serde): either top-level keys or a
//! `[proplet]` section (upstream's layout). A bad value is reported with its file and line.

use std::net::IpAddr;

use serde::Deserialize;

use std::path::{Path, PathBuf};

use propeller_broker::protocol::AddressError;

use crate::config::addresses::BrokerAddresses;
use crate::config::values::{
    Dirs, Interval, LogLevel, Overrides, PortRange, Qos, Size, Switch, Words,
};

use super::ConfigError;

/// `mqtt_address` as a string (comma-separated) or a list (checked entry by entry).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum AddressSetting {
    Text(String),
    List(Vec<toml::Value>),
}

/// The settings a file may give; keys are the flags' names with `_` for `-`, and upstream's
/// `tenant_id`, `entity_id` and `api_key`.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub(super) struct FileConfig {
    pub(super) mqtt_address: Option<AddressSetting>,
    #[serde(alias = "tenant_id")]
    pub(super) domain_id: Option<String>,
    pub(super) channel_id: Option<String>,
    #[serde(alias = "entity_id")]
    pub(super) client_id: Option<String>,
    #[serde(alias = "api_key")]
    pub(super) client_key: Option<String>,
    pub(super) mqtt_qos: Option<Qos>,
    pub(super) liveliness_interval: Option<Interval>,
    pub(super) metrics_interval: Option<Interval>,
    pub(super) metrics_enabled: Option<Switch>,
    pub(super) metrics_port: Option<u16>,
    pub(super) mqtt_keep_alive: Option<Interval>,
    pub(super) log_level: Option<LogLevel>,
    pub(super) plugin_dir: Option<PathBuf>,
    pub(super) tls_ca_cert: Option<PathBuf>,
    pub(super) tls_client_cert: Option<PathBuf>,
    pub(super) tls_client_key: Option<PathBuf>,
    pub(super) tags: Option<Words>,
    pub(super) location: Option<String>,
    pub(super) description: Option<String>,
    pub(super) namespace: Option<String>,
    pub(super) dirs: Option<Dirs>,
    pub(super) state_dir: Option<PathBuf>,
    pub(super) max_concurrent_tasks: Option<Size>,
    pub(super) task_memory_limit: Option<Size>,
    pub(super) task_timeout: Option<Interval>,
    pub(super) task_fuel: Option<Size>,
    pub(super) spool_max_results: Option<Size>,
    pub(super) chunk_timeout: Option<Interval>,
    pub(super) max_module_size: Option<Size>,
    pub(super) http_enabled: Option<Switch>,
    pub(super) http_bind: Option<IpAddr>,
    pub(super) http_ports: Option<PortRange>,
    pub(super) http_allow_hosts: Option<Words>,
    pub(super) http_resolve: Option<Overrides>,
    pub(super) http_ca_file: Option<PathBuf>,
    /// First boot: a token to enrol with when the device has no credentials yet.
    pub(super) bootstrap: Option<BootstrapSection>,
}

/// The `[bootstrap]` table: `server` and `token` for `proplet join` on first boot.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BootstrapSection {
    pub(super) server: Option<String>,
    pub(super) token: Option<String>,
}

#[derive(Deserialize)]
struct Sectioned {
    proplet: FileConfig,
}

impl FileConfig {
    /// `mqtt_address`, `None` when unset (or an empty string).
    pub(super) fn brokers(&self, path: &Path) -> Option<Result<BrokerAddresses, ConfigError>> {
        const KEY: &str = "mqtt_address";
        let origin = format!("`{KEY}` in config file {}", path.display());
        match self.mqtt_address.as_ref()? {
            AddressSetting::Text(text) if text.is_empty() => None,
            AddressSetting::Text(text) => Some(BrokerAddresses::parse_list(text, &origin)),
            AddressSetting::List(items) => {
                let count = items.len();
                let mut entries = Vec::with_capacity(count);
                for (i, item) in items.iter().enumerate() {
                    match item.as_str() {
                        Some(text) => entries.push(text),
                        None => {
                            return Some(Err(ConfigError::Address {
                                origin,
                                entry: i + 1,
                                count,
                                value: item.to_string(),
                                problem: AddressError::NotText,
                            }))
                        }
                    }
                }
                Some(BrokerAddresses::parse(&entries, &origin))
            }
        }
    }
}

/// Reads and checks the file at `path`; an error names the file and the line at fault.
pub(super) fn load_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
        path: shown.clone(),
        message: e.to_string(),
    })?;
    let at_line = |e: toml::de::Error| {
        let line = e
            .span()
            .map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
        ConfigError::File {
            path: match line {
                Some(line) => format!("{shown}:{line}"),
                None => shown.clone(),
            },
            message: e.message().to_owned(),
        }
    };
    let table: toml::Table = toml::from_str(&text).map_err(at_line)?;
    match table.get("proplet") {
        Some(toml::Value::Table(_)) => toml::from_str::<Sectioned>(&text)
            .map(|s| s.proplet)
            .map_err(at_line),
        Some(_) => Err(ConfigError::File {
            path: shown,
            message: "`proplet` must be a table".into(),
        }),
        None => toml::from_str(&text).map_err(at_line),
    }
}
