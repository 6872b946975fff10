//! Results on their way out: the spool sender (QoS 1, matched to broker acknowledgements)
//! of the result spool and, after it, the log spool; result messages and how they enter
//! the spool.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use propeller_broker::protocol::{ResultValue, TaskResult};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::agent::tasks::split;
use crate::config::Qos;
use crate::spool::Entry;

use super::{AckSignal, Agent, ACK_TIMEOUT, RESULTS_IN_FLIGHT};

impl Agent {
    /// Sends spooled results oldest first, then spooled task logs, up to
    /// [`RESULTS_IN_FLIGHT`] awaiting their PUBACK at once, deleting each on its own PUBACK.
    /// Sending one at a time capped delivery at one result per round trip: on a link with
    /// 600 ms of round trip, 1.6 results a second.
    pub(super) async fn send_spooled(
        self: Arc<Self>,
        mut acks: mpsc::UnboundedReceiver<AckSignal>,
    ) {
        let mut session = self.session.subscribe();
        let mut window = Window::default();
        loop {
            let Some(current) = *session.borrow_and_update() else {
                window.clear();
                if session.changed().await.is_err() {
                    return;
                }
                continue;
            };
            // What this session has not sent yet, oldest first, as far as the window allows.
            let room = RESULTS_IN_FLIGHT - window.len();
            let mut fresh: Vec<Sent> = Vec::new();
            for (from, spool) in [(From::Results, &self.spool), (From::Logs, &self.log_spool)] {
                let room = room - fresh.len();
                if room == 0 {
                    break;
                }
                fresh.extend(
                    spool
                        .oldest_n(RESULTS_IN_FLIGHT)
                        .into_iter()
                        .map(|entry| Sent { from, entry })
                        .filter(|sent| !window.holds(sent))
                        .take(room),
                );
            }
            let mut queue_full = false;
            for outgoing in fresh {
                let entry = &outgoing.entry;
                let queued = {
                    let _gate = self.lock_spool_gate();
                    if *session.borrow() != Some(current) {
                        break;
                    }
                    self.client.try_publish(
                        entry.topic.clone(),
                        self.config.qos.max(Qos::AtLeastOnce).to_mqtt(),
                        false,
                        entry.payload.clone().into_bytes(),
                    )
                };
                if queued.is_err() {
                    queue_full = true;
                    break;
                }
                self.time_turnaround(&entry.topic, &entry.payload);
                window.published(outgoing);
            }
            if queue_full {
                // The request queue is full: try again shortly.
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let oldest_due = window.oldest_sent().map(|at| at + ACK_TIMEOUT);
            tokio::select! {
                signal = acks.recv() => match signal {
                    Some(AckSignal::Sent(pkid)) => window.numbered(pkid),
                    Some(AckSignal::Acked(pkid)) => {
                        if let Some(Sent { from, entry }) = window.acked(pkid) {
                            let spool = match from {
                                From::Results => self.spool.clone(),
                                From::Logs => self.log_spool.clone(),
                            };
                            match tokio::task::spawn_blocking(move || spool.remove(&entry)).await {
                                Ok(Ok(())) => {}
                                Ok(Err(e)) => {
                                    warn!(%e, "cannot record a delivered message in its spool")
                                }
                                Err(_) => return,
                            }
                            self.metrics.spooled_results.set(self.spool.len() as i64);
                        }
                    }
                    None => return,
                },
                changed = session.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // A new session (or none): what was in flight is sent again from the
                    // spool, and acknowledgements of the old one mean nothing now.
                    window.clear();
                    while acks.try_recv().is_ok() {}
                }
                // Nothing in flight: wait for a new result or log batch. A push between the
                // look and this wait is not missed: it left a permit.
                _ = self.spool.added(), if window.is_empty() => {}
                _ = self.log_spool.added(), if window.is_empty() => {}
                _ = sleep_until(oldest_due), if oldest_due.is_some() => {
                    debug!("no PUBACK in time; sending the unacknowledged results again");
                    window.clear();
                }
            }
        }
    }

    /// Observes how long a result took from its start's arrival, once it is published.
    pub(super) fn time_turnaround(&self, topic: &str, payload: &str) {
        if topic != self.channel.results() {
            return;
        }
        let Ok(result) = serde_json::from_str::<serde_json::Value>(payload) else {
            return;
        };
        let Some(id) = result.get("task_id").and_then(|v| v.as_str()) else {
            return;
        };
        let arrived = self
            .arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(arrived) = arrived {
            let took = arrived.elapsed();
            self.metrics.task_turnaround.observe(took.as_secs_f64());
            debug!(
                task_id = id,
                turnaround_us = took.as_micros() as u64,
                "result published"
            );
        }
    }
}

impl Agent {
    /// Spools the result of task `id` for delivery.
    pub(super) async fn report(&self, id: &str, outcome: Result<String, String>) {
        let (topic, payload) = self.result_message(id, outcome);
        self.spool_message(topic, payload.into_bytes()).await;
    }

