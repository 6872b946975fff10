//! What tasks print, captured for their log: each run's stdout and stderr cut into lines,
//! held to a rate and a size per run, and queued for the agent to spool and send
//! (`agent::logs`). A limit never blocks or fails the guest: lines over it are counted and
//! replaced by one line from the agent that says how many were dropped and why.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use propeller_broker::protocol::{LogLine, LogStream, MAX_LOG_LINE_BYTES};
use tokio::sync::Notify;

/// How much of a run's output is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// Lines a second a run may log on average; it may burst to twice that.
    pub lines_per_second: u32,
    /// Bytes one run may log per `bytes_window`; past them the rest of the window is not
    /// logged (for most runs, the rest of the run).
    pub run_bytes: u64,
    /// The window `run_bytes` counts over (an hour): a daemon or an HTTP component that runs
    /// for days logs again each hour rather than falling silent for good.
    pub bytes_window: Duration,
    /// Lines longer than this are cut (and say so).
    pub line_bytes: usize,
}

impl Default for LogLimits {
    fn default() -> Self {
        Self {
            lines_per_second: 100,
            run_bytes: 1024 * 1024,
            bytes_window: Duration::from_secs(3600),
            line_bytes: 4096,
        }
    }
}

/// A captured line of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskLine {
    /// The task's UID.
    pub task_id: String,
    /// The line.
    pub line: LogLine,
}

/// Lines captured and not yet taken by the agent's log spooler. Bounded: when the spooler
/// falls behind (a guest printing faster than lines can be spooled, a full disk), the
/// oldest lines go first, and the task's log gets a line saying how many.
#[derive(Debug)]
pub struct LogQueue {
    queued: Mutex<Queued>,
    capacity: usize,
    added: Notify,
    /// Told when the queue reaches half its capacity: the spooler takes the lines early.
    filling: Notify,
}

#[derive(Debug, Default)]
struct Queued {
    lines: VecDeque<TaskLine>,
    /// Lines dropped since the last take, per task.
    dropped: std::collections::BTreeMap<String, u64>,
}

impl LogQueue {
    /// A queue holding at most `capacity` lines.
    pub fn new(capacity: usize) -> Self {
        Self {
            queued: Mutex::default(),
            capacity: capacity.max(1),
            added: Notify::new(),
            filling: Notify::new(),
        }
    }

    fn push(&self, line: TaskLine) {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        if queued.lines.len() == self.capacity {
            if let Some(oldest) = queued.lines.pop_front() {
                *queued.dropped.entry(oldest.task_id).or_default() += 1;
            }
        }
        queued.lines.push_back(line);
        let half = queued.lines.len() == self.capacity.div_ceil(2);
        drop(queued);
        self.added.notify_one();
        if half {
            self.filling.notify_one();
        }
    }

    /// Every queued line, oldest first, then for each task that lost lines to a full
    /// queue a line from the agent saying how many.
    pub fn take_all(&self) -> Vec<TaskLine> {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        let mut lines: Vec<TaskLine> = queued.lines.drain(..).collect();
        let at_ms = chrono::Utc::now().timestamp_millis();
        for (task_id, dropped) in std::mem::take(&mut queued.dropped) {
            lines.push(TaskLine {
                task_id,
                line: LogLine {
                    at_ms,
                    stream: LogStream::Agent,
                    text: format!(
                        "{dropped} lines dropped: printed faster than the agent could keep \
                         them ({} lines queued at most)",
                        self.capacity
                    ),
                },
            });
        }
        lines
    }

    /// Resolves when a line was queued since the last call (or now, if one is waiting).
    pub async fn added(&self) {
        self.added.notified().await;
    }

    /// Resolves when the queue reached half its capacity since the last call.
    pub async fn filling(&self) {
        self.filling.notified().await;
    }
}

/// The log of one run: what its stdout and stderr share (the limits and the queue).
#[derive(Debug, Clone)]
pub struct LogTap {
    task_id: Arc<str>,
    limits: LogLimits,
    queue: Arc<LogQueue>,
    budget: Arc<Mutex<Budget>>,
}

/// What a run has used of its limits.
#[derive(Debug)]
struct Budget {
    /// Lines that may be logged now (a token bucket refilled at the rate).
    tokens: f64,
    refilled: Instant,
    /// Bytes logged in the current window.
    bytes: u64,
    /// When the current window began.
    window: Instant,
    /// Lines dropped by the rate since the last line that went through.
    rate_dropped: u64,
    /// The run passed its byte limit in the current window (said once).
    truncated: bool,
}

