//! What one run needs from the runtime, whatever it runs (a core module in `wasm`, a
//! component in `component`): the engine, the limits, and the store, limiter, WASI context
//! and error classification built from them. Both runners build on it; it knows neither.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use wasmtime::{Engine, ResourceLimiter, Store, StoreLimitsBuilder, Trap, UpdateDeadline};
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

pub mod limits;
pub mod output;
pub mod values;

use limits::{current_thread_id, Limiter, Limits, RunError, StopFlag, TaskGauge, WASM_STACK_BYTES};
use output::{Output, Pipes};
use values::{root_cause, trap_site, INTERRUPTED};

use crate::task_log::LogTap;

/// What to run.
#[derive(Debug, Clone, Default)]
pub struct Invocation {
    /// Export to call (upstream's task `name`); falls back to `main`, `run`, `_start`.
    pub function: String,
    /// Arguments, parsed per parameter type.
    pub inputs: Vec<String>,
    /// WASI argv after the program name.
    pub args: Vec<String>,
    /// WASI environment.
    pub env: Vec<(String, String)>,
    /// Wall-clock limit; `None` for none at all (daemons).
    pub timeout: Option<Duration>,
    /// Host directories to preopen at the same path (must be allow-listed).
    pub preopens: Vec<PathBuf>,
    /// Where the run publishes its live figures.
    pub gauge: Arc<TaskGauge>,
    /// The task log its stdout and stderr are written to, line by line (`None`: not logged).
    pub log: Option<LogTap>,
}

/// A successful run.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// The result text upstream agents produce: the first return value in decimal, or the
    /// captured stdout (then `\n` and stderr if any) for WASI commands.
    pub output: String,
    /// Fuel used, when metering is on.
    pub fuel_used: Option<u64>,
    /// Peak linear memory, bytes.
    pub memory_bytes: usize,
}

/// The engine and the limits every run uses.
pub struct Sandbox {
    engine: Engine,
    limits: Limits,
}

impl Sandbox {
    /// Runs on `engine` under `limits`.
    pub fn new(engine: Engine, limits: Limits) -> Self {
        Self { engine, limits }
    }

    /// The engine every task runs on.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The limits every task runs under.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// A WASI context builder with the task's argv, env, captured output and the preopens it
    /// may have (refused outside the allow-list).
    pub(crate) fn wasi_builder(
        &self,
        invocation: &Invocation,
        pipes: &Pipes,
    ) -> Result<WasiCtxBuilder, RunError> {
        let mut builder = WasiCtxBuilder::new();
        let mut argv = vec![invocation.function.clone()];
        argv.extend(invocation.args.iter().cloned());
        builder
            .args(&argv)
            .envs(&invocation.env)
            .stdout(pipes.stdout.clone())
            .stderr(pipes.stderr.clone());
        for dir in &invocation.preopens {
            if !self
                .limits
                .preopen_allow_list
                .iter()
                .any(|a| dir.starts_with(a))
            {
                return Err(RunError::PreopenDenied(dir.display().to_string()));
            }
            let guest = dir.display().to_string();
            builder
                .preopened_dir(dir, &guest, FsPerms::ReadWrite)
                .map_err(|e| RunError::Link(format!("preopen {guest}: {e}")))?;
        }
        Ok(builder)
    }

    /// The memory cap and accounting for one task.
    pub(crate) fn limiter(&self, gauge: &Arc<TaskGauge>) -> Limiter {
        gauge
            .thread_id
            .store(current_thread_id(), Ordering::Relaxed);
        gauge
            .metered
            .store(self.limits.fuel.is_some(), Ordering::Relaxed);
        Limiter {
            inner: StoreLimitsBuilder::new()
                .memory_size(self.limits.max_memory_bytes)
                .trap_on_grow_failure(true)
                .build(),
            gauge: gauge.clone(),
        }
    }

