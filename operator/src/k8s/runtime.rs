//! The Kubernetes driver at run time: a kube-rs `Controller` per kind, the broker's events
//! turned into wakes, and the state the reconcilers share.
//!
//! The MQTT side never calls the API server. The event router records what a device said
//! (liveness, results, metrics) in in-memory stores and names the object whose reconcile
//! should run; the reconcile reads the stores, plans, writes, and only then forgets what it
//! wrote. A result for a Task the cache does not know yet waits in the inbox until the Task
//! appears, when its own watch event reconciles it.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::Secret;
use kube::core::PartialObjectMeta;
use kube::runtime::controller::Controller;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::Client;
use propeller_broker::server::{BrokerEvent, CredentialStore, Publisher};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::{info, warn};

use crate::controller::ownership::Ownership;
use crate::crd::job::PropellerJob;
use crate::crd::kueue::Workload;
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::decision::liveness::DeploymentObservation;
use crate::decision::propeller_job::JOB_LABEL;
use crate::decision::task::TaskSettings;
use crate::proplet_index::SharedPropletIndex;
use crate::task_index::SharedTaskIndex;
use crate::task_logs::LogStore;

use super::sharded_watch::Watches;
use crate::controller::kinds::{for_each_kind, wake_queues};
use crate::controller::{ObjectName, CREDENTIAL_TICK};
use controllers::{controller_of, wake_owners, Controllers, Prepared};

use super::deployment::PROPLET_LABEL;
use crate::credentials::{changes_credentials, RefreshGate};
use crate::decision::proplet::PropletSettings;
use crate::metrics::ControllerMetrics;
use crate::oci::Images;

mod cluster;
mod controllers;
mod deletions;
mod routing;
mod shared;

pub use super::task_job::KubeJobs;
pub use routing::{count_phases, prune_echoes, route_event, route_events, wake_overdue};
pub use shared::{Caches, Shared};

pub use crate::controller::proplet::PROPLET_FINALIZER;
pub use crate::controller::ReconcileError;

/// How often an object is looked at again with no event at all.
pub const RESYNC: Duration = Duration::from_secs(300);
/// How long the controllers may finish their reconciles after the stop signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Settings of the Kubernetes driver.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Watch only this namespace; every namespace when `None`.
    pub watch_namespace: Option<String>,
    /// Where bootstrap token Secrets are kept (a namespace the Secret watch covers).
    pub token_namespace: String,
    /// Kueue admits the PropellerJobs labelled with a queue name (their Workloads are
    /// watched).
    pub kueue: bool,
    /// Proplet plan settings.
    pub proplet: PropletSettings,
    /// Task plan settings.
    pub task: TaskSettings,
    /// Where the lines tasks print are kept (the log endpoint reads the same).
    pub logs: Arc<LogStore>,
}

/// The readiness figures of a proplet's Deployment.
pub fn observe_deployment(d: &Deployment) -> DeploymentObservation {
    let status = d.status.clone().unwrap_or_default();
    let condition = |type_: &str| {
        status
            .conditions
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.type_ == type_))
            .map(|c| c.status == "True")
    };
    DeploymentObservation {
        exists: true,
        desired: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
        replicas: status.replicas.unwrap_or(0),
        ready: status.ready_replicas.unwrap_or(0),
        available: status.available_replicas.unwrap_or(0),
        available_condition: condition("Available"),
        stalled: condition("Progressing") == Some(false),
    }
}

/// The settings of every `Controller` of this driver.
fn bounded() -> kube::runtime::controller::Config {
    crate::controller::controller_config::<Shared>()
}

/// Everything `run` needs from the caller.
pub struct Runtime {
    /// API client.
    pub client: Client,
    /// Driver settings.
    pub settings: Settings,
    /// The embedded broker's publisher.
    pub publisher: Publisher,
    /// The embedded broker's events.
    pub events: UnboundedReceiver<BrokerEvent>,
    /// The credential store the broker consults for proplets.
    pub credentials: Arc<CredentialStore>,
    /// Reconcile counters.
    pub metrics: Arc<ControllerMetrics>,
    /// Name reported on Events.
    pub reporter: String,
    /// How often every proplet is re-evaluated without events (the liveliness interval).
    pub resync: Duration,
    /// Registry resolution and chunk serving.
    pub images: Option<Arc<Images>>,
    /// This replica's share of the objects when several replicas are active; `None`: it
    /// reconciles every object (alone, or as the leader).
    pub shard: Option<Arc<Ownership>>,
    /// With sharded watches (and `shard` sharing by namespace): the client whose lists and
    /// watches carry this replica's `shardSelector` ([`super::sharded_watch`]).
    pub sharded_watches: Option<Client>,
}

