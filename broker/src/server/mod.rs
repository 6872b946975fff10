//! The embedded MQTT broker: rumqttd's router on a thread of its own, its network side on the
//! caller's tokio runtime, our listeners in front, and our codec guard inside.
//!
//! Listeners: plain TCP, TLS and websocket, each with the connection cap and handshake
//! deadline of `listener.rs`.
//!
//! Start it with [`EmbeddedBroker::start`]; take the typed event stream with
//! [`EmbeddedBroker::take_events`] and publish commands through [`Publisher`].
//!
//! # What is enforced, and how
//! - **Authentication** (rumqttd's auth hook): username must equal the client id and the
//!   password must equal that client's key from a [`CredentialSource`], compared in constant
//!   time. Anonymous clients are refused. rumqttd closes a refused socket without a CONNACK.
//! - **Authorization** (our codec guard, see `guard.rs`; rumqttd has no ACL hook): devices may
//!   publish only agent reports naming themselves and may subscribe only to literal topics that
//!   are not agent reports. Refused publishes are acknowledged but rewritten to
//!   [`DROPPED_TOPIC`] with an empty payload; refused filters become [`DENIED_FILTER`].
//! - **Not enforceable with rumqttd 0.20:** a negative acknowledgement for refused publishes
//!   or subscriptions (MQTT 3.1.1 has none for publishes; rumqttd does not let a codec fail a
//!   single filter), and binding a device to one domain/channel (upstream agents share one
//!   channel, so every device of a channel sees every start message of that channel).
//! - Commands from the operator travel over rumqttd's in-process link, which is QoS 0 only.

mod auth;
mod events;
mod guard;
mod listener;
mod metrics;
mod policy;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rumqttd::local::{LinkBuilder, LinkRx, LinkTx};
use rumqttd::{ConnectionSettings, Router, RouterConfig, Server, ServerSettings};
use tokio::net::TcpListener;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tracing::info;

use crate::protocol::{
    Channel, Decoder, FlRoundStart, InvokeRequest, RegistryChunk, StartRequest, StopRequest,
};

pub use auth::{
    authenticate, known_credential, load_credentials_file, login, login_again, login_over,
    login_shared_service, parse_credentials, AuthFailure, ChannelScope, Credential,
    CredentialSource, CredentialStore, CredentialsFileError, LayeredCredentials, Role,
    TokenCredential, Transport, TOKEN_FAILURES_BEFORE_LOCK, TOKEN_LOCK,
};
pub use events::{BrokerEvent, EventKind, OfflineCause};
pub use listener::{tls_acceptor, TlsSettings};
pub use metrics::{BrokerMetrics, KindLabel};
pub use policy::{
    is_agent_report, judge_publish, may_access_topic, may_subscribe, may_subscribe_as, DropReason,
    PublishDecision, TopicAccess, Verdict, DENIED_FILTER, DROPPED_TOPIC,
};

use guard::{Guard, Shared};
use listener::{serve, Front, Intake};

/// Large enough for a 512 KiB raw registry chunk in base64 (~700 KB) inside its JSON.
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 1024 * 1024;

/// Client id of the operator's in-process link.
const OPERATOR_LINK_ID: &str = "propeller-operator-link";

/// Broker settings; [`BrokerConfig::default`] listens on `0.0.0.0:1883` only.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// Plain MQTT listener, `None` to disable.
    pub tcp_listen: Option<SocketAddr>,
    /// MQTT over TLS listener.
    pub tls: Option<TlsSettings>,
    /// MQTT over websocket listener (plain HTTP upgrade; put TLS in front if needed).
    pub websocket_listen: Option<SocketAddr>,
    /// Largest PUBLISH payload accepted.
    pub max_payload_bytes: usize,
    /// Open sockets beyond this are closed at once.
    pub max_connections: usize,
    /// How long a new socket may take for its TLS handshake, and then again for its CONNECT.
    pub connect_timeout: Duration,
    /// Unacknowledged QoS 1/2 messages per client.
    pub max_inflight: usize,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        Self {
            tcp_listen: Some(SocketAddr::from(([0, 0, 0, 0], 1883))),
            tls: None,
            websocket_listen: None,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            max_connections: 10_000,
            connect_timeout: Duration::from_secs(5),
            max_inflight: 100,
        }
    }
}

