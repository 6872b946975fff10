//! Propeller operator: the custom resource types, the pure decision core that every driver
//! executes, and the Kubernetes driver.

pub mod crd;
pub mod decision;
pub mod executor;
pub mod inbox;
pub mod k8s;
pub mod metrics;
pub mod oci;
pub mod standalone;
pub mod state;
pub mod validation;
