//! Task logs on their way out: the lines runs print ([`crate::task_log`]) are gathered into
//! one batch per task and written to the log spool (`<state>/logs`, a ring: when it is full
//! the oldest batch goes). The spool sender sends them after the results, at QoS 1, and
//! forgets each batch on its PUBACK, so lines printed while the broker was unreachable
//! arrive once it is back.

use std::sync::Arc;
use std::time::Duration;

use propeller_broker::protocol::TaskLogs;
use tracing::warn;

use crate::task_log::{LogTap, TaskLine};

use super::Agent;

/// How long lines gather before they are spooled: one write for many lines.
const GATHER: Duration = Duration::from_millis(250);
/// A batch's lines take at most this many bytes of text (well below MQTT's packet limits).
const BATCH_BYTES: usize = 48 * 1024;

impl Agent {
    /// The log of a run of task `task_id`, when task output is logged.
    pub(super) fn log_tap(&self, task_id: &str) -> Option<LogTap> {
        self.config
            .task_log
            .map(|limits| LogTap::new(task_id, limits, self.log_queue.clone()))
    }

    /// Moves captured lines into the log spool, a batch per task, every [`GATHER`] (sooner
    /// when the queue is half full).
    pub(super) async fn spool_logs(self: Arc<Self>) {
        loop {
            self.log_queue.added().await;
            // A guest printing flat out fills the queue sooner: its lines go at once.
            tokio::select! {
                _ = tokio::time::sleep(GATHER) => {}
                _ = self.log_queue.filling() => {}
            }
            let lines = self.log_queue.take_all();
            if lines.is_empty() {
                continue;
            }
            let topic = self.channel.logs();
            let payloads: Vec<String> = batches(lines, &self.config.client_id)
                .iter()
                .map(|batch| String::from_utf8_lossy(&batch.encode()).into_owned())
                .collect();
            let spool = self.log_spool.clone();
            let stored =
                tokio::task::spawn_blocking(move || spool.push_all(&topic, &payloads)).await;
            match stored {
                Ok(Ok(0)) => {}
                Ok(Ok(dropped)) => warn!(
                    dropped,
                    "log spool full: the oldest unsent batches of task output were discarded"
                ),
                Ok(Err(e)) => warn!(%e, "cannot spool task output; those lines are lost"),
                Err(_) => return,
            }
        }
    }
}

/// `lines` as batches of `proplet_id`: one per task in the order its lines came, split
/// where a batch would pass [`BATCH_BYTES`].
fn batches(lines: Vec<TaskLine>, proplet_id: &str) -> Vec<TaskLogs> {
    let mut out: Vec<TaskLogs> = Vec::new();
    let mut sizes: Vec<usize> = Vec::new();
    for TaskLine { task_id, line } in lines {
        let size = line.text.len() + 32;
        let open = out
            .iter()
            .rposition(|b| b.task_id == task_id)
            .filter(|&i| sizes[i] + size <= BATCH_BYTES);
        match open {
            Some(i) => {
                out[i].lines.push(line);
                sizes[i] += size;
            }
            None => {
                out.push(TaskLogs {
                    task_id,
                    proplet_id: proplet_id.to_owned(),
                    lines: vec![line],
                });
                sizes.push(size);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use propeller_broker::protocol::{LogLine, LogStream};

    fn texts(lines: &[LogLine]) -> Vec<&str> {
        lines.iter().map(|l| l.text.as_str()).collect()
    }

    fn line(task: &str, text: &str) -> TaskLine {
        TaskLine {
            task_id: task.into(),
            line: LogLine {
                at_ms: 0,
                stream: LogStream::Stdout,
                text: text.into(),
            },
        }
    }

    #[test]
    fn lines_are_batched_per_task_in_order_and_split_at_the_size() {
        let lines = vec![line("a", "1"), line("b", "x"), line("a", "2")];
        let out = batches(lines, "edge");
        assert_eq!(out.len(), 2);
        assert_eq!(
            (out[0].task_id.as_str(), texts(&out[0].lines)),
            ("a", vec!["1", "2"])
        );
        assert_eq!(out[1].proplet_id, "edge");

        let long = "y".repeat(BATCH_BYTES / 3);
        let lines = (0..4).map(|_| line("a", &long)).collect();
        let out = batches(lines, "edge");
        assert_eq!(
            out.iter().map(|b| b.lines.len()).collect::<Vec<_>>(),
            [2, 2]
        );
    }
}
