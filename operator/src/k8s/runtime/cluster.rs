//! Kubernetes mode as the controllers' [`Cluster`]: objects through kube-rs, reads from the
//! watches' caches, wakes through the controllers' trigger channels, notes as Events.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use serde_json::Value;

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt as _};

use crate::controller::{
    Backend, BackendError, CacheReads, Cluster, ClusterScoped, Common, ObjectName, Refusal,
    Signals, Stored, Wake,
};
use crate::crd::proplet::Proplet;
use crate::crd::task::Task;
use crate::crd::task::TaskPhase;
use crate::decision::dag::Graph;
use crate::decision::liveness::DeploymentObservation;
use crate::decision::scheduler::SelectorView;
use crate::decision::task::Note;
use crate::k8s::patch::{finalizers_patch, status_patch};
use crate::k8s::proplet::apply as apply_proplet;
use crate::k8s::runtime::shared::Shared;
use crate::k8s::task_job::KubeJobs;
use crate::proplet_index::Narrowed;

use super::{observe_deployment, RESYNC};

fn object_ref<K: Stored>(name: &ObjectName) -> ObjectRef<K> {
    ObjectRef::new(&name.name).within(&name.namespace)
}

fn api<K: Stored>(client: &Client, meta: &ObjectMeta) -> Api<K> {
    Api::namespaced(
        client.clone(),
        meta.namespace.as_deref().unwrap_or("default"),
    )
}

impl Shared {
    fn in_namespace<'a>(
        tasks: &'a [Arc<Task>],
        namespace: &'a str,
    ) -> impl Iterator<Item = &'a Arc<Task>> + 'a {
        tasks
            .iter()
            .filter(move |t| t.metadata.namespace.as_deref().unwrap_or("default") == namespace)
    }
}

impl Cluster for Shared {
    type Jobs = KubeJobs;

    const RESYNC: Option<Duration> = Some(RESYNC);

    /// The watch shows the newer version within a few milliseconds.
    const CONFLICT_REREAD: Duration = Duration::from_millis(200);

    /// kube's client speaks HTTP/1.1, so every concurrent API call is a TLS connection of
    /// its own: unbounded, a resync of 10,000 Proplets opened thousands (handshakes on both
    /// sides, descriptors exhausted).
    const RECONCILE_CONCURRENCY: u16 = 32;

    fn common(&self) -> &Common {
        &self.common
    }

    async fn apply_proplet(
        &self,
        proplet: &Proplet,
        plan: &crate::decision::proplet::PropletPlan,
    ) -> Result<(), BackendError> {
        let written = apply_proplet(&self.client, proplet, plan).await?;
        if let Some(written) = written {
            let version = written.metadata.resource_version.clone();
            self.proplet_writes
                .record_write(&proplet.metadata, version, written);
        }
        Ok(())
    }

    fn jobs(&self) -> Option<&KubeJobs> {
        Some(&self.jobs)
    }
}

impl Backend for Shared {
    fn refusal(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Refusal> {
        api_refusal(error)
    }

    async fn get<K: Stored>(&self, name: &ObjectName) -> Result<Option<K>, BackendError> {
        let api: Api<K> = Api::namespaced(self.client.clone(), &name.namespace);
        Ok(api.get_opt(&name.name).await?)
    }

    async fn get_cluster_scoped<K: ClusterScoped>(
        &self,
        name: &str,
    ) -> Result<Option<K>, BackendError> {
        let api: Api<K> = Api::all(self.client.clone());
        Ok(api.get_opt(name).await?)
    }

    async fn list<K: Stored>(&self, namespace: &str) -> Result<Vec<K>, BackendError> {
        let api: Api<K> = Api::namespaced(self.client.clone(), namespace);
        Ok(api.list(&Default::default()).await?.items)
    }

    async fn create_once<K: Stored>(&self, object: &K) -> Result<(), BackendError> {
        match api::<K>(&self.client, object.meta())
            .create(&PostParams::default(), object)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn replace<K: Stored>(&self, object: &K) -> Result<(), BackendError> {
        let meta = object.meta();
        api::<K>(&self.client, meta)
            .replace(
                meta.name.as_deref().unwrap_or_default(),
                &PostParams::default(),
                object,
            )
            .await?;
        Ok(())
    }

    async fn write_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        old: &Value,
        new: &Value,
    ) -> Result<Option<String>, BackendError> {
        let written: K = api::<K>(&self.client, meta)
            .patch_status(
                meta.name.as_deref().unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Merge(status_patch(old, new, meta.resource_version.as_deref())),
            )
            .await?;
        Ok(self.remember_write(meta, written))
    }

    async fn set_finalizers<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
    ) -> Result<Option<String>, BackendError> {
        let written: K = api::<K>(&self.client, meta)
            .patch(
                meta.name.as_deref().unwrap_or_default(),
                &PatchParams::default(),
                &Patch::Merge(finalizers_patch(
                    finalizers,
                    meta.resource_version.as_deref(),
                )),
            )
            .await?;
        Ok(self.remember_write(meta, written))
    }

    async fn delete<K: Stored>(&self, meta: &ObjectMeta) -> Result<(), BackendError> {
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                resource_version: meta.resource_version.clone(),
                uid: meta.uid.clone(),
            }),
            ..DeleteParams::default()
        };
        match api::<K>(&self.client, meta)
            .delete(meta.name.as_deref().unwrap_or_default(), &params)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

