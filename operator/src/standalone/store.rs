//! The durable object store behind `propeller standalone`.
//!
//! Standalone mode runs the same reconcilers as the Kubernetes driver, so the store has to
//! keep the API server behaviour they depend on, not just persist JSON:
//!
//! * every committed write takes the next value of one global counter as the object's
//!   `metadata.resourceVersion`, and writes that carry a stale version are refused with
//!   [`StoreError::Conflict`] (optimistic concurrency, as reconcilers expect);
//! * `metadata.generation` moves only when the desired state (everything but `metadata` and
//!   `status`) changes, so "observedGeneration" logic works;
//! * `status` is kept apart from the desired state: [`ObjectStore::apply`] ignores it and only
//!   [`ObjectStore::write_status`] writes it;
//! * deletion honours finalizers (`metadata.deletionTimestamp` first, removal once the last
//!   finalizer is gone) and cascades to owned objects through `metadata.ownerReferences`;
//! * a write that changes nothing is not committed and produces no watch event, exactly like
//!   a no-op update on the API server, so reconcilers that rewrite an unchanged status do not
//!   trigger themselves forever;
//! * watchers get a [`Change`] after every committed write.
//!
//! Storage is [redb](https://docs.rs/redb), a pure-Rust ACID embedded database. Each
//! operation is one write transaction, and a write returns only once it is durable, so an
//! object returned by a write survives a crash or restart. Durability is a group commit:
//! transactions commit without `fsync`, and the first writer that needs durability runs one
//! `fsync`ed commit that covers every transaction before it, while the writers that arrive
//! meanwhile wait for it. Concurrent writers (reconciles running side by side, a burst of
//! API calls) thus share one `fsync` instead of queueing one each. Watchers and observers
//! hear of a change only once it is durable; plain reads may see a committed write a moment
//! before its `fsync` completes.

use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};

use redb::TableDefinition;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::{broadcast, watch};

mod change;
mod commit;
mod error;
mod key;
mod object;
mod recovery;
mod tx;

pub use change::{Applied, Change, ChangeKind, ChangeLabels, Deleted, Observer, StoreMetrics};
use commit::{GroupCommit, Inner, QueuedStatus, StatusBatch, BATCH_WINDOW, COMMIT_THREADS};
pub use error::{DocumentError, StoreError};
use key::{check_segment, Key};
use propeller_broker::private_file::{create_private_dir, restrict};
use recovery::open_database;
use tx::Tx;

/// redb's page cache (its default is 1 GiB). Reads are served by the typed cache in front of
/// the store, so redb's cache mostly keeps pages of objects that are about to be rewritten;
/// the OS page cache holds the rest of the file. At 10,000 Proplets with their Secrets a
/// 32 MiB cache filled up and was a tenth of the process's memory.
const REDB_CACHE_BYTES: usize = 8 * 1024 * 1024;

/// Objects by `Kind/namespace/name`, as JSON bytes.
const OBJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("objects");
/// Store-wide counters; holds [`VERSION_KEY`].
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Which objects name which owner: `<owner uid>\0<Kind/namespace/name>`, so a deletion's
/// cascade reads the owner's children instead of every object. An entry may outlive the
/// reference (an object that dropped an owner): the cascade checks each child it finds.
const OWNED: TableDefinition<&str, ()> = TableDefinition::new("owned");
/// Key in [`META`] set once [`OWNED`] holds every object's owners (a store written before
/// the table existed gets it built when opened).
const OWNED_BUILT_KEY: &str = "ownedIndexBuilt";
/// Key of the global resourceVersion counter in [`META`].
const VERSION_KEY: &str = "resourceVersion";
/// Key in [`META`] the durable commit writes, so that it always has something to commit.
const SYNCED_KEY: &str = "synced";

/// File name of the database inside the directory given to [`ObjectStore::open`].
pub const DB_FILE: &str = "objects.redb";

/// Namespace of objects that name none, as on the API server.
pub const DEFAULT_NAMESPACE: &str = "default";

/// How many changes a watcher may fall behind before it lags. Generous, because a lagged
/// watcher has lost events and must relist (see [`ObjectStore::subscribe`]).
pub const WATCH_CAPACITY: usize = 4096;

/// Metadata the store owns: whatever a client sends in these fields is replaced.
const SERVER_FIELDS: &[&str] = &[
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
];

/// Top-level fields that are not part of an object's desired state.
const NOT_DESIRED_STATE: &[&str] = &["apiVersion", "kind", "metadata", "status"];

/// A durable store of Kubernetes-style objects with API server semantics (see the module
/// docs). Cheap to clone and safe to share between threads and tasks: clones use the same
/// database and the same watchers. Open it once per directory and clone it; a second
/// [`ObjectStore::open`] of the same directory fails while the first is alive.
#[derive(Clone)]
pub struct ObjectStore {
    inner: Arc<Inner>,
}

impl fmt::Debug for ObjectStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ObjectStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

