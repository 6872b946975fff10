//! An in-memory [`Cluster`] for the shared reconciles' own unit tests: objects kept as JSON
//! by kind and name with API-server versioning (every write bumps `resourceVersion`, a write
//! from an older version is a conflict), the caches read from the same objects, and wakes
//! and notes recorded for the test to inspect. Commands go through a real embedded broker
//! on loopback.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use propeller_broker::server::{BrokerConfig, CredentialStore, EmbeddedBroker};
use serde_json::Value;

use super::executor::NoJobs;
use crate::crd::proplet::Proplet;
use crate::crd::task::{Task, TaskPhase};
use crate::decision::dag::Graph;
use crate::decision::liveness::DeploymentObservation;
use crate::decision::proplet::{PropletPlan, PropletSettings};
use crate::decision::scheduler::{SelectorView, Strategy};
use crate::decision::task::{Note, TaskSettings};
use crate::metrics::ControllerMetrics;
use crate::proplet_index::Narrowed;
use crate::state::lock;

use super::{
    Backend, BackendError, CacheReads, Cluster, ClusterScoped, Common, ObjectName, Refusal,
    Signals, Stored, Wake,
};

/// How the fake backend refuses a write.
#[derive(Debug, thiserror::Error)]
pub enum FakeError {
    /// The object changed since the version the write was based on.
    #[error("{0} changed since it was read")]
    Conflict(String),
    /// There is no such object.
    #[error("{0} not found")]
    NotFound(String),
}

/// (kind, namespace, name).
type Key = (String, String, String);

/// The objects, as JSON by kind and name.
#[derive(Default)]
struct Objects {
    by_key: Mutex<BTreeMap<Key, Value>>,
    version: AtomicU64,
}

impl Objects {
    fn key(kind: &str, meta: &ObjectMeta) -> Key {
        let name = ObjectName::from_meta(meta);
        (kind.to_owned(), name.namespace, name.name)
    }

    /// Applies `change` to the stored object, if its version is still `based_on` (none: any);
    /// the object as written.
    fn update(
        &self,
        key: Key,
        based_on: Option<&str>,
        change: impl FnOnce(&mut Value),
    ) -> Result<Value, BackendError> {
        let mut objects = lock(&self.by_key);
        let label = format!("{}/{}", key.1, key.2);
        let Some(object) = objects.get_mut(&key) else {
            return Err(Box::new(FakeError::NotFound(label)));
        };
        let current = object["metadata"]["resourceVersion"].as_str();
        if based_on.is_some_and(|v| Some(v) != current) {
            return Err(Box::new(FakeError::Conflict(label)));
        }
        change(object);
        object["metadata"]["resourceVersion"] = self.next_version().into();
        Ok(object.clone())
    }

    /// Removes the stored object if its version is still `based_on` (none: any); one
    /// already gone is no error.
    fn remove(&self, key: Key, based_on: Option<&str>) -> Result<(), BackendError> {
        let mut objects = lock(&self.by_key);
        let label = format!("{}/{}", key.1, key.2);
        let Some(object) = objects.get(&key) else {
            return Ok(());
        };
        let current = object["metadata"]["resourceVersion"].as_str();
        if based_on.is_some_and(|v| Some(v) != current) {
            return Err(Box::new(FakeError::Conflict(label)));
        }
        objects.remove(&key);
        Ok(())
    }

    fn next_version(&self) -> String {
        (self.version.fetch_add(1, Ordering::SeqCst) + 1).to_string()
    }

    fn typed<K: Stored>(&self) -> Vec<Arc<K>> {
        let kind = K::kind(&());
        lock(&self.by_key)
            .iter()
            .filter(|((k, _, _), _)| *k == kind)
            .filter_map(|(_, v)| serde_json::from_value(v.clone()).ok().map(Arc::new))
            .collect()
    }
}