/// The Proplet watch through its cache (`writer`, read by `cached`), counting on `gate`
/// each change that alters the credential table once the cache shows it.
fn credential_changes(
    events: impl futures::Stream<Item = Result<watcher::Event<Proplet>, watcher::Error>>
        + Send
        + 'static,
    cached: Store<Proplet>,
    writer: reflector::store::Writer<Proplet>,
    gate: Arc<RefreshGate>,
    index: SharedPropletIndex,
) -> impl futures::Stream<Item = Result<Proplet, watcher::Error>> + Send + 'static {
    let changed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let noted = changed.clone();
    events
        // Before the cache takes the event: it still holds the previous version.
        .inspect(move |event| {
            let alters = match event {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                    let old = cached.get(&ObjectRef::from_obj(p));
                    changes_credentials(old.as_deref(), p)
                }
                Ok(watcher::Event::Delete(_) | watcher::Event::InitDone) => true,
                Ok(watcher::Event::Init) | Err(_) => false,
            };
            if alters {
                noted.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        })
        .reflect(writer)
        // Right after the cache, as the Task index follows the Task watch.
        .inspect(move |event| {
            if let Ok(event) = event {
                index.apply(event);
            }
            if changed.swap(false, std::sync::atomic::Ordering::SeqCst) {
                gate.invalidate();
            }
        })
        .applied_objects()
}

