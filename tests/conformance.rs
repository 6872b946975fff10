//! The conformance table: the same scenarios through both drivers, `propeller standalone`
//! (the embedded store) and `propeller run` against a real kube-apiserver, must give the same
//! statuses and Events. Each scenario names the facts it observed; a fact is checked against
//! its expected value and between the two drivers, and the table is printed.
//!
//! Without the envtest assets the test prints one SKIPPED line and passes; with `CI=true` it
//! fails instead.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::envtest::{ControlPlane, Options};
use support::{binary, Running, ADD_WASM};

/// The reconcile settings both drivers run with. The flush interval is long so that routine
/// heartbeats have nothing to write; liveness comes from the 3 s threshold.
const SETTINGS: [&str; 6] = [
    "--last-seen-threshold",
    "3s",
    "--liveliness-interval",
    "1s",
    "--status-flush-interval",
    "30s",
];
/// Upper bound on every wait for a status.
const WAIT: Duration = Duration::from_secs(60);

/// A driver under test, with the client a user of that mode has.
trait Driver {
    /// `kubectl apply` or `propeller apply` of `manifest` in the default namespace.
    fn apply(&self, manifest: &str);
    /// The object as JSON, `None` when it does not exist.
    fn get(&self, kind: &str, name: &str) -> Option<Value>;
    /// `Type/Reason` of the Events recorded about the object.
    fn events(&self, kind: &str, name: &str) -> BTreeSet<String>;
    /// The MQTT port devices dial.
    fn mqtt_port(&self) -> u16;
    /// Where the test keeps agents' state.
    fn scratch(&self) -> &Path;
    /// What the operator logged, for failures.
    fn log_tail(&self) -> String;
}

struct OnApiServer {
    cp: ControlPlane,
    operator: Running,
    mqtt: u16,
}

impl OnApiServer {
    fn start() -> Option<Self> {
        let cp = ControlPlane::start(Options::default())?;
        cp.install_crds();
        cp.install_operator_rbac();
        let kubeconfig = cp.service_account_kubeconfig("propeller-system", "propeller");
        let mut cmd = binary("propeller");
        cmd.args(["run", "--mqtt-listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .args(SETTINGS)
            .args(["--log-format", "json"])
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info");
        let operator = Running::spawn(cmd);
        let line = operator.stderr_line_within("mqtt listening", WAIT);
        let entry: Value = serde_json::from_str(&line).unwrap_or_default();
        let mqtt = entry["fields"]["addr"]
            .as_str()
            .and_then(|a| a.rsplit(':').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no MQTT port in {line:?}"));
        Some(Self { cp, operator, mqtt })
    }
}

impl Driver for OnApiServer {
    fn apply(&self, manifest: &str) {
        let out = self.cp.kubectl_stdin(&["apply", "-f", "-"], manifest);
        assert!(
            out.status.success(),
            "kubectl apply: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn get(&self, kind: &str, name: &str) -> Option<Value> {
        let out = self
            .cp
            .kubectl()
            .args(["get", kind, name, "-o", "json"])
            .output()
            .expect("run kubectl");
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).expect("kubectl JSON"))
    }

    fn events(&self, kind: &str, name: &str) -> BTreeSet<String> {
        let selector = format!("involvedObject.kind={kind},involvedObject.name={name}");
        let out =
            self.cp
                .kubectl_ok(&["get", "events", "--field-selector", &selector, "-o", "json"]);
        let list: Value = serde_json::from_str(&out).expect("events JSON");
        type_and_reason(&list["items"])
    }

    fn mqtt_port(&self) -> u16 {
        self.mqtt
    }

    fn scratch(&self) -> &Path {
        self.cp.scratch()
    }

    fn log_tail(&self) -> String {
        tail(&self.operator)
    }
}

struct Standalone {
    dir: tempfile::TempDir,
    server: Running,
    api: String,
    mqtt: u16,
}

impl Standalone {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (server, api, mqtt) = support::start_standalone(dir.path(), &SETTINGS);
        let mqtt = mqtt.parse().expect("MQTT port");
        Self {
            dir,
            server,
            api,
            mqtt,
        }
    }
}

impl Driver for Standalone {
    fn apply(&self, manifest: &str) {
        support::standalone::apply_text(&self.api, self.dir.path(), "manifest.yaml", manifest);
    }

