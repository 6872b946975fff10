//! Agent upgrades in waves (`PropletUpgrade`) with real agents built twice: the suite's
//! `proplet`, and one built with `PROPLET_BUILD_VERSION=9.9.0-upgrade` by
//! `scripts/build-upgrade-agent.sh` (which `scripts/test.sh` runs first), served over HTTP
//! on loopback and pinned by its digest.

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use support::standalone::{apply_text, get_json, wait_for_phase};
use support::{binary, device_agent_env, device_manifest, start_standalone, Running};

/// The version the second agent reports.
const NEW_VERSION: &str = "9.9.0-upgrade";

/// The second agent, built by `scripts/build-upgrade-agent.sh`.
fn new_agent() -> Vec<u8> {
    let path = std::env::var_os("PROPLET_UPGRADE_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| support::repo_root().join("target/upgrade-agent/proplet"));
    std::fs::read(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; build it with scripts/build-upgrade-agent.sh (scripts/test.sh does)",
            path.display()
        )
    })
}

/// The version the suite's own agent reports.
fn old_version() -> String {
    let out = binary("proplet")
        .arg("--version")
        .output()
        .expect("run proplet --version");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .nth(1)
        .expect("a version")
        .to_owned()
}

/// Serves `body` on loopback until dropped, `pace` bytes every 10 ms when set.
struct FileServer {
    url: String,
    stop: Arc<AtomicBool>,
}

impl FileServer {
    fn start(body: Vec<u8>, pace: Option<usize>) -> Self {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}/proplet", listener.local_addr().expect("addr"));
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let body = Arc::new(body);
        std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(600);
            while !stopped.load(Ordering::Relaxed) && Instant::now() < deadline {
                let Ok((mut socket, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                let body = body.clone();
                std::thread::spawn(move || {
                    let _ = socket.set_nonblocking(false);
                    let _ = socket.set_read_timeout(Some(Duration::from_secs(2)));
                    let mut head = [0u8; 4096];
                    let _ = socket.read(&mut head);
                    let _ = write!(
                        socket,
                        "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    match pace {
                        None => {
                            let _ = socket.write_all(&body);
                        }
                        Some(step) => {
                            for piece in body.chunks(step) {
                                if socket.write_all(piece).is_err() {
                                    return;
                                }
                                std::thread::sleep(Duration::from_millis(10));
                            }
                        }
                    }
                });
            }
        });
        Self { url, stop }
    }

    /// The URL pinned with `body`'s digest.
    fn pinned(&self, body: &[u8]) -> String {
        format!("{}#sha256={}", self.url, sha256_hex(body))
    }
}

