//! Objects the Kubernetes driver derives from resources: the proplet Deployment and the
//! broker's credential table.

use k8s_openapi::api::core::v1::EnvVar;
use propeller_operator::crd::Proplet;
use propeller_operator::credentials::credential_table;
use propeller_operator::k8s::deployment::{proplet_deployment, DeploymentError};
use serde_json::json;

fn proplet(value: serde_json::Value) -> Proplet {
    match serde_json::from_value(value) {
        Ok(p) => p,
        Err(e) => panic!("test proplet does not parse: {e}"),
    }
}

fn k8s_proplet() -> Proplet {
    proplet(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Proplet",
        "metadata": {"name": "edge-a", "namespace": "iot", "uid": "uid-1"},
        "spec": {
            "type": "k8s",
            "k8s": {
                "image": "ghcr.io/absmach/proplet:1.0",
                "replicas": 2,
                "pluginDir": "/plugins",
                "env": {"livelinessInterval": "10s", "metricsInterval": "1500ms", "tags": "gpu,arm"}
            },
            "resources": {"cpu": "250m", "memory": "128Mi"},
            "connectionConfig": {
                "mqttAddress": "tcp://propeller.iot:1883",
                "domainId": "d1",
                "channelId": "c1",
                "clientId": "edge-a-id",
                "clientKeySecretRef": {"name": "edge-a-key", "key": "password"}
            }
        }
    }))
}

fn env_value<'a>(vars: &'a [EnvVar], name: &str) -> Option<&'a str> {
    vars.iter()
        .find(|v| v.name == name)
        .and_then(|v| v.value.as_deref())
}

#[test]
fn k8s_proplet_gets_an_owned_deployment_configured_for_the_agent() {
    let deployment = match proplet_deployment(&k8s_proplet()) {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    assert_eq!(deployment.metadata.name.as_deref(), Some("edge-a-proplet"));
    assert_eq!(deployment.metadata.namespace.as_deref(), Some("iot"));
    let owner = &deployment.metadata.owner_references.unwrap_or_default()[0];
    assert_eq!(
        (
            owner.kind.as_str(),
            owner.name.as_str(),
            owner.uid.as_str(),
            owner.controller
        ),
        ("Proplet", "edge-a", "uid-1", Some(true))
    );
    let spec = deployment.spec.unwrap_or_default();
    assert_eq!(spec.replicas, Some(2));
    let pod = spec.template.spec.unwrap_or_default();
    let container = &pod.containers[0];
    assert_eq!(
        container.image.as_deref(),
        Some("ghcr.io/absmach/proplet:1.0")
    );
    let vars = container.env.clone().unwrap_or_default();
    assert_eq!(
        env_value(&vars, "PROPLET_MQTT_ADDRESS"),
        Some("tcp://propeller.iot:1883")
    );
    assert_eq!(env_value(&vars, "PROPLET_DOMAIN_ID"), Some("d1"));
    assert_eq!(env_value(&vars, "PROPLET_CHANNEL_ID"), Some("c1"));
    assert_eq!(env_value(&vars, "PROPLET_CLIENT_ID"), Some("edge-a-id"));
    // Intervals in whole seconds, rounded up, as the agents read them.
    assert_eq!(env_value(&vars, "PROPLET_LIVELINESS_INTERVAL"), Some("10"));
    assert_eq!(env_value(&vars, "PROPLET_METRICS_INTERVAL"), Some("2"));
    assert_eq!(env_value(&vars, "PROPLET_PLUGIN_DIR"), Some("/plugins"));
    assert_eq!(env_value(&vars, "PROPLET_TAGS"), Some("gpu,arm"));
    // The key never appears in the Deployment; the pod reads it from the Secret.
    let key = vars.iter().find(|v| v.name == "PROPLET_CLIENT_KEY");
    let selector = key
        .and_then(|v| v.value_from.as_ref())
        .and_then(|f| f.secret_key_ref.as_ref());
    assert_eq!(
        selector.map(|s| (s.name.as_str(), s.key.as_str())),
        Some(("edge-a-key", "password"))
    );
    assert_eq!(key.and_then(|v| v.value.as_deref()), None);
    // Probes use the agent's endpoint: alive on /health, ready on /ready (broker connected).
    assert_eq!(env_value(&vars, "PROPLET_METRICS_ENABLED"), Some("true"));
    assert_eq!(env_value(&vars, "PROPLET_METRICS_PORT"), Some("9092"));
    let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        p.as_ref()
            .and_then(|p| p.http_get.as_ref())
            .and_then(|h| h.path.clone())
    };
    assert_eq!(path(&container.liveness_probe).as_deref(), Some("/health"));
    assert_eq!(path(&container.readiness_probe).as_deref(), Some("/ready"));
    let requests = container
        .resources
        .as_ref()
        .and_then(|r| r.requests.clone())
        .unwrap_or_default();
    assert_eq!(requests.get("memory").map(|q| q.0.as_str()), Some("128Mi"));
    let selector_labels = spec.selector.match_labels.unwrap_or_default();
    let pod_labels = spec
        .template
        .metadata
        .and_then(|m| m.labels)
        .unwrap_or_default();
    assert!(selector_labels
        .iter()
        .all(|(k, v)| pod_labels.get(k) == Some(v)));
}