fn version_of(object: &Value) -> Option<String> {
    object["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned)
}

/// An in-memory [`Cluster`] (see the module's documentation).
pub struct FakeCluster {
    common: Common,
    objects: Objects,
    /// Every wake asked for, in order.
    pub wakes: Mutex<Vec<Wake>>,
    /// Every note recorded: (object, reason).
    pub notes: Mutex<Vec<(ObjectName, String)>>,
    _broker: EmbeddedBroker,
}

impl FakeCluster {
    /// An empty cluster with its own loopback broker.
    pub async fn start() -> Self {
        let logins = Arc::new(CredentialStore::new());
        let broker = EmbeddedBroker::start(BrokerConfig::loopback(), logins.clone())
            .await
            .unwrap_or_else(|e| panic!("broker: {e}"));
        let common = Common::new(
            broker.publisher(),
            PropletSettings {
                last_seen_threshold: Duration::from_secs(30),
                status_flush_interval: Duration::from_secs(5),
                routine_writes_per_second: 20,
            },
            TaskSettings {
                strategy: Strategy::RoundRobin,
                default_timeout: Duration::from_secs(3600),
                running_write_delay: Duration::from_secs(1),
                finalizer: Default::default(),
            },
            Arc::new(ControllerMetrics::default()),
        );
        let _ = common.logins.set(logins);
        Self {
            common,
            objects: Objects::default(),
            wakes: Mutex::new(Vec::new()),
            notes: Mutex::new(Vec::new()),
            _broker: broker,
        }
    }

    /// Applies `change` to the `K` named by `meta`, conditionally on its version; the new
    /// version.
    fn write<K: Stored>(
        &self,
        meta: &ObjectMeta,
        change: impl FnOnce(&mut Value),
    ) -> Result<Option<String>, BackendError> {
        let written = self.objects.update(
            Objects::key(&K::kind(&()), meta),
            meta.resource_version.as_deref(),
            change,
        )?;
        Ok(version_of(&written))
    }

    /// Stores `object` as a user's create would (a version, a UID); what was stored.
    pub fn put<K: Stored>(&self, object: &K) -> K {
        let mut value = serde_json::to_value(object).unwrap_or(Value::Null);
        value["kind"] = K::kind(&()).as_ref().into();
        value["apiVersion"] = K::api_version(&()).as_ref().into();
        let key = Objects::key(&K::kind(&()), object.meta());
        if value["metadata"]["uid"].is_null() {
            value["metadata"]["uid"] = format!("uid-{}", key.2).into();
        }
        value["metadata"]["resourceVersion"] = self.objects.next_version().into();
        lock(&self.objects.by_key).insert(key, value.clone());
        serde_json::from_value(value).unwrap_or_else(|e| panic!("stored object: {e}"))
    }

    /// The stored object `name` of kind `K`.
    pub fn stored<K: Stored>(&self, name: &ObjectName) -> Option<K> {
        let key = (
            K::kind(&()).into_owned(),
            name.namespace.clone(),
            name.name.clone(),
        );
        let value = lock(&self.objects.by_key).get(&key).cloned()?;
        serde_json::from_value(value).ok()
    }

    /// The wakes asked for so far, taken.
    pub fn take_wakes(&self) -> Vec<Wake> {
        std::mem::take(&mut *lock(&self.wakes))
    }

    fn tasks(&self) -> Vec<Arc<Task>> {
        self.objects.typed::<Task>()
    }

    fn occupants(&self, proplet: &Proplet) -> Vec<String> {
        let name = ObjectName::of(proplet);
        self.tasks_in(&name.namespace)
            .into_iter()
            .filter(|t| {
                t.status.as_ref().is_some_and(|s| {
                    matches!(s.phase, TaskPhase::Scheduled | TaskPhase::Running)
                        && s.assigned_proplet.as_deref() == Some(name.name.as_str())
                })
            })
            .map(|t| ObjectName::of(&*t).name)
            .collect()
    }
}

impl Cluster for FakeCluster {
    type Jobs = NoJobs;

    const RESYNC: Option<Duration> = None;

    const CONFLICT_REREAD: Duration = Duration::ZERO;

    const RECONCILE_CONCURRENCY: u16 = 1;

    fn common(&self) -> &Common {
        &self.common
    }

    async fn apply_proplet(
        &self,
        proplet: &Proplet,
        plan: &PropletPlan,
    ) -> Result<(), BackendError> {
        let Some(status) = &plan.status else {
            return Ok(());
        };
        let status = serde_json::to_value(status)?;
        self.objects.update(
            Objects::key("Proplet", &proplet.metadata),
            proplet.metadata.resource_version.as_deref(),
            |o| o["status"] = status,
        )?;
        Ok(())
    }

    fn jobs(&self) -> Option<&NoJobs> {
        None
    }
}

impl Backend for FakeCluster {
    fn refusal(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Refusal> {
        match error.downcast_ref::<FakeError>()? {
            FakeError::Conflict(_) => Some(Refusal::Conflict),
            FakeError::NotFound(_) => Some(Refusal::Gone),
        }
    }

    async fn get<K: Stored>(&self, name: &ObjectName) -> Result<Option<K>, BackendError> {
        Ok(self.stored(name))
    }

    async fn get_cluster_scoped<K: ClusterScoped>(
        &self,
        _name: &str,
    ) -> Result<Option<K>, BackendError> {
        Ok(None)
    }

    async fn list<K: Stored>(&self, namespace: &str) -> Result<Vec<K>, BackendError> {
        Ok(self
            .objects
            .typed::<K>()
            .into_iter()
            .filter(|o| ObjectName::of(&**o).namespace == namespace)
            .map(|o| (*o).clone())
            .collect())
    }

    async fn create_once<K: Stored>(&self, object: &K) -> Result<(), BackendError> {
        let name = ObjectName::of(object);
        if self.stored::<K>(&name).is_none() {
            self.put(object);
        }
        Ok(())
    }

    async fn replace<K: Stored>(&self, object: &K) -> Result<(), BackendError> {
        let mut new = serde_json::to_value(object)?;
        let meta = object.meta();
        self.objects.update(
            Objects::key(&K::kind(&()), meta),
            meta.resource_version.as_deref(),
            |o| {
                new["status"] = o["status"].take();
                *o = new;
            },
        )?;
        Ok(())
    }

    async fn write_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        _old: &Value,
        new: &Value,
    ) -> Result<Option<String>, BackendError> {
        self.write::<K>(meta, |o| o["status"] = new.clone())
    }

    async fn set_finalizers<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
    ) -> Result<Option<String>, BackendError> {
        self.write::<K>(meta, |o| {
            o["metadata"]["finalizers"] = serde_json::json!(finalizers)
        })
    }

    async fn delete<K: Stored>(&self, meta: &ObjectMeta) -> Result<(), BackendError> {
        self.objects.remove(
            Objects::key(&K::kind(&()), meta),
            meta.resource_version.as_deref(),
        )
    }

    /// One write, as the embedded store's transaction.
    async fn set_finalizers_and_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        _old: &Value,
        new: &Value,
    ) -> Result<Option<String>, BackendError> {
        self.write::<K>(meta, |o| {
            o["metadata"]["finalizers"] = serde_json::json!(finalizers);
            o["status"] = new.clone();
        })
    }
}

