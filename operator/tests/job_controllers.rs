//! The PropellerJob, FederatedJob and TrainingRound executors against kube-rs's mocked API:
//! which children they create (bodies, owners), which model they persist, and which status
//! they write.

mod common;

use std::sync::Arc;

use common::{FakeApi, Harness, Sent};
use http::Method;
use kube::runtime::watcher;
use propeller_operator::controller::runner::reconcile;
use propeller_operator::crd::federated::{FederatedJob, TrainingRound};
use propeller_operator::crd::job::PropellerJob;
use propeller_operator::crd::task::Task;
use propeller_operator::decision::aggregation::{decode_vector, encode_json_f64, UpdateEnvelope};
use propeller_operator::decision::federated::MODEL_KEY;
use serde_json::{json, Value};

const API: &str = "/apis/propeller.propeller.absmach.eu/v1/namespaces/lab";

fn posts<'a>(sent: &'a [Sent], collection: &str) -> Vec<&'a Sent> {
    sent.iter()
        .filter(|s| s.method == Method::POST && s.path.ends_with(collection))
        .collect()
}

fn status_patch<'a>(sent: &'a [Sent], path: &str) -> &'a Value {
    &sent
        .iter()
        .find(|s| s.method == Method::PATCH && s.path == format!("{path}/status"))
        .unwrap_or_else(|| panic!("no status patch of {path} in {sent:#?}"))
        .body
}

