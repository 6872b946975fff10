//! The standalone driver: the same plans as on Kubernetes, applied to the embedded store.
//!
//! One work queue of object keys feeds one reconcile loop. Keys come from store changes (a
//! watch, with related objects: a task's owner, dependents and proplet), from broker events
//! (recorded in [`DriverState`] first; the MQTT side never writes the store), from requeue
//! times the plans ask for, and from a periodic sweep of proplets.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use propeller_broker::server::{BrokerEvent, CredentialStore, Publisher};
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tracing::{debug, info, warn};

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::proplet::{Proplet, PropletPhase};
use crate::crd::task::{Task, TaskPhase};
use crate::decision::federated::{
    fail_unstorable, model_config_map, model_config_map_name, model_of, observe_round,
    owned_rounds, reconcile_job as reconcile_federated, reconcile_round, FederatedObservation,
};
use crate::decision::propeller_job::{reconcile as reconcile_job, JobObservation};
use crate::decision::task::{awaits_job, observe_caches, plan as plan_task, TaskSettings};
use crate::executor::{apply_task, BackendError, ObjectWriter};
use crate::k8s::credentials::{credential_table, RefreshGate};
use crate::k8s::proplet::{plan as plan_proplet, PropletObservations, PropletSettings};
use crate::k8s::runtime::PROPLET_FINALIZER;
use crate::metrics::ControllerMetrics;
use crate::state::{lock, Concerns, DriverState};

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
    credential_gate: RefreshGate,
}

/// Writes Tasks into the embedded store.
struct StoreTasks<'a> {
    store: &'a ObjectStore,
}

impl ObjectWriter for StoreTasks<'_> {
    async fn set_finalizers(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = Key::of(TASK, meta);
        let updated = self.store.set_finalizers(
            TASK,
            &key.namespace,
            &key.name,
            finalizers.to_vec(),
            version,
        )?;
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
        let updated =
            self.store
                .write_status(TASK, &key.namespace, &key.name, new.clone(), version)?;
        Ok(version_of(&updated))
    }

    async fn create_task_job(&self, task: &Task) -> Result<(), BackendError> {
        Err(format!(
            "task {} was assigned to a k8s proplet; those run only under Kubernetes",
            task.metadata.name.as_deref().unwrap_or_default()
        )
        .into())
    }
}

fn version_of(obj: &Value) -> Option<String> {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned)
}

fn typed<K: DeserializeOwned>(values: Vec<Value>) -> Vec<K> {
    values
        .into_iter()
        .filter_map(|v| serde_json::from_value(v).ok())
        .collect()
}

