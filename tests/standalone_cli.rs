//! `propeller standalone` as a user runs it: the README's demo, the client commands, a
//! refused manifest, a refused MQTT login, and a restart that loses nothing.

mod support;

use support::standalone::{
    apply_text, finished_tasks, finished_tasks_within, get_json, inline_task, spin_module,
    wait_for_object_phase, wait_for_phase,
};
use support::{mosquitto_pub, propeller_client, start_standalone, ADD_WASM};

#[test]
fn the_demo_computes_add_and_the_pipeline_and_a_restart_keeps_everything() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut server, api, mqtt_port) = start_standalone(dir.path(), &["--demo"]);
    // The demo tells what happens, with the logs in a file instead. The tasks run at once,
    // so their lines come in any order (a state read after it changed again is not told,
    // as `scheduled` of a quick task); the summary comes after all of them.
    let mut told = Vec::new();
    let summary = loop {
        let line = server.stdout_line("");
        if line.contains("demo finished:") {
            break line;
        }
        told.push(line);
    };
    for expected in [
        "logs in",
        "demo: applied the quickstart: Secret quickstart-proplet-key",
        "demo: started the agent",
        "proplet quickstart-proplet: Running",
        "task add: completed, result 42",
        "task pipeline-step-two: completed, result 100",
        "propellerjob pipeline: Completed",
    ] {
        assert!(
            told.iter().any(|line| line.contains(expected)),
            "{expected:?} was not told before the summary: {told:#?}"
        );
    }
    assert!(summary.contains("3 completed"), "{summary}");
    server.stdout_line("propeller get tasks");
    assert!(
        server.stderr_so_far().is_empty(),
        "the demo's logs belong in the file"
    );
    let log = std::fs::read_to_string(dir.path().join("propeller.log")).expect("log file");
    assert!(log.contains("INFO"), "{log}");

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

