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

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};

use chrono::{SecondsFormat, Utc};
use redb::{Database, Durability, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use tokio::sync::{broadcast, watch};

mod recovery;
use recovery::{lost_cause, open_database};

/// Objects by `Kind/namespace/name`, as JSON bytes.
const OBJECTS: TableDefinition<&str, &[u8]> = TableDefinition::new("objects");
/// Store-wide counters; holds [`VERSION_KEY`].
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
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

/// Why a store operation failed. The variants mirror the API server's answers so that the
/// reconcilers can react the same way (retry on conflict, treat AlreadyExists as done).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No object has this kind, namespace and name.
    #[error("{kind} {namespace}/{name} not found")]
    NotFound {
        /// Kind of the missing object.
        kind: String,
        /// Namespace of the missing object.
        namespace: String,
        /// Name of the missing object.
        name: String,
    },
    /// A create found the object already there.
    #[error("{kind} {namespace}/{name} already exists")]
    AlreadyExists {
        /// Kind of the existing object.
        kind: String,
        /// Namespace of the existing object.
        namespace: String,
        /// Name of the existing object.
        name: String,
    },
    /// The object changed since the writer read it; re-read and try again.
    #[error(
        "{kind} {namespace}/{name} was modified: the write expected resourceVersion {expected} \
         but it is {actual}; read it again and retry"
    )]
    Conflict {
        /// Kind of the object.
        kind: String,
        /// Namespace of the object.
        namespace: String,
        /// Name of the object.
        name: String,
        /// The resourceVersion the writer had read.
        expected: String,
        /// The resourceVersion stored now.
        actual: String,
    },
    /// The object is malformed (not a JSON object, no kind or name, bad metadata).
    #[error("invalid object: {0}")]
    Invalid(String),
    /// The object is being deleted: its desired state and its finalizer list can only shrink.
    #[error(
        "{kind} {namespace}/{name} is being deleted (deletionTimestamp is set): only its status \
         can be written and finalizers removed; {refused}"
    )]
    Terminating {
        /// Kind of the object.
        kind: String,
        /// Namespace of the object.
        namespace: String,
        /// Name of the object.
        name: String,
        /// What was refused.
        refused: String,
    },
    /// The disk under the data directory is full (or the process may not write more): the
    /// write was not stored. Writes work again once there is room, without a restart.
    #[error(
        "the store's disk is full ({0}): the write was not stored; free space in the data \
         directory and writes resume"
    )]
    DiskFull(String),
    /// Reading or writing the database file failed; the store reopens it on the next use.
    #[error("object database I/O: {0}")]
    Io(String),
    /// The database failed (corruption, already open by another store, ...).
    #[error("object database: {0}")]
    Database(String),
    /// A stored or typed object could not be (de)serialized.
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
}

macro_rules! database_errors {
    ($($t:ty),* $(,)?) => {
        $(impl From<$t> for StoreError {
            fn from(e: $t) -> Self {
                StoreError::from_redb(redb::Error::from(e))
            }
        })*
    };
}

database_errors!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError,
    redb::SetDurabilityError,
);

/// Why [`ObjectStore::apply_all`] stored nothing: object `index` was refused.
#[derive(Debug, thiserror::Error)]
#[error("object {index}: {error}")]
pub struct DocumentError {
    /// Position of the refused object in the input.
    pub index: usize,
    /// Why it was refused.
    pub error: Box<StoreError>,
}

impl DocumentError {
    fn at(index: usize, error: StoreError) -> Self {
        Self {
            index,
            error: Box::new(error),
        }
    }
}

/// What [`ObjectStore::apply`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    /// The object as stored now, status included.
    pub object: Value,
    /// Whether the object was created (rather than updated or left unchanged).
    pub created: bool,
}

/// What [`ObjectStore::delete`] did.
#[derive(Debug, Clone, PartialEq)]
pub enum Deleted {
    /// The object has finalizers: it is kept with `metadata.deletionTimestamp` set until
    /// its controllers remove them with [`ObjectStore::set_finalizers`].
    Pending(Value),
    /// The object is gone (its dependents were deleted too); this is its last state.
    Removed(Value),
}

/// How an object changed, as in a Kubernetes watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    /// The object was created.
    Added,
    /// Its desired state, metadata, status or finalizers changed, or its deletion began.
    Modified,
    /// It was removed.
    Deleted,
}

impl ChangeKind {
    /// The watch event type's name.
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Added => "Added",
            ChangeKind::Modified => "Modified",
            ChangeKind::Deleted => "Deleted",
        }
    }
}

