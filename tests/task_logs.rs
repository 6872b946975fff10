//! Task logs end to end: a real agent runs Wasm that prints, standalone keeps what it sent,
//! and `propeller logs` prints it, following it live, after a broker outage, at the rate
//! limit, and never with lines a device sent for a task that is not its own.

mod support;

use std::sync::mpsc::RecvTimeoutError;
use std::time::{Duration, Instant};

use support::standalone::{apply_text, finished_tasks_within, wait_for_phase};
use support::{binary, propeller_client, start_standalone, Running};

/// A Task `name` printing `count` lines `gap_ms` apart on the proplet `proplet`.
fn printer_task(name: &str, proplet: &str, count: u32, gap_ms: u32) -> String {
    let file = support::printer_module();
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: print\n  file: {file}\n  inputs: [{count}, {gap_ms}]\n  propletSelector:\n    propletId: {proplet}\n"
    )
}

/// The device `name`'s Proplet and its real agent, Running; `env` goes to the agent.
fn device(
    api: &str,
    dir: &std::path::Path,
    port: &str,
    name: &str,
    env: &[(&str, &str)],
) -> Running {
    apply_text(
        api,
        dir,
        &format!("{name}.yaml"),
        &support::device_manifest(name, port),
    );
    let agent = support::device_agent_with(name, port, &dir.join(format!("{name}-state")), env);
    wait_for_phase(api, dir, name, "Running");
    agent
}

/// `propeller logs` with `args`; its stdout lines.
fn logs(api: &str, dir: &std::path::Path, args: &[&str]) -> Vec<String> {
    let mut all = vec!["logs"];
    all.extend_from_slice(args);
    let (ok, out, err) = propeller_client(api, dir, &all);
    assert!(ok, "propeller logs {args:?}: {err}");
    out.lines().map(str::to_owned).collect()
}

fn numbered(count: u32) -> Vec<String> {
    (0..=count).map(|i| format!("line {i}")).collect()
}

#[test]
fn a_tasks_output_is_followed_live_and_kept_after_it_ends() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = device(&api, dir.path(), &port, "printer", &[]);
    apply_text(
        &api,
        dir.path(),
        "t.yaml",
        &printer_task("chatty", "printer", 12, 400),
    );

    let mut follow = binary("propeller");
    follow
        .args(["logs", "task/chatty", "-f", "--server", &api, "--data-dir"])
        .arg(dir.path());
    let follower = Running::spawn(follow);
    let started = Instant::now();
    let mut seen = Vec::new();
    let mut first_at = None;
    loop {
        match follower.stdout.recv_timeout(Duration::from_secs(30)) {
            Ok(line) => {
                first_at.get_or_insert_with(|| started.elapsed());
                seen.push(line);
            }
            Err(RecvTimeoutError::Disconnected) => break,
            Err(RecvTimeoutError::Timeout) => panic!("no line for 30 s; so far {seen:?}"),
        }
    }
    let ended_at = started.elapsed();
    // Followed live: the first line came seconds before the follow ended with the task.
    let first_at = first_at.expect("a line");
    assert!(
        ended_at - first_at > Duration::from_secs(3),
        "first line after {first_at:?}, end after {ended_at:?}"
    );
    assert_eq!(seen, numbered(12), "every line once, in order");
    let task = finished_tasks_within(&api, dir.path(), &["chatty"], Duration::from_secs(30));
    assert_eq!(task["chatty"]["status"]["phase"], "completed");

    // Kept after the end: the tail, and nothing for another proplet.
    assert_eq!(
        logs(&api, dir.path(), &["task/chatty", "--tail", "2"]),
        ["line 11", "line 12"]
    );
    assert!(logs(&api, dir.path(), &["task/chatty", "--proplet", "other"]).is_empty());
    assert_eq!(
        logs(
            &api,
            dir.path(),
            &["task/chatty", "--prefix", "--tail", "1"]
        ),
        ["[printer] line 12"]
    );
    let (ok, _, err) = propeller_client(&api, dir.path(), &["logs", "task/nope"]);
    assert!(!ok && err.contains("nope"), "{err}");
}