    /// The result message of task `id` (topic and JSON text), counted and logged.
    pub(super) fn result_message(
        &self,
        id: &str,
        outcome: Result<String, String>,
    ) -> (String, String) {
        match &outcome {
            Ok(_) => {
                self.metrics.tasks_succeeded.inc();
                info!(task_id = id, "task succeeded")
            }
            Err(e) => {
                self.metrics.tasks_failed.inc();
                warn!(task_id = id, error = %e, "task failed")
            }
        }
        let (results, error) = split(outcome);
        let result = TaskResult {
            task_id: id.to_owned(),
            proplet_id: Some(self.config.client_id.clone()),
            results: ResultValue::Text(results),
            error,
        };
        let payload = String::from_utf8_lossy(&result.encode()).into_owned();
        (self.channel.results(), payload)
    }

    pub(super) async fn spool_message(&self, topic: String, payload: Vec<u8>) {
        let spool = self.spool.clone();
        let text = String::from_utf8_lossy(&payload).into_owned();
        let stored = tokio::task::spawn_blocking(move || spool.push(&topic, &text)).await;
        self.metrics.spooled_results.set(self.spool.len() as i64);
        match stored {
            Ok(Ok(None)) => {}
            Ok(Ok(Some(dropped))) => warn!(
                topic = dropped.topic,
                "result spool full: the oldest undelivered message was discarded"
            ),
            Ok(Err(e)) => warn!(%e, "cannot spool a result; it is lost"),
            Err(e) => warn!(%e, "spool write aborted"),
        }
    }
}

/// Waits until `at` (never, for `None`; that branch is disabled then).
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Which spool an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum From {
    Results,
    Logs,
}

/// A spooled entry published.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Sent {
    from: From,
    entry: Entry,
}

/// The spooled entries published in the current session and not acknowledged yet. The
/// spool sender is the agent's only QoS 1 publisher, so the client numbers its publishes in
/// the order they were made: the n-th packet id reported belongs to the n-th entry published.
#[derive(Default)]
struct Window {
    /// Published, waiting for the client to report its packet id.
    unnumbered: VecDeque<(Sent, Instant)>,
    /// Numbered, waiting for the PUBACK.
    numbered: HashMap<u16, (Sent, Instant)>,
}

impl Window {
    fn len(&self) -> usize {
        self.unnumbered.len() + self.numbered.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn holds(&self, entry: &Sent) -> bool {
        self.unnumbered.iter().any(|(e, _)| e == entry)
            || self.numbered.values().any(|(e, _)| e == entry)
    }

    fn published(&mut self, entry: Sent) {
        self.unnumbered.push_back((entry, Instant::now()));
    }

    /// The client gave the oldest unnumbered publish the packet id `pkid`. A packet id is
    /// reused only once the broker acknowledged its previous publish, so it names one entry.
    fn numbered(&mut self, pkid: u16) {
        if let Some(sent) = self.unnumbered.pop_front() {
            self.numbered.insert(pkid, sent);
        }
    }

    /// The entry the broker acknowledged with `pkid`, if it is one of ours.
    fn acked(&mut self, pkid: u16) -> Option<Sent> {
        self.numbered.remove(&pkid).map(|(entry, _)| entry)
    }

    /// When the longest-waiting entry was published.
    fn oldest_sent(&self) -> Option<Instant> {
        self.unnumbered
            .iter()
            .chain(self.numbered.values())
            .map(|(_, at)| *at)
            .min()
    }

    fn clear(&mut self) {
        self.unnumbered.clear();
        self.numbered.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(spool: &crate::spool::Spool, n: usize) -> Vec<Sent> {
        for i in 0..n {
            spool.push("t", &format!("{i}")).expect("push");
        }
        spool
            .oldest_n(n)
            .into_iter()
            .map(|entry| Sent {
                from: From::Results,
                entry,
            })
            .collect()
    }

    #[test]
    fn packet_ids_name_entries_in_publish_order_and_acks_free_them() {
        let dir = tempfile::tempdir().expect("dir");
        let spool = crate::spool::Spool::open(dir.path(), 100).expect("spool");
        let entries = entry(&spool, 3);
        let mut window = Window::default();
        for e in &entries {
            window.published(e.clone());
        }
        assert_eq!(window.len(), 3);
        window.numbered(7);
        window.numbered(8);
        // An ack for a packet id not ours (or not numbered yet) frees nothing.
        assert_eq!(window.acked(9), None);
        assert_eq!(window.acked(8), Some(entries[1].clone()));
        assert!(window.holds(&entries[0]) && window.holds(&entries[2]));
        assert!(!window.holds(&entries[1]));
        window.numbered(1);
        assert_eq!(window.acked(1), Some(entries[2].clone()));
        assert_eq!(window.acked(7), Some(entries[0].clone()));
        assert!(window.is_empty());
        assert_eq!(window.oldest_sent(), None);
    }
}