impl Driver {
    /// A driver over `store`, publishing through `publisher`; the returned receiver is the
    /// work queue [`Driver::run`] consumes.
    pub fn new(
        store: ObjectStore,
        publisher: Publisher,
        settings: StandaloneSettings,
        credentials: Arc<CredentialStore>,
        metrics: Arc<ControllerMetrics>,
        events: Arc<EventLog>,
    ) -> (Arc<Self>, UnboundedReceiver<Key>) {
        let (queue, rx) = unbounded_channel();
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
            credential_gate: RefreshGate::default(),
        });
        (driver, rx)
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

    fn enqueue_at(self: &Arc<Self>, key: Key, at: DateTime<Utc>, now: DateTime<Utc>) {
        let wait = (at - now).to_std().unwrap_or_default() + Duration::from_millis(50);
        let driver = Arc::downgrade(self);
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            if let Some(driver) = driver.upgrade() {
                driver.enqueue(key);
            }
        });
    }

    fn all<K: DeserializeOwned>(&self, kind: &str) -> Vec<K> {
        match self.store.list(kind, None) {
            Ok(values) => typed(values),
            Err(e) => {
                warn!(%e, kind, "cannot list");
                Vec::new()
            }
        }
    }

    /// Rebuilds the broker's credential table from the stored Proplets and Secrets.
    pub fn refresh_credentials(&self) {
        let stored = self.all::<Proplet>(PROPLET);
        if !self.credential_gate.due(&stored, CREDENTIAL_MAX_AGE) {
            return;
        }
        let proplets: Vec<Proplet> = stored
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let read = |ns: &str, name: &str, key: &str| -> Option<String> {
            let secret = self.store.get(SECRET, ns, name).ok()??;
            if let Some(v) = secret["stringData"][key].as_str() {
                return Some(v.to_owned());
            }
            let encoded = secret["data"][key].as_str()?;
            use base64::Engine;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .ok()?;
            String::from_utf8(bytes).ok()
        };
        let (table, problems) = credential_table(&proplets, read);
        for problem in problems {
            warn!(proplet = %problem.proplet, "{}", problem.message);
        }
        self.credentials.replace_all(table);
    }

    fn proplet_by_client(&self, client_id: &str) -> Option<Proplet> {
        self.all::<Proplet>(PROPLET)
            .into_iter()
            .find(|p| p.client_id() == client_id)
    }

    /// Records a broker event and queues the object it concerns.
    pub fn route_event(&self, event: &BrokerEvent) {
        match self.state.record(event, Utc::now()) {
            Concerns::Proplet(client_id) => {
                let found = self.proplet_by_client(&client_id);
                match found {
                    Some(p) => self.enqueue(Key::of(PROPLET, &p.metadata)),
                    None => debug!(client = %client_id, "liveness from a client with no Proplet"),
                }
            }
            Concerns::Task(uid) => {
                let found = self
                    .all::<Task>(TASK)
                    .into_iter()
                    .find(|t| t.metadata.uid.as_deref() == Some(uid.as_str()));
                match found {
                    Some(t) => self.enqueue(Key::of(TASK, &t.metadata)),
                    None => debug!(task = %uid, "report for a task not stored yet; it waits"),
                }
            }
            Concerns::TasksOf(client_id) => {
                if let Some(p) = self.proplet_by_client(&client_id) {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    for task in self.all::<Task>(TASK) {
                        if task.metadata.namespace == p.metadata.namespace
                            && crate::decision::task::occupies(&task, &name)
                        {
                            self.enqueue(Key::of(TASK, &task.metadata));
                        }
                    }
                }
            }
            Concerns::Nothing => {}
        }
    }

    /// Queues what a stored change affects besides the object itself.
    fn related(&self, key: &Key) {
        match key.kind.as_str() {
            TASK => {
                if let Ok(Some(task)) =
                    self.store
                        .get_typed::<Task>(TASK, &key.namespace, &key.name)
                {
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
                for other in self.all::<Task>(TASK) {
                    if other.metadata.namespace.as_deref() == Some(key.namespace.as_str())
                        && other.spec.depends_on.contains(&key.name)
                    {
                        self.enqueue(Key::of(TASK, &other.metadata));
                    }
                }
            }
            PROPLET => self.refresh_credentials(),
            SECRET => {
                self.credential_gate.invalidate();
                self.refresh_credentials();
            }
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

    /// Runs the reconcile loop until `shutdown` resolves.
    pub async fn run(
        self: Arc<Self>,
        mut queue: UnboundedReceiver<Key>,
        mut events: UnboundedReceiver<BrokerEvent>,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        self.refresh_credentials();
        for kind in RECONCILED {
            if let Ok(values) = self.store.list(kind, None) {
                for v in values {
                    if let Ok(meta) = serde_json::from_value::<ObjectMeta>(v["metadata"].clone()) {
                        self.enqueue(Key::of(kind, &meta));
                    }
                }
            }
        }
        let mut changes = self.store.subscribe();
        let mut sweep = tokio::time::interval(self.settings.sweep.max(Duration::from_secs(1)));
        tokio::pin!(shutdown);
        info!("standalone reconcilers running");
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                Some(key) = queue.recv() => {
                    lock(&self.queued).remove(&key);
                    self.reconcile(&key).await;
                }
                Some(event) = events.recv() => self.route_event(&event),
                change = changes.recv() => match change {
                    Ok(change) => {
                        let key = Key::new(&change.kind, &change.namespace, &change.name);
                        self.related(&key);
                        self.enqueue(key);
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                        // Missed changes: look at everything again.
                        for kind in RECONCILED {
                            for v in self.store.list(kind, None).unwrap_or_default() {
                                if let Ok(meta) = serde_json::from_value::<ObjectMeta>(v["metadata"].clone()) {
                                    self.enqueue(Key::of(kind, &meta));
                                }
                            }
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                },
                _ = sweep.tick() => {
                    for p in self.all::<Proplet>(PROPLET) {
                        self.enqueue(Key::of(PROPLET, &p.metadata));
                    }
                }
            }
        }
        info!("standalone reconcilers stopped");
    }

    async fn reconcile(self: &Arc<Self>, key: &Key) {
        let started = std::time::Instant::now();
        let now = Utc::now();
        let result = match key.kind.as_str() {
            PROPLET => self.reconcile_proplet(key, now),
            TASK => self.reconcile_task(key, now).await,
            PROPELLER_JOB => self.reconcile_propeller_job(key, now),
            FEDERATED_JOB => self.reconcile_federated_job(key, now),
            TRAINING_ROUND => self.reconcile_training_round(key, now),
            _ => Ok(None),
        };
        self.metrics
            .observe(&key.kind.to_lowercase(), started.elapsed(), result.is_ok());
        match result {
            Ok(Some(at)) => self.enqueue_at(key.clone(), at, now),
            Ok(None) => {}
            Err(DriverError::Store(StoreError::NotFound { .. })) => {}
            Err(e) => {
                debug!(%e, kind = %key.kind, name = %key.name, "reconcile failed; retrying");
                self.enqueue_at(key.clone(), now + chrono::Duration::seconds(1), now);
            }
        }
    }

    fn reconcile_proplet(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(proplet) = self
            .store
            .get_typed::<Proplet>(PROPLET, &key.namespace, &key.name)?
        else {
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
                .set_finalizers(PROPLET, &key.namespace, &key.name, finalizers, version)?;
            self.refresh_credentials();
            return Ok(None);
        }
        let mut version = version.map(str::to_owned);
        if !finalizers.iter().any(|f| f == PROPLET_FINALIZER) {
            finalizers.push(PROPLET_FINALIZER.to_owned());
            let updated = self.store.set_finalizers(
                PROPLET,
                &key.namespace,
                &key.name,
                finalizers,
                version.as_deref(),
            )?;
            version = version_of(&updated);
        }
        let observed = PropletObservations {
            external: self.state.liveness.peek(&client_id),
            deployment: None,
            last_write: lock(&self.state.proplet_writes).get(&map_key).copied(),
            report: self.state.liveness.report(&client_id),
        };
        let mut plan = plan_proplet(&proplet, &observed, &self.settings.proplet, now);
        let tasks = self.all::<Task>(TASK);
        let count = i64::from(crate::decision::task::active_tasks(&proplet, tasks.iter()));
        let written = proplet.status.clone().unwrap_or_default();
        if plan.status.is_none() && written.task_count != count {
            plan.status = Some(written.clone());
        }
        if let Some(status) = plan.status.as_mut() {
            status.task_count = count;
            let value = serde_json::to_value(&*status).unwrap_or(Value::Null);
            self.store.write_status(
                PROPLET,
                &key.namespace,
                &key.name,
                value,
                version.as_deref(),
            )?;
            self.state
                .liveness
                .clear_written(&client_id, &observed.external);
            lock(&self.state.proplet_writes).insert(map_key, now);
            if status.phase == PropletPhase::Running && written.phase != PropletPhase::Running {
                for task in tasks {
                    let waiting = task
                        .status
                        .as_ref()
                        .is_none_or(|s| s.phase == TaskPhase::Pending);
                    if task.metadata.namespace.as_deref() == Some(key.namespace.as_str()) && waiting
                    {
                        self.enqueue(Key::of(TASK, &task.metadata));
                    }
                }
            }
            if written.phase != status.phase {
                info!(proplet = %key.name, phase = %status.phase, "proplet phase");
                let note = crate::decision::task::Note {
                    warning: status.phase == PropletPhase::Offline,
                    reason: "PhaseChanged",
                    message: format!("proplet is now {}", status.phase),
                };
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
        let Some(task) = self
            .store
            .get_typed::<Task>(TASK, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let tasks = self.all::<Task>(TASK);
        let proplets = self.all::<Proplet>(PROPLET);
        let task_refs: Vec<&Task> = tasks.iter().collect();
        let proplet_refs: Vec<&Proplet> = proplets.iter().collect();
        let mut observed = observe_caches(&task, &task_refs, &proplet_refs);
        self.state.complete(&task, &mut observed);
        if awaits_job(&task, &observed) {
            observed.job = None;
        }
        let plan = plan_task(&task, &observed, &self.settings.task, now);
        let writer = StoreTasks { store: &self.store };
        apply_task(&writer, &task, &plan, &self.state.effects(&self.publisher)).await?;
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
        Ok(plan.requeue_at)
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
        let uid = job.metadata.uid.clone().unwrap_or_default();
        let tasks: Vec<Task> = self
            .all::<Task>(TASK)
            .into_iter()
            .filter(|t| t.metadata.namespace.as_deref() == Some(key.namespace.as_str()))
            .collect();
        let phase = |t: &Task| t.status.as_ref().map(|s| s.phase).unwrap_or_default();
        let observed = JobObservation {
            children: tasks
                .iter()
                .filter(|t| {
                    t.metadata
                        .owner_references
                        .iter()
                        .flatten()
                        .any(|o| o.uid == uid)
                })
                .map(|t| (t.metadata.name.clone().unwrap_or_default(), phase(t)))
                .collect::<BTreeMap<_, _>>(),
            refs: job
                .spec
                .task_refs
                .iter()
                .map(|name| {
                    let found = tasks
                        .iter()
                        .find(|t| t.metadata.name.as_deref() == Some(name.as_str()))
                        .map(phase);
                    (name.clone(), found)
                })
                .collect(),
        };
        let plan = reconcile_job(&job, &observed, now);
        for child in &plan.create {
            self.create_or_keep(serde_json::to_value(child).unwrap_or(Value::Null))?;
        }
        let old = job.status.clone().unwrap_or_default();
        let mut new = plan.status.clone();
        if old.created_at.is_some() {
            new.created_at = old.created_at;
        }
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
        let tasks = self.all::<Task>(TASK);
        let proplets = self.all::<Proplet>(PROPLET);
        let task_refs: Vec<&Task> = tasks.iter().collect();
        let proplet_refs: Vec<&Proplet> = proplets.iter().collect();
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
        let observed = observe_round(&round, &task_refs, &proplet_refs, parent.as_ref(), stored);
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
