//! The task logs propeller keeps in memory: the lines agents sent for each Task, the newest
//! [`LogSettings::task_bytes`] of it, for [`LogSettings::retention`] after its last line, and
//! at most [`LogSettings::total_bytes`] in all (the logs quiet longest go first). Readers
//! get what is kept, followers each line as it arrives. Nothing here touches a backend:
//! the broker's routing appends, the log endpoints read.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use propeller_broker::protocol::LogLine;
use propeller_core::object_name::ObjectName;
use serde::Serialize;
use tokio::sync::broadcast;

use crate::state::lock;

/// How much of the task logs is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    /// Bytes of text kept per Task (the newest lines).
    pub task_bytes: usize,
    /// How long a Task's log is kept after its last line.
    pub retention: Duration,
    /// Bytes of text kept in all.
    pub total_bytes: usize,
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            task_bytes: 256 * 1024,
            retention: Duration::from_secs(3600),
            total_bytes: 64 * 1024 * 1024,
        }
    }
}

/// One line of a task's log, as kept and served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoredLine {
    /// When the agent read it.
    pub at: DateTime<Utc>,
    /// The Proplet that ran the task.
    pub proplet: String,
    /// `stdout`, `stderr`, or `agent` for the agent's own notes (lines dropped at a limit).
    pub stream: &'static str,
    /// The text.
    pub text: String,
}

impl StoredLine {
    fn size(&self) -> usize {
        self.text.len() + self.proplet.len() + 32
    }
}

/// Which of a log's lines a reader wants.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogQuery {
    /// Only the last this many.
    pub tail: Option<usize>,
    /// Only those read at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only those of this Proplet (a broadcast task runs on several).
    pub proplet: Option<String>,
}

impl LogQuery {
    /// Whether `line` passes the time and proplet filters (the tail is applied apart).
    pub fn admits(&self, line: &StoredLine) -> bool {
        self.since.is_none_or(|since| line.at >= since)
            && self.proplet.as_deref().is_none_or(|p| line.proplet == p)
    }
}

/// The log of one Task.
struct TaskLog {
    /// The Task's UID: a Task created again under the same name starts a new log.
    uid: String,
    lines: VecDeque<StoredLine>,
    bytes: usize,
    /// When the last line arrived.
    last: DateTime<Utc>,
    /// Followers of this log.
    /// Followers of this log, once one came: a channel holds its whole backlog from the
    /// start (made for each of a thousand printing tasks, they took about 100 MiB).
    follow: Option<broadcast::Sender<StoredLine>>,
}

/// Lines a slow follower may fall behind by before it misses some (and is told).
const FOLLOW_BACKLOG: usize = 1024;

impl TaskLog {
    fn new(uid: &str, now: DateTime<Utc>) -> Self {
        Self {
            uid: uid.to_owned(),
            lines: VecDeque::new(),
            bytes: 0,
            last: now,
            follow: None,
        }
    }
}

/// The logs of every Task (see the module's documentation).
#[derive(Default)]
pub struct LogStore {
    settings: LogSettings,
    logs: Mutex<Logs>,
}

#[derive(Default)]
struct Logs {
    by_task: HashMap<ObjectName, TaskLog>,
    bytes: usize,
    /// When the logs past their retention were last dropped.
    pruned: Option<DateTime<Utc>>,
}

/// How often appends drop the logs past their retention (more often when it is shorter).
const PRUNE_EVERY: chrono::Duration = chrono::Duration::seconds(60);

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore")
            .field("settings", &self.settings)
            .field("bytes", &self.bytes())
            .finish()
    }
}

impl LogStore {
    /// Empty logs kept by `settings`.
    pub fn new(settings: LogSettings) -> Self {
        Self {
            settings,
            logs: Mutex::default(),
        }
    }

