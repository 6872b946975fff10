//! The agent's own HTTP endpoint: `/health` (liveness), `/ready` (connected to the broker)
//! and `/metrics` (Prometheus text). Off unless enabled; see `--metrics-enabled`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

/// Counters the agent keeps about its work.
#[derive(Debug, Clone, Default)]
pub struct AgentMetrics {
    /// Tasks accepted for execution.
    pub tasks_started: Counter,
    /// Tasks that produced a result.
    pub tasks_succeeded: Counter,
    /// Tasks (or start requests) that produced an error result.
    pub tasks_failed: Counter,
    /// Tasks running now.
    pub tasks_running: Gauge,
    /// MQTT sessions established since start (reconnects = this − 1).
    pub mqtt_sessions: Counter,
    /// 1 while connected to the broker.
    pub mqtt_connected: Gauge,
    /// Results waiting in the spool.
    pub spooled_results: Gauge,
}

impl AgentMetrics {
    fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix("proplet");
        r.register(
            "tasks_started",
            "Tasks accepted",
            self.tasks_started.clone(),
        );
        r.register(
            "tasks_succeeded",
            "Tasks that returned a result",
            self.tasks_succeeded.clone(),
        );
        r.register(
            "tasks_failed",
            "Tasks or start requests answered with an error",
            self.tasks_failed.clone(),
        );
        r.register(
            "tasks_running",
            "Tasks running now",
            self.tasks_running.clone(),
        );
        r.register(
            "mqtt_sessions",
            "MQTT sessions established",
            self.mqtt_sessions.clone(),
        );
        r.register(
            "mqtt_connected",
            "1 while connected to the broker",
            self.mqtt_connected.clone(),
        );
        r.register(
            "spooled_results",
            "Results waiting for delivery",
            self.spooled_results.clone(),
        );
        r
    }
}

/// Serves the endpoint on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<AgentMetrics>) {
    let registry = Arc::new(metrics.registry());
    loop {
        let Ok((socket, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let (metrics, registry) = (metrics.clone(), registry.clone());
        tokio::spawn(async move {
            if let Err(e) = answer(socket, &metrics, &registry).await {
                debug!(%peer, %e, "telemetry request failed");
            }
        });
    }
}

/// Binds the endpoint's listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

async fn answer(
    mut socket: TcpStream,
    metrics: &AgentMetrics,
    registry: &Registry,
) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(512);
    let mut buf = [0u8; 512];
    let read_head = async {
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
            let n = socket.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            request.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    if tokio::time::timeout(Duration::from_secs(5), read_head)
        .await
        .is_err()
    {
        return Ok(());
    }
    let head = String::from_utf8_lossy(&request);
    let mut parts = head.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, content_type, body) = match (method, path) {
        ("GET", "/health") => (
            "200 OK",
            "application/json",
            format!(
                r#"{{"status":"ok","running_tasks":{}}}"#,
                metrics.tasks_running.get()
            ),
        ),
        ("GET", "/ready") if metrics.mqtt_connected.get() == 1 => {
            ("200 OK", "application/json", r#"{"status":"ready"}"#.into())
        }
        ("GET", "/ready") => (
            "503 Service Unavailable",
            "application/json",
            r#"{"status":"not connected to the broker"}"#.into(),
        ),
        ("GET", "/metrics") => {
            let mut text = String::new();
            encode(&mut text, registry).map_err(std::io::Error::other)?;
            (
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                text,
            )
        }
        _ => ("404 Not Found", "text/plain", "not found\n".into()),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(response.as_bytes()).await?;
    socket.shutdown().await
}
