//! The runs this agent finished, each with the result it published: a start sent again for a
//! run that already ran (propeller restarted between publishing the start and recording it)
//! is answered with that result instead of running the task a second time.
//!
//! Only starts that carry a run counter (`run`, sent by our operator) are remembered and
//! recognised; a start without one (an upstream manager) always runs, as upstream's does.
//! One entry is kept per task, its latest run, for the last [`FinishedRuns::capacity`] tasks.
//!
//! The memory survives agent restarts, as the result spool does: it is an append-only file of
//! JSON lines (`finished` in the state directory), replayed on open and rewritten with only
//! the live entries when it grows to twice the capacity. A record is appended before its
//! result is spooled and is not synced on its own: after a `kill -9` the kernel still writes
//! it, and only an operating-system crash can lose the latest ones (the task would then run
//! again if its start were repeated). A torn last line is cut off on open.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

const FILE: &str = "finished";

/// The result a finished run published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finished {
    /// The run counter of the start that ran.
    pub run: u64,
    /// The topic the result went to.
    pub topic: String,
    /// The result message (JSON text).
    pub payload: String,
}

/// What the memory says about a start of (task, run).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// That run already finished here, with this result.
    Finished(Finished),
    /// A later run of the task finished here: the start is stale.
    Superseded {
        /// The latest run that finished.
        latest: u64,
    },
    /// Not finished here (as far as the memory reaches): run it.
    New,
}

/// One line of the file.
#[derive(Serialize, Deserialize)]
struct Record {
    id: String,
    #[serde(flatten)]
    finished: Finished,
}

/// Bounded memory of finished runs, persisted in the agent's state directory.
pub struct FinishedRuns {
    path: PathBuf,
    capacity: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    by_task: HashMap<String, Finished>,
    /// Insertion order of (task, run), oldest first; entries a later run replaced are
    /// skipped when evicting and dropped when the queue is compacted.
    order: VecDeque<(String, u64)>,
    file: File,
    /// Lines in the file.
    lines: usize,
}

