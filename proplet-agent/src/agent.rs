//! The agent service: MQTT session, liveness reports, and the handling of start, stop and
//! invoke requests.
//!
//! The agent may be given several brokers: it connects to one and, whenever the connection
//! fails or drops, moves round-robin to the next one, waiting the reconnect backoff between
//! attempts. Every new connection is a clean session, so subscriptions and the discovery are
//! sent again on each, and unacknowledged spooled results are sent again on the new one.
//!
//! Task work runs on the blocking pool behind a concurrency cap, so heartbeats and the MQTT
//! loop never wait behind a busy guest. Results and invoke results go through the on-disk
//! spool ([`crate::spool`]) and are the only QoS 1 publishes, which lets the spool sender match
//! each broker acknowledgement to its entry.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use propeller_broker::protocol::enrolment::{key_topic, KeyRotation};
use propeller_broker::protocol::{
    decode, targets, Channel, ChunkAssembler, Discovery, Inbound, StartRequest, TopicKind,
};
use rumqttc::{
    AsyncClient, ConnectReturnCode, Event, EventLoop, MqttOptions, Outgoing, Packet, QoS,
};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::fetch::HttpFetcher;
use crate::finished::FinishedRuns;
use crate::outgoing_http::OutgoingHttp;
use crate::spool::Spool;
use crate::system::SystemProbe;
use crate::task_log::LogQueue;
use crate::telemetry::AgentMetrics;
use crate::wasm::{Compiled, Limits, StopFlag, WasmRuntime};

mod chunks;
mod encrypted;
mod heartbeats;
mod login_keys;
mod logs;
mod options;
mod results;
mod rotation;
mod subscriptions;
mod tasks;
mod upgrades;

pub use options::{broker_options, mqtt_options, tls_config};
use rotation::{Backoff, Rotation};

/// Whole-request limit for HTTP(S) fetches.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the spool waits for a PUBACK before sending the entry again.
const ACK_TIMEOUT: Duration = Duration::from_secs(30);
/// Spooled results published and awaiting their PUBACK at most (the MQTT client's in-flight
/// window is the same).
const RESULTS_IN_FLIGHT: usize = 32;

/// A deployed latent task, compiled and waiting for invocations.
struct Latent {
    compiled: Compiled,
    request: StartRequest,
}

/// Chunks being collected for one image, and the tasks waiting for it.
struct Fetch {
    assembler: ChunkAssembler,
    waiters: Vec<oneshot::Sender<Result<Vec<u8>, String>>>,
}

/// Tasks whose last finished run (and its result) is remembered, to answer a repeated start.
const FINISHED_RUNS_KEPT: usize = 4096;
/// Wait before subscribing again after the broker refused a subscription.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

/// Captured lines waiting for the log spool at most (the newest are kept).
const LOG_QUEUE_LINES: usize = 100_000;

/// Starts whose result is awaited that the turnaround timing keeps track of at most.
const MAX_TRACKED_ARRIVALS: usize = 10_000;

/// Acknowledgement tracking for the spool sender.
#[derive(Debug, Clone, Copy)]
enum AckSignal {
    Sent(u16),
    Acked(u16),
}

