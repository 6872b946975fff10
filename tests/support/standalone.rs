//! Driving `propeller standalone` through its client commands: apply manifests, read
//! objects as JSON, wait for phases and results.

use super::{propeller_client, ADD_WASM, WAIT};

/// Waits until the `kind` object `name` shows `phase`; on timeout, fails with its status.
pub fn wait_for_object_phase(
    api: &str,
    dir: &std::path::Path,
    kind: &str,
    name: &str,
    phase: &str,
) -> serde_json::Value {
    let started = std::time::Instant::now();
    loop {
        let object = get_json(api, dir, &["get", kind, name]);
        if object["status"]["phase"] == phase {
            return object;
        }
        assert!(
            started.elapsed() < WAIT,
            "{kind} {name} did not become {phase}: {:#}",
            object["status"]
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Polls `propeller get proplet NAME -o json` until its phase is `phase`; returns how long
/// it took.
pub fn wait_for_phase(
    api: &str,
    dir: &std::path::Path,
    name: &str,
    phase: &str,
) -> std::time::Duration {
    wait_for_phase_within(api, dir, name, phase, WAIT)
}

/// [`wait_for_phase`] with its own bound.
pub fn wait_for_phase_within(
    api: &str,
    dir: &std::path::Path,
    name: &str,
    phase: &str,
    limit: std::time::Duration,
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
            started.elapsed() < limit,
            "proplet {name} did not become {phase} within {limit:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

pub fn get_json(api: &str, dir: &std::path::Path, args: &[&str]) -> serde_json::Value {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let (ok, out, err) = propeller_client(api, dir, &all);
    assert!(ok, "propeller {args:?}: {err}");
    serde_json::from_str(&out).expect("json")
}

/// Waits until every listed task is finished; returns them by name.
pub fn finished_tasks(
    api: &str,
    dir: &std::path::Path,
    names: &[&str],
) -> std::collections::BTreeMap<String, serde_json::Value> {
    finished_tasks_within(api, dir, names, WAIT)
}

/// [`finished_tasks`] with its own time limit.
pub fn finished_tasks_within(
    api: &str,
    dir: &std::path::Path,
    names: &[&str],
    limit: std::time::Duration,
) -> std::collections::BTreeMap<String, serde_json::Value> {
    let started = std::time::Instant::now();
    loop {
        let tasks = get_json(api, dir, &["get", "task"]);
        let by_name: std::collections::BTreeMap<String, serde_json::Value> = tasks
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                (
                    t["metadata"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                    t.clone(),
                )
            })
            .collect();
        let done = names.iter().all(|n| {
            by_name.get(*n).is_some_and(|t| {
                matches!(
                    t["status"]["phase"].as_str(),
                    Some("completed" | "failed" | "skipped" | "interrupted")
                )
            })
        });
        if done {
            return by_name;
        }
        assert!(
            started.elapsed() < limit,
            "tasks not finished in time: {:#?}",
            names
                .iter()
                .map(|n| (n, by_name.get(*n).map(|t| t["status"].clone())))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

pub fn apply_text(api: &str, dir: &std::path::Path, file: &str, text: &str) {
    let path = dir.join(file);
    std::fs::write(&path, text).expect("write manifest");
    let (ok, _, err) = propeller_client(api, dir, &["apply", "-f", path.to_str().expect("path")]);
    assert!(ok, "{file}: {err}");
}

/// A module whose `spin(n)` turns a loop 8·n times and returns `n`, as base64. A plain
/// countdown from 2,000,000,000 finished in 0.56 s on a fast machine: before the 1 s
/// `running` write, so the tests waiting for `running` never saw it.
pub fn spin_module() -> String {
    spin_module_by(8)
}

/// A module whose `spin(n)` turns a loop `turns`·n times and returns `n`, as base64.
pub fn spin_module_by(turns: u64) -> String {
    use base64::Engine;
    let spin = wat::parse_str(format!(
        r#"(module (func (export "spin") (param i32) (result i32) (local i64)
             local.get 0 i64.extend_i32_u i64.const {turns} i64.mul local.set 1
             (block (loop
               local.get 1 i64.eqz br_if 1
               local.get 1 i64.const 1 i64.sub local.set 1
               br 0))
             local.get 0))"#
    ))
    .expect("wat");
    base64::engine::general_purpose::STANDARD.encode(spin)
}

/// A task `name` running [`spin_module`]'s `spin(n)`; `extra` is more of its spec (indented
/// two spaces), e.g. a selector.
pub fn spin_task(name: &str, n: u64, extra: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: spin\n  file: {}\n  inputs: [{n}]\n{extra}",
        spin_module()
    )
}

/// The most tasks an agent ran at once, from its log lines (a start accepted opens a run,
/// its success or failure closes it), how many it accepted and how many it finished.
pub fn most_at_once<'a>(log: impl IntoIterator<Item = &'a String>) -> (usize, usize, usize) {
    let (mut running, mut most, mut accepted, mut finished) = (0usize, 0usize, 0usize, 0usize);
    for line in log {
        if line.contains("task accepted") {
            running += 1;
            accepted += 1;
            most = most.max(running);
        } else if line.contains("task succeeded") || line.contains("task failed") {
            running = running.saturating_sub(1);
            finished += 1;
        }
    }
    (most, accepted, finished)
}

/// A task with an inline module (no registry involved).
pub fn inline_task(name: &str, inputs: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: add\n  file: {ADD_WASM}\n  inputs: {inputs}\n"
    )
}
