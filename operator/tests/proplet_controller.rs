//! The Proplet reconcile step: the pure plan, and the exact API requests its executor sends
//! (kube-rs client over a tower-test mock; no API server).

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use http::{Method, Request, Response};
use kube::client::Body;
use propeller_operator::crd::proplet::{Proplet, PropletPhase};
use propeller_operator::decision::liveness::{DeploymentObservation, ExternalObservation};
use propeller_operator::decision::proplet::{plan, PropletObservations, PropletSettings};
use propeller_operator::k8s::proplet::apply;
use serde_json::{json, Value};

const SETTINGS: PropletSettings = PropletSettings {
    last_seen_threshold: Duration::from_secs(30),
    status_flush_interval: Duration::from_secs(10),
    routine_writes_per_second: 0,
};

fn at(secs: i64) -> DateTime<Utc> {
    match Utc.timestamp_opt(1_800_000_000 + secs, 0) {
        chrono::LocalResult::Single(t) => t,
        _ => panic!("bad time"),
    }
}

fn proplet(spec: Value) -> Proplet {
    let value = json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Proplet",
        "metadata": {"name": "edge", "namespace": "iot", "uid": "u-1", "generation": 3},
        "spec": spec
    });
    serde_json::from_value(value).unwrap_or_else(|e| panic!("{e}"))
}

fn external() -> Proplet {
    proplet(json!({
        "type": "external",
        "connectionConfig": {"mqttAddress": "tcp://b:1883", "channelId": "c", "clientKey": "k"}
    }))
}

fn k8s() -> Proplet {
    proplet(json!({
        "type": "k8s",
        "k8s": {"image": "proplet:1"},
        "connectionConfig": {"mqttAddress": "tcp://b:1883", "channelId": "c", "clientKey": "k"}
    }))
}

#[test]
fn heartbeat_makes_an_external_proplet_running_and_schedules_its_offline_check() {
    let observed = PropletObservations {
        external: ExternalObservation {
            heartbeats: vec![at(0)],
            offline_at: None,
        },
        ..PropletObservations::default()
    };
    let p = plan(&external(), &observed, &SETTINGS, at(1));
    assert!(!p.routine, "becoming Running is not a routine write");
    let status = p
        .status
        .unwrap_or_else(|| panic!("first heartbeat must be written"));
    assert_eq!(status.phase, PropletPhase::Running);
    assert_eq!(status.observed_generation, Some(3));
    // The offline check is a deadline the driver watches, not a reconcile at 30 s.
    assert_eq!(p.offline_at, Some(at(30)));
    assert_eq!(p.requeue_at, None);
    assert!(p.deployment.is_none());

    // A later heartbeat that changes nothing but lastSeen waits for the flush interval.
    let mut running = external();
    running.status = Some(status);
    let again = PropletObservations {
        external: ExternalObservation {
            heartbeats: vec![at(2)],
            offline_at: None,
        },
        last_write: Some(at(1)),
        ..PropletObservations::default()
    };
    assert!(plan(&running, &again, &SETTINGS, at(3)).status.is_none());
    let refresh = plan(&running, &again, &SETTINGS, at(12));
    assert!(refresh.status.is_some());
    assert!(
        refresh.routine,
        "a lastSeen refresh may wait when the API server is busy"
    );

    // Past the threshold without heartbeats it goes Offline.
    let silent = PropletObservations {
        last_write: Some(at(1)),
        ..PropletObservations::default()
    };
    let offline = plan(&running, &silent, &SETTINGS, at(31));
    assert!(!offline.routine, "going Offline never waits");
    assert_eq!(offline.status.map(|s| s.phase), Some(PropletPhase::Offline));
}

