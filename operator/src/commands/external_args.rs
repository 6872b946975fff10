//! Flags of the external broker mode (`--mqtt-broker`), shared by `run` and `standalone`.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use propeller_broker::external::{report_filters, ClientTls, DeviceTrust, ExternalConfig};
use propeller_broker::protocol::BrokerAddress;

/// How the external broker authenticates devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceAuth {
    /// The broker calls propeller back for each login and topic (RabbitMQ, EMQX): needs
    /// `--auth-callback-listen`.
    Callback,
    /// The broker runs a configuration rendered by `propeller broker-config` (NATS).
    Rendered,
    /// The broker lets anyone in; propeller takes reports as they claim (development only).
    None,
}

/// Connection to an existing MQTT cluster instead of the embedded broker.
#[derive(Args, Debug, Clone)]
pub struct ExternalBrokerArgs {
    /// Use this MQTT cluster instead of the embedded broker: one or more comma-separated
    /// `mqtt://host:port` or `mqtts://host:port` addresses of its nodes (or its load
    /// balancer). The embedded listeners are then off.
    #[arg(long, env = "PROPELLER_MQTT_BROKER", value_delimiter = ',', value_parser = parse_address)]
    pub mqtt_broker: Vec<BrokerAddress>,
    /// Propeller's client id on the cluster; keep it stable so a restart or the next leader
    /// resumes the same persistent session.
    #[arg(long, env = "PROPELLER_MQTT_CLIENT_ID", default_value = "propeller")]
    pub mqtt_client_id: String,
    /// Propeller's username on the cluster (the client id when unset; with `--shard`, the
    /// client id before the replica's name is added).
    #[arg(long, env = "PROPELLER_MQTT_USERNAME")]
    pub mqtt_username: Option<String>,
    /// File holding propeller's password on the cluster (e.g. a mounted Secret).
    #[arg(long, env = "PROPELLER_MQTT_PASSWORD_FILE")]
    pub mqtt_password_file: Option<PathBuf>,
    /// CA bundle (PEM) for `mqtts://` addresses; the system's when unset.
    #[arg(long, env = "PROPELLER_MQTT_CA")]
    pub mqtt_ca: Option<PathBuf>,
    /// Client certificate (PEM) for `mqtts://` addresses.
    #[arg(long, env = "PROPELLER_MQTT_CLIENT_CERT", requires = "mqtt_client_key")]
    pub mqtt_client_cert: Option<PathBuf>,
    /// The client certificate's key (PEM).
    #[arg(long, env = "PROPELLER_MQTT_CLIENT_KEY", requires = "mqtt_client_cert")]
    pub mqtt_client_key: Option<PathBuf>,
    /// How the cluster authenticates devices (callback when --auth-callback-listen is set,
    /// otherwise this must be given).
    #[arg(long, env = "PROPELLER_DEVICE_AUTH", value_enum)]
    pub device_auth: Option<DeviceAuth>,
    /// Address of the broker's authentication callbacks (`/rabbitmq/...`, `/emqx/...`).
    /// Reachable by the broker only, never by devices.
    #[arg(long, env = "PROPELLER_AUTH_CALLBACK_LISTEN")]
    pub auth_callback_listen: Option<SocketAddr>,
    /// File holding the callbacks' shared secret (the path segment after `/rabbitmq/`).
    #[arg(long, env = "PROPELLER_AUTH_CALLBACK_SECRET_FILE")]
    pub auth_callback_secret_file: Option<PathBuf>,
    /// With `--device-auth rendered`: keep this file equal to the broker configuration of the
    /// live credential table (a NATS `authorization` block to `include`).
    #[arg(long, env = "PROPELLER_BROKER_CONFIG_FILE")]
    pub broker_config_file: Option<PathBuf>,
    /// Shell command run after each rewrite of --broker-config-file, e.g.
    /// `nats-server --signal reload=<pid>`.
    #[arg(
        long,
        env = "PROPELLER_BROKER_CONFIG_RELOAD",
        requires = "broker_config_file"
    )]
    pub broker_config_reload: Option<String>,
}

