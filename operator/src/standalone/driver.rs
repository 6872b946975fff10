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
use propeller_broker::server::{BrokerEvent, CredentialStore, EventKind, Publisher};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::proplet::Proplet;
use crate::crd::task::{Task, TaskPhase};
use crate::credentials::credential_table;
use crate::decision::federated::{
    fail_unstorable, model_config_map, model_config_map_name, model_of, observe_round,
    owned_rounds, reconcile_job as reconcile_federated, reconcile_round, FederatedObservation,
};
use crate::decision::propeller_job::{reconcile as reconcile_job, status_to_write, JobObservation};
use crate::decision::task::{awaits_job, observe_indexed, plan as plan_task, TaskSettings};
use crate::executor::{apply_task, BackendError, Dispatch, NoJobs, ObjectWriter};
use crate::k8s::proplet::{plan as plan_proplet, PropletObservations, PropletSettings};
use crate::k8s::runtime::PROPLET_FINALIZER;
use crate::metrics::ControllerMetrics;
use crate::oci::Images;
use crate::state::{lock, Concerns, DriverState};

use super::cache::ObjectCache;
use super::events::EventLog;
use super::store::{ObjectStore, StoreError};

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
/// How often a task whose start waits for its device looks again.
const DEVICE_WAIT: chrono::TimeDelta = chrono::TimeDelta::seconds(1);

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

/// Why a standalone reconcile failed; it is retried.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Applying a Task plan failed.
    #[error(transparent)]
    Task(#[from] crate::executor::TaskApplyError),
}

impl DriverError {
    /// A conditional write lost to a newer version: worth retrying at once, not after a delay.
    fn is_conflict(&self) -> bool {
        match self {
            DriverError::Store(e) => matches!(e, StoreError::Conflict { .. }),
            DriverError::Task(crate::executor::TaskApplyError::Backend(e)) => {
                matches!(e.downcast_ref(), Some(StoreError::Conflict { .. }))
            }
            DriverError::Task(_) => false,
        }
    }
}

/// The standalone reconcilers and their shared state.
pub struct Driver {
    store: ObjectStore,
    publisher: Publisher,
    settings: StandaloneSettings,
    /// In-memory state shared with the broker side.
    pub state: DriverState,
    credentials: Arc<CredentialStore>,
    metrics: Arc<ControllerMetrics>,
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
    /// Registry resolution and chunk serving, once attached.
    images: std::sync::OnceLock<Arc<Images>>,
}

/// Writes Tasks into the embedded store.
struct StoreTasks<'a> {
    store: &'a ObjectStore,
}

/// The latest version each Proplet's reconcile wrote itself. Its watch event is not a reason
/// to reconcile again: the Proplet plan already asked for its next look (the offline check,
/// a deferred flush), which halves the reconciles of heartbeating proplets. Task plans still
/// rely on seeing their own writes (the time limit is planned from the written start), so
/// Tasks are not recorded here.
#[derive(Default)]
struct OwnWrites(Mutex<HashMap<Key, u64>>);

impl OwnWrites {
    fn record(&self, kind: &str, meta: &ObjectMeta, written: &Value) {
        if let Some(version) = version_of(written).and_then(|v| v.parse().ok()) {
            lock(&self.0).insert(Key::of(kind, meta), version);
        }
    }

    /// Whether `version` is the last write the key's own reconcile made (forgotten once
    /// asked).
    fn is_own(&self, key: &Key, version: u64) -> bool {
        let mut own = lock(&self.0);
        if own.get(key) == Some(&version) {
            own.remove(key);
            return true;
        }
        false
    }
}

impl ObjectWriter for StoreTasks<'_> {
    async fn set_finalizers(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = Key::of(TASK, meta);
        let updated = self
            .store
            .set_finalizers_async(
                TASK,
                &key.namespace,
                &key.name,
                finalizers.to_vec(),
                version,
            )
            .await?;
        Ok(version_of(&updated))
    }

    async fn write_status(
        &self,
        meta: &ObjectMeta,
        _old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = Key::of(TASK, meta);
        let updated = self
            .store
            .write_status_async(TASK, &key.namespace, &key.name, new.clone(), version)
            .await?;
        Ok(version_of(&updated))
    }

    async fn set_finalizers_and_status(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        _old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = Key::of(TASK, meta);
        let updated = self
            .store
            .set_finalizers_and_status_async(
                TASK,
                &key.namespace,
                &key.name,
                finalizers.to_vec(),
                new.clone(),
                version,
            )
            .await?;
        Ok(version_of(&updated))
    }

    type Jobs = NoJobs;

    fn jobs(&self) -> Option<&NoJobs> {
        None
    }
}

