//! The step that runs one queued key: read the object (the cache for Proplets and Tasks,
//! the store for the rest), run the shared controller (`crate::controller`), and queue its
//! next look or its retry.

use super::*;
use crate::controller::{self, retry_policy, Next, ObjectName, ReconcileError, Retry};
use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;

impl Driver {
    /// One reconcile of `key`.
    pub(super) async fn reconcile(self: &Arc<Self>, key: &Key) {
        let now = Utc::now();
        let name = ObjectName::new(&key.namespace, &key.name);
        let cluster: &Driver = self;
        // The cache holds every durable write; a write that is not durable yet makes the
        // reconcile's conditional write conflict, and it runs again at once.
        let result: Result<Next, ReconcileError> = match key.kind.as_str() {
            PROPLET => match self.cache.proplet(&key.namespace, &key.name) {
                Some(proplet) => {
                    controller::proplet::reconcile(cluster, (*proplet).clone(), now).await
                }
                None => Ok(None),
            },
            TASK => match self.cache.task(&key.namespace, &key.name) {
                Some(task) => controller::task::reconcile(cluster, &task, now).await,
                None => Ok(None),
            },
            PROPELLER_JOB => match self.read::<PropellerJob>(&name) {
                Ok(Some(job)) => {
                    controller::jobs::reconcile_propeller_job(cluster, &job, now).await
                }
                other => other.map(|_| None),
            },
            FEDERATED_JOB => match self.read::<FederatedJob>(&name) {
                Ok(Some(job)) => {
                    controller::jobs::reconcile_federated_job(cluster, &job, now).await
                }
                other => other.map(|_| None),
            },
            TRAINING_ROUND => match self.read::<TrainingRound>(&name) {
                Ok(Some(round)) => {
                    controller::jobs::reconcile_training_round(cluster, &round, now).await
                }
                other => other.map(|_| None),
            },
            _ => Ok(None),
        };
        match result {
            Ok(Some(at)) => self.enqueue_at(key.clone(), at, now),
            Ok(None) => {}
            Err(e) => match retry_policy(&key.kind, &name, &e) {
                // The cache already shows every durable write: read it again now.
                Retry::Reread => self.enqueue(key.clone()),
                Retry::Never => {}
                Retry::After(wait) => {
                    let at = now + chrono::Duration::from_std(wait).unwrap_or_default();
                    self.enqueue_at(key.clone(), at, now)
                }
            },
        }
    }

    fn read<K: controller::Stored>(&self, name: &ObjectName) -> Result<Option<K>, ReconcileError> {
        let kind = K::kind(&());
        self.store
            .get_typed::<K>(&kind, &name.namespace, &name.name)
            .map_err(|e| ReconcileError::Backend(Box::new(e)))
    }
}
