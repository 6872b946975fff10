//! Standalone mode as the controllers' [`Cluster`]: objects in the embedded store (writes
//! wait for the group commit off the runtime's threads), reads from the [`ObjectCache`],
//! wakes into the work queue, notes into the event log.

use crate::controller::executor::NoJobs;
use crate::controller::BackendError;
use crate::controller::{
    Backend, CacheReads, Cluster, ClusterScoped, Common, ObjectName, Refusal, Signals, Stored, Wake,
};
use crate::crd::task::Task;
use crate::crd::task::TaskPhase;
use crate::decision::dag::Graph;
use crate::decision::liveness::DeploymentObservation;
use crate::decision::proplet::PropletPlan;
use crate::decision::scheduler::SelectorView;
use crate::decision::task::Note;
use crate::proplet_index::Narrowed;

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::crd::proplet::Proplet;
use crate::standalone::kinds::PROPLET;
use crate::standalone::store::StoreError;

use super::Driver;

impl Cluster for Driver {
    type Jobs = NoJobs;

    /// The sweep covers proplets; every other change reaches the cache and wakes its object.
    const RESYNC: Option<Duration> = None;

    /// The cache already shows every durable write: read it again at once.
    const CONFLICT_REREAD: Duration = Duration::ZERO;

    /// They mostly wait for the store's group commit, so several share each `fsync`.
    const RECONCILE_CONCURRENCY: u16 = 64;

    fn common(&self) -> &Common {
        &self.common
    }

    async fn apply_proplet(
        &self,
        proplet: &Proplet,
        plan: &PropletPlan,
    ) -> Result<(), BackendError> {
        let Some(status) = &plan.status else {
            return Ok(());
        };
        let name = ObjectName::of(proplet);
        // Batched: thousands of heartbeating proplets each write every flush interval.
        let updated = self
            .store
            .write_status_batched(
                PROPLET,
                &name.namespace,
                &name.name,
                serde_json::to_value(status)?,
                proplet.metadata.resource_version.as_deref(),
            )
            .await?;
        self.proplet_writes
            .record_write(&proplet.metadata, version_of(&updated), ());
        Ok(())
    }

    fn jobs(&self) -> Option<&NoJobs> {
        None
    }
}

