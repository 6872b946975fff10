//! The schema and CEL rules refuse what the issue says they must, with the rule's message,
//! and accept the boundary values.

use propeller_operator::validation::Admission;
use serde_json::{json, Value};

fn proplet(spec: Value) -> Value {
    json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Proplet",
        "metadata": {"name": "p1", "namespace": "default"},
        "spec": spec,
    })
}

fn external_spec() -> Value {
    json!({
        "type": "external",
        "external": {"deviceType": "rpi", "capabilities": ["wasm"]},
        "connectionConfig": {
            "mqttAddress": "tcp://127.0.0.1:1883",
            "domainId": "d", "channelId": "c", "clientId": "p1", "clientKey": "k"
        }
    })
}

fn task(spec: Value) -> Value {
    json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Task",
        "metadata": {"name": "t1", "namespace": "default"},
        "spec": spec,
    })
}

fn task_spec() -> Value {
    json!({"name": "t1", "functionName": "main", "file": "AGFzbQEAAAA=", "inputs": ["1", 2]})
}

fn with(mut base: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    let target = base.pointer_mut(parent).unwrap().as_object_mut().unwrap();
    if value.is_null() {
        target.remove(key);
    } else {
        target.insert(key.to_string(), value);
    }
    base
}

/// Admits or returns every error message joined, for substring checks.
fn admit(object: &Value) -> Result<Value, String> {
    Admission::new()
        .admit(object, None)
        .map_err(|e| e.to_string())
}

fn assert_refused(object: &Value, expected: &str) {
    match admit(object) {
        Ok(_) => panic!("expected refusal containing {expected:?}, but it was admitted"),
        Err(msg) => assert!(msg.contains(expected), "expected {expected:?} in:\n{msg}"),
    }
}

#[test]
fn a_valid_external_proplet_is_admitted_with_defaults() {
    let out = admit(&proplet(external_spec())).unwrap();
    assert_eq!(out["spec"]["connectionConfig"]["mqttQos"], 0);
    assert_eq!(out["spec"]["connectionConfig"]["mqttTimeout"], "30s");
}

#[test]
fn k8s_proplet_needs_k8s_image() {
    let spec = with(external_spec(), "/type", json!("k8s"));
    assert_refused(
        &proplet(spec.clone()),
        "spec.k8s (with k8s.image) is required",
    );
    let spec = with(spec, "/k8s", json!({"replicas": 1}));
    assert_refused(&proplet(spec.clone()), "spec.k8s.image: Required value");
    let spec = with(spec, "/k8s", json!({"image": "ghcr.io/x/proplet:1"}));
    let out = admit(&proplet(spec)).unwrap();
    assert_eq!(out["spec"]["k8s"]["replicas"], 1);
    assert_eq!(out["spec"]["k8s"]["logLevel"], "info");
}

#[test]
fn replicas_are_bounded_0_to_100() {
    let base = with(external_spec(), "/type", json!("k8s"));
    for (replicas, ok) in [(0, true), (100, true), (101, false), (-1, false)] {
        let spec = with(
            base.clone(),
            "/k8s",
            json!({"image": "i", "replicas": replicas}),
        );
        assert_eq!(admit(&proplet(spec)).is_ok(), ok, "replicas {replicas}");
    }
}

#[test]
fn qos_is_bounded_0_to_2() {
    for (qos, ok) in [(0, true), (2, true), (3, false), (-1, false)] {
        let spec = with(external_spec(), "/connectionConfig/mqttQos", json!(qos));
        assert_eq!(admit(&proplet(spec)).is_ok(), ok, "qos {qos}");
    }
}

#[test]
fn exactly_one_client_key_counting_aliases() {
    let msg = "exactly one of clientKey, clientKeySecretRef";
    let none = with(external_spec(), "/connectionConfig/clientKey", Value::Null);
    assert_refused(&proplet(none.clone()), msg);
    let both = with(external_spec(), "/connectionConfig/apiKey", json!("k2"));
    assert_refused(&proplet(both), msg);
    let key_and_ref = with(
        external_spec(),
        "/connectionConfig/apiKeySecretRef",
        json!({"name": "s", "key": "k"}),
    );
    assert_refused(&proplet(key_and_ref), msg);
    let alias_only = with(none.clone(), "/connectionConfig/apiKey", json!("k"));
    assert!(admit(&proplet(alias_only)).is_ok());
    let ref_only = with(
        none,
        "/connectionConfig/clientKeySecretRef",
        json!({"name": "s", "key": "k"}),
    );
    assert!(admit(&proplet(ref_only)).is_ok());
}

