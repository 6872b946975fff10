//! The Task executor's writes into the store (one transaction for finalizers and status),
//! and the record of this driver's own writes, so their watch events wake nothing.

use std::collections::HashMap;
use std::sync::Mutex;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::Value;

use crate::executor::{BackendError, NoJobs, ObjectWriter};
use crate::standalone::kinds::TASK;
use crate::standalone::store::ObjectStore;
use crate::state::lock;

use crate::controller::{ObjectName, Wake};

/// Writes Tasks into the embedded store.
pub(super) struct StoreTasks<'a> {
    pub(super) store: &'a ObjectStore,
}

/// The latest version each Proplet's reconcile wrote itself. Its watch event is not a reason
/// to reconcile again: the Proplet plan already asked for its next look (the offline check,
/// a deferred flush), which halves the reconciles of heartbeating proplets. Task plans still
/// rely on seeing their own writes (the time limit is planned from the written start), so
/// Tasks are not recorded here.
#[derive(Default)]
pub(super) struct OwnWrites(Mutex<HashMap<Wake, u64>>);

impl OwnWrites {
    pub(super) fn record(&self, kind: &str, meta: &ObjectMeta, written: &Value) {
        if let Some(version) = version_of(written).and_then(|v| v.parse().ok()) {
            lock(&self.0).insert(Wake::named(kind, ObjectName::from_meta(meta)), version);
        }
    }

    /// Whether `version` is the last write the reconcile `wake` would run made itself
    /// (forgotten once asked).
    pub(super) fn is_own(&self, wake: &Wake, version: u64) -> bool {
        let mut own = lock(&self.0);
        if own.get(wake) == Some(&version) {
            own.remove(wake);
            return true;
        }
        false
    }
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
