//! The result spool: every result is written to disk before it is sent and forgotten only when
//! the broker acknowledges it, so results survive broker outages and agent restarts.
//!
//! The spool is one append-only journal (`journal` in the spool directory). A result is an
//! *entry* record; a delivered or discarded result is a *consumed* record naming the entry.
//! Every record carries its length and a CRC, so a crash mid-append leaves a torn tail that the
//! next open cuts off (keeping the bytes aside) instead of a broken spool.
//!
//! Why a journal and not a file per result: creating, renaming and deleting a file per result
//! cost the agent more kernel time than running the task (inode allocation, directory locks,
//! a directory scan per send), and every result needed its own `fsync`. Appends share one
//! `fsync` instead: results pushed while another push syncs are made durable by the next sync
//! together (group commit). Consumed records are not synced: after a crash a delivered result
//! can be sent again (at least once), never lost.
//!
//! The journal is cut back to nothing whenever every entry is consumed, and rewritten with
//! only the live entries when it grows large while a backlog waits.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// A queued message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// MQTT topic.
    pub topic: String,
    /// Payload (JSON text).
    pub payload: String,
    seq: u64,
}

/// A bounded on-disk FIFO of outgoing results.
pub struct Spool {
    dir: PathBuf,
    max_entries: usize,
    journal: Mutex<Journal>,
    /// Records made durable so far; held while syncing, so concurrent pushers queue here and
    /// the first one through syncs for everyone who appended before it.
    synced: Mutex<u64>,
    added: Notify,
}

/// The journal file and what it holds; appends happen under this lock.
struct Journal {
    file: Arc<File>,
    /// Bytes in the file.
    len: u64,
    /// Records appended since the spool was opened, across rewrites.
    appended: u64,
    next_seq: u64,
    /// Entries not consumed yet, oldest first, with the size of their record.
    pending: BTreeMap<u64, (Entry, u64)>,
    /// Bytes of the pending entries' records: what a rewrite would keep.
    live_bytes: u64,
}

const JOURNAL: &str = "journal";
/// An empty spool whose journal reached this size is cut back to nothing.
const TRUNCATE_WHEN_EMPTY_AT: u64 = 256 * 1024;
/// A journal this large, more than half of it consumed records, is rewritten.
const REWRITE_AT: u64 = 16 * 1024 * 1024;

const KIND_ENTRY: u8 = 1;
const KIND_CONSUMED: u8 = 2;
/// kind (1) + seq (8) + body length (4) + CRC of all that and the body (4).
const HEADER: usize = 17;
/// Larger bodies are read as corruption: results are bounded far below this by MQTT.
const MAX_BODY: usize = 256 * 1024 * 1024;
/// Higher sequence numbers are read as corruption: an agent spooling a million results a
/// second would need 290,000 years to reach it, and the next number must still fit a `u64`.
const MAX_SEQ: u64 = i64::MAX as u64;

/// An entry record's body; borrowed when written, owned when read back.
#[derive(Serialize, Deserialize)]
struct Body<'a> {
    #[serde(borrow)]
    topic: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    payload: std::borrow::Cow<'a, str>,
}

fn encode_body(topic: &str, payload: &str) -> io::Result<Vec<u8>> {
    serde_json::to_vec(&Body {
        topic: topic.into(),
        payload: payload.into(),
    })
    .map_err(io::Error::other)
}

