//! The figures devices report: the proplet's CPU and memory, and each task's process
//! metrics with their running aggregate.

use serde_json::Value;

use crate::protocol::error::DecodeError;
use crate::protocol::fields::{to_bytes, Fields, ObjectBuilder};
use crate::protocol::time::Timestamp;

/// Process CPU figures of [`PropletMetrics`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CpuMetrics {
    /// `user_seconds`: process user CPU time.
    pub user_seconds: Option<f64>,
    /// `system_seconds`: process system CPU time.
    pub system_seconds: Option<f64>,
    /// `percent`: system-wide CPU use, 0–100.
    pub percent: Option<f64>,
}

optional_figures!(CpuMetrics {
    user_seconds: opt_f64,
    system_seconds: opt_f64,
    percent: opt_f64,
});

/// Memory figures of [`PropletMetrics`]; the Rust agent fills the process and cgroup keys, the
/// embedded agent the heap keys.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryMetrics {
    /// `rss_bytes`: agent resident set size.
    pub rss_bytes: Option<u64>,
    /// `heap_alloc_bytes`.
    pub heap_alloc_bytes: Option<u64>,
    /// `heap_sys_bytes`.
    pub heap_sys_bytes: Option<u64>,
    /// `heap_inuse_bytes`.
    pub heap_inuse_bytes: Option<u64>,
    /// `heap_free_bytes` (embedded only).
    pub heap_free_bytes: Option<u64>,
    /// `heap_max_alloc_bytes` (embedded only).
    pub heap_max_alloc_bytes: Option<u64>,
    /// `container_usage_bytes`: cgroup memory use.
    pub container_usage_bytes: Option<u64>,
    /// `container_limit_bytes`: cgroup limit, absent when unlimited.
    pub container_limit_bytes: Option<u64>,
    /// `percent`: memory use, 0–100 (read by the upstream operator, sent by nobody upstream).
    pub percent: Option<f64>,
}

optional_figures!(MemoryMetrics {
    rss_bytes: opt_u64,
    heap_alloc_bytes: opt_u64,
    heap_sys_bytes: opt_u64,
    heap_inuse_bytes: opt_u64,
    heap_free_bytes: opt_u64,
    heap_max_alloc_bytes: opt_u64,
    container_usage_bytes: opt_u64,
    container_limit_bytes: opt_u64,
    percent: opt_f64,
});

/// Host metrics (`control/proplet/metrics`), sent periodically by each agent.
#[derive(Debug, Clone, PartialEq)]
pub struct PropletMetrics {
    /// `proplet_id` (required, non-empty).
    pub proplet_id: String,
    /// `namespace`.
    pub namespace: Option<String>,
    /// `timestamp`: in whichever of the three forms the sender uses.
    pub timestamp: Option<Timestamp>,
    /// `cpu_metrics`.
    pub cpu_metrics: Option<CpuMetrics>,
    /// `memory_metrics`.
    pub memory_metrics: Option<MemoryMetrics>,
}

pub(super) fn timestamp_at(f: &Fields<'_>, key: &str) -> Result<Option<Timestamp>, DecodeError> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => Timestamp::from_json(v, &f.key(key)).map(Some),
    }
}

