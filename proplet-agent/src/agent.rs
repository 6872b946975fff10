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

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use propeller_broker::protocol::{
    decode, targets, AggregatedMetrics, Channel, ChunkAssembler, ChunkError, ChunkProgress,
    Discovery, Heartbeat, Inbound, InvokeRequest, InvokeResult, MonitoringProfile, OfflineNotice,
    ProcessMetrics, RegistryChunk, RegistryRequest, ResultValue, StartRequest, StopRequest,
    TaskMetrics, TaskResult, Timestamp, TopicKind,
};
use rumqttc::{
    AsyncClient, ConnectReturnCode, Event, EventLoop, LastWill, MqttOptions, Outgoing, Packet, QoS,
    TlsConfiguration, Transport,
};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tracing::{debug, info, warn};

use crate::component::OutgoingHttp;
use crate::config::{BrokerAddress, Config};
use crate::fetch::HttpFetcher;
use crate::finished::{Finished, FinishedRuns, Seen};
use crate::http_server::Server as HttpServer;
use crate::spool::Spool;
use crate::system::{cpu_seconds, SystemProbe};
use crate::telemetry::AgentMetrics;
use crate::wasm::{Compiled, Invocation, Limits, RunError, StopFlag, TaskGauge, WasmRuntime};

/// Whole-request limit for HTTP(S) fetches.
const HTTP_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the spool waits for a PUBACK before sending the entry again.
const ACK_TIMEOUT: Duration = Duration::from_secs(30);

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
}

/// Connection options for `config`'s first broker, with the offline Last Will; the event loop
/// given to [`Agent::run`] is made from these.
pub fn mqtt_options(config: &Config, channel: &Channel) -> anyhow::Result<MqttOptions> {
    let tls = tls_for(config)?;
    options_for(config, channel, config.brokers.primary(), tls.as_ref())
}

/// Connection options for each of `config`'s brokers, in order.
pub fn broker_options(config: &Config, channel: &Channel) -> anyhow::Result<Vec<MqttOptions>> {
    let tls = tls_for(config)?;
    config
        .brokers
        .as_slice()
        .iter()
        .map(|broker| options_for(config, channel, broker, tls.as_ref()))
        .collect()
}

/// The TLS client configuration, read once, when a broker asks for TLS.
fn tls_for(config: &Config) -> anyhow::Result<Option<TlsConfiguration>> {
    match (&config.tls, config.brokers.first_tls()) {
        (Some(tls), Some(_)) => tls_config(tls).map(Some),
        _ => Ok(None),
    }
}

fn options_for(
    config: &Config,
    channel: &Channel,
    broker: &BrokerAddress,
    tls: Option<&TlsConfiguration>,
) -> anyhow::Result<MqttOptions> {
    let mut opts = MqttOptions::new(&config.client_id, &broker.host, broker.port);
    opts.set_credentials(&config.client_id, &config.client_key)
        .set_keep_alive(config.keep_alive)
        .set_clean_session(true)
        .set_max_packet_size(10 * 1024 * 1024, 10 * 1024 * 1024)
        .set_inflight(10)
        .set_request_channel_capacity(128);
    let will = OfflineNotice {
        proplet_id: config.client_id.clone(),
        namespace: Some(config.namespace.clone()),
    };
    opts.set_last_will(LastWill::new(
        channel.alive(),
        will.encode(),
        QoS::AtLeastOnce,
        false,
    ));
    if broker.tls {
        let tls = tls.with_context(|| {
            format!("{broker} uses TLS, but no CA bundle is configured (PROPLET_MQTT_TLS_CA_CERT)")
        })?;
        opts.set_transport(Transport::tls_with_config(tls.clone()));
    }
    Ok(opts)
}

