//! A device on a bad link, made by a userspace fault proxy (this kernel has no `netem`):
//! 300 ms added each way, a 20 s stall in the middle of a burst, then every connection cut
//! mid-stream, twice; and a module sent in chunks over a 1 MB/s link cut halfway.
//! `propeller standalone` and a real agent; the agent's log counts the executions.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::fault_proxy::FaultProxy;
use support::standalone::{apply_text, get_json, inline_task, wait_for_phase};
use support::{device_agent_with, device_manifest, start_standalone};

/// Tasks in the burst: 100, or `PROPELLER_SLOW_LINK_TASKS` (the long version).
fn tasks() -> usize {
    std::env::var("PROPELLER_SLOW_LINK_TASKS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100)
}

/// The phase of proplet `name` now.
fn phase(api: &str, dir: &std::path::Path, name: &str) -> String {
    get_json(api, dir, &["get", "proplet", name])["status"]["phase"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}

/// Waits until proplet `name` is in `wanted`; how long that took.
fn until_phase(api: &str, dir: &std::path::Path, name: &str, wanted: &str) -> Duration {
    let started = Instant::now();
    while phase(api, dir, name) != wanted {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{name} did not become {wanted}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}

/// The burst's tasks that are completed now, with their results.
fn completed(api: &str, dir: &std::path::Path) -> BTreeMap<String, String> {
    let tasks = get_json(api, dir, &["get", "task"]);
    tasks
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| t["status"]["phase"] == "completed")
        .filter_map(|t| {
            Some((
                t["metadata"]["name"].as_str()?.to_owned(),
                t["status"]["results"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ))
        })
        .collect()
}

/// The device `edge` (keep-alive 5 s) reaching the broker on `port` through a fault proxy
/// that adds 300 ms each way; Running.
fn device_behind_a_proxy(
    api: &str,
    work: &std::path::Path,
    port: &str,
) -> (FaultProxy, support::Running) {
    let broker: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
    let proxy = FaultProxy::start(broker);
    proxy.set_delay(Duration::from_millis(300));
    apply_text(api, work, "edge.yaml", &device_manifest("edge", port));
    let agent = device_agent_with(
        "edge",
        proxy.port,
        &work.join("edge-state"),
        &[("PROPLET_MQTT_KEEP_ALIVE", "5s")],
    );
    wait_for_phase(api, work, "edge", "Running");
    (proxy, agent)
}

#[test]
fn a_device_on_a_slow_stalling_cut_link_loses_and_doubles_nothing() {
    let tasks = tasks();
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(
        work,
        &["--last-seen-threshold", "3s", "--liveliness-interval", "1s"],
    );
    let (proxy, agent) = device_behind_a_proxy(&api, work, &port);

    let manifests: Vec<String> = (0..tasks)
        .map(|i| inline_task(&format!("link-{i}"), &format!("[{i}, 1]")))
        .collect();
    let applied = Instant::now();
    apply_text(&api, work, "burst.yaml", &manifests.join("---\n"));
    let started = Instant::now();
    while completed(&api, work).len() < 10 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the burst does not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let before_stall = completed(&api, work).len();

    // A stall: the link holds every byte for 20 s with the connections open.
    proxy.set_stalled(true);
    let stalled = Instant::now();
    let offline_after = until_phase(&api, work, "edge", "Offline");
    std::thread::sleep(Duration::from_secs(20).saturating_sub(stalled.elapsed()));
    proxy.set_stalled(false);
    let running_after = until_phase(&api, work, "edge", "Running");

    // Cuts: every connection closed mid-stream, twice, a second apart.
    let before_cuts = completed(&api, work).len();
    proxy.cut();
    std::thread::sleep(Duration::from_secs(1));
    proxy.cut();

    let started = Instant::now();
    let done = loop {
        let done = completed(&api, work);
        if done.len() == tasks {
            break done;
        }
        assert!(
            started.elapsed()
                < Duration::from_secs(180) + Duration::from_millis(500) * tasks as u32,
            "{} of {tasks} completed",
            done.len()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let total = applied.elapsed();
    for i in 0..tasks {
        assert_eq!(
            done.get(&format!("link-{i}")).map(String::as_str),
            Some((i + 1).to_string().as_str()),
            "link-{i}"
        );
    }
    // Each task ran once on the device: a start sent again was answered with the kept result.
    let log = agent.stderr_so_far();
    let mut runs: BTreeMap<String, usize> = BTreeMap::new();
    for line in log.iter().filter(|l| l.contains("task accepted")) {
        // `task accepted task_id="UID" run=N …`: counted per task.
        if let Some((_, rest)) = line.split_once("task accepted task_id=\"") {
            let uid: String = rest.chars().take_while(|c| *c != '"').collect();
            *runs.entry(uid).or_default() += 1;
        }
    }
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
    assert_eq!(runs.len(), tasks, "executions per task: {runs:?}");
    assert!(twice.is_empty(), "run twice: {twice:?}");
    let sessions = log
        .iter()
        .filter(|l| l.contains("connected to the broker"))
        .count();
    println!(
        "slow link (300 ms each way): {before_stall} of {tasks} done at the stall; Offline {:.1} s into the 20 s stall, Running {:.1} s after it; {before_cuts} done at the cuts; all {tasks} completed {:.1} s after the apply, each run once; {sessions} agent sessions",
        offline_after.as_secs_f64(),
        running_after.as_secs_f64(),
        total.as_secs_f64()
    );
}

/// A Wasm module from an OCI registry, sent to the device in MQTT chunks over a 1 MB/s
/// link (300 ms each way) that is cut when about a third of it has crossed: the device asks
/// again once it is back, keeps the chunks it has, and runs the task once.
#[test]
fn a_chunked_module_transfer_cut_halfway_is_asked_again_and_runs_once() {
    use support::registry::{add_module, Layout, Registry};
    let Some(registry) = Registry::start(None) else {
        return;
    };
    let size = 4_000_000;
    registry.push("wasm/add:big", &add_module(size), Layout::WasmArtifact);
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(
        work,
        &[
            "--last-seen-threshold",
            "3s",
            "--registry-plain-http",
            &registry.host,
        ],
    );
    let (proxy, agent) = device_behind_a_proxy(&api, work, &port);
    proxy.set_rate(1_000_000);
    let before = proxy.bytes_to_clients();
    let applied = Instant::now();
    apply_text(
        &api,
        work,
        "big.yaml",
        &format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: big\nspec:\n  name: big\n  functionName: add\n  imageUrl: {}/wasm/add:big\n  inputs: [10, 32]\n",
            registry.host
        ),
    );
    while proxy.bytes_to_clients() < before + size as u64 / 3 {
        assert!(
            applied.elapsed() < Duration::from_secs(60),
            "the module is not sent"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let crossed = proxy.bytes_to_clients() - before;
    proxy.cut();
    let cut_at = applied.elapsed();
    let started = Instant::now();
    let task = loop {
        let task = get_json(&api, work, &["get", "task", "big"]);
        if task["status"]["phase"] == "completed" || task["status"]["phase"] == "failed" {
            break task;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "not finished: {:#}",
            task["status"]
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let done = applied.elapsed();
    assert_eq!(task["status"]["phase"], "completed", "{:#}", task["status"]);
    assert_eq!(task["status"]["results"], "42");
    let log = agent.stderr_so_far();
    let accepted = log.iter().filter(|l| l.contains("task accepted")).count();
    assert_eq!(accepted, 1, "one execution");
    let asked_again = log
        .iter()
        .filter(|l| l.contains("chunks asked for again"))
        .count();
    assert!(asked_again >= 1, "the device asked again after the cut");
    println!(
        "a {size}-byte module over 1 MB/s: {crossed} bytes crossed when the link was cut {:.1} s after the apply; completed with 42, {:.1} s after the apply, executed once; asked again {asked_again} time(s)",
        cut_at.as_secs_f64(),
        done.as_secs_f64()
    );
}
