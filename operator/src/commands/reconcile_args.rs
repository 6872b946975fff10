//! The reconciler settings both `propeller run` and `propeller standalone` take.

use std::time::Duration;

use clap::Args;
use propeller_broker::protocol::parse_setting_duration;
use propeller_operator::decision::proplet::PropletSettings;
use propeller_operator::decision::scheduler::Strategy;
use propeller_operator::decision::task::{FinalizerTiming, TaskSettings};
use propeller_operator::task_logs::LogSettings;

/// Liveness, status-write and scheduling flags; each also reads a `PROPELLER_*` variable.
#[derive(Args, Debug, Clone)]
pub struct ReconcileArgs {
    /// An external proplet is Offline once its last heartbeat is this old.
    #[arg(long, env = "PROPELLER_LAST_SEEN_THRESHOLD", default_value = "30s", value_parser = parse_setting_duration)]
    pub last_seen_threshold: Duration,
    /// How often every proplet's liveness is re-evaluated even without events.
    #[arg(long, env = "PROPELLER_LIVELINESS_INTERVAL", default_value = "10s", value_parser = parse_setting_duration)]
    pub liveliness_interval: Duration,
    /// Heartbeat-only status changes are written at most this often per proplet.
    #[arg(long, env = "PROPELLER_STATUS_FLUSH_INTERVAL", default_value = "5s", value_parser = parse_setting_duration)]
    pub status_flush_interval: Duration,
    /// Heartbeat-only Proplet status writes per second across the whole fleet (0: no cap).
    /// With many proplets each one's lastSeen is refreshed less often, so the store (the
    /// API server in Kubernetes mode) keeps room for phase changes, which are never held
    /// back; a routine heartbeat causes no reconcile until its proplet's refresh is due.
    #[arg(
        long,
        env = "PROPELLER_HEARTBEAT_WRITES_PER_SECOND",
        default_value_t = 20
    )]
    pub heartbeat_writes_per_second: u32,
    /// A task's `running` status is written only if its result has not come this long after
    /// the start; a quicker result makes `completed` the only write after the assignment.
    #[arg(long, env = "PROPELLER_RUNNING_WRITE_DELAY", default_value = "1s", value_parser = parse_setting_duration)]
    pub running_write_delay: Duration,
    /// Scoring of candidate proplets: round-robin, least-loaded (or priority).
    #[arg(long, env = "PROPELLER_SCHEDULER", default_value = "round-robin")]
    pub scheduler: Strategy,
    /// Time limit of tasks without spec.timeoutSeconds (daemons are exempt).
    #[arg(long, env = "PROPELLER_TASK_TIMEOUT", default_value = "1h", value_parser = parse_setting_duration)]
    pub task_timeout: Duration,
    /// How long a task's output is kept after its last line (`propeller logs`).
    #[arg(long, env = "PROPELLER_TASK_LOG_RETENTION", default_value = "1h", value_parser = parse_setting_duration)]
    pub task_log_retention: Duration,
    /// Bytes of output kept per task (its newest lines).
    #[arg(long, env = "PROPELLER_TASK_LOG_BYTES", default_value_t = 256 * 1024)]
    pub task_log_bytes: usize,
    /// Bytes of task output kept in all; past them the logs quiet the longest go first.
    #[arg(long, env = "PROPELLER_TASK_LOG_TOTAL_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub task_log_total_bytes: usize,
}

impl ReconcileArgs {
    /// The Proplet plan's settings.
    pub fn proplet(&self) -> PropletSettings {
        PropletSettings {
            last_seen_threshold: self.last_seen_threshold,
            status_flush_interval: self.status_flush_interval,
            routine_writes_per_second: self.heartbeat_writes_per_second,
        }
    }

    /// How much task output is kept.
    pub fn logs(&self) -> LogSettings {
        LogSettings {
            task_bytes: self.task_log_bytes,
            retention: self.task_log_retention,
            total_bytes: self.task_log_total_bytes,
        }
    }

    /// The Task plan's settings, for a backend whose finalizer writes come at `finalizer`.
    pub fn task(&self, finalizer: FinalizerTiming) -> TaskSettings {
        TaskSettings {
            strategy: self.scheduler,
            default_timeout: self.task_timeout,
            running_write_delay: self.running_write_delay,
            finalizer,
        }
    }
}
