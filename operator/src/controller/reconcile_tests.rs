//! The shared reconciles on the in-memory [`FakeCluster`]: what each reads, writes, wakes and
//! notes, without an API server or a store.

use std::sync::Arc;

use chrono::Utc;
use propeller_broker::protocol::Heartbeat;
use propeller_broker::server::{BrokerEvent, EventKind};
use serde_json::json;

use crate::crd::job::PropellerJob;
use crate::crd::kueue::Workload;
use crate::crd::proplet::{Proplet, PropletPhase};
use crate::crd::task::{Task, TaskPhase};

use super::fake::FakeCluster;
use super::kinds::Reconciled;
use super::{retry_policy, CacheReads, Cluster, ObjectName, ReconcileError, Refusal, Retry, Wake};

const ADD_WASM: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags=";

fn proplet(name: &str) -> Proplet {
    serde_json::from_value(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
        "metadata": {"name": name, "namespace": "iot", "generation": 1},
        "spec": {"type": "external", "connectionConfig": {
            "mqttAddress": "tcp://127.0.0.1:1883", "domainId": "d1", "channelId": "c1",
            "clientId": name, "clientKey": "k"}}
    }))
    .unwrap()
}

fn task(name: &str, on: &str) -> Task {
    serde_json::from_value(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
        "metadata": {"name": name, "namespace": "iot", "generation": 1},
        "spec": {"name": name, "functionName": "add", "file": ADD_WASM, "inputs": [1, 2],
                 "propletSelector": {"propletId": on}}
    }))
    .unwrap()
}

fn heartbeat(cluster: &FakeCluster, client: &str) {
    let event = BrokerEvent {
        client_id: client.into(),
        domain: Some("d1".into()),
        channel: Some("c1".into()),
        kind: EventKind::Heartbeat(Heartbeat {
            proplet_id: client.into(),
            namespace: Some("iot".into()),
            metadata: None,
            metrics: None,
        }),
    };
    super::routing::route_event(cluster, &event);
}

#[tokio::test]
async fn a_heartbeat_makes_a_proplet_running_in_one_status_write() {
    let cluster = FakeCluster::start().await;
    let edge = cluster.put(&proplet("edge"));
    heartbeat(&cluster, "edge");
    assert_eq!(
        cluster.take_wakes(),
        vec![Wake::of::<Proplet>(ObjectName::new("iot", "edge"))],
        "the event wakes its Proplet and writes nothing"
    );
    Proplet::reconcile(&cluster, Arc::new(edge), Utc::now())
        .await
        .unwrap();
    let written: Proplet = cluster.stored(&ObjectName::new("iot", "edge")).unwrap();
    assert_eq!(written.status.unwrap().phase, PropletPhase::Running);
}

#[tokio::test]
async fn a_pending_task_is_assigned_and_its_start_waits_for_a_device_not_heard_from() {
    let cluster = FakeCluster::start().await;
    let edge = cluster.put(&proplet("edge"));
    heartbeat(&cluster, "edge");
    Proplet::reconcile(&cluster, Arc::new(edge), Utc::now())
        .await
        .unwrap();
    let add = cluster.put(&task("add", "edge"));
    let now = Utc::now();
    let next = Task::reconcile(&cluster, Arc::new(add), now).await.unwrap();
    let written: Task = cluster.stored(&ObjectName::new("iot", "add")).unwrap();
    let status = written.status.unwrap();
    assert_eq!(status.phase, TaskPhase::Scheduled);
    assert_eq!(status.assigned_proplet.as_deref(), Some("edge"));
    // The heartbeat reached this process, but the device has no session on the broker:
    // the start is held and the task looked at again shortly.
    assert!(next.is_some_and(|at| at > now), "{next:?}");
}

#[tokio::test]
async fn a_write_from_an_old_version_is_a_conflict_that_is_read_again() {
    let cluster = FakeCluster::start().await;
    let edge = cluster.put(&proplet("edge"));
    heartbeat(&cluster, "edge");
    // Someone else writes the Proplet after this reconcile's copy was read.
    cluster.put(&edge);
    let error = Proplet::reconcile(&cluster, Arc::new(edge), Utc::now())
        .await
        .unwrap_err();
    let refusal = error.refusal::<FakeCluster>();
    assert_eq!(refusal, Some(Refusal::Conflict));
    let name = ObjectName::new("iot", "edge");
    assert_eq!(
        retry_policy("Proplet", &name, &error, refusal),
        Retry::Reread
    );
    assert!(matches!(error, ReconcileError::Backend(_)));
}

#[tokio::test]
async fn a_finished_task_wakes_its_dependents_and_its_proplet() {
    let cluster = FakeCluster::start().await;
    cluster.put(&proplet("edge"));
    let mut first = task("first", "edge");
    first.status = Some(crate::crd::task::TaskStatus {
        phase: TaskPhase::Completed,
        assigned_proplet: Some("edge".into()),
        ..Default::default()
    });
    let first = cluster.put(&first);
    let mut second = task("second", "edge");
    second.spec.depends_on = vec!["first".into()];
    cluster.put(&second);
    super::task::wake_related(&cluster, &first);
    let mut wakes = cluster.take_wakes();
    wakes.sort();
    assert_eq!(
        wakes,
        vec![
            Wake::of::<Proplet>(ObjectName::new("iot", "edge")),
            Wake::of::<Task>(ObjectName::new("iot", "second")),
        ]
    );
}