fn version_of(obj: &Value) -> Option<String> {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned)
}

fn refs<K>(objects: &[Arc<K>]) -> Vec<&K> {
    objects.iter().map(Arc::as_ref).collect()
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
            publisher,
            settings,
            state: DriverState::new(),
            credentials,
            metrics,
            queue,
            queued: Mutex::new(HashSet::new()),
            events,
            cache,
            credentials_built: Mutex::new(None),
            timers: Mutex::new(HashMap::new()),
            secrets_changed: AtomicBool::new(false),
            own_writes: OwnWrites::default(),
            images: std::sync::OnceLock::new(),
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
        let _ = self.images.set(images);
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
        self.metrics.count_phases(
            proplets.iter().map(Arc::as_ref),
            tasks.iter().map(Arc::as_ref),
        );
    }

    /// Rebuilds the broker's credential table from the stored Proplets and Secrets when the
    /// Proplets changed (see [`ObjectCache::credential_epoch`]), when `force`d (a Secret
    /// changed) or when the table is older than [`CREDENTIAL_MAX_AGE`].
    pub fn refresh_credentials(&self, force: bool) {
        let epoch = self.cache.credential_epoch();
        {
            let mut built = lock(&self.credentials_built);
            let fresh =
                built.is_some_and(|(seen, at)| seen == epoch && at.elapsed() < CREDENTIAL_MAX_AGE);
            if fresh && !force {
                return;
            }
            *built = Some((epoch, Instant::now()));
        }
        let proplets: Vec<Proplet> = self
            .cache
            .proplets()
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| p.as_ref().clone())
            .collect();
        let read = |ns: &str, name: &str, key: &str| -> Option<String> {
            let secret = self.store.get(SECRET, ns, name).ok()??;
            let secret = serde_json::from_value(secret).ok()?;
            crate::credentials::secret_entry(&secret, key)
        };
        let (table, problems) = credential_table(&proplets, read);
        for problem in problems {
            warn!(proplet = %problem.proplet, "{}", problem.message);
        }
        self.credentials.replace_all(table);
    }

    /// Queues the tasks that occupy the proplet with MQTT client id `client_id`.
    fn enqueue_tasks_of(&self, client_id: &str) {
        if let Some(p) = self.cache.proplet_by_client(client_id) {
            let key = Key::of(PROPLET, &p.metadata);
            for task in self.cache.occupants(&key.namespace, &key.name) {
                self.enqueue(Key::new(TASK, &key.namespace, &task));
            }
        }
    }

    /// Records a broker event and queues the object it concerns.
    pub fn route_event(&self, event: &BrokerEvent) {
        if self.images.get().is_some_and(|i| i.handle_request(event)) {
            return;
        }
        let now = Utc::now();
        match self.state.record(event, now) {
            Concerns::Proplet(client_id) => {
                let found = self.cache.proplet_by_client(&client_id);
                match found {
                    Some(p) => {
                        let heartbeat = matches!(event.kind, EventKind::Heartbeat(_));
                        let routine = self
                            .settings
                            .proplet
                            .routine_interval(self.cache.proplet_count());
                        if !(heartbeat && self.state.heartbeat_waits(&p, &client_id, routine, now))
                        {
                            self.enqueue(Key::of(PROPLET, &p.metadata));
                        }
                    }
                    None => debug!(client = %client_id, "liveness from a client with no Proplet"),
                }
            }
            Concerns::Task(uid) => match self.cache.task_by_uid(&uid) {
                Some(t) => self.enqueue(Key::of(TASK, &t.metadata)),
                None => debug!(task = %uid, "report for a task not stored yet; it waits"),
            },
            Concerns::TasksOf(client_id) => self.enqueue_tasks_of(&client_id),
            Concerns::Rejoined(client_id) => {
                if let Some(p) = self.cache.proplet_by_client(&client_id) {
                    self.enqueue(Key::of(PROPLET, &p.metadata));
                }
                self.enqueue_tasks_of(&client_id);
            }
            Concerns::Nothing => {}
        }
    }

    /// Queues what a stored change affects besides the object itself.
    fn related(&self, key: &Key) {
        match key.kind.as_str() {
            TASK => {
                if let Some(task) = self.cache.task(&key.namespace, &key.name) {
                    for owner in task.metadata.owner_references.iter().flatten() {
                        self.enqueue(Key::new(&owner.kind, &key.namespace, &owner.name));
                    }
                    if let Some(proplet) = task
                        .status
                        .as_ref()
                        .and_then(|s| s.assigned_proplet.clone())
                    {
                        self.enqueue(Key::new(PROPLET, &key.namespace, &proplet));
                    }
                }
                for other in self.cache.dependents(&key.namespace, &key.name) {
                    self.enqueue(Key::new(TASK, &key.namespace, &other));
                }
            }
            // Rebuilt on the next credential tick: a burst of new Proplets costs one rebuild,
            // not one per Proplet.
            SECRET => self.secrets_changed.store(true, AtomicOrdering::Relaxed),
            TRAINING_ROUND => {
                if let Ok(Some(round)) =
                    self.store
                        .get_typed::<TrainingRound>(TRAINING_ROUND, &key.namespace, &key.name)
                {
                    for owner in round.metadata.owner_references.iter().flatten() {
                        self.enqueue(Key::new(&owner.kind, &key.namespace, &owner.name));
                    }
                }
            }
            _ => {}
        }
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
        let mut sweep = tokio::time::interval(self.settings.sweep.max(Duration::from_secs(1)));
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

    /// One reconcile of `key`, in a span named as kube-runtime names its own ("reconciling
    /// object"), so both drivers' logs say which object a line is about.
    #[tracing::instrument(
        name = "reconciling object",
        skip_all,
        fields(object.kind = %key.kind, object.namespace = %key.namespace, object.name = %key.name)
    )]
    async fn reconcile(self: &Arc<Self>, key: &Key) {
        let started = std::time::Instant::now();
        let now = Utc::now();
        let result = match key.kind.as_str() {
            PROPLET => self.reconcile_proplet(key, now).await,
            TASK => self.reconcile_task(key, now).await,
            // These reconcilers write through the blocking store calls, which wait for
            // redb's write lock and an `fsync`: keep that off the runtime threads.
            PROPELLER_JOB | FEDERATED_JOB | TRAINING_ROUND => {
                let (driver, key) = (Arc::clone(self), key.clone());
                let span = tracing::Span::current();
                tokio::task::spawn_blocking(move || {
                    span.in_scope(|| driver.reconcile_job(&key, now))
                })
                .await
                .unwrap_or_else(|e| {
                    Err(StoreError::Database(format!("the reconcile did not finish: {e}")).into())
                })
            }
            _ => Ok(None),
        };
        self.metrics
            .observe(&key.kind.to_lowercase(), started.elapsed(), result.is_ok());
        match result {
            Ok(Some(at)) => self.enqueue_at(key.clone(), at, now),
            Ok(None) => {}
            Err(DriverError::Store(StoreError::NotFound { .. })) => {}
            // Someone wrote the object since it was read: read it again now.
            Err(e) if e.is_conflict() => self.enqueue(key.clone()),
            Err(e) => {
                debug!(%e, kind = %key.kind, name = %key.name, "reconcile failed; retrying");
                self.enqueue_at(key.clone(), now + chrono::Duration::seconds(1), now);
            }
        }
    }

    async fn reconcile_proplet(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        // The cache holds every durable write; a write that is not durable yet makes this
        // reconcile's conditional write conflict, and it runs again at once.
        let Some(proplet) = self.cache.proplet(&key.namespace, &key.name) else {
            return Ok(None);
        };
        let client_id = proplet.client_id().to_owned();
        let map_key = format!("{}/{}", key.namespace, key.name);
        let version = proplet.metadata.resource_version.as_deref();
        let mut finalizers = proplet.metadata.finalizers.clone().unwrap_or_default();
        if proplet.metadata.deletion_timestamp.is_some() {
            self.state.liveness.forget(&client_id);
            lock(&self.state.proplet_writes).remove(&map_key);
            finalizers.retain(|f| f != PROPLET_FINALIZER);
            self.store
                .set_finalizers_async(PROPLET, &key.namespace, &key.name, finalizers, version)
                .await?;
            // The credential tick revokes its login.
            return Ok(None);
        }
        let mut version = version.map(str::to_owned);
        if !finalizers.iter().any(|f| f == PROPLET_FINALIZER) {
            finalizers.push(PROPLET_FINALIZER.to_owned());
            let updated = self
                .store
                .set_finalizers_async(
                    PROPLET,
                    &key.namespace,
                    &key.name,
                    finalizers,
                    version.as_deref(),
                )
                .await?;
            version = version_of(&updated);
        }
        let observed = PropletObservations {
            external: self.state.liveness.peek(&client_id),
            deployment: None,
            last_write: lock(&self.state.proplet_writes).get(&map_key).copied(),
            report: self.state.liveness.report(&client_id),
            task_count: i64::from(self.cache.load(&key.namespace, &key.name)),
            // The same fleet-wide budget for routine writes as in Kubernetes mode.
            fleet_size: self.cache.proplet_count(),
        };
        let plan = plan_proplet(&proplet, &observed, &self.settings.proplet, now);
        let written = proplet.status.clone().unwrap_or_default();
        if let Some(status) = plan.status.as_ref() {
            let value = serde_json::to_value(status).unwrap_or(Value::Null);
            // Batched: thousands of heartbeating proplets each write every flush interval.
            let updated = self
                .store
                .write_status_batched(
                    PROPLET,
                    &key.namespace,
                    &key.name,
                    value,
                    version.as_deref(),
                )
                .await?;
            self.own_writes.record(PROPLET, &proplet.metadata, &updated);
            self.state
                .liveness
                .clear_written(&client_id, &observed.external);
            lock(&self.state.proplet_writes).insert(map_key, now);
            let before = proplet.status.as_ref().map(|s| s.phase);
            if crate::k8s::proplet::wakes_waiting_tasks(before, status.phase) {
                for task in self.cache.tasks_in(&key.namespace) {
                    let waiting = task
                        .status
                        .as_ref()
                        .is_none_or(|s| s.phase == TaskPhase::Pending);
                    if waiting {
                        self.enqueue(Key::of(TASK, &task.metadata));
                    }
                }
            }
            if written.phase != status.phase {
                info!(proplet = %key.name, phase = %status.phase, "proplet phase");
            }
            if let Some(note) = crate::k8s::proplet::phase_change_note(before, status.phase) {
                self.events
                    .record(PROPLET, &key.namespace, &key.name, &note, now);
            }
        }
        Ok(plan.requeue_at)
    }

    async fn reconcile_task(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(cached) = self.cache.task(&key.namespace, &key.name) else {
            return Ok(None);
        };
        let task: &Task = &cached;
        let proplets = self.cache.proplets_in(&key.namespace);
        let mut observed = observe_indexed(
            task,
            |dep| self.cache.task_phase(&key.namespace, dep),
            || self.cache.dependency_graph(&key.namespace),
            &refs(&proplets),
            |p| {
                self.cache.load(
                    &key.namespace,
                    p.metadata.name.as_deref().unwrap_or_default(),
                )
            },
        );
        self.state.complete(task, &mut observed);
        if awaits_job(task, &observed) {
            observed.job = None;
        }
        let images = self.images.get();
        observed.image = images.and_then(|i| i.observe(task));
        let plan = plan_task(task, &observed, &self.settings.task, now);
        let writer = StoreTasks { store: &self.store };
        let dispatch =
            apply_task(&writer, task, &plan, &self.state.effects(&self.publisher)).await?;
        if plan.resolve_image {
            match images {
                Some(images) => images.resolve(task),
                None => {
                    warn!(task = %key.name, "an OCI imageUrl needs resolving, but no image service is attached")
                }
            }
        }
        if let Some(chosen) = &plan.chosen {
            self.state.chose(&key.namespace, chosen);
        }
        for note in &plan.notes {
            if note.warning {
                warn!(task = %key.name, reason = note.reason, "{}", note.message);
            } else {
                info!(task = %key.name, reason = note.reason, "{}", note.message);
            }
            self.events
                .record(TASK, &key.namespace, &key.name, note, now);
        }
        if let Dispatch::WaitingFor(client) = dispatch {
            debug!(task = %key.name, %client, "start held until the device is heard from");
            return Ok(Some(now + DEVICE_WAIT));
        }
        Ok(plan.requeue_at)
    }

    /// The reconcilers of the job kinds, which use the blocking store calls.
    fn reconcile_job(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        match key.kind.as_str() {
            PROPELLER_JOB => self.reconcile_propeller_job(key, now),
            FEDERATED_JOB => self.reconcile_federated_job(key, now),
            TRAINING_ROUND => self.reconcile_training_round(key, now),
            _ => Ok(None),
        }
    }

    fn reconcile_propeller_job(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(job) =
            self.store
                .get_typed::<PropellerJob>(PROPELLER_JOB, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let tasks = self.cache.tasks_in(&key.namespace);
        let observed = JobObservation::of(&job, tasks.iter().map(|t| &**t));
        let plan = reconcile_job(&job, &observed, now);
        for child in &plan.create {
            self.create_or_keep(serde_json::to_value(child).unwrap_or(Value::Null))?;
        }
        let old = job.status.clone().unwrap_or_default();
        let new = status_to_write(&old, &plan);
        self.write_status_if_changed(PROPELLER_JOB, &job.metadata, &old, &new)?;
        Ok(None)
    }

    fn create_or_keep(&self, obj: Value) -> Result<(), DriverError> {
        match self.store.create_child(obj) {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn write_status_if_changed<S: serde::Serialize + PartialEq>(
        &self,
        kind: &str,
        meta: &ObjectMeta,
        old: &S,
        new: &S,
    ) -> Result<(), DriverError> {
        if old == new {
            return Ok(());
        }
        let key = Key::of(kind, meta);
        let value = serde_json::to_value(new).unwrap_or(Value::Null);
        self.store.write_status(
            kind,
            &key.namespace,
            &key.name,
            value,
            meta.resource_version.as_deref(),
        )?;
        Ok(())
    }

    fn reconcile_federated_job(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(job) =
            self.store
                .get_typed::<FederatedJob>(FEDERATED_JOB, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let rounds: Vec<TrainingRound> = self
            .store
            .list_typed(TRAINING_ROUND, Some(&key.namespace))?;
        let mut observed = FederatedObservation {
            rounds: owned_rounds(&job, &rounds),
            ..FederatedObservation::default()
        };
        for (n, (_, reference)) in &observed.rounds {
            let Some(name) = reference.as_deref().and_then(|r| r.rsplit('/').next()) else {
                continue;
            };
            let stored = self
                .store
                .get_typed::<k8s_openapi::api::core::v1::ConfigMap>(
                    CONFIG_MAP,
                    &key.namespace,
                    name,
                )?;
            if let Some(model) = stored.as_ref().and_then(model_of) {
                observed.models.insert(*n, model);
            }
        }
        let plan = reconcile_federated(&job, &observed, now);
        if let Some(round) = &plan.create_round {
            self.create_or_keep(serde_json::to_value(round).unwrap_or(Value::Null))?;
        }
        let old = job.status.clone().unwrap_or_default();
        self.write_status_if_changed(FEDERATED_JOB, &job.metadata, &old, &plan.status)?;
        Ok(None)
    }

    fn reconcile_training_round(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(round) =
            self.store
                .get_typed::<TrainingRound>(TRAINING_ROUND, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let tasks = self.cache.tasks();
        let proplets = self.cache.proplets();
        let parent = self.store.get_typed::<FederatedJob>(
            FEDERATED_JOB,
            &key.namespace,
            &round.spec.federated_job_ref.name,
        )?;
        let model_name = model_config_map_name(&round);
        let stored = self
            .store
            .get(CONFIG_MAP, &key.namespace, &model_name)?
            .map(|_| model_name.clone());
        let observed = observe_round(
            &round,
            &refs(&tasks),
            &refs(&proplets),
            parent.as_ref(),
            stored,
        );
        let plan = reconcile_round(&round, &observed, now);
        for task in &plan.create {
            self.create_or_keep(serde_json::to_value(task).unwrap_or(Value::Null))?;
        }
        let mut status = plan.status.clone();
        if let Some(model) = &plan.persist_model {
            match model_config_map(&round, model) {
                Err(message) => {
                    fail_unstorable(&mut status, message, round.metadata.generation, now)
                }
                Ok(cm) => {
                    let mut value = serde_json::to_value(&cm).unwrap_or(Value::Null);
                    value["apiVersion"] = Value::String("v1".into());
                    value["kind"] = Value::String(CONFIG_MAP.into());
                    self.create_or_keep(value)?;
                    self.enqueue(key.clone());
                }
            }
        }
        let old = round.status.clone().unwrap_or_default();
        self.write_status_if_changed(TRAINING_ROUND, &round.metadata, &old, &status)?;
        Ok(plan.requeue_at)
    }
}