    /// A store for one task: the limiter found by `limiter`, fuel, and the epoch check that
    /// makes a stop or the deadline interrupt the guest within one tick.
    pub(crate) fn store<T: 'static>(
        &self,
        data: T,
        limiter: fn(&mut T) -> &mut Limiter,
        invocation: &Invocation,
        stop: &StopFlag,
    ) -> Result<Store<T>, RunError> {
        let mut store = Store::new(&self.engine, data);
        store.limiter(move |host| limiter(host) as &mut dyn ResourceLimiter);
        if let Some(fuel) = self.limits.fuel {
            store
                .set_fuel(fuel)
                .map_err(|e| RunError::Link(e.to_string()))?;
        }
        let deadline = invocation.timeout.map(|t| Instant::now() + t);
        let watch = stop.clone();
        let budget = self.limits.fuel;
        let gauge = invocation.gauge.clone();
        store.set_epoch_deadline(1);
        store.epoch_deadline_callback(move |ctx| {
            if let (Some(budget), Ok(left)) = (budget, ctx.get_fuel()) {
                gauge
                    .fuel_used
                    .store(budget.saturating_sub(left), Ordering::Relaxed);
            }
            let expired = deadline.is_some_and(|d| Instant::now() >= d);
            if watch.is_stopped() || expired {
                Err(wasmtime::Error::msg(INTERRUPTED))
            } else {
                Ok(UpdateDeadline::Continue(1))
            }
        });
        Ok(store)
    }

    /// Fuel a finished store used, when metering is on.
    pub(crate) fn fuel_used<T>(&self, store: &Store<T>) -> Option<u64> {
        self.limits
            .fuel
            .map(|budget| budget.saturating_sub(store.get_fuel().unwrap_or(0)))
    }

    /// Turns a Wasmtime error into what went wrong, in the task's terms.
    pub(crate) fn classify_error(
        &self,
        error: wasmtime::Error,
        invocation: &Invocation,
        stop: &StopFlag,
        stderr: &Output,
    ) -> RunError {
        if let Some(I32Exit(code)) = error.downcast_ref::<I32Exit>() {
            return RunError::Exit {
                code: *code,
                stderr: String::from_utf8_lossy(&stderr.contents()).into_owned(),
            };
        }
        let text = format!("{error:?}");
        if text.contains(INTERRUPTED) {
            if stop.is_stopped() {
                return RunError::Stopped;
            }
            return RunError::TimedOut(invocation.timeout.unwrap_or_default());
        }
        if let Some(trap) = error.downcast_ref::<Trap>() {
            if *trap == Trap::OutOfFuel {
                return RunError::OutOfFuel(self.limits.fuel.unwrap_or(0));
            }
            if *trap == Trap::StackOverflow {
                return RunError::StackOverflow(WASM_STACK_BYTES);
            }
        }
        if text.contains("forcing trap when growing memory")
            || text.contains("memory minimum size")
            || text.contains("exceeds memory limits")
        {
            return RunError::MemoryLimit(self.limits.max_memory_bytes);
        }
        if text.contains("unknown import") || text.contains("matching implementation was not found")
        {
            return RunError::Link(root_cause(&error));
        }
        // One line: the trap and where, rather than the error chain with its backtrace.
        let cause = match error.downcast_ref::<Trap>() {
            Some(trap) => {
                let text = trap.to_string();
                let text = text.strip_prefix("wasm trap: ").unwrap_or(&text);
                format!("{text}{}", trap_site(&error))
            }
            None => root_cause(&error),
        };
        // A guest that panics writes why to stderr before it traps: keep the end of it.
        let said = String::from_utf8_lossy(&stderr.contents()).into_owned();
        let said = said.trim();
        if said.is_empty() {
            RunError::Trap(cause)
        } else {
            let tail: String = said
                .chars()
                .rev()
                .take(2048)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            RunError::Trap(format!("{cause}; stderr: {tail}"))
        }
    }
}