impl FinishedRuns {
    /// Opens (or creates) the memory in `dir`, keeping at most `capacity` tasks.
    pub fn open(dir: &Path, capacity: usize) -> io::Result<Self> {
        fs::create_dir_all(dir)?;
        let path = dir.join(FILE);
        let capacity = capacity.max(1);
        let mut by_task = HashMap::new();
        let mut order = VecDeque::new();
        let mut lines = 0;
        let mut valid_len = 0u64;
        let mut torn = false;
        match File::open(&path) {
            Ok(file) => {
                let mut reader = BufReader::new(file);
                let mut line = String::new();
                loop {
                    line.clear();
                    let read = reader.read_line(&mut line)?;
                    if read == 0 {
                        break;
                    }
                    let parsed = line
                        .strip_suffix('\n')
                        .and_then(|text| serde_json::from_str::<Record>(text).ok());
                    let Some(record) = parsed else {
                        // A line cut short by a crash (or damaged): it and what follows go.
                        torn = true;
                        break;
                    };
                    valid_len += read as u64;
                    lines += 1;
                    remember(&mut by_task, &mut order, capacity, record);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        if torn {
            file.set_len(valid_len)?;
        }
        let runs = Self {
            path,
            capacity,
            inner: Mutex::new(Inner {
                by_task,
                order,
                file,
                lines,
            }),
        };
        {
            let mut inner = runs.lock();
            if inner.lines > 2 * runs.capacity {
                runs.rewrite(&mut inner)?;
            }
        }
        Ok(runs)
    }

    /// Tasks remembered at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tasks remembered now.
    pub fn len(&self) -> usize {
        self.lock().by_task.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What is known about run `run` of task `id`.
    pub fn seen(&self, id: &str, run: u64) -> Seen {
        match self.lock().by_task.get(id) {
            Some(done) if done.run == run => Seen::Finished(done.clone()),
            Some(done) if done.run > run => Seen::Superseded { latest: done.run },
            _ => Seen::New,
        }
    }

    /// Records that run `finished.run` of task `id` finished with this result; an older run
    /// of the same task is forgotten. The memory is updated even if the file write fails.
    pub fn record(&self, id: &str, finished: Finished) -> io::Result<()> {
        let record = Record {
            id: id.to_owned(),
            finished,
        };
        let mut line = serde_json::to_vec(&record).map_err(io::Error::other)?;
        line.push(b'\n');
        let mut inner = self.lock();
        let inner = &mut *inner;
        remember(&mut inner.by_task, &mut inner.order, self.capacity, record);
        let written = (&inner.file).write_all(&line);
        inner.lines += 1;
        written?;
        if inner.lines > 2 * self.capacity {
            self.rewrite(inner)?;
        }
        Ok(())
    }

    /// Replaces the file with one line per remembered task, oldest first.
    fn rewrite(&self, inner: &mut Inner) -> io::Result<()> {
        let tmp = self.path.with_extension("rewrite");
        let mut bytes = Vec::new();
        let mut lines = 0;
        for (id, run) in &inner.order {
            let Some(done) = inner.by_task.get(id).filter(|d| d.run == *run) else {
                continue;
            };
            let record = Record {
                id: id.clone(),
                finished: done.clone(),
            };
            serde_json::to_writer(&mut bytes, &record).map_err(io::Error::other)?;
            bytes.push(b'\n');
            lines += 1;
        }
        {
            let mut file = File::create(&tmp)?;
            file.write_all(&bytes)?;
            file.sync_all()?;
        }
        fs::rename(&tmp, &self.path)?;
        inner.file = OpenOptions::new().append(true).open(&self.path)?;
        inner.lines = lines;
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Adds `record` (replacing an older run of its task) and evicts the oldest tasks beyond
/// `capacity`.
fn remember(
    by_task: &mut HashMap<String, Finished>,
    order: &mut VecDeque<(String, u64)>,
    capacity: usize,
    record: Record,
) {
    if by_task
        .get(&record.id)
        .is_some_and(|done| done.run > record.finished.run)
    {
        return;
    }
    order.push_back((record.id.clone(), record.finished.run));
    by_task.insert(record.id, record.finished);
    while by_task.len() > capacity {
        let Some((id, run)) = order.pop_front() else {
            break;
        };
        if by_task.get(&id).is_some_and(|done| done.run == run) {
            by_task.remove(&id);
        }
    }
    if order.len() > 2 * capacity {
        order.retain(|(id, run)| by_task.get(id).is_some_and(|done| done.run == *run));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"))
    }

    fn open(dir: &Path, capacity: usize) -> FinishedRuns {
        FinishedRuns::open(dir, capacity).unwrap_or_else(|e| panic!("{e}"))
    }

    fn done(run: u64, payload: &str) -> Finished {
        Finished {
            run,
            topic: "m/d/c/control/proplet/results".into(),
            payload: payload.into(),
        }
    }

    fn record(runs: &FinishedRuns, id: &str, finished: Finished) {
        runs.record(id, finished).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn a_finished_run_is_recognised_and_a_later_run_is_new() {
        let dir = tempdir();
        let runs = open(dir.path(), 10);
        assert_eq!(runs.seen("t", 1), Seen::New);
        record(&runs, "t", done(1, "{\"r\":1}"));
        assert_eq!(runs.seen("t", 1), Seen::Finished(done(1, "{\"r\":1}")));
        assert_eq!(runs.seen("t", 2), Seen::New, "a rerun runs");
        assert_eq!(runs.seen("u", 1), Seen::New, "other tasks are unaffected");
        record(&runs, "t", done(2, "{\"r\":2}"));
        assert_eq!(runs.seen("t", 1), Seen::Superseded { latest: 2 });
        assert_eq!(runs.seen("t", 2), Seen::Finished(done(2, "{\"r\":2}")));
        assert_eq!(runs.len(), 1, "one entry per task");
    }

    #[test]
    fn an_older_run_recorded_late_does_not_replace_a_newer_one() {
        let dir = tempdir();
        let runs = open(dir.path(), 10);
        record(&runs, "t", done(3, "three"));
        record(&runs, "t", done(2, "two"));
        assert_eq!(runs.seen("t", 3), Seen::Finished(done(3, "three")));
    }

    #[test]
    fn the_oldest_tasks_are_forgotten_beyond_the_capacity() {
        let dir = tempdir();
        let runs = open(dir.path(), 3);
        for id in ["a", "b", "c", "d"] {
            record(&runs, id, done(1, id));
        }
        assert_eq!(runs.len(), 3);
        assert_eq!(runs.seen("a", 1), Seen::New);
        assert_eq!(runs.seen("d", 1), Seen::Finished(done(1, "d")));
        // A task's newer run refreshes it: "b" now outlives "c".
        record(&runs, "b", done(2, "b2"));
        record(&runs, "e", done(1, "e"));
        assert_eq!(runs.seen("c", 1), Seen::New);
        assert_eq!(runs.seen("b", 2), Seen::Finished(done(2, "b2")));
    }

    #[test]
    fn the_memory_survives_reopening_and_the_file_stays_bounded() {
        let dir = tempdir();
        let runs = open(dir.path(), 4);
        for n in 0..50u64 {
            record(&runs, &format!("t{}", n % 6), done(n, &format!("p{n}")));
        }
        drop(runs);
        let lines = fs::read_to_string(dir.path().join(FILE))
            .unwrap_or_else(|e| panic!("{e}"))
            .lines()
            .count();
        assert!(lines <= 2 * 4 + 1, "{lines} lines for a capacity of 4");
        let runs = open(dir.path(), 4);
        assert_eq!(runs.len(), 4);
        // The last four records: t2 (run 44), t3 (45), t4 (46), t5 (47)... then t0 (48), t1 (49).
        assert_eq!(runs.seen("t1", 49), Seen::Finished(done(49, "p49")));
        assert_eq!(runs.seen("t0", 48), Seen::Finished(done(48, "p48")));
        assert_eq!(runs.seen("t5", 47), Seen::Finished(done(47, "p47")));
        assert_eq!(runs.seen("t2", 44), Seen::New, "evicted before the restart");
    }

    #[test]
    fn a_torn_last_line_is_cut_off_and_appends_follow_the_good_ones() {
        let dir = tempdir();
        let runs = open(dir.path(), 10);
        record(&runs, "kept", done(1, "k"));
        record(&runs, "torn", done(1, "t"));
        drop(runs);
        let path = dir.path().join(FILE);
        let whole = fs::metadata(&path).unwrap_or_else(|e| panic!("{e}")).len();
        let file = OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{e}"));
        file.set_len(whole - 5).unwrap_or_else(|e| panic!("{e}"));
        drop(file);

        let runs = open(dir.path(), 10);
        assert_eq!(runs.seen("kept", 1), Seen::Finished(done(1, "k")));
        assert_eq!(runs.seen("torn", 1), Seen::New);
        record(&runs, "after", done(1, "a"));
        drop(runs);
        let runs = open(dir.path(), 10);
        assert_eq!(runs.seen("kept", 1), Seen::Finished(done(1, "k")));
        assert_eq!(runs.seen("after", 1), Seen::Finished(done(1, "a")));
    }
}
