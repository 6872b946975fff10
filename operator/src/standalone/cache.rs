//! Typed in-memory copies of the stored objects the controllers reconcile, in kube-runtime
//! reflector stores (what its `Controller`s read their objects from), with the indexes the
//! standalone driver looks Proplets and Tasks up by.
//!
//! Reconciles look at many objects besides their own: a Task's scheduling reads every
//! Proplet and the tasks each runs, a heartbeat is routed by client id, a result by task UID.
//! Reading those from the database would deserialize every object on every reconcile, so
//! the driver reads them here instead. The cache is fed by a store [`Observer`], which runs
//! before a write returns: once a writer has seen its write complete, the cache has it too.
//! The indexes hold the same `Arc`s as the reflector stores, so each object is kept once.

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::runtime::reflector::store::Writer;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::controller::kinds::{for_each_kind, KindVisitor};
use crate::controller::{ObjectName, Reconciled};
use crate::crd::proplet::Proplet;
use crate::crd::task::{Task, TaskPhase};
use crate::credentials::{changes_credentials, RefreshGate};
use crate::decision::dag::Graph;
use crate::decision::scheduler::SelectorView;
use crate::proplet_index::{Narrowed, PropletIndex};
use crate::task_index::TaskIndex;

use super::kinds::{PROPLET, TASK};
use super::store::{Change, ObjectStore, StoreError};

use crate::watch_index::{name_in, Index, Name};

/// A reflector store of one kind: written here, read by a `Controller`.
struct Reflected<K: kube::Resource<DynamicType = ()> + Clone + 'static> {
    writer: Writer<K>,
    reader: Store<K>,
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Default for Reflected<K> {
    fn default() -> Self {
        let mut writer = Writer::default();
        // Filled object by object from here on: ready at once.
        writer.apply_watcher_event(&watcher::Event::InitDone);
        let reader = writer.as_reader();
        Self { writer, reader }
    }
}

impl<K: kube::Resource<DynamicType = ()> + Clone + 'static> Reflected<K> {
    /// Stores `object`; the stored `Arc`, which the reflector store shares (not a copy).
    fn put(&mut self, object: K) -> Arc<K> {
        let shared = Arc::new(object);
        self.writer.insert_shared(shared.clone());
        shared
    }

    fn remove(&mut self, (namespace, name): &Name) {
        let reference = ObjectRef::new(name).within(namespace);
        if let Some(old) = self.reader.get(&reference) {
            self.writer
                .apply_watcher_event(&watcher::Event::Delete((*old).clone()));
        }
    }
}

/// The cached Proplets and Tasks with the indexes the driver looks them up by.
#[derive(Default)]
pub struct ObjectCache {
    inner: RwLock<Cached>,
    /// Counts the Proplet changes that alter the broker's credential table.
    credential_gate: RefreshGate,
}

/// A reflector store of a kind the cache keeps no index of, whatever its type.
trait Unindexed: Send + Sync {
    /// Stores the object `value` holds (one that does not decode is left out, logged).
    fn put(&mut self, value: &Value);
    /// Drops the object `name`.
    fn remove(&mut self, name: &Name);
    /// The object `name`'s owner references, when it is cached.
    fn owners(&self, name: &Name) -> Vec<OwnerReference>;
    /// The reader, a `Store<K>`.
    fn reader(&self) -> &dyn Any;
}

impl<K: Reconciled> Unindexed for Reflected<K> {
    fn put(&mut self, value: &Value) {
        if let Some(object) = decode::<K>(value) {
            Reflected::put(self, object);
        }
    }

    fn remove(&mut self, name: &Name) {
        Reflected::remove(self, name);
    }

    fn owners(&self, (namespace, name): &Name) -> Vec<OwnerReference> {
        self.reader
            .get(&ObjectRef::new(name).within(namespace))
            .and_then(|object| object.meta().owner_references.clone())
            .unwrap_or_default()
    }

    fn reader(&self) -> &dyn Any {
        &self.reader
    }
}

