//! Components that export `wasi:http/incoming-handler` run as daemon HTTP/1.1 servers.
//!
//! As in upstream's proplet, the task's result is `started at port N` as soon as the listener
//! is bound, and every request gets a fresh instance of the pre-instantiated component. Unlike
//! upstream, the server stops on the task's stop command (within one poll of the stop flag),
//! a second start of the same task cannot orphan it, each request is bounded in time and runs
//! on a blocking thread (a spinning guest cannot stall the agent), and the bind address and
//! port range are the agent's configuration.

use std::net::{IpAddr, SocketAddr, TcpListener as StdListener};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use wasmtime_wasi_http::io::TokioIo;
use wasmtime_wasi_http::p2::bindings::http::types::Scheme;
use wasmtime_wasi_http::p2::bindings::sync::ProxyPre;
use wasmtime_wasi_http::p2::body::HyperOutgoingBody;
use wasmtime_wasi_http::WasiHttpView;

use crate::component::{new_store, ComponentHost, Prepared};
use crate::wasm::{root_cause, Invocation, RunError, StopFlag, WasmRuntime};

/// How often the accept loop looks at the stop flag.
const STOP_POLL: Duration = Duration::from_millis(20);
/// Time limit of one request's guest call.
const REQUEST_LIMIT: Duration = Duration::from_secs(60);

/// Where HTTP components may listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpServing {
    /// Whether this agent serves HTTP components at all (`PROPLET_HTTP_ENABLED`).
    pub enabled: bool,
    /// Address to bind (`PROPLET_HTTP_BIND`, default all interfaces as upstream).
    pub bind: IpAddr,
    /// Ports tried in order when the task asks for none (`PROPLET_HTTP_PORTS`).
    pub ports: RangeInclusive<u16>,
}

impl Default for HttpServing {
    fn default() -> Self {
        Self {
            enabled: false,
            bind: IpAddr::from([0, 0, 0, 0]),
            ports: 8222..=8321,
        }
    }
}

/// The port a task asks for in its `cli_args`: `--port N`, `--port=N`, `--addr host:N` or
/// `--addr=host:N` (upstream's spellings).
pub fn requested_port(args: &[String]) -> Result<Option<u16>, RunError> {
    let bad = |v: &str| RunError::Serve(format!("{v:?} is not a port"));
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f, Some(v.to_owned())),
            None => (arg.as_str(), None),
        };
        if flag != "--port" && flag != "--addr" {
            continue;
        }
        let Some(value) = inline.or_else(|| iter.next().cloned()) else {
            return Err(RunError::Serve(format!("{flag} needs a value")));
        };
        let port = if flag == "--addr" {
            value
                .rsplit_once(':')
                .map_or(value.as_str(), |(_, p)| p)
                .to_owned()
        } else {
            value
        };
        return port.parse::<u16>().map(Some).map_err(|_| bad(&port));
    }
    Ok(None)
}

fn bind(serving: &HttpServing, requested: Option<u16>) -> Result<StdListener, RunError> {
    if let Some(port) = requested {
        return StdListener::bind(SocketAddr::new(serving.bind, port))
            .map_err(|e| RunError::Serve(format!("port {port} on {}: {e}", serving.bind)));
    }
    serving
        .ports
        .clone()
        .find_map(|port| StdListener::bind(SocketAddr::new(serving.bind, port)).ok())
        .ok_or_else(|| {
            RunError::Serve(format!(
                "no free port in {}-{} on {}",
                serving.ports.start(),
                serving.ports.end(),
                serving.bind
            ))
        })
}

/// A bound, ready server; [`Server::serve`] runs it until the stop flag is set.
pub struct Server {
    listener: tokio::net::TcpListener,
    shared: Arc<Shared>,
}

struct Shared {
    runtime: Arc<WasmRuntime>,
    pre: ProxyPre<ComponentHost>,
    invocation: Invocation,
    stop: StopFlag,
}

