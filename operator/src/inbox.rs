//! What the broker reported about tasks, held until a status write includes it.
//!
//! Results are not dropped because a Task is not (yet) in a driver's cache: they wait here,
//! keyed by the task id on the wire (the Task's UID), until a reconcile writes them into the
//! status and consumes them, or for [`UNKNOWN_REPORTS_KEPT`] when no Task has that UID. Task metrics keep only the latest sample, since only the latest
//! is shown. The dispatch ledger remembers which runs this process already started, so a
//! retried reconcile never publishes a start twice.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use crate::crd::common::MetricsSample;
use crate::decision::task::ReportedResult;

/// How long a report waits for a task this process does not know before it is dropped:
/// with sharded watches a replica hears every namespace's reports but caches only its own,
/// a result can come for a task deleted meanwhile, and a device can name any task id.
pub const UNKNOWN_REPORTS_KEPT: Duration = Duration::from_secs(300);

/// Results kept per task before further ones are refused (a device flooding one task id).
pub const MAX_PENDING_RESULTS_PER_TASK: usize = 256;

#[derive(Debug)]
struct Pending {
    results: Vec<ReportedResult>,
    metrics: Option<MetricsSample>,
    /// When the first of these reports arrived.
    since: Instant,
}

impl Default for Pending {
    fn default() -> Self {
        Self {
            results: Vec::new(),
            metrics: None,
            since: Instant::now(),
        }
    }
}

/// Pending task reports by task UID.
#[derive(Debug, Default)]
pub struct TaskInbox {
    pending: Mutex<HashMap<String, Pending>>,
}

/// Whether a result was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// Queued for the task's next reconcile.
    Yes,
    /// Refused: the task already has [`MAX_PENDING_RESULTS_PER_TASK`] unapplied results.
    Full,
}

impl TaskInbox {
    /// An empty inbox.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a result for task `uid`.
    pub fn push_result(&self, uid: &str, result: ReportedResult) -> Queued {
        let mut pending = self.lock();
        let entry = pending.entry(uid.to_owned()).or_default();
        if entry.results.len() >= MAX_PENDING_RESULTS_PER_TASK {
            return Queued::Full;
        }
        entry.results.push(result);
        Queued::Yes
    }

    /// Replaces the pending metrics sample of task `uid`.
    pub fn push_metrics(&self, uid: &str, sample: MetricsSample) {
        self.lock().entry(uid.to_owned()).or_default().metrics = Some(sample);
    }

    /// What is pending for `uid`, without consuming it.
    pub fn peek(&self, uid: &str) -> (Vec<ReportedResult>, Option<MetricsSample>) {
        self.lock()
            .get(uid)
            .map(|p| (p.results.clone(), p.metrics.clone()))
            .unwrap_or_default()
    }

    /// Forgets the first `results` results and, if `metrics` is the pending sample, the
    /// metrics: a status write that included them succeeded.
    pub fn consume(&self, uid: &str, results: usize, metrics: Option<&MetricsSample>) {
        let mut pending = self.lock();
        let Some(entry) = pending.get_mut(uid) else {
            return;
        };
        let n = results.min(entry.results.len());
        entry.results.drain(..n);
        if metrics.is_some() && entry.metrics.as_ref() == metrics {
            entry.metrics = None;
        }
        if entry.results.is_empty() && entry.metrics.is_none() {
            pending.remove(uid);
        }
    }

    /// Drops everything pending for a task that no longer exists.
    pub fn forget(&self, uid: &str) {
        self.lock().remove(uid);
    }

    /// [`TaskInbox::prune_unknown`] with the age every driver uses, saying in the log when
    /// something went.
    pub fn prune_unknown_reports(&self, known: impl Fn(&str) -> bool) {
        let dropped = self.prune_unknown(UNKNOWN_REPORTS_KEPT, known);
        if dropped > 0 {
            tracing::info!(
                tasks = dropped,
                "dropped reports kept for tasks this process does not know (deleted, never created, or another replica's)"
            );
        }
    }

    /// Drops the reports waiting longer than `age` for a task `known` does not know, and
    /// says how many tasks' reports went. With sharded watches a replica hears the reports
    /// of every namespace but caches only its own: the others' would wait here for ever. If
    /// such a task comes to this replica later, its start goes again when the result is
    /// overdue, and the agent answers with the result it kept.
    pub fn prune_unknown(&self, age: Duration, known: impl Fn(&str) -> bool) -> usize {
        let mut pending = self.lock();
        let before = pending.len();
        pending.retain(|uid, p| p.since.elapsed() < age || known(uid));
        before - pending.len()
    }

    /// Task ids with pending reports (for tests and metrics).
    pub fn waiting_tasks(&self) -> usize {
        self.lock().len()
    }
}

/// Runs whose start this process already published, as (task UID, run number), with the
/// devices they were sent to.
#[derive(Debug, Default)]
pub struct DispatchLedger {
    sent: Mutex<HashMap<(String, i64), Dispatched>>,
}

#[derive(Debug, Clone)]
struct Dispatched {
    at: DateTime<Utc>,
    clients: Vec<String>,
}

impl DispatchLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(String, i64), Dispatched>> {
        self.sent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether run `run` of task `uid` was started.
    pub fn contains(&self, uid: &str, run: i64) -> bool {
        self.lock().contains_key(&(uid.to_owned(), run))
    }

    /// When run `run` of task `uid` was started by this process.
    pub fn dispatched_at(&self, uid: &str, run: i64) -> Option<DateTime<Utc>> {
        self.lock().get(&(uid.to_owned(), run)).map(|d| d.at)
    }

