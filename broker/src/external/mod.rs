//! Propeller on an existing MQTT cluster (RabbitMQ, NATS, EMQX, mosquitto, ...): instead of
//! being the broker, propeller is one of its clients.
//!
//! [`ExternalBroker::connect`] opens one client session (`rumqttc`) on the first reachable node
//! of a list, subscribes to what the reconcilers need, and yields the same typed
//! [`BrokerEvent`] stream and [`Publisher`] the embedded broker does, so no reconcile code
//! knows which broker is in front.
//!
//! Nothing is lost while propeller is away: the session is persistent (clean session off, a
//! stable client id, QoS 1 subscriptions), so the cluster keeps what devices publish meanwhile
//! and delivers it when the same client id comes back, on any node. The replica that takes
//! over leadership takes the session over with it. Starts not yet acknowledged when the
//! connection drops are sent again on the next connection (devices answer a repeated start
//! with the result they already have). After every connect the subscriptions are made again,
//! since a node that never held the session does not know them.
//!
//! Who sent a report is decided by [`attribution`], since subscribers of an external broker
//! are not told the publisher.

pub mod attribution;
pub mod callback;
mod metrics;
pub mod nats_config;
mod session;
mod tls;

use std::sync::Arc;
use std::time::Duration;

use rumqttc::{AsyncClient, MqttOptions, Transport};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::protocol::{BrokerAddress, Decoder, UNPREFIXED_FL_UPDATE_FILTER};
use crate::server::{BrokerError, BrokerEvent, CredentialStore, Publisher};

pub use attribution::DeviceTrust;
pub use metrics::ExternalMetrics;
pub use tls::ClientTls;

/// Largest inbound packet accepted from the broker (a registry request or an FL update).
const MAX_INBOUND_PACKET: usize = 16 * 1024 * 1024;

/// How propeller connects to an external broker.
#[derive(Debug, Clone)]
pub struct ExternalConfig {
    /// The cluster's nodes (or its load balancer); tried in order, then round again.
    pub addresses: Vec<BrokerAddress>,
    /// Propeller's client id: stable, so a restart resumes the same session.
    pub client_id: String,
    /// Propeller's own username and password on the broker.
    pub credentials: Option<(String, String)>,
    /// CA and client certificate for `mqtts://` addresses.
    pub tls: ClientTls,
    /// The topic filters to subscribe to (see [`report_filters`]).
    pub filters: Vec<String>,
    /// MQTT keep-alive.
    pub keep_alive: Duration,
    /// Largest report payload decoded.
    pub max_payload_bytes: usize,
    /// Whether devices log in with propeller's credentials.
    pub trust: DeviceTrust,
    /// First delay before trying the next node; doubled per failure up to `max_backoff`.
    pub min_backoff: Duration,
    /// Longest delay between attempts.
    pub max_backoff: Duration,
}