/// Labels of [`StoreMetrics::changes`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct ChangeLabels {
    /// Kind of the object.
    pub kind: String,
    /// `Added`, `Modified` or `Deleted`.
    pub change: String,
}

/// What the store did, for `/metrics`: how many writes per kind (a Proplet `Modified` is a
/// status write once the finalizer is on) and how many `fsync`s they cost.
#[derive(Clone, Debug, Default)]
pub struct StoreMetrics {
    /// Object changes made durable, by kind and change.
    pub changes: prometheus_client::metrics::family::Family<
        ChangeLabels,
        prometheus_client::metrics::counter::Counter,
    >,
    /// Write transactions committed.
    pub transactions: prometheus_client::metrics::counter::Counter,
    /// Durable (`fsync`ed) commits; fewer than transactions when writers shared them.
    pub durable_commits: prometheus_client::metrics::counter::Counter,
    /// Times the database was reopened after an I/O failure (a full disk, typically).
    pub reopens: prometheus_client::metrics::counter::Counter,
}

impl StoreMetrics {
    /// Adds the counters to `registry`.
    pub fn register(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register(
            "store_changes",
            "Object changes made durable, by kind and change",
            self.changes.clone(),
        );
        registry.register(
            "store_transactions",
            "Write transactions committed",
            self.transactions.clone(),
        );
        registry.register(
            "store_durable_commits",
            "Durable (fsynced) commits, each covering every transaction before it",
            self.durable_commits.clone(),
        );
        registry.register(
            "store_reopens",
            "Times the database was reopened after an I/O failure such as a full disk",
            self.reopens.clone(),
        );
    }
}

/// One committed change, sent to every watcher. It names the object rather than carrying
/// it: a reconciler reads the current state, which may already be newer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Change {
    /// Kind of the object.
    pub kind: String,
    /// Namespace of the object.
    pub namespace: String,
    /// Name of the object.
    pub name: String,
    /// What happened to it.
    pub kind_of_change: ChangeKind,
    /// The resourceVersion the change gave it, so a writer can tell its own changes.
    pub resource_version: u64,
}

/// Called with every durable change, in commit order, and the object as stored after it
/// (`None` once removed). Observers run on the writer's thread before the write returns, so
/// an in-memory index they keep is never behind a write its owner has seen complete. They
/// must be quick and must not call the store.
pub type Observer = Arc<dyn Fn(&Change, Option<&Value>) + Send + Sync>;

/// Identity of a stored object.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Key {
    kind: String,
    namespace: String,
    name: String,
}