fn task_with(name: &str, owner_uid: &str, phase: &str, results: Value) -> Task {
    serde_json::from_value(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Task",
        "metadata": {"name": name, "namespace": "lab", "uid": format!("uid-{name}"),
                     "ownerReferences": [{"apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "X",
                                          "name": "owner", "uid": owner_uid, "controller": true}]},
        "spec": {"name": name, "imageUrl": "http://example.invalid/m.wasm"},
        "status": {"phase": phase, "results": results}
    }))
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn a_propeller_job_creates_owned_tasks_then_completes_with_them() {
    let job_json = json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "PropellerJob",
        "metadata": {"name": "pipeline", "namespace": "lab", "uid": "job-uid", "generation": 1, "resourceVersion": "1"},
        "spec": {"name": "pipeline", "executionMode": "configurable", "tasks": [
            {"name": "first", "functionName": "add", "imageUrl": "http://example.invalid/a.wasm", "inputs": [1, 2]},
            {"name": "second", "functionName": "add", "imageUrl": "http://example.invalid/a.wasm", "dependsOn": ["first"]}
        ]}
    });
    let job_path = format!("{API}/propellerjobs/pipeline");
    let (client, api) = FakeApi::start(vec![(job_path.clone(), job_json.clone())]);
    let job: PropellerJob = serde_json::from_value(job_json).unwrap_or_else(|e| panic!("{e}"));
    let mut h = Harness::start(client, vec![], vec![]).await;

    reconcile::<PropellerJob, _>(Arc::new(job.clone()), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sent = api.take();
    let created = posts(&sent, "/tasks");
    assert_eq!(created.len(), 2, "{sent:#?}");
    for child in &created {
        assert_eq!(
            child.body["metadata"]["ownerReferences"][0]["uid"],
            "job-uid"
        );
        assert_eq!(
            child.body["metadata"]["ownerReferences"][0]["controller"],
            true
        );
        assert_eq!(child.body["spec"]["jobId"], "job-uid");
    }
    let second = created
        .iter()
        .find(|c| {
            c.body["spec"]["dependsOn"]
                .as_array()
                .is_some_and(|d| !d.is_empty())
        })
        .unwrap_or_else(|| panic!("the dependent child"));
    let first_name = second.body["spec"]["dependsOn"][0]
        .as_str()
        .unwrap_or_default();
    assert!(created
        .iter()
        .any(|c| c.body["metadata"]["name"] == first_name));
    assert_eq!(status_patch(&sent, &job_path)["status"]["phase"], "Running");

    // A retried reconcile before the cache saw the children creates nothing new for good:
    // the server answers AlreadyExists and the executor treats that as done.
    reconcile::<PropellerJob, _>(Arc::new(job.clone()), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let retry = api.take();
    let names = |sent: &[&Sent]| -> Vec<Value> {
        sent.iter()
            .map(|s| s.body["metadata"]["name"].clone())
            .collect()
    };
    assert_eq!(names(&posts(&retry, "/tasks")), names(&created));

    // Both children completed: the job completes.
    for c in &created {
        let name = c.body["metadata"]["name"].as_str().unwrap_or_default();
        h.tasks
            .apply_watcher_event(&watcher::Event::Apply(task_with(
                name,
                "job-uid",
                "completed",
                json!("3"),
            )));
    }
    let current: PropellerJob = api.object(&job_path);
    reconcile::<PropellerJob, _>(Arc::new(current), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sent = api.take();
    assert!(posts(&sent, "/tasks").is_empty());
    assert_eq!(
        status_patch(&sent, &job_path)["status"]["phase"],
        "Completed"
    );
}

fn update(client: &str, round: u64, values: &[f64], samples: u64) -> Value {
    serde_json::to_value(UpdateEnvelope {
        task_id: String::new(),
        job_id: "mnist".into(),
        round_id: round,
        global_version: String::new(),
        proplet_id: client.into(),
        num_samples: samples,
        update_b64: encode_json_f64(values),
        metrics: None,
        format: None,
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn a_federated_job_starts_round_one_and_the_round_aggregates_and_stores_the_model() {
    let fed_json = json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "FederatedJob",
        "metadata": {"name": "mnist", "namespace": "lab", "uid": "fed-uid", "generation": 1, "resourceVersion": "1"},
        "spec": {"experimentId": "mnist", "taskWasmImage": "http://example.invalid/train.wasm",
                 "participants": [{"propletId": "pi-a"}, {"propletId": "pi-b"}],
                 "rounds": {"total": 2}, "kOfN": 2, "aggregator": {"algorithm": "fedavg"}}
    });
    let fed_path = format!("{API}/federatedjobs/mnist");
    let (client, api) = FakeApi::start(vec![(fed_path.clone(), fed_json.clone())]);
    let fed: FederatedJob = serde_json::from_value(fed_json).unwrap_or_else(|e| panic!("{e}"));
    let mut h = Harness::start(client, vec![], vec![]).await;

    // The job lists its rounds (none) and creates round 1, owned by the job.
    reconcile::<FederatedJob, _>(Arc::new(fed), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sent = api.take();
    assert!(sent
        .iter()
        .any(|s| s.method == Method::GET && s.path == format!("{API}/trainingrounds")));
    let rounds = posts(&sent, "/trainingrounds");
    assert_eq!(rounds.len(), 1);
    let round_body = rounds[0].body.clone();
    assert_eq!(round_body["spec"]["roundId"], "round-1");
    assert_eq!(round_body["spec"]["kOfN"], 2);
    assert_eq!(
        round_body["metadata"]["ownerReferences"][0]["uid"],
        "fed-uid"
    );
    let fed_status = &status_patch(&sent, &fed_path)["status"];
    assert_eq!(fed_status["phase"], "Running");
    assert_eq!(fed_status["currentRound"], 1);

    // The round creates one federated Task per participant.
    let round_name = round_body["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let round_path = format!("{API}/trainingrounds/{round_name}");
    let round: TrainingRound = api.object(&round_path);
    reconcile::<TrainingRound, _>(Arc::new(round.clone()), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sent = api.take();
    let tasks = posts(&sent, "/tasks");
    assert_eq!(tasks.len(), 2);
    for t in &tasks {
        assert_eq!(t.body["spec"]["kind"], "federated");
        assert_eq!(t.body["spec"]["env"]["ROUND_ID"], "round-1");
        assert_eq!(t.body["spec"]["env"]["FL_JOB_ID"], "mnist");
        assert_eq!(
            t.body["metadata"]["ownerReferences"][0]["kind"],
            "TrainingRound"
        );
    }
    assert_eq!(
        status_patch(&sent, &round_path)["status"]["phase"],
        "Running"
    );

    // Both participants completed with updates: the model is aggregated and stored in a
    // ConfigMap owned by the round.
    let round_uid = round.metadata.uid.clone().unwrap_or_default();
    for (t, (client, values, samples)) in tasks
        .iter()
        .zip([("pi-a", [1.0, 2.0], 1u64), ("pi-b", [3.0, 6.0], 3u64)])
    {
        let name = t.body["metadata"]["name"].as_str().unwrap_or_default();
        h.tasks
            .apply_watcher_event(&watcher::Event::Apply(task_with(
                name,
                &round_uid,
                "completed",
                update(client, 1, &values, samples),
            )));
    }
    let round: TrainingRound = api.object(&round_path);
    reconcile::<TrainingRound, _>(Arc::new(round), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sent = api.take();
    let stored = posts(&sent, "/configmaps");
    assert_eq!(stored.len(), 1);
    let cm = &stored[0].body;
    assert_eq!(cm["metadata"]["ownerReferences"][0]["uid"], round_uid);
    let encoded = cm["binaryData"][MODEL_KEY].as_str().unwrap_or_default();
    use base64::Engine;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .unwrap_or_else(|e| panic!("{e}"));
    let model: UpdateEnvelope = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}"));
    // FedAvg weighted by samples: (1·[1,2] + 3·[3,6]) / 4 = [2.5, 5].
    assert_eq!(
        decode_vector(&model).unwrap_or_else(|e| panic!("{e}")),
        vec![2.5, 5.0]
    );
    assert_eq!(model.num_samples, 4);
    assert_eq!(
        status_patch(&sent, &round_path)["status"]["phase"],
        "Aggregating"
    );

    // With the model stored, the round completes and names it.
    let round: TrainingRound = api.object(&round_path);
    reconcile::<TrainingRound, _>(Arc::new(round), h.shared.clone())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let sent = api.take();
    let done = &status_patch(&sent, &round_path)["status"];
    assert_eq!(done["phase"], "Completed");
    assert!(done["aggregatedModelRef"]
        .as_str()
        .is_some_and(|r| r.ends_with("-model")));
}
