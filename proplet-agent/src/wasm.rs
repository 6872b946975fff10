//! Running Wasm tasks with Wasmtime, within limits a task cannot escape.
//!
//! - **Time:** epoch interruption. A ticker thread advances the engine's epoch every
//!   [`EPOCH_TICK`]; each store checks at every tick whether its task was stopped or its
//!   deadline passed, so a stop or a timeout takes effect within one tick even in a tight loop.
//! - **Memory:** a per-store cap on linear memory; growing past it traps with a clear message.
//! - **Fuel:** optional instruction metering, reported in task metrics when on.
//! - **WASI preview 1** (core modules) and **WASI 0.2** (components, see [`crate::component`]):
//!   the task's `cli_args` and `env` only (never the agent's environment), no preopened
//!   directories outside the allow-list, and stdout/stderr captured in memory up to a cap.
//! - **Compilation** is cached by content hash, so a repeated task does not recompile. Core
//!   modules and components share one engine, one cache and the same limits.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use wasmtime::component::Component;
use wasmtime::{Config, Engine, Linker, Module, Val};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::I32Exit;

mod cache;

use crate::sandbox::output::Pipes;
use cache::ModuleCache;

use crate::sandbox::limits::Limiter;
pub use crate::sandbox::limits::{Limits, RunError, StopFlag, TaskGauge, WASM_STACK_BYTES};
pub use crate::sandbox::values::is_component;
pub(crate) use crate::sandbox::values::root_cause;
use crate::sandbox::values::{
    convert_inputs, create_private_dir, format_value, memory_size, resolve_export,
};
pub use crate::sandbox::{Invocation, Outcome, Sandbox};

/// How often running tasks are checked for stop requests and deadlines.
pub const EPOCH_TICK: Duration = Duration::from_millis(10);

/// A compiled core module or component, ready to instantiate (cheap to clone).
#[derive(Clone)]
pub enum Compiled {
    /// A core module (WASI preview 1 or none).
    Module(Module),
    /// A component (WASI 0.2), linked.
    Component(crate::component::Prepared),
}

impl Compiled {
    /// Whether this is a component exporting `wasi:http/incoming-handler`: it runs as an HTTP
    /// server rather than once.
    pub fn serves_http(&self) -> bool {
        match self {
            Compiled::Module(_) => false,
            Compiled::Component(c) => c.serves_http,
        }
    }
}

struct Host {
    wasi: Option<WasiP1Ctx>,
    limits: Limiter,
}

/// One Wasmtime engine, its epoch ticker and the compiled-module cache.
pub struct WasmRuntime {
    sandbox: Sandbox,
    core_linker: std::sync::OnceLock<Result<Linker<Host>, String>>,
    component_linker: std::sync::OnceLock<
        Result<wasmtime::component::Linker<crate::component::ComponentHost>, String>,
    >,
    cache: Mutex<ModuleCache>,
    ticker_stop: Arc<AtomicBool>,
}

