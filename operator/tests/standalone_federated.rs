//! Federated learning through the standalone driver and its store: a FederatedJob of two
//! rounds with two participants whose updates are known vectors; the stored models must be
//! FedAvg of them, and round two must start from round one's model.

use std::sync::Arc;
use std::time::Duration;

use propeller_broker::server::{BrokerConfig, CredentialStore, EmbeddedBroker};
use propeller_operator::decision::aggregation::{decode_vector, encode_json_f64, UpdateEnvelope};
use propeller_operator::decision::federated::{model_of, GLOBAL_MODEL_ANNOTATION};
use propeller_operator::decision::proplet::PropletSettings;
use propeller_operator::decision::scheduler::Strategy;
use propeller_operator::decision::task::TaskSettings;
use propeller_operator::metrics::ControllerMetrics;
use propeller_operator::standalone::driver::{Driver, StandaloneSettings};
use propeller_operator::standalone::store::ObjectStore;
use propeller_operator::validation::Admission;
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

async fn until<T>(what: &str, mut probe: impl FnMut() -> Option<T>) -> T {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn envelope(client: &str, round: u64, values: &[f64], samples: u64) -> Value {
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
    .unwrap_or(Value::Null)
}

#[tokio::test]
async fn two_rounds_of_fedavg_through_the_standalone_driver() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = ObjectStore::open(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    let mut broker =
        EmbeddedBroker::start(BrokerConfig::loopback(), Arc::new(CredentialStore::new()))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    let events = broker.take_events().unwrap_or_else(|| panic!("events"));
    let settings = StandaloneSettings {
        proplet: PropletSettings {
            last_seen_threshold: Duration::from_secs(30),
            status_flush_interval: Duration::from_secs(5),
            routine_writes_per_second: 20,
        },
        task: TaskSettings {
            strategy: Strategy::RoundRobin,
            default_timeout: Duration::from_secs(3600),
            running_write_delay: Duration::from_secs(1),
            finalizer: Default::default(),
        },
        sweep: Duration::from_secs(10),
        logs: Default::default(),
    };
    let (driver, queue) = Driver::new(
        store.clone(),
        broker.publisher(),
        settings,
        Arc::new(CredentialStore::new()),
        Arc::new(ControllerMetrics::default()),
        Arc::new(propeller_operator::standalone::events::EventLog::new()),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(driver.clone().run(queue, events, async {
        let _ = stop_rx.await;
    }));

    let job = json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "FederatedJob",
        "metadata": {"name": "mnist", "namespace": "default"},
        "spec": {"experimentId": "mnist", "taskWasmImage": "http://example.invalid/train.wasm",
                 "participants": [{"propletId": "pi-a"}, {"propletId": "pi-b"}],
                 "rounds": {"total": 2}, "kOfN": 2, "aggregator": {"algorithm": "fedavg"}}
    });
    let admitted = Admission::new()
        .admit(&job, None)
        .unwrap_or_else(|e| panic!("{e}"));
    store.apply(admitted).unwrap_or_else(|e| panic!("{e}"));

    // Each round: wait for its two participant tasks, report known updates as their results.
    let updates = [
        [("pi-a", [1.0, 2.0], 1u64), ("pi-b", [3.0, 6.0], 3u64)],
        [("pi-a", [0.0, 0.0], 2u64), ("pi-b", [4.0, 8.0], 2u64)],
    ];
    let mut models = Vec::new();
    for (round, participants) in updates.iter().enumerate() {
        let n = round as u64 + 1;
        let round_obj = until(&format!("round {n}"), || {
            store
                .list("TrainingRound", Some("default"))
                .ok()?
                .into_iter()
                .find(|r| r["spec"]["roundId"] == format!("round-{n}"))
        })
        .await;
        if n == 2 {
            // Round two starts from round one's aggregated model.
            let handed = round_obj["metadata"]["annotations"][GLOBAL_MODEL_ANNOTATION]
                .as_str()
                .unwrap_or_default();
            let model: UpdateEnvelope =
                serde_json::from_str(handed).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(decode_vector(&model).unwrap_or_default(), vec![2.5, 5.0]);
        }
        let round_name = round_obj["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        for (client, values, samples) in participants {
            let task = until(&format!("task of {client} in round {n}"), || {
                store
                    .list("Task", Some("default"))
                    .ok()?
                    .into_iter()
                    .find(|t| {
                        t["spec"]["env"]["ROUND_ID"] == format!("round-{n}")
                            && t["spec"]["propletSelector"]["propletId"] == *client
                    })
            })
            .await;
            let name = task["metadata"]["name"].as_str().unwrap_or_default();
            store
                .write_status(
                    "Task",
                    "default",
                    name,
                    json!({"phase": "completed", "results": envelope(client, n, values, *samples)}),
                    None,
                )
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let model = until(&format!("model of round {n}"), || {
            let cm = store
                .get_typed::<k8s_openapi::api::core::v1::ConfigMap>(
                    "ConfigMap",
                    "default",
                    &format!("{round_name}-model"),
                )
                .ok()??;
            model_of(&cm)
        })
        .await;
        models.push(decode_vector(&model).unwrap_or_default());
    }
    // FedAvg by samples: round 1 (1·[1,2] + 3·[3,6]) / 4 = [2.5, 5]; round 2 (2·[0,0] + 2·[4,8]) / 4 = [2, 4].
    assert_eq!(models, vec![vec![2.5, 5.0], vec![2.0, 4.0]]);
    until("the job completed", || {
        let job = store.get("FederatedJob", "default", "mnist").ok()??;
        (job["status"]["phase"] == "Completed").then_some(())
    })
    .await;
    let _ = stop_tx.send(());
    running.await.unwrap_or_else(|e| panic!("{e}"));
    broker.shutdown();
}