impl Key {
    fn new(kind: &str, namespace: &str, name: &str) -> Result<Self, StoreError> {
        let namespace = if namespace.is_empty() {
            DEFAULT_NAMESPACE
        } else {
            namespace
        };
        check_segment("kind", kind)?;
        check_segment("metadata.namespace", namespace)?;
        check_segment("metadata.name", name)?;
        Ok(Self {
            kind: kind.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }

    /// Reads the identity of a whole object, checking the shape the store relies on.
    fn of(obj: &Value) -> Result<Self, StoreError> {
        let Some(map) = obj.as_object() else {
            return Err(StoreError::Invalid(
                "an object must be a JSON object".into(),
            ));
        };
        let kind = match map.get("kind") {
            Some(Value::String(k)) => k.as_str(),
            _ => {
                return Err(StoreError::Invalid(
                    "kind must be a non-empty string".into(),
                ))
            }
        };
        let meta = match map.get("metadata") {
            Some(Value::Object(m)) => m,
            _ => {
                return Err(StoreError::Invalid(format!(
                    "{kind}: metadata must be an object with a name"
                )))
            }
        };
        let name = match meta.get("name") {
            Some(Value::String(n)) => n.as_str(),
            _ => {
                return Err(StoreError::Invalid(format!(
                    "{kind}: metadata.name must be a non-empty string"
                )))
            }
        };
        let namespace = match meta.get("namespace") {
            None | Some(Value::Null) => "",
            Some(Value::String(n)) => n.as_str(),
            Some(_) => {
                return Err(StoreError::Invalid(format!(
                    "{kind} {name}: metadata.namespace must be a string"
                )))
            }
        };
        check_string_list(meta, "finalizers", kind, name)?;
        if let Some(refs) = meta.get("ownerReferences") {
            let ok = refs.is_null()
                || refs
                    .as_array()
                    .is_some_and(|a| a.iter().all(Value::is_object));
            if !ok {
                return Err(StoreError::Invalid(format!(
                    "{kind} {name}: metadata.ownerReferences must be a list of objects"
                )));
            }
        }
        Self::new(kind, namespace, name)
    }

    /// `Kind/namespace/name`: no part contains `/`, so the encoding is unambiguous and all
    /// objects of a kind (or of a kind and namespace) share a prefix.
    fn encoded(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }

    fn decode(key: &str) -> Option<Self> {
        let mut parts = key.splitn(3, '/');
        Some(Self {
            kind: parts.next()?.to_owned(),
            namespace: parts.next()?.to_owned(),
            name: parts.next()?.to_owned(),
        })
    }

    fn not_found(&self) -> StoreError {
        StoreError::NotFound {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    fn already_exists(&self) -> StoreError {
        StoreError::AlreadyExists {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    fn conflict(&self, expected: &str, actual: &str) -> StoreError {
        StoreError::Conflict {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            expected: expected.to_owned(),
            actual: actual.to_owned(),
        }
    }

    fn terminating(&self, refused: impl Into<String>) -> StoreError {
        StoreError::Terminating {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            refused: refused.into(),
        }
    }

    fn change(&self, kind_of_change: ChangeKind, resource_version: u64) -> Change {
        Change {
            kind: self.kind.clone(),
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            kind_of_change,
            resource_version,
        }
    }
}

fn check_segment(what: &str, value: &str) -> Result<(), StoreError> {
    if value.is_empty() {
        return Err(StoreError::Invalid(format!("{what} must not be empty")));
    }
    if value.contains('/') || value.chars().any(char::is_control) {
        return Err(StoreError::Invalid(format!(
            "{what} {value:?} must not contain '/' or control characters"
        )));
    }
    Ok(())
}

fn check_string_list(
    meta: &Map<String, Value>,
    field: &str,
    kind: &str,
    name: &str,
) -> Result<(), StoreError> {
    match meta.get(field) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(StoreError::Invalid(format!(
            "{kind} {name}: metadata.{field} must be a list of strings"
        ))),
    }
}

fn now_rfc3339() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::Secs, true)
}

fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

/// Runs `f` on the metadata map, creating it if missing. Does nothing to a non-object,
/// which the store never holds ([`Key::of`] refuses them).
fn edit_meta(obj: &mut Value, f: impl FnOnce(&mut Map<String, Value>)) {
    if let Value::Object(map) = obj {
        let meta = map
            .entry("metadata")
            .or_insert_with(|| Value::Object(Map::new()));
        if !meta.is_object() {
            *meta = Value::Object(Map::new());
        }
        if let Value::Object(meta) = meta {
            f(meta);
        }
    }
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    meta(obj).and_then(|m| m.get(field)).and_then(Value::as_str)
}

fn resource_version(obj: &Value) -> &str {
    meta_str(obj, "resourceVersion").unwrap_or_default()
}

fn uid(obj: &Value) -> &str {
    meta_str(obj, "uid").unwrap_or_default()
}

/// Null or `[]`: an absent list, as the API server stores it.
fn is_empty_list(v: &Value) -> bool {
    v.is_null() || v.as_array().is_some_and(Vec::is_empty)
}

fn is_terminating(obj: &Value) -> bool {
    meta(obj)
        .and_then(|m| m.get("deletionTimestamp"))
        .is_some_and(|t| !t.is_null())
}

fn finalizers(obj: &Value) -> Vec<String> {
    meta(obj)
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn set_finalizer_list(obj: &mut Value, list: &[String]) {
    edit_meta(obj, |meta| {
        if list.is_empty() {
            meta.remove("finalizers");
        } else {
            meta.insert(
                "finalizers".into(),
                Value::Array(list.iter().cloned().map(Value::String).collect()),
            );
        }
    });
}

/// The uids of an object's owners.
fn owner_uids(obj: &Value) -> impl Iterator<Item = &str> {
    meta(obj)
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r.get("uid").and_then(Value::as_str))
}

/// Everything of an object but `apiVersion`, `kind`, `metadata` and `status`: what a
/// change of bumps `metadata.generation`.
fn desired_state(obj: &Value) -> Map<String, Value> {
    obj.as_object()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| !NOT_DESIRED_STATE.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// The resourceVersion a client sent, if any (an empty string means none).
fn given_version(obj: &Value) -> Result<Option<String>, StoreError> {
    match meta(obj).and_then(|m| m.get("resourceVersion")) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) => Ok(Some(n.to_string())),
        Some(_) => Err(StoreError::Invalid(
            "metadata.resourceVersion must be a string".into(),
        )),
    }
}

/// One write transaction: the objects table, the counter as it will be committed, and the
/// changes to announce once the commit has succeeded.
struct Tx<'t> {
    objects: redb::Table<'t, &'static str, &'static [u8]>,
    version: u64,
    changes: Announced,
}

/// A transaction's changes, each with the object as stored after it (`None` once removed).
type Announced = Vec<(Change, Option<Value>)>;

impl Tx<'_> {
    fn load(&self, key: &Key) -> Result<Option<Value>, StoreError> {
        match self.objects.get(key.encoded().as_str())? {
            Some(bytes) => Ok(Some(serde_json::from_slice(bytes.value())?)),
            None => Ok(None),
        }
    }