    /// Records that run `run` of task `uid` was started at `at` on `clients`; older runs are
    /// forgotten.
    pub fn record(&self, uid: &str, run: i64, at: DateTime<Utc>, clients: Vec<String>) {
        let mut sent = self.lock();
        sent.retain(|(u, r), _| u != uid || *r >= run);
        sent.insert((uid.to_owned(), run), Dispatched { at, clients });
    }

    /// Forgets a deleted task.
    pub fn forget(&self, uid: &str) {
        self.lock().retain(|(u, _), _| u != uid);
    }

    /// Forgets the starts sent to `client`, so they are published again: the device began a
    /// new session and may have missed them (a start sent while it moved between broker
    /// nodes, or while its subscriptions were refused, reached nobody). Devices answer a
    /// repeated start with the result they have, or ignore it while the run is going on.
    /// Returns the task UIDs concerned.
    pub fn forget_client(&self, client: &str) -> Vec<String> {
        let mut forgotten = Vec::new();
        self.lock().retain(|(uid, _), dispatched| {
            let sent_there = dispatched.clients.iter().any(|c| c == client);
            if sent_there {
                forgotten.push(uid.clone());
            }
            !sent_there
        });
        forgotten
    }
}

/// MQTT client ids this process has heard from (heartbeat or discovery) since they last
/// went away. A start published to a device that is not listening is lost (sessions are not
/// persistent), so dispatch waits for the device to be heard from first: after an operator
/// restart or a leader failover, a Proplet's stored `Running` may predate this broker.
#[derive(Debug, Default)]
pub struct LiveSessions {
    clients: Mutex<HashSet<String>>,
}

impl LiveSessions {
    fn lock(&self) -> MutexGuard<'_, HashSet<String>> {
        self.clients.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `client_id` reported since it last went away.
    pub fn contains(&self, client_id: &str) -> bool {
        self.lock().contains(client_id)
    }

    /// The device reported: it is connected and subscribed.
    pub fn heard_from(&self, client_id: &str) {
        let mut clients = self.lock();
        if !clients.contains(client_id) {
            clients.insert(client_id.to_owned());
        }
    }

    /// The device went away (goodbye, Last Will, or a closed connection).
    pub fn gone(&self, client_id: &str) {
        self.lock().remove(client_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn result(from: &str) -> ReportedResult {
        ReportedResult {
            client_id: from.into(),
            value: json!("42"),
            error: None,
        }
    }

    #[test]
    fn results_wait_until_consumed_and_later_ones_stay() {
        let inbox = TaskInbox::new();
        inbox.push_result("u1", result("a"));
        let (seen, _) = inbox.peek("u1");
        inbox.push_result("u1", result("b"));
        inbox.consume("u1", seen.len(), None);
        let (left, _) = inbox.peek("u1");
        assert_eq!(left, vec![result("b")]);
        inbox.consume("u1", 1, None);
        assert_eq!(inbox.waiting_tasks(), 0);
    }

    #[test]
    fn only_old_reports_of_unknown_tasks_are_pruned() {
        let inbox = TaskInbox::new();
        inbox.push_result("known", result("a"));
        inbox.push_result("foreign", result("a"));
        assert_eq!(inbox.prune_unknown(Duration::from_secs(60), |_| false), 0);
        std::thread::sleep(Duration::from_millis(20));
        inbox.push_result("fresh", result("a"));
        let pruned = inbox.prune_unknown(Duration::from_millis(10), |uid| uid == "known");
        assert_eq!(pruned, 1);
        assert_eq!(inbox.peek("foreign").0, Vec::new());
        assert_eq!(inbox.peek("known").0, vec![result("a")]);
        assert_eq!(inbox.peek("fresh").0, vec![result("a")]);
    }

    #[test]
    fn a_flooded_task_refuses_more_results() {
        let inbox = TaskInbox::new();
        for _ in 0..MAX_PENDING_RESULTS_PER_TASK {
            assert_eq!(inbox.push_result("u", result("a")), Queued::Yes);
        }
        assert_eq!(inbox.push_result("u", result("a")), Queued::Full);
    }

    #[test]
    fn metrics_are_consumed_only_if_unchanged() {
        let inbox = TaskInbox::new();
        let first = MetricsSample {
            memory_bytes: 1,
            ..MetricsSample::default()
        };
        let second = MetricsSample {
            memory_bytes: 2,
            ..MetricsSample::default()
        };
        inbox.push_metrics("u", first.clone());
        inbox.push_metrics("u", second.clone());
        inbox.consume("u", 0, Some(&first));
        assert_eq!(inbox.peek("u").1, Some(second));
    }

    #[test]
    fn the_ledger_remembers_the_current_run_only() {
        let ledger = DispatchLedger::new();
        let at = chrono::DateTime::UNIX_EPOCH;
        ledger.record("u", 1, at, vec!["dev".into()]);
        assert!(ledger.contains("u", 1));
        ledger.record("u", 2, at, vec!["dev".into()]);
        assert!(!ledger.contains("u", 1));
        assert_eq!(ledger.dispatched_at("u", 2), Some(at));
        ledger.forget("u");
        assert!(!ledger.contains("u", 2));
    }

    #[test]
    fn a_device_that_rejoins_gets_its_starts_again() {
        let ledger = DispatchLedger::new();
        let at = chrono::DateTime::UNIX_EPOCH;
        ledger.record("on-a", 1, at, vec!["a".into()]);
        ledger.record("on-b", 1, at, vec!["b".into()]);
        ledger.record("everywhere", 1, at, vec!["a".into(), "b".into()]);
        let mut again = ledger.forget_client("a");
        again.sort();
        assert_eq!(again, ["everywhere", "on-a"]);
        assert!(!ledger.contains("on-a", 1));
        assert!(ledger.contains("on-b", 1));
        assert!(ledger.forget_client("a").is_empty());
    }
}