/// One running agent.
pub struct Agent {
    config: Config,
    channel: Channel,
    client: AsyncClient,
    runtime: Arc<WasmRuntime>,
    spool: Arc<Spool>,
    /// Batches of task output waiting to be sent (a ring).
    log_spool: Arc<Spool>,
    /// Lines runs printed, not yet in the log spool.
    log_queue: Arc<LogQueue>,
    /// Runs finished here with their results; updated under the `running` lock.
    finished: FinishedRuns,
    probe: Arc<SystemProbe>,
    running: Mutex<HashMap<String, StopFlag>>,
    latent: Mutex<HashMap<String, Arc<Latent>>>,
    fetches: Mutex<HashMap<String, Fetch>>,
    /// When each accepted start arrived, until its result is published.
    arrivals: Mutex<HashMap<String, std::time::Instant>>,
    slots: Arc<Semaphore>,
    http: HttpFetcher,
    metrics: Arc<AgentMetrics>,
    /// `Some(n)` while connected, `n` counting sessions; `None` while disconnected.
    session: watch::Sender<Option<u64>>,
    /// Connection options for each of `config.brokers`, in the same order.
    broker_options: Vec<MqttOptions>,
    /// Held by the spool sender from its look at `session` until its publish is queued, and
    /// by the event loop while it marks a lost session and drops what was queued for it: a
    /// result queued for the old connection can then never go out on the next one besides
    /// its resend.
    spool_gate: Mutex<()>,
    /// The keys for the next logins: the configured one, or after a rotation the new one and,
    /// during its grace, the replaced one.
    login_keys: Mutex<login_keys::LoginKeys>,
    /// The SUBSCRIBEs awaiting their SUBACKs.
    subscriptions: subscriptions::Subscriptions,
    /// The Key Broker Service client for encrypted tasks, if this device can attest.
    kbs: Option<crate::kbs::KbsClient>,
    /// Whether the broker accepted every subscription of this connection: until then the
    /// agent neither announces itself nor sends heartbeats, so propeller does not count it
    /// Running (and send it starts) while its broker would not deliver them.
    listening: AtomicBool,
    /// Whether an upgrade request is being handled.
    upgrading: AtomicBool,
    /// Wakes the run loop to stop for a restart into another agent binary.
    restart: tokio::sync::Notify,
    /// The binary to restart into.
    restart_to: Mutex<Option<std::path::PathBuf>>,
    /// This binary's trial, until it is confirmed healthy or given up.
    trial: Mutex<Option<crate::upgrade::Trial>>,
}

impl Agent {
    /// Builds the agent; nothing runs until [`Agent::run`].
    pub fn new(config: Config, client: AsyncClient) -> anyhow::Result<Arc<Self>> {
        let channel = Channel::new(&config.domain_id, &config.channel_id)
            .context("domain and channel ids")?;
        let runtime = WasmRuntime::new(Limits {
            max_memory_bytes: config.task_memory_limit,
            fuel: config.task_fuel,
            disk_cache: Some(config.state_dir.join("modules")),
            preopen_allow_list: config.preopen_dirs.clone(),
            outgoing_http: OutgoingHttp {
                allow_hosts: config.http_allow_hosts.clone(),
                timeout: HTTP_TIMEOUT,
                overrides: config.http_resolve.clone(),
                extra_roots: config.http_ca_roots.clone(),
            },
            ..Limits::default()
        })
        .context("starting the Wasm runtime")?;
        let spool = Spool::open(&config.state_dir.join("spool"), config.spool_max_results)
            .with_context(|| {
                format!("opening the result spool in {}", config.state_dir.display())
            })?;
        let log_spool = Spool::open(&config.state_dir.join("logs"), config.log_spool_max_batches)
            .with_context(|| {
            format!("opening the log spool in {}", config.state_dir.display())
        })?;
        let finished =
            FinishedRuns::open(&config.state_dir, FINISHED_RUNS_KEPT).with_context(|| {
                format!(
                    "opening the finished-runs memory in {}",
                    config.state_dir.display()
                )
            })?;
        let http = HttpFetcher::new(HTTP_TIMEOUT, config.max_module_size as u64)
            .context("building the HTTP client")?;
        let broker_options = broker_options(&config, &channel)?;
        let kbs = encrypted::kbs_client(&config)?;
        let (session, _) = watch::channel(None);
        Ok(Arc::new(Self {
            slots: Arc::new(Semaphore::new(config.max_concurrent_tasks)),
            channel,
            client,
            runtime: Arc::new(runtime),
            spool: Arc::new(spool),
            log_spool: Arc::new(log_spool),
            log_queue: Arc::new(LogQueue::new(LOG_QUEUE_LINES)),
            finished,
            probe: Arc::new(SystemProbe::new(
                &config,
                kbs.as_ref().map(crate::kbs::KbsClient::attester),
            )),
            kbs,
            running: Mutex::new(HashMap::new()),
            latent: Mutex::new(HashMap::new()),
            fetches: Mutex::new(HashMap::new()),
            arrivals: Mutex::new(HashMap::new()),
            session,
            broker_options,
            spool_gate: Mutex::new(()),
            login_keys: Mutex::new(login_keys::LoginKeys::new(
                config.client_key.clone(),
                stored_previous_key(&config),
            )),
            subscriptions: subscriptions::Subscriptions::default(),
            listening: AtomicBool::new(false),
            upgrading: AtomicBool::new(false),
            restart: tokio::sync::Notify::new(),
            restart_to: Mutex::new(None),
            trial: Mutex::new(None),
            http,
            metrics: Arc::new(AgentMetrics::default()),
            config,
        }))
    }