impl BrokerConfig {
    /// A plain listener on 127.0.0.1 with an ephemeral port: for tests and local demos.
    pub fn loopback() -> Self {
        Self {
            tcp_listen: Some(SocketAddr::from(([127, 0, 0, 1], 0))),
            ..Self::default()
        }
    }
}

/// The broker could not start or publish.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// A listener could not bind.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// TLS material is unusable.
    #[error("TLS listener: {message}")]
    Tls {
        /// What is wrong.
        message: String,
    },
    /// The settings contradict each other.
    #[error("invalid broker settings: {0}")]
    Config(String),
    /// The router refused the in-process link or a publish.
    #[error("broker router unavailable: {0}")]
    Router(String),
}

/// A running broker. Dropping it stops the listeners; the router thread ends once the last
/// connection and [`Publisher`] are gone.
pub struct EmbeddedBroker {
    tcp_addr: Option<SocketAddr>,
    tls_addr: Option<SocketAddr>,
    ws_addr: Option<SocketAddr>,
    events: Option<UnboundedReceiver<BrokerEvent>>,
    publisher: Publisher,
    metrics: BrokerMetrics,
    tasks: Vec<JoinHandle<()>>,
}

impl EmbeddedBroker {
    /// Starts the broker on the current tokio runtime. Returns once every listener is bound.
    pub async fn start(
        config: BrokerConfig,
        credentials: Arc<dyn CredentialSource>,
    ) -> Result<Self, BrokerError> {
        if config.tcp_listen.is_none() && config.tls.is_none() && config.websocket_listen.is_none()
        {
            return Err(BrokerError::Config(
                "no listener: enable the TCP, TLS or websocket listener".into(),
            ));
        }
        if config.max_connections == 0 {
            return Err(BrokerError::Config(
                "max_connections must be positive".into(),
            ));
        }
        let connect_timeout_ms = u16::try_from(config.connect_timeout.as_millis())
            .map_err(|_| BrokerError::Config("connect_timeout must be below 65 s".into()))?;
        let tls = config.tls.as_ref().map(tls_acceptor).transpose()?;

        let public_tcp = match config.tcp_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        let public_tls = match &config.tls {
            Some(settings) => Some(bind(settings.listen).await?),
            None => None,
        };
        let public_ws = match config.websocket_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };

        let metrics = BrokerMetrics::default();
        let (event_tx, event_rx) = unbounded_channel();
        let shared = Arc::new(Shared::new(
            credentials,
            event_tx,
            metrics.clone(),
            Decoder::new(config.max_payload_bytes),
        ));

        let router_config = RouterConfig {
            max_connections: config.max_connections + 16,
            max_outgoing_packet_count: 200,
            max_segment_size: (config.max_payload_bytes * 4).max(4 * 1024 * 1024),
            max_segment_count: 4,
            ..RouterConfig::default()
        };
        let router_tx = Router::new(0, router_config).spawn();

