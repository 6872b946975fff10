//! Running WebAssembly components (WASI 0.2) on the agent's one engine.
//!
//! A component is run the way upstream's proplet runs it, so results are identical:
//! - **Command** (task name empty, `_start` or `fl-round-…`): `wasi:cli/run` is called; the
//!   result is the captured stdout, then `\n` and stderr if any. A failed run or a non-zero
//!   exit is an error carrying stderr.
//! - **Custom export** (any other name): the name is a top-level export, `instance#func`, or a
//!   function of an exported instance; each input is a WAVE literal parsed against its
//!   parameter type, and the first result is encoded as WAVE text (`"hello"` with quotes).
//! - **HTTP server** (exports `wasi:http/incoming-handler`): served by the `http_server` module.
//!
//! The guest gets the same policy as a core module: env and args only, preopens only from the
//! allow-list, the memory cap, the wall-clock limit, fuel, and a stop that interrupts even a
//! pure compute loop within one epoch tick. It runs on a blocking thread, never on the
//! agent's async workers, so heartbeats and MQTT keep going whatever the guest does.
//! Outgoing `wasi:http` requests follow [`OutgoingHttp`].

use std::sync::Arc;

use wasmtime::component::types::ComponentItem;
use wasmtime::component::{
    Component, ComponentExportIndex, Func, Instance, InstancePre, Linker, ResourceTable, Val,
};
use wasmtime::{Engine, Store};
use wasmtime_wasi::p2::bindings::sync::CommandPre;
use wasmtime_wasi::{I32Exit, WasiCtx, WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpHooks, WasiHttpView};

use crate::sandbox::limits::{Limiter, RunError, StopFlag};
use crate::sandbox::output::Pipes;
use crate::sandbox::values::root_cause;
use crate::sandbox::{Invocation, Outcome, Sandbox};

/// The export that makes a component an HTTP server.
pub(crate) const HTTP_HANDLER: &str = "wasi:http/incoming-handler";

pub use crate::outgoing_http::OutgoingHttp;

/// The hooks that send every guest request under [`OutgoingHttp`].
pub(crate) struct HttpHooks(Arc<OutgoingHttp>);

impl WasiHttpHooks for HttpHooks {
    fn send_request(
        &mut self,
        request: http::Request<wasmtime_wasi_http::WasiBody>,
        options: Option<wasmtime_wasi_http::RequestOptions>,
        fut: Box<dyn std::future::Future<Output = Result<(), wasmtime_wasi_http::Error>> + Send>,
    ) -> Box<
        dyn std::future::Future<
                Output = Result<
                    (
                        http::Response<wasmtime_wasi_http::WasiBody>,
                        crate::outgoing_http::Driver,
                    ),
                    wasmtime_wasi_http::Error,
                >,
            > + Send,
    > {
        // Response-processing errors need no reporting beyond what the guest sees.
        drop(fut);
        Box::new(crate::outgoing_http::send(self.0.clone(), request, options))
    }

    /// A certificate the roots do not vouch for is a certificate error, not a protocol one,
    /// so the guest can tell "trust this CA" from "this is not TLS".
    fn p2_error_from_tls(
        &mut self,
        err: &std::io::Error,
    ) -> wasmtime_wasi_http::p2::bindings::http::types::ErrorCode {
        use wasmtime_wasi_http::p2::bindings::http::types::ErrorCode;
        let rejected = err
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
            .is_some_and(|e| matches!(e, rustls::Error::InvalidCertificate(_)));
        tracing::debug!(error = %err, "guest HTTPS handshake failed");
        if rejected {
            ErrorCode::TlsCertificateError
        } else {
            ErrorCode::TlsProtocolError
        }
    }
}

/// What a component's store holds.
pub(crate) struct ComponentHost {
    wasi: WasiCtx,
    table: ResourceTable,
    http: WasiHttpCtx,
    hooks: HttpHooks,
    limits: Limiter,
}

impl ComponentHost {
    pub(crate) fn limiter(&mut self) -> &mut Limiter {
        &mut self.limits
    }
}

impl WasiView for ComponentHost {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for ComponentHost {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http,
            table: &mut self.table,
            hooks: &mut self.hooks,
        }
    }
}

