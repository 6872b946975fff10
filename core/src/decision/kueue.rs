//! Kueue admission for PropellerJobs: the Workload a labelled job needs, and what its
//! Workload's conditions mean for the job.
//!
//! A job with the [`QUEUE_NAME_LABEL`] label is Kueue-managed. Propeller creates its
//! Workload (owned by the job) and holds the job (creates no task, dispatches nothing) until
//! Kueue reserves quota and admits it; no mutating webhook is needed because a held job is
//! the operator's own reading of the label. On admission the job runs, restricted to the
//! proplets carrying the admitted ResourceFlavor's node labels. On eviction (preemption,
//! deactivation) the job is held again: its running tasks are stopped, and once none is out
//! the quota is given back with the one status write Kueue's webhook accepts for it. When the
//! job finishes, the Workload is marked `Finished`, which releases the quota.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta};

use super::conditions::{is_true, set_condition, DesiredCondition};
use super::names;
use super::propeller_job::{controller_ref, Gate, JOB_LABEL};
use crate::crd::job::{ExecutionMode, JobPhase, PropellerJob};
use crate::crd::kueue::{PodSet, PriorityClassRef, Workload, WorkloadSpec, WorkloadStatus};

/// The label that puts a job under Kueue: the name of a LocalQueue in its namespace.
pub const QUEUE_NAME_LABEL: &str = "kueue.x-k8s.io/queue-name";
/// The label naming a WorkloadPriorityClass for the job.
pub const PRIORITY_CLASS_LABEL: &str = "kueue.x-k8s.io/priority-class";
/// The label Kueue puts on a Workload naming its job's UID.
pub const JOB_UID_LABEL: &str = "kueue.x-k8s.io/job-uid";
/// The resource each task takes one of: a slot on a device. A ClusterQueue's quota of it
/// is how many tasks of admitted jobs may run at once.
pub const SLOTS: &str = "propeller.absmach.eu/slots";
/// The one pod set of a job's Workload.
pub const POD_SET: &str = "tasks";

/// Workload condition types (Kueue's).
pub const QUOTA_RESERVED: &str = "QuotaReserved";
const ADMITTED: &str = "Admitted";
const EVICTED: &str = "Evicted";
const FINISHED: &str = "Finished";
const REQUEUED: &str = "Requeued";

/// The LocalQueue `job` asks for, if it is Kueue-managed.
pub fn queue_name(job: &PropellerJob) -> Option<&str> {
    job.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(QUEUE_NAME_LABEL))
        .map(String::as_str)
        .filter(|q| !q.is_empty())
}

/// The WorkloadPriorityClass `job` names, if any.
pub fn priority_class(job: &PropellerJob) -> Option<&str> {
    job.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(PRIORITY_CLASS_LABEL))
        .map(String::as_str)
        .filter(|c| !c.is_empty())
}

/// The name of `job`'s Workload.
pub fn workload_name(job: &PropellerJob) -> String {
    names::child_name(
        "propellerjob",
        job.metadata.name.as_deref().unwrap_or_default(),
    )
}

/// How many of `job`'s tasks may run at once: one in sequence, all of them otherwise
/// (a DAG may run every branch together; the dependencies only order them).
pub fn tasks_at_once(job: &PropellerJob) -> i32 {
    let inline = i32::try_from(job.spec.tasks.len()).unwrap_or(i32::MAX);
    match job.spec.execution_mode {
        ExecutionMode::Sequential => inline.min(1),
        ExecutionMode::Parallel | ExecutionMode::Configurable => inline,
    }
    .max(1)
}