    fn get(&self, kind: &str, name: &str) -> Option<Value> {
        let (ok, out, _) = support::propeller_client(
            &self.api,
            self.dir.path(),
            &["get", kind, name, "-o", "json"],
        );
        ok.then(|| serde_json::from_str(&out).expect("propeller JSON"))
    }

    fn events(&self, kind: &str, name: &str) -> BTreeSet<String> {
        let token = std::fs::read_to_string(self.dir.path().join("api-token")).expect("token");
        let out = std::process::Command::new("curl")
            .args(["-sf", "-H"])
            .arg(format!("Authorization: Bearer {}", token.trim()))
            .arg(format!(
                "http://{}/v1/events/{kind}/default/{name}",
                self.api
            ))
            .output()
            .expect("run curl");
        assert!(out.status.success(), "events of {kind} {name}");
        let list: Value = serde_json::from_slice(&out.stdout).expect("events JSON");
        type_and_reason(&list)
    }

    fn mqtt_port(&self) -> u16 {
        self.mqtt
    }

    fn scratch(&self) -> &Path {
        self.dir.path()
    }

    fn log_tail(&self) -> String {
        tail(&self.server)
    }
}

fn type_and_reason(items: &Value) -> BTreeSet<String> {
    items
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            format!(
                "{}/{}: {}",
                e["type"].as_str().unwrap_or_default(),
                e["reason"].as_str().unwrap_or_default(),
                e["message"]
                    .as_str()
                    .or(e["note"].as_str())
                    .unwrap_or_default()
            )
        })
        .collect()
}

fn tail(process: &Running) -> String {
    let mut lines = process.stderr_so_far();
    lines.extend(process.stdout_so_far());
    lines[lines.len().saturating_sub(40)..].join("\n")
}

/// Polls `kind/name` until `done` holds; the object then.
fn wait_for(
    d: &dyn Driver,
    kind: &str,
    name: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    let started = Instant::now();
    loop {
        let object = d.get(kind, name);
        if let Some(object) = object.filter(|o| done(o)) {
            return object;
        }
        assert!(
            started.elapsed() < WAIT,
            "{kind} {name} never became {what}: {:#?}\noperator:\n{}",
            d.get(kind, name).map(|o| o["status"].clone()),
            d.log_tail()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn phase_is(phase: &'static str) -> impl Fn(&Value) -> bool {
    move |o| o["status"]["phase"] == phase
}

/// A Proplet `name` whose key Secret has `secret_body` (`data` and/or `stringData`).
fn proplet_with_secret(name: &str, mqtt: u16, secret_body: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\n{secret_body}---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\nspec:\n  type: external\n  external:\n    capabilities: [wasm]\n  connectionConfig:\n    mqttAddress: tcp://127.0.0.1:{mqtt}\n    domainId: d1\n    channelId: c1\n    clientId: {name}\n    clientKeySecretRef: {{name: {name}-key, key: key}}\n"
    )
}

fn agent(d: &dyn Driver, name: &str) -> Running {
    support::device_agent_with(
        name,
        d.mqtt_port(),
        &d.scratch().join(format!("{name}-state")),
        &[("PROPLET_METRICS_INTERVAL", "0")],
    )
}

/// What one driver showed in one scenario: named facts, each compared with the other
/// driver's and with its expected value.
type Facts = BTreeMap<&'static str, String>;

fn condition_types(status: &Value) -> String {
    let mut types: Vec<String> = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            format!(
                "{}={}",
                c["type"].as_str().unwrap_or_default(),
                c["status"].as_str().unwrap_or_default()
            )
        })
        .collect();
    types.sort();
    types.join(",")
}

