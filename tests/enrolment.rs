//! Devices that enrol themselves, as a user does it: `propeller token create` on a
//! standalone server with a TLS listener, `proplet join` with the token, and the device
//! Running with its labels and running a task; every refusal with its message on the
//! device and its count in `/metrics`; manual approval; a machine enrolling again gets a new
//! key for its Proplet instead of a second Proplet.

mod support;

use std::path::Path;
use std::process::Output;

use support::enrol::TlsServer;
use support::standalone::{apply_text, finished_tasks, get_json, inline_task, wait_for_phase};
use support::{binary, Running};

/// `proplet join … --no-run` as machine `machine` into `state`.
fn join(tls_port: &str, ca: &Path, token: &str, machine: &str, state: &Path) -> Output {
    binary("proplet")
        .args(["join", "--no-run", "--server"])
        .arg(format!("mqtts://127.0.0.1:{tls_port}"))
        .args(["--token", token, "--machine-id", machine, "--tls-ca-cert"])
        .arg(ca)
        .arg("--state-dir")
        .arg(state)
        .output()
        .expect("run proplet join")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn metric(api: &str, dir: &Path, name: &str) -> u64 {
    let token = std::fs::read_to_string(dir.join("server/api-token")).expect("api token");
    let out = std::process::Command::new("curl")
        .args(["-sf", "-H"])
        .arg(format!("Authorization: Bearer {}", token.trim()))
        .arg(format!("http://{api}/metrics"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[test]
fn a_device_enrols_with_a_token_over_tls_and_runs_tasks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = TlsServer::start(dir.path());
    let (api, _plain, tls, ca) = (
        server.api.clone(),
        server.plain_port.clone(),
        server.tls_port.clone(),
        server.ca.clone(),
    );
    let token = server.token(&["--labels", "site=lab", "--ttl", "1h", "--uses", "50"]);
    let (ok, listed, err) = server.client(&["token", "list"]);
    assert!(ok, "{err}");
    let id = &token[..6];
    let row = listed
        .lines()
        .find(|l| l.starts_with(id))
        .unwrap_or_default();
    assert!(row.contains("0/50") && row.contains("site=lab"), "{listed}");
    assert!(!listed.contains(&token[7..]), "the secret is never listed");

    // The whole path a user takes: join, and the agent runs with its new credentials.
    let state = dir.path().join("device");
    let mut agent = support::enrol::join_and_run(&tls, &token, "machine-one", &ca, &state);
    let enrolled = agent.stderr_line("enrolled as");
    let name = support::enrol::enrolled_name(&enrolled);
    let credentials = state.join("credentials.toml");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&credentials)
            .expect("credentials")
            .permissions(),
    );
    assert_eq!(mode & 0o777, 0o600);
    let written = std::fs::read_to_string(&credentials).expect("credentials");
    assert!(!written.contains(&token[7..]), "the token is not kept");

    wait_for_phase(&api, &dir.path().join("server"), &name, "Running");
    let proplet = get_json(&api, &dir.path().join("server"), &["get", "proplet", &name]);
    let labels = &proplet["metadata"]["labels"];
    assert_eq!(labels["site"], "lab", "{proplet:#}");
    assert_eq!(labels["propeller.absmach.eu/enrolled-with"], id);
    assert!(labels["kubernetes.io/arch"].is_string(), "{labels}");
    let (ok, described, _) = server.client(&["describe", "proplet", &name]);
    assert!(
        ok && described.contains(&format!("enrolled with token {id}")),
        "{described}"
    );

    // Ready for tasks: one runs there.
    let task = inline_task("after-enrol", "[20, 22]").replace(
        "spec:\n",
        &format!("spec:\n  propletSelector:\n    propletId: {name}\n"),
    );
    apply_text(&api, &dir.path().join("server"), "task.yaml", &task);
    let done = finished_tasks(&api, &dir.path().join("server"), &["after-enrol"]);
    assert_eq!(
        done["after-enrol"]["status"]["phase"], "completed",
        "{:#}",
        done["after-enrol"]
    );

    // A second join of an enrolled device says so and keeps its credentials.
    let again = join(&tls, &ca, &token, "machine-one", &state);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stderr(&again).contains("already enrolled"),
        "{}",
        stderr(&again)
    );
    assert_eq!(
        std::fs::read_to_string(&credentials).expect("credentials"),
        written
    );
    assert_eq!(
        metric(
            &api,
            dir.path(),
            "propeller_enrolments_total{outcome=\"enrolled\"}"
        ),
        1
    );
    agent.terminate();
}