impl WasmRuntime {
    /// Builds the engine (cranelift, epoch interruption, fuel if configured).
    pub fn new(limits: Limits) -> Result<Self, RunError> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        config.consume_fuel(limits.fuel.is_some());
        config.max_wasm_stack(WASM_STACK_BYTES);
        let engine = Engine::new(&config).map_err(|e| RunError::Compile(e.to_string()))?;
        let ticker_stop = Arc::new(AtomicBool::new(false));
        let ticking = engine.clone();
        let stop = ticker_stop.clone();
        std::thread::Builder::new()
            .name("wasm-epoch".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    ticking.increment_epoch();
                }
            })
            .map_err(|e| RunError::Compile(format!("cannot start epoch ticker: {e}")))?;
        let cache = Mutex::new(ModuleCache::new(limits.cache_entries));
        if let Some(dir) = &limits.disk_cache {
            create_private_dir(dir)
                .map_err(|e| RunError::Compile(format!("module cache {}: {e}", dir.display())))?;
        }
        Ok(Self {
            sandbox: Sandbox::new(engine, limits),
            core_linker: std::sync::OnceLock::new(),
            component_linker: std::sync::OnceLock::new(),
            cache,
            ticker_stop,
        })
    }

    /// Compiles `bytes`, or returns the module with the same content from the memory cache
    /// or the disk cache; the flag says whether compilation was avoided.
    pub fn compile(&self, bytes: &[u8]) -> Result<(Compiled, bool), RunError> {
        let digest: [u8; 32] = Sha256::digest(bytes).into();
        if let Some(compiled) = self.cache_lock().get(&digest) {
            return Ok((compiled, true));
        }
        if let Some(compiled) = self.load_from_disk(&digest, is_component(bytes)) {
            self.cache_lock().put(digest, compiled.clone());
            return Ok((compiled, true));
        }
        let compiled = self.compile_uncached(bytes)?;
        self.store_on_disk(&digest, &compiled);
        self.cache_lock().put(digest, compiled.clone());
        Ok((compiled, false))
    }

    /// Compiles a module or component and keeps it in no cache, in memory or on disk (a
    /// decrypted module must not rest anywhere).
    pub fn compile_uncached(&self, bytes: &[u8]) -> Result<Compiled, RunError> {
        if is_component(bytes) {
            let component = Component::new(self.engine(), bytes)
                .map_err(|e| RunError::Compile(root_cause(&e)))?;
            self.prepare(component)
        } else {
            Module::new(self.engine(), bytes)
                .map(Compiled::Module)
                .map_err(|e| RunError::Compile(root_cause(&e)))
        }
    }

    /// Links `component` against the imports components get (the linker is built once).
    fn prepare(&self, component: Component) -> Result<Compiled, RunError> {
        let linker = self
            .component_linker
            .get_or_init(|| crate::component::linker(self.engine()).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| RunError::Link(e.clone()))?;
        Ok(Compiled::Component(crate::component::Prepared::new(
            linker, component,
        )))
    }

    /// The engine every task runs on.
    pub fn engine(&self) -> &Engine {
        self.sandbox.engine()
    }

    /// The limits every task runs under.
    pub fn limits(&self) -> &Limits {
        self.sandbox.limits()
    }

    /// The engine and limits a single run needs.
    pub fn sandbox(&self) -> &Sandbox {
        &self.sandbox
    }

    fn disk_path(&self, digest: &[u8; 32]) -> Option<PathBuf> {
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        self.limits()
            .disk_cache
            .as_ref()
            .map(|dir| dir.join(format!("{hex}.cwasm")))
    }

    fn load_from_disk(&self, digest: &[u8; 32], component: bool) -> Option<Compiled> {
        let path = self.disk_path(digest)?;
        if !path.exists() {
            return None;
        }
        // SAFETY: the file was written by `store_on_disk` of this agent, from `serialize`, into
        // a directory only the agent may write (created 0700). Wasmtime checks that it was
        // produced by a compatible engine and configuration, and of the same kind (module or
        // component), and refuses it otherwise.
        let loaded = unsafe {
            if component {
                Component::deserialize_file(self.engine(), &path)
                    .map_err(|e| RunError::Compile(root_cause(&e)))
                    .and_then(|c| self.prepare(c))
            } else {
                Module::deserialize_file(self.engine(), &path)
                    .map(Compiled::Module)
                    .map_err(|e| RunError::Compile(root_cause(&e)))
            }
        };
        match loaded {
            Ok(compiled) => Some(compiled),
            Err(_) => {
                // Stale (another Wasmtime version or settings) or damaged: compile afresh.
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    fn store_on_disk(&self, digest: &[u8; 32], compiled: &Compiled) {
        let Some(path) = self.disk_path(digest) else {
            return;
        };
        let serialized = match compiled {
            Compiled::Module(m) => m.serialize(),
            Compiled::Component(c) => c.component.serialize(),
        };
        let Ok(bytes) = serialized else {
            return;
        };
        // Written aside and renamed: loaded modules map their file, so an existing file must
        // never be rewritten in place. A write failure only costs a recompilation later.
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, bytes).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }

    fn cache_lock(&self) -> std::sync::MutexGuard<'_, ModuleCache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `invocation` on `compiled`; blocks the calling thread (call from a blocking pool).
    pub fn run(
        &self,
        compiled: &Compiled,
        invocation: &Invocation,
        stop: &StopFlag,
    ) -> Result<Outcome, RunError> {
        match compiled {
            Compiled::Module(module) => self.run_module(module, invocation, stop),
            Compiled::Component(component) => {
                crate::component::run(&self.sandbox, component, invocation, stop)
            }
        }
    }

    fn run_module(
        &self,
        module: &Module,
        invocation: &Invocation,
        stop: &StopFlag,
    ) -> Result<Outcome, RunError> {
        let needs_wasi = module.imports().any(|i| {
            i.module().starts_with("wasi_snapshot_preview1") || i.module() == "wasi_unstable"
        });
        let pipes = Pipes::new(self.limits().max_output_bytes, invocation);
        let wasi = if needs_wasi {
            Some(self.sandbox.wasi_builder(invocation, &pipes)?.build_p1())
        } else {
            None
        };
        let limits = self.sandbox.limiter(&invocation.gauge);
        let mut store = self.sandbox.store(
            Host { wasi, limits },
            |host| &mut host.limits,
            invocation,
            stop,
        )?;

        // Built once: adding WASI's functions to a linker costs more than a small run.
        let linker = self
            .core_linker
            .get_or_init(|| {
                let mut linker: Linker<Host> = Linker::new(self.engine());
                wasmtime_wasi::p1::add_to_linker_sync(&mut linker, |host: &mut Host| {
                    host.wasi.as_mut().unwrap_or_else(|| {
                        unreachable!(
                            "only modules importing WASI can call it, and they get a context"
                        )
                    })
                })
                .map(|_| linker)
                .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| RunError::Link(e.clone()))?;
        let classify = |error: wasmtime::Error| {
            self.sandbox
                .classify_error(error, invocation, stop, &pipes.stderr)
        };
        let instance = match linker.instantiate(&mut store, module) {
            Ok(i) => i,
            Err(e) => return Err(classify(e)),
        };
        if let Some(init) = instance.get_func(&mut store, "_initialize") {
            if let Err(e) = init.call(&mut store, &[], &mut []) {
                return Err(classify(e));
            }
        }
        let (name, func) = resolve_export(&mut store, &instance, &invocation.function)?;
        let params = convert_inputs(
            &func.ty(&store).params().collect::<Vec<_>>(),
            &invocation.inputs,
        )?;
        let mut results = vec![Val::I32(0); func.ty(&store).results().len()];
        let call = func.call(&mut store, &params, &mut results);
        let memory_bytes = memory_size(&mut store, &instance);
        let fuel_used = self.sandbox.fuel_used(&store);
        let is_command = name == "_start";
        match call {
            Ok(()) => {}
            Err(e) => match e.downcast_ref::<I32Exit>() {
                Some(I32Exit(0)) => {}
                _ => return Err(classify(e)),
            },
        }
        let output = if is_command || results.is_empty() && needs_wasi {
            pipes.command_output()
        } else {
            results.first().map(format_value).unwrap_or_default()
        };
        Ok(Outcome {
            output,
            fuel_used,
            memory_bytes,
        })
    }
}

impl Drop for WasmRuntime {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
    }
}
