//! `propeller standalone` as a user runs it: the README's demo, the client commands, a
//! refused manifest, a refused MQTT login, and a restart that loses nothing.

mod support;

use support::{mosquitto_pub, propeller_client, start_standalone};

#[test]
fn the_demo_computes_add_and_the_pipeline_and_a_restart_keeps_everything() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut server, api, mqtt_port) = start_standalone(dir.path(), &["--demo"]);
    server.stdout_line("task add: completed, result 42");
    server.stdout_line("task pipeline-step-two: completed, result 100");
    server.stdout_line("propellerjob pipeline: Completed");

    // The client commands read what the server holds.
    let (ok, out, err) = propeller_client(&api, dir.path(), &["get", "task"]);
    assert!(ok, "{err}");
    let header = out.lines().next().unwrap_or_default();
    assert!(
        header.starts_with("NAME") && header.contains("PHASE"),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("add ") && l.contains("completed")),
        "{out}"
    );
    let (ok, out, err) =
        propeller_client(&api, dir.path(), &["get", "pjob", "pipeline", "-o", "json"]);
    assert!(ok, "{err}");
    let job: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(job["status"]["phase"], "Completed");
    let (ok, out, err) = propeller_client(
        &api,
        dir.path(),
        &["describe", "proplet", "quickstart-proplet"],
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("phase: Running") && out.contains("Conditions:"),
        "{out}"
    );

    // A manifest that breaks a CEL rule is refused with the rule's message, and stored
    // objects are untouched.
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: both\nspec:\n  name: both\n  file: AGFzbQEAAAA=\n  imageUrl: http://example.invalid/m.wasm\n",
    )
    .expect("write manifest");
    let (ok, _, err) = propeller_client(
        &api,
        dir.path(),
        &["apply", "-f", bad.to_str().expect("path")],
    );
    assert!(!ok);
    assert!(err.contains("set exactly one of file or imageUrl"), "{err}");
    let (ok, _, _) = propeller_client(&api, dir.path(), &["get", "task", "both"]);
    assert!(!ok, "the refused task must not exist");

    // The broker refuses a device with the wrong key.
    assert!(!mosquitto_pub(
        &mqtt_port,
        "quickstart-proplet",
        "wrong-key",
        "m/quickstart/c/quickstart/control/proplet/alive",
        r#"{"status":"alive","proplet_id":"quickstart-proplet"}"#
    ));

    // Restart on the same data: resources, statuses and results are all still there.
    server.terminate();
    drop(server);
    let (_server, api, _) = start_standalone(dir.path(), &[]);
    let (ok, out, err) = propeller_client(&api, dir.path(), &["get", "task", "add", "-o", "json"]);
    assert!(ok, "{err}");
    let task: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(task["status"]["phase"], "completed");
    assert_eq!(task["status"]["results"], "42");
    let (ok, out, _) = propeller_client(
        &api,
        dir.path(),
        &["get", "task", "pipeline-step-two", "-o", "json"],
    );
    assert!(ok);
    let step: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(step["status"]["results"], "100");
}

#[test]
fn client_commands_explain_what_is_wrong() {
    let dir = tempfile::tempdir().expect("temp dir");
    // No server yet: the token file is missing and the message says what to do.
    let (ok, _, err) = propeller_client("127.0.0.1:9", dir.path(), &["get", "task"]);
    assert!(!ok);
    assert!(err.contains("start `propeller standalone` first"), "{err}");
    let (_server, api, _) = start_standalone(dir.path(), &[]);
    let (ok, _, err) = propeller_client(&api, dir.path(), &["get", "gadgets"]);
    assert!(!ok);
    assert!(err.contains("unknown kind"), "{err}");
    let (ok, _, err) = propeller_client(&api, dir.path(), &["get", "task", "missing"]);
    assert!(!ok);
    assert!(err.contains("not found"), "{err}");
    let (ok, _, err) = propeller_client(&api, dir.path(), &["get", "task", "--token", "wrong"]);
    assert!(!ok);
    assert!(err.contains("bearer token"), "{err}");
}

/// Polls `propeller get proplet NAME -o json` until its phase is `phase`; returns how long
/// it took.
fn wait_for_phase(
    api: &str,
    dir: &std::path::Path,
    name: &str,
    phase: &str,
) -> std::time::Duration {
    let started = std::time::Instant::now();
    loop {
        let (ok, out, _) = propeller_client(api, dir, &["get", "proplet", name, "-o", "json"]);
        if ok {
            let p: serde_json::Value = serde_json::from_str(&out).expect("json");
            if p["status"]["phase"] == phase {
                return started.elapsed();
            }
        }
        assert!(
            started.elapsed() < support::WAIT,
            "proplet {name} did not become {phase} within {:?}",
            support::WAIT
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn a_killed_agent_goes_offline_and_comes_back_running() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &["--last-seen-threshold", "5s"]);
    let manifest = dir.path().join("pi.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: pi-key\nstringData:\n  key: pi-secret\n---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: pi\nspec:\n  type: external\n  connectionConfig:\n    mqttAddress: tcp://127.0.0.1:1883\n    domainId: d1\n    channelId: c1\n    clientId: pi\n    clientKeySecretRef: {name: pi-key, key: key}\n",
    )
    .expect("write manifest");
    let (ok, _, err) = propeller_client(
        &api,
        dir.path(),
        &["apply", "-f", manifest.to_str().expect("path")],
    );
    assert!(ok, "{err}");
    let agent = |state: &str| {
        let mut cmd = support::binary("proplet");
        cmd.env("PROPLET_MQTT_ADDRESS", format!("tcp://127.0.0.1:{port}"))
            .env("PROPLET_DOMAIN_ID", "d1")
            .env("PROPLET_CHANNEL_ID", "c1")
            .env("PROPLET_CLIENT_ID", "pi")
            .env("PROPLET_CLIENT_KEY", "pi-secret")
            .env("PROPLET_STATE_DIR", dir.path().join(state))
            .env("PROPLET_LIVELINESS_INTERVAL", "1");
        support::Running::spawn(cmd)
    };
    let mut first = agent("a");
    wait_for_phase(&api, dir.path(), "pi", "Running");
    // SIGKILL: no Last Will courtesy from the agent; the broker sees the connection drop.
    let _ = first.child.kill();
    let _ = first.child.wait();
    let took = wait_for_phase(&api, dir.path(), "pi", "Offline");
    assert!(
        took < std::time::Duration::from_secs(6),
        "Offline after {took:?}, beyond the 5 s threshold + 1 s"
    );
    let _second = agent("b");
    wait_for_phase(&api, dir.path(), "pi", "Running");
}