/// An [`Unindexed`] store for every kind but Proplets and Tasks, which have their own.
fn unindexed_stores() -> HashMap<String, Box<dyn Unindexed>> {
    struct Stores(HashMap<String, Box<dyn Unindexed>>);
    impl KindVisitor for Stores {
        fn visit<K: Reconciled>(&mut self) {
            let kind = K::kind(&());
            if kind != PROPLET && kind != TASK {
                self.0
                    .insert(kind.into_owned(), Box::new(Reflected::<K>::default()));
            }
        }
    }
    let mut stores = Stores(HashMap::new());
    for_each_kind(&mut stores);
    stores.0
}

struct Cached {
    reflected_proplets: Reflected<Proplet>,
    reflected_tasks: Reflected<Task>,
    /// Every other kind's, by kind.
    unindexed: HashMap<String, Box<dyn Unindexed>>,
    proplets: BTreeMap<Name, Arc<Proplet>>,
    tasks: BTreeMap<Name, Arc<Task>>,
    proplet_by_client: HashMap<String, Name>,
    proplet_index: PropletIndex,
    task_index: TaskIndex,
}

fn version(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl Default for Cached {
    fn default() -> Self {
        Self {
            reflected_proplets: Reflected::default(),
            reflected_tasks: Reflected::default(),
            unindexed: unindexed_stores(),
            proplets: BTreeMap::new(),
            tasks: BTreeMap::new(),
            proplet_by_client: HashMap::new(),
            proplet_index: PropletIndex::default(),
            task_index: TaskIndex::default(),
        }
    }
}

impl Cached {
    /// Caches `proplet`; whether that changes the credential table.
    fn put_proplet(&mut self, proplet: Proplet, only_if_newer: bool) -> bool {
        let key = name_in(&proplet.metadata);
        let old = self.proplets.get(&key);
        if only_if_newer && old.is_some_and(|o| version(&o.metadata) >= version(&proplet.metadata))
        {
            return false;
        }
        let credentials_change = changes_credentials(old.map(|o| &**o), &proplet);
        if let Some(old) = old {
            self.proplet_by_client.remove(old.client_id());
        }
        self.proplet_by_client
            .insert(proplet.client_id().to_owned(), key.clone());
        self.proplet_index.put(&proplet);
        let shared = self.reflected_proplets.put(proplet);
        self.proplets.insert(key, shared);
        credentials_change
    }

    /// Drops the proplet `key`; whether it was cached (its credential goes with it).
    fn remove_proplet(&mut self, key: &Name) -> bool {
        self.reflected_proplets.remove(key);
        self.proplet_index.remove(&key.0, &key.1);
        let Some(old) = self.proplets.remove(key) else {
            return false;
        };
        if self.proplet_by_client.get(old.client_id()) == Some(key) {
            self.proplet_by_client.remove(old.client_id());
        }
        true
    }

    fn put_task(&mut self, task: Task, only_if_newer: bool) {
        let key = name_in(&task.metadata);
        if only_if_newer
            && self
                .tasks
                .get(&key)
                .is_some_and(|o| version(&o.metadata) >= version(&task.metadata))
        {
            return;
        }
        // Replaced in the reflector store by `put`, never absent from it meanwhile (a
        // Controller reading it then would drop the reconcile).
        self.task_index.put(&task);
        let shared = self.reflected_tasks.put(task);
        self.tasks.insert(key, shared);
    }

    fn remove_task(&mut self, key: &Name) {
        self.reflected_tasks.remove(key);
        self.tasks.remove(key);
        self.task_index.remove(&key.0, &key.1);
    }
}

impl Cached {
    /// Caches a stored object of a kind without an index (kinds not reconciled are not).
    fn put_other(&mut self, kind: &str, value: &Value) {
        if let Some(store) = self.unindexed.get_mut(kind) {
            store.put(value);
        }
    }

    fn remove_other(&mut self, kind: &str, key: &Name) {
        if let Some(store) = self.unindexed.get_mut(kind) {
            store.remove(key);
        }
    }
}

fn decode<K: DeserializeOwned>(object: &Value) -> Option<K> {
    match K::deserialize(object) {
        Ok(typed) => Some(typed),
        Err(e) => {
            tracing::warn!(%e, "a stored object does not match its kind; not cached");
            None
        }
    }
}

/// A read of the cache (see [`ObjectCache::view`]).
pub struct CacheView<'a>(RwLockReadGuard<'a, Cached>);