impl ObjectStore {
    /// Opens the store kept in `dir` (file [`DB_FILE`]), creating the directory (mode 0700)
    /// and the database (0600) if needed; an existing directory or file wider than that is
    /// narrowed. Everything committed before survives, the resourceVersion counter
    /// included.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        // The store holds every Secret, so every device key: its directory is the owner's
        // alone, and so is the file.
        create_private_dir(dir).map_err(|e| StoreError::Database(e.to_string()))?;
        let path = dir.join(DB_FILE);
        let db = open_database(&path)?;
        restrict(&path, 0o600).map_err(|e| StoreError::Database(e.to_string()))?;
        let (events, _) = broadcast::channel(WATCH_CAPACITY);
        Ok(Self {
            inner: Arc::new(Inner {
                db: RwLock::new(Some(db)),
                broken: std::sync::atomic::AtomicBool::new(false),
                path,
                events,
                observers: RwLock::new(Vec::new()),
                write_order: Mutex::new(()),
                group: Mutex::new(GroupCommit::default()),
                synced_blocking: Condvar::new(),
                synced_async: watch::Sender::new(0),
                commit_threads: tokio::sync::Semaphore::new(COMMIT_THREADS),
                batch: Mutex::new(StatusBatch::default()),
                metrics: StoreMetrics::default(),
            }),
        })
    }

    /// Path of the database file.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// Creates `obj`, or updates its desired state (`spec` and any other top-level field
    /// but `apiVersion`, `kind`, `metadata`, `status`) and its labels and annotations.
    ///
    /// On create the store sets `uid`, `creationTimestamp`, `generation: 1` and
    /// `resourceVersion`, and the namespace defaults to `default`. On update it keeps uid,
    /// creationTimestamp and status, keeps finalizers and ownerReferences unless `obj`
    /// gives them, and bumps `generation` only if the desired state changed. `status` in
    /// `obj` is ignored: only [`ObjectStore::write_status`] writes it. If `obj` carries a
    /// `metadata.resourceVersion` that is not the stored one the update is refused with
    /// [`StoreError::Conflict`] (with [`StoreError::NotFound`] if there is no object). An
    /// update that changes nothing writes nothing. A terminating object refuses changes.
    pub fn apply(&self, obj: Value) -> Result<Applied, StoreError> {
        let key = Key::of(&obj)?;
        self.write(|tx| tx.apply(&key, obj, false))
    }

    /// Applies every object like [`ObjectStore::apply`], all in one transaction: either all
    /// are stored or, on the first error, none.
    pub fn apply_all(&self, objs: Vec<Value>) -> Result<Vec<Applied>, DocumentError> {
        let keys = document_keys(&objs)?;
        let failed_at = AtomicUsize::new(0);
        self.write(|tx| apply_each(tx, keys, objs, &failed_at))
            .map_err(|e| DocumentError::at(failed_at.load(Ordering::Relaxed), e))
    }

    /// [`ObjectStore::apply_all`] for async callers (see [`ObjectStore::write_async`]).
    pub async fn apply_all_async(&self, objs: Vec<Value>) -> Result<Vec<Applied>, DocumentError> {
        let keys = document_keys(&objs)?;
        let failed_at = Arc::new(AtomicUsize::new(0));
        let at = failed_at.clone();
        self.write_async(move |tx| apply_each(tx, keys, objs, &at))
            .await
            .map_err(|e| DocumentError::at(failed_at.load(Ordering::Relaxed), e))
    }

    /// Creates `obj` like [`ObjectStore::apply`] does, but fails with
    /// [`StoreError::AlreadyExists`] if it exists. Reconcilers create children this way and
    /// take AlreadyExists as "done", as with the API server.
    pub fn create_child(&self, obj: Value) -> Result<Value, StoreError> {
        let key = Key::of(&obj)?;
        self.write(|tx| tx.apply(&key, obj, true))
            .map(|applied| applied.object)
    }

    /// [`ObjectStore::create_child`] for async callers (see
    /// [`ObjectStore::write_status_async`]).
    pub async fn create_child_async(&self, obj: Value) -> Result<Value, StoreError> {
        let key = Key::of(&obj)?;
        self.write_async(move |tx| tx.apply(&key, obj, true))
            .await
            .map(|applied| applied.object)
    }

    /// The object `kind` `namespace`/`name`, if it exists.
    pub fn get(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        let txn = self.begin_read()?;
        let table = txn.open_table(OBJECTS)?;
        match table.get(key.encoded().as_str())? {
            Some(bytes) => Ok(Some(serde_json::from_slice(bytes.value())?)),
            None => Ok(None),
        }
    }

    /// Every object of `kind`, in one namespace or all, sorted by namespace then name.
    pub fn list(&self, kind: &str, namespace: Option<&str>) -> Result<Vec<Value>, StoreError> {
        let found = self.scan(kind, namespace, |bytes| Ok(serde_json::from_slice(bytes)?))?;
        Ok(found.into_iter().map(|(_, _, object)| object).collect())
    }

    /// [`ObjectStore::list`] as stored: each object's namespace, name and compact JSON text,
    /// unparsed, in (namespace, name) order.
    pub fn list_text(
        &self,
        kind: &str,
        namespace: Option<&str>,
    ) -> Result<Vec<(String, String, String)>, StoreError> {
        // Written by serde_json: UTF-8.
        self.scan(kind, namespace, |bytes| {
            Ok(String::from_utf8_lossy(bytes).into_owned())
        })
    }

    /// Every object of `kind` (in `namespace`, or all) read by `read`, with its namespace and
    /// name, in (namespace, name) order.
    fn scan<T>(
        &self,
        kind: &str,
        namespace: Option<&str>,
        read: impl Fn(&[u8]) -> Result<T, StoreError>,
    ) -> Result<Vec<(String, String, T)>, StoreError> {
        check_segment("kind", kind)?;
        let prefix = match namespace {
            Some(ns) => {
                let ns = if ns.is_empty() { DEFAULT_NAMESPACE } else { ns };
                check_segment("namespace", ns)?;
                format!("{kind}/{ns}/")
            }
            None => format!("{kind}/"),
        };
        let txn = self.begin_read()?;
        let table = txn.open_table(OBJECTS)?;
        let mut found = Vec::new();
        for entry in table.range(prefix.as_str()..)? {
            let (key, bytes) = entry?;
            let key = key.value();
            if !key.starts_with(&prefix) {
                break;
            }
            let Some(key) = Key::decode(key) else {
                continue;
            };
            found.push((key.namespace, key.name, read(bytes.value())?));
        }
        // Key order puts "a-b/" before "a/"; the API server's order is by (namespace, name).
        found.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
        Ok(found)
    }

    /// [`ObjectStore::get`] deserialized into a typed resource such as
    /// [`crate::crd::Task`].
    pub fn get_typed<K: DeserializeOwned>(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<K>, StoreError> {
        match self.get(kind, namespace, name)? {
            Some(obj) => Ok(Some(serde_json::from_value(obj)?)),
            None => Ok(None),
        }
    }

    /// [`ObjectStore::list`] deserialized into typed resources.
    pub fn list_typed<K: DeserializeOwned>(
        &self,
        kind: &str,
        namespace: Option<&str>,
    ) -> Result<Vec<K>, StoreError> {
        self.list(kind, namespace)?
            .into_iter()
            .map(|obj| serde_json::from_value(obj).map_err(StoreError::from))
            .collect()
    }

    /// Replaces the status of an object (`Value::Null` removes it) and nothing else, so
    /// `generation` stays. With `expected_version`, a stale read is refused with
    /// [`StoreError::Conflict`]. Allowed on terminating objects, as cleanup reports progress.
    /// Returns the object as stored now.
    pub fn write_status(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        status: Value,
        expected_version: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        self.write(|tx| tx.write_status(&key, status, expected_version))
    }

    /// [`ObjectStore::write_status`] for async callers: waiting for durability does not hold a
    /// runtime thread, so concurrent reconciles share one `fsync`.
    pub async fn write_status_async(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        status: Value,
        expected_version: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        let expected = expected_version.map(str::to_owned);
        self.write_async(move |tx| tx.write_status(&key, status, expected.as_deref()))
            .await
    }

    /// [`ObjectStore::write_status_async`] for frequent, unhurried writers (heartbeat figures
    /// of many proplets): the write waits up to [`BATCH_WINDOW`] for others and commits in
    /// one transaction with them. Each write keeps its own outcome: a conflict or a missing
    /// object fails that write alone, before it changes anything.
    pub async fn write_status_batched(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        status: Value,
        expected_version: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        let (reply, outcome) = tokio::sync::oneshot::channel();
        let start_flusher = {
            let mut batch = lock(&self.inner.batch);
            batch.queued.push(QueuedStatus {
                key,
                status,
                expected: expected_version.map(str::to_owned),
                reply,
            });
            !std::mem::replace(&mut batch.open, true)
        };
        if start_flusher {
            // A task of its own, so that a caller that gives up does not strand the batch.
            let store = self.clone();
            tokio::spawn(async move {
                tokio::time::sleep(BATCH_WINDOW).await;
                store.flush_batch().await;
            });
        }
        let (stored, seq) = outcome.await.map_err(|_| {
            StoreError::Database("a batched status write was dropped unanswered".into())
        })??;
        self.durable(seq).await?;
        Ok(stored)
    }

    /// [`ObjectStore::set_finalizers`] for async callers (see
    /// [`ObjectStore::write_status_async`]).
    pub async fn set_finalizers_async(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        finalizers: Vec<String>,
        expected_version: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        let expected = expected_version.map(str::to_owned);
        self.write_async(move |tx| tx.set_finalizers(&key, finalizers, expected.as_deref()))
            .await
    }

    /// [`ObjectStore::set_finalizers_async`] then [`ObjectStore::write_status_async`] in one
    /// transaction (one commit for a reconcile's first write).
    pub async fn set_finalizers_and_status_async(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        finalizers: Vec<String>,
        status: Value,
        expected_version: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        let expected = expected_version.map(str::to_owned);
        self.write_async(move |tx| {
            tx.set_finalizers(&key, finalizers, expected.as_deref())?;
            tx.write_status(&key, status, None)
        })
        .await
    }

    /// Replaces the finalizers of an object. On a terminating object finalizers can only be
    /// removed, and removing the last one removes the object (and cascades to what it owns);
    /// the object's last state is returned then. With `expected_version`, a stale read is
    /// refused with [`StoreError::Conflict`].
    pub fn set_finalizers(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        finalizers: Vec<String>,
        expected_version: Option<&str>,
    ) -> Result<Value, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        self.write(|tx| tx.set_finalizers(&key, finalizers, expected_version))
    }

    /// Deletes an object. With finalizers it only gets `metadata.deletionTimestamp` and
    /// stays until they are removed ([`Deleted::Pending`]); without, it is removed
    /// ([`Deleted::Removed`]) and so is every object whose `ownerReferences` name its uid,
    /// recursively and under the same finalizer rule (background cascading deletion).
    pub fn delete(&self, kind: &str, namespace: &str, name: &str) -> Result<Deleted, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        self.write(move |tx| delete_key(tx, &key))
    }

    /// [`ObjectStore::delete`] for async callers (see [`ObjectStore::write_async`]).
    pub async fn delete_async(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Deleted, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        self.write_async(move |tx| delete_key(tx, &key)).await
    }

    /// [`ObjectStore::delete_async`] conditional on the object's resourceVersion (a newer
    /// one: a conflict).
    pub async fn delete_at_version_async(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        expected_version: Option<&str>,
    ) -> Result<Deleted, StoreError> {
        let key = Key::new(kind, namespace, name)?;
        let expected = expected_version.map(str::to_owned);
        self.write_async(move |tx| {
            let current = tx.load_existing(&key)?;
            Tx::check_version(&key, &current, expected.as_deref())?;
            tx.delete_tree(&key, current, false)
        })
        .await
    }

    /// The last resourceVersion handed out (0 for a new store).
    pub fn current_version(&self) -> Result<u64, StoreError> {
        let txn = self.begin_read()?;
        let table = txn.open_table(META)?;
        Ok(table.get(VERSION_KEY)?.map(|v| v.value()).unwrap_or(0))
    }

    /// Watches every committed change, in commit order, from now on. Only changes after
    /// this call are delivered: list first, then process changes. A receiver more than
    /// [`WATCH_CAPACITY`] changes behind gets `RecvError::Lagged`, has lost changes and must
    /// relist everything it tracks.
    pub fn subscribe(&self) -> broadcast::Receiver<Change> {
        self.inner.events.subscribe()
    }

    /// The store's counters.
    pub fn metrics(&self) -> &StoreMetrics {
        &self.inner.metrics
    }

    /// Registers `observer` for every durable change from now on (see [`Observer`]).
    pub fn observe(&self, observer: Observer) {
        self.inner
            .observers
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .push(observer);
    }
}