impl Spool {
    /// Opens (or creates) the spool in `dir` and replays its journal. Results left by older
    /// agents as one file per result are moved into the journal, oldest first.
    pub fn open(dir: &Path, max_entries: usize) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        // A rewrite that never replaced the journal: the journal is still the whole truth.
        match fs::remove_file(dir.join(format!("{JOURNAL}.rewrite"))) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let path = dir.join(JOURNAL);
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let replayed = replay(&bytes);
        if replayed.valid_len < bytes.len() as u64 {
            // A torn or damaged tail: keep its bytes for inspection, then cut it off so new
            // records follow the last good one.
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis())
                .unwrap_or(0);
            let aside = dir.join(format!("{JOURNAL}.damaged-at-{}-{now}", replayed.valid_len));
            fs::write(&aside, &bytes[replayed.valid_len as usize..])?;
            file.set_len(replayed.valid_len)?;
            file.sync_all()?;
        }
        let live_bytes = replayed.pending.values().map(|(_, size)| size).sum();
        let spool = Self {
            dir: dir.to_owned(),
            max_entries: max_entries.max(1),
            journal: Mutex::new(Journal {
                file: Arc::new(file),
                len: replayed.valid_len,
                appended: 0,
                next_seq: replayed.last_seq + 1,
                pending: replayed.pending,
                live_bytes,
            }),
            synced: Mutex::new(0),
            added: Notify::new(),
        };
        spool.import_files()?;
        Ok(spool)
    }

    /// Appends a message and returns once it is durable. When the spool is full the oldest
    /// entry is discarded (and returned) so the newest results are kept.
    pub fn push(&self, topic: &str, payload: &str) -> io::Result<Option<Entry>> {
        let (dropped, appended) = self.append(topic, payload)?;
        self.sync_through(appended)?;
        self.added.notify_one();
        Ok(dropped)
    }

    /// Appends `payloads` on `topic` and returns once all are durable, with one sync for
    /// them all; how many of the oldest entries a full spool discarded for them.
    pub fn push_all(&self, topic: &str, payloads: &[String]) -> io::Result<usize> {
        let mut dropped = 0;
        let mut appended = 0;
        for payload in payloads {
            let (gone, at) = self.append(topic, payload)?;
            dropped += usize::from(gone.is_some());
            appended = at;
        }
        if !payloads.is_empty() {
            self.sync_through(appended)?;
            self.added.notify_one();
        }
        Ok(dropped)
    }

    /// The oldest entry, if any.
    pub fn oldest(&self) -> Option<Entry> {
        self.lock_journal()
            .pending
            .first_key_value()
            .map(|(_, (entry, _))| entry.clone())
    }

    /// The `n` oldest entries, oldest first.
    pub fn oldest_n(&self, n: usize) -> Vec<Entry> {
        self.lock_journal()
            .pending
            .values()
            .take(n)
            .map(|(entry, _)| entry.clone())
            .collect()
    }

    /// Forgets an entry once the broker acknowledged it.
    pub fn remove(&self, entry: &Entry) -> io::Result<()> {
        let mut journal = self.lock_journal();
        // Already gone (dropped as the oldest of a full spool): nothing to record.
        let Some((_, size)) = journal.pending.remove(&entry.seq) else {
            return Ok(());
        };
        journal.live_bytes -= size;
        journal.write_record(KIND_CONSUMED, entry.seq, &[])?;
        if journal.pending.is_empty() && journal.len >= TRUNCATE_WHEN_EMPTY_AT {
            // Nothing is pending, so an empty journal says the same; a crash before this
            // reaches the disk leaves the old journal, which says the same too.
            journal.file.set_len(0)?;
            journal.len = 0;
        } else if journal.len >= REWRITE_AT && journal.live_bytes * 2 < journal.len {
            self.rewrite(&mut journal)?;
        }
        Ok(())
    }

    /// Entries waiting.
    pub fn len(&self) -> usize {
        self.lock_journal().pending.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves when an entry is added; an addition while nobody waited resolves the next
    /// call at once, so a sender that found the spool empty cannot miss it.
    pub async fn added(&self) {
        self.added.notified().await;
    }

    /// Writes an entry record (and a consumed record for an entry pushed out); returns the
    /// dropped entry and the record count to sync through.
    fn append(&self, topic: &str, payload: &str) -> io::Result<(Option<Entry>, u64)> {
        let body = encode_body(topic, payload)?;
        let mut journal = self.lock_journal();
        let seq = journal.next_seq;
        if seq > MAX_SEQ {
            return Err(io::Error::other(format!(
                "spool sequence numbers exhausted (next would be {seq})"
            )));
        }
        let size = journal.write_record(KIND_ENTRY, seq, &body)?;
        journal.next_seq = seq + 1;
        let entry = Entry {
            topic: topic.to_owned(),
            payload: payload.to_owned(),
            seq,
        };
        journal.pending.insert(seq, (entry, size));
        journal.live_bytes += size;
        let mut dropped = None;
        if journal.pending.len() > self.max_entries {
            if let Some((old_seq, (old, old_size))) = journal.pending.pop_first() {
                journal.live_bytes -= old_size;
                journal.write_record(KIND_CONSUMED, old_seq, &[])?;
                dropped = Some(old);
            }
        }
        Ok((dropped, journal.appended))
    }

    /// Makes every record up to `appended` durable, with one `fsync` for all pushers waiting.
    fn sync_through(&self, appended: u64) -> io::Result<()> {
        let mut synced = self.synced.lock().unwrap_or_else(|e| e.into_inner());
        if *synced >= appended {
            return Ok(());
        }
        let (file, target) = {
            let journal = self.lock_journal();
            (journal.file.clone(), journal.appended)
        };
        file.sync_data()?;
        *synced = target;
        Ok(())
    }

    /// Replaces the journal with one holding only the pending entries.
    fn rewrite(&self, journal: &mut Journal) -> io::Result<()> {
        let tmp = self.dir.join(format!("{JOURNAL}.rewrite"));
        let mut bytes = Vec::with_capacity(journal.live_bytes as usize);
        for (seq, (entry, _)) in &journal.pending {
            let body = encode_body(&entry.topic, &entry.payload)?;
            encode_record(&mut bytes, KIND_ENTRY, *seq, &body);
        }
        {
            let mut file = File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
        }
        let path = self.dir.join(JOURNAL);
        fs::rename(&tmp, &path)?;
        File::open(&self.dir)?.sync_all()?;
        journal.file = Arc::new(OpenOptions::new().append(true).open(&path)?);
        journal.len = bytes.len() as u64;
        journal.live_bytes = journal.len;
        // Everything in the new file is durable already. A pusher still waiting to sync
        // its record syncs the new file, or the replaced one: either is harmless.
        Ok(())
    }

    /// Moves results spooled as one file each (`<seq>.json`, by agents before the journal)
    /// into the journal, then deletes the files. Unreadable ones are renamed `.corrupt`.
    fn import_files(&self) -> io::Result<()> {
        let mut paths: Vec<PathBuf> = fs::read_dir(&self.dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json" || x == "tmp"))
            .collect();
        if paths.is_empty() {
            return Ok(());
        }
        paths.sort();
        let mut imported = Vec::new();
        let mut last = 0;
        for path in paths {
            if path.extension().is_some_and(|x| x == "tmp") {
                // Never renamed into place, so never accepted: not a result.
                fs::remove_file(&path)?;
                continue;
            }
            let bytes = fs::read(&path).unwrap_or_default();
            match serde_json::from_slice::<Body>(&bytes) {
                Ok(body) => {
                    let (_, appended) = self.append(&body.topic, &body.payload)?;
                    last = appended;
                    imported.push(path);
                }
                _ => fs::rename(&path, path.with_extension("corrupt"))?,
            }
        }
        self.sync_through(last)?;
        for path in imported {
            fs::remove_file(path)?;
        }
        Ok(())
    }

    fn lock_journal(&self) -> MutexGuard<'_, Journal> {
        self.journal.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Journal {
    /// Appends one record; returns its size.
    fn write_record(&mut self, kind: u8, seq: u64, body: &[u8]) -> io::Result<u64> {
        let mut bytes = Vec::with_capacity(HEADER + body.len());
        encode_record(&mut bytes, kind, seq, body);
        if let Err(e) = (&*self.file).write_all(&bytes) {
            // Records appended later must not follow a partial one, which would end every
            // replay before them.
            let _ = self.file.set_len(self.len);
            return Err(e);
        }
        self.len += bytes.len() as u64;
        self.appended += 1;
        Ok(bytes.len() as u64)
    }
}

fn encode_record(out: &mut Vec<u8>, kind: u8, seq: u64, body: &[u8]) {
    let start = out.len();
    out.push(kind);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&out[start..]);
    crc.update(body);
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    out.extend_from_slice(body);
}

/// What a journal holds: its pending entries, the highest sequence number it used, and how
/// many of its bytes are whole, valid records.
struct Replayed {
    pending: BTreeMap<u64, (Entry, u64)>,
    last_seq: u64,
    valid_len: u64,
}

fn replay(bytes: &[u8]) -> Replayed {
    let mut pending = BTreeMap::new();
    let mut last_seq = 0;
    let mut at = 0;
    while let Some((kind, seq, body, size)) = decode_record(&bytes[at..]) {
        if seq > MAX_SEQ {
            break;
        }
        match kind {
            KIND_ENTRY => {
                let Ok(parsed) = serde_json::from_slice::<Body>(body) else {
                    break;
                };
                let entry = Entry {
                    topic: parsed.topic.into_owned(),
                    payload: parsed.payload.into_owned(),
                    seq,
                };
                pending.insert(seq, (entry, size as u64));
            }
            KIND_CONSUMED => {
                pending.remove(&seq);
            }
            _ => break,
        }
        last_seq = last_seq.max(seq);
        at += size;
    }
    Replayed {
        pending,
        last_seq,
        valid_len: at as u64,
    }
}

/// One whole record with a matching CRC at the start of `bytes`: kind, seq, body, size.
fn decode_record(bytes: &[u8]) -> Option<(u8, u64, &[u8], usize)> {
    let header = bytes.get(..HEADER)?;
    let kind = header[0];
    let seq = u64::from_le_bytes(header[1..9].try_into().ok()?);
    let body_len = u32::from_le_bytes(header[9..13].try_into().ok()?) as usize;
    let crc = u32::from_le_bytes(header[13..17].try_into().ok()?);
    if body_len > MAX_BODY {
        return None;
    }
    let body = bytes.get(HEADER..HEADER + body_len)?;
    let mut check = crc32fast::Hasher::new();
    check.update(&header[..13]);
    check.update(body);
    (check.finalize() == crc).then_some((kind, seq, body, HEADER + body_len))
}

/// Entries waiting in the spool in `dir`, read without opening it for writing: for tools and
/// tests that watch a running agent's backlog.
pub fn pending_in(dir: &Path) -> io::Result<usize> {
    match fs::read(dir.join(JOURNAL)) {
        Ok(bytes) => Ok(replay(&bytes).pending.len()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spool(dir: &Path, max: usize) -> Spool {
        Spool::open(dir, max).unwrap_or_else(|e| panic!("{e}"))
    }

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"))
    }

    fn push(s: &Spool, payload: &str) -> Option<Entry> {
        s.push("t", payload).unwrap_or_else(|e| panic!("{e}"))
    }

    fn drain(s: &Spool) -> Vec<String> {
        let mut seen = Vec::new();
        while let Some(e) = s.oldest() {
            seen.push(e.payload.clone());
            s.remove(&e).unwrap_or_else(|e| panic!("{e}"));
        }
        seen
    }

    impl Spool {
        fn oldest_after_first(&self) -> Option<Entry> {
            self.lock_journal()
                .pending
                .values()
                .nth(1)
                .map(|(e, _)| e.clone())
        }
    }

    fn journal_len(dir: &Path) -> u64 {
        fs::metadata(dir.join(JOURNAL))
            .unwrap_or_else(|e| panic!("{e}"))
            .len()
    }

    #[test]
    fn push_all_keeps_the_newest_of_a_full_spool_and_counts_what_it_discarded() {
        let dir = tempfile::tempdir().expect("dir");
        let spool = Spool::open(dir.path(), 2).expect("spool");
        let payloads: Vec<String> = (0..3).map(|i| i.to_string()).collect();
        assert_eq!(spool.push_all("t", &payloads).expect("push"), 1);
        let kept: Vec<String> = spool.oldest_n(5).into_iter().map(|e| e.payload).collect();
        assert_eq!(kept, ["1", "2"]);
        assert_eq!(spool.push_all("t", &[]).expect("nothing"), 0);
    }

    #[test]
    fn fifo_order_and_removals_survive_reopening() {
        let dir = tempdir();
        let s = spool(dir.path(), 10);
        for i in 0..4 {
            push(&s, &format!("{i}"));
        }
        let first = s.oldest().unwrap_or_else(|| panic!("empty spool"));
        s.remove(&first).unwrap_or_else(|e| panic!("{e}"));
        drop(s);
        let s = spool(dir.path(), 10);
        assert_eq!(s.len(), 3);
        push(&s, "4");
        assert_eq!(drain(&s), ["1", "2", "3", "4"]);
        drop(s);
        assert_eq!(pending_in(dir.path()).unwrap_or_else(|e| panic!("{e}")), 0);
    }

    #[test]
    fn a_full_spool_drops_the_oldest_and_remembers_it() {
        let dir = tempdir();
        let s = spool(dir.path(), 2);
        push(&s, "a");
        push(&s, "b");
        let dropped = push(&s, "c");
        assert_eq!(dropped.map(|e| e.payload), Some("a".to_owned()));
        assert_eq!(s.len(), 2);
        drop(s);
        assert_eq!(drain(&spool(dir.path(), 2)), ["b", "c"]);
    }

    #[test]
    fn removing_an_entry_twice_is_harmless() {
        let dir = tempdir();
        let s = spool(dir.path(), 1);
        push(&s, "a");
        let a = s.oldest().unwrap_or_else(|| panic!("empty spool"));
        // The sender holds `a` while a push discards it as the oldest.
        push(&s, "b");
        s.remove(&a).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(drain(&s), ["b"]);
    }

    #[test]
    fn a_torn_tail_is_cut_off_and_kept_aside() {
        let dir = tempdir();
        let s = spool(dir.path(), 10);
        push(&s, "kept");
        push(&s, "torn");
        drop(s);
        let whole = journal_len(dir.path());
        // A crash in the middle of the second append.
        let file = OpenOptions::new()
            .write(true)
            .open(dir.path().join(JOURNAL))
            .unwrap_or_else(|e| panic!("{e}"));
        file.set_len(whole - 3).unwrap_or_else(|e| panic!("{e}"));
        drop(file);

        let s = spool(dir.path(), 10);
        let aside: Vec<_> = fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("damaged-at-"))
            .collect();
        assert_eq!(aside.len(), 1, "the torn bytes are kept");
        push(&s, "after");
        drop(s);
        assert_eq!(drain(&spool(dir.path(), 10)), ["kept", "after"]);
    }

    #[test]
    fn a_damaged_record_ends_the_replay_there() {
        let dir = tempdir();
        let s = spool(dir.path(), 10);
        push(&s, "first");
        push(&s, "second");
        drop(s);
        let path = dir.path().join(JOURNAL);
        let mut bytes = fs::read(&path).unwrap_or_else(|e| panic!("{e}"));
        let last = bytes.len() - 2;
        bytes[last] ^= 0xff;
        fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(drain(&spool(dir.path(), 10)), ["first"]);
    }

    #[test]
    fn results_spooled_as_files_by_older_agents_are_imported_in_order() {
        let dir = tempdir();
        let write = |name: &str, text: &str| {
            fs::write(dir.path().join(name), text).unwrap_or_else(|e| panic!("{e}"))
        };
        write(
            "00000000000000000002.json",
            r#"{"topic":"t","payload":"two"}"#,
        );
        write(
            "00000000000000000001.json",
            r#"{"topic":"t","payload":"one"}"#,
        );
        write("00000000000000000003.json", "{torn");
        write("00000000000000000004.tmp", "half");
        let s = spool(dir.path(), 10);
        push(&s, "three");
        assert_eq!(drain(&s), ["one", "two", "three"]);
        let mut left: Vec<String> = fs::read_dir(dir.path())
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["00000000000000000003.corrupt", JOURNAL]);
    }

    #[test]
    fn the_journal_is_cut_back_once_everything_is_delivered() {
        let dir = tempdir();
        let s = spool(dir.path(), 100_000);
        let payload = "x".repeat(1024);
        while journal_len(dir.path()) < TRUNCATE_WHEN_EMPTY_AT {
            push(&s, &payload);
        }
        drain(&s);
        assert_eq!(journal_len(dir.path()), 0);
        push(&s, "next");
        drop(s);
        assert_eq!(drain(&spool(dir.path(), 10)), ["next"]);
    }

    #[test]
    fn a_large_journal_with_a_backlog_is_rewritten_keeping_the_backlog() {
        let dir = tempdir();
        let s = spool(dir.path(), 100_000);
        let payload = "y".repeat(64 * 1024);
        push(&s, "oldest");
        let mut longest = 0;
        let mut rewritten = false;
        for _ in 0..400 {
            push(&s, &payload);
            // Deliver everything but the oldest, so delivered entries pile up.
            let second = s.oldest_after_first();
            if let Some(e) = second {
                s.remove(&e).unwrap_or_else(|e| panic!("{e}"));
            }
            let now = journal_len(dir.path());
            if now < longest {
                rewritten = true;
                break;
            }
            longest = now;
        }
        assert!(rewritten, "never rewritten, reached {longest} bytes");
        // Not before the journal reached the size that calls for it (the last push and
        // removal, at most two records, crossed it).
        assert!(
            longest + 2 * 70 * 1024 >= REWRITE_AT,
            "rewritten at {longest}"
        );
        assert!(journal_len(dir.path()) < 1024 * 1024);
        push(&s, "newest");
        drop(s);
        assert_eq!(drain(&spool(dir.path(), 100_000)), ["oldest", "newest"]);
    }

    #[test]
    fn concurrent_pushes_all_land_in_order_of_their_sequence() {
        let dir = tempdir();
        let s = Arc::new(spool(dir.path(), 10_000));
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..50 {
                        push(&s, &format!("{t}-{i}"));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap_or_else(|_| panic!("a pusher panicked"));
        }
        drop(s);
        let reopened = spool(dir.path(), 10_000);
        let seen = drain(&reopened);
        assert_eq!(seen.len(), 400);
        // Each pusher's own results keep their order.
        for t in 0..8 {
            let mine: Vec<_> = seen
                .iter()
                .filter(|p| p.starts_with(&format!("{t}-")))
                .cloned()
                .collect();
            let expected: Vec<_> = (0..50).map(|i| format!("{t}-{i}")).collect();
            assert_eq!(mine, expected);
        }
    }

    mod hostile {
        //! Journals and old-format files written by someone else: torn, garbage, records with
        //! valid CRCs but nonsense inside. Opening must never panic and never lose what
        //! comes after it.

        use super::*;
        use proptest::collection::vec as pvec;
        use proptest::prelude::*;

        /// One piece of a hostile journal.
        #[derive(Debug, Clone)]
        enum Piece {
            /// A record with a correct CRC: any kind, any sequence number, any body.
            Record { kind: u8, seq: u64, body: Vec<u8> },
            /// An entry whose body is a well-formed result.
            Entry { seq: u64, payload: String },
            /// Bytes with no structure.
            Garbage(Vec<u8>),
            /// A good record cut short.
            Torn { seq: u64, keep: usize },
        }

        fn seq() -> impl Strategy<Value = u64> {
            prop_oneof![
                4 => 0u64..8,
                1 => Just(u64::MAX),
                1 => Just(u64::MAX - 1),
                1 => any::<u64>(),
            ]
        }

        fn piece() -> impl Strategy<Value = Piece> {
            prop_oneof![
                3 => (prop_oneof![Just(KIND_ENTRY), Just(KIND_CONSUMED), any::<u8>()], seq(),
                      pvec(any::<u8>(), 0..40))
                    .prop_map(|(kind, seq, body)| Piece::Record { kind, seq, body }),
                3 => (seq(), "\\PC{0,12}").prop_map(|(seq, payload)| Piece::Entry { seq, payload }),
                1 => pvec(any::<u8>(), 0..40).prop_map(Piece::Garbage),
                1 => (seq(), 0usize..40).prop_map(|(seq, keep)| Piece::Torn { seq, keep }),
            ]
        }

        fn bytes_of(pieces: &[Piece]) -> Vec<u8> {
            let mut out = Vec::new();
            for piece in pieces {
                match piece {
                    Piece::Record { kind, seq, body } => encode_record(&mut out, *kind, *seq, body),
                    Piece::Entry { seq, payload } => {
                        let body = encode_body("t", payload).unwrap_or_default();
                        encode_record(&mut out, KIND_ENTRY, *seq, &body);
                    }
                    Piece::Garbage(bytes) => out.extend_from_slice(bytes),
                    Piece::Torn { seq, keep } => {
                        let mut record = Vec::new();
                        encode_record(
                            &mut record,
                            KIND_ENTRY,
                            *seq,
                            br#"{"topic":"t","payload":"p"}"#,
                        );
                        record.truncate(*keep);
                        out.extend_from_slice(&record);
                    }
                }
            }
            out
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// Whatever the journal holds, the spool opens (or says why not), and a result
            /// pushed afterwards is delivered after everything replayed, also after reopening.
            #[test]
            fn any_journal_opens_and_keeps_what_comes_next(
                pieces in pvec(piece(), 0..10),
                old_file in prop::option::of(pvec(any::<u8>(), 0..40)),
            ) {
                let dir = tempdir();
                fs::write(dir.path().join(JOURNAL), bytes_of(&pieces))
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                if let Some(bytes) = &old_file {
                    fs::write(dir.path().join("00000000000000000001.json"), bytes)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                let counted = pending_in(dir.path()).map_err(|e| TestCaseError::fail(e.to_string()))?;
                let s = match Spool::open(dir.path(), 1_000) {
                    Ok(s) => s,
                    Err(e) => {
                        prop_assert!(!e.to_string().is_empty());
                        return Ok(());
                    }
                };
                // The old-format file adds at most one entry.
                prop_assert!(s.len() >= counted && s.len() <= counted + 1);
                let before = s.len();
                match s.push("t", "after") {
                    Ok(_) => {}
                    Err(e) => {
                        prop_assert!(!e.to_string().is_empty());
                        return Ok(());
                    }
                }
                drop(s);
                let reopened = Spool::open(dir.path(), 1_000)
                    .map_err(|e| TestCaseError::fail(format!("reopening: {e}")))?;
                prop_assert_eq!(reopened.len(), before + 1);
                let seen = drain(&reopened);
                prop_assert_eq!(seen.last().map(String::as_str), Some("after"));
            }
        }
    }
}