    /// Appends `lines` that `proplet` sent for the Task `task` with UID `uid`.
    pub fn append(&self, task: &ObjectName, uid: &str, proplet: &str, lines: &[LogLine]) {
        let now = Utc::now();
        let mut logs = lock(&self.logs);
        let logs = &mut *logs;
        let retention =
            chrono::Duration::from_std(self.settings.retention).unwrap_or(chrono::Duration::MAX);
        if logs
            .pruned
            .is_none_or(|at| now - at >= PRUNE_EVERY.min(retention))
        {
            self.drop_expired(logs, now);
        }
        let log = logs
            .by_task
            .entry(task.clone())
            .or_insert_with(|| TaskLog::new(uid, now));
        if log.uid != uid {
            logs.bytes -= log.bytes;
            *log = TaskLog::new(uid, now);
        }
        for line in lines {
            let stored = StoredLine {
                at: Utc.timestamp_millis_opt(line.at_ms).single().unwrap_or(now),
                proplet: proplet.to_owned(),
                stream: line.stream.as_str(),
                text: line.text.clone(),
            };
            log.bytes += stored.size();
            logs.bytes += stored.size();
            if let Some(follow) = &log.follow {
                // Followers that went away are no failure.
                let _ = follow.send(stored.clone());
            }
            log.lines.push_back(stored);
        }
        log.last = now;
        while log.bytes > self.settings.task_bytes {
            let Some(oldest) = log.lines.pop_front() else {
                break;
            };
            log.bytes -= oldest.size();
            logs.bytes -= oldest.size();
        }
        if logs.bytes > self.settings.total_bytes {
            self.evict(logs, now);
        }
    }

    /// The kept lines of `task` that `query` wants, oldest first.
    pub fn read(&self, task: &ObjectName, query: &LogQuery) -> Vec<StoredLine> {
        lock(&self.logs)
            .by_task
            .get(task)
            .map(|log| select(log, query))
            .unwrap_or_default()
    }

    /// The kept lines `query` wants and a subscription to the lines after them, taken under
    /// one lock so that no line is missed or seen twice.
    pub fn follow(
        &self,
        task: &ObjectName,
        uid: &str,
        query: &LogQuery,
    ) -> (Vec<StoredLine>, broadcast::Receiver<StoredLine>) {
        let now = Utc::now();
        let mut logs = lock(&self.logs);
        let log = logs
            .by_task
            .entry(task.clone())
            .or_insert_with(|| TaskLog::new(uid, now));
        let receiver = log
            .follow
            .get_or_insert_with(|| broadcast::channel(FOLLOW_BACKLOG).0)
            .subscribe();
        (select(log, query), receiver)
    }

    /// Forgets the logs quiet for longer than the retention and followed by no one.
    fn drop_expired(&self, logs: &mut Logs, now: DateTime<Utc>) {
        let retention =
            chrono::Duration::from_std(self.settings.retention).unwrap_or(chrono::Duration::MAX);
        let mut freed = 0;
        logs.by_task.retain(|_, log| {
            let followed = log.follow.as_ref().is_some_and(|f| f.receiver_count() > 0);
            let keep = now - log.last <= retention || followed;
            if !keep {
                freed += log.bytes;
            }
            keep
        });
        logs.bytes -= freed;
        logs.pruned = Some(now);
    }

    /// Bytes of text kept in all.
    pub fn bytes(&self) -> usize {
        lock(&self.logs).bytes
    }

    /// Drops whole logs, the longest quiet first, until the total fits again.
    fn evict(&self, logs: &mut Logs, now: DateTime<Utc>) {
        let mut by_age: Vec<(DateTime<Utc>, ObjectName)> = logs
            .by_task
            .iter()
            .map(|(name, log)| (log.last, name.clone()))
            .collect();
        by_age.sort();
        for (last, name) in by_age {
            if logs.bytes <= self.settings.total_bytes || last >= now {
                break;
            }
            if let Some(log) = logs.by_task.remove(&name) {
                logs.bytes -= log.bytes;
            }
        }
    }
}

