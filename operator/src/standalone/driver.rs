//! The standalone driver: the same plans as on Kubernetes, applied to the embedded store.
//!
//! One work queue of object keys feeds up to [`MAX_CONCURRENT_RECONCILES`] reconciles at a
//! time, never two of one object at once (as kube-rs controllers run them). Keys come from
//! store changes (a watch, with related objects: a task's owner, dependents and proplet),
//! from broker events (recorded in [`DriverState`] first; the MQTT side never writes the
//! store), from requeue times the plans ask for, and from a periodic sweep of proplets.
//! Reconciles read the objects they are not about from an [`ObjectCache`], and their own
//! object from the store.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use propeller_broker::server::{BrokerEvent, CredentialStore, Publisher};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::JoinSet;
use tracing::{info, warn};

use crate::controller::Common;
use crate::crd::proplet::Proplet;
use crate::credentials::credential_table;
use crate::decision::task::TaskSettings;
use crate::k8s::proplet::PropletSettings;
use crate::metrics::ControllerMetrics;
use crate::oci::Images;
use crate::state::{lock, DriverState};

use super::cache::ObjectCache;
use super::events::EventLog;
use super::store::{ObjectStore, StoreError};

mod cluster;
mod reconcile;
mod routing;
mod writer;

use writer::*;

/// Kind names as stored.
pub const PROPLET: &str = "Proplet";
/// Kind name of Tasks.
pub const TASK: &str = "Task";
/// Kind name of PropellerJobs.
pub const PROPELLER_JOB: &str = "PropellerJob";
/// Kind name of Secrets (proplet keys).
pub const SECRET: &str = "Secret";
/// Kind name of FederatedJobs.
pub const FEDERATED_JOB: &str = "FederatedJob";
/// Kind name of TrainingRounds.
pub const TRAINING_ROUND: &str = "TrainingRound";
/// Kind name of ConfigMaps (aggregated models).
pub const CONFIG_MAP: &str = "ConfigMap";

/// Secrets are watched here, so the table only needs an age limit as a safety net.
const CREDENTIAL_MAX_AGE: Duration = Duration::from_secs(300);

/// How often Proplet and Secret changes are folded into the broker's credential table. A
/// new Proplet's device can log in at most this long after the Proplet is stored.
const CREDENTIAL_TICK: Duration = Duration::from_millis(100);

/// Reconciles in flight at once. They mostly wait for the store's group commit, so several
/// share each `fsync`.
pub const MAX_CONCURRENT_RECONCILES: usize = 64;

/// Kinds the driver reconciles.
const RECONCILED: [&str; 5] = [PROPLET, TASK, PROPELLER_JOB, FEDERATED_JOB, TRAINING_ROUND];

/// Settings of the standalone driver.
#[derive(Debug, Clone)]
pub struct StandaloneSettings {
    /// Proplet plan settings.
    pub proplet: PropletSettings,
    /// Task plan settings.
    pub task: TaskSettings,
    /// How often every proplet is looked at without events.
    pub sweep: Duration,
}

