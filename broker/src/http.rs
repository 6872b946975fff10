//! A minimal HTTP/1.1 responder for health, readiness and metrics endpoints.
//!
//! Probes and Prometheus only send small GET requests, so a full HTTP stack would add size to
//! the device agent for nothing. Each connection answers one request and closes; a client that
//! does not finish its request head within five seconds is dropped.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest request head read.
const MAX_HEAD: usize = 8192;
/// Time allowed for the request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);

/// One response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Status line text, e.g. `200 OK`.
    pub status: &'static str,
    /// `Content-Type`.
    pub content_type: &'static str,
    /// Body.
    pub body: String,
}

impl Reply {
    /// A 200 response.
    pub fn ok(content_type: &'static str, body: impl Into<String>) -> Self {
        Self {
            status: "200 OK",
            content_type,
            body: body.into(),
        }
    }

    /// A 503 response (not ready).
    pub fn unavailable(body: impl Into<String>) -> Self {
        Self {
            status: "503 Service Unavailable",
            content_type: "application/json",
            body: body.into(),
        }
    }

    /// A 404 response.
    pub fn not_found() -> Self {
        Self {
            status: "404 Not Found",
            content_type: "text/plain",
            body: "not found\n".into(),
        }
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
            if let Err(e) = answer(socket, &handler).await {
                tracing::debug!(%peer, %e, "HTTP request failed");
            }
        });
    }
}

async fn answer(mut socket: TcpStream, handler: &Handler) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    let read_head = async {
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < MAX_HEAD {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            request.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    if tokio::time::timeout(HEAD_TIMEOUT, read_head).await.is_err() {
        return Ok(());
    }
    let head = String::from_utf8_lossy(&request);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let reply = handler(method, path);
    let response = format!(
        "HTTP/1.1 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        reply.status,
        reply.content_type,
        reply.body.len(),
        reply.body
    );
    socket.write_all(response.as_bytes()).await?;
    socket.shutdown().await
}