        let connections = ConnectionSettings {
            connection_timeout_ms: connect_timeout_ms,
            max_payload_size: config.max_payload_bytes,
            max_inflight_count: config.max_inflight,
            auth: None,
            external_auth: None,
            dynamic_filters: true,
        };
        // One rumqttd core per transport, so a login knows whether it came over TLS (a
        // bootstrap token is refused over plain TCP unless it allows it).
        let core_for = |transport: Transport| {
            let mut connections = connections.clone();
            let auth_shared = shared.clone();
            connections.set_auth_handler(move |client_id: String, user: String, pass: String| {
                let shared = auth_shared.clone();
                // The guard, which sees every CONNECT first, decided, counted and logged it.
                async move {
                    login_again(
                        shared.credentials.as_ref(),
                        &client_id,
                        &user,
                        &pass,
                        transport,
                    )
                    .is_ok()
                }
            });
            // Never started: our listeners accept and hand each stream to `serve_connection`.
            let settings = ServerSettings {
                name: "propeller".into(),
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                tls: None,
                next_connection_delay_ms: 0,
                connections,
            };
            Arc::new(Server::new(
                settings,
                router_tx.clone(),
                Guard::new(shared.clone(), transport),
            ))
        };
        let core = core_for(Transport::Plain);
        let encrypted_core = core_for(Transport::Encrypted);
        let mut tasks = Vec::new();

        // Building a local link waits on the router thread's reply: keep it off async threads.
        let (link_tx, link_rx, _connack) = tokio::task::spawn_blocking(move || {
            LinkBuilder::new(OPERATOR_LINK_ID, router_tx)
                .clean_session(true)
                .build()
                .map_err(|e| BrokerError::Router(e.to_string()))
        })
        .await
        .map_err(|e| BrokerError::Router(e.to_string()))??;
        let publisher = Publisher::new(link_tx, link_rx);

        let intake = Intake {
            core,
            encrypted_core,
            slots: Arc::new(Semaphore::new(config.max_connections)),
            handshake_timeout: config.connect_timeout,
            metrics: metrics.clone(),
        };
        let mut fronts = Vec::new();
        if let Some(listener) = public_tcp {
            fronts.push((listener, Front::Plain));
        }
        if let (Some(listener), Some(acceptor)) = (public_tls, tls) {
            fronts.push((listener, Front::Tls(acceptor)));
        }
        if let Some(listener) = public_ws {
            fronts.push((listener, Front::WebSocket));
        }
        let (mut tcp_addr, mut tls_addr, mut ws_addr) = (None, None, None);
        for (listener, front) in fronts {
            let addr = listener.local_addr().ok();
            match front {
                Front::Plain => tcp_addr = addr,
                Front::Tls(_) => tls_addr = addr,
                Front::WebSocket => ws_addr = addr,
            }
            tasks.push(tokio::spawn(serve(listener, intake.clone(), front)));
        }
        info!(tcp = ?tcp_addr, tls = ?tls_addr, websocket = ?ws_addr, "MQTT broker listening");
        Ok(Self {
            tcp_addr,
            tls_addr,
            ws_addr,
            events: Some(event_rx),
            publisher,
            metrics,
            tasks,
        })
    }

    /// The bound address of the plain listener.
    pub fn tcp_addr(&self) -> Option<SocketAddr> {
        self.tcp_addr
    }

    /// The bound address of the TLS listener.
    pub fn tls_addr(&self) -> Option<SocketAddr> {
        self.tls_addr
    }

    /// The bound address of the websocket listener.
    pub fn websocket_addr(&self) -> Option<SocketAddr> {
        self.ws_addr
    }

    /// The event stream; `None` after the first call (there is one consumer).
    pub fn take_events(&mut self) -> Option<UnboundedReceiver<BrokerEvent>> {
        self.events.take()
    }

    /// A handle for publishing commands to devices.
    pub fn publisher(&self) -> Publisher {
        self.publisher.clone()
    }

    /// The broker's meters (register them with [`BrokerMetrics::register`]).
    pub fn metrics(&self) -> &BrokerMetrics {
        &self.metrics
    }

    /// Stops accepting connections (established connections end with them).
    pub fn shutdown(&mut self) {
        for task in self.tasks.drain(..) {
            task.abort();
        }
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Pending-connection queue of public listeners: a fleet reconnecting after an outage arrives
/// at once, and the OS default of tokio's `bind` (1024) drops SYNs beyond it.
const LISTEN_BACKLOG: u32 = 4096;

async fn bind(addr: SocketAddr) -> Result<TcpListener, BrokerError> {
    let bind_error = |source| BrokerError::Bind { addr, source };
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }
    .map_err(bind_error)?;
    socket.set_reuseaddr(true).map_err(bind_error)?;
    socket.bind(addr).map_err(bind_error)?;
    socket.listen(LISTEN_BACKLOG).map_err(bind_error)
}