#[test]
fn a_changed_task_count_is_written_at_most_once_per_flush_interval() {
    let beat = ExternalObservation {
        heartbeats: vec![at(0)],
        offline_at: None,
    };
    let first = plan(
        &external(),
        &PropletObservations {
            external: beat.clone(),
            task_count: 1,
            ..PropletObservations::default()
        },
        &SETTINGS,
        at(0),
    );
    let mut running = external();
    running.status = first.status;
    assert_eq!(running.status.as_ref().map(|s| s.task_count), Some(1));

    // Two more tasks land a second later: not written yet, but a reconcile is asked for
    // when the flush interval is up.
    let busier = PropletObservations {
        last_write: Some(at(0)),
        task_count: 3,
        ..PropletObservations::default()
    };
    let deferred = plan(&running, &busier, &SETTINGS, at(1));
    assert!(deferred.status.is_none());
    assert_eq!(deferred.requeue_at, Some(at(10)));
    let flushed = plan(&running, &busier, &SETTINGS, at(10));
    assert_eq!(flushed.status.map(|s| s.task_count), Some(3));
}

#[test]
fn k8s_proplet_plans_its_deployment_and_takes_phase_from_it() {
    let ready = PropletObservations {
        deployment: Some(DeploymentObservation {
            exists: true,
            desired: 1,
            replicas: 1,
            ready: 1,
            available: 1,
            available_condition: Some(true),
            stalled: false,
        }),
        ..PropletObservations::default()
    };
    let p = plan(&k8s(), &ready, &SETTINGS, at(0));
    assert_eq!(
        p.deployment.and_then(|d| d.metadata.name),
        Some("edge-proplet".to_owned())
    );
    assert_eq!(p.status.map(|s| s.phase), Some(PropletPhase::Running));
    let missing = plan(&k8s(), &PropletObservations::default(), &SETTINGS, at(0));
    assert_eq!(
        missing.status.map(|s| s.phase),
        Some(PropletPhase::Initializing)
    );
}

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// The next request, checked to be a PATCH of `path` with `content_type` and every `query`
/// part; returns its JSON body and the responder.
async fn next_patch(
    handle: &mut Handle,
    path: &str,
    content_type: &str,
    query: &[&str],
) -> (Value, tower_test::mock::SendResponse<Response<Body>>) {
    let (request, respond) = handle
        .next_request()
        .await
        .unwrap_or_else(|| panic!("no request for {path}"));
    assert_eq!(request.method(), Method::PATCH);
    assert_eq!(request.uri().path(), path);
    let sent_query = request.uri().query().unwrap_or_default().to_owned();
    assert!(query.iter().all(|q| sent_query.contains(q)), "{sent_query}");
    assert_eq!(
        request
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some(content_type)
    );
    let bytes = request
        .into_body()
        .collect_bytes()
        .await
        .unwrap_or_default();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{e}"));
    (body, respond)
}

fn json_response(body: &Value) -> Response<Body> {
    Response::builder()
        .body(Body::from(serde_json::to_vec(body).unwrap_or_default()))
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn executor_applies_the_deployment_then_patches_the_status() {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let proplet = k8s();
    let p = plan(&proplet, &PropletObservations::default(), &SETTINGS, at(0));

    let server = tokio::spawn(async move {
        // 1. Server-side apply of the Deployment.
        let (body, respond) = next_patch(
            &mut handle,
            "/apis/apps/v1/namespaces/iot/deployments/edge-proplet",
            "application/apply-patch+yaml",
            &["fieldManager=propeller", "force=true"],
        )
        .await;
        assert_eq!(body["kind"], "Deployment");
        assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "u-1");
        respond.send_response(json_response(&body));

        // 2. Merge patch of the status subresource.
        let (body, respond) = next_patch(
            &mut handle,
            "/apis/propeller.propeller.absmach.eu/v1/namespaces/iot/proplets/edge/status",
            "application/merge-patch+json",
            &[],
        )
        .await;
        assert_eq!(body["status"]["phase"], "Initializing");
        assert_eq!(body["status"]["observedGeneration"], 3);
        let conditions = body["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert!(conditions
            .iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "False"));
        let mut echoed = serde_json::to_value(k8s()).unwrap_or_default();
        echoed["status"] = body["status"].clone();
        respond.send_response(json_response(&echoed));
    });
    if let Err(e) = apply(&client, &proplet, &p).await {
        panic!("apply failed: {e}");
    }
    server.await.unwrap_or_else(|e| panic!("mock server: {e}"));
}