/// A store for one run of a component, and its output pipes.
pub(crate) fn new_store(
    sandbox: &Sandbox,
    invocation: &Invocation,
    stop: &StopFlag,
) -> Result<(Store<ComponentHost>, Pipes), RunError> {
    let pipes = Pipes::new(sandbox.limits().max_output_bytes, invocation);
    let wasi = sandbox.wasi_builder(invocation, &pipes)?.build();
    let host = ComponentHost {
        wasi,
        table: ResourceTable::new(),
        http: WasiHttpCtx::new(),
        hooks: HttpHooks(Arc::new(sandbox.limits().outgoing_http.clone())),
        limits: sandbox.limiter(&invocation.gauge),
    };
    let store = sandbox.store(host, ComponentHost::limiter, invocation, stop)?;
    Ok((store, pipes))
}

/// A linker with everything a component may import: WASI 0.2, `wasi:http` and the HAL.
pub(crate) fn linker(engine: &Engine) -> Result<Linker<ComponentHost>, RunError> {
    let mut linker = Linker::new(engine);
    let link = |e: wasmtime::Error| RunError::Link(root_cause(&e));
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker).map_err(link)?;
    wasmtime_wasi_http::p2::add_only_http_to_linker_sync(&mut linker).map_err(link)?;
    crate::hal::add_to_linker(&mut linker).map_err(link)?;
    Ok(linker)
}

/// Whether a task with this name runs a component as a command (upstream's rule).
pub fn is_command_name(name: &str) -> bool {
    name.is_empty() || name == "_start" || name.starts_with("fl-round-")
}

fn export_names(component: &Component, engine: &Engine) -> Vec<String> {
    component
        .component_type()
        .exports(engine)
        .map(|(name, _)| name.to_owned())
        .collect()
}

fn exports_interface(component: &Component, engine: &Engine, interface: &str) -> bool {
    component
        .component_type()
        .exports(engine)
        .any(|(name, item)| {
            matches!(item.ty, ComponentItem::ComponentInstance(_))
                && (name == interface || name.starts_with(&format!("{interface}@")))
        })
}

/// A compiled component with its imports resolved once, so each run only instantiates.
#[derive(Clone)]
pub struct Prepared {
    pub(crate) component: Component,
    /// The linked component, or why its imports cannot be satisfied (reported at run time).
    pub(crate) pre: Result<InstancePre<ComponentHost>, String>,
    /// It exports `wasi:http/incoming-handler`, so it runs as a server (read once).
    pub(crate) serves_http: bool,
}

impl Prepared {
    /// Resolves `component`'s imports against `linker`.
    pub(crate) fn new(linker: &Linker<ComponentHost>, component: Component) -> Self {
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|e| root_cause(&e));
        let serves_http = exports_interface(&component, linker.engine(), HTTP_HANDLER);
        Self {
            component,
            pre,
            serves_http,
        }
    }

    pub(crate) fn linked(&self) -> Result<&InstancePre<ComponentHost>, RunError> {
        self.pre.as_ref().map_err(|e| RunError::Link(e.clone()))
    }
}

