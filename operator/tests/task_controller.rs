//! The Proplet and Task reconcilers driven by a real device over MQTT (our embedded broker and
//! a rumqttc client on 127.0.0.1) against kube-rs's mocked API (tower-test): heartbeat →
//! proplet Running, start published once, result → completed status patch.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{FakeApi, Sent};
use http::Method;
use kube::runtime::watcher;
use propeller_broker::server::{BrokerEvent, Credential, EventKind};
use propeller_operator::controller::runner::reconcile;
use propeller_operator::controller::CacheReads;
use propeller_operator::controller::ObjectName;
use propeller_operator::crd::proplet::Proplet;
use propeller_operator::crd::task::Task;
use propeller_operator::k8s::runtime::{count_phases, route_event};
use propeller_operator::metrics::PhaseLabels;
use rumqttc::{AsyncClient, Event, EventLoop, MqttOptions, Packet, QoS};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

const WAIT: Duration = Duration::from_secs(10);
const ADD_WASM: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags=";

const PROPLET_PATH: &str = "/apis/propeller.propeller.absmach.eu/v1/namespaces/iot/proplets/edge";
const TASK_PATH: &str = "/apis/propeller.propeller.absmach.eu/v1/namespaces/iot/tasks/add";

fn proplet_json() -> Value {
    json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Proplet",
        "metadata": {"name": "edge", "namespace": "iot", "uid": "p-uid", "generation": 1, "resourceVersion": "1"},
        "spec": {
            "type": "external",
            "connectionConfig": {"mqttAddress": "tcp://127.0.0.1:1883", "domainId": "d1", "channelId": "c1", "clientId": "edge", "clientKey": "edge-key"}
        }
    })
}

fn task_json() -> Value {
    json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Task",
        "metadata": {"name": "add", "namespace": "iot", "uid": "task-uid-1", "generation": 1, "resourceVersion": "1"},
        "spec": {"name": "add", "functionName": "add", "file": ADD_WASM, "inputs": [10, 32],
                 "propletSelector": {"propletId": "edge"}}
    })
}

fn paths(sent: &[Sent]) -> Vec<(String, String)> {
    sent.iter()
        .map(|s| (s.method.to_string(), s.path.clone()))
        .collect()
}

struct Device {
    client: AsyncClient,
    eventloop: EventLoop,
}

impl Device {
    async fn connect(port: u16) -> Self {
        Self::connect_to(port, "m/d1/c/c1/control/manager/start").await
    }

    /// Connects as `edge` and subscribes to `topic`.
    async fn connect_to(port: u16, topic: &str) -> Self {
        let mut opts = MqttOptions::new("edge", "127.0.0.1", port);
        opts.set_credentials("edge", "edge-key");
        opts.set_keep_alive(Duration::from_secs(5));
        let (client, mut eventloop) = AsyncClient::new(opts, 16);
        client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
        let until_subscribed = async {
            loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::SubAck(_))) => return,
                    Ok(_) => {}
                    Err(e) => panic!("device connection failed: {e}"),
                }
            }
        };
        tokio::time::timeout(WAIT, until_subscribed).await.unwrap();
        Self { client, eventloop }
    }

    async fn publish(&mut self, path: &str, payload: Value) {
        self.client
            .publish(
                format!("m/d1/c/c1/{path}"),
                QoS::AtLeastOnce,
                false,
                payload.to_string(),
            )
            .await
            .unwrap();
        let until_acked = async {
            loop {
                if let Ok(Event::Incoming(Packet::PubAck(_))) = self.eventloop.poll().await {
                    return;
                }
            }
        };
        tokio::time::timeout(WAIT, until_acked).await.unwrap();
    }

    /// Messages received on the subscribed topic within `within`.
    async fn starts(&mut self, within: Duration) -> Vec<Value> {
        let mut got = Vec::new();
        let deadline = tokio::time::Instant::now() + within;
        while let Ok(polled) = tokio::time::timeout_at(deadline, self.eventloop.poll()).await {
            if let Ok(Event::Incoming(Packet::Publish(p))) = polled {
                got.push(serde_json::from_slice(&p.payload).unwrap());
            }
        }
        got
    }
}

async fn next_event(events: &mut UnboundedReceiver<BrokerEvent>) -> BrokerEvent {
    tokio::time::timeout(WAIT, events.recv())
        .await
        .expect("no broker event in time")
        .expect("event stream closed")
}