#[test]
fn every_refusal_says_why_on_the_device_and_is_counted() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = TlsServer::start(dir.path());
    let (api, plain, tls, ca) = (
        server.api.clone(),
        server.plain_port.clone(),
        server.tls_port.clone(),
        server.ca.clone(),
    );
    let state = |n: &str| dir.path().join(format!("device-{n}"));

    // Used up: the second machine of a one-use token.
    let one = server.token(&["--uses", "1"]);
    let first = join(&tls, &ca, &one, "m-1", &state("1"));
    assert!(first.status.success(), "{}", stderr(&first));
    let second = join(&tls, &ca, &one, "m-2", &state("2"));
    assert!(!second.status.success());
    assert!(
        stderr(&second).contains("has enrolled the 1 devices"),
        "{}",
        stderr(&second)
    );
    // The same machine again does not need a use: it gets a new key for its Proplet.
    let old_key = std::fs::read_to_string(state("1").join("credentials.toml")).expect("creds");
    std::fs::remove_file(state("1").join("credentials.toml")).expect("remove");
    let rotated = join(&tls, &ca, &one, "m-1", &state("1"));
    assert!(rotated.status.success(), "{}", stderr(&rotated));
    let new_key = std::fs::read_to_string(state("1").join("credentials.toml")).expect("creds");
    assert_ne!(old_key, new_key, "a new key");
    let name = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("client_id"))
            .unwrap_or_default()
            .to_owned()
    };
    assert_eq!(name(&old_key), name(&new_key), "the same Proplet");
    let (_, proplets, _) = server.client(&["get", "proplet"]);
    assert_eq!(proplets.lines().count(), 2, "one Proplet only: {proplets}");

    // Expired.
    let short = server.token(&["--ttl", "1s"]);
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let expired = join(&tls, &ca, &short, "m-3", &state("3"));
    assert!(
        stderr(&expired).contains("expired at"),
        "{}",
        stderr(&expired)
    );

    // Deleted, and a wrong secret: refused at login, without telling which.
    let gone = server.token(&[]);
    let (ok, _, err) = server.client(&["token", "delete", &gone[..6]]);
    assert!(ok, "{err}");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let deleted = join(&tls, &ca, &gone, "m-4", &state("4"));
    assert!(
        stderr(&deleted).contains("refused bootstrap token"),
        "{}",
        stderr(&deleted)
    );
    let good = server.token(&[]);
    let wrong = format!("{}.0000000000000000", &good[..6]);
    let refused = join(&tls, &ca, &wrong, "m-5", &state("5"));
    assert!(
        stderr(&refused).contains("secret is wrong"),
        "{}",
        stderr(&refused)
    );

    // Plain tcp://: the device refuses to send the token; with --insecure-enrol the broker
    // refuses a token that was not made for it.
    let plain_join = |extra: &[&str]| {
        binary("proplet")
            .args(["join", "--no-run", "--server"])
            .arg(format!("tcp://127.0.0.1:{plain}"))
            .args(["--token", &good, "--machine-id", "m-6", "--state-dir"])
            .arg(state("6"))
            .args(extra)
            .output()
            .expect("run proplet join")
    };
    let device_side = plain_join(&[]);
    assert!(stderr(&device_side).contains("refusing to send a bootstrap token over plain"));
    let broker_side = plain_join(&["--insecure-enrol"]);
    assert!(!broker_side.status.success());
    assert!(
        stderr(&broker_side).contains("only for TLS"),
        "{}",
        stderr(&broker_side)
    );
    let open = server.token(&["--insecure-enrol"]);
    let allowed = binary("proplet")
        .args(["join", "--no-run", "--insecure-enrol", "--server"])
        .arg(format!("tcp://127.0.0.1:{plain}"))
        .args(["--token", &open, "--machine-id", "m-7", "--state-dir"])
        .arg(state("7"))
        .output()
        .expect("run proplet join");
    assert!(allowed.status.success(), "{}", stderr(&allowed));

    assert_eq!(
        metric(
            &api,
            dir.path(),
            "propeller_enrolments_total{outcome=\"used_up\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &api,
            dir.path(),
            "propeller_enrolments_total{outcome=\"expired\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &api,
            dir.path(),
            "propeller_enrolments_total{outcome=\"rotated\"}"
        ),
        1
    );
    assert!(
        metric(
            &api,
            dir.path(),
            "propeller_broker_auth_failures_total{reason=\"unknown_token\"}"
        ) >= 1
    );
    assert!(
        metric(
            &api,
            dir.path(),
            "propeller_broker_auth_failures_total{reason=\"wrong_token_secret\"}"
        ) >= 1
    );
    assert!(
        metric(
            &api,
            dir.path(),
            "propeller_broker_auth_failures_total{reason=\"token_needs_tls\"}"
        ) >= 1
    );
}

