//! Results on their way out: the spool sender (QoS 1, matched to broker acknowledgements),
//! result messages and how they enter the spool.

use std::sync::Arc;
use std::time::Duration;

use propeller_broker::protocol::{ResultValue, TaskResult};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::agent::tasks::split;
use crate::config::Qos;

use super::{AckSignal, Agent, ACK_TIMEOUT};

impl Agent {
    /// Sends spooled results oldest first, one at a time, deleting each on its PUBACK.
    pub(super) async fn send_spooled(
        self: Arc<Self>,
        mut acks: mpsc::UnboundedReceiver<AckSignal>,
    ) {
        let mut session = self.session.subscribe();
        loop {
            let Some(current) = *session.borrow_and_update() else {
                if session.changed().await.is_err() {
                    return;
                }
                continue;
            };
            let Some(entry) = self.spool.oldest() else {
                // A push between the look and this wait is not missed: it left a permit.
                tokio::select! {
                    _ = self.spool.added() => {}
                    _ = session.changed() => {}
                }
                continue;
            };
            while acks.try_recv().is_ok() {}
            let sent = {
                let _gate = self.lock_spool_gate();
                if *session.borrow() != Some(current) {
                    continue;
                }
                self.client.try_publish(
                    entry.topic.clone(),
                    self.config.qos.max(Qos::AtLeastOnce).to_mqtt(),
                    false,
                    entry.payload.clone().into_bytes(),
                )
            };
            if sent.is_err() {
                // The request queue is full: try again shortly.
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            self.time_turnaround(&entry.topic, &entry.payload);
            let mut pkid = None;
            let deadline = tokio::time::sleep(ACK_TIMEOUT);
            tokio::pin!(deadline);
            let acked = loop {
                tokio::select! {
                    signal = acks.recv() => match signal {
                        Some(AckSignal::Sent(p)) if pkid.is_none() => pkid = Some(p),
                        Some(AckSignal::Acked(p)) if Some(p) == pkid => break true,
                        Some(_) => {}
                        None => return,
                    },
                    changed = session.changed() => {
                        if changed.is_err() || *session.borrow() != Some(current) {
                            break false;
                        }
                    }
                    _ = &mut deadline => break false,
                }
            };
            if acked {
                let spool = self.spool.clone();
                match tokio::task::spawn_blocking(move || spool.remove(&entry)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(%e, "cannot record a delivered result in the spool"),
                    Err(_) => return,
                }
                self.metrics.spooled_results.set(self.spool.len() as i64);
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