#[test]
fn domain_and_client_id_under_either_name() {
    let no_domain = with(external_spec(), "/connectionConfig/domainId", Value::Null);
    assert_refused(
        &proplet(no_domain.clone()),
        "domainId (or its alias tenantId) is required",
    );
    assert!(admit(&proplet(with(
        no_domain,
        "/connectionConfig/tenantId",
        json!("d")
    )))
    .is_ok());
    let no_client = with(external_spec(), "/connectionConfig/clientId", Value::Null);
    assert_refused(
        &proplet(no_client.clone()),
        "clientId (or its alias entityId) is required",
    );
    assert!(admit(&proplet(with(
        no_client,
        "/connectionConfig/entityId",
        json!("p1")
    )))
    .is_ok());
}

#[test]
fn unknown_fields_and_wrong_types_are_refused_with_their_path() {
    let spec = with(external_spec(), "/bogus", json!(1));
    assert_refused(&proplet(spec), "spec.bogus: unknown field");
    let spec = with(external_spec(), "/type", json!("cloud"));
    assert_refused(&proplet(spec), "spec.type: unsupported value \"cloud\"");
    let spec = with(external_spec(), "/connectionConfig/mqttQos", json!("one"));
    assert_refused(
        &proplet(spec),
        "spec.connectionConfig.mqttQos: must be of type integer",
    );
    let mut bad_name = proplet(external_spec());
    bad_name["metadata"]["name"] = json!("Bad_Name");
    assert_refused(&bad_name, "metadata.name");
}

#[test]
fn resource_quantities_must_be_well_formed() {
    let spec = with(
        external_spec(),
        "/resources",
        json!({"cpu": "50m", "memory": "128Mi"}),
    );
    assert!(admit(&proplet(spec)).is_ok());
    let spec = with(external_spec(), "/resources", json!({"cpu": 2}));
    assert!(admit(&proplet(spec)).is_ok());
    let spec = with(external_spec(), "/resources", json!({"memory": "lots"}));
    assert_refused(&proplet(spec), "spec.resources.memory");
    let spec = with(
        task_spec(),
        "/resourceRequirements",
        json!({"cpu": "100m", "memory": "1x"}),
    );
    assert_refused(&task(spec), "spec.resourceRequirements.memory");
}

#[test]
fn task_name_is_1_to_253() {
    assert_refused(
        &task(with(task_spec(), "/name", json!(""))),
        "spec.name: must be at least 1",
    );
    assert!(admit(&task(with(task_spec(), "/name", json!("a".repeat(253))))).is_ok());
    assert_refused(
        &task(with(task_spec(), "/name", json!("a".repeat(254)))),
        "spec.name: may not be longer than 253",
    );
}

#[test]
fn priority_defaults_to_50_and_0_is_storable() {
    let out = admit(&task(task_spec())).unwrap();
    assert_eq!(out["spec"]["priority"], 50);
    let out = admit(&task(with(task_spec(), "/priority", json!(0)))).unwrap();
    assert_eq!(out["spec"]["priority"], 0);
    assert_refused(
        &task(with(task_spec(), "/priority", json!(101))),
        "spec.priority",
    );
    assert_refused(
        &task(with(task_spec(), "/priority", json!(-1))),
        "spec.priority",
    );
}

#[test]
fn exactly_one_of_file_or_image_url_unless_encrypted() {
    let msg = "set exactly one of file or imageUrl";
    assert_refused(&task(with(task_spec(), "/file", Value::Null)), msg);
    assert_refused(&task(with(task_spec(), "/imageUrl", json!("oci://x"))), msg);
    let image_only = with(
        with(task_spec(), "/file", Value::Null),
        "/imageUrl",
        json!("oci://x"),
    );
    assert!(admit(&task(image_only.clone())).is_ok());
    let encrypted = with(image_only, "/encrypted", json!(true));
    assert!(admit(&task(encrypted.clone())).is_ok());
    assert_refused(
        &task(with(encrypted.clone(), "/file", json!("AGFzbQEAAAA="))),
        msg,
    );
    assert_refused(
        &task(with(
            with(task_spec(), "/encrypted", json!(true)),
            "/imageUrl",
            Value::Null,
        )),
        msg,
    );
}

#[test]
fn file_must_be_base64() {
    assert_refused(
        &task(with(task_spec(), "/file", json!("not base64!"))),
        "spec.file: \"not base64!\" does not match the expected format",
    );
}

#[test]
fn broadcast_excludes_a_pinned_proplet() {
    let spec = with(
        with(task_spec(), "/broadcast", json!(true)),
        "/propletSelector",
        json!({"propletId": "p1"}),
    );
    assert_refused(
        &task(spec),
        "broadcast must not be set when propletSelector.propletId is specified",
    );
    let spec = with(task_spec(), "/broadcast", json!(true));
    assert!(admit(&task(spec)).is_ok());
}