#[tokio::test]
async fn heartbeat_start_and_result_drive_proplet_and_task_through_the_api() {
    let (client, api) = FakeApi::start(vec![
        (PROPLET_PATH.into(), proplet_json()),
        (TASK_PATH.into(), task_json()),
    ]);
    let proplet: Proplet = serde_json::from_value(proplet_json()).unwrap();
    let task: Task = serde_json::from_value(task_json()).unwrap();
    let common::Harness {
        shared,
        wakes,
        proplets: mut proplet_writer,
        tasks: mut task_writer,
        mut broker,
        logins,
    } = common::Harness::start(client, vec![proplet.clone()], vec![task.clone()]).await;
    logins.insert("edge", Credential::proplet("edge-key"));
    let mut events = broker.take_events().unwrap();
    let port = broker.tcp_addr().unwrap().port();
    let (mut task_rx, mut proplet_rx) = (wakes.tasks, wakes.proplets);

    // 1. The device heartbeats; the event names its Proplet, and nothing was written yet.
    let mut device = Device::connect(port).await;
    device
        .publish(
            "control/proplet/alive",
            json!({"status": "alive", "proplet_id": "edge", "namespace": "iot"}),
        )
        .await;
    loop {
        let event = next_event(&mut events).await;
        let heartbeat = matches!(event.kind, EventKind::Heartbeat(_));
        route_event(&event, &shared);
        if heartbeat {
            break;
        }
    }
    assert_eq!(
        proplet_rx.try_recv().ok(),
        Some(ObjectName::new("iot", "edge"))
    );
    assert!(api.take().is_empty(), "the MQTT path must not call the API");

    // 2. The Proplet reconcile adds its finalizer and writes Running.
    reconcile::<Proplet, _>(Arc::new(proplet), shared.clone())
        .await
        .unwrap();
    let sent = api.take();
    let patches: Vec<&Sent> = sent.iter().filter(|s| s.method == Method::PATCH).collect();
    assert_eq!(patches[0].path, PROPLET_PATH);
    assert_eq!(
        patches[0].body["metadata"]["finalizers"],
        json!(["propeller.propeller.absmach.eu/proplet-cleanup"])
    );
    assert_eq!(patches[1].path, format!("{PROPLET_PATH}/status"));
    assert_eq!(patches[1].body["status"]["phase"], "Running");
    assert_eq!(patches[1].body["status"]["alive"], true);
    // The pending task is triggered because a proplet became Running.
    assert_eq!(task_rx.try_recv().ok(), Some(ObjectName::new("iot", "add")));
    let running: Proplet = api.object(PROPLET_PATH);
    proplet_writer.apply_watcher_event(&watcher::Event::Apply(running));

    // 3. The Task reconcile: finalizer, conditional `scheduled` write, one start. `running`
    //    waits for the running-write delay: a quick result makes it unnecessary.
    reconcile::<Task, _>(Arc::new(task), shared.clone())
        .await
        .unwrap();
    let sent = api.take();
    let task_patches: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.method == Method::PATCH && s.path.starts_with(TASK_PATH))
        .collect();
    assert_eq!(
        paths(
            &task_patches
                .iter()
                .map(|s| (*s).clone())
                .collect::<Vec<_>>()
        ),
        vec![
            ("PATCH".to_owned(), TASK_PATH.to_owned()),
            ("PATCH".to_owned(), format!("{TASK_PATH}/status")),
        ]
    );
    assert_eq!(
        task_patches[0].body["metadata"]["finalizers"],
        json!(["propeller.propeller.absmach.eu/task-stop"])
    );
    let scheduled = &task_patches[1].body;
    // Conditional on the version the finalizer write returned, not the stale one.
    let version = scheduled["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or_default();
    assert!(!version.is_empty() && version != "1", "{version}");
    assert_eq!(scheduled["status"]["phase"], "scheduled");
    assert_eq!(scheduled["status"]["assignedProplet"], "edge");
    assert_eq!(scheduled["status"]["runCount"], 1);
    assert!(
        !sent
            .iter()
            .any(|s| s.method == Method::POST && s.path.ends_with("/events")),
        "scheduling records its condition, not an Event"
    );
    let starts = device.starts(Duration::from_millis(500)).await;
    assert_eq!(starts.len(), 1, "{starts:?}");
    assert_eq!(starts[0]["id"], "task-uid-1");
    assert_eq!(starts[0]["proplet_id"], "edge");
    assert_eq!(starts[0]["name"], "add");
    assert_eq!(starts[0]["inputs"], json!(["10", "32"]));
    assert_eq!(starts[0]["env"]["TASK_ID"], "task-uid-1");

    // 4. Another reconcile of the same run before the delay is over (the watch echoing the
    //    write) publishes nothing and writes nothing.
    let scheduled_task: Task = api.object(TASK_PATH);
    reconcile::<Task, _>(Arc::new(scheduled_task), shared.clone())
        .await
        .unwrap();
    let retried = api.take();
    assert!(
        !retried.iter().any(|s| s.method == Method::PATCH),
        "{retried:?}"
    );
    assert!(device.starts(Duration::from_millis(500)).await.is_empty());

    // 5. The device's result is queued, wakes the task, and completes it.
    let current: Task = api.object(TASK_PATH);
    task_writer.apply_watcher_event(&watcher::Event::Apply(current.clone()));
    count_phases(&shared);
    let gauge = |family: &prometheus_client::metrics::family::Family<
        PhaseLabels,
        prometheus_client::metrics::gauge::Gauge,
    >,
                 phase: &str| {
        family
            .get_or_create(&PhaseLabels {
                phase: phase.into(),
            })
            .get()
    };
    assert_eq!(gauge(&shared.common.metrics.tasks, "scheduled"), 1);
    assert_eq!(gauge(&shared.common.metrics.tasks, "pending"), 0);
    assert_eq!(gauge(&shared.common.metrics.proplets, "Running"), 1);
    device
        .publish(
            "control/proplet/results",
            json!({"task_id": "task-uid-1", "proplet_id": "edge", "results": "42", "error": null}),
        )
        .await;
    loop {
        let event = next_event(&mut events).await;
        let result = matches!(event.kind, EventKind::Result(_));
        route_event(&event, &shared);
        if result {
            break;
        }
    }
    while let Ok(r) = task_rx.try_recv() {
        assert_eq!(r, ObjectName::new("iot", "add"));
    }
    assert!(api.take().is_empty(), "the MQTT path must not call the API");
    assert_eq!(shared.common.state.inbox.waiting_tasks(), 1);
    reconcile::<Task, _>(Arc::new(current), shared.clone())
        .await
        .unwrap();
    let sent = api.take();
    let status_writes: Vec<&Sent> = sent
        .iter()
        .filter(|s| s.path == format!("{TASK_PATH}/status"))
        .collect();
    assert_eq!(
        status_writes.len(),
        1,
        "one write from scheduled to completed"
    );
    let done = status_writes[0];
    assert_eq!(done.body["status"]["phase"], "completed");
    assert!(done.body["status"]["startedAt"].is_string());
    assert_eq!(done.body["status"]["results"], "42");
    assert!(done.body["status"]["finishedAt"].is_string());
    assert_eq!(
        shared.common.state.inbox.waiting_tasks(),
        0,
        "the written result is consumed"
    );
    assert!(shared.common.metrics.reconciles("task", true) >= 3);
    let _ = done.query.len();
    broker.shutdown();
}

