//! The Kubernetes backend of the shared Task executor: conditional merge patches of
//! finalizers and status through kube-rs, and Jobs for `k8s` proplets.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use serde_json::Value;

use crate::crd::task::Task;
use crate::executor::{
    apply_task, BackendError, Dispatch, ObjectWriter, TaskApplyError, TaskEffects,
};

use super::patch::{finalizers_patch, status_patch};

/// Writes Tasks through the API server.
pub struct KubeTasks {
    client: kube::Client,
}

impl KubeTasks {
    /// A writer using `client`.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }

    fn api(&self, meta: &ObjectMeta) -> Api<Task> {
        Api::namespaced(
            self.client.clone(),
            meta.namespace.as_deref().unwrap_or("default"),
        )
    }
}

impl ObjectWriter for KubeTasks {
    async fn set_finalizers(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let updated = self
            .api(meta)
            .patch(
                meta.name.as_deref().unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Merge(finalizers_patch(finalizers, version)),
            )
            .await?;
        Ok(updated.metadata.resource_version)
    }

    async fn write_status(
        &self,
        meta: &ObjectMeta,
        old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let updated = self
            .api(meta)
            .patch_status(
                meta.name.as_deref().unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Merge(status_patch(old, new, version)),
            )
            .await?;
        Ok(updated.metadata.resource_version)
    }

    async fn create_task_job(&self, task: &Task) -> Result<(), BackendError> {
        Ok(super::task_job::create(&self.client, task).await?)
    }
}

/// Applies a Task plan through the API server.
pub async fn apply(
    client: &kube::Client,
    task: &Task,
    plan: &crate::decision::task::TaskPlan,
    fx: &TaskEffects<'_>,
) -> Result<Dispatch, TaskApplyError> {
    apply_task(&KubeTasks::new(client.clone()), task, plan, fx).await
}
