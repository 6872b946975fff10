//! The Kubernetes backend of the shared Task executor: conditional merge patches of
//! finalizers and status through kube-rs, and Jobs for `k8s` proplets.

use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams};
use serde_json::Value;

use crate::crd::task::Task;
use crate::executor::{
    apply_task, BackendError, Dispatch, ObjectWriter, TaskApplyError, TaskEffects,
};

use super::task_job::KubeJobs;

use super::patch::{finalizers_patch, status_patch};

/// Writes Tasks through the API server.
pub struct KubeTasks {
    client: kube::Client,
    jobs: KubeJobs,
    written: Mutex<Option<TaskWrites>>,
}

/// What one apply wrote to a Task: the object the last write returned, and every version
/// those writes replaced. A cache still showing one of those versions has not seen the
/// writes yet; planning from it again wrote with a stale version and got a conflict (821
/// conflicts in a burst of 1,000 tasks, each a wasted API call).
#[derive(Debug, Clone)]
pub struct TaskWrites {
    /// Versions the writes replaced.
    pub superseded: Vec<String>,
    /// The Task as the last write left it.
    pub latest: Task,
}

impl KubeTasks {
    /// A writer using `client`, running Jobs with `jobs`.
    pub fn new(client: kube::Client, jobs: KubeJobs) -> Self {
        Self {
            client,
            jobs,
            written: Mutex::new(None),
        }
    }

    fn record(&self, based_on: Option<&str>, updated: Task) -> Option<String> {
        let version = updated.metadata.resource_version.clone();
        let mut written = self.written.lock().unwrap_or_else(|e| e.into_inner());
        let mut superseded = written.take().map(|w| w.superseded).unwrap_or_default();
        superseded.extend(based_on.map(str::to_owned));
        *written = Some(TaskWrites {
            superseded,
            latest: updated,
        });
        version
    }

    /// What the applies through this writer wrote, if anything.
    pub fn into_writes(self) -> Option<TaskWrites> {
        self.written.into_inner().unwrap_or_else(|e| e.into_inner())
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
        Ok(self.record(version, updated))
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
        Ok(self.record(version, updated))
    }

    type Jobs = KubeJobs;

    fn jobs(&self) -> Option<&KubeJobs> {
        Some(&self.jobs)
    }
}

/// Applies a Task plan through the API server; also returns what it wrote.
pub async fn apply(
    client: &kube::Client,
    jobs: &KubeJobs,
    task: &Task,
    plan: &crate::decision::task::TaskPlan,
    fx: &TaskEffects<'_>,
) -> Result<(Dispatch, Option<TaskWrites>), TaskApplyError> {
    let writer = KubeTasks::new(client.clone(), jobs.clone());
    let dispatch = apply_task(&writer, task, plan, fx).await?;
    Ok((dispatch, writer.into_writes()))
}