fn sha256_hex(body: &[u8]) -> String {
    Sha256::digest(body)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl Drop for FileServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// An agent restarted whenever it exits, as systemd's `Restart=always` does.
struct Supervised {
    stop: Arc<AtomicBool>,
    current: Arc<Mutex<Option<Running>>>,
    log: Arc<Mutex<Vec<String>>>,
    starts: Arc<Mutex<usize>>,
}

impl Supervised {
    fn start(name: &str, port: &str, state: &Path) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let current: Arc<Mutex<Option<Running>>> = Arc::new(Mutex::new(None));
        let log = Arc::new(Mutex::new(Vec::new()));
        let starts = Arc::new(Mutex::new(0));
        let env = device_agent_env(name, port, state);
        let (stopped, slot, lines, count) =
            (stop.clone(), current.clone(), log.clone(), starts.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                let mut cmd = binary("proplet");
                cmd.envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
                *slot.lock().expect("slot") = Some(Running::spawn(cmd));
                *count.lock().expect("count") += 1;
                loop {
                    std::thread::sleep(Duration::from_millis(100));
                    let mut guard = slot.lock().expect("slot");
                    let Some(running) = guard.as_mut() else {
                        return;
                    };
                    lines.lock().expect("log").extend(running.stderr.try_iter());
                    if matches!(running.child.try_wait(), Ok(Some(_))) {
                        *guard = None;
                        break;
                    }
                }
                // systemd's RestartSec, shortened.
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        Self {
            stop,
            current,
            log,
            starts,
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(mut running) = self.current.lock().ok().and_then(|mut c| c.take()) {
            running.terminate();
        }
    }
}

fn upgrade_manifest(name: &str, url: &str, wave_size: usize, extra: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: PropletUpgrade\nmetadata:\n  name: {name}\nspec:\n  version: {NEW_VERSION}\n  artifacts:\n  - arch: {arch}\n    url: \"{url}\"\n  waveSize: {wave_size}\n  healthSeconds: 30\n  deadlineSeconds: 120\n{extra}",
        arch = std::env::consts::ARCH
    )
}

fn rollout(api: &str, dir: &Path, name: &str) -> serde_json::Value {
    get_json(api, dir, &["get", "propletupgrade", name])
}

/// Waits until rollout `name` is in `phase`; its object.
fn wait_for_rollout(
    api: &str,
    dir: &Path,
    name: &str,
    phase: &str,
    limit: Duration,
) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let object = rollout(api, dir, name);
        if object["status"]["phase"] == phase {
            return object;
        }
        assert!(
            started.elapsed() < limit,
            "rollout {name} not {phase} after {limit:?}: {:#}",
            object["status"]
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn reported_version(api: &str, dir: &Path, proplet: &str) -> String {
    get_json(api, dir, &["get", "proplet", proplet])["status"]["metadata"]["propletVersion"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

fn devices(api: &str, work: &Path, port: &str, names: &[String]) -> Vec<Running> {
    for name in names {
        apply_text(
            api,
            work,
            &format!("{name}.yaml"),
            &device_manifest(name, port),
        );
    }
    let agents: Vec<Running> = names
        .iter()
        .map(|name| {
            let mut cmd = binary("proplet");
            cmd.envs(device_agent_env(
                name,
                port,
                &work.join(format!("{name}-state")),
            ));
            Running::spawn(cmd)
        })
        .collect();
    for name in names {
        wait_for_phase(api, work, name, "Running");
    }
    agents
}

#[test]
fn twenty_agents_upgrade_in_four_waves_and_report_the_new_version() {
    let body = new_agent();
    let server = FileServer::start(body.clone(), None);
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(work, &[]);
    let names: Vec<String> = (0..20).map(|i| format!("wave-{i:02}")).collect();
    let agents = devices(&api, work, &port, &names);
    let pids: Vec<u32> = agents.iter().map(|a| a.child.id()).collect();
    let old = old_version();
    assert_ne!(old, NEW_VERSION);
    assert_eq!(reported_version(&api, work, "wave-00"), old);

    let applied = Instant::now();
    apply_text(
        &api,
        work,
        "roll.yaml",
        &upgrade_manifest("roll", &server.pinned(&body), 5, ""),
    );
    // Each wave's end, as the status shows it moving on.
    let mut wave_ends = Vec::new();
    let mut seen_wave = 0;
    let done = loop {
        let object = rollout(&api, work, "roll");
        let status = &object["status"];
        let wave = status["wave"].as_i64().unwrap_or_default();
        while seen_wave < wave {
            wave_ends.push(applied.elapsed());
            seen_wave += 1;
        }
        if status["phase"] == "Completed" {
            wave_ends.push(applied.elapsed());
            break object;
        }
        assert_ne!(status["phase"], "Stopped", "{status:#}");
        assert!(
            applied.elapsed() < Duration::from_secs(600),
            "not done: {status:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let status = &done["status"];
    assert_eq!(status["waves"], 4);
    assert_eq!(status["healthy"], 20, "{status:#}");
    assert_eq!(status["failed"], 0);
    for (i, p) in status["proplets"]
        .as_array()
        .expect("proplets")
        .iter()
        .enumerate()
    {
        assert_eq!(p["wave"], i / 5, "{p}");
        assert_eq!(p["state"], "Healthy", "{p}");
    }
    for name in &names {
        wait_for_phase(&api, work, name, "Running");
        assert_eq!(reported_version(&api, work, name), NEW_VERSION, "{name}");
    }
    // Each agent restarted in place (exec): the same process, now the new binary.
    for (agent, pid) in agents.iter().zip(&pids) {
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).expect("exe");
        assert!(
            exe.to_string_lossy().contains("/agent/"),
            "{pid} runs {}",
            exe.display()
        );
        assert_eq!(agent.child.id(), *pid);
    }
    let per_wave: Vec<String> = wave_ends
        .windows(2)
        .map(|w| format!("{:.1}", (w[1] - w[0]).as_secs_f64()))
        .collect();
    // Where a device's time went, from its own log: the request to the verified install,
    // and the restart to healthy.
    let mut install = Vec::new();
    let mut restart = Vec::new();
    for agent in &agents {
        let log = agent.stderr_so_far();
        let at = |needle: &str| {
            log.iter()
                .find(|l| l.contains(needle))
                .and_then(|l| log_time(l))
        };
        if let (Some(asked), Some(installed), Some(healthy)) = (
            at("downloading a new agent"),
            at("installed; restarting into it"),
            at("the new agent is healthy"),
        ) {
            install.push((installed - asked).as_seconds_f64());
            restart.push((healthy - installed).as_seconds_f64());
        }
    }
    assert_eq!(install.len(), 20, "every agent logged its steps");
    println!(
        "20 agents in 4 waves of 5 on loopback ({} MiB binary): first wave done {:.1} s after the apply, then {} s per wave; all on {NEW_VERSION} {:.1} s after the apply; per device, download to verified install {:.1} s and restart to healthy {:.1} s (medians)",
        body.len() / (1024 * 1024),
        wave_ends[0].as_secs_f64(),
        per_wave.join(", "),
        applied.elapsed().as_secs_f64(),
        median(&mut install),
        median(&mut restart),
    );
}

/// The timestamp at the start of an agent's log line.
fn log_time(line: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    let stamp = line.split_whitespace().next()?;
    chrono::DateTime::parse_from_rfc3339(stamp)
        .ok()
        .map(|t| t.with_timezone(&chrono::Utc))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or_default()
}

#[test]
fn a_broken_agent_stops_the_rollout_at_its_first_wave_and_those_devices_go_back_by_themselves() {
    // Passes the `--version` check, then exits at start, as a binary with a broken loader or
    // a panic at start-up would.
    let broken = format!(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo proplet {NEW_VERSION}; exit 0; fi\necho broken agent >&2\nexit 3\n"
    )
    .into_bytes();
    let server = FileServer::start(broken.clone(), None);
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(work, &[]);
    let names: Vec<String> = (0..6).map(|i| format!("broken-{i}")).collect();
    for name in &names {
        apply_text(
            &api,
            work,
            &format!("{name}.yaml"),
            &device_manifest(name, &port),
        );
    }
    let agents: Vec<Supervised> = names
        .iter()
        .map(|n| Supervised::start(n, &port, &work.join(format!("{n}-state"))))
        .collect();
    for name in &names {
        wait_for_phase(&api, work, name, "Running");
    }
    let old = old_version();
    apply_text(
        &api,
        work,
        "roll.yaml",
        &upgrade_manifest(
            "roll",
            &server.pinned(&broken),
            3,
            "  failureThreshold: 1\n",
        ),
    );
    let stopped = wait_for_rollout(&api, work, "roll", "Stopped", Duration::from_secs(120));
    // Every device of the first wave comes back on the old agent and says why.
    let started = Instant::now();
    let status = loop {
        let status = rollout(&api, work, "roll")["status"].clone();
        let first: Vec<&serde_json::Value> = status["proplets"]
            .as_array()
            .expect("proplets")
            .iter()
            .filter(|p| p["wave"] == 0)
            .collect();
        if first.iter().all(|p| p["state"] == "RolledBack") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "first wave not rolled back: {status:#} (stopped at {:#})",
            stopped["status"]
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(status["wave"], 0, "no second wave: {status:#}");
    for p in status["proplets"].as_array().expect("proplets") {
        if p["wave"] == 0 {
            assert!(
                p["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("stopped before it was healthy")),
                "{p}"
            );
        } else {
            assert_eq!(p["state"], "Pending", "{p}");
        }
    }
    for name in &names {
        wait_for_phase(&api, work, name, "Running");
        assert_eq!(reported_version(&api, work, name), old, "{name}");
    }
    for (name, agent) in names.iter().zip(&agents).take(3) {
        let log = agent.log.lock().expect("log").clone();
        assert!(
            log.iter().any(|l| l.contains("broken agent")),
            "{name} never ran the broken agent: {log:?}"
        );
        assert!(*agent.starts.lock().expect("starts") >= 2, "{name}");
    }
    assert!(stopped["status"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("failureThreshold")));
}

#[test]
fn a_digest_mismatch_is_refused_before_anything_is_replaced_and_a_killed_download_is_done_again() {
    let body = new_agent();
    // 64 KiB every 10 ms: about 6 MiB/s, so a kill lands mid-download.
    let slow = FileServer::start(body.clone(), Some(64 * 1024));
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(work, &[]);
    let names = vec!["pinned".to_owned(), "killed".to_owned()];
    let mut agents = devices(&api, work, &port, &names);
    let old = old_version();

    // A wrong digest: refused, and nothing installed.
    let wrong = format!("{}#sha256={}", slow.url, "0".repeat(64));
    let manifest = upgrade_manifest("wrong", &wrong, 1, "  selector:\n    role: pinned\n");
    let labelled = device_manifest("pinned", &port).replace(
        "metadata:\n  name: pinned\nspec:",
        "metadata:\n  name: pinned\n  labels:\n    role: pinned\nspec:",
    );
    apply_text(&api, work, "pinned-labelled.yaml", &labelled);
    apply_text(&api, work, "wrong.yaml", &manifest);
    let refused = wait_for_rollout(&api, work, "wrong", "Stopped", Duration::from_secs(120));
    let p = &refused["status"]["proplets"][0];
    assert_eq!(p["name"], "pinned");
    assert_eq!(p["state"], "Failed", "{p}");
    assert!(
        p["reason"]
            .as_str()
            .is_some_and(|r| r.contains("digest mismatch")),
        "{p}"
    );
    let installed = work.join("pinned-state/agent");
    let binaries = std::fs::read_dir(&installed)
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| e.path().join("proplet").exists())
                .count()
        })
        .unwrap_or(0);
    assert_eq!(binaries, 0, "nothing is installed after a digest mismatch");
    assert_eq!(reported_version(&api, work, "pinned"), old);

    // A download cut by a kill: the agent comes back, is asked again, and finishes.
    let labelled = device_manifest("killed", &port).replace(
        "metadata:\n  name: killed\nspec:",
        "metadata:\n  name: killed\n  labels:\n    role: killed\nspec:",
    );
    apply_text(&api, work, "killed-labelled.yaml", &labelled);
    apply_text(
        &api,
        work,
        "resume.yaml",
        &upgrade_manifest(
            "resume",
            &slow.pinned(&body),
            1,
            "  selector:\n    role: killed\n",
        ),
    );
    let killed = &mut agents[1];
    killed.stderr_line_within("downloading a new agent", Duration::from_secs(60));
    std::thread::sleep(Duration::from_secs(1));
    let _ = killed.child.kill();
    let _ = killed.child.wait();
    let state = work.join("killed-state");
    let mut cmd = binary("proplet");
    cmd.envs(device_agent_env("killed", &port, &state));
    let again = Running::spawn(cmd);
    let done = wait_for_rollout(&api, work, "resume", "Completed", Duration::from_secs(300));
    assert_eq!(done["status"]["healthy"], 1, "{:#}", done["status"]);
    wait_for_phase(&api, work, "killed", "Running");
    assert_eq!(reported_version(&api, work, "killed"), NEW_VERSION);
    drop(again);
}

#[test]
fn on_a_real_api_server_a_rollout_is_held_resumed_and_reverted_by_editing_it_with_kubectl() {
    use support::envtest::{free_port, Options};
    use support::kube::{apply, cluster, get, mqtt_port, operator_command, wait_phase};
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let body = new_agent();
    let server = FileServer::start(body.clone(), None);
    let operator = Running::spawn(operator_command(&kubeconfig, free_port()));
    let mqtt = mqtt_port(&operator);
    let ns = "fleet";
    cp.kubectl_ok(&["create", "namespace", ns]);
    let names: Vec<String> = (0..4).map(|i| format!("edge-{i}")).collect();
    let mut agents = Vec::new();
    for name in &names {
        apply(&cp, ns, &device_manifest(name, mqtt));
        agents.push(support::device_agent(
            name,
            mqtt,
            &cp.scratch().join(format!("{name}-state")),
        ));
    }
    for name in &names {
        wait_phase(&cp, ns, "proplet", name, "Running");
    }
    let old = old_version();
    let version_of = |name: &str| {
        get(&cp, ns, "proplet", name).expect("proplet")["status"]["metadata"]["propletVersion"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };

    // Held: nothing is asked.
    apply(
        &cp,
        ns,
        &upgrade_manifest("roll", &server.pinned(&body), 2, "  paused: true\n"),
    );
    let held = wait_phase(&cp, ns, "propletupgrade", "roll", "Paused");
    std::thread::sleep(Duration::from_secs(2));
    for name in &names {
        assert_eq!(
            version_of(name),
            old,
            "{name} upgraded while paused: {held:#}"
        );
    }
    let edit = |patch: &str| {
        cp.kubectl_ok(&[
            "-n",
            ns,
            "patch",
            "propletupgrade",
            "roll",
            "--type",
            "merge",
            "-p",
            patch,
        ]);
    };
    // Resumed by editing it.
    edit(r#"{"spec":{"paused":false}}"#);
    let wait_rollout = |phase: &str| {
        let started = Instant::now();
        loop {
            let object = get(&cp, ns, "propletupgrade", "roll").expect("rollout");
            if object["status"]["phase"] == phase {
                return object;
            }
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "not {phase}: {:#}",
                object["status"]
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    let done = wait_rollout("Completed");
    assert_eq!(done["status"]["healthy"], 4, "{:#}", done["status"]);
    let columns = cp.kubectl_ok(&["-n", ns, "get", "propletupgrades"]);
    assert!(
        columns.contains("Completed") && columns.contains("2/2") && columns.contains(NEW_VERSION),
        "{columns}"
    );
    for name in &names {
        wait_phase(&cp, ns, "proplet", name, "Running");
        let started = Instant::now();
        while version_of(name) != NEW_VERSION {
            assert!(started.elapsed() < Duration::from_secs(60), "{name}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    // Reverted by editing it: every device goes back to the agent it ran before.
    edit(r#"{"spec":{"revert":true}}"#);
    wait_rollout("Reverted");
    for name in &names {
        let started = Instant::now();
        while version_of(name) != old {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "{name} still new"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    println!("kubernetes: 4 agents held, resumed to {NEW_VERSION} in 2 waves, then reverted to {old}, all by kubectl edits");
    drop(agents);
}

/// The book's "Upgrade the agents" commands (`docs/src/upgrades.md`), as a user types them;
/// only the version, the architecture and the download URL are this test's.
#[test]
fn the_books_upgrade_steps_run_as_written() {
    let blocks = support::doc_blocks("upgrade-agents");
    assert_eq!(blocks.len(), 2, "apply, then follow: {blocks:#?}");
    let body = new_agent();
    let server = FileServer::start(body, None);
    let (_dir, work, data) = support::book_workdir();
    let (_server, api, port) = start_standalone(&data, &[]);
    let names = ["book-0".to_owned(), "book-1".to_owned()];
    let _agents = devices(&api, &data, &port, &names);
    let script = blocks
        .concat()
        .replace("VERSION=0.2.0", &format!("VERSION={NEW_VERSION}"))
        .replace("ARCH=aarch64", &format!("ARCH={}", std::env::consts::ARCH))
        .replace(
            "URL=https://downloads.example/proplet-$VERSION-$ARCH",
            &format!("URL={}", server.url),
        );
    let printed = support::run_book_script(&work, &api, &script);
    assert!(
        printed.contains("WAVE") && printed.contains(NEW_VERSION),
        "{printed}"
    );
    let name = format!("agent-{NEW_VERSION}");
    let done = wait_for_rollout(&api, &data, &name, "Completed", Duration::from_secs(300));
    assert_eq!(done["status"]["healthy"], 2, "{:#}", done["status"]);
    for proplet in &names {
        wait_for_phase(&api, &data, proplet, "Running");
    }
}

/// An agent pushed to an OCI registry as a plain file (the layout `oras push` makes) is
/// installed from its blob: a registry serves every blob at an HTTP(S) URL named by its
/// digest, which is also the pin.
#[test]
fn an_agent_pushed_to_an_oci_registry_is_installed_from_its_blob() {
    let Some(registry) = support::registry::Registry::start(None) else {
        return;
    };
    let body = new_agent();
    registry.push(
        &format!("agents/proplet:{NEW_VERSION}"),
        &body,
        support::registry::Layout::PlainFile,
    );
    let digest = sha256_hex(&body);
    let url = format!(
        "http://{}/v2/agents/proplet/blobs/sha256:{digest}#sha256={digest}",
        registry.host
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(work, &[]);
    let names = vec!["oci-0".to_owned(), "oci-1".to_owned()];
    let _agents = devices(&api, work, &port, &names);
    apply_text(
        &api,
        work,
        "oci.yaml",
        &upgrade_manifest("from-oci", &url, 2, ""),
    );
    let done = wait_for_rollout(
        &api,
        work,
        "from-oci",
        "Completed",
        Duration::from_secs(300),
    );
    assert_eq!(done["status"]["healthy"], 2, "{:#}", done["status"]);
    for name in &names {
        wait_for_phase(&api, work, name, "Running");
        assert_eq!(reported_version(&api, work, name), NEW_VERSION, "{name}");
    }
    assert!(
        registry.blob_gets(&format!("sha256:{digest}")) >= 2,
        "each device fetched the blob from the registry"
    );
}