fn status_keys(status: &Value) -> String {
    let keys: Vec<&str> = status
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys().map(String::as_str))
        .collect();
    keys.join(",")
}

fn events_text(events: &BTreeSet<String>) -> String {
    events.iter().cloned().collect::<Vec<_>>().join(",")
}

/// Runs every scenario on `d`; the facts of each, in order.
fn run_scenarios(d: &dyn Driver) -> Vec<(&'static str, Facts)> {
    let mut table = Vec::new();
    let port = d.mqtt_port();

    // A proplet's first Running: no PhaseChanged Event (it was never anything else).
    d.apply(&support::device_manifest("a", port));
    let _a = agent(d, "a");
    let a = wait_for(d, "proplet", "a", "Running", phase_is("Running"));
    table.push((
        "proplet first Running",
        Facts::from([
            (
                "phase",
                a["status"]["phase"].as_str().unwrap_or_default().to_owned(),
            ),
            ("conditions", condition_types(&a["status"])),
            ("events", events_text(&d.events("Proplet", "a"))),
        ]),
    ));

    // Routine heartbeats (five, inside the flush interval) write nothing, once the device's
    // description and figures are written.
    let before = wait_for(d, "proplet", "a", "described", |p| {
        p["status"]["availableResources"].is_object()
    });
    std::thread::sleep(Duration::from_secs(5));
    let after = d.get("proplet", "a").expect("proplet a");
    let unchanged = before["metadata"]["resourceVersion"] == after["metadata"]["resourceVersion"];
    if !unchanged {
        eprintln!("BEFORE {:#}\nAFTER {:#}", before["status"], after["status"]);
    }
    table.push((
        "routine heartbeats",
        Facts::from([
            (
                "phase",
                after["status"]["phase"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ),
            ("status written", (!unchanged).to_string()),
        ]),
    ));

    // Keys from Secrets: `data` alone, and `data` beside `stringData` (stringData wins, as
    // the API server merges it over data on write).
    let data_only = format!("data:\n  key: {}\n", base64("b-secret"));
    d.apply(&proplet_with_secret("b", port, &data_only));
    let both = format!(
        "data:\n  key: {}\nstringData:\n  key: c-secret\n",
        base64("stale-secret")
    );
    d.apply(&proplet_with_secret("c", port, &both));
    let mut b_agent = agent(d, "b");
    let _c_agent = agent(d, "c");
    let b = wait_for(d, "proplet", "b", "Running", phase_is("Running"));
    let c = wait_for(d, "proplet", "c", "Running", phase_is("Running"));
    table.push((
        "Secret data / data+stringData",
        Facts::from([
            (
                "data only",
                b["status"]["phase"].as_str().unwrap_or_default().to_owned(),
            ),
            (
                "stringData over data",
                c["status"]["phase"].as_str().unwrap_or_default().to_owned(),
            ),
        ]),
    ));

    // Offline: a silenced device is Offline after the threshold, with a Warning.
    b_agent.child.kill().expect("SIGKILL agent b");
    let started = Instant::now();
    let b = wait_for(d, "proplet", "b", "Offline", phase_is("Offline"));
    let within = started.elapsed() < Duration::from_secs(3 + 5);
    let events = wait_events(
        d,
        "Proplet",
        "b",
        "Warning/PhaseChanged: proplet is now Offline",
    );
    table.push((
        "Offline",
        Facts::from([
            (
                "phase",
                b["status"]["phase"].as_str().unwrap_or_default().to_owned(),
            ),
            ("within threshold + 5 s", within.to_string()),
            ("events", events_text(&events)),
        ]),
    ));

    // A task's lifecycle, and its Events.
    d.apply(&format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: sum\nspec:\n  name: add\n  file: {ADD_WASM}\n  functionName: add\n  inputs: [10, 32]\n  propletSelector: {{propletId: a}}\n"
    ));
    let sum = wait_for(d, "task", "sum", "completed", phase_is("completed"));
    table.push((
        "task lifecycle",
        Facts::from([
            (
                "phase",
                sum["status"]["phase"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ),
            ("results", sum["status"]["results"].to_string()),
            (
                "proplet",
                sum["status"]["assignedProplet"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ),
            ("events", events_text(&d.events("Task", "sum"))),
        ]),
    ));

    // A PropellerJob observed from its tasks: the same status fields in both.
    d.apply(&support::propeller_job_manifest("configurable"));
    let job = wait_for(
        d,
        "propellerjob",
        "configurable",
        "Completed",
        phase_is("Completed"),
    );
    table.push((
        "PropellerJob observation",
        Facts::from([
            (
                "phase",
                job["status"]["phase"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ),
            ("status fields", status_keys(&job["status"])),
            ("conditions", condition_types(&job["status"])),
        ]),
    ));
    table.push(("FL round ids", round_ids(d)));
    table
}

/// A device simulated over MQTT as upstream's embedded agent behaves: it logs in as `name`,
/// listens for starts, heartbeats every second, and sends FL updates naming only their round.
struct FakeDevice {
    client: rumqttc::Client,
    name: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl FakeDevice {
    fn start(d: &dyn Driver, name: &str) -> Self {
        use std::sync::atomic::{AtomicBool, Ordering};
        let mut options = rumqttc::MqttOptions::new(name, "127.0.0.1", d.mqtt_port());
        options.set_credentials(name, format!("{name}-secret"));
        options.set_keep_alive(Duration::from_secs(5));
        let (client, mut connection) = rumqttc::Client::new(options, 64);
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let done = stop.clone();
        std::thread::spawn(move || {
            for event in connection.iter() {
                if done.load(Ordering::Relaxed) {
                    return;
                }
                if event.is_err() {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        client
            .subscribe("m/d1/c/c1/control/manager/start", rumqttc::QoS::AtLeastOnce)
            .expect("subscribe");
        let (beats, done, id) = (client.clone(), stop.clone(), name.to_owned());
        std::thread::spawn(move || {
            let payload = format!(r#"{{"status":"alive","proplet_id":"{id}"}}"#);
            while !done.load(Ordering::Relaxed) {
                let topic = "m/d1/c/c1/control/proplet/alive";
                let _ = beats.publish(topic, rumqttc::QoS::AtMostOnce, false, payload.clone());
                std::thread::sleep(Duration::from_secs(1));
            }
        });
        Self {
            client,
            name: name.to_owned(),
            stop,
        }
    }

    /// An FL update for round `round`, naming no task.
    fn update(&self, round: &str) {
        let topic = format!("fl/rounds/{round}/updates/{}", self.name);
        let payload = format!(
            r#"{{"round_id":"{round}","proplet_id":"{}","num_samples":1,"update":{{"w":[1.0]}}}}"#,
            self.name
        );
        self.client
            .publish(topic, rumqttc::QoS::AtLeastOnce, false, payload)
            .expect("publish update");
    }
}

impl Drop for FakeDevice {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = self.client.disconnect();
    }
}

/// FL updates naming only their round ("r1", "4abc", "4") are claimed by the task of that
/// round (its `ROUND_ID`) on the sending device, or by none.
fn round_ids(d: &dyn Driver) -> Facts {
    d.apply(&support::device_manifest("f", d.mqtt_port()));
    let device = FakeDevice::start(d, "f");
    wait_for(d, "proplet", "f", "Running", phase_is("Running"));
    let task = |name: &str, round: &str| {
        format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  file: {ADD_WASM}\n  functionName: add\n  inputs: [1, 2]\n  env: {{ROUND_ID: \"{round}\"}}\n  propletSelector: {{propletId: f}}\n"
        )
    };
    d.apply(&format!(
        "{}---\n{}",
        task("round-one", "1"),
        task("round-four", "4")
    ));
    for name in ["round-one", "round-four"] {
        wait_for(d, "task", name, "assigned to f", |t| {
            t["status"]["assignedProplet"] == "f"
        });
    }
    let finished = |name: &str| {
        let phase = d.get("task", name).map(|t| t["status"]["phase"].clone());
        if phase == Some(Value::from("completed")) {
            "completed".to_owned()
        } else {
            "not completed".to_owned()
        }
    };
    device.update("r1");
    wait_for(d, "task", "round-one", "completed", phase_is("completed"));
    device.update("4abc");
    std::thread::sleep(Duration::from_secs(2));
    let after_4abc = finished("round-four");
    device.update("4");
    wait_for(d, "task", "round-four", "completed", phase_is("completed"));
    Facts::from([
        ("\"r1\" -> round 1", finished("round-one")),
        ("\"4abc\" -> no round", after_4abc),
        ("\"4\" -> round 4", finished("round-four")),
    ])
}

/// Events are recorded after the status write: waits until `expected` is among them.
fn wait_events(d: &dyn Driver, kind: &str, name: &str, expected: &str) -> BTreeSet<String> {
    let started = Instant::now();
    loop {
        let events = d.events(kind, name);
        if events.contains(expected) || started.elapsed() > Duration::from_secs(10) {
            return events;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A thread's result, its panic carried on.
fn rejoin<T>(result: std::thread::Result<T>) -> T {
    result.unwrap_or_else(|e| std::panic::resume_unwind(e))
}

fn base64(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// The values a fact must have whatever the driver (facts not listed only have to agree).
fn expected(scenario: &str, fact: &str) -> Option<&'static str> {
    Some(match (scenario, fact) {
        ("proplet first Running", "phase") => "Running",
        ("proplet first Running", "events") => "",
        ("routine heartbeats", "status written") => "false",
        ("Secret data / data+stringData", _) => "Running",
        ("Offline", "phase") => "Offline",
        ("Offline", "within threshold + 5 s") => "true",
        ("Offline", "events") => "Warning/PhaseChanged: proplet is now Offline",
        ("task lifecycle", "phase") => "completed",
        ("task lifecycle", "results") => "\"42\"",
        ("task lifecycle", "proplet") => "a",
        ("PropellerJob observation", "phase") => "Completed",
        ("FL round ids", "\"4abc\" -> no round") => "not completed",
        ("FL round ids", _) => "completed",
        _ => return None,
    })
}

#[test]
fn both_drivers_give_the_same_statuses_and_events() {
    // Each driver in a thread of its own, from its start (a process's output channels
    // belong to one thread).
    let (standalone_rows, api_rows) = std::thread::scope(|s| {
        let api = s.spawn(|| OnApiServer::start().map(|d| run_scenarios(&d)));
        let standalone = s.spawn(|| run_scenarios(&Standalone::start()));
        (rejoin(standalone.join()), rejoin(api.join()))
    });
    let Some(api_rows) = api_rows else {
        return;
    };
    let (standalone_rows, api_rows) = (&standalone_rows, &api_rows);
    let mut problems = Vec::new();
    println!(
        "{:<32} {:<24} {:<34} {:<34}",
        "scenario", "fact", "standalone", "api-server"
    );
    for ((scenario, ours), (_, theirs)) in standalone_rows.iter().zip(api_rows) {
        for (fact, value) in ours {
            let other = theirs.get(fact).cloned().unwrap_or_default();
            println!("{scenario:<32} {fact:<24} {value:<34} {other:<34}");
            if *value != other {
                problems.push(format!(
                    "{scenario} / {fact}: standalone {value:?}, api-server {other:?}"
                ));
            }
            if let Some(want) = expected(scenario, fact) {
                for (driver, got) in [("standalone", value), ("api-server", &other)] {
                    if got != want {
                        problems.push(format!(
                            "{scenario} / {fact} on {driver}: {got:?}, expected {want:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
