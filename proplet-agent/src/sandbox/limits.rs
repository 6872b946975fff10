//! What a task cannot escape: its limits, the errors that end it, the stop flag, and the
//! per-task gauge and memory limiter.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use wasmtime::{ResourceLimiter, StoreLimits};

use crate::outgoing_http::OutgoingHttp;

/// Call stack of a guest: deep or unbounded recursion past it ends the task with
/// [`RunError::StackOverflow`]. Wasmtime's default, stated here so the error can name it; it
/// stays well below the 2 MiB stacks of the threads that run guests.
pub const WASM_STACK_BYTES: usize = 512 * 1024;

/// Limits applied to every task.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest total linear memory of one task.
    pub max_memory_bytes: usize,
    /// Instruction budget per run; `None` disables metering.
    pub fuel: Option<u64>,
    /// Cap on captured stdout and on captured stderr, each.
    pub max_output_bytes: usize,
    /// Compiled modules kept in memory.
    pub cache_entries: usize,
    /// Host directories a task may be granted (it asks with `PROPLET_PREOPEN` in its env).
    pub preopen_allow_list: Vec<PathBuf>,
    /// Directory for compiled modules, so a restart does not recompile; `None` disables it.
    /// It must be private to the agent: its files are loaded as native code.
    pub disk_cache: Option<PathBuf>,
    /// Rules for guests' outgoing `wasi:http` requests.
    pub outgoing_http: OutgoingHttp,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_memory_bytes: 256 * 1024 * 1024,
            fuel: None,
            max_output_bytes: 1024 * 1024,
            cache_entries: 32,
            preopen_allow_list: Vec::new(),
            disk_cache: None,
            outgoing_http: OutgoingHttp::default(),
        }
    }
}

/// Why a task did not produce a result.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RunError {
    /// The bytes are not a usable Wasm module.
    #[error("invalid wasm module: {0}")]
    Compile(String),
    /// A command component (task name `_start`) that does not export `wasi:cli/run`.
    #[error("the component exports no `wasi:cli/run`; name the export to call in the task's functionName (it exports: {0})")]
    NotACommand(String),
    /// A component serving `wasi:http/incoming-handler` that cannot be served here.
    #[error("cannot serve HTTP: {0}")]
    Serve(String),
    /// Neither the named export nor a fallback (`main`, `run`, `_start`) exists.
    #[error("export `{name}` not found; the module exports: {available}")]
    NoExport {
        /// The requested name.
        name: String,
        /// Function exports that do exist.
        available: String,
    },
    /// The inputs do not fit the export's parameters.
    #[error("bad inputs: {0}")]
    Inputs(String),
    /// The module needs imports the proplet does not provide.
    #[error("cannot instantiate: {0}")]
    Link(String),
    /// The guest trapped.
    #[error("wasm trap: {0}")]
    Trap(String),
    /// The wall-clock limit passed.
    #[error("time limit of {0:?} exceeded")]
    TimedOut(Duration),
    /// A stop request interrupted the task.
    #[error("interrupted by a stop request")]
    Stopped,
    /// The fuel budget ran out.
    #[error("fuel budget of {0} exhausted")]
    OutOfFuel(u64),
    /// The guest tried to use more memory than allowed.
    #[error("memory limit of {0} bytes exceeded")]
    MemoryLimit(usize),
    /// A WASI command exited with a non-zero status.
    #[error("exited with status {code}: {stderr}")]
    Exit {
        /// The status.
        code: i32,
        /// Captured stderr.
        stderr: String,
    },
    /// The binary is larger than the proplet accepts; it is refused before compilation.
    #[error("{what} is {}{size} bytes, above the proplet's module size limit of {limit} bytes (PROPLET_MAX_MODULE_SIZE)", if *at_least { "at least " } else { "" })]
    TooLarge {
        /// Which binary (inline module, URL, image).
        what: String,
        /// Its size, or the least it can be.
        size: u64,
        /// Whether `size` is a lower bound (the rest was never received).
        at_least: bool,
        /// The limit.
        limit: usize,
    },
    /// The guest overflowed its call stack (unbounded recursion).
    #[error(
        "stack overflow: the guest exceeded its {0}-byte call stack (deep or unbounded recursion)"
    )]
    StackOverflow(usize),
    /// A preopen was asked for outside the allow-list.
    #[error("directory {0} is not in the proplet's preopen allow-list")]
    PreopenDenied(String),
}

/// A cooperative stop signal, checked at every epoch tick.
#[derive(Debug, Clone, Default)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    /// Requests the task to stop.
    pub fn stop(&self) {
        self.0.store(true, Ordering::Release);
    }

    /// Whether a stop was requested.
    pub fn is_stopped(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// Live figures of one running task, readable from other threads (task metrics).
#[derive(Debug, Default)]
pub struct TaskGauge {
    pub(crate) memory_bytes: AtomicU64,
    pub(crate) fuel_used: AtomicU64,
    pub(crate) metered: AtomicBool,
    pub(crate) thread_id: AtomicU32,
}

impl TaskGauge {
    /// Linear memory the task holds now, bytes.
    pub fn memory_bytes(&self) -> u64 {
        self.memory_bytes.load(Ordering::Relaxed)
    }

    /// Fuel consumed so far (updated every epoch tick), when metering is on.
    pub fn fuel_used(&self) -> Option<u64> {
        self.metered
            .load(Ordering::Relaxed)
            .then(|| self.fuel_used.load(Ordering::Relaxed))
    }

    /// The OS thread running the guest (Linux), for per-task CPU time.
    pub fn thread_id(&self) -> Option<u32> {
        Some(self.thread_id.load(Ordering::Relaxed)).filter(|t| *t != 0)
    }
}

/// The store's resource limiter: the memory cap, plus accounting into the task's gauge.
pub(crate) struct Limiter {
    pub(crate) inner: StoreLimits,
    pub(crate) gauge: Arc<TaskGauge>,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.inner.memory_growing(current, desired, maximum)?;
        if allowed {
            self.gauge
                .memory_bytes
                .fetch_add(desired.saturating_sub(current) as u64, Ordering::Relaxed);
        }
        Ok(allowed)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.inner.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.inner.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.inner.instances()
    }

    fn tables(&self) -> usize {
        self.inner.tables()
    }

    fn memories(&self) -> usize {
        self.inner.memories()
    }
}

/// The kernel id of the calling thread (Linux), 0 elsewhere.
pub(crate) fn current_thread_id() -> u32 {
    std::fs::read_to_string("/proc/thread-self/stat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|t| t.parse().ok()))
        .unwrap_or(0)
}