/// The key of every document, or the first document without a valid one.
fn document_keys(objs: &[Value]) -> Result<Vec<Key>, DocumentError> {
    objs.iter()
        .enumerate()
        .map(|(i, obj)| Key::of(obj).map_err(|e| DocumentError::at(i, e)))
        .collect()
}

/// Applies the documents in order inside one transaction, noting which one is being applied
/// so a failure can name it.
fn apply_each(
    tx: &mut Tx<'_>,
    keys: Vec<Key>,
    objs: Vec<Value>,
    failed_at: &AtomicUsize,
) -> Result<Vec<Applied>, StoreError> {
    let mut applied = Vec::with_capacity(objs.len());
    for (i, (key, obj)) in keys.iter().zip(objs).enumerate() {
        failed_at.store(i, Ordering::Relaxed);
        applied.push(tx.apply(key, obj, false)?);
    }
    Ok(applied)
}

fn delete_key(tx: &mut Tx<'_>, key: &Key) -> Result<Deleted, StoreError> {
    let current = tx.load_existing(key)?;
    tx.delete_tree(key, current, false)
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tokio::sync::broadcast::error::TryRecvError;

    fn store() -> (tempfile::TempDir, ObjectStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = ObjectStore::open(dir.path()).unwrap();
        (dir, store)
    }

    fn task(ns: &str, name: &str, spec: Value) -> Value {
        json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Task",
            "metadata": {"name": name, "namespace": ns},
            "spec": spec,
        })
    }

    fn rv(obj: &Value) -> String {
        obj["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    fn generation(obj: &Value) -> i64 {
        obj["metadata"]["generation"].as_i64().unwrap()
    }

    fn job(ns: &str, name: &str) -> Value {
        json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "PropellerJob",
            "metadata": {"name": name, "namespace": ns},
            "spec": {},
        })
    }

    fn owned_by(mut obj: Value, owner: &Value) -> Value {
        obj["metadata"]["ownerReferences"] = json!([{
            "apiVersion": owner["apiVersion"],
            "kind": owner["kind"],
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": true,
        }]);
        obj
    }

    fn drain(rx: &mut broadcast::Receiver<Change>) -> Vec<(String, String, ChangeKind)> {
        let mut out = Vec::new();
        loop {
            match rx.try_recv() {
                Ok(c) => out.push((c.kind, c.name, c.kind_of_change)),
                Err(TryRecvError::Empty) => return out,
                Err(e) => panic!("watch failed: {e}"),
            }
        }
    }

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// The store holds every device key: no other local user may reach it, whether the store
    /// is new or was left readable by an earlier version.
    #[test]
    fn the_store_is_its_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let fresh = root.path().join("data/nested");
        drop(ObjectStore::open(&fresh).unwrap());
        assert_eq!(mode(&fresh), 0o700);
        assert_eq!(mode(&fresh.join(DB_FILE)), 0o600);

        let old = root.path().join("old");
        drop(ObjectStore::open(&old).unwrap());
        let wide = |path: &Path, bits| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(bits)).unwrap()
        };
        wide(&old, 0o755);
        wide(&old.join(DB_FILE), 0o644);
        drop(ObjectStore::open(&old).unwrap());
        assert_eq!(mode(&old), 0o700);
        assert_eq!(mode(&old.join(DB_FILE)), 0o600);
    }

    #[test]
    fn create_sets_server_fields_and_drops_status() {
        let (_dir, store) = store();
        let mut obj = json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "Task",
            "metadata": {
                "name": "t1",
                "uid": "client-chosen",
                "generation": 7,
                "resourceVersion": "",
                "labels": {"app": "x"},
            },
            "spec": {"file": "add.wasm"},
            "status": {"phase": "Succeeded"},
        });
        obj["metadata"]["deletionTimestamp"] = json!("2020-01-01T00:00:00Z");
        let applied = store.apply(obj).unwrap();
        assert!(applied.created);
        let o = &applied.object;
        let m = &o["metadata"];
        assert_eq!(m["namespace"], "default");
        assert_eq!(m["generation"], 1);
        assert_eq!(m["resourceVersion"], "1");
        assert_eq!(m["labels"]["app"], "x");
        let uid = m["uid"].as_str().unwrap();
        assert_ne!(uid, "client-chosen");
        assert_eq!(uid.len(), 36, "a hyphenated UUID: {uid}");
        assert!(m.get("deletionTimestamp").is_none());
        let created = m["creationTimestamp"].as_str().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(created).is_ok());
        assert!(
            o.get("status").is_none(),
            "status of an applied object is ignored"
        );
        assert_eq!(
            store.get("Task", "default", "t1").unwrap().as_ref(),
            Some(o)
        );
        assert_eq!(store.current_version().unwrap(), 1);

        let other = store
            .apply(task("default", "t2", json!({})))
            .unwrap()
            .object;
        assert_ne!(other["metadata"]["uid"], o["metadata"]["uid"]);
        assert_eq!(rv(&other), "2");
    }

    #[test]
    fn update_bumps_generation_only_on_spec_change_and_keeps_status() {
        let (_dir, store) = store();
        let created = store
            .apply(task("iot", "t", json!({"file": "a.wasm"})))
            .unwrap()
            .object;
        let with_status = store
            .write_status("Task", "iot", "t", json!({"phase": "Running"}), None)
            .unwrap();

        // Labels only: new version, same generation, status kept.
        let mut labelled = task("iot", "t", json!({"file": "a.wasm"}));
        labelled["metadata"]["labels"] = json!({"tier": "edge"});
        labelled["status"] = json!({"phase": "Failed"});
        let a = store.apply(labelled.clone()).unwrap();
        assert!(!a.created);
        assert_eq!(generation(&a.object), 1);
        assert!(rv(&a.object).parse::<u64>().unwrap() > rv(&with_status).parse().unwrap());
        assert_eq!(a.object["status"]["phase"], "Running");
        assert_eq!(a.object["metadata"]["labels"]["tier"], "edge");
        assert_eq!(a.object["metadata"]["uid"], created["metadata"]["uid"]);
        assert_eq!(
            a.object["metadata"]["creationTimestamp"],
            created["metadata"]["creationTimestamp"]
        );

        // The same object again: nothing is written.
        let same = store.apply(labelled).unwrap();
        assert_eq!(same.object, a.object);
        assert!(!same.created);

        // Spec change: generation 2, status still kept, labels dropped as not given.
        let b = store
            .apply(task("iot", "t", json!({"file": "b.wasm"})))
            .unwrap()
            .object;
        assert_eq!(generation(&b), 2);
        assert_eq!(b["spec"]["file"], "b.wasm");
        assert_eq!(b["status"]["phase"], "Running");
        assert!(b["metadata"].get("labels").is_none());
        assert!(rv(&b).parse::<u64>().unwrap() > rv(&a.object).parse().unwrap());
    }

    #[test]
    fn apply_keeps_finalizers_and_owner_references_unless_given() {
        let (_dir, store) = store();
        store.apply(task("default", "t", json!({"x": 1}))).unwrap();
        store
            .set_finalizers("Task", "default", "t", vec!["a/b".into()], None)
            .unwrap();
        let kept = store
            .apply(task("default", "t", json!({"x": 2})))
            .unwrap()
            .object;
        assert_eq!(kept["metadata"]["finalizers"], json!(["a/b"]));
        let mut replace = task("default", "t", json!({"x": 2}));
        replace["metadata"]["finalizers"] = json!([]);
        let cleared = store.apply(replace).unwrap().object;
        assert!(cleared["metadata"].get("finalizers").is_none());
        assert_eq!(
            generation(&cleared),
            2,
            "metadata changes keep the generation"
        );
    }

    #[test]
    fn status_write_does_not_bump_generation() {
        let (_dir, store) = store();
        let created = store.apply(task("default", "t", json!({}))).unwrap().object;
        let s1 = store
            .write_status(
                "Task",
                "default",
                "t",
                json!({"phase": "Pending"}),
                Some(&rv(&created)),
            )
            .unwrap();
        assert_eq!(generation(&s1), 1);
        assert_eq!(s1["status"]["phase"], "Pending");
        assert_eq!(rv(&s1), "2");
        assert_eq!(s1["spec"], created["spec"]);

        // An unchanged status is not written again.
        let s2 = store
            .write_status("Task", "default", "t", json!({"phase": "Pending"}), None)
            .unwrap();
        assert_eq!(rv(&s2), "2");
        assert_eq!(store.current_version().unwrap(), 2);

        let cleared = store
            .write_status("Task", "default", "t", Value::Null, None)
            .unwrap();
        assert!(cleared.get("status").is_none());
        assert_eq!(generation(&cleared), 1);

        let missing = store.write_status("Task", "default", "nope", json!({}), None);
        assert!(
            matches!(missing, Err(StoreError::NotFound { .. })),
            "{missing:?}"
        );
    }

    #[test]
    fn stale_versions_conflict() {
        let (_dir, store) = store();
        let v1 = store
            .apply(task("default", "t", json!({"n": 1})))
            .unwrap()
            .object;
        let v2 = store
            .write_status("Task", "default", "t", json!({"phase": "Running"}), None)
            .unwrap();

        let mut stale = v1.clone();
        stale["spec"]["n"] = json!(2);
        match store.apply(stale) {
            Err(StoreError::Conflict {
                expected, actual, ..
            }) => {
                assert_eq!(expected, rv(&v1));
                assert_eq!(actual, rv(&v2));
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
        let status = store.write_status("Task", "default", "t", json!({}), Some(&rv(&v1)));
        assert!(
            matches!(status, Err(StoreError::Conflict { .. })),
            "{status:?}"
        );
        let fin = store.set_finalizers("Task", "default", "t", vec!["f".into()], Some(&rv(&v1)));
        assert!(matches!(fin, Err(StoreError::Conflict { .. })), "{fin:?}");
        // Refused writes leave everything as it was.
        assert_eq!(store.get("Task", "default", "t").unwrap(), Some(v2.clone()));

        let mut fresh = v2.clone();
        fresh["spec"]["n"] = json!(2);
        let v3 = store.apply(fresh).unwrap().object;
        assert_eq!(v3["spec"]["n"], 2);
        assert_eq!(generation(&v3), 2);

        // A version given for an object that does not exist: not found, not created.
        let mut ghost = task("default", "ghost", json!({}));
        ghost["metadata"]["resourceVersion"] = json!("3");
        assert!(matches!(
            store.apply(ghost),
            Err(StoreError::NotFound { .. })
        ));
        assert_eq!(store.get("Task", "default", "ghost").unwrap(), None);
    }

    #[test]
    fn delete_with_finalizer_is_pending_until_finalizers_are_cleared() {
        let (_dir, store) = store();
        store.apply(task("default", "t", json!({}))).unwrap();
        store
            .set_finalizers(
                "Task",
                "default",
                "t",
                vec!["propeller/a".into(), "propeller/b".into()],
                None,
            )
            .unwrap();
        let Deleted::Pending(pending) = store.delete("Task", "default", "t").unwrap() else {
            panic!("an object with finalizers must wait");
        };
        let stamp = pending["metadata"]["deletionTimestamp"].as_str().unwrap();
        assert!(chrono::DateTime::parse_from_rfc3339(stamp).is_ok());
        // Deleting again changes nothing.
        assert_eq!(
            store.delete("Task", "default", "t").unwrap(),
            Deleted::Pending(pending.clone())
        );

        let refused = store.apply(task("default", "t", json!({"changed": true})));
        assert!(
            matches!(refused, Err(StoreError::Terminating { .. })),
            "{refused:?}"
        );
        let added = store.set_finalizers(
            "Task",
            "default",
            "t",
            vec!["propeller/a".into(), "propeller/b".into(), "new".into()],
            None,
        );
        assert!(
            matches!(added, Err(StoreError::Terminating { .. })),
            "{added:?}"
        );
        // Status can still be written while terminating.
        store
            .write_status("Task", "default", "t", json!({"phase": "Stopping"}), None)
            .unwrap();

        let one_left = store
            .set_finalizers("Task", "default", "t", vec!["propeller/b".into()], None)
            .unwrap();
        assert_eq!(one_left["metadata"]["finalizers"], json!(["propeller/b"]));
        assert!(store.get("Task", "default", "t").unwrap().is_some());

        let last = store
            .set_finalizers("Task", "default", "t", vec![], Some(&rv(&one_left)))
            .unwrap();
        assert_eq!(last["status"]["phase"], "Stopping");
        assert!(last["metadata"].get("finalizers").is_none());
        assert_eq!(store.get("Task", "default", "t").unwrap(), None);
        assert_eq!(rv(&last), store.current_version().unwrap().to_string());

        let gone = store.delete("Task", "default", "t");
        assert!(matches!(gone, Err(StoreError::NotFound { .. })), "{gone:?}");
    }

    #[test]
    fn delete_without_finalizers_removes_at_once() {
        let (_dir, store) = store();
        let created = store.apply(task("default", "t", json!({}))).unwrap().object;
        let Deleted::Removed(last) = store.delete("Task", "default", "t").unwrap() else {
            panic!("nothing holds the object");
        };
        assert_eq!(last["metadata"]["uid"], created["metadata"]["uid"]);
        assert_eq!(store.get("Task", "default", "t").unwrap(), None);
        // The name can be used again, by a new object.
        let again = store.apply(task("default", "t", json!({}))).unwrap();
        assert!(again.created);
        assert_ne!(again.object["metadata"]["uid"], created["metadata"]["uid"]);
    }

    #[test]
    fn removal_cascades_to_owned_objects_over_two_levels() {
        let (_dir, store) = store();
        let job = store.apply(job("iot", "job")).unwrap().object;
        let t1 = store
            .create_child(owned_by(task("iot", "job-t1", json!({})), &job))
            .unwrap();
        let t2 = store
            .create_child(owned_by(task("iot", "job-t2", json!({})), &job))
            .unwrap();
        let grandchild = json!({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "job-t1-data", "namespace": "iot"},
            "data": {"k": "v"},
        });
        store.create_child(owned_by(grandchild, &t1)).unwrap();
        let bystander = store.apply(task("iot", "other", json!({}))).unwrap().object;
        // t2 holds a finalizer: it waits, and so do its own children.
        store
            .set_finalizers(
                "Task",
                "iot",
                "job-t2",
                vec!["propeller/cleanup".into()],
                None,
            )
            .unwrap();
        let t2_child = store
            .create_child(owned_by(task("iot", "job-t2-child", json!({})), &t2))
            .unwrap();

        let mut rx = store.subscribe();
        let Deleted::Removed(_) = store.delete("PropellerJob", "iot", "job").unwrap() else {
            panic!("the job has no finalizers");
        };
        assert_eq!(store.get("PropellerJob", "iot", "job").unwrap(), None);
        assert_eq!(store.get("Task", "iot", "job-t1").unwrap(), None);
        assert_eq!(store.get("ConfigMap", "iot", "job-t1-data").unwrap(), None);
        let t2_now = store.get("Task", "iot", "job-t2").unwrap().unwrap();
        assert!(t2_now["metadata"]["deletionTimestamp"].is_string());
        assert!(store.get("Task", "iot", "job-t2-child").unwrap().is_some());
        assert_eq!(store.get("Task", "iot", "other").unwrap(), Some(bystander));

        let mut events = drain(&mut rx);
        events.sort_by(|a, b| a.1.cmp(&b.1));
        assert_eq!(
            events,
            vec![
                ("PropellerJob".into(), "job".into(), ChangeKind::Deleted),
                ("Task".into(), "job-t1".into(), ChangeKind::Deleted),
                (
                    "ConfigMap".into(),
                    "job-t1-data".into(),
                    ChangeKind::Deleted
                ),
                ("Task".into(), "job-t2".into(), ChangeKind::Modified),
            ]
        );

        // Finalizing t2 removes it and cascades on to its child.
        store
            .set_finalizers("Task", "iot", "job-t2", vec![], None)
            .unwrap();
        assert_eq!(store.get("Task", "iot", "job-t2").unwrap(), None);
        assert_eq!(store.get("Task", "iot", "job-t2-child").unwrap(), None);
        assert_eq!(
            t2_child["metadata"]["ownerReferences"][0]["uid"],
            t2["metadata"]["uid"]
        );
        assert_eq!(store.list("Task", None).unwrap().len(), 1);
    }

    /// A store written before the owner index existed gets it built when opened, so its
    /// deletions still cascade.
    #[test]
    fn a_store_without_the_owner_index_gets_it_when_opened() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = ObjectStore::open(dir.path()).unwrap();
            let job = store.apply(job("iot", "job")).unwrap().object;
            store
                .create_child(owned_by(task("iot", "job-t1", json!({})), &job))
                .unwrap();
        }
        // As an earlier version left it: no index, no mark.
        {
            let db = redb::Database::open(dir.path().join(DB_FILE)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.delete_table(OWNED).unwrap();
            txn.open_table(META)
                .unwrap()
                .remove(OWNED_BUILT_KEY)
                .unwrap();
            txn.commit().unwrap();
        }
        let store = ObjectStore::open(dir.path()).unwrap();
        store.delete("PropellerJob", "iot", "job").unwrap();
        assert_eq!(store.get("Task", "iot", "job-t1").unwrap(), None);
    }

    #[test]
    fn create_child_refuses_an_existing_object() {
        let (_dir, store) = store();
        let first = store
            .create_child(task("default", "c", json!({"n": 1})))
            .unwrap();
        assert_eq!(generation(&first), 1);
        let again = store.create_child(task("default", "c", json!({"n": 2})));
        match again {
            Err(StoreError::AlreadyExists {
                kind,
                namespace,
                name,
            }) => assert_eq!(
                (kind.as_str(), namespace.as_str(), name.as_str()),
                ("Task", "default", "c")
            ),
            other => panic!("expected AlreadyExists, got {other:?}"),
        }
        assert_eq!(store.get("Task", "default", "c").unwrap(), Some(first));
    }

    #[test]
    fn watchers_get_added_modified_deleted_in_order() {
        let (_dir, store) = store();
        let mut rx = store.subscribe();
        store.apply(task("default", "t", json!({"n": 1}))).unwrap();
        store.apply(task("default", "t", json!({"n": 2}))).unwrap();
        store.apply(task("default", "t", json!({"n": 2}))).unwrap(); // no-op: no event
        store
            .write_status("Task", "default", "t", json!({"phase": "Running"}), None)
            .unwrap();
        store
            .write_status("Task", "default", "t", json!({"phase": "Running"}), None)
            .unwrap(); // no-op
        store.delete("Task", "default", "t").unwrap();
        let _ = store.apply(Value::Null); // refused: no event
        let changes: Vec<Change> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        let kinds: Vec<ChangeKind> = changes.iter().map(|c| c.kind_of_change).collect();
        assert_eq!(
            kinds,
            vec![
                ChangeKind::Added,
                ChangeKind::Modified,
                ChangeKind::Modified,
                ChangeKind::Deleted
            ]
        );
        assert_eq!(
            changes[0],
            Change {
                kind: "Task".into(),
                namespace: "default".into(),
                name: "t".into(),
                kind_of_change: ChangeKind::Added,
                resource_version: 1,
            }
        );
        // Every clone shares the watchers.
        let clone = store.clone();
        clone.apply(task("default", "u", json!({}))).unwrap();
        assert_eq!(rx.try_recv().unwrap().name, "u");
    }

    #[tokio::test]
    async fn watchers_work_from_async_code() {
        let (_dir, store) = store();
        let mut rx = store.subscribe();
        let writer = store.clone();
        let handle = tokio::spawn(async move {
            writer
                .apply(task("default", "async", json!({})))
                .map(|a| a.created)
        });
        let change = rx.recv().await.unwrap();
        assert_eq!(change.name, "async");
        assert_eq!(change.kind_of_change, ChangeKind::Added);
        assert!(handle.await.unwrap().unwrap());
    }

    #[test]
    fn reopening_keeps_objects_statuses_finalizers_and_the_counter() {
        let dir = tempfile::tempdir().unwrap();
        let (uid, version) = {
            let store = ObjectStore::open(dir.path()).unwrap();
            let created = store
                .apply(task("iot", "t", json!({"n": 1})))
                .unwrap()
                .object;
            store
                .write_status("Task", "iot", "t", json!({"phase": "Running"}), None)
                .unwrap();
            store
                .set_finalizers("Task", "iot", "t", vec!["propeller/f".into()], None)
                .unwrap();
            (
                created["metadata"]["uid"].clone(),
                store.current_version().unwrap(),
            )
            // store dropped here: the database is closed
        };
        assert_eq!(version, 3);
        assert!(dir.path().join(DB_FILE).is_file());

        let store = ObjectStore::open(dir.path()).unwrap();
        assert_eq!(store.current_version().unwrap(), 3);
        let t = store.get("Task", "iot", "t").unwrap().unwrap();
        assert_eq!(t["metadata"]["uid"], uid);
        assert_eq!(t["status"]["phase"], "Running");
        assert_eq!(t["metadata"]["finalizers"], json!(["propeller/f"]));
        assert_eq!(rv(&t), "3");
        let next = store.apply(task("iot", "u", json!({}))).unwrap().object;
        assert_eq!(rv(&next), "4", "the counter goes on after a reopen");
        // And the stale-version check still holds across the restart.
        let stale = store.write_status("Task", "iot", "t", json!({}), Some("2"));
        assert!(matches!(stale, Err(StoreError::Conflict { .. })));
    }

    #[tokio::test]
    async fn batched_status_writes_share_one_transaction_and_keep_their_own_outcomes() {
        let (dir, store) = store();
        let docs = ["a", "b", "c"]
            .iter()
            .map(|n| task("iot", n, json!({})))
            .collect();
        let applied = store.apply_all(docs).unwrap();
        let stale = applied[2].object["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_owned();
        store
            .write_status("Task", "iot", "c", json!({"phase": "Pending"}), None)
            .unwrap();
        let before = store.metrics().transactions.get();
        let running = json!({"phase": "Running"});
        let (a, b, c, missing) = tokio::join!(
            store.write_status_batched("Task", "iot", "a", running.clone(), None),
            store.write_status_batched("Task", "iot", "b", running.clone(), None),
            store.write_status_batched("Task", "iot", "c", running.clone(), Some(&stale)),
            store.write_status_batched("Task", "iot", "gone", running.clone(), None),
        );
        assert_eq!(a.unwrap()["status"]["phase"], "Running");
        assert_eq!(b.unwrap()["status"]["phase"], "Running");
        assert!(matches!(c, Err(StoreError::Conflict { .. })), "{c:?}");
        assert!(
            matches!(missing, Err(StoreError::NotFound { .. })),
            "{missing:?}"
        );
        assert_eq!(
            store.metrics().transactions.get() - before,
            1,
            "the two writes that applied shared one transaction"
        );
        // Returned means durable: both survive a reopen, and the refused one changed nothing.
        drop(store);
        let reopened = ObjectStore::open(dir.path()).unwrap();
        let phase = |name: &str| {
            reopened.get("Task", "iot", name).unwrap().unwrap()["status"]["phase"].clone()
        };
        assert_eq!(phase("a"), "Running");
        assert_eq!(phase("b"), "Running");
        assert_eq!(phase("c"), "Pending");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_share_durable_commits_and_changes_keep_commit_order() {
        let (dir, store) = store();
        let names: Vec<String> = (0..40).map(|i| format!("t{i}")).collect();
        let docs = names.iter().map(|n| task("iot", n, json!({}))).collect();
        store.apply_all(docs).unwrap();
        let mut rx = store.subscribe();
        let mut writers = tokio::task::JoinSet::new();
        for name in names.clone() {
            let store = store.clone();
            writers.spawn(async move {
                store
                    .write_status_async("Task", "iot", &name, json!({"phase": "Running"}), None)
                    .await
            });
        }
        while let Some(written) = writers.join_next().await {
            let written = written.unwrap().unwrap();
            // Returned means announced: the change is already in the channel.
            assert_eq!(written["status"]["phase"], "Running");
        }
        let changes = drain(&mut rx);
        assert_eq!(changes.len(), 40);
        let mut versions = Vec::new();
        for (_, name, _) in &changes {
            let obj = store.get("Task", "iot", name).unwrap().unwrap();
            versions.push(rv(&obj).parse::<u64>().unwrap());
        }
        assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
        drop(store);
        let reopened = ObjectStore::open(dir.path()).unwrap();
        let running = reopened
            .list("Task", Some("iot"))
            .unwrap()
            .into_iter()
            .filter(|t| t["status"]["phase"] == "Running")
            .count();
        assert_eq!(running, 40, "every returned write survived the reopen");
    }

    #[test]
    fn apply_all_stores_everything_or_nothing() {
        let (_dir, store) = store();
        store.apply(task("iot", "b", json!({}))).unwrap();
        let good = task("iot", "a", json!({}));
        let mut stale = task("iot", "b", json!({"n": 2}));
        stale["metadata"]["resourceVersion"] = json!("999");
        let refused = store.apply_all(vec![good.clone(), stale]);
        assert!(
            matches!(&refused, Err(DocumentError { index: 1, error }) if matches!(**error, StoreError::Conflict { .. })),
            "{refused:?}"
        );
        assert!(
            store.get("Task", "iot", "a").unwrap().is_none(),
            "rolled back"
        );
        let unnamed = json!({"kind": "Task", "metadata": {}});
        assert!(matches!(
            store.apply_all(vec![good.clone(), unnamed]),
            Err(DocumentError { index: 1, error }) if matches!(*error, StoreError::Invalid(_))
        ));
        let applied = store.apply_all(vec![good]).unwrap();
        assert!(applied[0].created);
    }

    #[test]
    fn a_second_open_of_the_same_directory_fails_cleanly() {
        let (dir, _store) = store();
        match ObjectStore::open(dir.path()) {
            Err(StoreError::Database(_)) => {}
            other => panic!("expected a database error, got {other:?}"),
        }
    }

    #[test]
    fn list_sorts_by_namespace_then_name_and_filters() {
        let (_dir, store) = store();
        for (ns, name) in [
            ("b", "x"),
            ("a", "z"),
            ("a-b", "m"),
            ("a", "a-b"),
            ("a", "a"),
            ("default", "d"),
        ] {
            store.apply(task(ns, name, json!({}))).unwrap();
        }
        // Another kind whose name starts like "Task" must not leak in.
        store
            .apply(json!({"kind": "TaskRun", "metadata": {"name": "r", "namespace": "a"}}))
            .unwrap();
        let ids = |objs: Vec<Value>| -> Vec<(String, String)> {
            objs.iter()
                .map(|o| {
                    (
                        o["metadata"]["namespace"].as_str().unwrap().to_owned(),
                        o["metadata"]["name"].as_str().unwrap().to_owned(),
                    )
                })
                .collect()
        };
        let s = |a: &str, b: &str| (a.to_owned(), b.to_owned());
        assert_eq!(
            ids(store.list("Task", None).unwrap()),
            vec![
                s("a", "a"),
                s("a", "a-b"),
                s("a", "z"),
                s("a-b", "m"),
                s("b", "x"),
                s("default", "d")
            ]
        );
        assert_eq!(
            ids(store.list("Task", Some("a")).unwrap()),
            vec![s("a", "a"), s("a", "a-b"), s("a", "z")]
        );
        assert_eq!(
            ids(store.list("Task", Some("")).unwrap()),
            vec![s("default", "d")]
        );
        assert!(store.list("Task", Some("none")).unwrap().is_empty());
        assert!(store.list("Proplet", None).unwrap().is_empty());
        assert_eq!(store.list("TaskRun", None).unwrap().len(), 1);
    }

    #[test]
    fn typed_helpers_read_our_custom_resources() {
        use crate::crd::proplet::{Proplet, PropletType};
        let (_dir, store) = store();
        for name in ["edge-2", "edge-1"] {
            store
                .apply(json!({
                    "apiVersion": "propeller.propeller.absmach.eu/v1",
                    "kind": "Proplet",
                    "metadata": {"name": name, "namespace": "iot"},
                    "spec": {
                        "type": "external",
                        "connectionConfig": {
                            "mqttAddress": "tcp://127.0.0.1:1883",
                            "domainId": "d1",
                            "channelId": "c1",
                            "clientId": name,
                            "clientKey": "secret"
                        }
                    }
                }))
                .unwrap();
        }
        let p: Proplet = store
            .get_typed("Proplet", "iot", "edge-1")
            .unwrap()
            .unwrap();
        assert_eq!(p.spec.type_, PropletType::External);
        assert_eq!(p.metadata.generation, Some(1));
        assert!(p.metadata.uid.is_some());
        assert!(p.status.is_none());
        let all: Vec<Proplet> = store.list_typed("Proplet", Some("iot")).unwrap();
        let names: Vec<_> = all.iter().filter_map(|p| p.metadata.name.clone()).collect();
        assert_eq!(names, ["edge-1", "edge-2"]);
        assert!(store
            .get_typed::<Proplet>("Proplet", "iot", "absent")
            .unwrap()
            .is_none());
        // A Task is not a Proplet.
        store.apply(task("iot", "t", json!({}))).unwrap();
        assert!(matches!(
            store.get_typed::<Proplet>("Task", "iot", "t"),
            Err(StoreError::Json(_))
        ));
    }

    #[test]
    fn malformed_objects_are_invalid() {
        let (_dir, store) = store();
        let bad = [
            json!(null),
            json!({"metadata": {"name": "x"}}),
            json!({"kind": "", "metadata": {"name": "x"}}),
            json!({"kind": "Task"}),
            json!({"kind": "Task", "metadata": {}}),
            json!({"kind": "Task", "metadata": {"name": ""}}),
            json!({"kind": "Task", "metadata": {"name": "a/b"}}),
            json!({"kind": "Task", "metadata": {"name": "a", "namespace": 3}}),
            json!({"kind": "Ta/sk", "metadata": {"name": "a"}}),
            json!({"kind": "Task", "metadata": {"name": "a", "finalizers": "f"}}),
            json!({"kind": "Task", "metadata": {"name": "a", "ownerReferences": [1]}}),
        ];
        for obj in bad {
            let r = store.apply(obj.clone());
            assert!(matches!(r, Err(StoreError::Invalid(_))), "{obj}: {r:?}");
        }
        assert!(matches!(
            store.get("Task", "a/b", "c"),
            Err(StoreError::Invalid(_))
        ));
        assert_eq!(store.current_version().unwrap(), 0, "nothing was written");
    }

    #[test]
    fn concurrent_writers_get_distinct_versions() {
        let (_dir, store) = store();
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    (0..10)
                        .map(|i| {
                            let obj = store
                                .apply(task("default", &format!("t{t}-{i}"), json!({})))
                                .unwrap()
                                .object;
                            rv(&obj).parse::<u64>().unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut versions: Vec<u64> = handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect();
        versions.sort_unstable();
        assert_eq!(versions, (1..=40).collect::<Vec<_>>());
        assert_eq!(store.list("Task", None).unwrap().len(), 40);
    }
}