    /// Stamps `obj` with the next resourceVersion, stores it and records the change.
    fn save(&mut self, key: &Key, obj: &mut Value, change: ChangeKind) -> Result<(), StoreError> {
        self.stamp(obj);
        let bytes = serde_json::to_vec(obj)?;
        self.objects
            .insert(key.encoded().as_str(), bytes.as_slice())?;
        self.changes
            .push((key.change(change, self.version), Some(obj.clone())));
        Ok(())
    }

    /// Removes the object (no cascade), stamping its last state with a new version.
    fn remove(&mut self, key: &Key, mut obj: Value) -> Result<Value, StoreError> {
        self.stamp(&mut obj);
        self.objects.remove(key.encoded().as_str())?;
        self.changes
            .push((key.change(ChangeKind::Deleted, self.version), None));
        Ok(obj)
    }

    fn stamp(&mut self, obj: &mut Value) {
        self.version += 1;
        let version = Value::String(self.version.to_string());
        edit_meta(obj, |meta| {
            meta.insert("resourceVersion".into(), version);
        });
    }

    fn load_existing(&self, key: &Key) -> Result<Value, StoreError> {
        self.load(key)?.ok_or_else(|| key.not_found())
    }

    fn check_version(key: &Key, current: &Value, expected: Option<&str>) -> Result<(), StoreError> {
        match expected {
            Some(expected) if !expected.is_empty() => {
                let actual = resource_version(current);
                if actual == expected {
                    Ok(())
                } else {
                    Err(key.conflict(expected, actual))
                }
            }
            _ => Ok(()),
        }
    }

    fn create(&mut self, key: &Key, mut obj: Value) -> Result<Value, StoreError> {
        if let Some(map) = obj.as_object_mut() {
            map.remove("status");
        }
        edit_meta(&mut obj, |meta| {
            for field in SERVER_FIELDS {
                meta.remove(*field);
            }
            meta.insert("namespace".into(), Value::String(key.namespace.clone()));
            meta.insert(
                "uid".into(),
                Value::String(uuid::Uuid::new_v4().hyphenated().to_string()),
            );
            meta.insert("creationTimestamp".into(), Value::String(now_rfc3339()));
            meta.insert("generation".into(), Value::from(1));
            for field in ["finalizers", "ownerReferences"] {
                if meta.get(field).is_some_and(is_empty_list) {
                    meta.remove(field);
                }
            }
        });
        self.save(key, &mut obj, ChangeKind::Added)?;
        Ok(obj)
    }

    fn apply(
        &mut self,
        key: &Key,
        incoming: Value,
        create_only: bool,
    ) -> Result<Applied, StoreError> {
        let given = given_version(&incoming)?;
        let Some(current) = self.load(key)? else {
            if given.is_some() {
                // An update of something that is not there, as a PUT would be.
                return Err(key.not_found());
            }
            let object = self.create(key, incoming)?;
            return Ok(Applied {
                object,
                created: true,
            });
        };
        if create_only {
            return Err(key.already_exists());
        }
        Self::check_version(key, &current, given.as_deref())?;
        let mut next = current.clone();
        let old_state = desired_state(&current);
        let new_state = desired_state(&incoming);
        let state_changed = old_state != new_state;
        if let Some(map) = next.as_object_mut() {
            map.retain(|k, _| NOT_DESIRED_STATE.contains(&k.as_str()));
            map.extend(new_state);
            if let Some(api_version) = incoming.get("apiVersion") {
                map.insert("apiVersion".into(), api_version.clone());
            }
        }
        let incoming_meta = meta(&incoming).cloned().unwrap_or_default();
        edit_meta(&mut next, |next_meta| {
            for field in ["labels", "annotations"] {
                match incoming_meta.get(field) {
                    Some(v) if !v.is_null() => {
                        next_meta.insert(field.into(), v.clone());
                    }
                    _ => {
                        next_meta.remove(field);
                    }
                }
            }
            for field in ["finalizers", "ownerReferences"] {
                match incoming_meta.get(field) {
                    None => {}
                    Some(v) if is_empty_list(v) => {
                        next_meta.remove(field);
                    }
                    Some(v) => {
                        next_meta.insert(field.into(), v.clone());
                    }
                }
            }
        });
        if next == current {
            return Ok(Applied {
                object: current,
                created: false,
            });
        }
        if is_terminating(&current) {
            return Err(key.terminating("apply changed its spec or metadata"));
        }
        if state_changed {
            let generation = meta(&current)
                .and_then(|m| m.get("generation"))
                .and_then(Value::as_i64)
                .unwrap_or(0);
            edit_meta(&mut next, |meta| {
                meta.insert("generation".into(), Value::from(generation + 1));
            });
        }
        self.save(key, &mut next, ChangeKind::Modified)?;
        Ok(Applied {
            object: next,
            created: false,
        })
    }