/// The Workload `job` needs: its queue, its priority (`Some((class, value))` when it names
/// a WorkloadPriorityClass), and one pod set of [`tasks_at_once`] members, each requesting
/// one [`SLOTS`] and the largest memory any of its tasks declares.
pub fn desired_workload(job: &PropellerJob, priority: Option<(&str, i32)>) -> Workload {
    let job_name = job.metadata.name.clone().unwrap_or_default();
    let mut requests = BTreeMap::from([(SLOTS.to_owned(), Quantity("1".to_owned()))]);
    if let Some(memory) = largest_memory(job) {
        requests.insert("memory".to_owned(), Quantity(memory));
    }
    let mut labels = BTreeMap::from([(JOB_LABEL.to_owned(), names::label_value(&job_name))]);
    if let Some(uid) = &job.metadata.uid {
        labels.insert(JOB_UID_LABEL.to_owned(), names::label_value(uid));
    }
    let template = PodTemplateSpec {
        metadata: None,
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "task".to_owned(),
                resources: Some(ResourceRequirements {
                    requests: Some(requests),
                    ..ResourceRequirements::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
    };
    Workload {
        metadata: ObjectMeta {
            name: Some(workload_name(job)),
            namespace: job.metadata.namespace.clone(),
            labels: Some(labels),
            owner_references: Some(vec![controller_ref(job)]),
            ..ObjectMeta::default()
        },
        spec: WorkloadSpec {
            queue_name: queue_name(job).map(str::to_owned),
            pod_sets: vec![PodSet {
                name: POD_SET.to_owned(),
                count: tasks_at_once(job),
                template,
            }],
            priority: priority.map(|(_, value)| value),
            priority_class_ref: priority.map(|(class, _)| PriorityClassRef {
                group: "kueue.x-k8s.io".to_owned(),
                kind: "WorkloadPriorityClass".to_owned(),
                name: class.to_owned(),
            }),
        },
        status: None,
    }
}

/// The largest `resourceRequirements.memory` among `job`'s tasks, as written.
fn largest_memory(job: &PropellerJob) -> Option<String> {
    job.spec
        .tasks
        .iter()
        .filter_map(|t| t.resource_requirements.as_ref()?.memory.clone())
        .filter_map(|m| quantity_bytes(&m).map(|bytes| (bytes, m)))
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, m)| m)
}

/// A memory quantity ("512Mi", "1G", "1000") in bytes; `None` when it is not one.
fn quantity_bytes(quantity: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 10] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("k", 1e3),
        ("K", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("m", 1e-3),
    ];
    let (number, factor) = SUFFIXES
        .iter()
        .find_map(|(suffix, factor)| quantity.strip_suffix(suffix).map(|n| (n, *factor)))
        .unwrap_or((quantity, 1.0));
    number.parse::<f64>().ok().map(|n| n * factor)
}

/// The ResourceFlavors Kueue admitted `workload`'s pod sets to (whose node labels restrict
/// the job's proplets).
pub fn admitted_flavors(workload: &Workload) -> Vec<String> {
    let mut flavors: Vec<String> = workload
        .status
        .as_ref()
        .and_then(|s| s.admission.as_ref())
        .and_then(|a| a.get("podSetAssignments"))
        .and_then(|a| a.as_array())
        .into_iter()
        .flatten()
        .filter_map(|assignment| assignment.get("flavors")?.as_object())
        .flat_map(|flavors| flavors.values())
        .filter_map(|f| f.as_str().map(str::to_owned))
        .collect();
    flavors.sort();
    flavors.dedup();
    flavors
}

/// What to do about a Kueue-managed job's Workload, and what it means for the job.
#[derive(Debug, Clone, PartialEq)]
pub struct KueuePlan {
    /// Create this Workload (the job has none yet).
    pub create: Option<Workload>,
    /// Write this status on the Workload (its `old` being what it holds now).
    pub workload_status: Option<WorkloadStatus>,
    /// Whether the job may run.
    pub gate: Gate,
    /// The job's `QuotaReserved` condition, Kueue's words.
    pub quota: DesiredCondition,
}