fn parse_address(text: &str) -> Result<BrokerAddress, String> {
    BrokerAddress::parse(text).map_err(|e| e.to_string())
}

/// Everything the external mode needs, resolved from the flags.
pub struct ExternalPlan {
    /// The client session's settings.
    pub config: ExternalConfig,
    /// Propeller's own login, added to the service credentials the callbacks accept.
    pub own_login: Option<(String, String)>,
    /// The callback listener and its secret.
    pub callback: Option<(SocketAddr, String)>,
    /// How devices are authenticated.
    pub device_auth: DeviceAuth,
    /// The rendered configuration file and its reload command.
    pub rendered: Option<(PathBuf, Option<String>)>,
}

impl ExternalBrokerArgs {
    /// Whether the external mode is on.
    pub fn enabled(&self) -> bool {
        !self.mqtt_broker.is_empty()
    }

    /// Resolves the flags; `None` when the embedded broker is used.
    pub fn plan(
        &self,
        domain: Option<&str>,
        channel: Option<&str>,
    ) -> anyhow::Result<Option<ExternalPlan>> {
        if !self.enabled() {
            return Ok(None);
        }
        let device_auth = match (self.device_auth, self.auth_callback_listen) {
            (Some(auth), _) => auth,
            (None, Some(_)) => DeviceAuth::Callback,
            (None, None) => anyhow::bail!(
                "--mqtt-broker needs --device-auth (callback, rendered or none) or \
                 --auth-callback-listen: say how the cluster authenticates devices"
            ),
        };
        let callback = match (device_auth, self.auth_callback_listen) {
            (DeviceAuth::Callback, Some(listen)) => {
                let path = self.auth_callback_secret_file.as_ref().context(
                    "--auth-callback-listen needs --auth-callback-secret-file (the secret the \
                     broker puts in the callback URLs)",
                )?;
                let secret = read_secret(path)?;
                if secret.len() < 16 {
                    anyhow::bail!(
                        "the callback secret in {} is shorter than 16 characters",
                        path.display()
                    );
                }
                Some((listen, secret))
            }
            (DeviceAuth::Callback, None) => anyhow::bail!(
                "--device-auth callback needs --auth-callback-listen and \
                 --auth-callback-secret-file"
            ),
            (_, _) => None,
        };
        let username = self
            .mqtt_username
            .clone()
            .unwrap_or_else(|| self.mqtt_client_id.clone());
        let own_login = match &self.mqtt_password_file {
            Some(path) => Some((username, read_secret(path)?)),
            None => None,
        };
        let mut config = ExternalConfig::new(self.mqtt_broker.clone(), &self.mqtt_client_id);
        config.credentials = own_login.clone();
        config.tls = ClientTls {
            ca: self.mqtt_ca.clone(),
            cert: self.mqtt_client_cert.clone(),
            key: self.mqtt_client_key.clone(),
        };
        config.filters = report_filters(domain, channel);
        config.trust = match device_auth {
            DeviceAuth::None => DeviceTrust::Unauthenticated,
            DeviceAuth::Callback | DeviceAuth::Rendered => DeviceTrust::Authenticated,
        };
        let rendered = match (device_auth, &self.broker_config_file) {
            (DeviceAuth::Rendered, Some(path)) => {
                Some((path.clone(), self.broker_config_reload.clone()))
            }
            (_, Some(_)) => anyhow::bail!("--broker-config-file goes with --device-auth rendered"),
            (_, None) => None,
        };
        Ok(Some(ExternalPlan {
            config,
            own_login,
            callback,
            device_auth,
            rendered,
        }))
    }
}

fn read_secret(path: &PathBuf) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the secret in {}", path.display()))?;
    let secret = text.trim().to_owned();
    if secret.is_empty() {
        anyhow::bail!("{} is empty", path.display());
    }
    Ok(secret)
}