    fn write_status(
        &mut self,
        key: &Key,
        status: Value,
        expected: Option<&str>,
    ) -> Result<Value, StoreError> {
        let current = self.load_existing(key)?;
        Self::check_version(key, &current, expected)?;
        let mut next = current.clone();
        if let Some(map) = next.as_object_mut() {
            if status.is_null() {
                map.remove("status");
            } else {
                map.insert("status".into(), status);
            }
        }
        if next == current {
            return Ok(current);
        }
        self.save(key, &mut next, ChangeKind::Modified)?;
        Ok(next)
    }

    fn set_finalizers(
        &mut self,
        key: &Key,
        list: Vec<String>,
        expected: Option<&str>,
    ) -> Result<Value, StoreError> {
        let current = self.load_existing(key)?;
        Self::check_version(key, &current, expected)?;
        let terminating = is_terminating(&current);
        if terminating {
            let had = finalizers(&current);
            if let Some(added) = list.iter().find(|f| !had.contains(f)) {
                return Err(key.terminating(format!("adding finalizer {added:?}")));
            }
        }
        let mut next = current.clone();
        set_finalizer_list(&mut next, &list);
        if terminating && list.is_empty() {
            return match self.delete_tree(key, next, true)? {
                Deleted::Removed(last) | Deleted::Pending(last) => Ok(last),
            };
        }
        if next == current {
            return Ok(current);
        }
        self.save(key, &mut next, ChangeKind::Modified)?;
        Ok(next)
    }

    /// Deletes one object without cascading: marks it if it has finalizers, else removes it.
    fn delete_one(&mut self, key: &Key, obj: Value) -> Result<Deleted, StoreError> {
        if finalizers(&obj).is_empty() {
            return Ok(Deleted::Removed(self.remove(key, obj)?));
        }
        if is_terminating(&obj) {
            return Ok(Deleted::Pending(obj));
        }
        let mut obj = obj;
        edit_meta(&mut obj, |meta| {
            meta.insert("deletionTimestamp".into(), Value::String(now_rfc3339()));
        });
        self.save(key, &mut obj, ChangeKind::Modified)?;
        Ok(Deleted::Pending(obj))
    }

    /// Deletes `obj` and, once it is removed, every object it owns (transitively), each under
    /// the same finalizer rule. `remove_now` skips the finalizer check for the first object
    /// (its last finalizer was just removed).
    fn delete_tree(
        &mut self,
        key: &Key,
        obj: Value,
        remove_now: bool,
    ) -> Result<Deleted, StoreError> {
        let first = if remove_now {
            Deleted::Removed(self.remove(key, obj)?)
        } else {
            self.delete_one(key, obj)?
        };
        let Deleted::Removed(removed) = &first else {
            return Ok(first);
        };
        let mut queue = VecDeque::from([uid(removed).to_owned()]);
        let mut index: Option<HashMap<String, Vec<Key>>> = None;
        while let Some(owner) = queue.pop_front() {
            if owner.is_empty() {
                continue;
            }
            if index.is_none() {
                index = Some(self.owner_index()?);
            }
            let Some(children) = index.as_mut().and_then(|i| i.remove(&owner)) else {
                continue;
            };
            for child_key in children {
                // Already gone when several owners of it were removed in this cascade.
                let Some(child) = self.load(&child_key)? else {
                    continue;
                };
                if let Deleted::Removed(child) = self.delete_one(&child_key, child)? {
                    queue.push_back(uid(&child).to_owned());
                }
            }
        }
        Ok(first)
    }

