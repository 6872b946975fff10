//! Executors of the PropellerJob, FederatedJob and TrainingRound plans: create the children
//! the core asks for, persist aggregated models, and write status.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::ByteString;
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
    reconcile_job, reconcile_round, FederatedObservation, ParticipantObservation, RoundObservation,
};
use crate::decision::names::{child_name, round_task_name};
use crate::decision::propeller_job::{reconcile, JobObservation};

use super::patch::status_patch;
use super::runtime::{ReconcileError, Shared, RESYNC};

/// Key of the aggregated model in its ConfigMap's `binaryData`.
pub const MODEL_KEY: &str = "model.json";
/// Largest model a ConfigMap may hold (the API server's object limit is 1 MiB).
pub const MAX_MODEL_BYTES: usize = 900 * 1024;
/// Annotation carrying the model handed to a round by the previous one.
pub const GLOBAL_MODEL_ANNOTATION: &str = "propeller.propeller.absmach.eu/global-model";

fn owned_by(meta: &ObjectMeta, uid: &str) -> bool {
    meta.owner_references
        .as_ref()
        .is_some_and(|refs| refs.iter().any(|r| r.uid == uid))
}

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
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let tasks = ctx.tasks.state();
    let in_ns = || {
        tasks
            .iter()
            .filter(|t| t.namespace().as_deref() == Some(ns.as_str()))
    };
    let observed = JobObservation {
        children: in_ns()
            .filter(|t| owned_by(&t.metadata, &uid))
            .map(|t| {
                (
                    t.name_any(),
                    t.status.as_ref().map(|s| s.phase).unwrap_or_default(),
                )
            })
            .collect(),
        refs: job
            .spec
            .task_refs
            .iter()
            .map(|name| {
                let phase = in_ns()
                    .find(|t| t.name_any() == *name)
                    .map(|t| t.status.as_ref().map(|s| s.phase).unwrap_or_default());
                (name.clone(), phase)
            })
            .collect(),
    };
    let plan = reconcile(job, &observed, Utc::now());
    let task_api: Api<Task> = Api::namespaced(ctx.client.clone(), &ns);
    for child in &plan.create {
        create_once(&task_api, child).await?;
    }
    let api: Api<PropellerJob> = Api::namespaced(ctx.client.clone(), &ns);
    let old = job.status.clone().unwrap_or_default();
    let mut new = plan.status.clone();
    if new.created_at.is_some() && old.created_at.is_some() {
        new.created_at = old.created_at;
    }
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
    let cm = api.get_opt(name).await.ok()??;
    let bytes = cm.binary_data.as_ref()?.get(MODEL_KEY)?.0.clone();
    serde_json::from_slice(&bytes).ok()
}

async fn federated_job_once(job: &FederatedJob, ctx: &Shared) -> Result<Action, ReconcileError> {
    let ns = job.namespace().unwrap_or_else(|| "default".into());
    let uid = job.metadata.uid.clone().unwrap_or_default();
    let round_api: Api<TrainingRound> = Api::namespaced(ctx.client.clone(), &ns);
    let rounds = round_api.list(&Default::default()).await?;
    let mut observed = FederatedObservation::default();
    for round in rounds.items.iter().filter(|r| owned_by(&r.metadata, &uid)) {
        let Some(n) = crate::decision::aggregation::parse_round_id(&round.spec.round_id) else {
            continue;
        };
        let Ok(n) = u32::try_from(n) else { continue };
        let status = round.status.clone().unwrap_or_default();
        observed
            .rounds
            .insert(n, (status.phase, status.aggregated_model_ref.clone()));
        if let Some(reference) = &status.aggregated_model_ref {
            if let Some(model) = load_model(ctx, &ns, reference).await {
                observed.models.insert(n, model);
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
    let round_name = round.name_any();
    let tasks = ctx.tasks.state();
    let proplets = ctx.proplets.state();
    let mut participants = BTreeMap::new();
    for p in &round.spec.participants {
        let task_name = round_task_name(&round_name, p);
        let task = tasks
            .iter()
            .find(|t| t.namespace().as_deref() == Some(ns.as_str()) && t.name_any() == task_name);
        let client_id = proplets
            .iter()
            .find(|x| x.namespace().as_deref() == Some(ns.as_str()) && x.name_any() == *p)
            .map(|x| {
                x.spec
                    .connection_config
                    .client()
                    .unwrap_or(p.as_str())
                    .to_owned()
            });
        let status = task.and_then(|t| t.status.clone());
        participants.insert(
            p.clone(),
            ParticipantObservation {
                phase: task.map(|t| t.status.as_ref().map(|s| s.phase).unwrap_or_default()),
                results: status.as_ref().and_then(|s| s.results.clone()),
                error: status.and_then(|s| s.error),
                client_id,
            },
        );
    }
    let job_api: Api<FederatedJob> = Api::namespaced(ctx.client.clone(), &ns);
    let parent = job_api.get_opt(&round.spec.federated_job_ref.name).await?;
    let model_name = child_name(&round_name, "model");
    let cm_api: Api<ConfigMap> = Api::namespaced(ctx.client.clone(), &ns);
    let stored = cm_api
        .get_opt(&model_name)
        .await?
        .map(|_| model_name.clone());
    let observed = RoundObservation {
        participants,
        algorithm: parent
            .as_ref()
            .map(|j| j.spec.aggregator.algorithm)
            .unwrap_or_default(),
        job_id: parent
            .as_ref()
            .and_then(|j| j.spec.experiment_id.clone())
            .unwrap_or_else(|| round.spec.federated_job_ref.name.clone()),
        global_model: round
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(GLOBAL_MODEL_ANNOTATION))
            .and_then(|json| serde_json::from_str(json).ok()),
        stored_model_ref: stored,
    };
    let now = Utc::now();
    let plan = reconcile_round(round, &observed, now);
    let task_api: Api<Task> = Api::namespaced(ctx.client.clone(), &ns);
    for task in &plan.create {
        create_once(&task_api, task).await?;
    }
    let mut status = plan.status.clone();
    if let Some(model) = &plan.persist_model {
        let bytes = serde_json::to_vec(model).unwrap_or_default();
        if bytes.len() > MAX_MODEL_BYTES {
            status.phase = crate::crd::federated::RoundPhase::Failed;
            status.end_time = Some(now);
            crate::decision::conditions::set_condition(
                &mut status.conditions,
                &crate::decision::conditions::DesiredCondition::new(
                    "Ready",
                    false,
                    "ModelTooLarge",
                    format!(
                        "the aggregated model is {} bytes; a ConfigMap holds at most {MAX_MODEL_BYTES}",
                        bytes.len()
                    ),
                ),
                round.metadata.generation,
                now,
            );
        } else {
            let owner = round.controller_owner_ref(&()).map(|o| vec![o]);
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(model_name.clone()),
                    namespace: Some(ns.clone()),
                    owner_references: owner,
                    ..ObjectMeta::default()
                },
                binary_data: Some(BTreeMap::from([(MODEL_KEY.to_owned(), ByteString(bytes))])),
                ..ConfigMap::default()
            };
            create_once(&cm_api, &cm).await?;
            // The next reconcile sees the stored model and completes the round.
            let _ = ctx
                .round_trigger
                .send(kube::runtime::reflector::ObjectRef::from_obj(round));
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