/// What `job`'s Workload (`None`: not created yet) means now. `node_labels` are the
/// admitted flavors' labels, `runs_out` whether any of the job's tasks is still out on a
/// device (an evicted job gives its quota back only once none is), `priority` the job's
/// priority class and value.
pub fn plan(
    job: &PropellerJob,
    workload: Option<&Workload>,
    node_labels: &BTreeMap<String, String>,
    runs_out: bool,
    priority: Option<(&str, i32)>,
    now: DateTime<Utc>,
) -> KueuePlan {
    let Some(workload) = workload else {
        return KueuePlan {
            create: Some(desired_workload(job, priority)),
            workload_status: None,
            gate: held("Pending", "waiting for Kueue to see the job's Workload"),
            quota: DesiredCondition::new(
                QUOTA_RESERVED,
                false,
                "WorkloadCreated",
                "the Workload was created; Kueue has not reserved quota yet",
            ),
        };
    };
    let status = workload.status.clone().unwrap_or_default();
    let conditions = &status.conditions;
    let generation = workload.metadata.generation;
    let finished = matches!(
        job.status.as_ref().map(|s| s.phase),
        Some(JobPhase::Completed | JobPhase::Failed)
    );
    let reserved = is_true(conditions, QUOTA_RESERVED);
    let quota = mirror(conditions, QUOTA_RESERVED);
    let mut plan = KueuePlan {
        create: None,
        workload_status: None,
        gate: held(&quota.reason, &quota.message),
        quota,
    };
    if finished {
        if !is_true(conditions, FINISHED) {
            let mut new = status.clone();
            let succeeded = job.status.as_ref().map(|s| s.phase) == Some(JobPhase::Completed);
            let (reason, message) = if succeeded {
                ("Succeeded", "the job's tasks finished")
            } else {
                ("Failed", "the job failed")
            };
            set_condition(
                &mut new.conditions,
                &DesiredCondition::new(FINISHED, true, reason, message),
                generation,
                now,
            );
            plan.workload_status = Some(new);
        }
        return plan;
    }
    let evicted = condition(conditions, EVICTED).filter(|c| c.status == "True");
    match evicted {
        Some(evicted) if reserved || status.admission.is_some() => {
            let reason = evicted.reason.clone();
            plan.gate = held(&reason, &evicted.message);
            if !runs_out {
                plan.workload_status = Some(give_back(&status, evicted, generation, now));
            }
        }
        _ if reserved && is_true(conditions, ADMITTED) => {
            plan.gate = Gate::Open {
                node_labels: node_labels.clone(),
            };
        }
        // Given back after an eviction: held for that reason until admitted again.
        Some(evicted) => {
            plan.gate = held(
                &evicted.reason,
                &format!(
                    "{}; waiting to be admitted again ({})",
                    evicted.message, plan.quota.message
                ),
            );
        }
        None => {}
    }
    plan
}

/// The status that gives an evicted Workload's quota back: requeued for the eviction's
/// reason, no reservation, no admission.
fn give_back(
    status: &WorkloadStatus,
    evicted: &Condition,
    generation: Option<i64>,
    now: DateTime<Utc>,
) -> WorkloadStatus {
    let mut new = status.clone();
    let requeued = matches!(evicted.reason.as_str(), "Preempted" | "NodeFailures");
    let changes = [
        DesiredCondition::new(
            REQUEUED,
            requeued,
            evicted.reason.clone(),
            format!("the job's runs were stopped: {}", evicted.message),
        ),
        DesiredCondition::new(
            QUOTA_RESERVED,
            false,
            "Pending",
            "the job's runs were stopped and its quota given back",
        ),
        DesiredCondition::new(ADMITTED, false, "NoReservation", "the job holds no quota"),
    ];
    for change in &changes {
        set_condition(&mut new.conditions, change, generation, now);
    }
    new.admission = None;
    new
}

fn held(reason: &str, message: &str) -> Gate {
    Gate::Held {
        reason: if reason.is_empty() { "Pending" } else { reason }.to_owned(),
        message: message.to_owned(),
    }
}

fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Kueue's condition `type_` as the job shows it (Pending until Kueue wrote one).
fn mirror(conditions: &[Condition], type_: &'static str) -> DesiredCondition {
    match condition(conditions, type_) {
        Some(c) => DesiredCondition::new(
            type_,
            c.status == "True",
            if c.reason.is_empty() {
                "Pending".to_owned()
            } else {
                c.reason.clone()
            },
            c.message.clone(),
        ),
        None => DesiredCondition::new(type_, false, "Pending", "the Workload waits in its queue"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crd::job::{PropellerJobSpec, PropellerJobStatus};
    use crate::crd::task::TaskSpec;
    use crate::decision::conditions::to_k8s_time;
    use chrono::TimeZone;
    use serde_json::json;

    fn now() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 28, 10, 0, 0)
            .single()
            .unwrap_or_default()
    }

    fn job(mode: ExecutionMode, tasks: usize) -> PropellerJob {
        let mut job = PropellerJob::new(
            "etl",
            PropellerJobSpec {
                name: "etl".into(),
                execution_mode: mode,
                tasks: (0..tasks)
                    .map(|i| TaskSpec {
                        name: format!("t{i}"),
                        ..TaskSpec::default()
                    })
                    .collect(),
                task_refs: Vec::new(),
                suspend: false,
            },
        );
        job.metadata.namespace = Some("team-a".into());
        job.metadata.uid = Some("uid-1".into());
        job.metadata.labels = Some(BTreeMap::from([(
            QUEUE_NAME_LABEL.to_owned(),
            "lq-a".to_owned(),
        )]));
        job
    }

    fn cond(type_: &str, status: bool, reason: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: if status { "True" } else { "False" }.into(),
            reason: reason.into(),
            message: format!("{type_} {reason}"),
            observed_generation: Some(1),
            last_transition_time: to_k8s_time(now()),
        }
    }

    fn workload(conditions: Vec<Condition>, admitted_to: Option<&str>) -> Workload {
        let mut w = desired_workload(&job(ExecutionMode::Parallel, 2), None);
        w.metadata.generation = Some(1);
        w.status = Some(WorkloadStatus {
            conditions,
            admission: admitted_to.map(|flavor| {
                json!({"clusterQueue": "cq", "podSetAssignments": [
                    {"name": POD_SET, "count": 2, "flavors": {SLOTS: flavor}}
                ]})
            }),
        });
        w
    }

    fn admitted() -> Workload {
        workload(
            vec![
                cond(QUOTA_RESERVED, true, "QuotaReserved"),
                cond(ADMITTED, true, "Admitted"),
            ],
            Some("pi-flavor"),
        )
    }

    #[test]
    fn a_job_gets_a_workload_of_its_slots_and_waits() {
        let mut j = job(ExecutionMode::Parallel, 2);
        j.spec.tasks[1].resource_requirements = Some(crate::crd::common::PropletResources {
            cpu: None,
            memory: Some("64Mi".into()),
            ..Default::default()
        });
        j.spec.tasks[0].resource_requirements = Some(crate::crd::common::PropletResources {
            cpu: None,
            memory: Some("1M".into()),
            ..Default::default()
        });
        let plan = plan(
            &j,
            None,
            &BTreeMap::new(),
            false,
            Some(("high", 100)),
            now(),
        );
        let w = plan.create.unwrap_or_default();
        assert_eq!(w.metadata.name.as_deref(), Some("propellerjob-etl"));
        assert_eq!(w.spec.queue_name.as_deref(), Some("lq-a"));
        assert_eq!(w.spec.priority, Some(100));
        assert_eq!(
            w.spec.priority_class_ref.map(|r| r.name),
            Some("high".to_owned())
        );
        assert_eq!(w.spec.pod_sets[0].count, 2);
        let value = serde_json::to_value(&w.spec.pod_sets[0].template).unwrap_or_default();
        assert_eq!(
            value["spec"]["containers"][0]["resources"]["requests"],
            json!({SLOTS: "1", "memory": "64Mi"})
        );
        let owner = &w.metadata.owner_references.unwrap_or_default()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.controller),
            ("PropellerJob", Some(true))
        );
        assert!(matches!(plan.gate, Gate::Held { .. }));
    }

    #[test]
    fn a_sequential_job_needs_one_slot() {
        assert_eq!(tasks_at_once(&job(ExecutionMode::Sequential, 5)), 1);
        assert_eq!(tasks_at_once(&job(ExecutionMode::Configurable, 5)), 5);
        assert_eq!(tasks_at_once(&job(ExecutionMode::Parallel, 0)), 1);
    }

    #[test]
    fn a_pending_workload_holds_the_job_with_kueues_reason() {
        let w = workload(vec![cond(QUOTA_RESERVED, false, "Pending")], None);
        let j = job(ExecutionMode::Parallel, 2);
        let plan = plan(&j, Some(&w), &BTreeMap::new(), false, None, now());
        assert_eq!(
            plan.gate,
            Gate::Held {
                reason: "Pending".into(),
                message: "QuotaReserved Pending".into()
            }
        );
        assert_eq!(plan.quota.message, "QuotaReserved Pending");
        assert_eq!(plan.workload_status, None);
    }

    #[test]
    fn an_admitted_workload_opens_the_job_to_its_flavors_proplets() {
        let w = admitted();
        assert_eq!(admitted_flavors(&w), vec!["pi-flavor".to_owned()]);
        let labels = BTreeMap::from([("arch".to_owned(), "arm64".to_owned())]);
        let plan = plan(
            &job(ExecutionMode::Parallel, 2),
            Some(&w),
            &labels,
            true,
            None,
            now(),
        );
        assert_eq!(
            plan.gate,
            Gate::Open {
                node_labels: labels
            }
        );
        assert!(plan.quota.status);
    }

    #[test]
    fn an_evicted_workload_gives_its_quota_back_once_no_run_is_out() {
        let mut w = admitted();
        if let Some(s) = w.status.as_mut() {
            s.conditions.push(cond(EVICTED, true, "Preempted"));
        }
        let j = job(ExecutionMode::Parallel, 2);
        let out = plan(&j, Some(&w), &BTreeMap::new(), true, None, now());
        assert!(matches!(&out.gate, Gate::Held { reason, .. } if reason == "Preempted"));
        assert_eq!(out.workload_status, None, "not while a run is out");

        let stopped = plan(&j, Some(&w), &BTreeMap::new(), false, None, now());
        let new = stopped.workload_status.unwrap_or_default();
        assert_eq!(new.admission, None);
        let c =
            |t: &str| condition(&new.conditions, t).map(|c| (c.status.clone(), c.reason.clone()));
        assert_eq!(c(REQUEUED), Some(("True".into(), "Preempted".into())));
        assert_eq!(c(QUOTA_RESERVED), Some(("False".into(), "Pending".into())));
        assert_eq!(c(ADMITTED), Some(("False".into(), "NoReservation".into())));

        // Given back: the job waits, still saying why it stopped.
        let mut after = w.clone();
        after.status = Some(new);
        let waiting = plan(&j, Some(&after), &BTreeMap::new(), false, None, now());
        assert_eq!(waiting.workload_status, None);
        assert!(matches!(&waiting.gate, Gate::Held { reason, .. } if reason == "Preempted"));
        assert!(!waiting.quota.status);
    }

    #[test]
    fn a_finished_job_marks_its_workload_finished_once() {
        let mut j = job(ExecutionMode::Parallel, 2);
        j.status = Some(PropellerJobStatus {
            phase: JobPhase::Failed,
            ..PropellerJobStatus::default()
        });
        let plan1 = plan(&j, Some(&admitted()), &BTreeMap::new(), false, None, now());
        let new = plan1.workload_status.unwrap_or_default();
        assert_eq!(
            condition(&new.conditions, FINISHED).map(|c| c.reason.as_str()),
            Some("Failed")
        );
        let mut done = admitted();
        done.status = Some(new);
        assert_eq!(
            plan(&j, Some(&done), &BTreeMap::new(), false, None, now()).workload_status,
            None
        );
    }

    #[test]
    fn memory_quantities_compare_by_size() {
        assert_eq!(quantity_bytes("1Ki"), Some(1024.0));
        assert_eq!(quantity_bytes("2G"), Some(2e9));
        assert_eq!(quantity_bytes("300"), Some(300.0));
        assert_eq!(quantity_bytes("lots"), None);
    }
}
