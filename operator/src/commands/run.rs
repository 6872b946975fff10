//! `propeller run`: the Kubernetes operator with the MQTT broker in the same process.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use prometheus_client::encoding::text::encode;
use prometheus_client::registry::Registry;
use propeller_broker::http::{Handler, Reply, OPENMETRICS};
use propeller_broker::protocol::parse_setting_duration;
use propeller_broker::server::CredentialStore;
use propeller_core::shard::ShardBy;
use propeller_operator::controller::ownership::Ownership;
use propeller_operator::decision::task::FinalizerTiming;
use propeller_operator::k8s::api_requests::ApiRequestsLayer;
use propeller_operator::k8s::fence::FenceLayer;
use propeller_operator::k8s::leader::{self, LeaderSettings};
use propeller_operator::k8s::membership::{self, MembershipSettings};
use propeller_operator::k8s::runtime::{self, Runtime, Settings};
use propeller_operator::k8s::sharded_watch::{
    check_api_server_filters, shard_selector_layer, ShardedWatchError,
};
use propeller_operator::metrics::ControllerMetrics;
use propeller_operator::task_logs::LogStore;
use tracing::{info, warn};

use super::broker::{watch_credentials, BrokerArgs};
use super::console_args::ConsoleArgs;
use super::device_broker::{DeviceBroker, Logins};
use super::external_args::ExternalBrokerArgs;
use super::image_args::ImageArgs;
use super::log_endpoint_args::LogEndpointArgs;
use super::logging::LogFormat;
use super::reconcile_args::ReconcileArgs;
use propeller_operator::k8s::pull_secrets::ApiPullSecrets;

/// Flags of `propeller run`; every one also reads a `PROPELLER_*` variable.
#[derive(Args, Debug)]
pub struct RunCommand {
    /// Watch only this namespace (every namespace when unset).
    #[arg(long, env = "PROPELLER_WATCH_NAMESPACE")]
    pub watch_namespace: Option<String>,
    /// Namespace of the bootstrap token Secrets devices enrol with (`propeller token`):
    /// the watched namespace, else the client's default namespace, when unset.
    #[arg(long, env = "PROPELLER_TOKEN_NAMESPACE")]
    pub token_namespace: Option<String>,
    /// Put the PropellerJobs labelled `kueue.x-k8s.io/queue-name` under Kueue: each gets a
    /// Workload and waits until Kueue admits it (needs Kueue's CRDs and RBAC on them).
    #[arg(long, env = "PROPELLER_KUEUE")]
    pub kueue: bool,
    /// Accept device reports only from this topic domain (any when unset).
    #[arg(long, env = "PROPELLER_DOMAIN_ID")]
    pub domain_id: Option<String>,
    /// Accept device reports only from this topic channel (any when unset).
    #[arg(long, env = "PROPELLER_CHANNEL_ID")]
    pub channel_id: Option<String>,
    #[command(flatten)]
    pub reconcile: ReconcileArgs,
    #[command(flatten)]
    pub log_endpoint: LogEndpointArgs,
    #[command(flatten)]
    pub console: ConsoleArgs,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "PROPELLER_METRICS_LISTEN", default_value = "0.0.0.0:8080")]
    pub metrics_listen: SocketAddr,
    /// Reconcile and accept MQTT only while holding the leader Lease.
    #[arg(long, env = "PROPELLER_LEADER_ELECT")]
    pub leader_elect: bool,
    /// Name of the leader Lease.
    #[arg(long, env = "PROPELLER_LEASE_NAME", default_value = "propeller-leader")]
    pub lease_name: String,
    /// How long the leader Lease lasts without a renewal: a standby takes over this long
    /// after the leader's last renewal (at once when it stops cleanly); the leader renews
    /// every third of it and stops acting after two thirds without a successful renewal.
    #[arg(long, env = "PROPELLER_LEASE_DURATION", default_value = "15s", value_parser = parse_setting_duration)]
    pub lease_duration: Duration,
    /// Namespace of the leader Lease and of the members' Leases (the client's default
    /// namespace when unset).
    #[arg(long, env = "PROPELLER_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Share the objects with the other replicas of the group instead of one leading: each
    /// reconciles the part it owns by rendezvous hashing, membership is a Lease per replica.
    /// Every replica must reach every device, so this needs --mqtt-broker; the member id is
    /// $HOSTNAME (the pod name).
    #[arg(
        long,
        env = "PROPELLER_SHARD",
        conflicts_with = "leader_elect",
        requires = "mqtt_broker"
    )]
    pub shard: bool,
    /// The group the replica shares the objects with (its members' Leases are named after it).
    #[arg(
        long,
        env = "PROPELLER_SHARD_GROUP",
        default_value = "propeller-member"
    )]
    pub shard_group: String,
    /// With --shard: the UID of this replica's pod (the chart sets it from the downward API).
    /// Its Lease then names the pod as its owner, and the garbage collector removes the
    /// Lease of a pod that is gone, also when the replica could not delete it itself.
    #[arg(long, env = "PROPELLER_POD_UID")]
    pub pod_uid: Option<String>,
    /// How long a member's Lease lasts without a renewal: a stopped replica's share is taken
    /// over this long after its last renewal (at once when it stops cleanly).
    #[arg(long, env = "PROPELLER_SHARD_LEASE_DURATION", default_value = "15s", value_parser = parse_setting_duration)]
    pub shard_lease_duration: Duration,
    /// With --shard: share whole namespaces, and have the API server send each replica only
    /// its namespaces' Tasks, Jobs, PropellerJobs, FederatedJobs and TrainingRounds (sharded
    /// list and watch: Kubernetes 1.36 or later with kube-apiserver's feature gate
    /// ShardedListAndWatch=true, checked at start). Proplets and Secrets are still watched
    /// whole: every replica authenticates and routes every device.
    #[arg(long, env = "PROPELLER_SHARDED_WATCHES", requires = "shard")]
    pub sharded_watches: bool,
    /// Log line format.
    #[arg(long, env = "PROPELLER_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Optional TOML file of extra MQTT clients (services); re-read when it changes.
    #[arg(long, env = "PROPELLER_CREDENTIALS")]
    pub credentials: Option<PathBuf>,
    #[command(flatten)]
    pub broker: BrokerArgs,
    #[command(flatten)]
    pub external: ExternalBrokerArgs,
    #[command(flatten)]
    pub images: ImageArgs,
}

