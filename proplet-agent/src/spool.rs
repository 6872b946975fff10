//! The result spool: every result is written to disk before it is sent and deleted only when
//! the broker acknowledges it, so results survive broker outages and agent restarts.
//!
//! One file per message, named by a sequence number so the oldest is sent first. Writes go to
//! a temporary file that is synced and renamed, so a crash never leaves a torn entry.

use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// A queued message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// MQTT topic.
    pub topic: String,
    /// Payload (JSON text).
    pub payload: String,
    #[serde(skip)]
    path: PathBuf,
}

/// A bounded on-disk FIFO of outgoing results.
pub struct Spool {
    dir: PathBuf,
    max_entries: usize,
    next_seq: AtomicU64,
    /// Entries on disk, kept in memory so the depth costs no directory scan.
    count: AtomicUsize,
    added: Notify,
}

impl Spool {
    /// Opens (or creates) the spool in `dir`, continuing its sequence.
    pub fn open(dir: &Path, max_entries: usize) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let existing = list(dir)?;
        let last = existing.iter().filter_map(|p| seq_of(p)).max().unwrap_or(0);
        Ok(Self {
            dir: dir.to_owned(),
            max_entries: max_entries.max(1),
            next_seq: AtomicU64::new(last + 1),
            count: AtomicUsize::new(existing.len()),
            added: Notify::new(),
        })
    }

    /// Appends a message. When the spool is full the oldest entry is discarded (and returned)
    /// so the newest results are kept.
    pub fn push(&self, topic: &str, payload: &str) -> io::Result<Option<Entry>> {
        let seq = self.next_seq.fetch_add(1, Ordering::SeqCst);
        let path = self.dir.join(format!("{seq:020}.json"));
        let tmp = self.dir.join(format!("{seq:020}.tmp"));
        let entry = Entry {
            topic: topic.to_owned(),
            payload: payload.to_owned(),
            path: PathBuf::new(),
        };
        let bytes = serde_json::to_vec(&entry).map_err(io::Error::other)?;
        {
            let mut file = fs::File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
        }
        fs::rename(&tmp, &path)?;
        let mut dropped = None;
        if self.count.fetch_add(1, Ordering::SeqCst) + 1 > self.max_entries {
            if let Some(oldest) = list(&self.dir)?.first() {
                dropped = read(oldest).ok();
                fs::remove_file(oldest)?;
                self.decrement();
            }
        }
        self.added.notify_one();
        Ok(dropped)
    }

    /// The oldest entry, if any.
    pub fn oldest(&self) -> io::Result<Option<Entry>> {
        for path in list(&self.dir)? {
            match read(&path) {
                Ok(entry) => return Ok(Some(entry)),
                // An unreadable entry cannot ever be sent: set it aside instead of blocking.
                Err(_) => {
                    if fs::rename(&path, path.with_extension("corrupt")).is_ok() {
                        self.decrement();
                    }
                }
            }
        }
        Ok(None)
    }

    /// Removes an entry once the broker acknowledged it.
    pub fn remove(&self, entry: &Entry) -> io::Result<()> {
        match fs::remove_file(&entry.path) {
            Ok(()) => {
                self.decrement();
                Ok(())
            }
            // Already gone (dropped as the oldest of a full spool): nothing to count.
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// One entry fewer; saturating, in case files were placed in the directory by hand.
    fn decrement(&self) {
        let _ = self
            .count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                Some(c.saturating_sub(1))
            });
    }

    /// Entries waiting.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves when an entry is added after the call.
    pub async fn added(&self) {
        self.added.notified().await;
    }
}

fn list(dir: &Path) -> io::Result<Vec<PathBuf>> {
    let mut paths: Vec<PathBuf> = fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    Ok(paths)
}

fn seq_of(path: &Path) -> Option<u64> {
    path.file_stem()?.to_str()?.parse().ok()
}

fn read(path: &Path) -> io::Result<Entry> {
    let bytes = fs::read(path)?;
    let mut entry: Entry = serde_json::from_slice(&bytes).map_err(io::Error::other)?;
    entry.path = path.to_owned();
    Ok(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spool(dir: &Path, max: usize) -> Spool {
        match Spool::open(dir, max) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn fifo_order_survives_reopening() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = spool(dir.path(), 10);
        for i in 0..3 {
            s.push("t", &format!("{i}"))
                .unwrap_or_else(|e| panic!("{e}"));
        }
        drop(s);
        let s = spool(dir.path(), 10);
        s.push("t", "3").unwrap_or_else(|e| panic!("{e}"));
        let mut seen = Vec::new();
        while let Some(e) = s.oldest().unwrap_or_else(|e| panic!("{e}")) {
            seen.push(e.payload.clone());
            s.remove(&e).unwrap_or_else(|e| panic!("{e}"));
        }
        assert_eq!(seen, ["0", "1", "2", "3"]);
    }

    #[test]
    fn a_full_spool_drops_the_oldest() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = spool(dir.path(), 2);
        s.push("t", "a").unwrap_or_else(|e| panic!("{e}"));
        s.push("t", "b").unwrap_or_else(|e| panic!("{e}"));
        let dropped = s.push("t", "c").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(dropped.map(|e| e.payload), Some("a".to_owned()));
        assert_eq!(s.len(), 2);
    }

    #[test]
    fn corrupt_entries_are_set_aside() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = spool(dir.path(), 5);
        fs::write(dir.path().join("00000000000000000000.json"), b"{torn")
            .unwrap_or_else(|e| panic!("{e}"));
        s.push("t", "ok").unwrap_or_else(|e| panic!("{e}"));
        let first = s.oldest().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(first.map(|e| e.payload), Some("ok".to_owned()));
    }
}
