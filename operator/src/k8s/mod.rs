//! The Kubernetes driver: the executors that apply the core's plans through kube-rs, the
//! Jobs of `k8s` proplets' tasks, and the runtime that drives one Controller per kind.

pub use crate::decision::deployment;
pub mod api_requests;
pub mod console_api;
pub mod fence;
pub mod leader;
pub mod log_access;
pub mod membership;
pub mod patch;
pub mod proplet;
pub mod pull_secrets;
pub mod runtime;
pub mod sharded_watch;
pub mod task_job;
pub mod user_access;