impl Backend for Driver {
    fn refusal(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Refusal> {
        store_refusal(error)
    }

    async fn get<K: Stored>(&self, name: &ObjectName) -> Result<Option<K>, BackendError> {
        Ok(self
            .store
            .get_typed(&K::kind(&()), &name.namespace, &name.name)?)
    }

    /// The store holds no cluster-scoped kinds (standalone has no Kueue).
    async fn get_cluster_scoped<K: ClusterScoped>(
        &self,
        _name: &str,
    ) -> Result<Option<K>, BackendError> {
        Ok(None)
    }

    async fn list<K: Stored>(&self, namespace: &str) -> Result<Vec<K>, BackendError> {
        Ok(self.store.list_typed(&K::kind(&()), Some(namespace))?)
    }

    async fn create_once<K: Stored>(&self, object: &K) -> Result<(), BackendError> {
        let mut value = serde_json::to_value(object)?;
        value["apiVersion"] = Value::String(K::api_version(&()).into_owned());
        value["kind"] = Value::String(K::kind(&()).into_owned());
        match self.store.create_child_async(value).await {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn replace<K: Stored>(&self, object: &K) -> Result<(), BackendError> {
        let mut value = serde_json::to_value(object)?;
        value["apiVersion"] = Value::String(K::api_version(&()).into_owned());
        value["kind"] = Value::String(K::kind(&()).into_owned());
        self.store
            .apply_all_async(vec![value])
            .await
            .map_err(|e| -> BackendError { e.error })?;
        Ok(())
    }

    async fn write_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        _old: &Value,
        new: &Value,
    ) -> Result<Option<String>, BackendError> {
        let name = ObjectName::from_meta(meta);
        let written = self
            .store
            .write_status_async(
                &K::kind(&()),
                &name.namespace,
                &name.name,
                new.clone(),
                meta.resource_version.as_deref(),
            )
            .await?;
        Ok(version_of(&written))
    }

    async fn set_finalizers<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
    ) -> Result<Option<String>, BackendError> {
        let name = ObjectName::from_meta(meta);
        let written = self
            .store
            .set_finalizers_async(
                &K::kind(&()),
                &name.namespace,
                &name.name,
                finalizers.to_vec(),
                meta.resource_version.as_deref(),
            )
            .await?;
        Ok(version_of(&written))
    }

    async fn delete<K: Stored>(&self, meta: &ObjectMeta) -> Result<(), BackendError> {
        let name = ObjectName::from_meta(meta);
        match self
            .store
            .delete_at_version_async(
                &K::kind(&()),
                &name.namespace,
                &name.name,
                meta.resource_version.as_deref(),
            )
            .await
        {
            Ok(_) | Err(StoreError::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// One store transaction.
    async fn set_finalizers_and_status<K: Stored>(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        _old: &Value,
        new: &Value,
    ) -> Result<Option<String>, BackendError> {
        let name = ObjectName::from_meta(meta);
        let written = self
            .store
            .set_finalizers_and_status_async(
                &K::kind(&()),
                &name.namespace,
                &name.name,
                finalizers.to_vec(),
                new.clone(),
                meta.resource_version.as_deref(),
            )
            .await?;
        Ok(version_of(&written))
    }
}

/// The resourceVersion of a stored object.
fn version_of(object: &Value) -> Option<String> {
    object["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned)
}

impl CacheReads for Driver {
    fn deployment_of(&self, _: &Proplet) -> Option<DeploymentObservation> {
        None
    }

    fn load_of(&self, proplet: &Proplet) -> u32 {
        let name = ObjectName::of(proplet);
        self.cache.load(&name.namespace, &name.name)
    }

    fn tasks_on(&self, proplet: &Proplet) -> Vec<String> {
        let name = ObjectName::of(proplet);
        self.cache.occupants(&name.namespace, &name.name)
    }

    fn fleet_size(&self) -> usize {
        self.cache.proplet_count()
    }

    fn proplet_by_client(&self, client_id: &str) -> Option<Arc<Proplet>> {
        self.cache.proplet_by_client(client_id)
    }

    fn task_by_uid(&self, uid: &str) -> Option<Arc<Task>> {
        self.cache.task_by_uid(uid)
    }

    fn tasks_in(&self, namespace: &str) -> Vec<Arc<Task>> {
        self.cache.tasks_in(namespace)
    }

    fn proplets(&self) -> Vec<Arc<Proplet>> {
        self.cache.proplets()
    }

    fn dependents(&self, name: &ObjectName) -> Vec<String> {
        self.cache.dependents(&name.namespace, &name.name)
    }

    fn proplets_in(&self, namespace: &str) -> Vec<Arc<Proplet>> {
        self.cache.proplets_in(namespace)
    }

    fn narrow_proplets(&self, namespace: &str, selector: &SelectorView) -> Narrowed {
        self.cache.narrow_proplets(namespace, selector)
    }

    fn proplet(&self, name: &ObjectName) -> Option<Arc<Proplet>> {
        self.cache.proplet(&name.namespace, &name.name)
    }

    fn task_phase(&self, name: &ObjectName) -> Option<TaskPhase> {
        self.cache.task_phase(&name.namespace, &name.name)
    }

    fn dependency_graph(&self, namespace: &str) -> Graph {
        self.cache.dependency_graph(namespace)
    }
}

impl Signals for Driver {
    fn wake(&self, wake: Wake) {
        Driver::wake(self, wake);
    }

    async fn note<K: Stored>(&self, object: &K, note: &Note) {
        self.record_note(object, note);
    }

    /// The event log is in memory: recording never holds the caller up.
    fn note_later<K: Stored>(&self, object: &K, note: Note) {
        self.record_note(object, &note);
    }
}

impl Driver {
    fn record_note<K: Stored>(&self, object: &K, note: &Note) {
        let name = ObjectName::of(object);
        self.events
            .record(&K::kind(&()), &name.namespace, &name.name, note, Utc::now());
    }
}

/// The store's refusals: a conflict and a missing object.
fn store_refusal(error: &(dyn std::error::Error + Send + Sync + 'static)) -> Option<Refusal> {
    match error.downcast_ref::<StoreError>() {
        Some(StoreError::Conflict { .. }) => Some(Refusal::Conflict),
        Some(StoreError::NotFound { .. }) => Some(Refusal::Gone),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::executor::TaskApplyError;
    use crate::controller::ReconcileError;

    #[test]
    fn the_stores_conflicts_are_refusals_however_they_arrive() {
        let conflict = || -> BackendError {
            Box::new(StoreError::Conflict {
                kind: "Task".into(),
                namespace: "default".into(),
                name: "t".into(),
                expected: "3".into(),
                actual: "4".into(),
            })
        };
        let cases = [
            (ReconcileError::Backend(conflict()), Some(Refusal::Conflict)),
            (
                ReconcileError::Task(TaskApplyError::Backend(conflict())),
                Some(Refusal::Conflict),
            ),
            (
                ReconcileError::Task(TaskApplyError::NoJobs("t".into())),
                None,
            ),
        ];
        for (error, expected) in cases {
            assert_eq!(
                error.backend().and_then(store_refusal),
                expected,
                "{error:?}"
            );
        }
    }
}