impl LogTap {
    /// The log of a run of task `task_id`, queued into `queue`.
    pub fn new(task_id: &str, limits: LogLimits, queue: Arc<LogQueue>) -> Self {
        Self {
            task_id: task_id.into(),
            limits,
            queue,
            budget: Arc::new(Mutex::new(Budget {
                tokens: f64::from(limits.lines_per_second) * 2.0,
                refilled: Instant::now(),
                bytes: 0,
                window: Instant::now(),
                rate_dropped: 0,
                truncated: false,
            })),
        }
    }

    /// A writer cutting `stream`'s bytes into lines of this log.
    pub fn writer(&self, stream: LogStream) -> LineWriter {
        LineWriter {
            tap: self.clone(),
            stream,
            partial: Vec::new(),
        }
    }

    /// Logs one line of `stream`, within the limits.
    fn line(&self, stream: LogStream, bytes: &[u8]) {
        let limit = self.limits.line_bytes.min(MAX_LOG_LINE_BYTES - 64);
        let mut text = String::from_utf8_lossy(&bytes[..bytes.len().min(limit)]).into_owned();
        if bytes.len() > limit {
            text.push_str(&format!(" [cut: the line had {} bytes]", bytes.len()));
        }
        let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        if budget.window.elapsed() >= self.limits.bytes_window {
            budget.window = Instant::now();
            budget.bytes = 0;
            budget.truncated = false;
        }
        if budget.truncated {
            return;
        }
        if budget.bytes + text.len() as u64 > self.limits.run_bytes {
            budget.truncated = true;
            let run_bytes = self.limits.run_bytes;
            drop(budget);
            self.emit(
                LogStream::Agent,
                format!("output over {run_bytes} bytes this hour: the rest of it is not logged"),
            );
            return;
        }
        let rate = f64::from(self.limits.lines_per_second);
        let now = Instant::now();
        let elapsed = now.duration_since(budget.refilled).as_secs_f64();
        budget.tokens = (budget.tokens + elapsed * rate).min(rate * 2.0);
        budget.refilled = now;
        if budget.tokens < 1.0 {
            budget.rate_dropped += 1;
            return;
        }
        budget.tokens -= 1.0;
        budget.bytes += text.len() as u64;
        let dropped = std::mem::take(&mut budget.rate_dropped);
        drop(budget);
        if dropped > 0 {
            self.emit(LogStream::Agent, self.dropped_line(dropped));
        }
        self.emit(stream, text);
    }

    /// Says how many lines the rate dropped at the end of the run, if any.
    pub fn finish(&self) {
        let dropped = {
            let mut budget = self.budget.lock().unwrap_or_else(|e| e.into_inner());
            std::mem::take(&mut budget.rate_dropped)
        };
        if dropped > 0 {
            self.emit(LogStream::Agent, self.dropped_line(dropped));
        }
    }

    fn dropped_line(&self, dropped: u64) -> String {
        format!(
            "{dropped} lines dropped: over {} lines a second",
            self.limits.lines_per_second
        )
    }

    fn emit(&self, stream: LogStream, text: String) {
        self.queue.push(TaskLine {
            task_id: self.task_id.to_string(),
            line: LogLine {
                at_ms: chrono::Utc::now().timestamp_millis(),
                stream,
                text,
            },
        });
    }
}

/// Cuts one stream's bytes into lines of a [`LogTap`]; what follows the last line break is
/// kept until the next write, or logged when the writer is dropped (the run ended).
#[derive(Debug)]
pub struct LineWriter {
    tap: LogTap,
    stream: LogStream,
    partial: Vec<u8>,
}

impl LineWriter {
    /// Takes `bytes` the guest wrote.
    pub fn write(&mut self, mut bytes: &[u8]) {
        while let Some(end) = bytes.iter().position(|b| *b == b'\n') {
            let (line, rest) = bytes.split_at(end);
            if self.partial.is_empty() {
                self.tap.line(self.stream, strip_cr(line));
            } else {
                self.partial.extend_from_slice(line);
                let whole = std::mem::take(&mut self.partial);
                self.tap.line(self.stream, strip_cr(&whole));
            }
            bytes = &rest[1..];
        }
        // A line with no break yet; one far over the limit is logged in pieces.
        self.partial.extend_from_slice(bytes);
        if self.partial.len() >= MAX_LOG_LINE_BYTES {
            let whole = std::mem::take(&mut self.partial);
            self.tap.line(self.stream, &whole);
        }
    }
}

impl LineWriter {
    /// Logs what follows the last line break: the stream ended.
    pub fn end(&mut self) {
        if !self.partial.is_empty() {
            let rest = std::mem::take(&mut self.partial);
            self.tap.line(self.stream, strip_cr(&rest));
        }
    }
}