/// The lines of `log` that `query` wants, oldest first.
fn select(log: &TaskLog, query: &LogQuery) -> Vec<StoredLine> {
    let mut lines: Vec<StoredLine> = log
        .lines
        .iter()
        .filter(|l| query.admits(l))
        .cloned()
        .collect();
    if let Some(tail) = query.tail {
        lines.drain(..lines.len().saturating_sub(tail));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use propeller_broker::protocol::LogStream;

    fn line(text: &str, at_ms: i64) -> LogLine {
        LogLine {
            at_ms,
            stream: LogStream::Stdout,
            text: text.into(),
        }
    }

    fn texts(lines: &[StoredLine]) -> Vec<&str> {
        lines.iter().map(|l| l.text.as_str()).collect()
    }

    #[test]
    fn reads_filter_by_time_proplet_and_tail() {
        let logs = LogStore::new(LogSettings::default());
        let task = ObjectName::new("ns", "t");
        logs.append(&task, "u1", "a", &[line("a1", 1_000), line("a2", 3_000)]);
        logs.append(&task, "u1", "b", &[line("b1", 2_000)]);
        assert_eq!(
            texts(&logs.read(&task, &LogQuery::default())),
            ["a1", "a2", "b1"]
        );
        let only_b = LogQuery {
            proplet: Some("b".into()),
            ..LogQuery::default()
        };
        assert_eq!(texts(&logs.read(&task, &only_b)), ["b1"]);
        let since = LogQuery {
            since: Utc.timestamp_millis_opt(2_000).single(),
            tail: Some(1),
            ..LogQuery::default()
        };
        assert_eq!(texts(&logs.read(&task, &since)), ["b1"]);
        // A Task created again under the name starts afresh.
        logs.append(&task, "u2", "a", &[line("new", 4_000)]);
        assert_eq!(texts(&logs.read(&task, &LogQuery::default())), ["new"]);
    }

    #[test]
    fn each_log_keeps_its_newest_bytes_and_the_total_drops_the_quietest() {
        let settings = LogSettings {
            task_bytes: 200,
            retention: Duration::from_secs(3600),
            total_bytes: 300,
        };
        let logs = LogStore::new(settings);
        let old = ObjectName::new("ns", "old");
        let new = ObjectName::new("ns", "new");
        let text = "x".repeat(60);
        for i in 0..10 {
            logs.append(&old, "u", "p", &[line(&format!("{i}{text}"), i)]);
        }
        let kept = logs.read(&old, &LogQuery::default());
        assert!(kept.len() < 10 && kept.last().is_some_and(|l| l.text.starts_with('9')));
        assert!(logs.bytes() <= 200);
        std::thread::sleep(Duration::from_millis(5));
        for i in 0..2 {
            logs.append(&new, "v", "p", &[line(&text, i)]);
        }
        assert!(logs.bytes() <= 300, "{} bytes kept", logs.bytes());
        assert!(logs.read(&old, &LogQuery::default()).is_empty());
        assert_eq!(logs.read(&new, &LogQuery::default()).len(), 2);
    }

    #[test]
    fn a_log_quiet_past_its_retention_is_dropped_unless_followed() {
        let logs = LogStore::new(LogSettings {
            retention: Duration::ZERO,
            ..LogSettings::default()
        });
        let (quiet, followed, busy) = (
            ObjectName::new("ns", "quiet"),
            ObjectName::new("ns", "followed"),
            ObjectName::new("ns", "busy"),
        );
        logs.append(&quiet, "u", "p", &[line("q", 1)]);
        let (_, _receiver) = logs.follow(&followed, "v", &LogQuery::default());
        std::thread::sleep(Duration::from_millis(5));
        logs.append(&busy, "w", "p", &[line("b", 2)]);
        assert!(logs.read(&quiet, &LogQuery::default()).is_empty());
        assert_eq!(logs.read(&busy, &LogQuery::default()).len(), 1);
        assert!(lock(&logs.logs).by_task.contains_key(&followed));
    }

    #[tokio::test]
    async fn a_follower_gets_the_kept_lines_then_each_new_one_once() {
        let logs = LogStore::new(LogSettings::default());
        let task = ObjectName::new("ns", "t");
        logs.append(&task, "u", "p", &[line("before", 1)]);
        let (kept, mut live) = logs.follow(&task, "u", &LogQuery::default());
        assert_eq!(texts(&kept), ["before"]);
        logs.append(&task, "u", "p", &[line("after", 2)]);
        let next = live.recv().await.map(|l| l.text).unwrap_or_default();
        assert_eq!(next, "after");
        assert!(live.try_recv().is_err());
    }
}
