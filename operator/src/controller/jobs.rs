//! The PropellerJob, FederatedJob and TrainingRound controllers: create the children the
//! core asks for, persist aggregated models, and write status when it changed.

use std::time::Instant;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::ConfigMap;
use serde::Serialize;
use serde_json::Value;

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::decision::conditions::set_condition;
use crate::decision::federated::{
    fail_unstorable, model_config_map, model_config_map_name, model_of, observe_round,
    owned_rounds, reconcile_job, reconcile_round, FederatedObservation,
};
use crate::decision::kueue::queue_name;
use crate::decision::propeller_job::{self, restrict, status_to_write, JobObservation};

use super::{count, kueue, Cluster, Next, ObjectName, ReconcileError, Stored, Wake};

/// Writes `new` as `object`'s status when it differs from `old`, what is written.
async fn write_if_changed<C: Cluster, K: Stored, S: Serialize + PartialEq>(
    cluster: &C,
    object: &K,
    old: &S,
    new: &S,
) -> Result<(), ReconcileError> {
    if old == new {
        return Ok(());
    }
    let json = |s: &S| serde_json::to_value(s).unwrap_or(Value::Null);
    cluster
        .write_status::<K>(object.meta(), &json(old), &json(new))
        .await?;
    Ok(())
}

/// Reconciles one PropellerJob: its children, then its status from theirs.
#[tracing::instrument(
    name = "reconcile",
    skip_all,
    fields(object.kind = "PropellerJob", object.ref = %ObjectName::of(job))
)]
pub async fn reconcile_propeller_job<C: Cluster>(
    cluster: &C,
    job: &PropellerJob,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let started = Instant::now();
    let result = async {
        let ns = ObjectName::of(job).namespace;
        // The Task cache already holds the change that woke this reconcile: a child's
        // change wakes its owners only once its driver's cache shows it.
        let tasks = cluster.tasks_in(&ns);
        let mut observed = JobObservation::of(job, tasks.iter().map(|t| &**t));
        let admission = match queue_name(job) {
            Some(_) => Some(kueue::admit(cluster, job, &observed, now).await?),
            None => None,
        };
        if let Some(admission) = &admission {
            observed.gate = admission.gate.clone();
        }
        let mut plan = propeller_job::reconcile(job, &observed, now);
        if let Some(admission) = &admission {
            set_condition(
                &mut plan.status.conditions,
                &admission.quota,
                job.metadata.generation,
                now,
            );
        }
        for child in &plan.create {
            cluster.create_once(child).await?;
        }
        let node_labels = observed.gate.node_labels();
        let holds = plan.suspend.iter().map(|n| (n, true));
        for (name, suspend) in holds.chain(plan.resume.iter().map(|n| (n, false))) {
            let Some(task) = tasks
                .iter()
                .find(|t| t.metadata.name.as_ref() == Some(name))
            else {
                continue;
            };
            let mut changed = (**task).clone();
            changed.spec.suspend = suspend;
            if !suspend {
                restrict(&mut changed.spec, &node_labels);
            }
            cluster.replace(&changed).await?;
        }
        for note in &plan.notes {
            cluster.note(job, note).await;
        }
        let old = job.status.clone().unwrap_or_default();
        let new = status_to_write(&old, &plan);
        write_if_changed(cluster, job, &old, &new).await?;
        Ok(None)
    }
    .await;
    count(cluster.common(), "propellerjob", started, &result);
    result
}

/// Reconciles one FederatedJob: its rounds, with the models they stored.
#[tracing::instrument(
    name = "reconcile",
    skip_all,
    fields(object.kind = "FederatedJob", object.ref = %ObjectName::of(job))
)]
pub async fn reconcile_federated_job<C: Cluster>(
    cluster: &C,
    job: &FederatedJob,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let started = Instant::now();
    let result = async {
        let ns = ObjectName::of(job).namespace;
        let rounds = cluster.list::<TrainingRound>(&ns).await?;
        let mut observed = FederatedObservation {
            rounds: owned_rounds(job, &rounds),
            ..FederatedObservation::default()
        };
        for (n, (_, reference)) in &observed.rounds {
            let Some(name) = reference.as_deref().and_then(|r| r.rsplit('/').next()) else {
                continue;
            };
            let stored = cluster
                .get::<ConfigMap>(&ObjectName::new(&ns, name))
                .await?;
            if let Some(model) = stored.as_ref().and_then(model_of) {
                observed.models.insert(*n, model);
            }
        }
        let plan = reconcile_job(job, &observed, now);
        if let Some(round) = &plan.create_round {
            cluster.create_once(round).await?;
        }
        let old = job.status.clone().unwrap_or_default();
        write_if_changed(cluster, job, &old, &plan.status).await?;
        Ok(None)
    }
    .await;
    count(cluster.common(), "federatedjob", started, &result);
    result
}

/// Reconciles one TrainingRound: its participants' tasks, the aggregated model, its status.
#[tracing::instrument(
    name = "reconcile",
    skip_all,
    fields(object.kind = "TrainingRound", object.ref = %ObjectName::of(round))
)]
pub async fn reconcile_training_round<C: Cluster>(
    cluster: &C,
    round: &TrainingRound,
    now: DateTime<Utc>,
) -> Result<Next, ReconcileError> {
    let started = Instant::now();
    let result = async {
        let name = ObjectName::of(round);
        let tasks = cluster.tasks_in(&name.namespace);
        let proplets = cluster.proplets();
        let task_refs: Vec<_> = tasks.iter().map(|t| &**t).collect();
        let proplet_refs: Vec<_> = proplets.iter().map(|p| &**p).collect();
        let parent = cluster
            .get::<FederatedJob>(&ObjectName::new(
                &name.namespace,
                &round.spec.federated_job_ref.name,
            ))
            .await?;
        let model_name = model_config_map_name(round);
        let stored = cluster
            .get::<ConfigMap>(&ObjectName::new(&name.namespace, &model_name))
            .await?
            .map(|_| model_name.clone());
        let observed = observe_round(round, &task_refs, &proplet_refs, parent.as_ref(), stored);
        let plan = reconcile_round(round, &observed, now);
        for task in &plan.create {
            cluster.create_once(task).await?;
        }
        let mut status = plan.status.clone();
        if let Some(model) = &plan.persist_model {
            match model_config_map(round, model) {
                Err(message) => {
                    fail_unstorable(&mut status, message, round.metadata.generation, now)
                }
                Ok(config_map) => {
                    cluster.create_once(&config_map).await?;
                    // The next reconcile sees the stored model and completes the round.
                    cluster.wake(Wake::of::<TrainingRound>(name.clone()));
                }
            }
        }
        let old = round.status.clone().unwrap_or_default();
        write_if_changed(cluster, round, &old, &status).await?;
        Ok(plan.requeue_at)
    }
    .await;
    count(cluster.common(), "traininground", started, &result);
    result
}
