//! Propeller operator: the custom resource types, the pure decision core that every driver
//! executes, and (in later modules) the Kubernetes and standalone drivers.

pub mod crd;
pub mod decision;
pub mod k8s;
pub mod validation;
