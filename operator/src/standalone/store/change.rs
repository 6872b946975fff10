//! What a write did and who hears of it: results, watch changes, observers, meters.

use std::sync::Arc;

use serde_json::Value;

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