impl Drop for LineWriter {
    fn drop(&mut self) {
        self.end();
    }
}

fn strip_cr(line: &[u8]) -> &[u8] {
    line.strip_suffix(b"\r").unwrap_or(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(queue: &LogQueue) -> Vec<(LogStream, String)> {
        queue
            .take_all()
            .into_iter()
            .map(|l| (l.line.stream, l.line.text))
            .collect()
    }

    #[test]
    fn bytes_become_lines_whatever_the_writes_and_the_rest_is_logged_at_the_end() {
        let queue = Arc::new(LogQueue::new(100));
        let tap = LogTap::new("t", LogLimits::default(), queue.clone());
        let mut out = tap.writer(LogStream::Stdout);
        out.write(b"one\r\ntw");
        out.write(b"o\nthree");
        let mut err = tap.writer(LogStream::Stderr);
        err.write(b"oops\n");
        assert_eq!(
            texts(&queue),
            [
                (LogStream::Stdout, "one".to_owned()),
                (LogStream::Stdout, "two".to_owned()),
                (LogStream::Stderr, "oops".to_owned()),
            ]
        );
        drop(out);
        assert_eq!(texts(&queue), [(LogStream::Stdout, "three".to_owned())]);
    }

    #[test]
    fn a_flood_is_cut_at_the_rate_and_the_drop_is_said() {
        let queue = Arc::new(LogQueue::new(10_000));
        let limits = LogLimits {
            lines_per_second: 10,
            ..LogLimits::default()
        };
        let tap = LogTap::new("t", limits, queue.clone());
        let mut out = tap.writer(LogStream::Stdout);
        for i in 0..1000 {
            out.write(format!("line {i}\n").as_bytes());
        }
        tap.finish();
        let lines = texts(&queue);
        // The burst (twice the rate) went through, the rest was counted in one line.
        let logged = lines
            .iter()
            .filter(|(s, _)| *s == LogStream::Stdout)
            .count();
        assert!((20..=21).contains(&logged), "{logged} lines logged");
        let (stream, said) = lines
            .last()
            .cloned()
            .unwrap_or((LogStream::Stdout, String::new()));
        assert_eq!(stream, LogStream::Agent);
        assert_eq!(
            said,
            format!("{} lines dropped: over 10 lines a second", 1000 - logged)
        );
    }

    #[test]
    fn a_run_over_its_bytes_says_so_once_and_long_lines_are_cut() {
        let queue = Arc::new(LogQueue::new(100));
        let limits = LogLimits {
            lines_per_second: 1000,
            run_bytes: 45,
            line_bytes: 8,
            ..LogLimits::default()
        };
        let tap = LogTap::new("t", limits, queue.clone());
        let mut out = tap.writer(LogStream::Stdout);
        out.write(b"0123456789abc\nshort\nmore\nand more\n");
        let lines = texts(&queue);
        assert_eq!(lines[0].1, "01234567 [cut: the line had 13 bytes]");
        assert_eq!(lines[1].1, "short");
        assert_eq!(
            lines[2],
            (
                LogStream::Agent,
                "output over 45 bytes this hour: the rest of it is not logged".to_owned()
            )
        );
        assert_eq!(lines.len(), 3);
    }

    #[test]
    fn a_long_run_logs_again_in_the_next_window() {
        let queue = Arc::new(LogQueue::new(100));
        let limits = LogLimits {
            run_bytes: 10,
            bytes_window: Duration::from_millis(50),
            ..LogLimits::default()
        };
        let tap = LogTap::new("t", limits, queue.clone());
        let mut out = tap.writer(LogStream::Stdout);
        out.write(b"123456\n789012\n");
        std::thread::sleep(Duration::from_millis(60));
        out.write(b"again\n");
        let lines: Vec<String> = texts(&queue).into_iter().map(|(_, t)| t).collect();
        assert_eq!(
            lines,
            [
                "123456",
                "output over 10 bytes this hour: the rest of it is not logged",
                "again"
            ]
        );
    }

    #[test]
    fn a_full_queue_keeps_the_newest_lines() {
        let queue = Arc::new(LogQueue::new(3));
        let tap = LogTap::new("t", LogLimits::default(), queue.clone());
        let mut out = tap.writer(LogStream::Stdout);
        out.write(b"1\n2\n3\n4\n5\n");
        let kept: Vec<String> = texts(&queue).into_iter().map(|(_, t)| t).collect();
        assert_eq!(
            kept,
            [
                "3",
                "4",
                "5",
                "2 lines dropped: printed faster than the agent could keep them (3 lines queued at most)"
            ]
        );
        assert!(texts(&queue).is_empty(), "said once");
    }
}
