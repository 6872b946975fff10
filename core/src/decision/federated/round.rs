//! TrainingRound: its participants' tasks, the updates it collects, its aggregation and the
//! global model it stores (a ConfigMap), and how it ends.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::crd::federated::{
    AggregationAlgorithm, FederatedJob, ParticipantPhase, RoundParticipantStatus, RoundPhase,
    TrainingRound, TrainingRoundStatus,
};
use crate::crd::task::{PropletSelector, Task, TaskKind, TaskMode, TaskPhase, TaskSpec};
use crate::decision::aggregation::{Algorithm, ExpectedUpdate, UpdateEnvelope};
use crate::decision::conditions::{set_condition, DesiredCondition};
use crate::decision::{aggregation, names};

use super::{owner, MAX_INLINE_MODEL, PARTICIPANT_LABEL, ROUND_ID_LABEL, ROUND_LABEL};

/// What the driver observed about one participant's Task.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ParticipantObservation {
    /// Phase of the participant's Task; `None` when it does not exist yet.
    pub phase: Option<TaskPhase>,
    /// `status.results` of the Task.
    pub results: Option<serde_json::Value>,
    /// `status.error` of the Task.
    pub error: Option<String>,
    /// MQTT client id of the participant's Proplet, when known.
    pub client_id: Option<String>,
}

/// Everything a round decision needs besides the round itself.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoundObservation {
    /// By participant (Proplet name).
    pub participants: BTreeMap<String, ParticipantObservation>,
    /// The parent job's aggregation algorithm.
    pub algorithm: AggregationAlgorithm,
    /// The parent job's experiment id (`FL_JOB_ID`), or its name.
    pub job_id: String,
    /// The model handed to this round by the previous one.
    pub global_model: Option<UpdateEnvelope>,
    /// Where the driver stored this round's aggregated model, once it has.
    pub stored_model_ref: Option<String>,
}

/// What the executor must do for a TrainingRound.
#[derive(Debug, Clone)]
pub struct RoundPlan {
    /// Participant Tasks to create.
    pub create: Vec<Task>,
    /// Aggregated model the driver must persist; report where in the next observation.
    pub persist_model: Option<UpdateEnvelope>,
    /// The status to write.
    pub status: TrainingRoundStatus,
    /// When to look again even if nothing changes (the round's deadline).
    pub requeue_at: Option<DateTime<Utc>>,
}

/// The Task of one participant.
pub fn participant_task(
    round: &TrainingRound,
    participant: &str,
    job_id: &str,
    global: Option<&UpdateEnvelope>,
) -> Result<Task, String> {
    let round_name = round.metadata.name.clone().unwrap_or_default();
    let mut env = BTreeMap::from([
        ("ROUND_ID".to_string(), round.spec.round_id.clone()),
        ("PROPLET_ID".to_string(), participant.to_string()),
        ("FL_JOB_ID".to_string(), job_id.to_string()),
    ]);
    if let Some(m) = &round.spec.model_ref {
        env.insert("MODEL_URI".into(), m.clone());
    }
    if let Some(h) = &round.spec.hyperparams {
        env.insert("HYPERPARAMS".into(), h.to_string());
    }
    if let Some(g) = global {
        if g.update_b64.len() > MAX_INLINE_MODEL {
            return Err(format!(
                "the global model ({} base64 characters) is larger than the {MAX_INLINE_MODEL} that can be handed to tasks",
                g.update_b64.len()
            ));
        }
        env.insert("FL_GLOBAL_VERSION".into(), g.global_version.clone());
        env.insert("FL_GLOBAL_UPDATE_B64".into(), g.update_b64.clone());
        env.insert(
            "FL_GLOBAL_UPDATE_FORMAT".into(),
            g.effective_format().to_string(),
        );
    }
    Ok(Task {
        metadata: ObjectMeta {
            name: Some(names::round_task_name(&round_name, participant)),
            namespace: round.metadata.namespace.clone(),
            labels: Some(BTreeMap::from([
                (ROUND_LABEL.to_string(), names::label_value(&round_name)),
                (
                    ROUND_ID_LABEL.to_string(),
                    names::label_value(&round.spec.round_id),
                ),
                (
                    PARTICIPANT_LABEL.to_string(),
                    names::label_value(participant),
                ),
            ])),
            owner_references: Some(vec![owner("TrainingRound", &round.metadata)]),
            ..ObjectMeta::default()
        },
        spec: TaskSpec {
            name: names::round_task_name(&round_name, participant),
            kind: TaskKind::Federated,
            mode: Some(TaskMode::Train),
            image_url: Some(round.spec.task_wasm_image.clone()),
            proplet_selector: Some(PropletSelector {
                proplet_id: Some(participant.to_string()),
                ..Default::default()
            }),
            env,
            timeout_seconds: round.spec.timeout_seconds.filter(|t| *t > 0),
            ..TaskSpec::default()
        },
        status: None,
    })
}