impl ExternalConfig {
    /// Settings with defaults for everything but the addresses and the client id.
    pub fn new(addresses: Vec<BrokerAddress>, client_id: impl Into<String>) -> Self {
        Self {
            addresses,
            client_id: client_id.into(),
            credentials: None,
            tls: ClientTls::default(),
            filters: report_filters(None, None),
            keep_alive: Duration::from_secs(15),
            max_payload_bytes: crate::server::DEFAULT_MAX_PAYLOAD_BYTES,
            trust: DeviceTrust::Authenticated,
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// What propeller subscribes to: every report agents publish (alive, results, metrics, task
/// metrics, invoke results, discovery), binary requests, FL updates and enrolment requests,
/// on one domain and channel or (`None`) on all.
pub fn report_filters(domain: Option<&str>, channel: Option<&str>) -> Vec<String> {
    let prefix = format!("m/{}/c/{}", domain.unwrap_or("+"), channel.unwrap_or("+"));
    vec![
        format!("{prefix}/control/proplet/+"),
        format!("{prefix}/registry/proplet"),
        format!("{prefix}/fl/rounds/+/updates/+"),
        UNPREFIXED_FL_UPDATE_FILTER.to_owned(),
        crate::protocol::enrolment::ENROL_REQUEST_FILTER.to_owned(),
    ]
}

/// A running client session on an external broker; dropping it ends the session's task
/// (the broker keeps the session for the next connect with the same client id).
pub struct ExternalBroker {
    /// What the session was started with, kept to end it ([`ExternalBroker::end_session`]).
    config: Box<ExternalConfig>,
    tls: Option<Arc<rustls::ClientConfig>>,
    events: Option<UnboundedReceiver<BrokerEvent>>,
    publisher: Publisher,
    metrics: ExternalMetrics,
    ready: watch::Receiver<bool>,
    task: Option<JoinHandle<()>>,
}

impl ExternalBroker {
    /// Starts the session on the current tokio runtime and returns at once; the connection is
    /// made (and remade) in the background. `devices` is the proplets' credential table, used
    /// to attribute reports.
    pub fn connect(config: ExternalConfig, devices: CredentialStore) -> Result<Self, BrokerError> {
        if config.addresses.is_empty() {
            return Err(BrokerError::Config(
                "no external broker address: give at least one mqtt:// or mqtts:// address".into(),
            ));
        }
        if config.client_id.is_empty() {
            return Err(BrokerError::Config(
                "the client id on the external broker is empty".into(),
            ));
        }
        let tls = config.tls.rustls_config(&config.addresses)?;
        let options = options_for(&config, 0, tls.clone());
        // Large enough that a burst of starts never waits for the session task.
        let (client, mut eventloop) = AsyncClient::new(options, 65_536);
        // A start is one small packet a device answers at once: with Nagle's algorithm on it
        // waits for the broker's delayed ACK (40 ms on Linux) before it leaves.
        eventloop.network_options.set_tcp_nodelay(true);
        let metrics = ExternalMetrics::default();
        metrics
            .devices_authenticated
            .set(i64::from(config.trust == DeviceTrust::Authenticated));
        let (event_tx, event_rx) = unbounded_channel();
        let (ready_tx, ready_rx) = watch::channel(false);
        let decoder = Decoder::new(config.max_payload_bytes);
        let session = session::Session {
            config: config.clone(),
            tls: tls.clone(),
            eventloop,
            devices,
            decoder,
            events: event_tx,
            ready: ready_tx,
            metrics: metrics.clone(),
        };
        let task = tokio::spawn(session.run());
        Ok(Self {
            config: Box::new(config),
            tls,
            events: Some(event_rx),
            publisher: Publisher::external(client),
            metrics,
            ready: ready_rx,
            task: Some(task),
        })
    }

    /// The event stream; `None` after the first call (there is one consumer).
    pub fn take_events(&mut self) -> Option<UnboundedReceiver<BrokerEvent>> {
        self.events.take()
    }

    /// A handle for publishing commands to devices (QoS 1, through the session).
    pub fn publisher(&self) -> Publisher {
        self.publisher.clone()
    }

    /// The session's meters.
    pub fn metrics(&self) -> &ExternalMetrics {
        &self.metrics
    }

    /// True while connected and subscribed.
    pub fn ready(&self) -> watch::Receiver<bool> {
        self.ready.clone()
    }

    /// Ends the session task (the broker keeps the persistent session).
    pub fn shutdown(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }

    /// Ends the session task and the session on the cluster too: a clean-session connect with
    /// the same client id, then a DISCONNECT, on the first node that accepts it, so the broker
    /// drops the session's subscriptions and stops keeping reports for it. For a client id
    /// that is never used again (a sharded replica's names its pod). Gives up after `limit`.
    pub async fn end_session(&mut self, limit: Duration) -> Result<(), BrokerError> {
        self.shutdown();
        let config = &self.config;
        let tls = &self.tls;
        let attempt = async {
            let mut last = String::from("no address");
            for index in 0..config.addresses.len() {
                let mut options = options_for(config, index, tls.clone());
                options.set_clean_session(true);
                let (client, mut eventloop) = AsyncClient::new(options, 4);
                match end_on(&client, &mut eventloop).await {
                    Ok(()) => return Ok(()),
                    Err(e) => last = format!("{}: {e}", config.addresses[index]),
                }
            }
            Err(BrokerError::Config(format!(
                "ending the session {} on the cluster: {last}",
                config.client_id
            )))
        };
        tokio::time::timeout(limit, attempt).await.map_err(|_| {
            BrokerError::Config(format!(
                "ending the session {} on the cluster took over {limit:?}",
                config.client_id
            ))
        })?
    }
}

/// Connects (the options say clean session), then disconnects once the broker accepted.
async fn end_on(
    client: &AsyncClient,
    eventloop: &mut rumqttc::EventLoop,
) -> Result<(), rumqttc::ConnectionError> {
    use rumqttc::{Event, Outgoing, Packet};
    loop {
        if let Event::Incoming(Packet::ConnAck(_)) = eventloop.poll().await? {
            break;
        }
    }
    // The request queue is empty and sized 4: this cannot fail for want of room.
    let _ = client.try_disconnect();
    loop {
        match eventloop.poll().await {
            Ok(Event::Outgoing(Outgoing::Disconnect)) | Err(_) => return Ok(()),
            Ok(_) => {}
        }
    }
}

impl Drop for ExternalBroker {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The client options for the `index`-th address.
fn options_for(
    config: &ExternalConfig,
    index: usize,
    tls: Option<Arc<rustls::ClientConfig>>,
) -> MqttOptions {
    let address = &config.addresses[index % config.addresses.len()];
    let mut options = MqttOptions::new(&config.client_id, &address.host, address.port);
    options
        .set_clean_session(false)
        .set_keep_alive(config.keep_alive)
        .set_inflight(500)
        .set_max_packet_size(MAX_INBOUND_PACKET, MAX_INBOUND_PACKET);
    if let Some((user, password)) = &config.credentials {
        options.set_credentials(user, password);
    }
    if address.tls {
        if let Some(tls) = tls {
            options.set_transport(Transport::tls_with_config(
                rumqttc::TlsConfiguration::Rustls(tls),
            ));
        }
    }
    options
}
