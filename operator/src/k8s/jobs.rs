//! Executors of the PropellerJob, FederatedJob and TrainingRound plans: create the children
//! the core asks for, persist aggregated models, and write status.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::crd::federated::{FederatedJob, TrainingRound};
use crate::crd::job::PropellerJob;
use crate::crd::task::Task;
use crate::decision::aggregation::UpdateEnvelope;
use crate::decision::federated::{
    fail_unstorable, model_config_map, model_config_map_name, model_of, observe_round,
    owned_rounds, reconcile_job, reconcile_round, FederatedObservation,
};
use crate::decision::propeller_job::{reconcile, status_to_write, JobObservation};

use super::patch::status_patch;
use super::runtime::{ReconcileError, Shared, RESYNC};

pub use crate::decision::federated::MODEL_KEY;

/// Creates `obj` unless it exists already (a retried reconcile).
async fn create_once<K>(api: &Api<K>, obj: &K) -> Result<(), kube::Error>
where
    K: Resource + Clone + Serialize + DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Writes `new` as the status of `obj` when it differs from what is written.
async fn write_status<K, S>(api: &Api<K>, obj: &K, old: &S, new: &S) -> Result<(), kube::Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
    S: Serialize + PartialEq,
{
    if old == new {
        return Ok(());
    }
    api.patch_status(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(status_patch(
            old,
            new,
            obj.meta().resource_version.as_deref(),
        )),
    )
    .await?;
    Ok(())
}

fn timed(
    ctx: &Shared,
    controller: &str,
    started: Instant,
    result: &Result<Action, ReconcileError>,
) {
    ctx.metrics
        .observe(controller, started.elapsed(), result.is_ok());
}

/// Reconciles one PropellerJob.
pub async fn reconcile_propeller_job(
    job: Arc<PropellerJob>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let result = propeller_job_once(&job, &ctx).await;
    timed(&ctx, "propellerjob", started, &result);
    result
}

async fn propeller_job_once(job: &PropellerJob, ctx: &Shared) -> Result<Action, ReconcileError> {
    let ns = job.namespace().unwrap_or_else(|| "default".into());
    // Referenced Tasks come from the Task controller's cache (they carry no job label); the
    // children from the labelled watch that woke this reconcile, listed last as the fresher.
    let all_tasks = ctx.tasks.state();
    let children = ctx.job_tasks.state();
    let observed = JobObservation::of(
        job,
        all_tasks
            .iter()
            .chain(children.iter())
            .filter(|t| t.namespace().as_deref() == Some(ns.as_str()))
            .map(|t| &**t),
    );
    let plan = reconcile(job, &observed, Utc::now());
    let task_api: Api<Task> = Api::namespaced(ctx.client.clone(), &ns);
    for child in &plan.create {
        create_once(&task_api, child).await?;
    }
    let api: Api<PropellerJob> = Api::namespaced(ctx.client.clone(), &ns);
    let old = job.status.clone().unwrap_or_default();
    let new = status_to_write(&old, &plan);
    write_status(&api, job, &old, &new).await?;
    Ok(Action::requeue(RESYNC))
}

/// Reconciles one FederatedJob.
pub async fn reconcile_federated_job(
    job: Arc<FederatedJob>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let result = federated_job_once(&job, &ctx).await;
    timed(&ctx, "federatedjob", started, &result);
    result
}

/// The model a round stored, read back from its ConfigMap.
async fn load_model(ctx: &Shared, ns: &str, reference: &str) -> Option<UpdateEnvelope> {
    let name = reference.rsplit('/').next()?;
    let api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), ns);
    model_of(&api.get_opt(name).await.ok()??)
}

async fn federated_job_once(job: &FederatedJob, ctx: &Shared) -> Result<Action, ReconcileError> {
    let ns = job.namespace().unwrap_or_else(|| "default".into());
    let round_api: Api<TrainingRound> = Api::namespaced(ctx.client.clone(), &ns);
    let rounds = round_api.list(&Default::default()).await?;
    let mut observed = FederatedObservation {
        rounds: owned_rounds(job, &rounds.items),
        ..FederatedObservation::default()
    };
    for (n, (_, reference)) in &observed.rounds {
        if let Some(reference) = reference {
            if let Some(model) = load_model(ctx, &ns, reference).await {
                observed.models.insert(*n, model);
            }
        }
    }
    let plan = reconcile_job(job, &observed, Utc::now());
    if let Some(round) = &plan.create_round {
        create_once(&round_api, round).await?;
    }
    let api: Api<FederatedJob> = Api::namespaced(ctx.client.clone(), &ns);
    let old = job.status.clone().unwrap_or_default();
    write_status(&api, job, &old, &plan.status).await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// Reconciles one TrainingRound.
pub async fn reconcile_training_round(
    round: Arc<TrainingRound>,
    ctx: Arc<Shared>,
) -> Result<Action, ReconcileError> {
    let started = Instant::now();
    let result = training_round_once(&round, &ctx).await;
    timed(&ctx, "traininground", started, &result);
    result
}

async fn training_round_once(
    round: &TrainingRound,
    ctx: &Shared,
) -> Result<Action, ReconcileError> {
    let ns = round.namespace().unwrap_or_else(|| "default".into());
    let tasks = ctx.round_tasks.state();
    let proplets = ctx.proplets.state();
    let task_refs: Vec<&Task> = tasks.iter().map(|t| &**t).collect();
    let proplet_refs: Vec<&crate::crd::proplet::Proplet> = proplets.iter().map(|p| &**p).collect();
    let job_api: Api<FederatedJob> = Api::namespaced(ctx.client.clone(), &ns);
    let parent = job_api.get_opt(&round.spec.federated_job_ref.name).await?;
    let model_name = model_config_map_name(round);
    let cm_api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let stored = cm_api
        .get_opt(&model_name)
        .await?
        .map(|_| model_name.clone());
    let observed = observe_round(round, &task_refs, &proplet_refs, parent.as_ref(), stored);
    let now = Utc::now();
    let plan = reconcile_round(round, &observed, now);
    let task_api: Api<Task> = Api::namespaced(ctx.client.clone(), &ns);
    for task in &plan.create {
        create_once(&task_api, task).await?;
    }
    let mut status = plan.status.clone();
    if let Some(model) = &plan.persist_model {
        match model_config_map(round, model) {
            Err(message) => fail_unstorable(&mut status, message, round.metadata.generation, now),
            Ok(cm) => {
                create_once(&cm_api, &cm).await?;
                // The next reconcile sees the stored model and completes the round.
                let _ = ctx
                    .round_trigger
                    .send(kube::runtime::reflector::ObjectRef::from_obj(round));
            }
        }
    }
    let api: Api<TrainingRound> = Api::namespaced(ctx.client.clone(), &ns);
    let old = round.status.clone().unwrap_or_default();
    write_status(&api, round, &old, &status).await?;
    let wait = plan
        .requeue_at
        .and_then(|at| (at - now).to_std().ok())
        .map_or(RESYNC, |d| d.min(RESYNC) + Duration::from_millis(100));
    Ok(Action::requeue(wait))
}
