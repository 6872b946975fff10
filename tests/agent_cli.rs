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

/// Every stderr line of `process` up to and including the first containing `needle`.
fn lines_until(process: &Running, needle: &str) -> Vec<String> {
    let deadline = std::time::Instant::now() + support::WAIT;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match process.stderr.recv_timeout(left) {
            Ok(line) => {
                let done = line.contains(needle);
                seen.push(line);
                if done {
                    return seen;
                }
            }
            Err(_) => panic!(
                "no line containing {needle:?} within {:?}; saw:\n{}",
                support::WAIT,
                seen.join("\n")
            ),
        }
    }
}

#[test]
fn a_start_repeated_after_its_run_finished_is_answered_with_its_result_not_run_again() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (broker, port) = support::start_broker(
        dir.path(),
        "[[client]]\nid = \"pi-1\"\nkey = \"pi-key\"\n\n[[client]]\nid = \"ops\"\nkey = \"ops-key\"\nrole = \"service\"\n\n[[client]]\nid = \"ops-watch\"\nkey = \"ops-key\"\nrole = \"service\"\n",
    );
    let agent = || {
        let mut cmd = binary("proplet");
        cmd.env_clear()
            .env("PROPLET_MQTT_ADDRESS", format!("tcp://127.0.0.1:{port}"))
            .env("PROPLET_DOMAIN_ID", "d1")
            .env("PROPLET_CHANNEL_ID", "c1")
            .env("PROPLET_CLIENT_ID", "pi-1")
            .env("PROPLET_CLIENT_KEY", "pi-key")
            .env("PROPLET_LIVELINESS_INTERVAL", "1s")
            .env("PROPLET_STATE_DIR", dir.path().join("state"));
        Running::spawn(cmd)
    };
    let mut first = agent();
    broker.stderr_line("discovered");
    let prefix = "m/d1/c/c1";
    let mut sub = Command::new("mosquitto_sub");
    sub.args(["-h", "127.0.0.1", "-p", &port, "-i", "ops-watch"])
        .args(["-u", "ops-watch", "-P", "ops-key", "-q", "1"])
        .args(["-t", &format!("{prefix}/control/proplet/results")]);
    let results = Running::spawn(sub);
    std::thread::sleep(std::time::Duration::from_millis(500));
    let start_topic = format!("{prefix}/control/manager/start");
    let start = |run: u64| {
        let message = format!(
            r#"{{"id":"task-1","name":"add","file":"{ADD_B64}","inputs":["10","32"],"proplet_id":"pi-1","run":{run}}}"#
        );
        assert!(mosquitto_pub(
            &port,
            "ops",
            "ops-key",
            &start_topic,
            &message
        ));
    };
    let result = || -> serde_json::Value {
        let line = results.stdout_line("task-1");
        serde_json::from_str(&line).expect("result is JSON")
    };

    // Run 1, then the same start again: one execution, the result twice.
    start(1);
    let mut log = lines_until(&first, "task succeeded");
    let original = result();
    assert_eq!(original["results"], "42");
    start(1);
    log.extend(lines_until(&first, "its result is published again"));
    assert_eq!(result(), original);
    log.extend(first.stderr_so_far());
    first.terminate();

    // The memory survives a restart of the agent.
    let second = agent();
    broker.stderr_line("discovered");
    start(1);
    log.extend(lines_until(&second, "its result is published again"));
    assert_eq!(result(), original);
    // The next run is a run: it executes.
    start(2);
    log.extend(lines_until(&second, "task succeeded"));
    assert_eq!(result()["results"], "42");
    log.extend(second.stderr_so_far());

    let accepted: Vec<&String> = log.iter().filter(|l| l.contains("task accepted")).collect();
    assert_eq!(
        accepted.len(),
        2,
        "runs 1 and 2 once each:\n{}",
        log.join("\n")
    );
    assert!(
        accepted[0].contains("run=1") && accepted[1].contains("run=2"),
        "{accepted:?}"
    );
    assert_eq!(
        log.iter().filter(|l| l.contains("published again")).count(),
        2
    );
}

/// The suite's secret check can fail: a process whose log shows a registered secret fails
/// the test that ran it, and the failure does not repeat the secret.
#[test]
fn a_process_that_logs_a_registered_secret_fails_its_test() {
    let key = support::secret("leak-check-key-7f3a9c");
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        &format!("echo 'connecting with key {key}' >&2; echo fine >&2"),
    ]);
    let process = support::Running::spawn(cmd);
    // The line after the secret: the reader has seen both before the drop stops the shell.
    process.stderr_line("fine");
    let failure = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(process)))
        .expect_err("dropping a process that logged a secret must fail");
    let message = failure
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
    assert!(message.contains("logged a secret"), "{message}");
    assert!(
        !message.contains(&key),
        "the failure repeats the secret: {message}"
    );

    let mut quiet = std::process::Command::new("sh");
    quiet.args(["-c", "echo 'connecting with key <redacted>' >&2"]);
    drop(support::Running::spawn(quiet));
}
