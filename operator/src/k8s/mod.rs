//! The Kubernetes driver: desired objects, the broker's credential table, and the executors
//! that apply the decision core's plans through kube-rs.

pub mod credentials;
pub mod deployment;
pub mod jobs;
pub mod observations;
pub mod patch;
pub mod proplet;
pub mod pull_secrets;
pub mod runtime;
pub mod task;
pub mod task_job;
