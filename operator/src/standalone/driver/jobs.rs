//! The PropellerJob, FederatedJob and TrainingRound reconciles of standalone mode.

use super::*;

impl Driver {
    /// The reconcilers of the job kinds, which use the blocking store calls.
    pub(super) fn reconcile_job(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        match key.kind.as_str() {
            PROPELLER_JOB => self.reconcile_propeller_job(key, now),
            FEDERATED_JOB => self.reconcile_federated_job(key, now),
            TRAINING_ROUND => self.reconcile_training_round(key, now),
            _ => Ok(None),
        }
    }

    pub(super) fn reconcile_propeller_job(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(job) =
            self.store
                .get_typed::<PropellerJob>(PROPELLER_JOB, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let tasks = self.cache.tasks_in(&key.namespace);
        let observed = JobObservation::of(&job, tasks.iter().map(|t| &**t));
        let plan = reconcile_job(&job, &observed, now);
        for child in &plan.create {
            self.create_or_keep(serde_json::to_value(child).unwrap_or(Value::Null))?;
        }
        let old = job.status.clone().unwrap_or_default();
        let new = status_to_write(&old, &plan);
        self.write_status_if_changed(PROPELLER_JOB, &job.metadata, &old, &new)?;
        Ok(None)
    }

    pub(super) fn create_or_keep(&self, obj: Value) -> Result<(), DriverError> {
        match self.store.create_child(obj) {
            Ok(_) | Err(StoreError::AlreadyExists { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    pub(super) fn write_status_if_changed<S: serde::Serialize + PartialEq>(
        &self,
        kind: &str,
        meta: &ObjectMeta,
        old: &S,
        new: &S,
    ) -> Result<(), DriverError> {
        if old == new {
            return Ok(());
        }
        let key = Key::of(kind, meta);
        let value = serde_json::to_value(new).unwrap_or(Value::Null);
        self.store.write_status(
            kind,
            &key.namespace,
            &key.name,
            value,
            meta.resource_version.as_deref(),
        )?;
        Ok(())
    }

    pub(super) fn reconcile_federated_job(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(job) =
            self.store
                .get_typed::<FederatedJob>(FEDERATED_JOB, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let rounds: Vec<TrainingRound> = self
            .store
            .list_typed(TRAINING_ROUND, Some(&key.namespace))?;
        let mut observed = FederatedObservation {
            rounds: owned_rounds(&job, &rounds),
            ..FederatedObservation::default()
        };
        for (n, (_, reference)) in &observed.rounds {
            let Some(name) = reference.as_deref().and_then(|r| r.rsplit('/').next()) else {
                continue;
            };
            let stored = self
                .store
                .get_typed::<k8s_openapi::api::core::v1::ConfigMap>(
                    CONFIG_MAP,
                    &key.namespace,
                    name,
                )?;
            if let Some(model) = stored.as_ref().and_then(model_of) {
                observed.models.insert(*n, model);
            }
        }
        let plan = reconcile_federated(&job, &observed, now);
        if let Some(round) = &plan.create_round {
            self.create_or_keep(serde_json::to_value(round).unwrap_or(Value::Null))?;
        }
        let old = job.status.clone().unwrap_or_default();
        self.write_status_if_changed(FEDERATED_JOB, &job.metadata, &old, &plan.status)?;
        Ok(None)
    }

    pub(super) fn reconcile_training_round(
        &self,
        key: &Key,
        now: DateTime<Utc>,
    ) -> Result<Option<DateTime<Utc>>, DriverError> {
        let Some(round) =
            self.store
                .get_typed::<TrainingRound>(TRAINING_ROUND, &key.namespace, &key.name)?
        else {
            return Ok(None);
        };
        let tasks = self.cache.tasks();
        let proplets = self.cache.proplets();
        let parent = self.store.get_typed::<FederatedJob>(
            FEDERATED_JOB,
            &key.namespace,
            &round.spec.federated_job_ref.name,
        )?;
        let model_name = model_config_map_name(&round);
        let stored = self
            .store
            .get(CONFIG_MAP, &key.namespace, &model_name)?
            .map(|_| model_name.clone());
        let observed = observe_round(
            &round,
            &refs(&tasks),
            &refs(&proplets),
            parent.as_ref(),
            stored,
        );
        let plan = reconcile_round(&round, &observed, now);
        for task in &plan.create {
            self.create_or_keep(serde_json::to_value(task).unwrap_or(Value::Null))?;
        }
        let mut status = plan.status.clone();
        if let Some(model) = &plan.persist_model {
            match model_config_map(&round, model) {
                Err(message) => {
                    fail_unstorable(&mut status, message, round.metadata.generation, now)
                }
                Ok(cm) => {
                    let mut value = serde_json::to_value(&cm).unwrap_or(Value::Null);
                    value["apiVersion"] = Value::String("v1".into());
                    value["kind"] = Value::String(CONFIG_MAP.into());
                    self.create_or_keep(value)?;
                    self.enqueue(key.clone());
                }
            }
        }
        let old = round.status.clone().unwrap_or_default();
        self.write_status_if_changed(TRAINING_ROUND, &round.metadata, &old, &status)?;
        Ok(plan.requeue_at)
    }
}