    /// Owner uid → keys of the objects that name it in `ownerReferences`.
    fn owner_index(&self) -> Result<HashMap<String, Vec<Key>>, StoreError> {
        let mut index: HashMap<String, Vec<Key>> = HashMap::new();
        for entry in self.objects.iter()? {
            let (key, bytes) = entry?;
            let obj: Value = serde_json::from_slice(bytes.value())?;
            let Some(key) = Key::decode(key.value()) else {
                continue;
            };
            for owner in owner_uids(&obj) {
                index.entry(owner.to_owned()).or_default().push(key.clone());
            }
        }
        Ok(index)
    }
}

struct Inner {
    /// The redb handle; `None` after an I/O failure until it is reopened. Transactions hold
    /// it shared while they begin (writes: while they run); a reopen holds it alone.
    db: RwLock<Option<Database>>,
    /// An I/O failure poisoned the handle: the next use reopens it.
    broken: std::sync::atomic::AtomicBool,
    path: PathBuf,
    events: broadcast::Sender<Change>,
    observers: RwLock<Vec<Observer>>,
    /// Held from the start of a write transaction until its changes are queued for
    /// announcement, so watchers see changes in commit (resourceVersion) order.
    write_order: Mutex<()>,
    group: Mutex<GroupCommit>,
    /// Wakes blocking writers when a durable commit finished.
    synced_blocking: Condvar,
    /// Wakes async writers when a durable commit finished; carries [`GroupCommit::synced`].
    synced_async: watch::Sender<u64>,
    /// Blocking threads async writers may hold while a durable commit runs. Commits take
    /// turns on the write lock anyway; more threads would only each hold memory.
    commit_threads: tokio::sync::Semaphore,
    /// Status writes waiting to share one transaction.
    batch: Mutex<StatusBatch>,
    metrics: StoreMetrics,
}

/// See [`Inner::commit_threads`].
const COMMIT_THREADS: usize = 16;

/// redb's page cache (its default is 1 GiB). Reads are served by the typed cache in front of
/// the store, so redb's cache mostly keeps pages of objects that are about to be rewritten;
/// the OS page cache holds the rest of the file.
const REDB_CACHE_BYTES: usize = 32 * 1024 * 1024;

/// Where the group commit stands. Sequence numbers count committed write transactions.
#[derive(Default)]
struct GroupCommit {
    /// Last transaction committed (visible, maybe not yet durable).
    committed: u64,
    /// Last transaction known durable and announced.
    synced: u64,
    /// A writer is running the durable commit; the others wait for it.
    syncing: bool,
    /// Transactions up to this one were committed but never made durable, and were dropped
    /// when an I/O failure made the database reopen; their writers get `lost_because`.
    lost_through: u64,
    /// Why they were lost: whether the disk was full, and the error.
    lost_because: Option<(bool, String)>,
    /// Changes of transactions not yet durable, to announce once they are.
    pending: VecDeque<(u64, Announced)>,
}

/// How long the first status write of a batch waits for others to join it. Status writes of
/// heartbeating proplets arrive spread out, about one per proplet per flush interval; each
/// transaction of its own cost more CPU than the heartbeat it records (copy-on-write of the
/// tree's pages, the counter, the commit), and a few milliseconds more on a status that is
/// refreshed every few seconds changes nothing a reader can see.
const BATCH_WINDOW: std::time::Duration = std::time::Duration::from_millis(20);

/// Status writes queued for the next batch transaction (see
/// [`ObjectStore::write_status_batched`]).
#[derive(Default)]
struct StatusBatch {
    queued: Vec<QueuedStatus>,
    /// A flusher task is waiting out the window; writes join `queued` until it takes them.
    open: bool,
}

