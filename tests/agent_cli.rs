//! The real `proplet` binary against the real `propeller broker`, with mosquitto clients
//! playing the operator (a trusted service credential).

mod support;

use std::process::{Command, Stdio};

use support::{binary, mosquitto_pub, Running};

const ADD_B64: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL";

#[test]
fn proplet_runs_a_task_sent_through_the_broker() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (broker, port) = support::start_broker(
        dir.path(),
        "[[client]]\nid = \"pi-1\"\nkey = \"pi-key\"\n\n[[client]]\nid = \"ops\"\nkey = \"ops-key\"\nrole = \"service\"\n\n[[client]]\nid = \"ops-watch\"\nkey = \"ops-key\"\nrole = \"service\"\n",
    );

    // Upstream variable names, including the aliases, as a Docker deployment sets them.
    let mut agent = binary("proplet");
    agent
        .env_clear()
        .env("PROPLET_MQTT_ADDRESS", format!("tcp://127.0.0.1:{port}"))
        .env("PROPLET_TENANT_ID", "d1")
        .env("PROPLET_CHANNEL_ID", "c1")
        .env("PROPLET_ENTITY_ID", "pi-1")
        .env("PROPLET_API_KEY", "pi-key")
        .env("PROPLET_LIVELINESS_INTERVAL", "1s")
        .env("PROPLET_STATE_DIR", dir.path().join("state"));
    let _agent = Running::spawn(agent);
    broker.stderr_line("discovered");

    let prefix = "m/d1/c/c1";
    let mut sub = Command::new("mosquitto_sub");
    sub.args([
        "-h",
        "127.0.0.1",
        "-p",
        &port,
        "-i",
        "ops-watch",
        "-u",
        "ops-watch",
    ])
    .args(["-P", "ops-key"])
    .args([
        "-t",
        &format!("{prefix}/control/proplet/results"),
        "-C",
        "1",
        "-W",
        "20",
    ])
    .args(["-q", "1"])
    .stdout(Stdio::piped());
    let sub = sub
        .spawn()
        .expect("run mosquitto_sub (is mosquitto-clients installed?)");
    std::thread::sleep(std::time::Duration::from_millis(500));

    // What the upstream Go manager publishes.
    let start = format!(
        r#"{{"id":"task-1","name":"add","state":0,"file":"{ADD_B64}","inputs":["10","32"],"cli_args":null,"broadcast":false,"daemon":false,"latent":false,"encrypted":false,"proplet_id":"pi-1"}}"#
    );
    let start_topic = format!("{prefix}/control/manager/start");
    // The username must equal the client id: "ops-pub" logging in as "ops" is refused.
    assert!(!support::mosquitto_pub_as(
        &port,
        "ops-pub",
        "ops",
        "ops-key",
        &start_topic,
        &start
    ));
    assert!(mosquitto_pub(&port, "ops", "ops-key", &start_topic, &start));

    let out = sub.wait_with_output().expect("mosquitto_sub output");
    let text = String::from_utf8_lossy(&out.stdout);
    let result: serde_json::Value = serde_json::from_str(text.trim()).expect("result is JSON");
    assert_eq!(result["task_id"], "task-1");
    assert_eq!(result["proplet_id"], "pi-1");
    assert_eq!(result["results"], "42");
    assert!(result["error"].is_null(), "{result}");
}

#[test]
fn proplet_help_documents_the_variables_and_bad_values_are_named() {
    let help = binary("proplet")
        .arg("--help")
        .output()
        .expect("run proplet");
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for var in [
        "PROPLET_MQTT_ADDRESS",
        "PROPLET_DOMAIN_ID",
        "PROPLET_TENANT_ID",
        "PROPLET_CHANNEL_ID",
        "PROPLET_CLIENT_ID",
        "PROPLET_ENTITY_ID",
        "PROPLET_CLIENT_KEY",
        "PROPLET_API_KEY",
        "PROPLET_MQTT_QOS",
        "PROPLET_LIVELINESS_INTERVAL",
        "PROPLET_METRICS_INTERVAL",
        "PROPLET_LOG_LEVEL",
        "PROPLET_PLUGIN_DIR",
        "PROPLET_MQTT_TLS_CA_CERT",
        "PROPLET_TAGS",
        "PROPLET_LOCATION",
        "PROPLET_DESCRIPTION",
    ] {
        assert!(text.contains(var), "--help does not mention {var}");
    }

    let out = binary("proplet")
        .env_clear()
        .env("PROPLET_DOMAIN_ID", "d")
        .env("PROPLET_CHANNEL_ID", "c")
        .env("PROPLET_CLIENT_ID", "p")
        .env("PROPLET_CLIENT_KEY", "k")
        .env("PROPLET_LIVELINESS_INTERVAL", "soon")
        .output()
        .expect("run proplet");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("PROPLET_LIVELINESS_INTERVAL"), "{stderr}");
}