#[test]
fn wrong_secrets_lock_a_token_id_and_leave_other_tokens_alone() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = TlsServer::start(dir.path());
    let (api, _plain, tls, ca) = (
        server.api.clone(),
        server.plain_port.clone(),
        server.tls_port.clone(),
        server.ca.clone(),
    );
    let target = server.token(&[]);
    let other = server.token(&[]);
    // Each refused join tries up to three logins: join until the broker has counted the ten
    // wrong secrets that lock the id.
    let wrong = format!("{}.0000000000000000", &target[..6]);
    let wrong_secrets = || {
        metric(
            &api,
            dir.path(),
            "propeller_broker_auth_failures_total{reason=\"wrong_token_secret\"}",
        )
    };
    for i in 0..10 {
        if wrong_secrets() >= 10 {
            break;
        }
        let out = join(&tls, &ca, &wrong, &format!("m-{i}"), &dir.path().join("x"));
        assert!(!out.status.success());
    }
    assert!(wrong_secrets() >= 10, "ten wrong secrets counted");
    let locked = join(&tls, &ca, &target, "m-good", &dir.path().join("locked"));
    assert!(
        !locked.status.success(),
        "the right secret is refused while locked"
    );
    assert!(
        metric(
            &api,
            dir.path(),
            "propeller_broker_auth_failures_total{reason=\"token_locked\"}"
        ) >= 1
    );
    let fine = join(&tls, &ca, &other, "m-other", &dir.path().join("other"));
    assert!(fine.status.success(), "{}", stderr(&fine));
}

#[test]
fn a_manual_approval_token_holds_devices_back_until_approved() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = TlsServer::start(dir.path());
    let (api, _plain, tls, ca) = (
        server.api.clone(),
        server.plain_port.clone(),
        server.tls_port.clone(),
        server.ca.clone(),
    );
    let token = server.token(&["--approve", "manual"]);
    let state = dir.path().join("device");
    let out = join(&tls, &ca, &token, "held", &state);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stderr(&out);
    let name = support::enrol::enrolled_name(&text);
    let agent = Running::spawn({
        let mut cmd = binary("proplet");
        cmd.arg("--state-dir").arg(&state).env("RUST_LOG", "info");
        cmd
    });
    let server_dir = dir.path().join("server");
    wait_for_phase(&api, &server_dir, &name, "Running");
    let task = inline_task("held-task", "[1, 2]").replace(
        "spec:\n",
        &format!("spec:\n  propletSelector:\n    propletId: {name}\n"),
    );
    apply_text(&api, &server_dir, "task.yaml", &task);
    std::thread::sleep(std::time::Duration::from_secs(2));
    let waiting = get_json(&api, &server_dir, &["get", "task", "held-task"]);
    assert_ne!(waiting["status"]["phase"], "completed", "{waiting:#}");
    let (_, described, _) = server.client(&["describe", "task", "held-task"]);
    assert!(described.contains("await"), "{described}");
    let (ok, out, err) = server.client(&["approve", &format!("proplet/{name}")]);
    assert!(ok, "{err}");
    assert!(out.contains("approved"), "{out}");
    let done = finished_tasks(&api, &server_dir, &["held-task"]);
    assert_eq!(done["held-task"]["status"]["phase"], "completed");
    drop(agent);
}