/// Annotation carrying the model handed to a round by the previous one.
pub const GLOBAL_MODEL_ANNOTATION: &str = "propeller.propeller.absmach.eu/global-model";
/// Key of the aggregated model in its ConfigMap's `binaryData`.
pub const MODEL_KEY: &str = "model.json";
/// Largest model a ConfigMap may hold (the API server's object limit is 1 MiB).
pub const MAX_MODEL_BYTES: usize = 900 * 1024;

/// Name of the ConfigMap holding a round's aggregated model.
pub fn model_config_map_name(round: &TrainingRound) -> String {
    names::child_name(round.metadata.name.as_deref().unwrap_or_default(), "model")
}

/// The ConfigMap that stores `model` for `round`, owned by it; an error when the model is
/// too large for a ConfigMap.
pub fn model_config_map(
    round: &TrainingRound,
    model: &UpdateEnvelope,
) -> Result<k8s_openapi::api::core::v1::ConfigMap, String> {
    let bytes = serde_json::to_vec(model).map_err(|e| e.to_string())?;
    if bytes.len() > MAX_MODEL_BYTES {
        return Err(format!(
            "the aggregated model is {} bytes; a ConfigMap holds at most {MAX_MODEL_BYTES}",
            bytes.len()
        ));
    }
    Ok(k8s_openapi::api::core::v1::ConfigMap {
        metadata: ObjectMeta {
            name: Some(model_config_map_name(round)),
            namespace: round.metadata.namespace.clone(),
            owner_references: Some(vec![owner("TrainingRound", &round.metadata)]),
            ..ObjectMeta::default()
        },
        binary_data: Some(BTreeMap::from([(
            MODEL_KEY.to_owned(),
            k8s_openapi::ByteString(bytes),
        )])),
        ..Default::default()
    })
}

/// The model a stored ConfigMap holds.
pub fn model_of(config_map: &k8s_openapi::api::core::v1::ConfigMap) -> Option<UpdateEnvelope> {
    let bytes = &config_map.binary_data.as_ref()?.get(MODEL_KEY)?.0;
    serde_json::from_slice(bytes).ok()
}

/// Marks a round failed because its model could not be stored.
pub fn fail_unstorable(
    status: &mut TrainingRoundStatus,
    message: String,
    generation: Option<i64>,
    now: DateTime<Utc>,
) {
    status.phase = RoundPhase::Failed;
    status.end_time = Some(now);
    set_condition(
        &mut status.conditions,
        &DesiredCondition::new("Ready", false, "ModelTooLarge", message),
        generation,
        now,
    );
}