#[test]
fn upstream_samples_run_on_three_agents() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let names = ["external-proplet", "k8s-proplet", "third-proplet"];
    let mut manifest = String::new();
    for name in names {
        manifest.push_str(&format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {name}-secret\n---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\nspec:\n  type: external\n  connectionConfig:\n    mqttAddress: tcp://127.0.0.1:{port}\n    domainId: d1\n    channelId: c1\n    clientId: {name}\n    clientKeySecretRef: {{name: {name}-key, key: key}}\n---\n"
        ));
    }
    let path = dir.path().join("proplets.yaml");
    std::fs::write(&path, manifest).expect("write");
    let (ok, _, err) = propeller_client(
        &api,
        dir.path(),
        &["apply", "-f", path.to_str().expect("path")],
    );
    assert!(ok, "{err}");
    let _agents: Vec<support::Running> = names
        .iter()
        .map(|name| support::device_agent(name, &port, &dir.path().join(name)))
        .collect();
    for name in names {
        wait_for_phase(&api, dir.path(), name, "Running");
    }
    let samples = std::env::var("PROPELLER_SAMPLES_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| support::repo_root().join("tests/fixtures/upstream-samples"));
    for file in [
        "propeller_v1_task.yaml",
        "propeller_v1_task_dag_a.yaml",
        "propeller_v1_task_dag.yaml",
        "propeller_v1_task_broadcast.yaml",
        "propeller_v1_propellerjob.yaml",
    ] {
        let path = samples.join(file);
        let (ok, _, err) = propeller_client(
            &api,
            dir.path(),
            &["apply", "-f", path.to_str().expect("path")],
        );
        assert!(ok, "{file}: {err}");
    }
    let tasks = finished_tasks(
        &api,
        dir.path(),
        &[
            "wasm-addition",
            "dag-task-a",
            "dag-task-b",
            "broadcast-task",
            "sample-propeller-job-job-task-1",
            "sample-propeller-job-job-task-2",
        ],
    );
    let result = |name: &str| tasks[name]["status"]["results"].clone();
    let phase = |name: &str| {
        tasks[name]["status"]["phase"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(phase("wasm-addition"), "completed");
    assert_eq!(result("wasm-addition"), "42");
    assert_eq!(
        tasks["wasm-addition"]["status"]["assignedProplet"],
        "k8s-proplet"
    );
    assert_eq!(result("dag-task-a"), "42");
    assert_eq!(result("dag-task-b"), "20");
    // dag-task-b started only after dag-task-a finished.
    let finished_a = tasks["dag-task-a"]["status"]["finishedAt"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let started_b = tasks["dag-task-b"]["status"]["startedAt"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(started_b >= finished_a, "{started_b} < {finished_a}");
    assert_eq!(phase("broadcast-task"), "completed");
    let per_proplet = tasks["broadcast-task"]["status"]["results"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert_eq!(per_proplet.len(), 3, "{per_proplet:?}");
    assert!(per_proplet.values().all(|r| r["results"] == "42"));
    assert_eq!(result("sample-propeller-job-job-task-1"), "30");
    assert_eq!(result("sample-propeller-job-job-task-2"), "70");
    wait_for_object_phase(
        &api,
        dir.path(),
        "pjob",
        "sample-propeller-job",
        "Completed",
    );
}

/// A Secret, a Proplet and a running `proplet` agent named `name` on the standalone broker.
fn agent_for(api: &str, dir: &std::path::Path, mqtt_port: &str, name: &str) -> support::Running {
    apply_text(
        api,
        dir,
        &format!("{name}.yaml"),
        &support::device_manifest(name, mqtt_port),
    );
    let agent = support::device_agent(name, mqtt_port, &dir.join(format!("{name}-state")));
    wait_for_phase(api, dir, name, "Running");
    agent
}

#[test]
fn a_propeller_job_completes_in_each_execution_mode() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = agent_for(&api, dir.path(), &port, "worker");
    for mode in ["parallel", "sequential", "configurable"] {
        apply_text(
            &api,
            dir.path(),
            &format!("{mode}.yaml"),
            &support::propeller_job_manifest(mode),
        );
    }
    let names: Vec<String> = ["parallel", "sequential", "configurable"]
        .iter()
        .flat_map(|m| [format!("{m}-first"), format!("{m}-second")])
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let tasks = finished_tasks(&api, dir.path(), &refs);
    for mode in ["parallel", "sequential", "configurable"] {
        let first = &tasks[&format!("{mode}-first")]["status"];
        let second = &tasks[&format!("{mode}-second")]["status"];
        assert_eq!(first["results"], "3", "{mode}");
        assert_eq!(second["results"], "7", "{mode}");
        if mode != "parallel" {
            let (done, start) = (
                first["finishedAt"].as_str().unwrap_or_default(),
                second["startedAt"].as_str().unwrap_or_default(),
            );
            assert!(
                start >= done,
                "{mode}: second started {start} before first finished {done}"
            );
        }
    }
    for mode in ["parallel", "sequential", "configurable"] {
        let started = std::time::Instant::now();
        while get_json(&api, dir.path(), &["get", "pjob", mode])["status"]["phase"] != "Completed" {
            assert!(
                started.elapsed() < support::WAIT,
                "{mode} job did not complete"
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }
}

#[test]
fn a_restart_during_a_run_loses_nothing_and_the_run_completes() {
    // spin(n) turns a loop 8·n times: long enough to restart the server while it runs.
    let file = spin_module();
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = agent_for(&api, dir.path(), &port, "worker");
    apply_text(
        &api,
        dir.path(),
        "spin.yaml",
        &format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: spin\nspec:\n  name: spin\n  functionName: spin\n  file: {file}\n  inputs: [2000000000]\n"
        ),
    );
    wait_for_object_phase(&api, dir.path(), "task", "spin", "running");
    server.terminate();
    drop(server);
    // Same data and the same MQTT port, so the agent reconnects and delivers its result.
    let restarted_at = chrono::Utc::now();
    let (_server, api, _) =
        start_standalone(dir.path(), &["--mqtt-listen", &format!("127.0.0.1:{port}")]);
    // The agent reconnects with exponential backoff (1, 2, 4, 8 s …), so on a loaded machine
    // the late result can take a while to come back.
    let tasks = finished_tasks_within(
        &api,
        dir.path(),
        &["spin"],
        std::time::Duration::from_secs(60),
    );
    assert_eq!(tasks["spin"]["status"]["phase"], "completed");
    assert_eq!(tasks["spin"]["status"]["results"], "2000000000");
    let finished: chrono::DateTime<chrono::Utc> = tasks["spin"]["status"]["finishedAt"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("finishedAt");
    assert!(
        finished >= restarted_at,
        "the result must have been applied by the restarted server ({finished} < {restarted_at})"
    );
    assert_eq!(
        tasks["spin"]["status"]["runCount"], 1,
        "the task must not run twice"
    );
}

#[test]
fn a_task_whose_agent_dies_fails_at_its_time_limit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let mut agent = agent_for(&api, dir.path(), &port, "worker");
    let file = spin_module();
    apply_text(
        &api,
        dir.path(),
        "long.yaml",
        &format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: long\nspec:\n  name: long\n  functionName: spin\n  file: {file}\n  inputs: [2000000000]\n  timeoutSeconds: 2\n"
        ),
    );
    wait_for_object_phase(&api, dir.path(), "task", "long", "running");
    let _ = agent.child.kill();
    let _ = agent.child.wait();
    wait_for_phase(&api, dir.path(), "worker", "Offline");
    let tasks = finished_tasks(&api, dir.path(), &["long"]);
    let status = &tasks["long"]["status"];
    assert_eq!(status["phase"], "failed");
    assert!(
        status["error"]
            .as_str()
            .is_some_and(|e| e.contains("time limit")),
        "{status}"
    );
}

#[test]
fn a_recurring_task_runs_at_its_tick_and_schedules_the_next() {
    use chrono::Timelike;
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = agent_for(&api, dir.path(), &port, "worker");
    apply_text(
        &api,
        dir.path(),
        "tick.yaml",
        &format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: tick\nspec:\n  name: tick\n  functionName: add\n  file: {ADD_WASM}\n  inputs: [20, 22]\n  schedule: \"* * * * *\"\n  isRecurring: true\n"
        ),
    );
    let waiting = get_json(&api, dir.path(), &["get", "task", "tick"]);
    let first_tick: chrono::DateTime<chrono::Utc> = waiting["status"]["nextRun"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("nextRun while waiting");
    assert_eq!(first_tick.second(), 0, "ticks are on the minute");
    // The first tick is at most a minute away.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(75);
    let status = loop {
        let task = get_json(&api, dir.path(), &["get", "task", "tick"]);
        if task["status"]["runCount"].as_i64() == Some(1) && task["status"]["phase"] == "completed"
        {
            break task["status"].clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no run at the tick: {:#}",
            task["status"]
        );
        std::thread::sleep(std::time::Duration::from_millis(250));
    };
    assert_eq!(status["results"], "42");
    let started: chrono::DateTime<chrono::Utc> = status["startedAt"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("startedAt");
    assert!(
        started >= first_tick && started < first_tick + chrono::Duration::seconds(2),
        "started {started}, tick {first_tick}"
    );
    let next: chrono::DateTime<chrono::Utc> = status["nextRun"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("nextRun after the run");
    assert_eq!(next, first_tick + chrono::Duration::minutes(1));
}

#[test]
fn a_federated_job_with_real_wasm_participants_averages_their_updates() {
    use base64::Engine;
    let module = support::fl_module();
    let (http, stop) = support::serve_file(module);

    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _a = agent_for(&api, dir.path(), &port, "a");
    let _b = agent_for(&api, dir.path(), &port, "bb");
    apply_text(
        &api,
        dir.path(),
        "fl.yaml",
        &support::federated_job_manifest(&http),
    );
    let deadline = std::time::Instant::now() + support::WAIT;
    let job = loop {
        let job = get_json(&api, dir.path(), &["get", "federatedjob", "fl"]);
        if job["status"]["phase"] == "Completed" {
            break job;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "job: {:#}",
            job["status"]
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(job["status"]["completedRounds"], 2);
    let model_ref = job["status"]["aggregatedModelRef"]
        .as_str()
        .expect("model ref");
    let cm = get_json(&api, dir.path(), &["get", "configmap", model_ref]);
    let stored = base64::engine::general_purpose::STANDARD
        .decode(
            cm["binaryData"]["model.json"]
                .as_str()
                .expect("model bytes"),
        )
        .expect("base64");
    let model: serde_json::Value = serde_json::from_slice(&stored).expect("model json");
    assert_eq!(model["num_samples"], 4);
    assert_eq!(model["proplet_id"], "aggregator");
    let vector = base64::engine::general_purpose::STANDARD
        .decode(model["update_b64"].as_str().expect("update"))
        .expect("base64");
    let vector: Vec<f64> = serde_json::from_slice(&vector).expect("vector");
    assert_eq!(vector, vec![2.5, 5.0]);
}

/// Upstream's sample component tasks that need no hardware (issue: components), end to end:
/// `propeller standalone`, real agents with upstream's settings (`PROPLET_DIRS=/tmp`, HTTP
/// serving on), the sample manifests applied unchanged except the HTTP server's port.
#[test]
fn upstream_component_samples_run_end_to_end() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let names = ["external-proplet", "k8s-proplet", "k8s-proplet-full"];
    let manifest: String = names
        .iter()
        .map(|name| support::device_manifest(name, &port) + "---\n")
        .collect();
    apply_text(&api, dir.path(), "proplets.yaml", &manifest);
    let serve_port = support::envtest::free_port();
    let upstream_settings = [
        ("PROPLET_DIRS", "/tmp"),
        ("PROPLET_HTTP_ENABLED", "true"),
        ("PROPLET_HTTP_BIND", "127.0.0.1"),
    ];
    let _agents: Vec<support::Running> = names
        .iter()
        .map(|name| {
            support::device_agent_with(name, &port, &dir.path().join(name), &upstream_settings)
        })
        .collect();
    for name in names {
        wait_for_phase(&api, dir.path(), name, "Running");
    }
    let samples = support::repo_root().join("tests/fixtures/upstream-samples");
    for sample in [
        "string_input",
        "filesystem",
        "hal_test",
        "attestation_test",
        "http_server",
    ] {
        let text =
            std::fs::read_to_string(samples.join(format!("propeller_v1_task_{sample}.yaml")))
                .expect("sample");
        // The server sample asks for port 8044; a test listens only on ephemeral ports.
        let text = text.replace("\"8044\"", &format!("\"{serve_port}\""));
        apply_text(&api, dir.path(), &format!("{sample}.yaml"), &text);
    }
    // Outgoing wasi:http, from a guest built from source, to a loopback server.
    use base64::Engine as _;
    let guest = base64::engine::general_purpose::STANDARD.encode(support::http_get_guest());
    let (site, _site_stop) = support::serve_file(b"fetched through wasi:http".to_vec());
    apply_text(
        &api,
        dir.path(),
        "http-get.yaml",
        &[
            "apiVersion: propeller.propeller.absmach.eu/v1",
            "kind: Task",
            "metadata:",
            "  name: http-get",
            "spec:",
            "  name: http-get",
            "  functionName: _start",
            &format!("  file: {guest}"),
            "  env:",
            &format!("    TARGET_URL: http://{site}/page"),
            "  propletSelector:",
            "    propletId: external-proplet",
        ]
        .join("\n"),
    );
    let tasks = finished_tasks(
        &api,
        dir.path(),
        &[
            "http-get",
            "string-input-example",
            "filesystem-example",
            "hal-test-example",
            "attestation-test-example",
            "http-server-example",
        ],
    );
    let result = |name: &str| {
        let status = &tasks[name]["status"];
        assert_eq!(status["phase"], "completed", "{name}: {status:#}");
        status["results"].as_str().unwrap_or_default().to_owned()
    };
    assert_eq!(result("string-input-example"), "\"Hello, John Doe!\"");
    assert_eq!(
        result("http-get"),
        "status 200\nfetched through wasi:http\n"
    );
    let expect = |name: &str, part: &str| {
        let text = result(name);
        assert!(text.contains(part), "{name}: {text}");
    };
    expect("filesystem-example", "All filesystem operations succeeded");
    expect(
        "hal-test-example",
        "sha256(hello)=2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
    );
    expect(
        "attestation-test-example",
        "attestation: failed (no TEE platform available for attestation)",
    );
    assert_eq!(
        result("http-server-example"),
        format!("started at port {serve_port}")
    );

    // The daemon serves until its task is deleted.
    let get = || {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", serve_port))?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
        stream.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut reply = String::new();
        stream.read_to_string(&mut reply)?;
        Ok::<_, std::io::Error>(reply)
    };
    let reply = get().expect("the HTTP component answers");
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(
        reply.contains("Hello from proplet WASM HTTP server!"),
        "{reply}"
    );
    let (ok, _, err) =
        propeller_client(&api, dir.path(), &["delete", "task", "http-server-example"]);
    assert!(ok, "{err}");
    let started = std::time::Instant::now();
    while get().is_ok() {
        assert!(
            started.elapsed() < support::WAIT,
            "the server still answers after its task was deleted"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Upstream's `http_client` sample (GET http://httpbin.org/get, GET https://httpbin.org/get,
/// POST https://httpbin.org/post), applied unchanged, against a stand-in for httpbin.org on
/// loopback: the agent's host overrides send the requests there with the guest's Host and
/// TLS name, and its extra CA lets the guest trust the stand-in's certificate. Without a
/// reachable override, or without the CA, the task fails at once with the reason.
#[test]
fn upstream_http_client_sample_reaches_httpbin_through_overrides() {
    let httpbin = support::httpbin::FakeHttpbin::start();
    let dir = tempfile::tempdir().expect("temp dir");
    let ca = dir.path().join("httpbin-ca.pem");
    std::fs::write(&ca, &httpbin.ca_pem).expect("write the CA");
    let ca = ca.to_str().expect("utf-8 path");
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let reachable = format!(
        "httpbin.org:80:{},httpbin.org:443:{}",
        httpbin.http, httpbin.https
    );
    let refused = format!("httpbin.org:80:127.0.0.1:{closed},httpbin.org:443:127.0.0.1:{closed}");
    let agents: [(&str, Vec<(&str, &str)>); 3] = [
        (
            "k8s-proplet-full",
            vec![
                ("PROPLET_HTTP_RESOLVE", &reachable),
                ("PROPLET_HTTP_CA_FILE", ca),
            ],
        ),
        (
            "refused-proplet",
            vec![
                ("PROPLET_HTTP_RESOLVE", &refused),
                ("PROPLET_HTTP_CA_FILE", ca),
            ],
        ),
        (
            "untrusting-proplet",
            vec![("PROPLET_HTTP_RESOLVE", &reachable)],
        ),
    ];
    let manifest: String = agents
        .iter()
        .map(|(name, _)| support::device_manifest(name, &port) + "---\n")
        .collect();
    apply_text(&api, dir.path(), "proplets.yaml", &manifest);
    let _agents: Vec<support::Running> = agents
        .iter()
        .map(|(name, env)| support::device_agent_with(name, &port, &dir.path().join(name), env))
        .collect();
    for (name, _) in &agents {
        wait_for_phase(&api, dir.path(), name, "Running");
    }
    let sample = std::fs::read_to_string(
        support::repo_root()
            .join("tests/fixtures/upstream-samples/propeller_v1_task_http_client.yaml"),
    )
    .expect("sample");
    apply_text(&api, dir.path(), "http-client.yaml", &sample);
    for (task, proplet) in [
        ("http-client-refused", "refused-proplet"),
        ("http-client-untrusting", "untrusting-proplet"),
    ] {
        let copy = sample
            .replace("name: http-client-example", &format!("name: {task}"))
            .replace("\"k8s-proplet-full\"", &format!("\"{proplet}\""));
        assert_eq!(copy.matches(task).count(), 2, "the sample changed");
        assert!(copy.contains(proplet), "the sample changed");
        apply_text(&api, dir.path(), &format!("{task}.yaml"), &copy);
    }
    // Each agent compiles the 300 KB component first; a debug build on a busy machine is slow.
    let tasks = finished_tasks_within(
        &api,
        dir.path(),
        &[
            "http-client-example",
            "http-client-refused",
            "http-client-untrusting",
        ],
        std::time::Duration::from_secs(120),
    );
    let status = |name: &str| tasks[name]["status"].clone();
    let done = status("http-client-example");
    assert_eq!(done["phase"], "completed", "{done:#}");
    let result = done["results"].as_str().unwrap_or_default();
    for part in [
        "=== GET http://httpbin.org/get ===\nStatus: 200 OK\n{",
        "\"url\": \"http://httpbin.org/get\"",
        "=== GET https://httpbin.org/get ===\nStatus: 200 OK\n{",
        "\"url\": \"https://httpbin.org/get\"",
        "=== POST https://httpbin.org/post ===\nStatus: 200 OK\n{",
        "\"url\": \"https://httpbin.org/post\"",
        "\"data\": \"hello from proplet wasm client\"",
        "\"Content-Type\": \"text/plain\"",
        "\"Host\": \"httpbin.org\"",
    ] {
        assert!(result.contains(part), "{part} missing from:\n{result}");
    }
    // Nothing listens where the override points: the guest's first request is refused and
    // the task fails with the guest's own message.
    let refused = status("http-client-refused");
    assert_eq!(refused["phase"], "failed", "{refused:#}");
    let error = refused["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("plain HTTP GET failed") && error.contains("GET httpbin HTTPS failed"),
        "{error}"
    );
    // Without the CA the stand-in's certificate is not trusted.
    let untrusting = status("http-client-untrusting");
    assert_eq!(untrusting["phase"], "failed", "{untrusting:#}");
    let error = untrusting["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("GET httpbin HTTPS failed: ErrorCode::TlsCertificateError"),
        "{error}"
    );
    // Both HTTPS requests asked the stand-in for httpbin.org by name.
    let names = httpbin.server_names.lock().expect("names").clone();
    assert!(
        names.len() >= 2 && names.iter().all(|n| n == "httpbin.org"),
        "{names:?}"
    );
}

/// A task manifest running `add` from the OCI reference `image` with `inputs`, plus extra
/// spec lines.
fn oci_task(name: &str, image: &str, inputs: &str, extra: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: add\n  imageUrl: {image}\n  inputs: {inputs}\n{extra}---\n"
    )
}

#[test]
fn oci_images_are_resolved_pulled_and_served_over_mqtt() {
    use support::registry::{add_module, pull_secret_manifest, Layout, Registry};
    let Some(open) = Registry::start(None) else {
        return;
    };
    let Some(locked) = Registry::start(Some(("ci", "s3cret"))) else {
        return;
    };
    let add = add_module(0);
    let add_digest = open.push("wasm/add:1.0", &add, Layout::WasmArtifact);
    open.push("wasm/plain:1", &add, Layout::PlainFile);
    open.push(
        "wasm/container:1",
        &[0x1f, 0x8b, 8, 0, 0, 0],
        Layout::ContainerImage,
    );
    open.push("wasm/big:1", &add_module(200_000), Layout::WasmArtifact);
    locked.push("private/add:2", &add, Layout::WasmArtifact);

    let dir = tempfile::tempdir().expect("temp dir");
    let plain_http = format!("{},{}", open.host, locked.host);
    let (_server, api, port) = start_standalone(
        dir.path(),
        &[
            "--registry-plain-http",
            &plain_http,
            "--image-max-size",
            "100KiB",
        ],
    );
    let _agents = [
        agent_for(&api, dir.path(), &port, "oci-a"),
        agent_for(&api, dir.path(), &port, "oci-b"),
    ];
    let (o, l) = (&open.host, &locked.host);
    let manifests = [
        pull_secret_manifest("locked-login", l, "ci", "s3cret") + "---\n",
        oci_task("from-oci", &format!("{o}/wasm/add:1.0"), "[2, 3]", ""),
        oci_task(
            "from-oci-scheme",
            &format!("oci://{o}/wasm/add:1.0"),
            "[20, 22]",
            "",
        ),
        oci_task("from-plain", &format!("{o}/wasm/plain:1"), "[4, 5]", ""),
        oci_task(
            "from-private",
            &format!("{l}/private/add:2"),
            "[1, 1]",
            "  imagePullSecrets:\n  - name: locked-login\n",
        ),
        oci_task(
            "private-no-login",
            &format!("{l}/private/add:2"),
            "[1, 1]",
            "",
        ),
        oci_task("missing", &format!("{o}/wasm/nothing:1"), "[1, 1]", ""),
        oci_task("container", &format!("{o}/wasm/container:1"), "[1, 1]", ""),
        oci_task("too-big", &format!("{o}/wasm/big:1"), "[1, 1]", ""),
    ]
    .concat();
    apply_text(&api, dir.path(), "oci-tasks.yaml", &manifests);
    let names = [
        "from-oci",
        "from-oci-scheme",
        "from-plain",
        "from-private",
        "private-no-login",
        "missing",
        "container",
        "too-big",
    ];
    // Failures end well within the agents' 60 s chunk timeout.
    let tasks = finished_tasks(&api, dir.path(), &names);
    let status = |name: &str| tasks[name]["status"].clone();
    for (name, sum) in [
        ("from-oci", "5"),
        ("from-oci-scheme", "42"),
        ("from-plain", "9"),
        ("from-private", "2"),
    ] {
        assert_eq!(
            status(name)["phase"],
            "completed",
            "{name}: {:#}",
            status(name)
        );
        assert_eq!(status(name)["results"], sum, "{name}");
    }
    assert_eq!(status("from-oci")["imageDigest"], add_digest.as_str());
    for (name, message) in [
        ("private-no-login", "registry refused access"),
        ("missing", "not found"),
        ("container", "is not a Wasm artifact"),
        ("too-big", "above the 102400-byte image limit"),
    ] {
        let s = status(name);
        assert_eq!(s["phase"], "failed", "{name}: {s:#}");
        let error = s["error"].as_str().unwrap_or_default();
        assert!(error.contains(message), "{name}: {error}");
    }

    // What upstream's proplet does, with another MQTT implementation: ask on
    // registry/proplet, read registry/server chunks.
    let devices = support::device_manifest("watcher", &port)
        + "---\n"
        + &support::device_manifest("asker", &port);
    apply_text(&api, dir.path(), "watchers.yaml", &devices);
    let pinned = format!("{o}/wasm/add@{add_digest}");
    // Line-buffered, so the SUBACK line arrives before the process exits.
    let mut sub = std::process::Command::new("stdbuf");
    sub.args(["-oL", "mosquitto_sub"])
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port,
            "-i",
            "watcher",
            "-u",
            "watcher",
        ])
        .args([
            "-P",
            "watcher-secret",
            "-t",
            "m/d1/c/c1/registry/server",
            "-C",
            "1",
            "-W",
            "15",
            "-d",
        ]);
    let watcher = support::Running::spawn(sub);
    watcher.stdout_line("SUBACK");
    assert!(mosquitto_pub(
        &port,
        "asker",
        "asker-secret",
        "m/d1/c/c1/registry/proplet",
        &format!(r#"{{"app_name":"{pinned}"}}"#),
    ));
    let chunk_line = watcher.stdout_line("\"chunk_idx\"");
    let chunk: serde_json::Value = serde_json::from_str(&chunk_line).expect("chunk JSON");
    assert_eq!(chunk["app_name"], pinned.as_str());
    assert_eq!(chunk["chunk_idx"], 0);
    assert_eq!(chunk["total_chunks"], 1);
    use base64::Engine as _;
    let data = base64::engine::general_purpose::STANDARD
        .decode(chunk["data"].as_str().unwrap_or_default())
        .expect("base64");
    assert_eq!(data, add);
}

#[test]
fn get_w_prints_the_table_then_a_line_per_change_as_it_happens() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, _port) = start_standalone(dir.path(), &[]);
    apply_text(
        &api,
        dir.path(),
        "first.yaml",
        &inline_task("first", "[1, 2]"),
    );
    let mut cmd = support::binary("propeller");
    cmd.args(["get", "tasks", "-w", "--server", &api, "--data-dir"])
        .arg(dir.path());
    let watch = support::Running::spawn(cmd);
    let header = watch.stdout_line("NAME");
    assert!(header.contains("PHASE"), "{header}");
    assert!(watch.stdout_line("first").contains("first"));
    // No proplet exists: the new task waits, and each of its writes is one line.
    apply_text(
        &api,
        dir.path(),
        "second.yaml",
        &inline_task("second", "[3, 4]"),
    );
    let line = watch.stdout_line("second");
    assert!(line.starts_with("second"), "{line}");
    let (ok, _, err) = propeller_client(&api, dir.path(), &["delete", "task", "second"]);
    assert!(ok, "{err}");
    // Its last lines: the finalizer's removal, then the deletion.
    assert!(watch.stdout_line("second").starts_with("second"));
}

/// SIGTERM in the middle of a burst: `propeller standalone` and a busy agent each stop within
/// a few seconds, and what was stored stays (a restart finds every task).
#[test]
fn standalone_and_a_busy_agent_stop_within_seconds_of_sigterm_mid_burst() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (mut server, api, port) = support::start_standalone(dir.path(), &[]);
    support::standalone::apply_text(
        &api,
        dir.path(),
        "pi.yaml",
        &support::device_manifest("pi", &port),
    );
    let state = tempfile::tempdir().expect("agent state");
    let mut agent = support::device_agent("pi", &port, state.path());
    support::standalone::wait_for_object_phase(&api, dir.path(), "proplet", "pi", "Running");
    let spin = support::standalone::spin_module();
    let manifests: Vec<String> = (0..200)
        .map(|i| {
            format!(
                "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: burst-{i}\nspec:\n  name: burst-{i}\n  functionName: spin\n  file: {spin}\n  inputs: [20000000]\n"
            )
        })
        .collect();
    support::standalone::apply_text(&api, dir.path(), "burst.yaml", &manifests.join("---\n"));
    // Mid-burst: the first results are in (whichever tasks ran first), most are not.
    let started = std::time::Instant::now();
    let finished = loop {
        let tasks = support::standalone::get_json(&api, dir.path(), &["get", "task"]);
        let completed = tasks.as_array().map_or(0, |items| {
            items
                .iter()
                .filter(|t| t["status"]["phase"].as_str() == Some("completed"))
                .count()
        });
        if completed > 0 {
            break completed;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(90),
            "no task of the burst completed in 90 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    eprintln!("{finished} of 200 tasks completed when SIGTERM was sent");
    assert!(
        finished < 200,
        "the burst was over before SIGTERM: make the tasks longer"
    );
    for (what, process) in [
        ("propeller standalone", &mut server),
        ("the agent", &mut agent),
    ] {
        let (status, took) = support::signal_and_wait(
            &mut process.child,
            what,
            "TERM",
            std::time::Duration::from_secs(5),
        );
        assert!(status.success(), "{what} after SIGTERM: {status}");
        eprintln!("{what} stopped {:.2} s after SIGTERM", took.as_secs_f64());
    }
    // Nothing accepted was lost: a restart lists all 200.
    let (_server, api, _) = support::start_standalone(dir.path(), &[]);
    let tasks = support::standalone::get_json(&api, dir.path(), &["get", "task"]);
    let count = tasks.as_array().map_or(0, |items| {
        items
            .iter()
            .filter(|t| {
                t["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("burst-"))
            })
            .count()
    });
    assert_eq!(count, 200, "{tasks}");
}

/// A proplet with `capacity: 1` runs the tasks sent to it one at a time: the others wait,
/// then run, each once.
#[test]
fn a_proplet_at_capacity_runs_its_tasks_one_at_a_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_server, api, port) = support::start_standalone(dir.path(), &[]);
    let device = format!("{}  capacity: 1\n", support::device_manifest("pi", &port));
    support::standalone::apply_text(&api, dir.path(), "pi.yaml", &device);
    let state = tempfile::tempdir().expect("agent state");
    let agent = support::device_agent("pi", &port, state.path());
    support::standalone::wait_for_object_phase(&api, dir.path(), "proplet", "pi", "Running");
    let names: Vec<String> = (0..4).map(|i| format!("one-{i}")).collect();
    let manifests: Vec<String> = names
        .iter()
        .map(|name| support::standalone::spin_task(name, 50_000_000, ""))
        .collect();
    support::standalone::apply_text(&api, dir.path(), "tasks.yaml", &manifests.join("---\n"));
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let finished = support::standalone::finished_tasks_within(
        &api,
        dir.path(),
        &refs,
        std::time::Duration::from_secs(60),
    );
    for (name, task) in &finished {
        assert_eq!(task["status"]["phase"], "completed", "{name}: {task:#}");
    }
    let (most, accepted, _) = support::standalone::most_at_once(&agent.stderr_so_far());
    assert_eq!(accepted, 4, "each task runs once");
    assert_eq!(most, 1, "the capacity of 1 was exceeded");
}

/// A module whose `after(deadline)` traps until the device's clock reaches `deadline`
/// (seconds since the epoch), then returns it: a task that fails its first runs.
fn fails_until_module() -> String {
    use base64::Engine;
    let wasm = wat::parse_str(
        r#"(module
             (import "wasi_snapshot_preview1" "clock_time_get"
               (func $clock (param i32 i64 i32) (result i32)))
             (memory (export "memory") 1)
             (func (export "after") (param $deadline i32) (result i32)
               (drop (call $clock (i32.const 0) (i64.const 1) (i32.const 0)))
               (if (i64.lt_u (i64.div_u (i64.load (i32.const 0)) (i64.const 1000000000))
                             (i64.extend_i32_u (local.get $deadline)))
                 (then unreachable))
               (local.get $deadline)))"#,
    )
    .expect("valid WAT");
    base64::engine::general_purpose::STANDARD.encode(wasm)
}

#[test]
fn a_failing_task_is_retried_with_backoff_up_to_its_limit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = agent_for(&api, dir.path(), &port, "worker");
    let file = fails_until_module();
    let now = chrono::Utc::now().timestamp();
    // Fails at 0 s and after the first 3 s backoff; the second retry (6 s later) is past
    // the deadline and succeeds.
    let heals = now + 6;
    // Never succeeds: 2 retries, then failed for good.
    let never = now + 3600;
    let task = |name: &str, deadline: i64, limit: u32, backoff: u32| {
        format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: after\n  file: {file}\n  inputs: [{deadline}]\n  backoffLimit: {limit}\n  backoffSeconds: {backoff}\n"
        )
    };
    apply_text(&api, dir.path(), "heals.yaml", &task("heals", heals, 3, 3));
    apply_text(&api, dir.path(), "never.yaml", &task("never", never, 2, 1));
    let tasks = finished_tasks_within(
        &api,
        dir.path(),
        &["heals", "never"],
        std::time::Duration::from_secs(60),
    );
    let heals = &tasks["heals"]["status"];
    assert_eq!(heals["phase"], "completed", "{heals:#}");
    assert_eq!(heals["runCount"], 3, "{heals:#}");
    assert_eq!(heals["retries"], 2, "{heals:#}");
    let attempts = heals["failedAttempts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(
        attempts
            .iter()
            .map(|a| a["run"].clone())
            .collect::<Vec<_>>(),
        [1, 2],
        "{heals:#}"
    );
    assert!(attempts
        .iter()
        .all(|a| a["error"].as_str().is_some_and(|e| !e.is_empty())));
    let never = &tasks["never"]["status"];
    assert_eq!(never["phase"], "failed", "{never:#}");
    assert_eq!(never["runCount"], 3, "{never:#}");
    assert_eq!(never["retries"], 2, "{never:#}");
    assert_eq!(
        never["failedAttempts"].as_array().map(Vec::len),
        Some(2),
        "every attempt's error: two retried, the last in status.error: {never:#}"
    );
    assert!(never["error"].as_str().is_some_and(|e| !e.is_empty()));
}

/// `ttlSecondsAfterFinished`: a finished task goes that long after it finished (and so does
/// everything the store holds of it); one without the field stays.
#[test]
fn a_finished_task_with_a_ttl_is_deleted_after_it_and_one_without_stays() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = agent_for(&api, dir.path(), &port, "worker");
    let task = |name: &str, extra: &str| {
        format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: add\n  file: {ADD_WASM}\n  inputs: [40, 2]\n{extra}"
        )
    };
    apply_text(
        &api,
        dir.path(),
        "brief.yaml",
        &task("brief", "  ttlSecondsAfterFinished: 2\n"),
    );
    apply_text(&api, dir.path(), "kept.yaml", &task("kept", ""));
    let finished = finished_tasks(&api, dir.path(), &["brief", "kept"]);
    assert_eq!(finished["brief"]["status"]["results"], "42");
    let done_at: chrono::DateTime<chrono::Utc> = finished["brief"]["status"]["finishedAt"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("finishedAt");
    let started = std::time::Instant::now();
    let names = || -> Vec<String> {
        get_json(&api, dir.path(), &["get", "task"])
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["metadata"]["name"].as_str().map(str::to_owned))
            .collect()
    };
    while names().contains(&"brief".to_owned()) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(30),
            "brief is still there: {:?}",
            names()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let gone_after = chrono::Utc::now() - done_at;
    eprintln!("brief deleted {gone_after} after it finished (TTL 2 s)");
    assert!(
        gone_after >= chrono::Duration::seconds(2),
        "deleted before its TTL: {gone_after}"
    );
    assert_eq!(names(), ["kept"]);
}
