//! `propeller standalone --demo`: the quickstart applied, a local agent started, and what
//! happens told as it happens (the agent connecting, each task's phase, the results), then
//! a summary with where to look next. Logs go to files in the data directory unless `-v`.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::{bail, Context};
use propeller_operator::manifest::parse_manifest;
use propeller_operator::standalone::api::{self, ApiState};
use propeller_operator::standalone::store::{ChangeKind, ObjectStore};
use serde_json::Value;

/// propeller's log file in the data directory during the demo.
pub const LOG_FILE: &str = "propeller.log";
/// The demo agent's log file in the data directory.
pub const AGENT_LOG_FILE: &str = "proplet.log";

/// The quickstart manifests, built into the binary so the demo works from any directory.
const QUICKSTART: [&str; 3] = [
    include_str!("../../../configs/samples/quickstart/proplet.yaml"),
    include_str!("../../../configs/samples/quickstart/task.yaml"),
    include_str!("../../../configs/samples/quickstart/pipeline.yaml"),
];

/// Applies the quickstart with a freshly generated proplet key and starts a local `proplet`
/// (found next to this binary) that logs in with it.
pub async fn start(
    api_state: &ApiState,
    mqtt: &str,
    data_dir: &Path,
    verbose: bool,
) -> anyhow::Result<tokio::process::Child> {
    let key = super::random::random_hex(16)?;
    let mut docs = Vec::new();
    for text in QUICKSTART {
        docs.extend(parse_manifest(text).map_err(anyhow::Error::msg)?);
    }
    for doc in &mut docs {
        match doc["kind"].as_str() {
            Some("Secret") => doc["stringData"]["key"] = Value::String(key.clone()),
            Some("Proplet") => {
                doc["spec"]["connectionConfig"]["mqttAddress"] = Value::String(mqtt.to_owned())
            }
            _ => {}
        }
    }
    let applied = api::apply_documents(api_state, &docs)
        .await
        .map_err(|refused| {
            anyhow::anyhow!(
                "the quickstart does not apply:\n{}",
                refused.problems.join("\n")
            )
        })?;
    let names: Vec<String> = applied
        .iter()
        .map(|a| {
            format!(
                "{} {}",
                a["kind"].as_str().unwrap_or_default(),
                a["name"].as_str().unwrap_or_default()
            )
        })
        .collect();
    println!("demo: applied the quickstart: {}", names.join(", "));
    let exe = std::env::current_exe().context("locating this binary")?;
    let agent = exe.with_file_name("proplet");
    if !agent.exists() {
        bail!(
            "the demo needs the proplet binary next to {} (build both with `cargo build --bins`)",
            exe.display()
        );
    }
    let state_dir = data_dir.join("demo-proplet");
    std::fs::create_dir_all(&state_dir)?;
    let mut command = tokio::process::Command::new(&agent);
    command
        .env("PROPLET_MQTT_ADDRESS", mqtt)
        .env("PROPLET_DOMAIN_ID", "quickstart")
        .env("PROPLET_CHANNEL_ID", "quickstart")
        .env("PROPLET_CLIENT_ID", "quickstart-proplet")
        .env("PROPLET_CLIENT_KEY", &key)
        .env("PROPLET_STATE_DIR", &state_dir)
        .env("PROPLET_LIVELINESS_INTERVAL", "2")
        .kill_on_drop(true);
    if !verbose {
        let path = data_dir.join(AGENT_LOG_FILE);
        let log =
            std::fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        command
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log));
    }
    let child = command
        .spawn()
        .with_context(|| format!("starting {}", agent.display()))?;
    println!(
        "demo: started the agent {} as quickstart-proplet",
        agent.display()
    );
    Ok(child)
}

/// The line that tells a user what `obj` (a Proplet, Task or PropellerJob) just became, or
/// `None` when there is nothing new to tell.
fn progress_line(kind: &str, obj: &Value) -> Option<String> {
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let status = &obj["status"];
    let phase = status["phase"].as_str().unwrap_or_default();
    match (kind, phase) {
        ("Proplet", "Running") => Some(format!(
            "proplet {name}: Running (its agent is connected and heartbeating)"
        )),
        ("Proplet", "") => None,
        ("Proplet", other) => Some(format!("proplet {name}: {other}")),
        ("Task", "scheduled") => Some(format!(
            "task {name}: scheduled on {}",
            status["assignedProplet"].as_str().unwrap_or("a proplet")
        )),
        ("Task", "running") => Some(format!("task {name}: running")),
        ("Task", "completed") => {
            let result = &status["results"];
            let shown = result
                .as_str()
                .map_or_else(|| result.to_string(), str::to_owned);
            Some(format!("task {name}: completed, result {shown}"))
        }
        ("Task", "failed" | "skipped" | "interrupted") => Some(format!(
            "task {name}: {phase}: {}",
            status["error"].as_str().unwrap_or("no reason given")
        )),
        ("PropellerJob", "") => None,
        ("PropellerJob", other) => Some(format!("propellerjob {name}: {other}")),
        _ => None,
    }
}