#[test]
fn lines_printed_while_the_broker_is_down_arrive_after_it() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (mut server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = device(&api, dir.path(), &port, "printer", &[]);
    apply_text(
        &api,
        dir.path(),
        "t.yaml",
        &printer_task("through", "printer", 20, 500),
    );
    // Wait for the first lines, then take propeller (and its broker) away for 4 s.
    let deadline = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let lines = logs(&api, dir.path(), &["task/through"]);
        if lines.len() >= 3 {
            break lines.len();
        }
        assert!(Instant::now() < deadline, "no lines: {lines:?}");
        std::thread::sleep(Duration::from_millis(200));
    };
    server.terminate();
    std::thread::sleep(Duration::from_secs(4));
    let (_server, api, _) =
        start_standalone(dir.path(), &["--mqtt-listen", &format!("127.0.0.1:{port}")]);
    let task = finished_tasks_within(&api, dir.path(), &["through"], Duration::from_secs(60));
    assert_eq!(task["through"]["status"]["phase"], "completed");
    // The restarted propeller holds what came after it went away: the lines printed during
    // the outage among them, none missing to the end.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let lines = logs(&api, dir.path(), &["task/through"]);
        if lines.last().map(String::as_str) == Some("line 20") {
            let first: u32 = lines[0]
                .strip_prefix("line ")
                .and_then(|n| n.parse().ok())
                .expect("a numbered line");
            assert!(
                first as usize <= before + 2,
                "the lines printed while propeller was down are missing: {lines:?}"
            );
            assert_eq!(
                lines,
                numbered(20)[first as usize..],
                "none lost after {first}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every line arrived: {lines:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_flood_is_cut_at_the_rate_and_says_how_many_lines_were_dropped() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = device(
        &api,
        dir.path(),
        &port,
        "printer",
        &[("PROPLET_LOG_LINES_PER_SECOND", "50")],
    );
    apply_text(
        &api,
        dir.path(),
        "t.yaml",
        &printer_task("flood", "printer", 5000, 0),
    );
    finished_tasks_within(&api, dir.path(), &["flood"], Duration::from_secs(60));
    // The last count arrives when the run's streams close, just after its result.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (lines, dropped) = loop {
        let lines = logs(&api, dir.path(), &["task/flood"]);
        let dropped: usize = lines
            .iter()
            .filter_map(|l| l.strip_prefix("[agent: "))
            .map(|l| {
                assert!(l.ends_with("lines dropped: over 50 lines a second]"), "{l}");
                l.split_whitespace()
                    .next()
                    .and_then(|n| n.parse::<usize>().ok())
                    .expect("a count")
            })
            .sum();
        let logged = lines.iter().filter(|l| l.starts_with("line ")).count();
        if logged + dropped >= 5001 || Instant::now() > deadline {
            break (lines, dropped);
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    let logged = lines.iter().filter(|l| l.starts_with("line ")).count();
    assert!(
        logged <= 150,
        "{logged} lines went through a limit of 50 a second"
    );
    assert_eq!(
        logged + dropped,
        5001,
        "every line is logged or counted as dropped"
    );
}

#[test]
fn a_device_cannot_log_lines_for_another_devices_task() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server, api, port) = start_standalone(dir.path(), &[]);
    let _agent = device(&api, dir.path(), &port, "printer", &[]);
    apply_text(
        &api,
        dir.path(),
        "m.yaml",
        &support::device_manifest("mallory", &port),
    );
    apply_text(
        &api,
        dir.path(),
        "t.yaml",
        &printer_task("victim", "printer", 2, 0),
    );
    let task = finished_tasks_within(&api, dir.path(), &["victim"], Duration::from_secs(30));
    let uid = task["victim"]["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_owned();
    let deadline = Instant::now() + Duration::from_secs(20);
    while logs(&api, dir.path(), &["task/victim"]) != numbered(2) {
        assert!(
            Instant::now() < deadline,
            "the device's own lines never arrived"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let topic = "m/d1/c/c1/control/proplet/logs";
    let line = |proplet: &str| {
        format!(
            r#"{{"task_id":"{uid}","proplet_id":"{proplet}","lines":[{{"t":1,"s":"stdout","l":"forged by mallory"}}]}}"#
        )
    };
    // As itself, for a task it does not run: propeller drops it.
    assert!(support::mosquitto_pub(
        &port,
        "mallory",
        "mallory-secret",
        topic,
        &line("mallory")
    ));
    server.stderr_line("task output from a device the task is not assigned to; dropped");
    // In the name of the device that runs it: the broker drops it as spoofed.
    assert!(support::mosquitto_pub(
        &port,
        "mallory",
        "mallory-secret",
        topic,
        &line("printer")
    ));
    server.stderr_line("reason=\"spoofed\"");
    let lines = logs(&api, dir.path(), &["task/victim"]);
    assert_eq!(lines, numbered(2), "only the device's own lines: {lines:?}");
}

/// The book's "Read a task's output" commands (`docs/src/logs.md`), as a user types them;
/// only the task's name is this test's.
#[test]
fn the_books_log_steps_run_as_written() {
    let blocks = support::doc_blocks("task-logs");
    assert_eq!(blocks.len(), 2, "tail, then follow: {blocks:#?}");
    let (_dir, work, data) = support::book_workdir();
    let (_server, api, port) = start_standalone(&data, &[]);
    let _agent = device(&api, &data, &port, "printer", &[]);
    apply_text(
        &api,
        &data,
        "t.yaml",
        &printer_task("book", "printer", 8, 300),
    );
    let script = blocks.concat().replace("TASK=hello", "TASK=book");
    let printed = support::run_book_script(&work, &api, &script);
    // The follow printed every line and ended with the task.
    assert!(
        printed.ends_with(&format!("{}\n", numbered(8).join("\n"))),
        "{printed}"
    );
}
