//! Propeller's core: the six resource types and the pure decision logic every driver
//! executes. A reconcile step here is a function from (object, observations, now) to a plan;
//! the drivers (the Kubernetes one through kube-rs, the standalone one over its store) read
//! the observations and apply the plans. This crate has no Kubernetes client, no async
//! runtime and no I/O in its dependencies, so that layering is kept by the compiler.

pub mod crd;
pub mod decision;
pub mod image_reference;
pub mod object_name;
pub mod shard;