impl CacheView<'_> {
    /// Every Proplet, by namespace then name.
    pub fn proplets(&self) -> impl Iterator<Item = &Proplet> + Clone {
        self.0.proplets.values().map(|p| &**p)
    }

    /// Every Task, by namespace then name.
    pub fn tasks(&self) -> impl Iterator<Item = &Task> + Clone {
        self.0.tasks.values().map(|t| &**t)
    }
}

impl ObjectCache {
    /// A cache of `store`'s Proplets and Tasks, kept current from now on.
    pub fn attach(store: &ObjectStore) -> Result<Arc<Self>, StoreError> {
        let cache = Arc::new(Self::default());
        let weak = Arc::downgrade(&cache);
        store.observe(Arc::new(move |change, object| {
            if let Some(cache) = weak.upgrade() {
                cache.observe(change, object);
            }
        }));
        // Holding the lock while listing: changes announced meanwhile wait, then apply on
        // top; the version check keeps a listed object from replacing a newer one.
        let mut cached = cache.write();
        for value in store.list(PROPLET, None)? {
            if let Some(p) = decode::<Proplet>(&value) {
                cached.put_proplet(p, true);
            }
        }
        for value in store.list(TASK, None)? {
            if let Some(t) = decode::<Task>(&value) {
                cached.put_task(t, true);
            }
        }
        let kinds: Vec<String> = cached.unindexed.keys().cloned().collect();
        for kind in kinds {
            for value in store.list(&kind, None)? {
                cached.put_other(&kind, &value);
            }
        }
        drop(cached);
        Ok(cache)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Cached> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn read(&self) -> RwLockReadGuard<'_, Cached> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn observe(&self, change: &Change, object: Option<&Value>) {
        let key = (change.namespace.clone(), change.name.clone());
        match (change.kind.as_str(), object) {
            (PROPLET, Some(value)) => {
                let changed =
                    decode::<Proplet>(value).is_some_and(|p| self.write().put_proplet(p, false));
                // Counted once the cache shows it, so a rebuild that saw the count sees it.
                if changed {
                    self.credential_gate.invalidate();
                }
            }
            (PROPLET, None) => {
                if self.write().remove_proplet(&key) {
                    self.credential_gate.invalidate();
                }
            }
            (TASK, Some(value)) => {
                if let Some(t) = decode::<Task>(value) {
                    self.write().put_task(t, false);
                }
            }
            (TASK, None) => self.write().remove_task(&key),
            (kind, Some(value)) => self.write().put_other(kind, value),
            (kind, None) => self.write().remove_other(kind, &key),
        }
    }

    /// The objects of kind `K`, as a `Controller` reads them (an empty store for a kind
    /// the cache does not keep).
    pub fn store<K: Reconciled>(&self) -> Store<K> {
        let cached = self.read();
        let indexed: [&dyn Any; 2] = [
            &cached.reflected_proplets.reader,
            &cached.reflected_tasks.reader,
        ];
        let unindexed = cached
            .unindexed
            .get(K::kind(&()).as_ref())
            .map(|store| store.reader());
        let found = indexed
            .into_iter()
            .chain(unindexed)
            .find_map(|reader| reader.downcast_ref::<Store<K>>())
            .cloned();
        found.unwrap_or_else(|| Reflected::<K>::default().reader)
    }

    /// The owner references of the cached object `name` of kind `kind` (copied, not its whole
    /// metadata: this runs for every stored change).
    pub fn owners(&self, kind: &str, name: &ObjectName) -> Vec<OwnerReference> {
        let cached = self.read();
        let key = (name.namespace.clone(), name.name.clone());
        let owners = |meta: &ObjectMeta| meta.owner_references.clone().unwrap_or_default();
        match kind {
            PROPLET => cached.proplets.get(&key).map(|p| owners(&p.metadata)),
            TASK => cached.tasks.get(&key).map(|t| owners(&t.metadata)),
            _ => cached.unindexed.get(kind).map(|store| store.owners(&key)),
        }
        .unwrap_or_default()
    }

