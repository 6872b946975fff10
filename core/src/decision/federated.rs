//! Federated learning: a FederatedJob runs its rounds one after another; a TrainingRound
//! runs one Task per participant, collects their updates, waits for k of n, aggregates, and
//! hands the aggregated model to the next round.
//!
//! Round phases: Pending → Running → Aggregating → Completed, or Failed on timeout, on too
//! few usable updates once every participant finished, or on an aggregation error. The
//! aggregated model itself is persisted by the driver ([`RoundPlan::persist_model`]); the
//! round completes once the driver reports where it stored it.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::LocalObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

use super::aggregation::UpdateEnvelope;
use super::conditions::{set_condition, DesiredCondition};
use super::names;
use crate::crd::federated::{
    FederatedJob, FederatedJobStatus, FederatedParticipantStatus, RoundPhase, TrainingRound,
    TrainingRoundSpec,
};
use crate::crd::job::JobPhase;

mod round;

pub use round::{
    fail_unstorable, model_config_map, model_config_map_name, model_of, observe_round,
    owned_rounds, participant_task, reconcile_round, ParticipantObservation, RoundObservation,
    RoundPlan, GLOBAL_MODEL_ANNOTATION, MAX_MODEL_BYTES, MODEL_KEY,
};

/// Label on round Tasks naming their round.
pub const ROUND_LABEL: &str = "propeller.propeller.absmach.eu/training-round";
/// Label on round Tasks carrying the round id.
pub const ROUND_ID_LABEL: &str = "propeller.propeller.absmach.eu/round-id";
/// Label on round Tasks naming the participant.
pub const PARTICIPANT_LABEL: &str = "propeller.propeller.absmach.eu/participant";
/// Largest aggregated model (base64 characters) handed to the next round through task env.
pub const MAX_INLINE_MODEL: usize = 65536;

fn owner(api_kind: &str, meta: &ObjectMeta) -> OwnerReference {
    OwnerReference {
        api_version: "propeller.propeller.absmach.eu/v1".to_string(),
        kind: api_kind.to_string(),
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    }
}

/// What the driver observed about a FederatedJob's rounds, by round number (1-based).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FederatedObservation {
    /// Phase and aggregated model reference of each existing round.
    pub rounds: BTreeMap<u32, (RoundPhase, Option<String>)>,
    /// The aggregated model of each completed round, when the driver could load it.
    pub models: BTreeMap<u32, UpdateEnvelope>,
}

/// What the executor must do for a FederatedJob.
#[derive(Debug, Clone)]
pub struct FederatedPlan {
    /// The round to create, if any.
    pub create_round: Option<TrainingRound>,
    /// The status to write.
    pub status: FederatedJobStatus,
}

/// Decides the next round and the status of a FederatedJob.
pub fn reconcile_job(
    job: &FederatedJob,
    observed: &FederatedObservation,
    now: DateTime<Utc>,
) -> FederatedPlan {
    let mut status = job.status.clone().unwrap_or_default();
    let generation = job.metadata.generation;
    status.observed_generation = generation;
    if status.participants.is_empty() {
        status.participants = job
            .spec
            .participants
            .iter()
            .map(|p| FederatedParticipantStatus {
                proplet_id: p.proplet_id.clone(),
                ..Default::default()
            })
            .collect();
    }
    if matches!(status.phase, JobPhase::Completed | JobPhase::Failed) {
        return FederatedPlan {
            create_round: None,
            status,
        };
    }
    let total = u32::try_from(job.spec.rounds.total.max(1)).unwrap_or(1);
    let current = u32::try_from(status.current_round.max(1)).unwrap_or(1);
    if status.phase == JobPhase::Pending {
        status.phase = JobPhase::Running;
        status.current_round = 1;
        status.start_time = Some(now);
    }
    let mut create_round = None;
    let msg;
    match observed.rounds.get(&current).cloned() {
        None => {
            let previous_model = current.checked_sub(1).and_then(|p| observed.models.get(&p));
            let previous_ref = current
                .checked_sub(1)
                .and_then(|p| observed.rounds.get(&p))
                .and_then(|(_, r)| r.clone());
            create_round = Some(round_for(job, current, previous_ref, previous_model));
            msg = DesiredCondition::new(
                "Ready",
                true,
                "RoundRunning",
                format!("round {current} of {total} started"),
            );
        }
        Some((RoundPhase::Completed, model_ref)) => {
            status.completed_rounds = i32::try_from(current).unwrap_or(i32::MAX);
            status.aggregated_model_ref = model_ref.clone();
            if current >= total {
                status.phase = JobPhase::Completed;
                status.finish_time = Some(now);
                msg = DesiredCondition::new(
                    "Ready",
                    true,
                    "AllRoundsCompleted",
                    format!("{total} rounds completed"),
                );
            } else {
                let next = current + 1;
                status.current_round = i32::try_from(next).unwrap_or(i32::MAX);
                create_round = Some(round_for(
                    job,
                    next,
                    model_ref,
                    observed.models.get(&current),
                ));
                msg = DesiredCondition::new(
                    "Ready",
                    true,
                    "RoundRunning",
                    format!("round {next} of {total} started"),
                );
            }
        }
        Some((RoundPhase::Failed, _)) => {
            status.phase = JobPhase::Failed;
            status.finish_time = Some(now);
            msg = DesiredCondition::new(
                "Ready",
                false,
                "RoundFailed",
                format!(
                    "round {current} failed; see TrainingRound {}",
                    names::training_round_name(
                        current,
                        job.metadata.name.as_deref().unwrap_or_default()
                    )
                ),
            );
        }
        Some((phase, _)) => {
            msg = DesiredCondition::new(
                "Ready",
                true,
                "RoundRunning",
                format!("round {current} of {total} is {phase:?}"),
            );
        }
    }
    set_condition(&mut status.conditions, &msg, generation, now);
    FederatedPlan {
        create_round,
        status,
    }
}