fn finished(phase: &str) -> bool {
    matches!(
        phase,
        "completed" | "failed" | "skipped" | "interrupted" | "Completed" | "Failed"
    )
}

/// Tells each change of the demo's objects once, and a summary when the quickstart's task
/// and job have finished.
pub async fn narrate(store: ObjectStore, api: SocketAddr, data_dir: PathBuf) {
    let mut changes = store.subscribe();
    let mut told = HashSet::new();
    let mut summarised = false;
    // The objects are also looked over twice a second, not only on a change: a change a
    // lagging receiver missed must not lose its line nor hold the summary back.
    let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
    loop {
        let change = tokio::select! {
            change = changes.recv() => match change {
                Ok(c) => Some(c),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => None,
                Err(_) => return,
            },
            _ = tick.tick() => None,
        };
        match change {
            Some(change) if change.kind_of_change == ChangeKind::Deleted => {}
            Some(change) => {
                if let Ok(Some(obj)) = store.get(&change.kind, &change.namespace, &change.name) {
                    tell(&mut told, &change.kind, &obj);
                }
            }
            None => tell_all(&store, &mut told),
        }
        if !summarised && quickstart_finished(&store) {
            // Every line before the summary, also one whose change has not arrived yet.
            tell_all(&store, &mut told);
            summarised = true;
            print!("{}", summary(&store, api, &data_dir));
        }
    }
}

/// The kinds whose changes the demo tells.
const NARRATED: [&str; 3] = ["Proplet", "Task", "PropellerJob"];

/// Tells every demo object's state that was not told yet.
fn tell_all(store: &ObjectStore, told: &mut HashSet<(String, String, String, i64)>) {
    for kind in NARRATED {
        for obj in store.list(kind, Some("default")).unwrap_or_default() {
            tell(told, kind, &obj);
        }
    }
}

/// Prints `obj`'s progress line unless it was told already (for this run).
fn tell(told: &mut HashSet<(String, String, String, i64)>, kind: &str, obj: &Value) {
    let name = obj["metadata"]["name"].as_str().unwrap_or_default();
    let run = obj["status"]["runCount"].as_i64().unwrap_or(0);
    if let Some(line) = progress_line(kind, obj) {
        if told.insert((kind.to_owned(), name.to_owned(), line.clone(), run)) {
            println!("{line}");
        }
    }
}

fn quickstart_finished(store: &ObjectStore) -> bool {
    let phase = |kind: &str, name: &str| -> String {
        store
            .get(kind, "default", name)
            .ok()
            .flatten()
            .and_then(|o| o["status"]["phase"].as_str().map(str::to_owned))
            .unwrap_or_default()
    };
    finished(&phase("Task", "add")) && finished(&phase("PropellerJob", "pipeline"))
}

fn summary(store: &ObjectStore, api: SocketAddr, data_dir: &Path) -> String {
    let mut tasks: BTreeMap<String, usize> = BTreeMap::new();
    for task in store.list("Task", None).unwrap_or_default() {
        let phase = task["status"]["phase"].as_str().unwrap_or("pending");
        *tasks.entry(phase.to_owned()).or_default() += 1;
    }
    let counts: Vec<String> = tasks.iter().map(|(p, n)| format!("{n} {p}")).collect();
    // As the user started this program, so the commands work when pasted.
    let me = std::env::args()
        .next()
        .unwrap_or_else(|| "propeller".to_owned());
    format!(
        "demo finished: tasks {}; propeller and the agent keep running until Ctrl-C.\n\
         \x20 look at what ran:  {me} get tasks  |  {me} describe task add  |  {me} get pjob\n\
         \x20 watch changes:     {me} get tasks -w     (API http://{api}, token in {})\n\
         \x20 in a browser:      http://{api}/console/ (sign in with that token)\n\
         \x20 logs:              {} and {}\n",
        counts.join(", "),
        data_dir.join("api-token").display(),
        data_dir.join(LOG_FILE).display(),
        data_dir.join(AGENT_LOG_FILE).display(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn each_phase_reads_as_a_sentence() {
        let task = |phase: &str| {
            json!({"metadata": {"name": "add"},
                   "status": {"phase": phase, "assignedProplet": "pi", "results": "42", "error": "trap"}})
        };
        assert_eq!(
            progress_line("Task", &task("scheduled")).as_deref(),
            Some("task add: scheduled on pi")
        );
        assert_eq!(
            progress_line("Task", &task("completed")).as_deref(),
            Some("task add: completed, result 42")
        );
        assert_eq!(
            progress_line("Task", &task("failed")).as_deref(),
            Some("task add: failed: trap")
        );
        assert_eq!(progress_line("Task", &task("pending")), None);
        let proplet = json!({"metadata": {"name": "pi"}, "status": {"phase": "Running"}});
        assert!(progress_line("Proplet", &proplet).is_some_and(|l| l.contains("connected")));
    }
}