#[tokio::test]
async fn a_propeller_job_creates_its_tasks_once_and_counts_them_in_its_status() {
    let cluster = FakeCluster::start().await;
    let job: PropellerJob = serde_json::from_value(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "PropellerJob",
        "metadata": {"name": "sum", "namespace": "iot", "generation": 1},
        "spec": {"name": "sum", "executionMode": "parallel", "tasks": [
            {"name": "a", "functionName": "add", "file": ADD_WASM, "inputs": [1, 2]},
            {"name": "b", "functionName": "add", "file": ADD_WASM, "inputs": [3, 4]}]}
    }))
    .unwrap();
    let job = cluster.put(&job);
    PropellerJob::reconcile(&cluster, Arc::new(job), Utc::now())
        .await
        .unwrap();
    let tasks: Vec<String> = cluster
        .tasks_in("iot")
        .iter()
        .map(|t| ObjectName::of(&**t).name)
        .collect();
    assert_eq!(tasks.len(), 2, "{tasks:?}");
    // Again, from the job as now stored: no task is created twice.
    let job: PropellerJob = cluster.stored(&ObjectName::new("iot", "sum")).unwrap();
    PropellerJob::reconcile(&cluster, Arc::new(job), Utc::now())
        .await
        .unwrap();
    assert_eq!(cluster.tasks_in("iot").len(), 2);
    let job: PropellerJob = cluster.stored(&ObjectName::new("iot", "sum")).unwrap();
    assert!(job.status.is_some(), "the job's status is written");
}

fn queued_job() -> PropellerJob {
    serde_json::from_value(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "PropellerJob",
        "metadata": {"name": "sum", "namespace": "iot", "generation": 1,
                     "labels": {"kueue.x-k8s.io/queue-name": "lq"}},
        "spec": {"name": "sum", "executionMode": "parallel", "tasks": [
            {"name": "a", "functionName": "add", "file": ADD_WASM, "inputs": [1, 2]},
            {"name": "b", "functionName": "add", "file": ADD_WASM, "inputs": [3, 4]}]}
    }))
    .unwrap()
}

async fn reconcile_job(cluster: &FakeCluster) -> PropellerJob {
    let job: PropellerJob = cluster.stored(&ObjectName::new("iot", "sum")).unwrap();
    PropellerJob::reconcile(cluster, Arc::new(job), Utc::now())
        .await
        .unwrap();
    cluster.stored(&ObjectName::new("iot", "sum")).unwrap()
}

fn condition_of(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    type_: &str,
) -> Option<(String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

/// Sets Workload `propellerjob-sum`'s status as Kueue would.
fn kueue_writes(cluster: &FakeCluster, status: serde_json::Value) {
    let name = ObjectName::new("iot", "propellerjob-sum");
    let mut workload: Workload = cluster.stored(&name).unwrap();
    workload.status = Some(serde_json::from_value(status).unwrap());
    cluster.put(&workload);
}

fn set_phases(cluster: &FakeCluster, phase: &str) {
    for task in cluster.tasks_in("iot") {
        let mut task = (*task).clone();
        task.status = Some(serde_json::from_value(json!({"phase": phase})).unwrap());
        cluster.put(&task);
    }
}

#[tokio::test]
async fn a_queued_job_waits_for_its_workload_runs_when_admitted_and_gives_quota_back() {
    let cluster = FakeCluster::start().await;
    cluster.put(&queued_job());

    // Without --kueue the label holds the job and says how to go on.
    let job = reconcile_job(&cluster).await;
    let conditions = job.status.unwrap().conditions;
    assert_eq!(
        condition_of(&conditions, "Suspended"),
        Some(("True".into(), "KueueDisabled".into()))
    );
    assert!(cluster.tasks_in("iot").is_empty());

    cluster
        .common()
        .kueue
        .store(true, std::sync::atomic::Ordering::Relaxed);
    reconcile_job(&cluster).await;
    let workload: Workload = cluster
        .stored(&ObjectName::new("iot", "propellerjob-sum"))
        .expect("the job's Workload");
    assert_eq!(workload.spec.queue_name.as_deref(), Some("lq"));
    assert!(
        cluster.tasks_in("iot").is_empty(),
        "nothing before admission"
    );

    let t = "2026-11-28T10:00:00Z";
    let admitted = json!({
        "conditions": [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "", "lastTransitionTime": t},
            {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "", "lastTransitionTime": t}],
        "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "tasks", "count": 2, "flavors": {}}]}
    });
    kueue_writes(&cluster, admitted.clone());
    reconcile_job(&cluster).await;
    assert_eq!(
        cluster.tasks_in("iot").len(),
        2,
        "admitted: the tasks exist"
    );
    set_phases(&cluster, "running");

    // Preempted while running: the tasks are held; the quota stays until they are stopped.
    let mut evicted = admitted.clone();
    evicted["conditions"].as_array_mut().unwrap().push(json!(
        {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "by a higher priority", "lastTransitionTime": t}));
    kueue_writes(&cluster, evicted);
    let job = reconcile_job(&cluster).await;
    assert_eq!(
        condition_of(&job.status.unwrap().conditions, "Suspended"),
        Some(("True".into(), "Preempted".into()))
    );
    assert!(cluster.tasks_in("iot").iter().all(|t| t.spec.suspend));
    let workload: Workload = cluster
        .stored(&ObjectName::new("iot", "propellerjob-sum"))
        .unwrap();
    assert!(
        workload.status.unwrap().admission.is_some(),
        "runs still out"
    );

    set_phases(&cluster, "pending");
    reconcile_job(&cluster).await;
    let given_back = cluster
        .stored::<Workload>(&ObjectName::new("iot", "propellerjob-sum"))
        .unwrap()
        .status
        .unwrap();
    assert_eq!(given_back.admission, None);
    assert_eq!(
        condition_of(&given_back.conditions, "QuotaReserved"),
        Some(("False".into(), "Pending".into()))
    );
}