impl Shared {
    /// Remembers a write to a Task until the watch shows it (see [`CacheReads::newest_task`]);
    /// the version it produced.
    fn remember_write<K: Stored>(&self, read: &ObjectMeta, written: K) -> Option<String> {
        let version = written.meta().resource_version.clone();
        if let Some(task) = (&written as &dyn Any).downcast_ref::<Task>() {
            self.task_writes
                .record_write(read, version.clone(), task.clone());
        }
        version
    }
}

impl CacheReads for Shared {
    fn newest_proplet(&self, proplet: Proplet) -> Proplet {
        let cached = proplet.metadata.resource_version.as_deref();
        self.proplet_writes
            .newest(&ObjectName::of(&proplet), cached)
            .unwrap_or(proplet)
    }

    fn newest_task(&self, task: Arc<Task>) -> Arc<Task> {
        let cached = task.metadata.resource_version.as_deref();
        match self.task_writes.newest(&ObjectName::of(&*task), cached) {
            Some(written) => Arc::new(written),
            None => task,
        }
    }

    fn deployment_of(&self, proplet: &Proplet) -> Option<DeploymentObservation> {
        let name = crate::decision::names::proplet_deployment_name(&proplet.name_any());
        let reference =
            ObjectRef::<Deployment>::new(&name).within(&ObjectName::of(proplet).namespace);
        self.deployments
            .get(&reference)
            .map(|d| observe_deployment(&d))
    }

    fn load_of(&self, proplet: &Proplet) -> u32 {
        let name = ObjectName::of(proplet);
        self.task_index.read().load(&name.namespace, &name.name)
    }

    fn tasks_on(&self, proplet: &Proplet) -> Vec<String> {
        let name = ObjectName::of(proplet);
        self.task_index
            .read()
            .occupants(&name.namespace, &name.name)
    }

    fn fleet_size(&self) -> usize {
        self.clients.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>> {
        Shared::proplet_by_client(self, client_id)
    }

    fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>> {
        Shared::task_by_uid(self, uid)
    }

    fn tasks_in(&self, namespace: &str) -> Vec<Arc<Task>> {
        let tasks = self.tasks.state();
        Self::in_namespace(&tasks, namespace).cloned().collect()
    }

    fn proplets(&self) -> Vec<Arc<Proplet>> {
        self.proplets.state()
    }

    fn dependents(&self, name: &ObjectName) -> Vec<String> {
        self.task_index
            .read()
            .dependents(&name.namespace, &name.name)
    }

    fn proplets_in(&self, namespace: &str) -> Vec<Arc<Proplet>> {
        let proplets = self.proplets.state();
        proplets
            .into_iter()
            .filter(|p| p.metadata.namespace.as_deref().unwrap_or("default") == namespace)
            .collect()
    }

    fn narrow_proplets(&self, namespace: &str, selector: &SelectorView) -> Narrowed {
        self.proplet_index.read().narrow(namespace, selector)
    }

    fn proplet(&self, name: &ObjectName) -> Option<Arc<Proplet>> {
        self.proplets.get(&object_ref(name))
    }

    fn task_phase(&self, name: &ObjectName) -> Option<TaskPhase> {
        self.tasks
            .get(&object_ref(name))
            .map(|t| t.status.as_ref().map(|s| s.phase).unwrap_or_default())
    }

    fn dependency_graph(&self, namespace: &str) -> Graph {
        let tasks = self.tasks.state();
        Self::in_namespace(&tasks, namespace)
            .map(|t| (t.name_any(), t.spec.depends_on.clone()))
            .collect()
    }
}

impl Signals for Shared {
    fn wake(&self, wake: Wake) {
        // A closed queue means the controllers are stopping: nothing to wake.
        self.wakers.send(wake);
    }

    async fn note<K: Stored>(&self, object: &K, note: &Note) {
        Shared::publish_note(&self.recorder, &object.object_ref(&()), note).await;
    }

    fn note_later<K: Stored>(&self, object: &K, note: Note) {
        let recorder = self.recorder.clone();
        let slots = self.background_events.clone();
        let reference = object.object_ref(&());
        tokio::spawn(async move {
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            Shared::publish_note(&recorder, &reference, &note).await;
        });
    }
}

/// The API server's refusals: 409 Conflict and 404 Not Found.
fn api_refusal(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Refusal> {
    match error.downcast_ref::<kube::Error>() {
        Some(kube::Error::Api(status)) if status.code == 409 => Some(Refusal::Conflict),
        Some(kube::Error::Api(status)) if status.code == 404 => Some(Refusal::Gone),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::executor::TaskApplyError;
    use crate::controller::ReconcileError;

    fn api_error(code: u16) -> BackendError {
        let status: kube::core::Status =
            serde_json::from_value(serde_json::json!({"code": code, "reason": "Conflict"}))
                .unwrap_or_else(|e| panic!("{e}"));
        Box::new(kube::Error::Api(Box::new(status)))
    }

    #[test]
    fn the_api_servers_conflicts_and_misses_are_refusals_however_they_arrive() {
        let cases = [
            (
                ReconcileError::Backend(api_error(409)),
                Some(Refusal::Conflict),
            ),
            (
                ReconcileError::Task(TaskApplyError::Backend(api_error(409))),
                Some(Refusal::Conflict),
            ),
            (ReconcileError::Backend(api_error(404)), Some(Refusal::Gone)),
            (ReconcileError::Backend(api_error(500)), None),
            (
                ReconcileError::Task(TaskApplyError::NoJobs("t".into())),
                None,
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(error.backend().and_then(api_refusal), expected, "{error:?}");
        }
    }
}
