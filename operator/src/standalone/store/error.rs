//! Why a store operation failed, in the API server's terms.

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
    pub(super) fn at(index: usize, error: StoreError) -> Self {
        Self {
            index,
            error: Box::new(error),
        }
    }
}
