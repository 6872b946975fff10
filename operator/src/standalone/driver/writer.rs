//! The Task executor's writes into the store (one transaction for finalizers and status).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::controller::ObjectName;
use crate::executor::{BackendError, NoJobs, ObjectWriter};
use crate::standalone::kinds::TASK;
use crate::standalone::store::ObjectStore;

/// Writes Tasks into the embedded store.
pub(super) struct StoreTasks<'a> {
    pub(super) store: &'a ObjectStore,
}

impl ObjectWriter for StoreTasks<'_> {
    async fn set_finalizers(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = ObjectName::from_meta(meta);
        let updated = self
            .store
            .set_finalizers_async(
                TASK,
                &key.namespace,
                &key.name,
                finalizers.to_vec(),
                version,
            )
            .await?;
        Ok(version_of(&updated))
    }

    async fn write_status(
        &self,
        meta: &ObjectMeta,
        _old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = ObjectName::from_meta(meta);
        let updated = self
            .store
            .write_status_async(TASK, &key.namespace, &key.name, new.clone(), version)
            .await?;
        Ok(version_of(&updated))
    }

    async fn set_finalizers_and_status(
        &self,
        meta: &ObjectMeta,
        finalizers: &[String],
        _old: &Value,
        new: &Value,
        version: Option<&str>,
    ) -> Result<Option<String>, BackendError> {
        let key = ObjectName::from_meta(meta);
        let updated = self
            .store
            .set_finalizers_and_status_async(
                TASK,
                &key.namespace,
                &key.name,
                finalizers.to_vec(),
                new.clone(),
                version,
            )
            .await?;
        Ok(version_of(&updated))
    }

    type Jobs = NoJobs;

    fn jobs(&self) -> Option<&NoJobs> {
        None
    }
}

pub(super) fn version_of(obj: &Value) -> Option<String> {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .map(str::to_owned)
}