    /// Starts the health and metrics endpoint if configured; fails if its port is taken.
    pub async fn serve_telemetry(&self) -> anyhow::Result<Option<std::net::SocketAddr>> {
        let Some(addr) = self.config.telemetry else {
            return Ok(None);
        };
        let listener = crate::telemetry::bind(addr)
            .await
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        let bound = listener.local_addr().ok();
        tokio::spawn(crate::telemetry::serve(listener, self.metrics.clone()));
        Ok(bound)
    }

    /// Drives the MQTT session until `shutdown` resolves; then disconnects cleanly.
    ///
    /// `eventloop` is made from [`mqtt_options`]: it starts on the first broker. When a
    /// connection fails or drops, the loop points it at the next broker of the list
    /// (round-robin) and tries that one after the backoff delay.
    pub async fn run(
        self: Arc<Self>,
        mut eventloop: EventLoop,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        // A result follows the start's PUBACK within microseconds; with Nagle on, it would
        // wait for the broker's delayed ACK (about 40 ms on Linux).
        eventloop.network_options.set_tcp_nodelay(true);
        let (ack_tx, ack_rx) = mpsc::unbounded_channel();
        let background = [
            tokio::spawn(self.clone().heartbeats()),
            tokio::spawn(self.clone().proplet_metrics()),
            tokio::spawn(self.clone().send_spooled(ack_rx)),
            tokio::spawn(self.clone().start_upgrades()),
            tokio::spawn(self.clone().spool_logs()),
        ];
        let mut sessions = 0u64;
        let mut backoff = Backoff::default();
        let mut brokers = Rotation::new(
            self.config.brokers.as_slice(),
            &self.broker_options,
            &eventloop.mqtt_options,
        );
        let mut connected = false;
        tokio::pin!(shutdown);
        loop {
            let event = tokio::select! {
                event = eventloop.poll() => event,
                _ = &mut shutdown => break,
                _ = self.restart.notified() => break,
            };
            match event {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                    if ack.code != ConnectReturnCode::Success {
                        warn!(code = ?ack.code, "broker refused the connection");
                        continue;
                    }
                    backoff.reset();
                    connected = true;
                    self.listening.store(false, Ordering::Relaxed);
                    sessions += 1;
                    self.metrics.mqtt_sessions.inc();
                    self.metrics.mqtt_connected.set(1);
                    info!(
                        session = sessions,
                        broker = %brokers.current(),
                        "connected to the broker"
                    );
                    // Mark the session live before the subscriptions and the discovery go
                    // out, or the discovery would be skipped as "not connected".
                    self.session.send_replace(Some(sessions));
                    let agent = self.clone();
                    let (host, port) = eventloop.mqtt_options.broker_address();
                    tokio::spawn(async move { agent.on_connected(host, port).await });
                }
                Ok(Event::Incoming(Packet::Publish(publish))) => {
                    let agent = self.clone();
                    tokio::spawn(
                        async move { agent.dispatch(&publish.topic, &publish.payload).await },
                    );
                }
                Ok(Event::Incoming(Packet::PubAck(ack))) => {
                    let _ = ack_tx.send(AckSignal::Acked(ack.pkid));
                }
                Ok(Event::Outgoing(Outgoing::Subscribe(pkid))) => self.subscriptions.sent(pkid),
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
                    let refused = ack
                        .return_codes
                        .iter()
                        .any(|code| matches!(code, rumqttc::SubscribeReasonCode::Failure));
                    let which = self.subscriptions.refused(ack.pkid, &ack.return_codes);
                    let retry = match &which {
                        None => refused,
                        Some(filters) => !filters.is_empty(),
                    };
                    if retry {
                        // A clustered broker may refuse subscriptions for a while after a
                        // node failure (NATS re-electing its JetStream leaders): try again,
                        // the refused filters only.
                        warn!(
                            retry_in = ?RESUBSCRIBE_AFTER,
                            filters = ?which,
                            "the broker refused a subscription; subscribing again"
                        );
                        let agent = self.clone();
                        tokio::spawn(async move { agent.subscribe_again(sessions, which).await });
                    } else {
                        if refused {
                            warn!("the broker does not offer agent upgrade requests here (an older propeller?); running without them");
                        }
                        if self.subscriptions.complete()
                            && !self.listening.swap(true, Ordering::Relaxed)
                        {
                            info!("subscribed; announcing the proplet");
                            let agent = self.clone();
                            tokio::spawn(async move {
                                agent.announce().await;
                                agent.confirm_trial().await;
                            });
                        }
                    }
                }
                Ok(Event::Outgoing(Outgoing::Publish(pkid))) if pkid != 0 => {
                    let _ = ack_tx.send(AckSignal::Sent(pkid));
                }
                Ok(_) => {}
                Err(error) => {
                    {
                        let _gate = self.lock_spool_gate();
                        self.session.send_replace(None);
                        if connected {
                            // rumqttc dropped what was queued for the lost connection when it
                            // reported the error; drop too what was queued since, before the
                            // spool sender saw the session end (it sends those again).
                            eventloop.clean();
                        }
                        self.subscriptions.forget();
                        self.listening.store(false, Ordering::Relaxed);
                    }
                    self.metrics.mqtt_connected.set(0);
                    let wait = backoff.next_delay();
                    let failed = brokers.current().clone();
                    let next = brokers.advance(&mut eventloop);
                    let key = self
                        .login_keys
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .next(!connected, chrono::Utc::now())
                        .to_owned();
                    eventloop
                        .mqtt_options
                        .set_credentials(&self.config.client_id, key);
                    match (connected, next) {
                        (true, None) => warn!(%error, retry_in = ?wait, "MQTT connection lost"),
                        (false, None) => {
                            warn!(%error, retry_in = ?wait, "cannot connect to the broker")
                        }
                        (true, Some(next)) => warn!(
                            %error,
                            broker = %failed,
                            next = %next,
                            retry_in = ?wait,
                            "MQTT connection lost; moving to the next broker"
                        ),
                        (false, Some(next)) => warn!(
                            %error,
                            broker = %failed,
                            next = %next,
                            retry_in = ?wait,
                            "cannot connect to the broker; trying the next one"
                        ),
                    }
                    connected = false;
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = &mut shutdown => break,
                    }
                }
            }
        }
        info!("shutting down");
        let _ = self.client.try_disconnect();
        // Let the DISCONNECT go out, bounded.
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            while let Ok(event) = eventloop.poll().await {
                if matches!(event, Event::Outgoing(Outgoing::Disconnect)) {
                    break;
                }
            }
        })
        .await;
        for task in background {
            task.abort();
        }
        for stop in self.lock_running().values() {
            stop.stop();
        }
    }

    /// Subscribes again after [`RESUBSCRIBE_AFTER`] to `filters` (all when `None`) if
    /// session `session` is still the live one.
    async fn subscribe_again(&self, session: u64, filters: Option<Vec<String>>) {
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
        if *self.session.borrow() != Some(session) {
            return;
        }
        let wanted = self.filters();
        let filters = match filters {
            None => wanted,
            Some(refused) => wanted
                .into_iter()
                .filter(|(f, _)| refused.contains(f))
                .collect(),
        };
        self.request_subscriptions(filters).await;
    }

    async fn subscribe(&self) {
        self.request_subscriptions(self.filters()).await;
        let upgrades = vec![(self.channel.upgrade(), self.config.qos.to_mqtt())];
        while !self
            .subscriptions
            .request_optional(&self.client, upgrades.clone())
        {
            if self.session.borrow().is_none() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Every filter the agent listens on, with its QoS: its channel's and its key topic.
    fn filters(&self) -> Vec<(String, QoS)> {
        let qos = self.config.qos.to_mqtt();
        let mut filters: Vec<(String, QoS)> = self
            .channel
            .agent_filters()
            .into_iter()
            .map(|f| (f, qos))
            .collect();
        filters.push((key_topic(&self.config.client_id), QoS::AtLeastOnce));
        filters
    }

    /// Sends one SUBSCRIBE for `filters`, waiting while the client's queue is full.
    async fn request_subscriptions(&self, filters: Vec<(String, QoS)>) {
        while !self.subscriptions.request(&self.client, filters.clone()) {
            if self.session.borrow().is_none() {
                return warn!(?filters, "not subscribed: the connection is gone");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A new key from propeller (`propeller rotate`): kept for the next logins, in memory and
    /// in the state directory's credentials.
    fn on_new_key(&self, payload: &[u8]) {
        let rotation: KeyRotation = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => return warn!(%e, "a key rotation that does not decode"),
        };
        if rotation.client_id != self.config.client_id {
            return warn!(
                client = rotation.client_id,
                "a key rotation for another client"
            );
        }
        let Ok(until) = chrono::DateTime::parse_from_rfc3339(&rotation.previous_valid_until) else {
            return warn!(
                until = rotation.previous_valid_until,
                "a key rotation whose grace end does not read as a time"
            );
        };
        let mut keys = self.login_keys.lock().unwrap_or_else(|e| e.into_inner());
        if !keys.rotate(
            rotation.client_key.clone(),
            until.with_timezone(&chrono::Utc),
        ) {
            return;
        }
        let dir = &self.config.state_dir;
        let stored = match crate::credentials::load(dir) {
            Ok(stored) => stored,
            Err(e) => {
                return warn!(%e, "cannot read the stored credentials; the new key is used until this agent stops")
            }
        };
        let mut credentials = stored.unwrap_or_else(|| crate::credentials::Credentials {
            mqtt_address: self.config.brokers.to_string(),
            tls_ca_cert: self.config.tls.as_ref().map(|t| t.ca_cert.clone()),
            domain_id: self.config.domain_id.clone(),
            channel_id: self.config.channel_id.clone(),
            client_id: self.config.client_id.clone(),
            client_key: String::new(),
            namespace: self.config.namespace.clone(),
            previous_client_key: None,
            previous_key_until: None,
        });
        credentials.client_key = keys.current().to_owned();
        let previous = keys.previous(chrono::Utc::now());
        credentials.previous_client_key = previous.map(|(key, _)| key.to_owned());
        credentials.previous_key_until = previous.map(|(_, until)| until);
        match crate::credentials::save(dir, &credentials) {
            Ok(path) => info!(
                path = %path.display(),
                old_key_until = rotation.previous_valid_until,
                "received a new key from propeller; it is used from the next login"
            ),
            Err(e) => warn!(%e, "cannot store the new key; it is used until this agent stops"),
        }
    }

    /// Subscribes on a new connection, to `host:port`; the proplet is announced once the
    /// broker has accepted every subscription (after every connect, so metadata is fresh
    /// after a broker restart too).
    async fn on_connected(&self, host: String, port: u16) {
        let probe_ip = tokio::task::spawn_blocking({
            let probe = self.probe.clone();
            move || probe.learn_ip(&host, port)
        });
        let _ = probe_ip.await;
        self.subscribe().await;
        self.ask_again_for_chunks().await;
    }

    /// Publishes the proplet's discovery (`control/proplet/create`).
    async fn announce(&self) {
        let discovery = Discovery {
            proplet_id: self.config.client_id.clone(),
            namespace: Some(self.config.namespace.clone()),
            metadata: Some(self.probe.metadata()),
        };
        self.publish_now(self.channel.discovery(), discovery.encode())
            .await;
    }

    /// Publishes at QoS 0 while connected; liveness reports are not worth queueing.
    async fn publish_now(&self, topic: String, payload: Vec<u8>) {
        if self.session.borrow().is_none() {
            return;
        }
        if let Err(e) = self
            .client
            .publish(topic, QoS::AtMostOnce, false, payload)
            .await
        {
            debug!(%e, "publish skipped");
        }
    }

    /// Handles one message from the broker.
    pub async fn dispatch(self: &Arc<Self>, topic: &str, payload: &[u8]) {
        if topic == key_topic(&self.config.client_id) {
            return self.on_new_key(payload);
        }
        let Some(kind) = self.channel.classify(topic) else {
            return;
        };
        match decode(&kind, payload) {
            Ok(Inbound::Start(request)) => self.clone().on_start(*request).await,
            Ok(Inbound::Stop(request)) => self.on_stop(&request),
            Ok(Inbound::Invoke(request)) => self.clone().on_invoke(request).await,
            Ok(Inbound::RegistryChunk(chunk)) => self.on_chunk(chunk),
            Ok(Inbound::Upgrade(request)) => self.clone().on_upgrade(request).await,
            Ok(_) => {}
            Err(error) => {
                warn!(topic, %error, "undecodable message");
                if kind == TopicKind::Start {
                    self.reject_undecodable_start(payload, &error.to_string())
                        .await;
                }
            }
        }
    }

    /// A start we cannot decode still gets a failure result when its id and target are readable.
    async fn reject_undecodable_start(&self, payload: &[u8], error: &str) {
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(payload) else {
            return;
        };
        let Some(id) = value
            .get("id")
            .and_then(|v| v.as_str())
            .filter(|s| !s.is_empty())
        else {
            return;
        };
        let broadcast = value
            .get("broadcast")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        let target = value.get("proplet_id").and_then(|v| v.as_str());
        if targets(broadcast, target, &self.config.client_id) {
            self.report(id, Err(format!("invalid start request: {error}")))
                .await;
        }
    }

    fn lock_restart(&self) -> std::sync::MutexGuard<'_, Option<std::path::PathBuf>> {
        self.restart_to.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_trial(&self) -> std::sync::MutexGuard<'_, Option<crate::upgrade::Trial>> {
        self.trial.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_spool_gate(&self) -> std::sync::MutexGuard<'_, ()> {
        self.spool_gate.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_running(&self) -> std::sync::MutexGuard<'_, HashMap<String, StopFlag>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_latent(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Latent>>> {
        self.latent.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock_fetches(&self) -> std::sync::MutexGuard<'_, HashMap<String, Fetch>> {
        self.fetches.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The key the stored credentials say the configured key replaced, while it still works.
fn stored_previous_key(config: &Config) -> Option<(String, chrono::DateTime<chrono::Utc>)> {
    let stored = crate::credentials::load(&config.state_dir).ok().flatten()?;
    if stored.client_key != config.client_key {
        return None;
    }
    let key = stored.previous_client_key?;
    let until = stored.previous_key_until?;
    (chrono::Utc::now() < until).then_some((key, until))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::tasks::start_problem;
    use crate::config::BrokerAddress;

    #[test]
    fn backoff_grows_to_a_minute_with_jitter_and_resets() {
        let mut b = Backoff::default();
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(800) && first <= Duration::from_millis(1200));
        let mut last = first;
        for _ in 0..10 {
            last = b.next_delay();
        }
        assert!(
            last >= Duration::from_secs(48) && last <= Duration::from_secs(72),
            "{last:?}"
        );
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(1200));
    }

    #[test]
    fn brokers_rotate_round_robin_and_a_single_one_stays() {
        let brokers: Vec<BrokerAddress> = ["a", "b", "c"]
            .iter()
            .map(|h| BrokerAddress {
                host: (*h).into(),
                port: 1883,
                tls: false,
            })
            .collect();
        let options: Vec<MqttOptions> = brokers
            .iter()
            .map(|b| MqttOptions::new("p", &b.host, b.port))
            .collect();
        // The event loop starts on the second broker: the rotation follows it from there.
        let mut eventloop = EventLoop::new(options[1].clone(), 10);
        let mut rotation = Rotation::new(&brokers, &options, &eventloop.mqtt_options);
        assert_eq!(rotation.current().host, "b");
        let mut visited = Vec::new();
        for _ in 0..4 {
            let next = rotation.advance(&mut eventloop).map(|b| b.host.clone());
            assert_eq!(
                next,
                Some(eventloop.mqtt_options.broker_address().0),
                "the event loop follows the rotation"
            );
            visited.extend(next);
        }
        assert_eq!(visited, ["c", "a", "b", "c"]);

        let single = &brokers[..1];
        let mut eventloop = EventLoop::new(options[0].clone(), 10);
        let mut rotation = Rotation::new(single, &options[..1], &eventloop.mqtt_options);
        assert_eq!(rotation.advance(&mut eventloop), None);
        assert_eq!(rotation.current().host, "a");
    }

    #[test]
    fn start_validation_explains_each_problem() {
        let ok = StartRequest {
            id: "t".into(),
            name: "add".into(),
            file: Some(vec![0]),
            ..StartRequest::default()
        };
        assert_eq!(start_problem(&ok), None);
        let mut r = ok.clone();
        r.name = String::new();
        assert!(start_problem(&r).is_some_and(|p| p.contains("name")));
        let mut r = ok;
        r.file = None;
        assert!(start_problem(&r).is_some_and(|p| p.contains("image_url")));
    }
}