#[test]
fn depends_on_needs_workflow_or_job() {
    let spec = with(task_spec(), "/dependsOn", json!(["a"]));
    assert_refused(
        &task(spec.clone()),
        "workflowId or jobId is required when dependsOn is specified",
    );
    assert!(admit(&task(with(spec.clone(), "/workflowId", json!("w")))).is_ok());
    assert!(admit(&task(with(spec, "/jobId", json!("uid")))).is_ok());
}

#[test]
fn recurring_needs_a_schedule() {
    let spec = with(task_spec(), "/isRecurring", json!(true));
    assert_refused(
        &task(spec.clone()),
        "schedule is required when isRecurring is true",
    );
    assert!(admit(&task(with(spec, "/schedule", json!("*/5 * * * *")))).is_ok());
}

#[test]
fn inline_job_tasks_may_depend_on_siblings_without_workflow_id() {
    let job = json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "PropellerJob",
        "metadata": {"name": "j"},
        "spec": {"name": "j", "executionMode": "configurable", "tasks": [
            {"name": "a", "file": "AGFzbQEAAAA="},
            {"name": "b", "file": "AGFzbQEAAAA=", "dependsOn": ["a"]}
        ]}
    });
    assert!(admit(&job).is_ok());
    let mut bad = job.clone();
    bad["spec"]["tasks"][1]["imageUrl"] = json!("oci://x");
    assert_refused(&bad, "spec.tasks[1]");
}

fn federated(spec: Value) -> Value {
    json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "FederatedJob",
        "metadata": {"name": "fl"},
        "spec": spec,
    })
}

fn fl_spec() -> Value {
    json!({
        "taskWasmImage": "oci://train", "participants": [{"propletId": "a"}, {"propletId": "b"}],
        "kOfN": 2, "rounds": {"total": 2}, "aggregator": {"algorithm": "fedavg"}
    })
}

#[test]
fn federated_job_rules() {
    assert!(admit(&federated(fl_spec())).is_ok());
    assert_refused(
        &federated(with(fl_spec(), "/participants", json!([]))),
        "spec.participants: must have at least 1",
    );
    assert_refused(&federated(with(fl_spec(), "/kOfN", json!(0))), "spec.kOfN");
    assert_refused(
        &federated(with(fl_spec(), "/kOfN", json!(3))),
        "kOfN cannot be greater than the number of participants",
    );
    assert_refused(
        &federated(with(fl_spec(), "/rounds", json!({"total": 0}))),
        "spec.rounds.total",
    );
    assert_refused(
        &federated(with(
            fl_spec(),
            "/aggregator",
            json!({"algorithm": "median"}),
        )),
        "spec.aggregator.algorithm: unsupported value",
    );
    let out = admit(&federated(with(fl_spec(), "/aggregator", Value::Null))).unwrap();
    assert_eq!(out["spec"]["aggregator"]["algorithm"], "fedavg");
}

#[test]
fn training_round_rules() {
    let round = |participants: Value, k: i64| {
        json!({
            "apiVersion": "propeller.propeller.absmach.eu/v1",
            "kind": "TrainingRound",
            "metadata": {"name": "round-1-fl"},
            "spec": {"roundId": "round-1", "federatedJobRef": {"name": "fl"},
                     "taskWasmImage": "oci://t", "participants": participants, "kOfN": k}
        })
    };
    assert!(admit(&round(json!(["a"]), 1)).is_ok());
    assert_refused(&round(json!([]), 1), "spec.participants");
    assert_refused(
        &round(json!(["a"]), 2),
        "kOfN cannot be greater than the number of participants",
    );
    assert_refused(&round(json!(["a"]), 0), "spec.kOfN");
}

#[test]
fn wrong_api_version_and_unknown_kind_are_refused() {
    let mut obj = task(task_spec());
    obj["apiVersion"] = json!("propeller.propeller.absmach.eu/v2");
    assert_refused(&obj, "apiVersion: must be");
    let mut obj = task(task_spec());
    obj["kind"] = json!("Gadget");
    assert!(admit(&obj).unwrap_err().contains("unknown kind"));
}

/// Tasks the operator builds itself start from `TaskSpec::default()`; the API server
/// must accept them as a user's manifest with the same fields left out.
#[test]
fn a_default_task_spec_is_admitted() {
    use propeller_operator::crd::task::{Task, TaskSpec};
    let spec = TaskSpec {
        name: "round-1-a".into(),
        image_url: Some("http://127.0.0.1/train.wasm".into()),
        ..TaskSpec::default()
    };
    let mut task = Task::new("round-1-a", spec);
    task.metadata.namespace = Some("default".into());
    let object = serde_json::to_value(&task).unwrap();
    assert_eq!(object["spec"]["timezone"], "UTC");
    assert_eq!(object["spec"]["priority"], 50);
    admit(&object).unwrap_or_else(|e| panic!("refused: {e}"));
}
