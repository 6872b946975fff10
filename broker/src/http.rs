//! Health, readiness and metrics endpoints (agent and operator) on hyper's HTTP/1.1 server.
//!
//! Probes and Prometheus send small GET requests; a [`Handler`] maps (method, path) to a
//! [`Reply`]. hyper does the protocol (keep-alive, pipelining, malformed requests); a client
//! that does not finish its request head within five seconds is dropped.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::CONTENT_TYPE;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

/// Time allowed for the request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// One response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Status code.
    pub status: u16,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl Reply {
    /// A 200 response.
    pub fn ok(content_type: &'static str, body: impl Into<String>) -> Self {
        Self {
            status: 200,
            content_type,
            body: body.into(),
        }
    }

    /// A 503 response (not ready).
    pub fn unavailable(body: impl Into<String>) -> Self {
        Self {
            status: 503,
            content_type: "application/json",
            body: body.into(),
        }
    }

    /// A 404 response.
    pub fn not_found() -> Self {
        Self {
            status: 404,
            content_type: "text/plain",
            body: "not found\n".into(),
        }
    }

    fn into_response(self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(Bytes::from(self.body)));
        *response.status_mut() = hyper::StatusCode::from_u16(self.status)
            .unwrap_or(hyper::StatusCode::INTERNAL_SERVER_ERROR);
        response.headers_mut().insert(
            CONTENT_TYPE,
            hyper::header::HeaderValue::from_static(self.content_type),
        );
        response
    }
}

/// `Content-Type` of Prometheus' OpenMetrics text.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Decides the reply for (method, path).
pub type Handler = Arc<dyn Fn(&str, &str) -> Reply + Send + Sync>;

/// Serves `handler` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, handler: Handler) {
    loop {
        let Ok((socket, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let handler = handler.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: Request<_>| {
                let reply = handler(request.method().as_str(), request.uri().path());
                async move { Ok::<_, std::convert::Infallible>(reply.into_response()) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEAD_TIMEOUT)
                .serve_connection(TokioIo::new(socket), service);
            if let Err(e) = connection.await {
                tracing::debug!(%peer, %e, "HTTP connection failed");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn exchange(addr: std::net::SocketAddr, request: &str) -> String {
        let mut socket = tokio::net::TcpStream::connect(addr).await.expect("connect");
        socket.write_all(request.as_bytes()).await.expect("write");
        let mut out = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), socket.read_to_string(&mut out)).await;
        out
    }

    #[tokio::test]
    async fn routes_by_method_and_path_and_keeps_connections_alive() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handler: Handler = Arc::new(|method, path| match (method, path) {
            ("GET", "/healthz") => Reply::ok("application/json", r#"{"status":"ok"}"#),
            ("GET", "/readyz") => Reply::unavailable(r#"{"status":"not leading"}"#),
            _ => Reply::not_found(),
        });
        let server = tokio::spawn(serve(listener, handler));
        // Two pipelined requests on one connection, the second closing it.
        let both = exchange(
            addr,
            "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(both.starts_with("HTTP/1.1 200 OK"), "{both}");
        assert!(both.contains(r#"{"status":"ok"}"#));
        assert!(both.contains("HTTP/1.1 503 Service Unavailable"), "{both}");
        let missing = exchange(
            addr,
            "POST /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
        let garbage = exchange(addr, "NOT HTTP AT ALL\r\n\r\n").await;
        assert!(garbage.starts_with("HTTP/1.1 400"), "{garbage}");
        server.abort();
    }
}