/// One object to reconcile.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Kind.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl Key {
    fn new(kind: &str, namespace: &str, name: &str) -> Self {
        Self {
            kind: kind.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    fn of(kind: &str, meta: &ObjectMeta) -> Self {
        Self::new(
            kind,
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or_default(),
        )
    }
}

/// The standalone reconcilers and their shared state.
pub struct Driver {
    store: ObjectStore,
    /// What both drivers hold alike: driver state, publisher, plan settings, counters, images.
    common: Common,
    /// How often every proplet is looked at without events.
    sweep: Duration,
    credentials: Arc<CredentialStore>,
    queue: UnboundedSender<Key>,
    queued: Mutex<HashSet<Key>>,
    events: Arc<EventLog>,
    cache: Arc<ObjectCache>,
    /// The cache's credential epoch and the time of the last rebuild.
    credentials_built: Mutex<Option<(u64, Instant)>>,
    /// The time each key's pending timer fires.
    timers: Mutex<HashMap<Key, DateTime<Utc>>>,
    /// A Secret changed since the last credential rebuild.
    secrets_changed: AtomicBool,
    own_writes: OwnWrites,
}

impl Driver {
    /// A driver over `store`, publishing through `publisher`; the returned receiver is the
    /// work queue [`Driver::run`] consumes. Fails if the store cannot be read.
    pub fn new(
        store: ObjectStore,
        publisher: Publisher,
        settings: StandaloneSettings,
        credentials: Arc<CredentialStore>,
        metrics: Arc<ControllerMetrics>,
        events: Arc<EventLog>,
    ) -> Result<(Arc<Self>, UnboundedReceiver<Key>), StoreError> {
        let (queue, rx) = unbounded_channel();
        let cache = ObjectCache::attach(&store)?;
        let driver = Arc::new(Self {
            store,
            common: Common::new(publisher, settings.proplet, settings.task, metrics),
            sweep: settings.sweep,
            credentials,
            queue,
            queued: Mutex::new(HashSet::new()),
            events,
            cache,
            credentials_built: Mutex::new(None),
            timers: Mutex::new(HashMap::new()),
            secrets_changed: AtomicBool::new(false),
            own_writes: OwnWrites::default(),
        });
        Ok((driver, rx))
    }

    /// Serves OCI images to devices and resolves Tasks' `imageUrl`s with `images`; a
    /// finished resolution queues its Task.
    pub fn attach_images(self: &Arc<Self>, images: Arc<Images>) {
        let driver = Arc::downgrade(self);
        images.on_resolved(move |uid| {
            if let Some(driver) = driver.upgrade() {
                if let Some(task) = driver.cache.task_by_uid(uid) {
                    driver.enqueue(Key::of(TASK, &task.metadata));
                }
            }
        });
        let _ = self.common.images.set(images);
    }

    /// In-memory state shared with the broker side.
    pub fn state(&self) -> &DriverState {
        &self.common.state
    }

    /// The store the driver writes.
    pub fn store(&self) -> &ObjectStore {
        &self.store
    }

    /// Asks for `key` to be reconciled (once, however often it is asked before it runs).
    pub fn enqueue(&self, key: Key) {
        if lock(&self.queued).insert(key.clone()) {
            let _ = self.queue.send(key);
        }
    }

    /// Reconciles `key` at `at`. One timer per key: a later time than one already set waits
    /// for that one (whose reconcile asks again), so a heartbeating proplet does not pile up
    /// a timer per heartbeat.
    fn enqueue_at(self: &Arc<Self>, key: Key, at: DateTime<Utc>, now: DateTime<Utc>) {
        {
            let mut timers = lock(&self.timers);
            if timers.get(&key).is_some_and(|set| *set <= at) {
                return;
            }
            timers.insert(key.clone(), at);
        }
        let wait = (at - now).to_std().unwrap_or_default() + Duration::from_millis(50);
        let driver = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            if let Some(driver) = driver.upgrade() {
                {
                    let mut timers = lock(&driver.timers);
                    if timers.get(&key) == Some(&at) {
                        timers.remove(&key);
                    }
                }
                driver.enqueue(key);
            }
        });
    }

    /// Sets the per-phase gauges of Proplets and Tasks from the cache (on each scrape).
    pub fn count_phases(&self) {
        let proplets = self.cache.proplets();
        let tasks = self.cache.tasks();
        self.common.metrics.count_phases(
            proplets.iter().map(Arc::as_ref),
            tasks.iter().map(Arc::as_ref),
        );
    }

    /// Runs the reconcilers until `shutdown` resolves, then lets the ones in flight finish.
    pub async fn run(
        self: Arc<Self>,
        mut queue: UnboundedReceiver<Key>,
        mut events: UnboundedReceiver<BrokerEvent>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        self.refresh_credentials(true);
        self.enqueue_everything();
        let mut changes = self.store.subscribe();
        let mut sweep = tokio::time::interval(self.sweep.max(Duration::from_secs(1)));
        let mut credential_tick = tokio::time::interval(CREDENTIAL_TICK);
        let mut running: JoinSet<()> = JoinSet::new();
        let mut in_flight: HashMap<tokio::task::Id, Key> = HashMap::new();
        // Keys asked for while a reconcile of theirs runs: they run again after it.
        let mut again: HashSet<Key> = HashSet::new();
        // The latest stored change of a key while its reconcile runs: it runs again after
        // unless the change was that reconcile's own last write.
        let mut changed_meanwhile: HashMap<Key, u64> = HashMap::new();
        tokio::pin!(shutdown);
        info!("standalone reconcilers running");
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(key) = queue.recv(), if running.len() < MAX_CONCURRENT_RECONCILES => {
                    lock(&self.queued).remove(&key);
                    if in_flight.values().any(|k| *k == key) {
                        again.insert(key);
                        continue;
                    }
                    let driver = self.clone();
                    let task_key = key.clone();
                    let handle = running.spawn(async move { driver.reconcile(&task_key).await });
                    in_flight.insert(handle.id(), key);
                }
                Some(done) = running.join_next_with_id() => {
                    let id = match &done {
                        Ok((id, ())) => *id,
                        Err(e) => {
                            warn!(error = %e, "a reconcile panicked");
                            e.id()
                        }
                    };
                    if let Some(key) = in_flight.remove(&id) {
                        let changed = changed_meanwhile
                            .remove(&key)
                            .is_some_and(|version| !self.own_writes.is_own(&key, version));
                        if again.remove(&key) || changed {
                            self.enqueue(key);
                        }
                    }
                }
                Some(event) = events.recv() => self.route_event(&event),
                change = changes.recv() => match change {
                    Ok(change) => {
                        let key = Key::new(&change.kind, &change.namespace, &change.name);
                        self.related(&key);
                        if in_flight.values().any(|k| *k == key) {
                            changed_meanwhile.insert(key, change.resource_version);
                        } else if !self.own_writes.is_own(&key, change.resource_version) {
                            self.enqueue(key);
                        }
                    }
                    // Missed changes: look at everything again.
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        self.enqueue_everything()
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                },
                _ = credential_tick.tick() => {
                    let secrets = self
                        .secrets_changed
                        .swap(false, AtomicOrdering::Relaxed);
                    self.refresh_credentials(secrets);
                }
                _ = sweep.tick() => {
                    for p in self.cache.proplets() {
                        self.enqueue(Key::of(PROPLET, &p.metadata));
                    }
                }
            }
        }
        while running.join_next().await.is_some() {}
        info!("standalone reconcilers stopped");
    }

    fn enqueue_everything(&self) {
        for kind in RECONCILED {
            match self.store.list(kind, None) {
                Ok(values) => {
                    for v in values {
                        if let Ok(meta) =
                            serde_json::from_value::<ObjectMeta>(v["metadata"].clone())
                        {
                            self.enqueue(Key::of(kind, &meta));
                        }
                    }
                }
                Err(e) => warn!(%e, kind, "cannot list"),
            }
        }
    }
}