#[test]
fn external_proplets_and_incomplete_objects_get_no_deployment() {
    let mut external = k8s_proplet();
    external.spec.type_ = propeller_operator::crd::proplet::PropletType::External;
    assert_eq!(
        proplet_deployment(&external).err(),
        Some(DeploymentError::NotK8s)
    );
    let mut unsaved = k8s_proplet();
    unsaved.metadata.uid = None;
    assert!(matches!(
        proplet_deployment(&unsaved),
        Err(DeploymentError::MissingMetadata(_))
    ));
}

fn external(name: &str, connection: serde_json::Value) -> Proplet {
    proplet(json!({
        "apiVersion": "propeller.propeller.absmach.eu/v1",
        "kind": "Proplet",
        "metadata": {"name": name, "namespace": "iot"},
        "spec": {"type": "external", "connectionConfig": connection}
    }))
}

#[test]
fn credential_table_comes_from_inline_keys_and_secrets() {
    let proplets = vec![
        external(
            "inline",
            json!({"mqttAddress": "tcp://b:1883", "channelId": "c", "clientKey": "k1"}),
        ),
        external(
            "upstream-names",
            json!({"mqttAddress": "tcp://b:1883", "channelId": "c", "entityId": "pi-7", "apiKey": "k2"}),
        ),
        external(
            "from-secret",
            json!({"mqttAddress": "tcp://b:1883", "channelId": "c", "clientId": "pi-8",
                   "clientKeySecretRef": {"name": "keys", "key": "pi-8"}}),
        ),
        external(
            "missing-secret",
            json!({"mqttAddress": "tcp://b:1883", "channelId": "c",
                   "clientKeySecretRef": {"name": "keys", "key": "absent"}}),
        ),
    ];
    let (table, problems) = credential_table(&proplets, |ns, name, key| {
        (ns == "iot" && name == "keys" && key == "pi-8").then(|| "k3".to_owned())
    });
    // Client id defaults to the Proplet's name.
    assert!(table.get("inline").is_some_and(|c| c.accepts("k1")));
    assert!(table.get("pi-7").is_some_and(|c| c.accepts("k2")));
    assert!(table.get("pi-8").is_some_and(|c| c.accepts("k3")));
    assert!(!table.contains_key("missing-secret"));
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].proplet, "iot/missing-secret");
    assert!(problems[0].message.contains("absent"));
}

#[test]
fn a_client_id_claimed_twice_logs_in_for_neither() {
    let proplets = vec![
        external(
            "one",
            json!({"mqttAddress": "tcp://b:1883", "channelId": "c", "clientId": "pi", "clientKey": "a"}),
        ),
        external(
            "two",
            json!({"mqttAddress": "tcp://b:1883", "channelId": "c", "clientId": "pi", "clientKey": "b"}),
        ),
    ];
    let (table, problems) = credential_table(&proplets, |_, _, _| None);
    assert!(!table.contains_key("pi"));
    assert!(problems.iter().any(|p| p.message.contains("also claimed")));
}
