//! Propeller operator: the custom resource types, the pure decision core that every driver
//! executes, and the Kubernetes driver.

pub mod crd;
pub mod decision;
pub mod inbox;
pub mod k8s;
pub mod metrics;
pub mod validation;