impl CacheReads for FakeCluster {
    fn deployment_of(&self, _: &Proplet) -> Option<DeploymentObservation> {
        None
    }

    fn load_of(&self, proplet: &Proplet) -> u32 {
        u32::try_from(self.occupants(proplet).len()).unwrap_or(u32::MAX)
    }

    fn tasks_on(&self, proplet: &Proplet) -> Vec<String> {
        self.occupants(proplet)
    }

    fn fleet_size(&self) -> usize {
        self.proplets().len()
    }

    fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>> {
        self.proplets()
            .into_iter()
            .find(|p| p.client_id() == client_id)
    }

    fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>> {
        self.tasks()
            .into_iter()
            .find(|t| t.metadata.uid.as_deref() == Some(uid))
    }

    fn tasks_in(&self, namespace: &str) -> Vec<Arc<Task>> {
        self.tasks()
            .into_iter()
            .filter(|t| ObjectName::of(&**t).namespace == namespace)
            .collect()
    }

    fn proplets(&self) -> Vec<Arc<Proplet>> {
        self.objects.typed::<Proplet>()
    }

    fn dependents(&self, name: &ObjectName) -> Vec<String> {
        self.tasks_in(&name.namespace)
            .into_iter()
            .filter(|t| t.spec.depends_on.contains(&name.name))
            .map(|t| ObjectName::of(&*t).name)
            .collect()
    }

    fn proplets_in(&self, namespace: &str) -> Vec<Arc<Proplet>> {
        self.proplets()
            .into_iter()
            .filter(|p| ObjectName::of(&**p).namespace == namespace)
            .collect()
    }

    fn narrow_proplets(&self, _: &str, _: &SelectorView) -> Narrowed {
        Narrowed::Whole
    }

    fn proplet(&self, name: &ObjectName) -> Option<Arc<Proplet>> {
        self.stored::<Proplet>(name).map(Arc::new)
    }

    fn task_phase(&self, name: &ObjectName) -> Option<TaskPhase> {
        self.stored::<Task>(name)
            .map(|t| t.status.map(|s| s.phase).unwrap_or_default())
    }

    fn dependency_graph(&self, namespace: &str) -> Graph {
        self.tasks_in(namespace)
            .into_iter()
            .map(|t| (ObjectName::of(&*t).name, t.spec.depends_on.clone()))
            .collect()
    }
}

impl Signals for FakeCluster {
    fn wake(&self, wake: Wake) {
        lock(&self.wakes).push(wake);
    }

    async fn note<K: Stored>(&self, object: &K, note: &Note) {
        lock(&self.notes).push((ObjectName::of(object), note.reason.to_string()));
    }

    fn note_later<K: Stored>(&self, object: &K, note: Note) {
        lock(&self.notes).push((ObjectName::of(object), note.reason.to_string()));
    }
}