fn stored_key(state: &Path) -> String {
    std::fs::read_to_string(state.join("credentials.toml"))
        .expect("credentials")
        .lines()
        .find_map(|l| l.strip_prefix("client_key = "))
        .expect("client_key")
        .trim_matches('"')
        .to_owned()
}

fn wait_for_new_key(state: &Path, old: &str) -> String {
    let started = std::time::Instant::now();
    loop {
        let key = stored_key(state);
        if key != old {
            return key;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the agent never got its new key"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[test]
fn a_rotated_key_reaches_the_agent_and_the_old_one_works_only_for_the_grace_period() {
    let dir = tempfile::tempdir().expect("temp dir");
    let server = TlsServer::start(dir.path());
    let token = server.token(&[]);
    let state = dir.path().join("device");
    let out = join(&server.tls_port, &server.ca, &token, "rotating", &state);
    assert!(out.status.success(), "{}", stderr(&out));
    let name = support::enrol::enrolled_name(&stderr(&out));
    let first = stored_key(&state);
    let start_agent = || {
        Running::spawn({
            let mut cmd = binary("proplet");
            cmd.arg("--state-dir").arg(&state).env("RUST_LOG", "info");
            cmd
        })
    };
    let mut agent = start_agent();
    let server_dir = &server.data;
    wait_for_phase(&server.api, server_dir, &name, "Running");

    // A connected agent gets its new key over its session and keeps it.
    let (ok, out, err) = server.client(&["rotate", &format!("proplet/{name}"), "--grace", "4s"]);
    assert!(ok, "{err}");
    assert!(out.contains("the old one works until"), "{out}");
    let second = wait_for_new_key(&state, &first);
    let alive = "m/default-domain/c/default-channel/control/proplet/alive";
    assert!(
        support::mosquitto_pub(&server.plain_port, &name, &first, alive, "{}"),
        "the old key works during the grace period"
    );
    std::thread::sleep(std::time::Duration::from_secs(5));
    assert!(
        !support::mosquitto_pub(&server.plain_port, &name, &first, alive, "{}"),
        "the old key is refused after the grace period"
    );
    // The agent comes back with the new key.
    agent.terminate();
    let mut agent = start_agent();
    wait_for_phase(&server.api, server_dir, &name, "Running");

    // An agent that is offline during a rotation comes back within the grace period with
    // its old key and is sent the new one.
    agent.terminate();
    let (ok, _, err) = server.client(&["rotate", &format!("proplet/{name}"), "--grace", "60s"]);
    assert!(ok, "{err}");
    let agent = start_agent();
    let third = wait_for_new_key(&state, &second);
    assert_ne!(third, first);
    wait_for_phase(&server.api, server_dir, &name, "Running");
    drop(agent);
}

/// The book's "Add a device" commands (`docs/src/devices.md`), as a user types them: the
/// server with a TLS listener, a token, and `proplet join` with the token and the server's CA
/// beside the agent.
/// Only what a test must change is changed: the listeners' ports (ephemeral), the name the
/// device dials (`localhost` for `broker.example`), the token pasted in, the device's state
/// directory (`PROPLET_STATE_DIR`, not the machine's `/var/lib/proplet`).
#[test]
fn the_readme_add_a_device_steps_run_as_written() {
    let blocks = support::doc_blocks("add-device");
    assert_eq!(blocks.len(), 3, "server, token, join: {blocks:#?}");
    let work = tempfile::tempdir().expect("temp dir");
    let root = support::repo_root();
    std::os::unix::fs::symlink(root.join("target"), work.path().join("target")).expect("symlink");
    let port = || support::envtest::free_port().to_string();
    let (api_port, mqtt_port, tls_port) = (port(), port(), port());
    let api = format!("127.0.0.1:{api_port}");
    let server = blocks[0]
        .replace("8883", &tls_port)
        .replace("broker.example", "localhost");
    let token = blocks[1].trim();
    let join = blocks[2]
        .replace("8883", &tls_port)
        .replace("broker.example", "localhost")
        .replace("<token>", "\"$TOKEN\"");
    let script = format!(
        "set -euo pipefail\n{server_cmd} &\n\
         for _ in $(seq 1 150); do\n  \
           [ -f propeller-data/tls/ca.pem ] && (exec 3<>/dev/tcp/127.0.0.1/{tls_port}) 2>/dev/null && break\n  \
           sleep 0.2\n\
         done\n\
         TOKEN=$({token})\n\
         mkdir -p device && cp propeller-data/tls/ca.pem device/ && cd device\n\
         {join}\n",
        server_cmd = server.trim(),
    );
    let bin_dir = root.join("target/debug");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = std::process::Command::new("timeout");
    cmd.args(["120", "bash", "-c", &script])
        .current_dir(work.path())
        .env("PATH", path)
        .env("PROPELLER_API_LISTEN", &api)
        .env("PROPELLER_API", &api)
        .env("PROPELLER_MQTT_LISTEN", format!("127.0.0.1:{mqtt_port}"))
        .env("PROPLET_STATE_DIR", work.path().join("device/state"))
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(work.path().join("steps.out")).expect("output file"))
        .stderr(std::fs::File::create(work.path().join("steps.err")).expect("output file"));
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    support::pdeathsig(&mut cmd);
    let mut child = cmd.spawn().expect("run bash");
    let group = child.id();
    let stop = || {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", "--", &format!("-{group}")])
            .status();
    };
    let data = work.path().join("propeller-data");
    let started = std::time::Instant::now();
    let running = loop {
        let (ok, out, _) =
            support::propeller_client(&api, &data, &["get", "proplets", "-o", "json"]);
        let list: serde_json::Value = if ok {
            serde_json::from_str(&out).unwrap_or_default()
        } else {
            serde_json::Value::Null
        };
        let found = list.as_array().and_then(|items| {
            items
                .iter()
                .find(|p| {
                    p["metadata"]["labels"]["site"] == "lab" && p["status"]["phase"] == "Running"
                })
                .cloned()
        });
        if let Some(proplet) = found {
            break proplet;
        }
        if started.elapsed() > std::time::Duration::from_secs(60)
            || child.try_wait().ok().flatten().is_some()
        {
            stop();
            let _ = child.wait();
            let said = std::fs::read_to_string(work.path().join("steps.err")).unwrap_or_default();
            let tail: Vec<&str> = said.lines().rev().take(40).collect();
            panic!(
                "no Running proplet labelled site=lab after the book's steps; they said:\n{}",
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    stop();
    let _ = child.wait();
    let labels = &running["metadata"]["labels"];
    assert_eq!(labels["kubernetes.io/os"], "linux", "{running:#}");
    assert!(labels["kubernetes.io/arch"].is_string(), "{running:#}");
    let credentials = work.path().join("device/state/credentials.toml");
    assert!(credentials.exists(), "the device kept its credentials");
    println!(
        "the book's 'Add a device': {} Running with site=lab {:?} after the steps began",
        running["metadata"]["name"].as_str().unwrap_or_default(),
        started.elapsed()
    );
}