fn tls_config(tls: &crate::config::TlsFiles) -> anyhow::Result<TlsConfiguration> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&tls.ca_cert)
        .with_context(|| format!("reading CA bundle {}", tls.ca_cert.display()))?
    {
        roots
            .add(cert.with_context(|| format!("parsing {}", tls.ca_cert.display()))?)
            .context("adding CA certificate")?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_root_certificates(roots);
    let config = match &tls.client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .with_context(|| format!("reading {}", cert.display()))?
                .collect::<Result<Vec<_>, _>>()
                .with_context(|| format!("parsing {}", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key)
                .with_context(|| format!("reading {}", key.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .context("client certificate and key do not match")?
        }
    };
    Ok(TlsConfiguration::Rustls(Arc::new(config)))
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
        let (session, _) = watch::channel(None);
        Ok(Arc::new(Self {
            slots: Arc::new(Semaphore::new(config.max_concurrent_tasks)),
            channel,
            client,
            runtime: Arc::new(runtime),
            spool: Arc::new(spool),
            finished,
            probe: Arc::new(SystemProbe::new(&config)),
            running: Mutex::new(HashMap::new()),
            latent: Mutex::new(HashMap::new()),
            fetches: Mutex::new(HashMap::new()),
            arrivals: Mutex::new(HashMap::new()),
            session,
            broker_options,
            spool_gate: Mutex::new(()),
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
        ];
        let mut sessions = 0u64;
        let mut backoff = Backoff::default();
        let mut brokers = Rotation::new(
            self.config.brokers.as_slice(),
            &self.broker_options,
            &eventloop.mqtt_options,
        );
        let mut connected = false;
        let mut subscriptions_refused = false;
        tokio::pin!(shutdown);
        loop {
            let event = tokio::select! {
                event = eventloop.poll() => event,
                _ = &mut shutdown => break,
            };
            match event {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                    if ack.code != ConnectReturnCode::Success {
                        warn!(code = ?ack.code, "broker refused the connection");
                        continue;
                    }
                    backoff.reset();
                    connected = true;
                    subscriptions_refused = false;
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
                Ok(Event::Incoming(Packet::SubAck(ack))) => {
                    let refused = ack
                        .return_codes
                        .iter()
                        .any(|code| matches!(code, rumqttc::SubscribeReasonCode::Failure));
                    if refused {
                        // A clustered broker may refuse subscriptions for a while after a
                        // node failure (NATS re-electing its JetStream leaders): try again.
                        warn!(
                            retry_in = ?RESUBSCRIBE_AFTER,
                            "the broker refused a subscription; subscribing again"
                        );
                        subscriptions_refused = true;
                        let agent = self.clone();
                        tokio::spawn(async move { agent.subscribe_again(sessions).await });
                    } else if subscriptions_refused {
                        // Starts sent meanwhile reached nobody: announcing the proplet again
                        // makes propeller send them again.
                        subscriptions_refused = false;
                        info!("subscribed after refusals; announcing the proplet again");
                        let agent = self.clone();
                        tokio::spawn(async move { agent.announce().await });
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
                    }
                    self.metrics.mqtt_connected.set(0);
                    let wait = backoff.next_delay();
                    let failed = brokers.current().clone();
                    let next = brokers.advance(&mut eventloop);
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

    /// Subscribes again after [`RESUBSCRIBE_AFTER`] if session `session` is still the live one.
    async fn subscribe_again(&self, session: u64) {
        tokio::time::sleep(RESUBSCRIBE_AFTER).await;
        if *self.session.borrow() != Some(session) {
            return;
        }
        self.subscribe().await;
    }

    async fn subscribe(&self) {
        let qos = qos(self.config.qos);
        for filter in self.channel.agent_filters() {
            if let Err(e) = self.client.subscribe(filter.clone(), qos).await {
                warn!(%e, filter, "subscribe failed");
            }
        }
    }

    /// Subscribes and announces the proplet on a new connection, to `host:port`.
    async fn on_connected(&self, host: String, port: u16) {
        let probe_ip = tokio::task::spawn_blocking({
            let probe = self.probe.clone();
            move || probe.learn_ip(&host, port)
        });
        let _ = probe_ip.await;
        self.subscribe().await;
        // Discovery after every connect, so metadata is fresh after a broker restart too.
        self.announce().await;
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

    async fn heartbeats(self: Arc<Self>) {
        let mut tick = tokio::time::interval(self.config.liveliness_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let beat = Heartbeat {
                proplet_id: self.config.client_id.clone(),
                namespace: Some(self.config.namespace.clone()),
                metadata: Some(self.probe.metadata()),
                metrics: Some(self.probe.heartbeat_metrics()),
            };
            self.publish_now(self.channel.alive(), beat.encode()).await;
        }
    }

    async fn proplet_metrics(self: Arc<Self>) {
        let Some(period) = self.config.metrics_interval else {
            return;
        };
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let metrics = self
                .probe
                .proplet_metrics(&self.config.client_id, &self.config.namespace);
            self.publish_now(self.channel.proplet_metrics(), metrics.encode())
                .await;
        }
    }

    /// Sends spooled results oldest first, one at a time, deleting each on its PUBACK.
    async fn send_spooled(self: Arc<Self>, mut acks: mpsc::UnboundedReceiver<AckSignal>) {
        let mut session = self.session.subscribe();
        loop {
            let Some(current) = *session.borrow_and_update() else {
                if session.changed().await.is_err() {
                    return;
                }
                continue;
            };
            let Some(entry) = self.spool.oldest() else {
                // A push between the look and this wait is not missed: it left a permit.
                tokio::select! {
                    _ = self.spool.added() => {}
                    _ = session.changed() => {}
                }
                continue;
            };
            while acks.try_recv().is_ok() {}
            let sent = {
                let _gate = self.lock_spool_gate();
                if *session.borrow() != Some(current) {
                    continue;
                }
                self.client.try_publish(
                    entry.topic.clone(),
                    qos(self.config.qos.max(1)),
                    false,
                    entry.payload.clone().into_bytes(),
                )
            };
            if sent.is_err() {
                // The request queue is full: try again shortly.
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            self.time_turnaround(&entry.topic, &entry.payload);
            let mut pkid = None;
            let deadline = tokio::time::sleep(ACK_TIMEOUT);
            tokio::pin!(deadline);
            let acked = loop {
                tokio::select! {
                    signal = acks.recv() => match signal {
                        Some(AckSignal::Sent(p)) if pkid.is_none() => pkid = Some(p),
                        Some(AckSignal::Acked(p)) if Some(p) == pkid => break true,
                        Some(_) => {}
                        None => return,
                    },
                    changed = session.changed() => {
                        if changed.is_err() || *session.borrow() != Some(current) {
                            break false;
                        }
                    }
                    _ = &mut deadline => break false,
                }
            };
            if acked {
                let spool = self.spool.clone();
                match tokio::task::spawn_blocking(move || spool.remove(&entry)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(%e, "cannot record a delivered result in the spool"),
                    Err(_) => return,
                }
                self.metrics.spooled_results.set(self.spool.len() as i64);
            }
        }
    }

    /// Observes how long a result took from its start's arrival, once it is published.
    fn time_turnaround(&self, topic: &str, payload: &str) {
        if topic != self.channel.results() {
            return;
        }
        let Ok(result) = serde_json::from_str::<serde_json::Value>(payload) else {
            return;
        };
        let Some(id) = result.get("task_id").and_then(|v| v.as_str()) else {
            return;
        };
        let arrived = self
            .arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(arrived) = arrived {
            let took = arrived.elapsed();
            self.metrics.task_turnaround.observe(took.as_secs_f64());
            debug!(
                task_id = id,
                turnaround_us = took.as_micros() as u64,
                "result published"
            );
        }
    }

    /// Handles one message from the broker.
    pub async fn dispatch(self: &Arc<Self>, topic: &str, payload: &[u8]) {
        let Some(kind) = self.channel.classify(topic) else {
            return;
        };
        match decode(&kind, payload) {
            Ok(Inbound::Start(request)) => self.clone().on_start(*request).await,
            Ok(Inbound::Stop(request)) => self.on_stop(&request),
            Ok(Inbound::Invoke(request)) => self.clone().on_invoke(request).await,
            Ok(Inbound::RegistryChunk(chunk)) => self.on_chunk(chunk),
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

    /// Runs one start request; its logs carry the task's id and run (the span `task`).
    #[tracing::instrument(name = "task", skip_all, fields(task_id = %request.id, run = ?request.run))]
    async fn on_start(self: Arc<Self>, request: StartRequest) {
        let arrived = std::time::Instant::now();
        if !request.is_for(&self.config.client_id) {
            return;
        }
        let id = request.id.clone();
        if let Some(problem) = start_problem(&request) {
            self.report(&id, Err(problem)).await;
            return;
        }
        let run = request.run;
        let stop = StopFlag::default();
        let repeat = {
            let mut running = self.lock_running();
            // Looked up under the `running` lock, which a run holds while it records itself
            // as finished and leaves `running`: a repeated start sees it in one or the other.
            let seen = run.map_or(Seen::New, |run| self.finished.seen(&id, run));
            match seen {
                Seen::Finished(done) => Some(done),
                Seen::Superseded { latest } => {
                    info!(
                        task_id = id,
                        run, latest, "start of an older run ignored: a later run finished here"
                    );
                    return;
                }
                Seen::New if running.contains_key(&id) => {
                    info!(
                        task_id = id,
                        "duplicate start ignored: the task is already running"
                    );
                    return;
                }
                Seen::New => {
                    running.insert(id.clone(), stop.clone());
                    None
                }
            }
        };
        if let Some(done) = repeat {
            info!(
                task_id = id,
                run = done.run,
                "start of a run that already finished here: its result is published again"
            );
            self.metrics.repeated_starts.inc();
            self.spool_message(done.topic, done.payload.into_bytes())
                .await;
            return;
        }
        {
            let mut arrivals = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
            // Results that were never published (spool overflow) must not pile up here.
            if arrivals.len() >= MAX_TRACKED_ARRIVALS {
                arrivals.clear();
            }
            arrivals.insert(id.clone(), arrived);
        }
        info!(task_id = id, run, name = request.name, "task accepted");
        self.metrics.tasks_started.inc();
        self.metrics.tasks_running.inc();
        let latent = request.latent;
        let outcome = self.execute(request, &stop).await;
        self.metrics.tasks_running.dec();
        let outcome = match outcome {
            Ok(None) => {
                self.lock_running().remove(&id);
                info!(
                    task_id = id,
                    "latent task compiled and ready for invocations"
                );
                return;
            }
            Ok(Some(output)) => Ok(output),
            Err(error) => {
                if latent {
                    warn!(task_id = id, %error, "latent task not deployed");
                }
                Err(error)
            }
        };
        let (topic, payload) = self.result_message(&id, outcome);
        {
            let mut running = self.lock_running();
            if let Some(run) = run {
                let done = Finished {
                    run,
                    topic: topic.clone(),
                    payload: payload.clone(),
                };
                if let Err(e) = self.finished.record(&id, done) {
                    warn!(task_id = id, %e, "cannot persist the finished run; a repeated start after a restart would run it again");
                }
            }
            running.remove(&id);
        }
        self.spool_message(topic, payload.into_bytes()).await;
    }

    /// Fetches, compiles and runs a task. `Ok(None)` for a deployed latent task.
    async fn execute(
        self: &Arc<Self>,
        request: StartRequest,
        stop: &StopFlag,
    ) -> Result<Option<String>, String> {
        let limit = self.config.max_module_size;
        let bytes = match (&request.file, &request.image_url) {
            (Some(file), _) if !file.is_empty() => {
                if file.len() > limit {
                    return Err(RunError::TooLarge {
                        what: "the inline module".into(),
                        size: file.len() as u64,
                        at_least: false,
                        limit,
                    }
                    .to_string());
                }
                file.clone()
            }
            (_, Some(url)) if url.starts_with("http://") || url.starts_with("https://") => {
                self.http.fetch(url).await.map_err(|e| e.to_string())?
            }
            (_, Some(image)) => self.fetch_chunks(image).await?,
            _ => return Err("the start request carries neither `file` nor `image_url`".into()),
        };
        if stop.is_stopped() {
            return Err(RunError::Stopped.to_string());
        }
        let runtime = self.runtime.clone();
        let (compiled, cached) = tokio::task::spawn_blocking(move || runtime.compile(&bytes))
            .await
            .map_err(|e| format!("compilation aborted: {e}"))?
            .map_err(|e| e.to_string())?;
        debug!(task_id = request.id, cached, "module ready");
        if let Compiled::Component(component) = &compiled {
            if compiled.serves_http() {
                return self.serve_http(&request, component, stop).await;
            }
        }
        if request.latent {
            self.lock_latent()
                .insert(request.id.clone(), Arc::new(Latent { compiled, request }));
            return Ok(None);
        }
        let invocation = self.invocation(&request, &request.inputs, &request.env);
        let sampler = self
            .clone()
            .sample_task_metrics(&request, invocation.gauge.clone());
        let outcome = self.run_guest(compiled, invocation, stop.clone()).await;
        if let Some(sampler) = sampler {
            sampler.abort();
        }
        outcome.map(Some)
    }

    /// Runs an HTTP component until its stop: reports `started at port N` once it listens
    /// (as upstream does), and nothing when it ends.
    async fn serve_http(
        self: &Arc<Self>,
        request: &StartRequest,
        component: &crate::component::Prepared,
        stop: &StopFlag,
    ) -> Result<Option<String>, String> {
        let invocation = self.invocation(request, &request.inputs, &request.env);
        let server = HttpServer::bind(
            self.runtime.clone(),
            component,
            invocation,
            stop.clone(),
            &self.config.http_serving,
        )
        .map_err(|e| e.to_string())?;
        let port = server.port();
        info!(task_id = request.id, port, "HTTP component serving");
        self.report(&request.id, Ok(format!("started at port {port}")))
            .await;
        server.serve().await;
        info!(task_id = request.id, port, "HTTP component stopped");
        Ok(None)
    }

    fn invocation(
        &self,
        request: &StartRequest,
        inputs: &[String],
        env: &BTreeMap<String, String>,
    ) -> Invocation {
        // A task asks for host directories with `PROPLET_PREOPEN=/a:/b`; the runtime refuses
        // any outside the agent's allow-list (`PROPLET_DIRS`). A task that asks for none gets
        // the whole allow-list, as upstream's proplet gives every task.
        let preopens = env
            .get("PROPLET_PREOPEN")
            .map(|v| {
                v.split(':')
                    .filter(|p| !p.is_empty())
                    .map(std::path::PathBuf::from)
                    .collect()
            })
            .unwrap_or_else(|| self.config.preopen_dirs.clone());
        let mut env: Vec<(String, String)> =
            env.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        if !env.iter().any(|(k, _)| k == "PROPLET_ID") {
            env.push(("PROPLET_ID".into(), self.config.client_id.clone()));
        }
        Invocation {
            function: request.name.clone(),
            inputs: inputs.to_vec(),
            args: request.cli_args.clone(),
            env,
            timeout: (!request.daemon).then_some(self.config.task_timeout),
            preopens,
            gauge: Arc::new(TaskGauge::default()),
        }
    }

    async fn run_guest(
        &self,
        compiled: Compiled,
        invocation: Invocation,
        stop: StopFlag,
    ) -> Result<String, String> {
        let _permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| "the proplet is shutting down".to_owned())?;
        if stop.is_stopped() {
            return Err(RunError::Stopped.to_string());
        }
        let runtime = self.runtime.clone();
        tokio::task::spawn_blocking(move || runtime.run(&compiled, &invocation, &stop))
            .await
            .map_err(|e| format!("task aborted: {e}"))?
            .map(|outcome| outcome.output)
            .map_err(|e| e.to_string())
    }

    /// Publishes `task_metrics` while the task runs, if its monitoring profile asks for it.
    /// Figures are the task's own: elapsed time, its linear memory, the CPU time of the
    /// thread running it, and fuel when metered.
    fn sample_task_metrics(
        self: Arc<Self>,
        request: &StartRequest,
        gauge: Arc<TaskGauge>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let profile = request.monitoring_profile.unwrap_or(if request.daemon {
            MonitoringProfile::long_running_daemon()
        } else {
            MonitoringProfile::standard()
        });
        if !(profile.enabled && profile.export_to_mqtt) {
            return None;
        }
        let task_id = request.id.clone();
        Some(tokio::spawn(async move {
            let period = Duration::from_secs(profile.interval_secs.max(1));
            let started = std::time::Instant::now();
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
            let mut summary = Summary::default();
            let mut last_cpu: Option<(std::time::Instant, f64)> = None;
            loop {
                tick.tick().await;
                let now = std::time::Instant::now();
                let cpu_percent = match (
                    profile.collect_cpu,
                    gauge.thread_id().and_then(thread_cpu_seconds),
                ) {
                    (true, Some(seconds)) => {
                        let percent = last_cpu.map(|(at, before)| {
                            let wall = now.duration_since(at).as_secs_f64();
                            if wall > 0.0 {
                                (seconds - before) * 100.0 / wall
                            } else {
                                0.0
                            }
                        });
                        last_cpu = Some((now, seconds));
                        percent
                    }
                    _ => None,
                };
                let memory = profile.collect_memory.then(|| gauge.memory_bytes());
                let metrics = ProcessMetrics {
                    cpu_percent,
                    memory_bytes: memory,
                    memory_percent: memory
                        .map(|m| m as f64 * 100.0 / self.config.task_memory_limit.max(1) as f64),
                    uptime_seconds: Some(started.elapsed().as_secs()),
                    thread_count: profile.collect_threads.then_some(1),
                    fuel_used: gauge.fuel_used(),
                    ..ProcessMetrics::default()
                };
                summary.add(cpu_percent, memory);
                let message = TaskMetrics {
                    task_id: task_id.clone(),
                    proplet_id: Some(self.config.client_id.clone()),
                    metrics,
                    aggregated: Some(summary.to_aggregated()),
                    timestamp: Some(Timestamp::now()),
                };
                self.publish_now(self.channel.task_metrics(), message.encode())
                    .await;
            }
        }))
    }

    fn on_stop(&self, request: &StopRequest) {
        if !request.is_for(&self.config.client_id) {
            return;
        }
        let found_running = self.lock_running().get(&request.id).cloned();
        let found_latent = self.lock_latent().remove(&request.id).is_some();
        match found_running {
            Some(stop) => {
                info!(task_id = request.id, "stop requested");
                stop.stop();
            }
            None if found_latent => info!(task_id = request.id, "latent task removed"),
            None => debug!(task_id = request.id, "stop for a task not running here"),
        }
    }

    async fn on_invoke(self: Arc<Self>, request: InvokeRequest) {
        if !request.is_for(&self.config.client_id) {
            return;
        }
        let invocation_id = request.invocation_id.clone().unwrap_or_default();
        let latent = self.lock_latent().get(&request.id).cloned();
        let outcome = match latent {
            None => Err(format!(
                "task {} is not deployed as a latent task on this proplet",
                request.id
            )),
            Some(latent) => {
                let mut env = latent.request.env.clone();
                env.extend(request.env.clone());
                let inputs = if request.inputs.is_empty() {
                    latent.request.inputs.clone()
                } else {
                    request.inputs.clone()
                };
                let invocation = self.invocation(&latent.request, &inputs, &env);
                self.run_guest(latent.compiled.clone(), invocation, StopFlag::default())
                    .await
            }
        };
        let (results, error) = split(outcome);
        let reply = InvokeResult {
            task_id: request.id.clone(),
            invocation_id,
            proplet_id: Some(self.config.client_id.clone()),
            results: ResultValue::Text(results),
            error,
        };
        self.spool_message(self.channel.invoke_results(), reply.encode())
            .await;
    }

    /// Requests `image` from the registry proxy and waits for all its chunks.
    async fn fetch_chunks(&self, image: &str) -> Result<Vec<u8>, String> {
        let (tx, rx) = oneshot::channel();
        {
            let mut fetches = self.lock_fetches();
            fetches
                .entry(image.to_owned())
                .or_insert_with(|| Fetch {
                    assembler: ChunkAssembler::new(image, self.config.max_module_size),
                    waiters: Vec::new(),
                })
                .waiters
                .push(tx);
        }
        let request = RegistryRequest {
            app_name: image.to_owned(),
        };
        if let Err(e) = self
            .client
            .publish(
                self.channel.registry_request(),
                QoS::AtMostOnce,
                false,
                request.encode(),
            )
            .await
        {
            return Err(format!("cannot request {image}: {e}"));
        }
        match tokio::time::timeout(self.config.chunk_timeout, rx).await {
            Ok(Ok(outcome)) => outcome,
            _ => {
                self.lock_fetches().remove(image);
                Err(format!(
                    "timed out after {:?} waiting for the chunks of {image}",
                    self.config.chunk_timeout
                ))
            }
        }
    }

    /// Collects a chunk, but only for images this proplet asked for.
    fn on_chunk(&self, chunk: RegistryChunk) {
        let mut fetches = self.lock_fetches();
        let Some(fetch) = fetches.get_mut(&chunk.app_name) else {
            return;
        };
        let name = chunk.app_name.clone();
        let limit = self.config.max_module_size;
        // Chunks before the last are all of one size: their count announces the least size
        // of the binary, so one that cannot fit is refused at its first chunk, not its last.
        let announced = (chunk.chunk_idx + 1 < chunk.total_chunks)
            .then(|| u64::from(chunk.total_chunks - 1) * chunk.data.len() as u64 + 1);
        let outcome = match announced {
            Some(least) if least > limit as u64 => Err(RunError::TooLarge {
                what: format!("image {name} ({} chunks)", chunk.total_chunks),
                size: least,
                at_least: true,
                limit,
            }
            .to_string()),
            _ => match fetch.assembler.push(chunk) {
                Ok(ChunkProgress::Complete(bytes)) => Ok(bytes),
                Ok(ChunkProgress::Pending { received, total }) => {
                    debug!(image = name, received, total, "chunk stored");
                    return;
                }
                // propeller resends the first chunks for devices that asked late.
                Err(error @ ChunkError::DuplicateIndex { .. }) => {
                    debug!(image = name, %error, "chunk already held");
                    return;
                }
                Err(ChunkError::TooLarge { size, max }) => Err(RunError::TooLarge {
                    what: format!("image {name}"),
                    size: size as u64,
                    at_least: true,
                    limit: max,
                }
                .to_string()),
                Err(error) => {
                    warn!(image = name, %error, "chunk rejected");
                    return;
                }
            },
        };
        if let Some(done) = fetches.remove(&name) {
            for waiter in done.waiters {
                let _ = waiter.send(outcome.clone());
            }
        }
    }

    /// Spools the result of task `id` for delivery.
    async fn report(&self, id: &str, outcome: Result<String, String>) {
        let (topic, payload) = self.result_message(id, outcome);
        self.spool_message(topic, payload.into_bytes()).await;
    }

    /// The result message of task `id` (topic and JSON text), counted and logged.
    fn result_message(&self, id: &str, outcome: Result<String, String>) -> (String, String) {
        match &outcome {
            Ok(_) => {
                self.metrics.tasks_succeeded.inc();
                info!(task_id = id, "task succeeded")
            }
            Err(e) => {
                self.metrics.tasks_failed.inc();
                warn!(task_id = id, error = %e, "task failed")
            }
        }
        let (results, error) = split(outcome);
        let result = TaskResult {
            task_id: id.to_owned(),
            proplet_id: Some(self.config.client_id.clone()),
            results: ResultValue::Text(results),
            error,
        };
        let payload = String::from_utf8_lossy(&result.encode()).into_owned();
        (self.channel.results(), payload)
    }

    async fn spool_message(&self, topic: String, payload: Vec<u8>) {
        let spool = self.spool.clone();
        let text = String::from_utf8_lossy(&payload).into_owned();
        let stored = tokio::task::spawn_blocking(move || spool.push(&topic, &text)).await;
        self.metrics.spooled_results.set(self.spool.len() as i64);
        match stored {
            Ok(Ok(None)) => {}
            Ok(Ok(Some(dropped))) => warn!(
                topic = dropped.topic,
                "result spool full: the oldest undelivered message was discarded"
            ),
            Ok(Err(e)) => warn!(%e, "cannot spool a result; it is lost"),
            Err(e) => warn!(%e, "spool write aborted"),
        }
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

/// Running averages and maxima for the `aggregated` part of task metrics.
#[derive(Debug, Default)]
struct Summary {
    samples: u64,
    cpu_sum: f64,
    cpu_samples: u64,
    cpu_max: f64,
    memory_sum: f64,
    memory_max: f64,
}

impl Summary {
    fn add(&mut self, cpu: Option<f64>, memory: Option<u64>) {
        self.samples += 1;
        if let Some(c) = cpu {
            self.cpu_sum += c;
            self.cpu_samples += 1;
            self.cpu_max = self.cpu_max.max(c);
        }
        if let Some(m) = memory {
            self.memory_sum += m as f64;
            self.memory_max = self.memory_max.max(m as f64);
        }
    }

    fn to_aggregated(&self) -> AggregatedMetrics {
        AggregatedMetrics {
            avg_cpu_usage: (self.cpu_samples > 0).then(|| self.cpu_sum / self.cpu_samples as f64),
            max_cpu_usage: (self.cpu_samples > 0).then_some(self.cpu_max),
            avg_memory_usage: (self.samples > 0).then(|| self.memory_sum / self.samples as f64),
            max_memory_usage: (self.samples > 0).then_some(self.memory_max),
            total_disk_read: None,
            total_disk_write: None,
            sample_count: Some(self.samples),
        }
    }
}

/// CPU seconds (user + system) consumed by one thread of this process (Linux).
fn thread_cpu_seconds(thread_id: u32) -> Option<f64> {
    cpu_seconds(&format!("/proc/self/task/{thread_id}/stat")).map(|(user, system)| user + system)
}

/// Why a start request cannot run, checked before anything is fetched.
fn start_problem(request: &StartRequest) -> Option<String> {
    if request.name.trim().is_empty() {
        return Some("the start request has an empty `name`".into());
    }
    if request.encrypted {
        return Some("encrypted (TEE) tasks are not supported by this proplet".into());
    }
    let has_file = request.file.as_ref().is_some_and(|f| !f.is_empty());
    let has_image = request.image_url.as_ref().is_some_and(|u| !u.is_empty());
    if !has_file && !has_image {
        return Some("the start request carries neither `file` nor `image_url`".into());
    }
    None
}

fn split(outcome: Result<String, String>) -> (String, Option<String>) {
    match outcome {
        Ok(output) => (output, None),
        Err(error) => (String::new(), Some(error)),
    }
}

fn qos(level: u8) -> QoS {
    match level {
        0 => QoS::AtMostOnce,
        1 => QoS::AtLeastOnce,
        _ => QoS::ExactlyOnce,
    }
}

/// Which broker the event loop is pointed at, and the options of each.
struct Rotation<'a> {
    brokers: &'a [BrokerAddress],
    options: &'a [MqttOptions],
    current: usize,
}

impl<'a> Rotation<'a> {
    /// Starts at the broker `initial` (the event loop's options) connects to; the first when
    /// none matches.
    fn new(
        brokers: &'a [BrokerAddress],
        options: &'a [MqttOptions],
        initial: &MqttOptions,
    ) -> Self {
        let current = options
            .iter()
            .position(|o| o.broker_address() == initial.broker_address())
            .unwrap_or(0);
        Self {
            brokers,
            options,
            current,
        }
    }

    fn current(&self) -> &'a BrokerAddress {
        &self.brokers[self.current]
    }

    /// Points `eventloop` at the next broker, round-robin, and returns it; `None` (and the
    /// event loop unchanged) with a single broker.
    fn advance(&mut self, eventloop: &mut EventLoop) -> Option<&'a BrokerAddress> {
        let count = self.options.len().min(self.brokers.len());
        if count < 2 {
            return None;
        }
        self.current = (self.current + 1) % count;
        eventloop.mqtt_options = self.options[self.current].clone();
        Some(self.current())
    }
}

/// Reconnect delays: exponential from 1 s to 60 s with ±20 % jitter, so a fleet that lost
/// its broker does not reconnect in lockstep.
#[derive(Debug, Default)]
struct Backoff {
    attempt: u32,
}

impl Backoff {
    fn next_delay(&mut self) -> Duration {
        let base = Duration::from_secs(1u64 << self.attempt.min(6)).min(Duration::from_secs(60));
        self.attempt = self.attempt.saturating_add(1);
        let jitter = 0.8 + 0.4 * fastrand::f64();
        base.mul_f64(jitter)
    }

    fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let mut r = ok.clone();
        r.encrypted = true;
        assert!(start_problem(&r).is_some_and(|p| p.contains("encrypted")));
        let mut r = ok;
        r.file = None;
        assert!(start_problem(&r).is_some_and(|p| p.contains("image_url")));
    }
}
