//! Devices whose clocks are wrong by an hour, either way (the real agent under Debian's
//! `faketime`, its monotonic clock left true as a device's is): liveness, time limits and
//! the task's times are judged by propeller's clock, and nothing is refused or expired
//! because of the device's.

mod support;

use std::process::Command;
use std::time::Duration;

use chrono::{DateTime, Utc};
use support::standalone::{apply_text, finished_tasks_within, get_json, wait_for_phase};
use support::{binary, device_agent_env, device_manifest, start_standalone, Running};

/// The agent of device `name` with its wall clock moved by `offset` (faketime's syntax,
/// e.g. `+1h`), or `None` when faketime is missing outside CI.
fn skewed_agent(name: &str, offset: &str, port: &str, state: &std::path::Path) -> Option<Running> {
    if Command::new("faketime").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "faketime is missing");
        println!("SKIPPED: faketime is missing (apt-get install faketime)");
        return None;
    }
    let program = binary("proplet").get_program().to_owned();
    let mut cmd = Command::new("faketime");
    cmd.args(["-f", offset])
        .arg(program)
        .envs(device_agent_env(name, port, state))
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    Some(Running::spawn(cmd))
}

fn time_of(value: &serde_json::Value) -> DateTime<Utc> {
    value
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("not a time: {value}"))
}

#[test]
fn devices_an_hour_ahead_or_behind_stay_running_and_their_tasks_finish() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (_server, api, port) = start_standalone(
        dir.path(),
        &["--last-seen-threshold", "3s", "--liveliness-interval", "1s"],
    );
    let mut agents = Vec::new();
    for (name, offset) in [("ahead", "+1h"), ("behind", "-1h")] {
        apply_text(
            &api,
            dir.path(),
            &format!("{name}.yaml"),
            &device_manifest(name, &port),
        );
        let state = dir.path().join(format!("{name}-state"));
        let Some(agent) = skewed_agent(name, offset, &port, &state) else {
            return;
        };
        agents.push(agent);
    }
    let started = Utc::now();
    for name in ["ahead", "behind"] {
        wait_for_phase(&api, dir.path(), name, "Running");
    }
    // The skew is real: each agent's log lines carry its own, wrong, time.
    for (agent, hours) in agents.iter().zip([1i64, -1]) {
        let line = agent.stderr_line("proplet starting");
        let logged: DateTime<Utc> = line
            .split_whitespace()
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no time in {line:?}"));
        let skew = (logged - Utc::now()).num_minutes();
        assert!((skew - hours * 60).abs() < 5, "skew {skew} min: {line}");
    }
    // Three liveness thresholds later both are still Running: their heartbeats are timed
    // on arrival by propeller's clock, not by the device's.
    std::thread::sleep(Duration::from_secs(9));
    for name in ["ahead", "behind"] {
        let proplet = get_json(&api, dir.path(), &["get", "proplet", name]);
        assert_eq!(
            proplet["status"]["phase"], "Running",
            "{name}: {:#}",
            proplet["status"]
        );
        let seen = time_of(&proplet["status"]["lastSeen"]);
        assert!(
            (seen - Utc::now()).num_seconds().abs() < 60,
            "{name}: lastSeen {seen} is not propeller's time"
        );
    }
    // A task with a 20 s time limit on each: neither is expired by the device's clock, and
    // the task's times are propeller's.
    let spin = support::standalone::spin_module();
    for name in ["ahead", "behind"] {
        apply_text(
            &api,
            dir.path(),
            &format!("task-{name}.yaml"),
            &format!(
                "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: on-{name}\nspec:\n  name: on-{name}\n  functionName: spin\n  file: {spin}\n  inputs: [1000000]\n  timeoutSeconds: 20\n  propletSelector: {{propletId: {name}}}\n"
            ),
        );
    }
    let tasks = finished_tasks_within(
        &api,
        dir.path(),
        &["on-ahead", "on-behind"],
        Duration::from_secs(60),
    );
    for name in ["on-ahead", "on-behind"] {
        let status = &tasks[name]["status"];
        assert_eq!(status["phase"], "completed", "{name}: {status:#}");
        assert_eq!(status["results"], "1000000", "{name}: {status:#}");
        for field in ["startedAt", "finishedAt"] {
            let at = time_of(&status[field]);
            assert!(
                at >= started - chrono::Duration::seconds(1) && at <= Utc::now(),
                "{name}: {field} {at} is not propeller's time"
            );
        }
    }
    drop(agents);
}