#[tokio::test]
async fn deleting_a_running_task_stops_it_on_its_proplet_then_releases_the_finalizer() {
    let mut task = task_json();
    task["metadata"]["finalizers"] = json!(["propeller.propeller.absmach.eu/task-stop"]);
    task["metadata"]["deletionTimestamp"] = json!("2026-11-22T10:00:00Z");
    task["status"] = json!({"phase": "running", "assignedProplet": "edge", "runCount": 1});
    let mut proplet = proplet_json();
    proplet["status"] = json!({"phase": "Running"});
    let (client, api) = FakeApi::start(vec![(TASK_PATH.into(), task.clone())]);
    let task: Task = serde_json::from_value(task).unwrap();
    let proplet: Proplet = serde_json::from_value(proplet).unwrap();
    let h = common::Harness::start(client, vec![proplet], vec![task.clone()]).await;
    h.logins.insert("edge", Credential::proplet("edge-key"));
    let port = h.broker.tcp_addr().unwrap().port();
    let mut device = Device::connect_to(port, "m/d1/c/c1/control/manager/stop").await;

    reconcile::<Task, _>(Arc::new(task), h.shared.clone())
        .await
        .unwrap();
    let sent = api.take();
    let status = sent
        .iter()
        .find(|s| s.path == format!("{TASK_PATH}/status"))
        .expect("a status patch");
    assert_eq!(status.body["status"]["phase"], "interrupted");
    let release = sent
        .iter()
        .rev()
        .find(|s| s.path == TASK_PATH)
        .expect("a finalizer patch");
    assert_eq!(release.body["metadata"]["finalizers"], json!([]));
    let stops = device.starts(Duration::from_millis(500)).await;
    assert_eq!(stops.len(), 1, "{stops:?}");
    assert_eq!(stops[0]["id"], "task-uid-1");
    assert_eq!(stops[0]["proplet_id"], "edge");
}