struct LinkHalves {
    tx: LinkTx,
    // Held so the router keeps the in-process link registered; it subscribes to nothing.
    _rx: LinkRx,
}

/// Where a [`Publisher`] sends: the embedded broker's in-process link, or the client session
/// on an external broker.
#[derive(Clone)]
enum Outlet {
    Embedded(Arc<Mutex<LinkHalves>>),
    External(rumqttc::AsyncClient),
}

/// Publishes commands to devices, through whichever broker is in front. Cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    outlet: Outlet,
}

impl Publisher {
    fn new(tx: LinkTx, rx: LinkRx) -> Self {
        Self {
            outlet: Outlet::Embedded(Arc::new(Mutex::new(LinkHalves { tx, _rx: rx }))),
        }
    }

    /// A publisher on an external broker's client session (QoS 1).
    pub(crate) fn external(client: rumqttc::AsyncClient) -> Self {
        Self {
            outlet: Outlet::External(client),
        }
    }

    /// Publishes `payload` on `topic` (not retained): QoS 0 on the embedded broker's
    /// in-process link, QoS 1 on an external broker.
    pub async fn publish(&self, topic: String, payload: Vec<u8>) -> Result<(), BrokerError> {
        match &self.outlet {
            Outlet::Embedded(link) => {
                let link = link.clone();
                // The router's queue is a bounded blocking channel: keep the wait off async
                // threads.
                tokio::task::spawn_blocking(move || {
                    let mut halves = link.lock().unwrap_or_else(|e| e.into_inner());
                    halves
                        .tx
                        .publish(topic, payload)
                        .map(|_| ())
                        .map_err(|e| BrokerError::Router(e.to_string()))
                })
                .await
                .map_err(|e| BrokerError::Router(e.to_string()))?
            }
            // Queued in the session; sent when connected, again after a reconnect if unacked.
            Outlet::External(client) => client
                .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload)
                .await
                .map_err(|e| BrokerError::Router(format!("external broker session ended: {e}"))),
        }
    }

    /// Sends a start request on `channel`.
    pub async fn start(
        &self,
        channel: &Channel,
        request: &StartRequest,
    ) -> Result<(), BrokerError> {
        self.publish(channel.start(), request.encode()).await
    }

    /// Sends an agent upgrade request on `channel`.
    pub async fn upgrade(
        &self,
        channel: &Channel,
        request: &crate::protocol::UpgradeRequest,
    ) -> Result<(), BrokerError> {
        self.publish(channel.upgrade(), request.encode()).await
    }

    /// Sends a stop request on `channel`.
    pub async fn stop(&self, channel: &Channel, request: &StopRequest) -> Result<(), BrokerError> {
        self.publish(channel.stop(), request.encode()).await
    }

    /// Sends an invoke request for a latent task on `channel`.
    pub async fn invoke(
        &self,
        channel: &Channel,
        request: &InvokeRequest,
    ) -> Result<(), BrokerError> {
        self.publish(channel.invoke(), request.encode()).await
    }

    /// Sends one registry chunk on `channel`.
    pub async fn registry_chunk(
        &self,
        channel: &Channel,
        chunk: &RegistryChunk,
    ) -> Result<(), BrokerError> {
        self.publish(channel.registry_chunks(), chunk.encode())
            .await
    }

    /// Announces a federated round on `channel`.
    pub async fn fl_round_start(
        &self,
        channel: &Channel,
        start: &FlRoundStart,
    ) -> Result<(), BrokerError> {
        self.publish(channel.fl_round_start(), start.encode()).await
    }
}