impl PropletMetrics {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            proplet_id: f.req_id("proplet_id")?,
            namespace: f.opt_str("namespace")?,
            timestamp: timestamp_at(&f, "timestamp")?,
            cpu_metrics: match f.opt_object("cpu_metrics")? {
                None => None,
                Some(o) => Some(CpuMetrics::from_fields(Fields::nested(o, "cpu_metrics"))?),
            },
            memory_metrics: match f.opt_object("memory_metrics")? {
                None => None,
                Some(o) => Some(MemoryMetrics::from_fields(Fields::nested(
                    o,
                    "memory_metrics",
                ))?),
            },
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("proplet_id", self.proplet_id.clone())
            .put_opt("namespace", self.namespace.clone())
            .put_opt("timestamp", self.timestamp.as_ref().map(Timestamp::to_json))
            .put_opt(
                "cpu_metrics",
                self.cpu_metrics.as_ref().map(CpuMetrics::to_json),
            )
            .put_opt(
                "memory_metrics",
                self.memory_metrics.as_ref().map(MemoryMetrics::to_json),
            )
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// One sample of a task's process (`metrics` of [`TaskMetrics`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProcessMetrics {
    /// `cpu_percent`.
    pub cpu_percent: Option<f64>,
    /// `memory_bytes` (the upstream Rust agent inflates it ×1024).
    pub memory_bytes: Option<u64>,
    /// `memory_percent` (always 0 from the upstream Rust agent).
    pub memory_percent: Option<f64>,
    /// `disk_read_bytes`: cumulative.
    pub disk_read_bytes: Option<u64>,
    /// `disk_write_bytes`: cumulative.
    pub disk_write_bytes: Option<u64>,
    /// `uptime_seconds`.
    pub uptime_seconds: Option<u64>,
    /// `thread_count`.
    pub thread_count: Option<u64>,
    /// `file_descriptor_count`.
    pub file_descriptor_count: Option<u64>,
    /// `fuel_used`: Wasm fuel consumed so far, when the agent meters fuel (our addition;
    /// upstream consumers ignore it).
    pub fuel_used: Option<u64>,
}

optional_figures!(ProcessMetrics {
    cpu_percent: opt_f64,
    memory_bytes: opt_u64,
    memory_percent: opt_f64,
    disk_read_bytes: opt_u64,
    disk_write_bytes: opt_u64,
    uptime_seconds: opt_u64,
    thread_count: opt_u64,
    file_descriptor_count: opt_u64,
    fuel_used: opt_u64,
});

/// Summary over the samples an agent kept (`aggregated` of [`TaskMetrics`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AggregatedMetrics {
    /// `avg_cpu_usage`.
    pub avg_cpu_usage: Option<f64>,
    /// `max_cpu_usage`.
    pub max_cpu_usage: Option<f64>,
    /// `avg_memory_usage`.
    pub avg_memory_usage: Option<f64>,
    /// `max_memory_usage`.
    pub max_memory_usage: Option<f64>,
    /// `total_disk_read`.
    pub total_disk_read: Option<u64>,
    /// `total_disk_write`.
    pub total_disk_write: Option<u64>,
    /// `sample_count`.
    pub sample_count: Option<u64>,
}

optional_figures!(AggregatedMetrics {
    avg_cpu_usage: opt_f64,
    max_cpu_usage: opt_f64,
    avg_memory_usage: opt_f64,
    max_memory_usage: opt_f64,
    total_disk_read: opt_u64,
    total_disk_write: opt_u64,
    sample_count: opt_u64,
});

/// Task metrics (`control/proplet/task_metrics`): periodic samples of one running task.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskMetrics {
    /// `task_id` (required, non-empty).
    pub task_id: String,
    /// `proplet_id`.
    pub proplet_id: Option<String>,
    /// `metrics` (required object; every figure inside is optional).
    pub metrics: ProcessMetrics,
    /// `aggregated`: absent or `null` when the agent keeps no history.
    pub aggregated: Option<AggregatedMetrics>,
    /// `timestamp`.
    pub timestamp: Option<Timestamp>,
}

impl TaskMetrics {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            task_id: f.req_id("task_id")?,
            proplet_id: f.opt_str("proplet_id")?,
            metrics: ProcessMetrics::from_fields(Fields::nested(
                f.req_object("metrics")?,
                "metrics",
            ))?,
            aggregated: match f.opt_object("aggregated")? {
                None => None,
                Some(o) => Some(AggregatedMetrics::from_fields(Fields::nested(
                    o,
                    "aggregated",
                ))?),
            },
            timestamp: timestamp_at(&f, "timestamp")?,
        })
    }

    /// The JSON object; `aggregated` is written as `null` when absent, like the Rust agent.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("task_id", self.task_id.clone())
            .put_opt("proplet_id", self.proplet_id.clone())
            .put("metrics", self.metrics.to_json())
            .put(
                "aggregated",
                self.aggregated
                    .as_ref()
                    .map_or(Value::Null, AggregatedMetrics::to_json),
            )
            .put_opt("timestamp", self.timestamp.as_ref().map(Timestamp::to_json))
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}
