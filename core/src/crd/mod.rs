//! The six custom resources. These types are the single source of the CRD YAML in
//! `configs/crd/` (see [`all_crds`]).

pub mod common;
pub mod federated;
pub mod job;
pub mod kueue;
pub mod proplet;
pub mod reference;
pub mod task;
pub mod upgrade;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

pub use common::{Condition, GROUP, PREFIX, VERSION};
pub use federated::{FederatedJob, TrainingRound};
pub use job::PropellerJob;
pub use proplet::Proplet;
pub use reference::crd_reference;
pub use task::Task;
pub use upgrade::PropletUpgrade;

/// Every CRD, in a stable order: Proplet, Task, PropellerJob, FederatedJob, TrainingRound,
/// PropletUpgrade.
pub fn all_crds() -> Vec<CustomResourceDefinition> {
    vec![
        Proplet::crd(),
        Task::crd(),
        PropellerJob::crd(),
        FederatedJob::crd(),
        TrainingRound::crd(),
        PropletUpgrade::crd(),
    ]
}

/// The CRDs as one multi-document YAML stream, exactly as written to `configs/crd/`.
pub fn crds_yaml() -> Result<String, serde_yaml_ng::Error> {
    let mut out = String::new();
    for crd in all_crds() {
        out.push_str(&crd_yaml(&crd)?);
    }
    Ok(out)
}

/// File name of a CRD inside `configs/crd/`.
pub fn crd_file_name(crd: &CustomResourceDefinition) -> String {
    format!("{}.yaml", crd.spec.names.plural)
}

/// One CRD as a YAML document.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml_ng::Error> {
    Ok(format!("---\n{}", serde_yaml_ng::to_string(crd)?))
}