impl Server {
    /// Pre-instantiates `component` and binds its port.
    pub fn bind(
        runtime: Arc<WasmRuntime>,
        component: &Prepared,
        mut invocation: Invocation,
        stop: StopFlag,
        serving: &HttpServing,
    ) -> Result<Self, RunError> {
        if !serving.enabled {
            return Err(RunError::Serve(
                "this proplet does not serve HTTP components (set PROPLET_HTTP_ENABLED=true)"
                    .into(),
            ));
        }
        let pre = ProxyPre::new(component.linked()?.clone())
            .map_err(|e| RunError::Link(root_cause(&e)))?;
        let listener = bind(serving, requested_port(&invocation.args)?)?;
        listener
            .set_nonblocking(true)
            .map_err(|e| RunError::Serve(e.to_string()))?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| RunError::Serve(e.to_string()))?;
        invocation.timeout = Some(REQUEST_LIMIT);
        Ok(Self {
            listener,
            shared: Arc::new(Shared {
                runtime,
                pre,
                invocation,
                stop,
            }),
        })
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.listener.local_addr().map_or(0, |a| a.port())
    }

    /// Accepts and serves connections until the task is stopped; open connections are closed.
    pub async fn serve(self) {
        let mut connections = tokio::task::JoinSet::new();
        let mut poll = tokio::time::interval(STOP_POLL);
        loop {
            tokio::select! {
                accepted = self.listener.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let _ = stream.set_nodelay(true);
                    let shared = self.shared.clone();
                    connections.spawn(async move {
                        let service = hyper::service::service_fn(move |request| {
                            let shared = shared.clone();
                            async move { Ok::<_, std::convert::Infallible>(handle(shared, request).await) }
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .keep_alive(true)
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                _ = poll.tick() => {
                    if self.shared.stop.is_stopped() {
                        break;
                    }
                    while connections.try_join_next().is_some() {}
                }
            }
        }
        connections.shutdown().await;
    }
}

fn plain(status: u16, text: String) -> hyper::Response<HyperOutgoingBody> {
    let body = Full::new(Bytes::from(text))
        .map_err(|never| match never {})
        .boxed_unsync();
    let mut response = hyper::Response::new(body);
    *response.status_mut() =
        hyper::StatusCode::from_u16(status).unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
    response
}

async fn handle(
    shared: Arc<Shared>,
    request: hyper::Request<Incoming>,
) -> hyper::Response<HyperOutgoingBody> {
    let (sender, receiver) = tokio::sync::oneshot::channel();
    let call = shared.clone();
    let guest = tokio::task::spawn_blocking(move || -> Result<(), RunError> {
        let (mut store, pipes) = new_store(call.runtime.sandbox(), &call.invocation, &call.stop)?;
        let classify = |e: wasmtime::Error| {
            call.runtime
                .sandbox()
                .classify_error(e, &call.invocation, &call.stop, &pipes.stderr)
        };
        let request = store
            .data_mut()
            .http()
            .new_incoming_request(Scheme::Http, request)
            .map_err(classify)?;
        let out = store
            .data_mut()
            .http()
            .new_response_outparam(sender)
            .map_err(classify)?;
        let proxy = call.pre.instantiate(&mut store).map_err(classify)?;
        proxy
            .wasi_http_incoming_handler()
            .call_handle(&mut store, request, out)
            .map_err(classify)
    });
    match receiver.await {
        Ok(Ok(response)) => response,
        Ok(Err(code)) => plain(500, format!("the component failed the request: {code:?}")),
        Err(_) => {
            let why = match guest.await {
                Ok(Ok(())) => "the component did not set a response".to_owned(),
                Ok(Err(error)) => error.to_string(),
                Err(error) => error.to_string(),
            };
            plain(500, why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn ports_are_read_in_upstreams_spellings() {
        assert_eq!(requested_port(&args(&["--port", "8044"])), Ok(Some(8044)));
        assert_eq!(requested_port(&args(&["--port=8045"])), Ok(Some(8045)));
        assert_eq!(
            requested_port(&args(&["-v", "--addr", "0.0.0.0:9000"])),
            Ok(Some(9000))
        );
        assert_eq!(
            requested_port(&args(&["--addr=127.0.0.1:9001"])),
            Ok(Some(9001))
        );
        assert_eq!(requested_port(&args(&["--verbose"])), Ok(None));
        assert!(requested_port(&args(&["--port", "http"])).is_err());
        assert!(requested_port(&args(&["--port"])).is_err());
    }
}