/// One queued status write and where its outcome goes: the object as stored and the
/// transaction to wait on for durability.
struct QueuedStatus {
    key: Key,
    status: Value,
    expected: Option<String>,
    reply: tokio::sync::oneshot::Sender<Result<(Value, u64), StoreError>>,
}

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
    /// Opens the store kept in `dir` (file [`DB_FILE`]), creating the directory and the
    /// database if needed. Everything committed before survives, the resourceVersion counter
    /// included.
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| StoreError::Database(format!("cannot create {}: {e}", dir.display())))?;
        let path = dir.join(DB_FILE);
        let db = open_database(&path)?;
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
            let obj: Value = serde_json::from_slice(bytes.value())?;
            found.push(((key.namespace, key.name), obj));
        }
        // Key order puts "a-b/" before "a/"; the API server's order is by (namespace, name).
        found.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(found.into_iter().map(|(_, obj)| obj).collect())
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

    /// Commits every queued status write in one transaction and answers each writer.
    async fn flush_batch(&self) {
        let queued = {
            let mut batch = lock(&self.inner.batch);
            batch.open = false;
            std::mem::take(&mut batch.queued)
        };
        let (writes, replies): (Vec<_>, Vec<_>) = queued
            .into_iter()
            .map(|q| ((q.key, q.status, q.expected), q.reply))
            .unzip();
        let committed = self
            .write_async_nowait(move |tx| {
                Ok(writes
                    .into_iter()
                    .map(|(key, status, expected)| {
                        tx.write_status(&key, status, expected.as_deref())
                    })
                    .collect::<Vec<_>>())
            })
            .await;
        match committed {
            Ok((outcomes, seq)) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    // A writer that gave up is no reason to fail the others.
                    let _ = reply.send(outcome.map(|stored| (stored, seq)));
                }
            }
            Err(error) => {
                let message = error.to_string();
                for reply in replies {
                    let _ = reply.send(Err(StoreError::Database(message.clone())));
                }
            }
        }
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

    /// Runs `f` in one write transaction, commits it if it changed anything and returns once
    /// the commit is durable and announced. An error from `f` aborts the transaction, leaving
    /// the store untouched.
    fn write<T>(
        &self,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let (out, seq) = self.commit(f)?;
        self.durable_blocking(seq)?;
        Ok(out)
    }

    /// [`ObjectStore::write`] for async callers: durability is awaited without holding a
    /// thread. A durable commit holds redb's write lock through its `fsync`; while one runs,
    /// the transaction goes to a blocking thread, so the wait for the lock stalls no runtime
    /// thread and every writer arriving meanwhile joins the next group commit. Otherwise it
    /// commits right here: a commit without `fsync` is short, and the hop to another thread
    /// would cost a single write more than the commit.
    async fn write_async<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (out, seq) = self.write_async_nowait(f).await?;
        self.durable(seq).await?;
        Ok(out)
    }

    /// The commit of [`ObjectStore::write_async`] without the wait for durability: returns
    /// the transaction's sequence number to wait on.
    async fn write_async_nowait<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<(T, u64), StoreError> {
        let syncing = lock(&self.inner.group).syncing;
        let (out, seq) = if syncing {
            // Never closed, so acquiring only waits.
            let _thread = self.inner.commit_threads.acquire().await;
            let store = self.clone();
            tokio::task::spawn_blocking(move || store.commit(f))
                .await
                .map_err(|e| StoreError::Database(format!("a store write did not finish: {e}")))??
        } else {
            self.commit(f)?
        };
        Ok((out, seq))
    }

    /// Runs `f` in one write transaction and commits it without `fsync`. Returns the
    /// transaction's sequence number to wait on (0 if it changed nothing).
    fn commit<T>(
        &self,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T, StoreError>,
    ) -> Result<(T, u64), StoreError> {
        let _order = lock(&self.inner.write_order);
        let db = self.database()?;
        let outcome = Self::commit_on(&db, f);
        drop(db);
        match outcome {
            Ok((out, None)) => Ok((out, 0)),
            Ok((out, Some(changes))) => {
                self.inner.metrics.transactions.inc();
                let mut group = lock(&self.inner.group);
                group.committed += 1;
                let seq = group.committed;
                group.pending.push_back((seq, changes));
                Ok((out, seq))
            }
            Err(e) => {
                self.poisoned_by(&e);
                Err(e)
            }
        }
    }

    /// The transaction of [`ObjectStore::commit`] on `db`: the changes it committed, `None`
    /// if it changed nothing.
    fn commit_on<T>(
        db: &Database,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T, StoreError>,
    ) -> Result<(T, Option<Announced>), StoreError> {
        let mut txn = db.begin_write()?;
        txn.set_durability(Durability::None)?;
        let (out, changes) = {
            let mut meta = txn.open_table(META)?;
            let start = meta.get(VERSION_KEY)?.map(|v| v.value()).unwrap_or(0);
            let mut tx = Tx {
                objects: txn.open_table(OBJECTS)?,
                version: start,
                changes: Vec::new(),
            };
            let out = f(&mut tx)?;
            if tx.version != start {
                meta.insert(VERSION_KEY, tx.version)?;
            }
            (out, tx.changes)
        };
        if changes.is_empty() {
            txn.abort()?;
            return Ok((out, None));
        }
        txn.commit()?;
        Ok((out, Some(changes)))
    }

    /// Whether transaction `seq` is durable; `None` if not yet and someone is syncing,
    /// `Some(false)` if the caller must run the durable commit itself.
    fn sync_state(&self, seq: u64) -> Result<Option<bool>, StoreError> {
        let mut group = lock(&self.inner.group);
        if group.synced >= seq {
            return Ok(Some(true));
        }
        if seq <= group.lost_through {
            return Err(match &group.lost_because {
                Some((true, cause)) => StoreError::DiskFull(cause.clone()),
                Some((false, cause)) => StoreError::Io(cause.clone()),
                None => StoreError::Io("the write was lost".into()),
            });
        }
        if group.syncing {
            return Ok(None);
        }
        group.syncing = true;
        Ok(Some(false))
    }

    /// Waits, blocking the thread, until transaction `seq` is durable.
    fn durable_blocking(&self, seq: u64) -> Result<(), StoreError> {
        loop {
            match self.sync_state(seq)? {
                Some(true) => return Ok(()),
                Some(false) => self.sync_and_announce(),
                None => {
                    let group = lock(&self.inner.group);
                    if group.syncing {
                        drop(
                            self.inner
                                .synced_blocking
                                .wait(group)
                                .unwrap_or_else(PoisonError::into_inner),
                        );
                    }
                }
            }
        }
    }

    /// Waits, without blocking a runtime thread, until transaction `seq` is durable.
    async fn durable(&self, seq: u64) -> Result<(), StoreError> {
        let mut synced = self.inner.synced_async.subscribe();
        loop {
            match self.sync_state(seq)? {
                Some(true) => return Ok(()),
                Some(false) => {
                    let store = self.clone();
                    // Runs to the end even if this future is dropped: others wait on it.
                    let _ = tokio::task::spawn_blocking(move || store.sync_and_announce()).await;
                }
                None => {
                    let _ = synced.changed().await;
                }
            }
        }
    }

    /// The durable commit: one `fsync`ed transaction covering every commit before it, then
    /// the announcement of their changes, in order. Only the writer that set `syncing` runs it.
    fn sync_and_announce(&self) {
        let outcome = self.commit_durably();
        let target = match &outcome {
            Ok(target) => *target,
            Err(_) => lock(&self.inner.group).committed,
        };
        let ready: Vec<(u64, Announced)> = {
            let mut group = lock(&self.inner.group);
            match &outcome {
                Ok(_) => {
                    let mut ready = Vec::new();
                    while group.pending.front().is_some_and(|(seq, _)| *seq <= target) {
                        ready.extend(group.pending.pop_front());
                    }
                    ready
                }
                // Told to their writers by `poisoned_by`, or through `lost_through` below.
                Err(_) => Vec::new(),
            }
        };
        {
            let observers = self
                .inner
                .observers
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            for (change, object) in ready.into_iter().flat_map(|(_, changes)| changes) {
                self.inner
                    .metrics
                    .changes
                    .get_or_create(&ChangeLabels {
                        kind: change.kind.clone(),
                        change: change.kind_of_change.as_str().to_owned(),
                    })
                    .inc();
                for observer in observers.iter() {
                    observer(&change, object.as_ref());
                }
                // No receivers is fine: nobody is watching yet.
                let _ = self.inner.events.send(change);
            }
        }
        {
            let mut group = lock(&self.inner.group);
            match &outcome {
                Ok(_) => group.synced = group.synced.max(target),
                Err(e) if !e.poisons_handle() => {
                    // Not an I/O failure, so the handle still works, but these commits are
                    // not durable: fail their writers rather than leave them waiting.
                    group.lost_through = group.lost_through.max(target);
                    group.lost_because = Some(lost_cause(e));
                    while group.pending.front().is_some_and(|(seq, _)| *seq <= target) {
                        group.pending.pop_front();
                    }
                }
                Err(_) => {}
            }
            group.syncing = false;
        }
        self.inner.synced_blocking.notify_all();
        self.inner.synced_async.send_replace(target);
    }

    /// Commits durably; returns the last transaction it covers. That is read once the write
    /// lock is held, so writers that got the lock first are covered too.
    fn commit_durably(&self) -> Result<u64, StoreError> {
        let db = self.database()?;
        let outcome = (|| {
            let mut txn = db.begin_write()?;
            let target = lock(&self.inner.group).committed;
            txn.set_durability(Durability::Immediate)?;
            txn.open_table(META)?.insert(SYNCED_KEY, target)?;
            txn.commit()?;
            Ok(target)
        })();
        drop(db);
        match outcome {
            Ok(target) => {
                self.inner.metrics.durable_commits.inc();
                Ok(target)
            }
            Err(e) => {
                self.poisoned_by(&e);
                Err(e)
            }
        }
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
        let job = store
            .apply(json!({
                "apiVersion": "propeller.propeller.absmach.eu/v1",
                "kind": "PropellerJob",
                "metadata": {"name": "job", "namespace": "iot"},
                "spec": {},
            }))
            .unwrap()
            .object;
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