/// What the health endpoint reports; the registry is replaced once the broker's meters exist.
#[derive(Default)]
struct Health {
    ready: AtomicBool,
    /// The external broker session's state; `None` with the embedded broker.
    broker: RwLock<Option<tokio::sync::watch::Receiver<bool>>>,
    registry: RwLock<Arc<Registry>>,
    /// The share this replica acts on (the leader's, or a sharded member's): fenced while
    /// its Lease is not renewed in time.
    acting: RwLock<Option<Arc<Ownership>>>,
}

impl Health {
    fn broker_connected(&self) -> bool {
        self.broker
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_none_or(|ready| *ready.borrow())
    }

    /// Why this replica does not act now although it leads or is a member.
    fn fence_reason(&self) -> Option<String> {
        self.acting
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|share| share.fence_reason(std::time::Instant::now()))
    }

    fn set_registry(&self, registry: Registry) {
        *self.registry.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(registry);
    }

    fn registry(&self) -> Arc<Registry> {
        self.registry
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

fn handler(health: Arc<Health>) -> Handler {
    Arc::new(move |method, path| match (method, path) {
        ("GET", "/healthz") => Reply::ok("application/json", r#"{"status":"ok"}"#),
        ("GET", "/readyz") if !health.ready.load(Ordering::Relaxed) => {
            Reply::unavailable(r#"{"status":"not leading"}"#)
        }
        ("GET", "/readyz") => match health.fence_reason() {
            Some(reason) => Reply::unavailable(
                serde_json::json!({ "status": "fenced", "reason": reason }).to_string(),
            ),
            None if !health.broker_connected() => {
                Reply::unavailable(r#"{"status":"no connection to the MQTT broker"}"#)
            }
            None => Reply::ok("application/json", r#"{"status":"ready"}"#),
        },
        ("GET", "/metrics") => {
            let mut text = String::new();
            match encode(&mut text, &health.registry()) {
                Ok(()) => Reply::ok(OPENMETRICS, text),
                Err(_) => Reply::unavailable(r#"{"status":"metrics encoding failed"}"#),
            }
        }
        _ => Reply::not_found(),
    })
}

/// Runs the operator until SIGTERM or Ctrl-C.
pub async fn run(mut cmd: RunCommand) -> anyhow::Result<()> {
    let config = kube::Config::infer()
        .await
        .context("finding the Kubernetes API (in-cluster config or kubeconfig)")?;
    let server = config.cluster_url.to_string();
    // Every client's requests are counted (propeller_apiserver_requests_total).
    let controller_metrics = Arc::new(ControllerMetrics::default());
    let counted = ApiRequestsLayer::new(controller_metrics.api_requests.clone());
    let plain_client = kube::client::ClientBuilder::try_from(config.clone())
        .with_context(|| format!("configuring the client of the Kubernetes API at {server}"))?
        .with_layer(&counted)
        .build();
    let identity = std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty());
    let shard = match (cmd.shard, &identity) {
        (false, _) => None,
        (true, None) => {
            anyhow::bail!("--shard needs a member id: set HOSTNAME (in a pod it is the pod name)")
        }
        (true, Some(me)) => {
            let shard_by = if cmd.sharded_watches {
                ShardBy::Namespace
            } else {
                ShardBy::Object
            };
            Some(Arc::new(Ownership::new(
                me,
                cmd.shard_lease_duration,
                shard_by,
            )))
        }
    };
    // With sharded watches, the lists and watches of a replica's share go through a client
    // that asks the API server for its namespaces only.
    let sharded_watches = match (&shard, cmd.sharded_watches) {
        (Some(shard), true) => Some(
            kube::client::ClientBuilder::try_from(config.clone())
                .with_context(|| {
                    format!("configuring the client of the Kubernetes API at {server}")
                })?
                .with_layer(&counted)
                .with_layer(&shard_selector_layer(shard.namespace_ranges()))
                .build(),
        ),
        _ => None,
    };
    // A sharded replica's reconciles write through the fence; its membership does not.
    // The API server's address and CA, for the console's clients that present users' tokens.
    let api_config = config.clone();
    // The leader is a share of one: its turns and its writes stop when its renewals do.
    let leader_share = cmd.leader_elect.then(|| {
        Arc::new(Ownership::new(
            identity.as_deref().unwrap_or("propeller"),
            cmd.lease_duration,
            ShardBy::Object,
        ))
    });
    let acting = shard.clone().or_else(|| leader_share.clone());
    let client = match &acting {
        Some(share) => kube::client::ClientBuilder::try_from(config)
            .with_context(|| format!("configuring the client of the Kubernetes API at {server}"))?
            .with_layer(&counted)
            .with_layer(&FenceLayer::new(share.clone()))
            .build(),
        None => plain_client.clone(),
    };
    let identity = identity.unwrap_or_else(|| "propeller".into());
    let health = Arc::new(Health::default());
    *health.acting.write().unwrap_or_else(|e| e.into_inner()) = acting.clone();
    let logins = Logins {
        proplets: Arc::new(CredentialStore::new()),
        services: CredentialStore::new(),
    };
    if let Some(path) = &cmd.credentials {
        let table = propeller_broker::server::load_credentials_file(path)?;
        logins.services.replace_all(table);
        tokio::spawn(watch_credentials(path.clone(), logins.services.clone()));
    }

    let listener = tokio::net::TcpListener::bind(cmd.metrics_listen)
        .await
        .with_context(|| format!("binding the metrics address {}", cmd.metrics_listen))?;
    let mut registry = Registry::with_prefix("propeller");
    controller_metrics.register(&mut registry);
    health.set_registry(registry);
    let http = tokio::spawn(propeller_broker::http::serve(
        listener,
        handler(health.clone()),
    ));

    let shutdown = super::signals::terminated();
    let shutdown: ShutdownFuture = Box::pin(shutdown);
    let shutdown = futures::FutureExt::shared(shutdown);

    let mut lease = None;
    if cmd.leader_elect {
        let settings = LeaderSettings {
            name: cmd.lease_name.clone(),
            namespace: cmd
                .lease_namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned()),
            identity: identity.clone(),
            lease_duration: cmd.lease_duration,
        };
        let share = leader_share.clone().context("the leader's share")?;
        // Health and metrics answer while waiting; readiness stays false. The API server
        // may not answer yet (a control plane starting, a partition): the wait says why and
        // ends at once on SIGTERM or Ctrl-C.
        let Some(held) = leader::acquire(
            plain_client.clone(),
            &server,
            &settings,
            &share,
            shutdown.clone(),
        )
        .await
        else {
            return Ok(());
        };
        lease = Some(LeaderLease {
            settings,
            held,
            share,
        });
    }
    let mut members = None;
    if let Some(shard) = &shard {
        let settings = MembershipSettings {
            group: cmd.shard_group.clone(),
            namespace: cmd
                .lease_namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned()),
            identity: identity.clone(),
            lease_duration: cmd.shard_lease_duration,
            pod_uid: cmd.pod_uid.clone().filter(|uid| !uid.is_empty()),
        };
        // Each replica keeps its own persistent session on the cluster, under the login all
        // replicas share (by default the client id they were given, not their own).
        let base = cmd.external.mqtt_client_id.clone();
        cmd.external
            .mqtt_username
            .get_or_insert_with(|| base.clone());
        cmd.external.mqtt_client_id = format!("{base}-{identity}");
        if sharded_watches.is_some()
            && !api_server_filters(&plain_client, &settings.namespace, &server, &shutdown).await?
        {
            return Ok(());
        }
        members = Some(tokio::spawn(membership::run(
            plain_client.clone(),
            settings,
            shard.clone(),
            shutdown.clone(),
        )));
    }
    let result = serve(
        cmd,
        client,
        api_config,
        health,
        controller_metrics,
        logins,
        shutdown,
        Leading {
            lease,
            shard,
            sharded_watches,
            api: plain_client,
        },
    )
    .await;
    if let Some(members) = members {
        // Leaving the group deletes this replica's Lease, so the others take over at once.
        if tokio::time::timeout(Duration::from_secs(10), members)
            .await
            .is_err()
        {
            warn!("leaving the group took over 10 s; the others take over when the Lease expires");
        }
    }
    http.abort();
    result
}

/// Whether the API server filters lists and watches by `shardSelector`, retried while it
/// cannot be asked; `Ok(false)` when `shutdown` came first, an error when it does not filter.
async fn api_server_filters(
    client: &kube::Client,
    namespace: &str,
    server: &str,
    shutdown: &futures::future::Shared<ShutdownFuture>,
) -> anyhow::Result<bool> {
    let mut delay = Duration::from_millis(500);
    loop {
        match check_api_server_filters(client, namespace, server).await {
            Ok(()) => return Ok(true),
            Err(e @ ShardedWatchError::NotFiltered { .. }) => return Err(e.into()),
            Err(e @ ShardedWatchError::Check(_)) => warn!(
                error = %propeller_operator::errors::error_chain(&e),
                retry_in = ?delay,
                "cannot check the API server's sharded watches yet"
            ),
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.clone() => return Ok(false),
        }
        delay = (delay * 2).min(Duration::from_secs(10));
    }
}

/// How this replica shares the work: as the leader (`lease`), as a member of a sharded
/// group (`shard`), or alone (neither).
struct Leading {
    lease: Option<LeaderLease>,
    shard: Option<Arc<Ownership>>,
    /// The client of the share's watches, with `--sharded-watches`.
    sharded_watches: Option<kube::Client>,
    /// The client the fence does not stop, for the leader Lease.
    api: kube::Client,
}

/// The leader Lease this replica holds, and the share of one it acts on.
struct LeaderLease {
    settings: LeaderSettings,
    held: k8s_openapi::api::coordination::v1::Lease,
    share: Arc<Ownership>,
}

type ShutdownFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

#[allow(clippy::too_many_arguments)]
async fn serve(
    cmd: RunCommand,
    client: kube::Client,
    api_config: kube::Config,
    health: Arc<Health>,
    controller_metrics: Arc<ControllerMetrics>,
    logins: Logins,
    shutdown: futures::future::Shared<ShutdownFuture>,
    leading: Leading,
) -> anyhow::Result<()> {
    let Leading {
        lease,
        shard,
        sharded_watches,
        api,
    } = leading;
    let leader = controller_metrics.leader.clone();
    let external = cmd
        .external
        .plan(cmd.domain_id.as_deref(), cmd.channel_id.as_deref())?;
    let mut broker = DeviceBroker::start(cmd.broker.to_config()?, external, &logins).await?;
    if let Some(addr) = broker.listen_addr() {
        info!(%addr, "mqtt listening");
    }
    *health.broker.write().unwrap_or_else(|e| e.into_inner()) = broker.ready();
    let images = cmd.images.images(
        &std::env::temp_dir().join("propeller-images"),
        broker.publisher(),
        Arc::new(ApiPullSecrets(client.clone())),
    )?;
    let mut registry = Registry::with_prefix("propeller");
    controller_metrics.register(&mut registry);
    broker.register(&mut registry);
    images.metrics().register(&mut registry);
    if let Some(shard) = &shard {
        shard.metrics().register(&mut registry);
    }
    health.set_registry(registry);
    let raw_events = broker
        .take_events()
        .context("broker event stream unavailable")?;
    let events = filter_events(raw_events, cmd.domain_id.clone(), cmd.channel_id.clone());
    let watch_namespace = cmd.watch_namespace.clone().filter(|s| !s.is_empty());
    let logs = Arc::new(LogStore::new(cmd.reconcile.logs()));
    if let Some(addr) = cmd.log_endpoint.start(client.clone(), logs.clone()).await? {
        info!(%addr, "task log endpoint listening (https)");
    }
    if let Some(addr) = cmd
        .console
        .start(client.clone(), api_config, logs.clone())
        .await?
    {
        info!(%addr, "web console listening (https, path /console/)");
    }
    let settings = Settings {
        token_namespace: cmd
            .token_namespace
            .clone()
            .or_else(|| watch_namespace.clone())
            .unwrap_or_else(|| client.default_namespace().to_owned()),
        watch_namespace,
        kueue: cmd.kueue,
        proplet: cmd.reconcile.proplet(),
        task: cmd.reconcile.task(FinalizerTiming::WhileRunning),
        logs,
    };
    // A sharded replica's client id names its pod: its session is never resumed.
    let session_ends_with_replica = shard.is_some();
    let rt = Runtime {
        client,
        settings,
        publisher: broker.publisher(),
        events,
        credentials: logins.proplets.clone(),
        metrics: controller_metrics,
        reporter: std::env::var("HOSTNAME").unwrap_or_else(|_| "propeller".into()),
        resync: cmd.reconcile.liveliness_interval,
        images: Some(images),
        shard: shard.or_else(|| lease.as_ref().map(|l| l.share.clone())),
        sharded_watches,
    };
    health.ready.store(true, Ordering::Relaxed);
    leader.set(1);
    // The leader Lease is renewed until the runtime has stopped acting, then released.
    let (stopped, release) = tokio::sync::oneshot::channel::<()>();
    let (lost, lost_lease) = tokio::sync::oneshot::channel::<leader::LeaderError>();
    let holding = lease.map(|l| {
        tokio::spawn(async move {
            let held = leader::hold(api, l.settings, l.share, l.held, async move {
                let _ = release.await;
            });
            if let Err(reason) = held.await {
                let _ = lost.send(reason);
            }
        })
    });
    let lost_lease = async move {
        match lost_lease.await {
            Ok(reason) => {
                warn!(%reason, "leadership lost; stopping so another replica takes over")
            }
            // Not leading by a Lease (or it was released): nothing to lose.
            Err(_) => std::future::pending::<()>().await,
        }
    };
    let stop = futures::FutureExt::shared(Box::pin(async move {
        tokio::select! {
            _ = shutdown => info!("shutting down"),
            _ = lost_lease => {}
        }
    }));
    runtime::run(rt, stop).await;
    let _ = stopped.send(());
    if let Some(holding) = holding {
        if tokio::time::timeout(Duration::from_secs(10), holding)
            .await
            .is_err()
        {
            warn!(
                "releasing the leader Lease took over 10 s; a standby takes over when it expires"
            );
        }
    }
    health.ready.store(false, Ordering::Relaxed);
    leader.set(0);
    if session_ends_with_replica {
        broker.leave().await;
    } else {
        broker.shutdown();
    }
    Ok(())
}

fn filter_events(
    mut raw: tokio::sync::mpsc::UnboundedReceiver<propeller_broker::server::BrokerEvent>,
    domain: Option<String>,
    channel: Option<String>,
) -> tokio::sync::mpsc::UnboundedReceiver<propeller_broker::server::BrokerEvent> {
    if domain.is_none() && channel.is_none() {
        return raw;
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(event) = raw.recv().await {
            let domain_ok = domain.is_none() || event.domain == domain || event.domain.is_none();
            let channel_ok =
                channel.is_none() || event.channel == channel || event.channel.is_none();
            if domain_ok && channel_ok {
                if tx.send(event).is_err() {
                    return;
                }
            } else {
                tracing::debug!(client = %event.client_id, "event outside the configured domain/channel ignored");
            }
        }
    });
    rx
}
