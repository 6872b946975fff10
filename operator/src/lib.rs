//! Propeller operator: the Kubernetes and standalone drivers of the core's plans
//! (`propeller-core`, re-exported here as `crd` and `decision`), the image
//! puller and the validation of objects.

pub use propeller_core::{crd, decision};
pub mod console;
pub mod controller;
pub mod credentials;
pub mod enrolment;
pub mod enrolment_queue;
pub mod errors;
pub mod inbox;
pub mod k8s;
pub mod key_delivery;
pub mod log_endpoint;
pub mod manifest;
pub mod metrics;
pub mod observations;
pub mod oci;
pub mod own_writes;
pub mod proplet_index;
pub mod standalone;
pub mod state;
pub mod task_index;
pub mod task_logs;
pub mod validation;
pub mod watch_index;