fn round_for(
    job: &FederatedJob,
    n: u32,
    previous_ref: Option<String>,
    previous_model: Option<&UpdateEnvelope>,
) -> TrainingRound {
    let job_name = job.metadata.name.clone().unwrap_or_default();
    let mut annotations = BTreeMap::new();
    if let Some(model) = previous_model {
        if let Ok(json) = serde_json::to_string(model) {
            annotations.insert(GLOBAL_MODEL_ANNOTATION.to_owned(), json);
        }
    }
    TrainingRound {
        metadata: ObjectMeta {
            name: Some(names::training_round_name(n, &job_name)),
            namespace: job.metadata.namespace.clone(),
            owner_references: Some(vec![owner("FederatedJob", &job.metadata)]),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..ObjectMeta::default()
        },
        spec: TrainingRoundSpec {
            round_id: format!("round-{n}"),
            federated_job_ref: LocalObjectReference { name: job_name },
            model_ref: previous_ref.or_else(|| job.spec.model_ref.clone()),
            task_wasm_image: job.spec.task_wasm_image.clone(),
            participants: job
                .spec
                .participants
                .iter()
                .map(|p| p.proplet_id.clone())
                .collect(),
            hyperparams: job.spec.hyperparams.clone(),
            k_of_n: job.spec.k_of_n,
            timeout_seconds: job.spec.timeout_seconds,
        },
        status: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::federated::ParticipantPhase;
    use crate::crd::federated::{AggregatorSpec, FederatedJobSpec, Participant, RoundsSpec};
    use crate::crd::task::TaskKind;
    use crate::crd::task::TaskPhase;
    use crate::decision::aggregation::{decode_vector, encode_json_f64};
    use chrono::TimeZone;
    use serde_json::json;

    fn t(s: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
    }

    fn fl_job(total: i32, k: i32, timeout: Option<i64>) -> FederatedJob {
        let mut j = FederatedJob::new(
            "fl",
            FederatedJobSpec {
                experiment_id: Some("exp1".into()),
                model_ref: Some("oci://model:v0".into()),
                task_wasm_image: "oci://train".into(),
                participants: vec![
                    Participant {
                        proplet_id: "edge-a".into(),
                    },
                    Participant {
                        proplet_id: "edge-b".into(),
                    },
                ],
                hyperparams: Some(json!({"lr": 0.1})),
                k_of_n: k,
                timeout_seconds: timeout,
                rounds: RoundsSpec {
                    total,
                    strategy: None,
                },
                aggregator: AggregatorSpec::default(),
            },
        );
        j.metadata.namespace = Some("lab".into());
        j.metadata.uid = Some("job-uid".into());
        j
    }

    fn round_of(job: &FederatedJob, n: u32, prev: Option<&UpdateEnvelope>) -> TrainingRound {
        let mut r = round_for(job, n, None, prev);
        r.metadata.uid = Some(format!("round-uid-{n}"));
        r
    }

    fn result(values: &[f64], samples: u64, round: &str, proplet: &str) -> serde_json::Value {
        // The Rust proplet's FL result form: an object without job_id.
        json!({"task_id": "t", "round_id": round, "proplet_id": proplet, "num_samples": samples,
               "update_b64": encode_json_f64(values), "format": "json-f64", "metrics": {}})
    }

    fn obs(a: ParticipantObservation, b: ParticipantObservation) -> RoundObservation {
        RoundObservation {
            participants: BTreeMap::from([("edge-a".to_string(), a), ("edge-b".to_string(), b)]),
            job_id: "exp1".into(),
            ..Default::default()
        }
    }

    fn done(values: &[f64], samples: u64, proplet: &str) -> ParticipantObservation {
        ParticipantObservation {
            phase: Some(TaskPhase::Completed),
            results: Some(result(values, samples, "round-1", proplet)),
            client_id: Some(proplet.into()),
            ..Default::default()
        }
    }

    #[test]
    fn a_round_creates_one_federated_task_per_participant() {
        let job = fl_job(2, 2, None);
        let round = round_of(&job, 1, None);
        assert_eq!(round.metadata.name.as_deref(), Some("round-1-fl"));
        assert_eq!(round.spec.model_ref.as_deref(), Some("oci://model:v0"));
        let plan = reconcile_round(
            &round,
            &RoundObservation {
                job_id: "exp1".into(),
                ..Default::default()
            },
            t(0),
        );
        assert_eq!(plan.status.phase, RoundPhase::Running);
        let names: Vec<_> = plan
            .create
            .iter()
            .map(|t| t.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(names, ["round-1-fl-edge-a", "round-1-fl-edge-b"]);
        let task = &plan.create[0];
        assert_eq!(task.spec.kind, TaskKind::Federated);
        assert_eq!(task.spec.image_url.as_deref(), Some("oci://train"));
        assert_eq!(
            task.spec
                .proplet_selector
                .as_ref()
                .unwrap()
                .proplet_id
                .as_deref(),
            Some("edge-a")
        );
        assert_eq!(task.spec.env["ROUND_ID"], "round-1");
        assert_eq!(task.spec.env["FL_JOB_ID"], "exp1");
        assert_eq!(task.spec.env["HYPERPARAMS"], r#"{"lr":0.1}"#);
        assert_eq!(
            task.metadata.owner_references.as_ref().unwrap()[0].uid,
            "round-uid-1"
        );
    }

    #[test]
    fn fedavg_of_two_participants_worked_example() {
        // edge-a: [1, 2] with 100 samples; edge-b: [3, 6] with 300 samples.
        // FedAvg = (100·[1,2] + 300·[3,6]) / 400 = [2.5, 5.0].
        let job = fl_job(1, 2, None);
        let round = round_of(&job, 1, None);
        let observation = obs(
            done(&[1.0, 2.0], 100, "edge-a"),
            done(&[3.0, 6.0], 300, "edge-b"),
        );
        let plan = reconcile_round(&round, &observation, t(10));
        assert_eq!(plan.status.phase, RoundPhase::Aggregating);
        assert_eq!(plan.status.updates_received, 2);
        let model = plan.persist_model.expect("model to persist");
        assert_eq!(decode_vector(&model).unwrap(), vec![2.5, 5.0]);
        assert_eq!(model.num_samples, 400);
        assert_eq!(model.job_id, "exp1");

        let mut round = round;
        round.status = Some(plan.status);
        let stored = RoundObservation {
            stored_model_ref: Some("configmap://lab/round-1-fl-model".into()),
            ..observation
        };
        let plan = reconcile_round(&round, &stored, t(11));
        assert_eq!(plan.status.phase, RoundPhase::Completed);
        assert_eq!(
            plan.status.aggregated_model_ref.as_deref(),
            Some("configmap://lab/round-1-fl-model")
        );
        assert!(plan.status.participants.iter().all(|p| p.update_received));
    }

    #[test]
    fn k_of_n_aggregates_without_waiting_for_everyone() {
        let job = fl_job(1, 1, None);
        let round = round_of(&job, 1, None);
        let running = ParticipantObservation {
            phase: Some(TaskPhase::Running),
            ..Default::default()
        };
        let plan = reconcile_round(&round, &obs(done(&[4.0], 5, "edge-a"), running), t(1));
        assert_eq!(plan.status.phase, RoundPhase::Aggregating);
        assert_eq!(
            decode_vector(plan.persist_model.as_ref().unwrap()).unwrap(),
            vec![4.0]
        );
    }

    #[test]
    fn too_few_updates_fail_once_everyone_finished() {
        let job = fl_job(1, 2, None);
        let round = round_of(&job, 1, None);
        let failed = ParticipantObservation {
            phase: Some(TaskPhase::Failed),
            error: Some("trap".into()),
            ..Default::default()
        };
        let plan = reconcile_round(&round, &obs(done(&[1.0], 1, "edge-a"), failed), t(1));
        assert_eq!(plan.status.phase, RoundPhase::Failed);
        assert_eq!(plan.status.conditions[0].reason, "InsufficientUpdates");
        assert_eq!(
            plan.status.conditions[0].message,
            "every participant finished but only 1/2 usable updates arrived"
        );
    }

    #[test]
    fn an_invalid_update_does_not_count() {
        let job = fl_job(1, 2, None);
        let round = round_of(&job, 1, None);
        let mut bad = done(&[1.0], 1, "edge-b");
        bad.results = Some(json!("42"));
        let plan = reconcile_round(&round, &obs(done(&[1.0], 1, "edge-a"), bad), t(1));
        assert_eq!(plan.status.phase, RoundPhase::Failed);
        assert_eq!(plan.status.updates_received, 1);
        assert_eq!(plan.status.participants[1].status, ParticipantPhase::Failed);
    }

    #[test]
    fn the_round_times_out_at_its_deadline() {
        let job = fl_job(1, 2, Some(60));
        let round = round_of(&job, 1, None);
        let running = ParticipantObservation {
            phase: Some(TaskPhase::Running),
            ..Default::default()
        };
        let observation = obs(running.clone(), running);
        let plan = reconcile_round(&round, &observation, t(0));
        assert_eq!(plan.requeue_at, Some(t(60)));
        let mut round = round;
        round.status = Some(plan.status);
        let plan = reconcile_round(&round, &observation, t(61));
        assert_eq!(plan.status.phase, RoundPhase::Failed);
        assert_eq!(plan.status.conditions[0].reason, "Timeout");
    }

    #[test]
    fn mismatched_dimensions_fail_aggregation() {
        let job = fl_job(1, 2, None);
        let round = round_of(&job, 1, None);
        let plan = reconcile_round(
            &round,
            &obs(done(&[1.0, 2.0], 1, "edge-a"), done(&[1.0], 1, "edge-b")),
            t(1),
        );
        assert_eq!(plan.status.phase, RoundPhase::Failed);
        assert_eq!(plan.status.conditions[0].reason, "AggregationFailed");
        assert!(plan.persist_model.is_none());
    }

    #[test]
    fn the_job_runs_rounds_in_order_and_hands_the_model_on() {
        let job = fl_job(2, 2, None);
        let plan = reconcile_job(&job, &FederatedObservation::default(), t(0));
        assert_eq!(plan.status.phase, JobPhase::Running);
        assert_eq!(plan.status.current_round, 1);
        assert_eq!(
            plan.create_round.as_ref().unwrap().metadata.name.as_deref(),
            Some("round-1-fl")
        );

        let mut job = job;
        job.status = Some(plan.status);
        let model = UpdateEnvelope {
            job_id: "exp1".into(),
            round_id: 1,
            global_version: "v1".into(),
            proplet_id: "aggregator".into(),
            num_samples: 400,
            update_b64: encode_json_f64(&[2.5, 5.0]),
            ..Default::default()
        };
        let observed = FederatedObservation {
            rounds: BTreeMap::from([(
                1,
                (
                    RoundPhase::Completed,
                    Some("configmap://lab/round-1-fl-model".to_string()),
                ),
            )]),
            models: BTreeMap::from([(1, model.clone())]),
        };
        let plan = reconcile_job(&job, &observed, t(5));
        assert_eq!(
            (plan.status.completed_rounds, plan.status.current_round),
            (1, 2)
        );
        let next = plan.create_round.expect("round 2");
        assert_eq!(next.metadata.name.as_deref(), Some("round-2-fl"));
        assert_eq!(
            next.spec.model_ref.as_deref(),
            Some("configmap://lab/round-1-fl-model")
        );
        // The next round's tasks receive the aggregated model.
        let task = participant_task(&next, "edge-a", "exp1", Some(&model)).unwrap();
        assert_eq!(task.spec.env["FL_GLOBAL_UPDATE_B64"], model.update_b64);
        assert_eq!(task.spec.env["FL_GLOBAL_UPDATE_FORMAT"], "json-f64");

        job.status = Some(plan.status);
        let mut observed = observed;
        observed.rounds.insert(
            2,
            (
                RoundPhase::Completed,
                Some("configmap://lab/round-2-fl-model".into()),
            ),
        );
        let plan = reconcile_job(&job, &observed, t(9));
        assert_eq!(plan.status.phase, JobPhase::Completed);
        assert_eq!(plan.status.completed_rounds, 2);
        assert_eq!(
            plan.status.aggregated_model_ref.as_deref(),
            Some("configmap://lab/round-2-fl-model")
        );
        assert!(plan.create_round.is_none());
    }

    #[test]
    fn a_failed_round_fails_the_job() {
        let mut job = fl_job(3, 1, None);
        job.status = Some(reconcile_job(&job, &FederatedObservation::default(), t(0)).status);
        let observed = FederatedObservation {
            rounds: BTreeMap::from([(1, (RoundPhase::Failed, None))]),
            ..Default::default()
        };
        let plan = reconcile_job(&job, &observed, t(1));
        assert_eq!(plan.status.phase, JobPhase::Failed);
        assert_eq!(plan.status.conditions[0].reason, "RoundFailed");
    }
}
