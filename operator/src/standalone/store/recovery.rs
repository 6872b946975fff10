//! What the store does when the disk fails it: which redb errors mean a full disk, and the
//! reopening of a handle that an I/O failure poisoned (redb refuses every later use of it),
//! so that writes resume by themselves once there is room, without a restart.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::PoisonError;

use redb::{Database, ReadableDatabase, ReadableTable as _};

use super::object::owner_uids;
use super::tx::owned_entry;
use super::{
    lock, ObjectStore, StoreError, META, OBJECTS, OWNED, OWNED_BUILT_KEY, REDB_CACHE_BYTES,
};

impl StoreError {
    /// Sorts a redb failure: out of space, other I/O (after which redb refuses every use of
    /// that handle until it is reopened), or anything else.
    pub(super) fn from_redb(error: redb::Error) -> Self {
        match error {
            redb::Error::Io(io) if out_of_space(&io) => StoreError::DiskFull(io.to_string()),
            redb::Error::Io(io) => StoreError::Io(io.to_string()),
            redb::Error::PreviousIo => StoreError::Io(
                "the database file could not be written; it is being reopened".into(),
            ),
            other => StoreError::Database(other.to_string()),
        }
    }

    /// Whether this failure left redb's handle unusable (it must be reopened).
    pub(super) fn poisons_handle(&self) -> bool {
        matches!(self, StoreError::DiskFull(_) | StoreError::Io(_))
    }
}

/// What writers of lost transactions are told, from the failure that lost them.
pub(super) fn lost_cause(error: &StoreError) -> (bool, String) {
    match error {
        StoreError::DiskFull(cause) => (true, cause.clone()),
        other => (false, format!("the write was not made durable: {other}")),
    }
}

/// ENOSPC, a quota (EDQUOT) or a file size limit (EFBIG, as `RLIMIT_FSIZE` gives).
fn out_of_space(error: &std::io::Error) -> bool {
    error.kind() == std::io::ErrorKind::StorageFull
        || error.kind() == std::io::ErrorKind::QuotaExceeded
        || error.kind() == std::io::ErrorKind::FileTooLarge
        || matches!(error.raw_os_error(), Some(27 | 28 | 122))
}

impl ObjectStore {
    /// A read transaction on the current handle (reopened first if an I/O failure broke it).
    pub(super) fn begin_read(&self) -> Result<redb::ReadTransaction, StoreError> {
        let db = self.database()?;
        let txn = db.begin_read().map_err(StoreError::from);
        drop(db);
        txn.inspect_err(|e| self.poisoned_by(e))
    }

    /// The usable handle, shared. After an I/O failure the handle is reopened here first, so
    /// the store recovers by itself once the disk has room again.
    pub(super) fn database(&self) -> Result<DatabaseRef<'_>, StoreError> {
        if self.inner.broken.load(Ordering::Acquire) {
            self.reopen()?;
        }
        let guard = self.inner.db.read().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            return Err(StoreError::Io(
                "the database is being reopened after an I/O failure".into(),
            ));
        }
        Ok(DatabaseRef(guard))
    }

    /// Notes that `error` left redb's handle unusable: the commits not yet durable are lost
    /// with it (their writers are told), and the next use reopens the database.
    pub(super) fn poisoned_by(&self, error: &StoreError) {
        if !error.poisons_handle() {
            return;
        }
        {
            let mut group = lock(&self.inner.group);
            group.lost_through = group.committed;
            group.lost_because = Some(lost_cause(error));
            group.pending.clear();
        }
        self.inner.broken.store(true, Ordering::Release);
        self.inner.synced_blocking.notify_all();
        let synced = *self.inner.synced_async.borrow();
        self.inner.synced_async.send_replace(synced);
    }

    /// Closes the broken handle and opens the file again; redb then returns to its last
    /// durable commit. Fails (and is tried again on the next use) while the disk is still
    /// full or a read transaction still holds the old handle.
    fn reopen(&self) -> Result<(), StoreError> {
        let mut slot = self
            .inner
            .db
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if !self.inner.broken.load(Ordering::Acquire) {
            return Ok(());
        }
        drop(slot.take());
        let db = open_database(&self.inner.path)?;
        *slot = Some(db);
        self.inner.broken.store(false, Ordering::Release);
        self.inner.metrics.reopens.inc();
        Ok(())
    }
}

/// Opens (or creates) the database file and its tables.
pub(super) fn open_database(path: &Path) -> Result<Database, StoreError> {
    let db = Database::builder()
        .set_cache_size(REDB_CACHE_BYTES)
        .create(path)?;
    // Create the tables up front so that reads never meet a missing table.
    let txn = db.begin_write()?;
    {
        let objects = txn.open_table(OBJECTS)?;
        let mut meta = txn.open_table(META)?;
        let mut owned = txn.open_table(OWNED)?;
        if meta.get(OWNED_BUILT_KEY)?.is_none() {
            for entry in objects.iter()? {
                let (key, bytes) = entry?;
                let obj: serde_json::Value = serde_json::from_slice(bytes.value())?;
                for owner in owner_uids(&obj) {
                    owned.insert(owned_entry(owner, key.value()).as_str(), ())?;
                }
            }
            meta.insert(OWNED_BUILT_KEY, 1)?;
        }
    }
    txn.commit()?;
    Ok(db)
}

/// The current redb handle, held shared (see [`Inner::db`]).
pub(super) struct DatabaseRef<'a>(std::sync::RwLockReadGuard<'a, Option<Database>>);

impl std::ops::Deref for DatabaseRef<'_> {
    type Target = Database;

    fn deref(&self) -> &Database {
        match self.0.as_ref() {
            Some(db) => db,
            None => unreachable!("a DatabaseRef is only made of a present handle"),
        }
    }
}