/// A round's observations from a driver's cached Tasks and Proplets, its parent job, and
/// where its model is stored (if it is).
pub fn observe_round(
    round: &TrainingRound,
    tasks: &[&Task],
    proplets: &[&crate::crd::proplet::Proplet],
    parent: Option<&FederatedJob>,
    stored_model_ref: Option<String>,
) -> RoundObservation {
    let ns = &round.metadata.namespace;
    let round_name = round.metadata.name.clone().unwrap_or_default();
    let mut participants = BTreeMap::new();
    for p in &round.spec.participants {
        let task_name = names::round_task_name(&round_name, p);
        let task = tasks.iter().find(|t| {
            t.metadata.namespace == *ns && t.metadata.name.as_deref() == Some(task_name.as_str())
        });
        let client_id = proplets
            .iter()
            .find(|x| x.metadata.namespace == *ns && x.metadata.name.as_deref() == Some(p.as_str()))
            .map(|x| x.client_id().to_owned());
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
    RoundObservation {
        participants,
        algorithm: parent
            .map(|j| j.spec.aggregator.algorithm)
            .unwrap_or_default(),
        job_id: parent
            .and_then(|j| j.spec.experiment_id.clone())
            .unwrap_or_else(|| round.spec.federated_job_ref.name.clone()),
        global_model: round
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(GLOBAL_MODEL_ANNOTATION))
            .and_then(|json| serde_json::from_str(json).ok()),
        stored_model_ref,
    }
}

/// The rounds a FederatedJob owns, by round number, with their phase and model reference.
pub fn owned_rounds<'a>(
    job: &FederatedJob,
    rounds: impl IntoIterator<Item = &'a TrainingRound>,
) -> BTreeMap<u32, (RoundPhase, Option<String>)> {
    let uid = job.metadata.uid.clone().unwrap_or_default();
    rounds
        .into_iter()
        .filter(|r| {
            r.metadata
                .owner_references
                .iter()
                .flatten()
                .any(|o| o.uid == uid)
        })
        .filter_map(|r| {
            let n =
                u32::try_from(propeller_broker::protocol::round_number(&r.spec.round_id)?).ok()?;
            let status = r.status.clone().unwrap_or_default();
            Some((n, (status.phase, status.aggregated_model_ref)))
        })
        .collect()
}

