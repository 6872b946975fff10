//! What the agent reports about its host and itself: discovery metadata and resource use.

use std::sync::Mutex;

use propeller_broker::protocol::{
    CpuMetrics, HeartbeatMetrics, MemoryMetrics, PropletMetadata, PropletMetrics, Timestamp,
};
use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System};

use crate::config::Config;

/// Samples host and process figures; one instance per agent.
pub struct SystemProbe {
    /// `None` where sysinfo does not support the platform; figures are then omitted.
    system: Mutex<Option<System>>,
    pid: Pid,
    /// Everything in the metadata but the address, which may change between sessions.
    fixed: PropletMetadata,
    ip: Mutex<Option<String>>,
}

impl SystemProbe {
    /// A probe for the current process; reads the host facts once. `attester` is the one
    /// the agent attests with to its Key Broker Service, if it has one.
    pub fn new(config: &Config, attester: Option<&str>) -> Self {
        let mut system = System::new().ok();
        let total_memory = system.as_mut().map(|sys| {
            sys.refresh_memory();
            sys.total_memory()
        });
        let fixed = PropletMetadata {
            description: config.description.clone(),
            tags: config.tags.clone(),
            location: config.location.clone(),
            ip: None,
            environment: Some(
                if std::path::Path::new("/.dockerenv").exists() {
                    "docker"
                } else {
                    "binary"
                }
                .to_owned(),
            ),
            os: Some(std::env::consts::OS.to_owned()),
            hostname: System::host_name().ok(),
            cpu_arch: Some(std::env::consts::ARCH.to_owned()),
            total_memory_bytes: total_memory,
            proplet_version: Some(crate::upgrade::AGENT_VERSION.to_owned()),
            wasm_runtime: Some("wasmtime".to_owned()),
            attester: attester.map(str::to_owned),
        };
        Self {
            system: Mutex::new(system),
            pid: Pid::from_u32(std::process::id()),
            fixed,
            ip: Mutex::new(None),
        }
    }

    /// Learns the local address used to reach the broker (a UDP "connect" sends nothing).
    /// Called once per MQTT session, since the route may change between sessions.
    pub fn learn_ip(&self, host: &str, port: u16) {
        let found = std::net::UdpSocket::bind(("0.0.0.0", 0))
            .and_then(|socket| {
                socket.connect((host, port))?;
                socket.local_addr()
            })
            .ok()
            .map(|addr| addr.ip())
            .filter(|ip| !ip.is_unspecified())
            .map(|ip| ip.to_string());
        *self.ip.lock().unwrap_or_else(|e| e.into_inner()) = found;
    }

    /// Discovery and heartbeat metadata.
    pub fn metadata(&self) -> PropletMetadata {
        PropletMetadata {
            ip: self.ip.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            ..self.fixed.clone()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<System>> {
        self.system.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Host CPU use (all cores, 0–100), and this process's RSS and share of host memory.
    pub fn heartbeat_metrics(&self) -> HeartbeatMetrics {
        let mut guard = self.lock();
        let Some(sys) = guard.as_mut() else {
            return HeartbeatMetrics::default();
        };
        sys.refresh_cpu_usage();
        sys.refresh_memory();
        sys.refresh_processes_specifics(
            ProcessesToUpdate::Some(&[self.pid]),
            true,
            ProcessRefreshKind::nothing().with_memory(),
        );
        let rss = sys.process(self.pid).map(|p| p.memory());
        let total = sys.total_memory();
        HeartbeatMetrics {
            cpu_percent: Some(f64::from(sys.global_cpu_usage())),
            memory_bytes: rss,
            memory_percent: rss
                .filter(|_| total > 0)
                .map(|r| r as f64 * 100.0 / total as f64),
        }
    }

    /// The `control/proplet/metrics` message: the agent process's CPU times and memory.
    pub fn proplet_metrics(&self, proplet_id: &str, namespace: &str) -> PropletMetrics {
        let beat = self.heartbeat_metrics();
        let (user_seconds, system_seconds) = process_cpu_times();
        let (usage, limit) = cgroup_memory();
        PropletMetrics {
            proplet_id: proplet_id.to_owned(),
            namespace: Some(namespace.to_owned()),
            timestamp: Some(Timestamp::now()),
            cpu_metrics: Some(CpuMetrics {
                user_seconds,
                system_seconds,
                percent: beat.cpu_percent,
            }),
            memory_metrics: Some(MemoryMetrics {
                rss_bytes: beat.memory_bytes,
                heap_alloc_bytes: Some(0),
                heap_sys_bytes: Some(0),
                heap_inuse_bytes: Some(0),
                heap_free_bytes: None,
                heap_max_alloc_bytes: None,
                container_usage_bytes: Some(usage.unwrap_or(0)),
                container_limit_bytes: limit,
                percent: beat.memory_percent,
            }),
        }
    }
}

/// User and system CPU seconds of this process (Linux).
fn process_cpu_times() -> (Option<f64>, Option<f64>) {
    match cpu_seconds("/proc/self/stat") {
        Some((user, system)) => (Some(user), Some(system)),
        None => (None, None),
    }
}

/// User and system CPU seconds from a `/proc/.../stat` file: fields 14 and 15, counted after
/// the parenthesised command name (which may itself contain spaces).
pub fn cpu_seconds(stat_path: &str) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // USER_HZ is 100 on every Linux architecture the agent targets.
    let seconds = |i: usize| fields.get(i)?.parse::<f64>().ok().map(|t| t / 100.0);
    Some((seconds(11)?, seconds(12)?))
}

/// cgroup v2 (or v1) memory usage and limit; the limit is `None` when unlimited.
fn cgroup_memory() -> (Option<u64>, Option<u64>) {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let usage = read("/sys/fs/cgroup/memory.current")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.usage_in_bytes"));
    let limit = read("/sys/fs/cgroup/memory.max")
        .or_else(|| read("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
        .filter(|l| *l > 0 && *l < (1 << 62));
    (usage, limit)
}
