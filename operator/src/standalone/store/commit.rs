//! Durability: the group commit that shares one `fsync` between concurrent writers, the
//! batching of status writes, and the announcement of durable changes.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex, PoisonError, RwLock};

use redb::{Database, Durability, ReadableTable as _};
use serde_json::Value;
use tokio::sync::{broadcast, watch};

use crate::standalone::store::change::{Change, ChangeLabels, Observer, StoreMetrics};
use crate::standalone::store::error::StoreError;
use crate::standalone::store::key::Key;
use crate::standalone::store::recovery::lost_cause;
use crate::standalone::store::tx::{Announced, Tx};

use super::{lock, ObjectStore, META, OBJECTS, OWNED, SYNCED_KEY, VERSION_KEY};

pub(super) struct Inner {
    /// The redb handle; `None` after an I/O failure until it is reopened. Transactions hold
    /// it shared while they begin (writes: while they run); a reopen holds it alone.
    pub(super) db: RwLock<Option<Database>>,
    /// An I/O failure poisoned the handle: the next use reopens it.
    pub(super) broken: std::sync::atomic::AtomicBool,
    pub(super) path: PathBuf,
    pub(super) events: broadcast::Sender<Change>,
    pub(super) observers: RwLock<Vec<Observer>>,
    /// Held from the start of a write transaction until its changes are queued for
    /// announcement, so watchers see changes in commit (resourceVersion) order.
    pub(super) write_order: Mutex<()>,
    pub(super) group: Mutex<GroupCommit>,
    /// Wakes blocking writers when a durable commit finished.
    pub(super) synced_blocking: Condvar,
    /// Wakes async writers when a durable commit finished; carries [`GroupCommit::synced`].
    pub(super) synced_async: watch::Sender<u64>,
    /// Blocking threads async writers may hold while a durable commit runs. Commits take
    /// turns on the write lock anyway; more threads would only each hold memory.
    pub(super) commit_threads: tokio::sync::Semaphore,
    /// Status writes waiting to share one transaction.
    pub(super) batch: Mutex<StatusBatch>,
    pub(super) metrics: StoreMetrics,
}

/// See [`Inner::commit_threads`].
pub(super) const COMMIT_THREADS: usize = 16;

/// Where the group commit stands. Sequence numbers count committed write transactions.
#[derive(Default)]
pub(super) struct GroupCommit {
    /// Last transaction committed (visible, maybe not yet durable).
    pub(super) committed: u64,
    /// Last transaction known durable and announced.
    pub(super) synced: u64,
    /// A writer is running the durable commit; the others wait for it.
    pub(super) syncing: bool,
    /// Transactions up to this one were committed but never made durable, and were dropped
    /// when an I/O failure made the database reopen; their writers get `lost_because`.
    pub(super) lost_through: u64,
    /// Why they were lost: whether the disk was full, and the error.
    pub(super) lost_because: Option<(bool, String)>,
    /// Changes of transactions not yet durable, to announce once they are.
    pub(super) pending: VecDeque<(u64, Announced)>,
}

/// How long the first status write of a batch waits for others to join it. Status writes of
/// heartbeating proplets arrive spread out, about one per proplet per flush interval; each
/// transaction of its own cost more CPU than the heartbeat it records (copy-on-write of the
/// tree's pages, the counter, the commit), and a few milliseconds more on a status that is
/// refreshed every few seconds changes nothing a reader can see.
pub(super) const BATCH_WINDOW: std::time::Duration = std::time::Duration::from_millis(20);

/// Status writes queued for the next batch transaction (see
/// [`ObjectStore::write_status_batched`]).
#[derive(Default)]
pub(super) struct StatusBatch {
    pub(super) queued: Vec<QueuedStatus>,
    /// A flusher task is waiting out the window; writes join `queued` until it takes them.
    pub(super) open: bool,
}

/// One queued status write and where its outcome goes: the object as stored and the
/// transaction to wait on for durability.
pub(super) struct QueuedStatus {
    pub(super) key: Key,
    pub(super) status: Value,
    pub(super) expected: Option<String>,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<(Value, u64), StoreError>>,
}

impl ObjectStore {
    /// Commits every queued status write in one transaction and answers each writer.
    pub(super) async fn flush_batch(&self) {
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

    /// Runs `f` in one write transaction, commits it if it changed anything and returns once
    /// the commit is durable and announced. An error from `f` aborts the transaction, leaving
    /// the store untouched.
    pub(super) fn write<T>(
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
    pub(super) async fn write_async<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Tx<'_>) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (out, seq) = self.write_async_nowait(f).await?;
        self.durable(seq).await?;
        Ok(out)
    }

    /// The commit of [`ObjectStore::write_async`] without the wait for durability: returns
    /// the transaction's sequence number to wait on.
    pub(super) async fn write_async_nowait<T: Send + 'static>(
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
    pub(super) fn commit<T>(
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
    pub(super) fn commit_on<T>(
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
                owned: txn.open_table(OWNED)?,
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
    pub(super) fn sync_state(&self, seq: u64) -> Result<Option<bool>, StoreError> {
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
    pub(super) fn durable_blocking(&self, seq: u64) -> Result<(), StoreError> {
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
    pub(super) async fn durable(&self, seq: u64) -> Result<(), StoreError> {
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
    pub(super) fn sync_and_announce(&self) {
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
    pub(super) fn commit_durably(&self) -> Result<u64, StoreError> {
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