/// Decides a round's Tasks, its collected updates, aggregation and status.
pub fn reconcile_round(
    round: &TrainingRound,
    observed: &RoundObservation,
    now: DateTime<Utc>,
) -> RoundPlan {
    let mut status = round.status.clone().unwrap_or_default();
    let generation = round.metadata.generation;
    status.observed_generation = generation;
    status.updates_required = round.spec.k_of_n;
    let mut plan = RoundPlan {
        create: Vec::new(),
        persist_model: None,
        status: TrainingRoundStatus::default(),
        requeue_at: None,
    };
    if matches!(status.phase, RoundPhase::Completed | RoundPhase::Failed) {
        plan.status = status;
        return plan;
    }
    let start = *status.start_time.get_or_insert(now);
    let deadline = round
        .spec
        .timeout_seconds
        .filter(|t| *t > 0)
        .and_then(|t| start.checked_add_signed(chrono::Duration::seconds(t)));

    // Create missing participant Tasks.
    for p in &round.spec.participants {
        if observed
            .participants
            .get(p)
            .is_none_or(|o| o.phase.is_none())
        {
            match participant_task(round, p, &observed.job_id, observed.global_model.as_ref()) {
                Ok(task) => plan.create.push(task),
                Err(e) => return fail(plan, status, "InvalidModel", e, generation, now),
            }
        }
    }
    if status.phase == RoundPhase::Pending {
        status.phase = RoundPhase::Running;
    }

    // Collect updates.
    let round_number = propeller_broker::protocol::round_number(&round.spec.round_id).unwrap_or(0);
    let mut updates: Vec<UpdateEnvelope> = Vec::new();
    let mut participants = Vec::new();
    let mut all_finished = true;
    for p in &round.spec.participants {
        let obs = observed.participants.get(p).cloned().unwrap_or_default();
        let round_name = round.metadata.name.clone().unwrap_or_default();
        let mut entry = RoundParticipantStatus {
            proplet_id: p.clone(),
            task_ref: Some(ObjectReference {
                api_version: Some("propeller.propeller.absmach.eu/v1".into()),
                kind: Some("Task".into()),
                name: Some(names::round_task_name(&round_name, p)),
                namespace: round.metadata.namespace.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        match obs.phase {
            Some(TaskPhase::Completed) => {
                let expected = ExpectedUpdate {
                    job_id: observed.job_id.clone(),
                    round: round_number,
                    proplet_id: obs.client_id.clone().unwrap_or_default(),
                    global_version: observed
                        .global_model
                        .as_ref()
                        .map(|g| g.global_version.clone())
                        .unwrap_or_default(),
                };
                match obs
                    .results
                    .as_ref()
                    .map(|r| aggregation::extract_update(r, &expected))
                {
                    Some(Ok(update)) => {
                        entry.status = ParticipantPhase::Completed;
                        entry.update_received = true;
                        updates.push(update);
                    }
                    _ => entry.status = ParticipantPhase::Failed,
                }
            }
            Some(TaskPhase::Failed | TaskPhase::Skipped | TaskPhase::Interrupted) => {
                entry.status = ParticipantPhase::Failed
            }
            Some(_) => {
                entry.status = ParticipantPhase::Running;
                all_finished = false;
            }
            None => {
                entry.status = ParticipantPhase::Pending;
                all_finished = false;
            }
        }
        participants.push(entry);
    }
    status.participants = participants;
    status.updates_received = i32::try_from(updates.len()).unwrap_or(i32::MAX);
    let k = usize::try_from(round.spec.k_of_n.max(1)).unwrap_or(1);

    if updates.len() >= k {
        status.phase = RoundPhase::Aggregating;
        let algorithm = match observed.algorithm {
            AggregationAlgorithm::Fedavg => Algorithm::FedAvg,
            AggregationAlgorithm::Concat => Algorithm::Concat,
        };
        match aggregation::aggregate(&updates, algorithm) {
            Ok(model) => match &observed.stored_model_ref {
                Some(r) => {
                    status.phase = RoundPhase::Completed;
                    status.end_time = Some(now);
                    status.aggregated_model_ref = Some(r.clone());
                    let c = DesiredCondition::new(
                        "Ready",
                        true,
                        "Aggregated",
                        format!(
                            "aggregated {} updates with {}",
                            updates.len(),
                            algorithm.as_str()
                        ),
                    );
                    set_condition(&mut status.conditions, &c, generation, now);
                }
                None => {
                    plan.persist_model = Some(model);
                    let c = DesiredCondition::new(
                        "Ready",
                        true,
                        "Aggregating",
                        format!(
                            "collected {}/{} updates, storing the aggregated model",
                            updates.len(),
                            k
                        ),
                    );
                    set_condition(&mut status.conditions, &c, generation, now);
                }
            },
            Err(e) => {
                return fail(
                    plan,
                    status,
                    "AggregationFailed",
                    format!("failed to aggregate: {e}"),
                    generation,
                    now,
                )
            }
        }
        plan.status = status;
        return plan;
    }
    if all_finished {
        let msg = format!(
            "every participant finished but only {}/{} usable updates arrived",
            updates.len(),
            k
        );
        return fail(plan, status, "InsufficientUpdates", msg, generation, now);
    }
    if let Some(deadline) = deadline {
        if now > deadline {
            let msg = format!(
                "round timed out after {}s with {}/{} updates",
                round.spec.timeout_seconds.unwrap_or_default(),
                updates.len(),
                k
            );
            return fail(plan, status, "Timeout", msg, generation, now);
        }
        plan.requeue_at = Some(deadline);
    }
    let c = DesiredCondition::new(
        "Ready",
        true,
        "CollectingUpdates",
        format!("{}/{} updates received", updates.len(), k),
    );
    set_condition(&mut status.conditions, &c, generation, now);
    plan.status = status;
    plan
}

pub(super) fn fail(
    mut plan: RoundPlan,
    mut status: TrainingRoundStatus,
    reason: &'static str,
    message: String,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> RoundPlan {
    status.phase = RoundPhase::Failed;
    status.end_time = Some(now);
    set_condition(
        &mut status.conditions,
        &DesiredCondition::new("Ready", false, reason, message),
        generation,
        now,
    );
    plan.status = status;
    plan.persist_model = None;
    plan
}