#[tokio::test]
async fn a_task_for_a_k8s_proplet_creates_its_config_map_and_job_after_the_assignment() {
    let mut task = task_json();
    task["spec"] = json!({"name": "add", "imageUrl": "registry.local/add:1", "inputs": [10, 32],
                          "propletSelector": {"propletId": "cluster"}});
    let proplet = json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1", "kind": "Proplet",
        "metadata": {"name": "cluster", "namespace": "iot", "uid": "c-uid"},
        "spec": {"type": "k8s", "k8s": {"image": "proplet:1"},
                 "connectionConfig": {"mqttAddress": "tcp://propeller:1883", "domainId": "d1", "channelId": "c1", "clientId": "cluster", "clientKey": "k"}},
        "status": {"phase": "Running"}
    });
    let (client, api) = FakeApi::start(vec![(TASK_PATH.into(), task.clone())]);
    let task: Task = serde_json::from_value(task).unwrap();
    let proplet: Proplet = serde_json::from_value(proplet).unwrap();
    let h = common::Harness::start(client, vec![proplet], vec![task.clone()]).await;

    reconcile::<Task, _>(Arc::new(task), h.shared.clone())
        .await
        .unwrap();
    let sent = api.take();
    let order: Vec<String> = sent
        .iter()
        .filter(|s| !s.path.contains("/events"))
        .map(|s| {
            format!(
                "{} {}",
                s.method,
                s.path.rsplit('/').take(2).collect::<Vec<_>>().join("<")
            )
        })
        .collect();
    assert_eq!(
        order,
        vec![
            "PATCH add<tasks",
            "PATCH status<add",
            "POST configmaps<iot",
            "POST jobs<iot",
        ],
        "running is written once the Job is seen, by the reconcile its watch event starts"
    );
    let job = sent
        .iter()
        .find(|s| s.path.ends_with("/jobs"))
        .expect("a Job");
    assert_eq!(job.body["metadata"]["name"], "add-job");
    assert_eq!(
        job.body["metadata"]["ownerReferences"][0]["uid"],
        "task-uid-1"
    );
    assert_eq!(
        job.body["spec"]["template"]["spec"]["containers"][0]["image"],
        "registry.local/add:1"
    );
    let config = sent
        .iter()
        .find(|s| s.path.ends_with("/configmaps"))
        .expect("a ConfigMap");
    assert_eq!(config.body["metadata"]["name"], "add-config");
    assert_eq!(config.body["data"]["INPUTS"], "10,32");
}

#[tokio::test]
async fn an_fl_update_naming_its_task_waits_in_the_inbox_as_that_tasks_result() {
    use propeller_broker::protocol::{FlUpdate, FlUpdateMessage, TopicSegment};
    let (client, api) = FakeApi::start(vec![]);
    let task: Task = serde_json::from_value(task_json()).unwrap();
    let h = common::Harness::start(client, vec![], vec![task]).await;
    let mut wakes = h.wakes;
    let update = FlUpdateMessage {
        round_id: TopicSegment::new("round-1", "round").unwrap(),
        proplet_id: TopicSegment::new("edge", "proplet").unwrap(),
        envelope: FlUpdate {
            task_id: Some("task-uid-1".into()),
            job_id: Some("mnist".into()),
            num_samples: Some(3),
            update_b64: Some(b"[1.0]".to_vec()),
            ..FlUpdate::default()
        },
    };
    let event = BrokerEvent {
        client_id: "edge".into(),
        domain: Some("d1".into()),
        channel: Some("c1".into()),
        kind: EventKind::FlUpdate(Box::new(update)),
    };
    route_event(&event, &h.shared);
    let (results, _) = h.shared.common.state.inbox.peek("task-uid-1");
    assert_eq!(results.len(), 1);
    assert_eq!(results[0].client_id, "edge");
    assert_eq!(results[0].value["job_id"], "mnist");
    assert_eq!(results[0].value["num_samples"], 3);
    assert_eq!(
        wakes.tasks.try_recv().ok(),
        Some(ObjectName::new("iot", "add"))
    );
    assert!(api.take().is_empty(), "the MQTT path must not call the API");
}

