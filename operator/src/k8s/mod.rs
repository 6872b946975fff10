//! Kubernetes-side building blocks of the operator: desired objects and the broker's
//! credential table, derived from resources without any API call.

pub mod credentials;
pub mod deployment;
pub mod observations;
pub mod proplet;
