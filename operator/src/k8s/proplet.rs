//! The Kubernetes executor of the Proplet plan (`propeller_core::decision::proplet`):
//! server-side apply of the Deployment, then the status patch.

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};
use serde_json::json;

use crate::crd::proplet::Proplet;
use crate::decision::proplet::PropletPlan;

/// Field manager of every server-side apply the operator makes.
pub const FIELD_MANAGER: &str = "propeller";

/// Applies a plan: server-side apply of the Deployment, then a merge patch of the status
/// subresource. Returns the Proplet as the status write left it, when there was one.
pub async fn apply(
    client: &kube::Client,
    proplet: &Proplet,
    plan: &PropletPlan,
) -> Result<Option<Proplet>, kube::Error> {
    let namespace = proplet.metadata.namespace.as_deref().unwrap_or("default");
    let name = proplet.metadata.name.as_deref().unwrap_or_default();
    if let Some(deployment) = &plan.deployment {
        let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
        let deployment_name = deployment.metadata.name.as_deref().unwrap_or_default();
        deployments
            .patch(
                deployment_name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(deployment),
            )
            .await?;
    }
    if let Some(status) = &plan.status {
        // Not the slots: tasks take and give them back with conditional writes of their
        // own, which this unconditional merge must not undo (left out, they stay as stored).
        let mut status = status.clone();
        status.slots.clear();
        let proplets: Api<Proplet> = Api::namespaced(client.clone(), namespace);
        let written = proplets
            .patch_status(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "status": status })),
            )
            .await?;
        return Ok(Some(written));
    }
    Ok(None)
}