/// The liveness tick wakes only the Running proplets past their heartbeat deadline:
/// reconciling the whole fleet on every tick queued each proplet's own deadline requeue
/// behind thousands of reconciles.
#[tokio::test]
async fn liveness_tick_wakes_only_running_proplets_past_their_deadline() {
    use propeller_broker::protocol::Heartbeat;
    use propeller_operator::k8s::runtime::wake_overdue;
    let now = chrono::Utc::now();
    let seconds_ago = |s: i64| (now - chrono::Duration::seconds(s)).to_rfc3339();
    let proplet = |name: &str, phase: &str, last_seen: String| -> Proplet {
        let mut v = proplet_json();
        v["metadata"]["name"] = json!(name);
        v["metadata"]["uid"] = json!(format!("{name}-uid"));
        v["spec"]["connectionConfig"]["clientId"] = json!(name);
        v["status"] = json!({"phase": phase, "lastSeen": last_seen});
        serde_json::from_value(v).unwrap()
    };
    let (client, api) = FakeApi::start(vec![]);
    let proplets = vec![
        proplet("silent", "Running", seconds_ago(31)),
        proplet("fresh", "Running", seconds_ago(5)),
        proplet("already-offline", "Offline", seconds_ago(300)),
        // Its status is old, but a heartbeat arrived since (pending, not yet written).
        proplet("beating", "Running", seconds_ago(40)),
    ];
    let h = common::Harness::start(client, proplets, vec![]).await;
    let mut wakes = h.wakes;
    h.shared.common.state.liveness.record(
        &BrokerEvent {
            client_id: "beating".into(),
            domain: Some("d1".into()),
            channel: Some("c1".into()),
            kind: EventKind::Heartbeat(Heartbeat {
                proplet_id: "beating".into(),
                namespace: Some("iot".into()),
                metadata: None,
                metrics: None,
            }),
        },
        now - chrono::Duration::seconds(2),
    );

    assert_eq!(wake_overdue(&h.shared, now), 1);
    assert_eq!(
        wakes.proplets.try_recv().ok(),
        Some(ObjectName::new("iot", "silent"))
    );
    assert!(wakes.proplets.try_recv().is_err());
    // 25 s on, the fresh one is past its deadline too; the beating one is not yet.
    assert_eq!(
        wake_overdue(&h.shared, now + chrono::Duration::seconds(26)),
        2
    );
    assert!(api.take().is_empty(), "the tick must not call the API");
}

/// A task selecting a label is placed on a proplet carrying it among many that do not: it
/// waits while none carries it, and finds one relabelled by the watch on its next
/// reconcile. The placement reads the label index, which follows the watch: it gives the
/// labelled proplet alone, not the namespace's 51.
#[tokio::test]
async fn a_task_selecting_a_label_is_placed_on_the_proplet_the_watch_labelled() {
    let running = |name: &str, labels: Value| -> Proplet {
        let mut p = proplet_json();
        p["metadata"]["name"] = json!(name);
        p["metadata"]["labels"] = labels;
        p["spec"]["connectionConfig"]["clientId"] = json!(name);
        p["status"] = json!({"phase": "Running", "alive": true});
        serde_json::from_value(p).unwrap()
    };
    let mut proplets: Vec<Proplet> = (0..50)
        .map(|i| running(&format!("sim-{i}"), json!({"fleet": "sim"})))
        .collect();
    proplets.push(running("edge", json!({"role": "spare"})));
    let mut task = task_json();
    task["spec"]["propletSelector"] = json!({"matchLabels": {"role": "worker"}});
    let (client, api) = FakeApi::start(vec![(TASK_PATH.into(), task.clone())]);
    let task: Task = serde_json::from_value(task).unwrap();
    let mut h = common::Harness::start(client, proplets, vec![task.clone()]).await;
    let assigned = |sent: &[Sent]| {
        sent.iter()
            .filter(|s| s.path == format!("{TASK_PATH}/status"))
            .filter_map(|s| {
                s.body["status"]["assignedProplet"]
                    .as_str()
                    .map(str::to_owned)
            })
            .collect::<Vec<_>>()
    };

    let selector = propeller_operator::decision::task::selector_of(&task);
    let indexed = |shared: &propeller_operator::k8s::runtime::Shared| -> Vec<String> {
        CacheReads::proplets_for(shared, "iot", &selector)
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect()
    };

    assert_eq!(indexed(&h.shared), Vec::<String>::new());
    reconcile::<Task, _>(Arc::new(task.clone()), h.shared.clone())
        .await
        .unwrap();
    assert_eq!(assigned(&api.take()), Vec::<String>::new());

    h.proplets
        .apply_watcher_event(&watcher::Event::Apply(running(
            "edge",
            json!({"role": "worker"}),
        )));
    assert_eq!(indexed(&h.shared), vec!["edge".to_owned()]);
    reconcile::<Task, _>(Arc::new(task), h.shared.clone())
        .await
        .unwrap();
    assert_eq!(assigned(&api.take()), vec!["edge".to_owned()]);
}
