//! A run's stdout and stderr: kept in memory up to a cap (a command's result is what it
//! printed) and, when the run is logged, cut into lines of its task log as they are written.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use propeller_broker::protocol::LogStream;
use tokio::io::AsyncWrite;
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamError};

use crate::task_log::{LineWriter, LogTap};

use super::Invocation;

/// What happens to output past the memory cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Overflow {
    /// The guest's write fails: a command's result would be incomplete.
    Fail,
    /// It is logged only: a daemon prints for as long as it runs, and its result is not
    /// what it printed.
    LogOnly,
}

/// One output stream of a run (see the module's documentation).
#[derive(Clone)]
pub struct Output {
    memory: MemoryOutputPipe,
    overflow: Overflow,
    log: Option<Arc<Logged>>,
}

/// The line writer of a logged stream; the run's last line and the count of lines dropped
/// at the rate are logged when the run's streams are gone.
struct Logged {
    writer: Mutex<LineWriter>,
    tap: LogTap,
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.writer
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .end();
        self.tap.finish();
    }
}

impl Output {
    fn new(capacity: usize, overflow: Overflow, log: Option<(&LogTap, LogStream)>) -> Self {
        Self {
            memory: MemoryOutputPipe::new(capacity),
            overflow,
            log: log.map(|(tap, stream)| {
                Arc::new(Logged {
                    writer: Mutex::new(tap.writer(stream)),
                    tap: tap.clone(),
                })
            }),
        }
    }

    /// What was kept in memory.
    pub fn contents(&self) -> Bytes {
        self.memory.contents()
    }

    fn log(&self, bytes: &[u8]) {
        if let Some(log) = &self.log {
            log.writer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write(bytes);
        }
    }

    /// Room left in memory.
    fn room(&mut self) -> usize {
        self.memory.check_write().unwrap_or(0)
    }
}

/// What a daemon may write at once once its memory is full (its output is only logged).
const LOG_ONLY_PERMIT: usize = 64 * 1024;

impl OutputStream for Output {
    fn write(&mut self, bytes: Bytes) -> Result<(), StreamError> {
        match self.overflow {
            Overflow::Fail => {
                self.memory.write(bytes.clone())?;
                self.log(&bytes);
            }
            Overflow::LogOnly => {
                let kept = bytes.len().min(self.room());
                if kept > 0 {
                    self.memory.write(bytes.slice(..kept))?;
                }
                self.log(&bytes);
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), StreamError> {
        Ok(())
    }

    fn check_write(&mut self) -> Result<usize, StreamError> {
        match self.overflow {
            Overflow::Fail => self.memory.check_write(),
            Overflow::LogOnly => Ok(self.room().max(LOG_ONLY_PERMIT)),
        }
    }
}

#[async_trait::async_trait]
impl Pollable for Output {
    async fn ready(&mut self) {}
}

impl AsyncWrite for Output {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let room = self.room();
        let kept = buf.len().min(room);
        if kept > 0 {
            let _ = OutputStream::write(&mut self.memory, Bytes::copy_from_slice(&buf[..kept]));
        }
        let taken = match self.overflow {
            Overflow::Fail => kept,
            Overflow::LogOnly => buf.len(),
        };
        self.log(&buf[..taken]);
        Poll::Ready(Ok(taken))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl IsTerminal for Output {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Output {
    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

/// The stdout and stderr of one run.
pub(crate) struct Pipes {
    pub stdout: Output,
    pub stderr: Output,
}

impl Pipes {
    /// The streams of `invocation`, each kept up to `capacity` bytes, logged into its
    /// task log when it has one.
    pub(crate) fn new(capacity: usize, invocation: &Invocation) -> Self {
        let overflow = if invocation.timeout.is_none() {
            Overflow::LogOnly
        } else {
            Overflow::Fail
        };
        let log = invocation.log.as_ref();
        Self {
            stdout: Output::new(capacity, overflow, log.map(|t| (t, LogStream::Stdout))),
            stderr: Output::new(capacity, overflow, log.map(|t| (t, LogStream::Stderr))),
        }
    }

    /// The result text upstream agents give a WASI command: its stdout, then `\n` and its
    /// stderr if it wrote any.
    pub(crate) fn command_output(&self) -> String {
        let mut text = String::from_utf8_lossy(&self.stdout.contents()).into_owned();
        let err = self.stderr.contents();
        if !err.is_empty() {
            text.push('\n');
            text.push_str(&String::from_utf8_lossy(&err));
        }
        text
    }
}