    /// The cached Proplets and Tasks, read in place while the view is held (writers wait):
    /// for a pass over the whole fleet that copies nothing.
    pub fn view(&self) -> CacheView<'_> {
        CacheView(self.read())
    }

    /// Every Proplet, by namespace then name.
    pub fn proplets(&self) -> Vec<Arc<Proplet>> {
        self.read().proplets.values().cloned().collect()
    }

    /// How many Proplets there are.
    pub fn proplet_count(&self) -> usize {
        self.read().proplets.len()
    }

    /// Every Task, by namespace then name.
    pub fn tasks(&self) -> Vec<Arc<Task>> {
        self.read().tasks.values().cloned().collect()
    }

    /// The Proplet that logs in to the broker as `client_id`.
    pub fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>> {
        let cached = self.read();
        let key = cached.proplet_by_client.get(client_id)?;
        cached.proplets.get(key).cloned()
    }

    /// The Task with this UID.
    pub fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>> {
        let cached = self.read();
        let key = cached.task_index.by_uid(uid)?;
        cached.tasks.get(key).cloned()
    }

    /// One Proplet.
    pub fn proplet(&self, namespace: &str, name: &str) -> Option<Arc<Proplet>> {
        self.read()
            .proplets
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// One Task.
    pub fn task(&self, namespace: &str, name: &str) -> Option<Arc<Task>> {
        self.read()
            .tasks
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// The phase of Task `namespace`/`name`, if it exists.
    pub fn task_phase(&self, namespace: &str, name: &str) -> Option<TaskPhase> {
        self.read()
            .tasks
            .get(&(namespace.to_owned(), name.to_owned()))
            .map(|t| t.status.as_ref().map(|s| s.phase).unwrap_or_default())
    }

    /// The dependency graph of the Tasks in `namespace`.
    pub fn dependency_graph(&self, namespace: &str) -> Graph {
        self.read()
            .tasks
            .range((namespace.to_owned(), String::new())..)
            .take_while(|((ns, _), _)| ns == namespace)
            .map(|((_, name), t)| (name.clone(), t.spec.depends_on.clone()))
            .collect()
    }

    /// Which proplets of `namespace` `selector` can match by their labels (see
    /// [`PropletIndex::narrow`]).
    pub fn narrow_proplets(&self, namespace: &str, selector: &SelectorView) -> Narrowed {
        self.read().proplet_index.narrow(namespace, selector)
    }

    /// The Proplets of `namespace`.
    pub fn proplets_in(&self, namespace: &str) -> Vec<Arc<Proplet>> {
        self.read()
            .proplets
            .range((namespace.to_owned(), String::new())..)
            .take_while(|((ns, _), _)| ns == namespace)
            .map(|(_, p)| p.clone())
            .collect()
    }

    /// The Tasks of `namespace`.
    pub fn tasks_in(&self, namespace: &str) -> Vec<Arc<Task>> {
        self.read()
            .tasks
            .range((namespace.to_owned(), String::new())..)
            .take_while(|((ns, _), _)| ns == namespace)
            .map(|(_, t)| t.clone())
            .collect()
    }

    /// Names of the Tasks that occupy proplet `namespace`/`proplet` (scheduled or running
    /// there).
    pub fn occupants(&self, namespace: &str, proplet: &str) -> Vec<String> {
        self.read().task_index.occupants(namespace, proplet)
    }

    /// How many Tasks occupy proplet `namespace`/`proplet`.
    pub fn load(&self, namespace: &str, proplet: &str) -> u32 {
        self.read().task_index.load(namespace, proplet)
    }

    /// Names of the Tasks in `namespace` that depend on Task `name`.
    pub fn dependents(&self, namespace: &str, name: &str) -> Vec<String> {
        self.read().task_index.dependents(namespace, name)
    }

    /// Moves whenever the broker's credential table must be rebuilt: a Proplet appeared or
    /// went, started terminating, or got a new spec generation.
    pub fn credential_gate(&self) -> &RefreshGate {
        &self.credential_gate
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn proplet(name: &str, client: &str) -> Value {
        json!({"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
               "metadata": {"name": name},
               "spec": {"type": "external", "connectionConfig": {
                   "mqttAddress": "tcp://127.0.0.1:1883", "domainId": "d", "channelId": "c",
                   "clientId": client, "clientKeySecretRef": {"name": "k", "key": "key"}}}})
    }

    fn task(name: &str) -> Value {
        json!({"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
               "metadata": {"name": name},
               "spec": {"name": name, "functionName": "add", "file": "AA=="}})
    }

    #[test]
    fn follows_every_write_before_it_returns() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = ObjectStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        store
            .apply(proplet("before", "c-before"))
            .unwrap_or_else(|e| panic!("{e}"));
        let cache = ObjectCache::attach(&store).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            cache.proplet_by_client("c-before").is_some(),
            "loaded at attach"
        );
        let hour = std::time::Duration::from_secs(3600);
        assert!(cache.credential_gate().due(hour), "the first table");

        store
            .apply(proplet("after", "c-after"))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            cache
                .proplet_by_client("c-after")
                .and_then(|p| p.metadata.name.clone())
                .as_deref(),
            Some("after")
        );
        assert!(
            cache.credential_gate().due(hour),
            "a new Proplet is counted"
        );

        store
            .write_status(
                PROPLET,
                "default",
                "after",
                json!({"phase": "Running"}),
                None,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(!cache.credential_gate().due(hour), "status writes are not");

        let mut dependent = task("t2");
        dependent["spec"]["dependsOn"] = json!(["t1"]);
        store.apply(dependent).unwrap_or_else(|e| panic!("{e}"));
        let created = store.apply(task("t1")).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cache.dependents("default", "t1"), vec!["t2".to_owned()]);
        store
            .write_status(
                TASK,
                "default",
                "t1",
                json!({"phase": "running", "assignedProplet": "after"}),
                None,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cache.load("default", "after"), 1);
        assert_eq!(cache.occupants("default", "after"), vec!["t1".to_owned()]);
        assert_eq!(cache.task_phase("default", "t1"), Some(TaskPhase::Running));
        store
            .write_status(
                TASK,
                "default",
                "t1",
                json!({"phase": "completed", "assignedProplet": "after"}),
                None,
            )
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            cache.load("default", "after"),
            0,
            "a finished task frees it"
        );
        let uid = created.object["metadata"]["uid"]
            .as_str()
            .unwrap_or_default();
        assert!(cache.task_by_uid(uid).is_some());
        store
            .delete(TASK, "default", "t1")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(cache.task_by_uid(uid).is_none());
        assert!(cache.task("default", "t1").is_none());
        store
            .delete(TASK, "default", "t2")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(cache.dependents("default", "t1").is_empty());
        assert!(cache.tasks_in("default").is_empty());

        store
            .delete(PROPLET, "default", "before")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(cache.proplet_by_client("c-before").is_none());
        assert_eq!(cache.proplets().len(), 1);
    }

    #[test]
    fn a_selector_reads_the_proplets_its_labels_name_as_the_store_changes_them() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let store = ObjectStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
        let cache = ObjectCache::attach(&store).unwrap_or_else(|e| panic!("{e}"));
        let labelled = |name: &str, labels: Value| {
            let mut p = proplet(name, name);
            p["metadata"]["labels"] = labels;
            store.apply(p).unwrap_or_else(|e| panic!("{e}"));
        };
        for i in 0..20 {
            labelled(&format!("sim-{i}"), json!({"fleet": "sim"}));
        }
        labelled("w0", json!({"role": "spare"}));
        let worker = SelectorView {
            match_labels: [("role".to_owned(), "worker".to_owned())].into(),
            ..SelectorView::default()
        };
        let names = |selector: &SelectorView| -> Vec<String> {
            match cache.narrow_proplets("default", selector) {
                Narrowed::Only(names) => names,
                Narrowed::Whole => cache
                    .proplets_in("default")
                    .iter()
                    .filter_map(|p| p.metadata.name.clone())
                    .collect(),
            }
        };
        assert!(names(&worker).is_empty());
        assert_eq!(names(&SelectorView::default()).len(), 21, "no label: all");

        labelled("w0", json!({"role": "worker"}));
        assert_eq!(names(&worker), vec!["w0".to_owned()]);
        store
            .delete(PROPLET, "default", "w0")
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(names(&worker).is_empty());
    }
}
