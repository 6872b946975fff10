//! The agent's own HTTP endpoint: `/health` (liveness), `/ready` (connected to the broker)
//! and `/metrics` (Prometheus text). Off unless enabled; see `--metrics-enabled`.

use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use propeller_broker::http::{Handler, Reply, OPENMETRICS};
use tokio::net::TcpListener;

/// Counters the agent keeps about its work.
#[derive(Debug, Clone)]
pub struct AgentMetrics {
    /// From a start request's arrival to its result handed to the MQTT client (compile or
    /// cache lookup, run, and the result's durable spooling included).
    pub task_turnaround: Histogram,
    /// Tasks accepted for execution.
    pub tasks_started: Counter,
    /// Starts of a run that already finished here, answered with its result instead of a
    /// second run.
    pub repeated_starts: Counter,
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

impl Default for AgentMetrics {
    fn default() -> Self {
        Self {
            // 50 µs to about 1.6 s.
            task_turnaround: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            tasks_started: Counter::default(),
            repeated_starts: Counter::default(),
            tasks_succeeded: Counter::default(),
            tasks_failed: Counter::default(),
            tasks_running: Gauge::default(),
            mqtt_sessions: Counter::default(),
            mqtt_connected: Gauge::default(),
            spooled_results: Gauge::default(),
        }
    }
}

impl AgentMetrics {
    fn registry(&self) -> Registry {
        let mut r = Registry::with_prefix("proplet");
        r.register(
            "task_turnaround_seconds",
            "From a start request's arrival to its result handed to the MQTT client",
            self.task_turnaround.clone(),
        );
        r.register(
            "tasks_started",
            "Tasks accepted",
            self.tasks_started.clone(),
        );
        r.register(
            "repeated_starts",
            "Starts of a run already finished here, answered with its result",
            self.repeated_starts.clone(),
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
    let registry = metrics.registry();
    let handler: Handler = Arc::new(move |method, path| reply(method, path, &metrics, &registry));
    propeller_broker::http::serve(listener, handler).await;
}

/// Binds the endpoint's listener.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}

fn reply(method: &str, path: &str, metrics: &AgentMetrics, registry: &Registry) -> Reply {
    match (method, path) {
        ("GET", "/health") => Reply::ok(
            "application/json",
            format!(
                r#"{{"status":"ok","running_tasks":{}}}"#,
                metrics.tasks_running.get()
            ),
        ),
        ("GET", "/ready") if metrics.mqtt_connected.get() == 1 => {
            Reply::ok("application/json", r#"{"status":"ready"}"#)
        }
        ("GET", "/ready") => Reply::unavailable(r#"{"status":"not connected to the broker"}"#),
        ("GET", "/metrics") => {
            let mut text = String::new();
            match encode(&mut text, registry) {
                Ok(()) => Reply::ok(OPENMETRICS, text),
                Err(_) => Reply::unavailable(r#"{"status":"metrics encoding failed"}"#),
            }
        }
        _ => Reply::not_found(),
    }
}
