//! A device on a bad link, made by a userspace fault proxy (this kernel has no `netem`):
//! 300 ms added each way, a 20 s stall in the middle of a burst, then every connection cut
//! mid-stream, twice. `propeller standalone` and a real agent; the agent's log counts the
//! executions.

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

#[test]
fn a_device_on_a_slow_stalling_cut_link_loses_and_doubles_nothing() {
    let tasks = tasks();
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let (_server, api, port) = start_standalone(
        work,
        &["--last-seen-threshold", "3s", "--liveliness-interval", "1s"],
    );
    let broker: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
    let proxy = FaultProxy::start(broker);
    proxy.set_delay(Duration::from_millis(300));
    apply_text(&api, work, "edge.yaml", &device_manifest("edge", &port));
    let agent = device_agent_with(
        "edge",
        proxy.port,
        &work.join("edge-state"),
        &[("PROPLET_MQTT_KEEP_ALIVE", "5s")],
    );
    wait_for_phase(&api, work, "edge", "Running");

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
