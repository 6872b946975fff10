//! `propeller broker`: the embedded broker alone, logging typed events (device bring-up).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use clap::Args;
use propeller_broker::server::{
    load_credentials_file, BrokerConfig, BrokerEvent, CredentialStore, EmbeddedBroker, EventKind,
    TlsSettings,
};
use tracing::{info, warn};

/// Listener and limit settings of the embedded broker.
#[derive(Args, Debug, Clone)]
pub struct BrokerArgs {
    /// Plain MQTT listener address.
    #[arg(long, env = "PROPELLER_MQTT_LISTEN", default_value = "0.0.0.0:1883")]
    pub mqtt_listen: SocketAddr,
    /// Disable the plain listener (TLS only).
    #[arg(long)]
    pub no_plain: bool,
    /// MQTT over TLS listener address (needs --tls-cert and --tls-key).
    #[arg(long, env = "PROPELLER_MQTT_TLS_LISTEN", requires_all = ["tls_cert", "tls_key"])]
    pub tls_listen: Option<SocketAddr>,
    /// MQTT over websocket listener address (e.g. 0.0.0.0:8080).
    #[arg(long, env = "PROPELLER_MQTT_WS_LISTEN")]
    pub ws_listen: Option<SocketAddr>,
    /// Server certificate chain, PEM.
    #[arg(long, env = "PROPELLER_MQTT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// Server private key, PEM.
    #[arg(long, env = "PROPELLER_MQTT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates signed by this CA bundle, PEM.
    #[arg(long, env = "PROPELLER_MQTT_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Largest accepted PUBLISH payload, bytes.
    #[arg(long, default_value_t = propeller_broker::server::DEFAULT_MAX_PAYLOAD_BYTES)]
    pub max_payload_bytes: usize,
    /// Open sockets beyond this are closed at once.
    #[arg(long, default_value_t = 10_000)]
    pub max_connections: usize,
    /// Seconds a new socket may take for its TLS handshake and its CONNECT (max 65).
    #[arg(long, default_value_t = 5)]
    pub connect_timeout_secs: u64,
}

impl BrokerArgs {
    /// The broker configuration these flags describe.
    pub fn to_config(&self) -> anyhow::Result<BrokerConfig> {
        let tls = match (&self.tls_listen, &self.tls_cert, &self.tls_key) {
            (Some(listen), Some(cert), Some(key)) => Some(TlsSettings {
                listen: *listen,
                cert_path: cert.clone(),
                key_path: key.clone(),
                client_ca_path: self.tls_client_ca.clone(),
            }),
            (None, _, _) => None,
            _ => anyhow::bail!("--tls-listen needs both --tls-cert and --tls-key"),
        };
        Ok(BrokerConfig {
            tcp_listen: (!self.no_plain).then_some(self.mqtt_listen),
            tls,
            websocket_listen: self.ws_listen,
            max_payload_bytes: self.max_payload_bytes,
            max_connections: self.max_connections,
            connect_timeout: Duration::from_secs(self.connect_timeout_secs),
            ..BrokerConfig::default()
        })
    }
}

/// Arguments of `propeller broker`.
#[derive(Args, Debug)]
pub struct BrokerCommand {
    /// TOML file of `[[client]]` tables (`id`, `key`, optional `role`); re-read when it changes.
    #[arg(long, env = "PROPELLER_CREDENTIALS")]
    pub credentials: PathBuf,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

/// Runs the broker until Ctrl-C, logging every event.
pub async fn run(cmd: BrokerCommand) -> anyhow::Result<()> {
    let store = CredentialStore::new();
    let table = load_credentials_file(&cmd.credentials)?;
    info!(clients = table.len(), file = %cmd.credentials.display(), "credentials loaded");
    store.replace_all(table);
    let config = cmd.broker.to_config()?;
    let mut broker = EmbeddedBroker::start(config, Arc::new(store.clone()))
        .await
        .context("starting the MQTT broker")?;
    if let Some(addr) = broker.tcp_addr() {
        println!("mqtt listening on {addr}");
    }
    if let Some(addr) = broker.tls_addr() {
        println!("mqtts listening on {addr}");
    }
    if let Some(addr) = broker.websocket_addr() {
        println!("mqtt over websocket listening on {addr}");
    }
    let mut events = broker
        .take_events()
        .context("broker event stream unavailable")?;
    let reload = tokio::spawn(watch_credentials(cmd.credentials.clone(), store));
    loop {
        tokio::select! {
            event = events.recv() => match event {
                Some(event) => log_event(&event),
                None => break,
            },
            _ = super::signals::terminated() => {
                info!("interrupted, stopping");
                break;
            }
        }
    }
    reload.abort();
    broker.shutdown();
    Ok(())
}

fn log_event(event: &BrokerEvent) {
    let domain = event.domain.as_deref().unwrap_or("-");
    let channel = event.channel.as_deref().unwrap_or("-");
    match &event.kind {
        EventKind::Result(result) => info!(
            client_id = event.client_id,
            domain,
            channel,
            task_id = result.task_id,
            error = result.error.as_deref().unwrap_or(""),
            "result"
        ),
        other => info!(
            client_id = event.client_id,
            domain,
            channel,
            event = other.label(),
            detail = ?other,
        ),
    }
}

/// Re-reads the credentials file when its modification time changes. A file that fails to
/// parse is reported and the previous table stays in force.
pub(crate) async fn watch_credentials(path: PathBuf, store: CredentialStore) {
    let mut seen = modified(&path);
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        let now = modified(&path);
        if now == seen {
            continue;
        }
        seen = now;
        match load_credentials_file(&path) {
            Ok(table) => {
                info!(clients = table.len(), "credentials reloaded");
                store.replace_all(table);
            }
            Err(error) => warn!(%error, "credentials not reloaded; previous ones stay in force"),
        }
    }
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}