/// Runs the Proplet and Task controllers and the event router until `shutdown` resolves.
pub async fn run(
    rt: Runtime,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + Clone + 'static,
) {
    let ns = rt.settings.watch_namespace.clone();
    let client = rt.client.clone();
    // Proplets and Secrets are watched whole even with sharded watches: every replica
    // authenticates and routes every device. What only a namespace's owner reads (its Tasks,
    // their Jobs, and every other listed kind) comes from its share.
    let share = rt.sharded_watches.clone().zip(rt.shard.clone());
    let watches = Watches::new(client.clone(), ns.clone(), share);
    let (deployment_reader, deployment_writer) = reflector::store::<Deployment>();
    let deployment_stream = reflector::reflector(
        deployment_writer,
        watches.whole(watcher::Config::default().labels(PROPLET_LABEL)),
    )
    .applied_objects()
    .default_backoff();
    // Proplet keys come from a watched Secret cache: reading each Secret whenever the
    // Proplet set changed cost N GETs per new Proplet.
    let (secret_reader, secret_writer) = reflector::store::<Secret>();
    let secret_stream = reflector::reflector(
        secret_writer,
        watches.whole::<Secret>(watcher::Config::default()),
    )
    .default_backoff();
    let credential_gate = Arc::new(RefreshGate::default());
    let (proplet_reader, proplet_writer) = reflector::store::<Proplet>();
    let proplet_index = SharedPropletIndex::default();
    let proplet_events = credential_changes(
        watches.whole::<Proplet>(watcher::Config::default()),
        proplet_reader.clone(),
        proplet_writer,
        credential_gate.clone(),
        proplet_index.clone(),
    );
    let proplet_controller = Controller::for_stream(proplet_events, proplet_reader)
        .with_config(bounded())
        .owns_stream(deployment_stream);
    // The Task watch feeds the controller's cache and, right after it, the index of the
    // Tasks by UID, proplet and dependency.
    // Deletions (also those a relist reveals) go on to `deleted` below: a quick task holds
    // no finalizer, so its run is stopped from here if it was deleted while out. A Task's
    // change wakes its owners (a PropellerJob, a TrainingRound) once the cache shows it.
    let (wakers, mut queues) = wake_queues();
    let task_index = SharedTaskIndex::default();
    let (task_reader, task_writer) = reflector::store::<Task>();
    let (deleted_tx, mut deleted_rx) = tokio::sync::mpsc::unbounded_channel::<Task>();
    let (changed_tx, mut changed_rx) = tokio::sync::mpsc::unbounded_channel::<ObjectName>();
    let task_events = {
        let index = task_index.clone();
        let wakers = wakers.clone();
        // A relist after the share changed no longer lists the namespaces that left it:
        // those Tasks were not deleted.
        let shard = rt.shard.clone();
        let in_share = move |task: &Task| {
            shard.as_ref().is_none_or(|shard| {
                shard.watches_namespace(task.metadata.namespace.as_deref().unwrap_or_default())
            })
        };
        let mut deletions = deletions::Deletions::new(task_reader.clone(), Box::new(in_share));
        reflector::reflector(
            task_writer,
            watches.share::<Task>(watcher::Config::default()),
        )
        .inspect(move |event| {
            if let Ok(event) = event {
                index.apply(event);
                wake_owners(&wakers, event);
                if let watcher::Event::Apply(task) | watcher::Event::InitApply(task) = event {
                    let _ = changed_tx.send(ObjectName::of(task));
                }
                for task in deletions.seen(event) {
                    let _ = deleted_tx.send(task);
                }
            }
        })
        .applied_objects()
    };
    // A task on a `k8s` proplet finishes when its Job does: the Job's changes (it is owned
    // by the Task) wake the Task's reconcile.
    let task_controller = Controller::for_stream(task_events, task_reader)
        .with_config(bounded())
        .owns_stream(
            watches
                .share::<PartialObjectMeta<Job>>(
                    watcher::Config::default().labels(super::task_job::TASK_LABEL),
                )
                .touched_objects(),
        );
    let caches = Caches {
        wakers: wakers.clone(),
        proplets: proplet_controller.store(),
        proplet_index,
        tasks: task_controller.store(),
        task_index,
        credential_gate,
        deployments: deployment_reader,
        secrets: secret_reader,
    };
    let token_namespace = rt.settings.token_namespace.clone();
    let kueue = rt.settings.kueue;
    let shared = Shared::new(
        client.clone(),
        rt.settings,
        rt.publisher,
        rt.credentials,
        rt.metrics,
        Some(rt.reporter),
        caches,
    );
    if let Some(images) = rt.images {
        let _ = shared.common.images.set(images);
    }
    let shard = rt.shard.clone();
    if let Some(shard) = &shard {
        let _ = shared.common.shard.set(shard.clone());
    }
    let shard = shard.as_ref();
    shared
        .common
        .kueue
        .store(kueue, std::sync::atomic::Ordering::Relaxed);
    let shared = Arc::new(shared);
    let enrolments = crate::enrolment::start(&shared, token_namespace);
    let _ = shared.common.enrolments.set(enrolments);
    if let Some(images) = shared.common.images() {
        let weak = Arc::downgrade(&shared);
        images.on_resolved(move |uid| {
            if let Some(shared) = weak.upgrade() {
                crate::controller::routing::wake_task_by_uid(&*shared, uid);
            }
        });
    }
    let router = tokio::spawn(route_events(rt.events, shared.clone()));
    let deletions = {
        let shared = shared.clone();
        tokio::spawn(async move {
            while let Some(task) = deleted_rx.recv().await {
                crate::controller::task::deleted(&*shared, &task).await;
            }
        })
    };
    // What a Task's change wakes besides itself and its owners, once the cache shows it.
    let related = {
        let shared = shared.clone();
        tokio::spawn(async move {
            while let Some(name) = changed_rx.recv().await {
                let cached = shared
                    .tasks
                    .get(&ObjectRef::new(&name.name).within(&name.namespace));
                if let Some(task) = cached {
                    crate::controller::task::wake_related(&*shared, &task);
                }
            }
        })
    };
    let secrets = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut events = std::pin::pin!(secret_stream);
            while let Some(event) = events.next().await {
                match event {
                    Ok(_) => shared.credential_gate.invalidate(),
                    Err(e) => warn!(%e, "watching Secrets"),
                }
            }
        })
    };
    let credential_tick = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CREDENTIAL_TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                shared.refresh_credentials();
                shared.common.wake_held(&*shared);
            }
        })
    };
    let gauges = {
        let shared = shared.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                count_phases(&shared);
                prune_echoes(&shared);
                let index = shared.task_index.read();
                shared
                    .common
                    .state
                    .inbox
                    .prune_unknown_reports(|uid| index.by_uid(uid).is_some());
            }
        })
    };
    let liveness_tick = {
        let shared = shared.clone();
        let every = rt.resync.max(Duration::from_secs(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                wake_overdue(&shared, Utc::now());
            }
        })
    };
    // Proplets and Tasks come with their own watches (the indexes, the credential table,
    // deletions, and their Deployments and Jobs); every other kind gets a plain one.
    let mut prepared = Prepared::default();
    prepared.add(proplet_controller);
    prepared.add(task_controller);
    if kueue {
        // A Workload's change (Kueue admitting or evicting it) reconciles its job.
        let workloads = watches
            .share::<PartialObjectMeta<Workload>>(watcher::Config::default().labels(JOB_LABEL))
            .touched_objects();
        prepared
            .add(controller_of::<PropellerJob>(&watches, wakers.clone()).owns_stream(workloads));
    }
    let mut controllers = Controllers {
        watches: &watches,
        prepared,
        queues: &mut queues,
        wakers: &wakers,
        shard,
        shared: shared.clone(),
        shutdown: shutdown.clone(),
        running: Vec::new(),
    };
    for_each_kind(&mut controllers);
    let controllers = futures::future::join_all(controllers.running);
    info!("controllers running");
    // A controller whose caches never filled (the API server unreachable since the start)
    // holds its queued work until they do, and its graceful shutdown with it: past the grace
    // period the process stops anyway, well inside a pod's termination grace period.
    let overdue = async {
        shutdown.clone().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        _ = controllers => {}
        _ = overdue => warn!(
            grace = ?SHUTDOWN_GRACE,
            "controllers still busy after the stop signal (is the API server reachable?); stopping anyway"
        ),
    }
    router.abort();
    deletions.abort();
    related.abort();
    secrets.abort();
    credential_tick.abort();
    liveness_tick.abort();
    gauges.abort();
    info!("controllers stopped");
}