/// Runs `prepared` once; blocks the calling thread.
pub(crate) fn run(
    sandbox: &Sandbox,
    prepared: &Prepared,
    invocation: &Invocation,
    stop: &StopFlag,
) -> Result<Outcome, RunError> {
    let engine = sandbox.engine();
    let component = &prepared.component;
    if prepared.serves_http {
        return Err(RunError::Serve(
            "a component exporting wasi:http/incoming-handler runs as a daemon HTTP server; \
             start it with daemon: true on a proplet with HTTP serving enabled"
                .into(),
        ));
    }
    let pre = prepared.linked()?;
    let (mut store, pipes) = new_store(sandbox, invocation, stop)?;
    let classify =
        |error: wasmtime::Error| sandbox.classify_error(error, invocation, stop, &pipes.stderr);
    let output = if is_command_name(&invocation.function) {
        let Ok(command) = CommandPre::new(pre.clone()) else {
            return Err(RunError::NotACommand(
                export_names(component, engine).join(", "),
            ));
        };
        let command = command.instantiate(&mut store).map_err(classify)?;
        match command.wasi_cli_run().call_run(&mut store) {
            Ok(Ok(())) => pipes.command_output(),
            Ok(Err(())) => {
                return Err(RunError::Exit {
                    code: 1,
                    stderr: String::from_utf8_lossy(&pipes.stderr.contents()).into_owned(),
                })
            }
            Err(e) if matches!(e.downcast_ref::<I32Exit>(), Some(I32Exit(0))) => {
                pipes.command_output()
            }
            Err(e) => return Err(classify(e)),
        }
    } else {
        let instance = pre.instantiate(&mut store).map_err(classify)?;
        let func = resolve_export(
            &mut store,
            &instance,
            component,
            engine,
            &invocation.function,
        )?;
        call_export(&mut store, &func, &invocation.inputs).map_err(|e| match e {
            CallError::Inputs(message) => RunError::Inputs(message),
            CallError::Wasm(error) => classify(error),
        })?
    };
    Ok(Outcome {
        output,
        fuel_used: sandbox.fuel_used(&store),
        memory_bytes: invocation.gauge.memory_bytes() as usize,
    })
}

enum CallError {
    Inputs(String),
    Wasm(wasmtime::Error),
}

/// Calls `func` with WAVE-encoded `inputs`; returns the first result as WAVE text.
fn call_export(
    store: &mut Store<ComponentHost>,
    func: &Func,
    inputs: &[String],
) -> Result<String, CallError> {
    let ty = func.ty(&*store);
    let params: Vec<_> = ty
        .params()
        .map(|(name, ty)| (name.to_owned(), ty))
        .collect();
    if params.len() != inputs.len() {
        return Err(CallError::Inputs(format!(
            "the export takes {} parameter(s), {} input(s) given",
            params.len(),
            inputs.len()
        )));
    }
    let args = params
        .iter()
        .zip(inputs)
        .enumerate()
        .map(|(i, ((name, ty), text))| {
            Val::from_wave(ty, text.trim()).map_err(|e| {
                CallError::Inputs(format!(
                    "input #{} ({name}) {text:?} is not a WAVE value of the parameter's type: {e}",
                    i + 1
                ))
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut results = vec![Val::Bool(false); ty.results().len()];
    func.call(&mut *store, &args, &mut results)
        .map_err(CallError::Wasm)?;
    match results.first() {
        Some(value) => value.to_wave().map_err(|e| {
            CallError::Wasm(wasmtime::Error::msg(format!(
                "cannot encode the result: {e}"
            )))
        }),
        None => Ok(String::new()),
    }
}

/// Finds the export `requested`: a top-level function, `instance#func`, or a function of the
/// same name in one of the exported instances.
fn resolve_export(
    store: &mut Store<ComponentHost>,
    instance: &Instance,
    component: &Component,
    engine: &Engine,
    requested: &str,
) -> Result<Func, RunError> {
    let not_found = || RunError::NoExport {
        name: requested.to_owned(),
        available: export_names(component, engine).join(", "),
    };
    let func_at = |store: &mut Store<ComponentHost>, index: Option<ComponentExportIndex>| {
        index.and_then(|i| instance.get_func(&mut *store, i))
    };
    if let Some((outer, inner)) = requested.split_once('#') {
        let outer = instance.get_export_index(&mut *store, None, outer);
        let index = outer.and_then(|o| instance.get_export_index(&mut *store, Some(&o), inner));
        return func_at(store, index).ok_or_else(not_found);
    }
    let top = instance.get_export_index(&mut *store, None, requested);
    if let Some(func) = func_at(store, top) {
        return Ok(func);
    }
    let instances: Vec<String> = component
        .component_type()
        .exports(engine)
        .filter(|(_, item)| matches!(item.ty, ComponentItem::ComponentInstance(_)))
        .map(|(name, _)| name.to_owned())
        .collect();
    for name in instances {
        let outer = instance.get_export_index(&mut *store, None, &name);
        let index = outer.and_then(|o| instance.get_export_index(&mut *store, Some(&o), requested));
        if let Some(func) = func_at(store, index) {
            return Ok(func);
        }
    }
    Err(not_found())
}
