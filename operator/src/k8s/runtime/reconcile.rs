//! The reconcile functions and error policy kube-runtime's Controllers call in Kubernetes
//! mode: the shared ones (`crate::controller::runner`), on [`Shared`].

pub use crate::controller::runner::{
    error_policy, reconcile_federated_job, reconcile_propeller_job, reconcile_proplet,
    reconcile_task, reconcile_training_round,
};
