//! The cases every external MQTT cluster must pass, run in order on one cluster by each
//! engine's test: tasks, a DAG across two agents, a broadcast and a PropellerJob through
//! agents on different nodes; Offline through a Last Will relayed across nodes; a broker
//! node killed under a running task; propeller killed (-9) in a burst.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use super::external::{
    add_task, device_agent, device_manifest, eventually, expect_results, start_propeller, task_ids,
    AgentLog, Probe, DOMAIN,
};
use super::standalone::{
    apply_text, finished_tasks_within, get_json, spin_module, wait_for_object_phase, wait_for_phase,
};
use super::{propeller_job_manifest, Running, WAIT};

/// The test devices, each on a channel of its own.
pub const DEVICES: [&str; 3] = ["a", "bb", "c"];
/// A device with a Proplet and a key but no agent: the policy cases log in as it (a login
/// with an agent's client id would displace that agent's session).
pub const PROBE: &str = "probe";

/// Tasks of the propeller-kill case (`EXTERNAL_BURST_TASKS`; the fault script runs 1,000).
pub fn burst_size() -> usize {
    std::env::var("EXTERNAL_BURST_TASKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200)
}

/// Propeller (standalone) and its agents on a cluster.
pub struct Fleet {
    /// `rabbitmq` or `nats`, for the progress lines.
    pub engine: &'static str,
    pub dir: tempfile::TempDir,
    pub api: String,
    pub propeller: Running,
    pub propeller_args: Vec<String>,
    /// The cluster's nodes as URLs, in node order.
    pub nodes: Vec<String>,
    pub agents: BTreeMap<&'static str, AgentLog>,
    /// Uids of broadcast tasks (run once on each agent).
    pub broadcasts: std::collections::BTreeSet<String>,
}

impl Fleet {
    /// Starts propeller on the cluster (nodes in order) with `propeller_args`.
    pub fn start(
        engine: &'static str,
        dir: tempfile::TempDir,
        nodes: Vec<String>,
        propeller_args: Vec<String>,
    ) -> Self {
        let brokers = nodes.join(",");
        let args: Vec<&str> = propeller_args.iter().map(String::as_str).collect();
        let (propeller, api) = start_propeller(dir.path(), &brokers, &args);
        Self {
            engine,
            dir,
            api,
            propeller,
            propeller_args,
            nodes,
            agents: BTreeMap::new(),
            broadcasts: Default::default(),
        }
    }

    /// The nodes as a list starting at node `first`.
    pub fn nodes_from(&self, first: usize) -> String {
        let n = self.nodes.len();
        (0..n)
            .map(|i| self.nodes[(first + i) % n].clone())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Applies the Proplets (and Secrets) of devices `a`, `bb`, `c` and the probe.
    pub fn apply_devices(&self) {
        for name in DEVICES.into_iter().chain([PROBE]) {
            let manifest = device_manifest(name, &self.nodes.join(","));
            apply_text(
                &self.api,
                self.dir.path(),
                &format!("{name}.yaml"),
                &manifest,
            );
        }
    }

    /// Starts the agents of devices `a`, `bb` and `c`, each on a different node first;
    /// waits until their Proplets are Running.
    pub fn start_three_agents(&mut self) {
        for (i, name) in DEVICES.into_iter().enumerate() {
            let state = self.dir.path().join(format!("{name}-state"));
            let agent = device_agent(name, &self.nodes_from(i), &state);
            self.agents.insert(name, AgentLog::new(agent));
        }
        for name in DEVICES {
            wait_for_phase(&self.api, self.dir.path(), name, "Running");
        }
    }

    fn restart_propeller(&mut self) {
        let args: Vec<&str> = self.propeller_args.iter().map(String::as_str).collect();
        let (propeller, api) = start_propeller(self.dir.path(), &self.nodes.join(","), &args);
        self.propeller = propeller;
        self.api = api;
    }

    /// Every task id run more than once: by one agent, or (unless it is a broadcast) by
    /// several.
    pub fn doubled_runs(&mut self) -> Vec<(String, usize)> {
        let mut all: BTreeMap<String, usize> = BTreeMap::new();
        let mut doubled = Vec::new();
        for agent in self.agents.values_mut() {
            for (id, n) in agent.runs() {
                if n > 1 {
                    doubled.push((id.clone(), n));
                }
                if !self.broadcasts.contains(&id) {
                    *all.entry(id).or_default() += n;
                }
            }
        }
        doubled.extend(all.into_iter().filter(|(_, n)| *n > 1));
        doubled
    }

    fn paths(&self) -> (String, std::path::PathBuf) {
        (self.api.clone(), self.dir.path().to_owned())
    }
}

/// add(10, 32) → 42, a DAG whose steps are pinned to two agents on different nodes, a
/// broadcast to all three, and a PropellerJob.
pub fn tasks_dags_broadcasts_and_jobs(fleet: &mut Fleet) {
    let (api, dir) = fleet.paths();
    apply_text(&api, &dir, "add.yaml", &add_task("add", 10, 32, ""));
    expect_results(&api, &dir, &["add"], "42", WAIT);
    let first = "  workflowId: w\n  propletSelector:\n    propletId: a\n";
    let second =
        "  workflowId: w\n  dependsOn: [dag-first]\n  propletSelector:\n    propletId: bb\n";
    let dag = format!(
        "{}---\n{}",
        add_task("dag-first", 1, 2, first),
        add_task("dag-second", 3, 4, second)
    );
    apply_text(&api, &dir, "dag.yaml", &dag);
    expect_results(&api, &dir, &["dag-first"], "3", WAIT);
    expect_results(&api, &dir, &["dag-second"], "7", WAIT);
    let done = finished_tasks_within(&api, &dir, &["dag-first", "dag-second"], WAIT);
    assert_eq!(done["dag-first"]["status"]["assignedProplet"], "a");
    assert_eq!(done["dag-second"]["status"]["assignedProplet"], "bb");

    let broadcast = add_task("everywhere", 20, 22, "  broadcast: true\n");
    apply_text(&api, &dir, "broadcast.yaml", &broadcast);
    fleet
        .broadcasts
        .insert(task_ids(&api, &dir)["everywhere"].clone());
    let done = finished_tasks_within(&api, &dir, &["everywhere"], WAIT);
    let results = &done["everywhere"]["status"]["results"];
    for name in ["a", "bb", "c"] {
        assert_eq!(
            results[name]["results"].to_string().trim_matches('"'),
            "42",
            "broadcast result of {name}: {results:#}"
        );
    }
    let job = propeller_job_manifest("parallel");
    apply_text(&api, &dir, "job.yaml", &job);
    wait_for_object_phase(&api, &dir, "pjob", "parallel", "Completed");
    let doubled = fleet.doubled_runs();
    assert!(doubled.is_empty(), "run twice: {doubled:?}");
    println!(
        "{}: task, DAG across two agents, broadcast to three and PropellerJob completed",
        fleet.engine
    );
}

/// Agent `c` killed: its Last Will, published by the node it was on and relayed to
/// propeller's node, makes it Offline; a new agent brings it back.
pub fn a_last_will_crosses_nodes(fleet: &mut Fleet) {
    let (api, dir) = fleet.paths();
    let mut c = fleet.agents.remove("c").expect("agent c");
    let killed = Instant::now();
    let _ = c.process.child.kill();
    let _ = c.process.child.wait();
    wait_for_phase(&api, &dir, "c", "Offline");
    println!(
        "{}: proplet c Offline {:?} after its agent was killed (Last Will)",
        fleet.engine,
        killed.elapsed()
    );
    let agent = device_agent("c", &fleet.nodes_from(2), &dir.join("c-state"));
    wait_for_phase(&api, &dir, "c", "Running");
    fleet.agents.insert("c", AgentLog::new(agent));
}

/// The node agent `bb` is on, killed while `bb` runs a long task: `bb` moves to another node
/// and the task completes, run once; later tasks still reach `bb`. Returns the node's index.
pub fn a_node_killed_under_a_running_task(
    fleet: &mut Fleet,
    kill_node: impl FnOnce(usize),
) -> usize {
    let (api, dir) = fleet.paths();
    let engine = fleet.engine;
    let bb = fleet.agents.get_mut("bb").expect("agent bb");
    let sessions_before = bb.sessions();
    let spin = format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: long\nspec:\n  name: long\n  functionName: spin\n  file: {}\n  inputs: [300000000]\n  propletSelector:\n    propletId: bb\n",
        spin_module()
    );
    apply_text(&api, &dir, "long.yaml", &spin);
    let long_id = task_ids(&api, &dir)["long"].clone();
    bb.wait_for(&long_id, WAIT);
    let on = bb.current_broker().expect("agent bb's broker");
    let node = fleet
        .nodes
        .iter()
        .position(|n| n.ends_with(&on))
        .unwrap_or_else(|| panic!("agent bb is on {on}, not a node of {:?}", fleet.nodes));
    let killed = Instant::now();
    kill_node(node);
    let deadline = Instant::now() + WAIT * 3;
    while bb.sessions() <= sessions_before {
        assert!(
            Instant::now() < deadline,
            "agent bb did not reconnect after its node was killed; its log:\n{}",
            bb.lines().join("\n")
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    println!(
        "{engine}: node {} (agent bb's) killed under a running task; bb reconnected after {:?}",
        node + 1,
        killed.elapsed()
    );
    expect_results(&api, &dir, &["long"], "300000000", WAIT * 3);
    let runs = bb.runs();
    assert_eq!(runs.get(&long_id), Some(&1), "the long task's runs");
    let pinned = "  propletSelector:\n    propletId: bb\n";
    let after = add_task("after-kill", 40, 2, pinned);
    apply_text(&api, &dir, "after-kill.yaml", &after);
    let deadline = Instant::now() + WAIT * 2;
    loop {
        let task = get_json(&api, &dir, &["get", "task", "after-kill"]);
        if task["status"]["phase"] == "completed" {
            assert_eq!(task["status"]["results"], "42", "{:#}", task["status"]);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after-kill did not complete: {:#}\nagent bb's log:\n{}",
            task["status"],
            bb.lines().join("\n")
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    println!(
        "{engine}: the long task completed once {:?} after the kill",
        killed.elapsed()
    );
    node
}

/// A burst of [`burst_size`] tasks; propeller killed (-9) once the first completed and started
/// again: every task completes with its result, none runs twice, no agent reconnects.
pub fn propeller_killed_in_a_burst(fleet: &mut Fleet) {
    let n = burst_size();
    let engine = fleet.engine;
    // Agents that were on the node killed before may still be moving: wait until no agent
    // opened a session for 3 s, so the count below is what propeller's kill causes.
    let settled = Instant::now();
    loop {
        let before: Vec<usize> = fleet.agents.values_mut().map(|a| a.sessions()).collect();
        std::thread::sleep(std::time::Duration::from_secs(3));
        let after: Vec<usize> = fleet.agents.values_mut().map(|a| a.sessions()).collect();
        if before == after {
            break;
        }
        assert!(settled.elapsed() < WAIT, "the agents kept reconnecting");
    }
    let sessions_before: BTreeMap<&str, usize> = fleet
        .agents
        .iter_mut()
        .map(|(k, a)| (*k, a.sessions()))
        .collect();
    let manifest: String = (0..n)
        .map(|i| add_task(&format!("burst-{i}"), i as i64, 1, ""))
        .collect::<Vec<_>>()
        .join("---\n");
    let (api, dir) = fleet.paths();
    let applied = Instant::now();
    apply_text(&api, &dir, "burst.yaml", &manifest);
    // Killed as soon as the first of the burst completes: the rest are scheduled, running,
    // or have their results on the way.
    let mut killed_at = 0;
    eventually("the burst under way", 6, || {
        killed_at = completed(&api, &dir);
        killed_at > 0
    });
    let _ = fleet.propeller.child.kill();
    let _ = fleet.propeller.child.wait();
    let killed = Instant::now();
    fleet.restart_propeller();
    let (api, dir) = fleet.paths();
    let names: Vec<String> = (0..n).map(|i| format!("burst-{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let done = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        finished_tasks_within(&api, &dir, &names, WAIT * 6)
    }))
    .unwrap_or_else(|unfinished| {
        for (name, agent) in fleet.agents.iter_mut() {
            let lines = agent.lines();
            eprintln!(
                "--- agent {name}, last lines ---\n{}",
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
        let propeller: Vec<String> = fleet.propeller.stderr.try_iter().collect();
        eprintln!(
            "--- propeller, last lines ---\n{}",
            propeller[propeller.len().saturating_sub(60)..].join("\n")
        );
        std::panic::resume_unwind(unfinished)
    });
    let mut lost = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let status = &done[*name]["status"];
        let value = status["results"].to_string();
        if status["phase"] != "completed" || value.trim_matches('"') != (i + 1).to_string() {
            lost.push((name.to_string(), status.clone()));
        }
    }
    let doubled = fleet.doubled_runs();
    let reconnects: BTreeMap<&str, usize> = fleet
        .agents
        .iter_mut()
        .map(|(k, a)| (*k, a.sessions() - sessions_before[k]))
        .collect();
    println!(
        "{engine}: propeller killed with {killed_at} of {n} tasks completed; all {n} finished {:?} after the kill ({:?} after the apply): lost {}, run twice {}, agent reconnects {reconnects:?}",
        killed.elapsed(),
        applied.elapsed(),
        lost.len(),
        doubled.len()
    );
    assert!(lost.is_empty(), "tasks lost or wrong: {lost:?}");
    assert!(doubled.is_empty(), "tasks run twice: {doubled:?}");
    // RabbitMQ asks propeller (its HTTP auth backend) about every publish's topic: a device
    // publishing a result while propeller is down is refused and disconnected, reconnects
    // and sends the result again (the lines above show nothing lost or run twice). NATS
    // checks its rendered configuration itself, so there no device may reconnect.
    let allowed = if engine == "rabbitmq" { 1 } else { 0 };
    assert!(
        reconnects.values().all(|n| *n <= allowed),
        "devices reconnected: {reconnects:?}"
    );
}

/// How many tasks of the burst completed.
fn completed(api: &str, dir: &Path) -> usize {
    get_json(api, dir, &["get", "task"])
        .as_array()
        .into_iter()
        .flatten()
        .filter(|t| {
            t["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("burst-"))
                && t["status"]["phase"] == "completed"
        })
        .count()
}

/// The probe device's own report is taken; anonymous logins, a wrong key and an unknown
/// user are refused, and, where the broker binds the client id to the user (RabbitMQ), a
/// client id other than the username too.
pub fn probe_logins(probe: &Probe, client_id_is_the_user: bool) {
    let topic = format!("m/{DOMAIN}/c/{PROBE}/control/proplet/results");
    // A result for no task: accepted by the broker, kept by propeller for a task that never
    // comes (a heartbeat would make the probe a Running proplet the scheduler could pick).
    let result = format!(r#"{{"task_id":"no-such-task","proplet_id":"{PROBE}","results":"1"}}"#);
    assert!(
        probe.publish(&topic, &result),
        "the device's own report was refused"
    );
    let key = probe.password.clone();
    let mut refused = vec![
        ("anonymous", probe.with(PROBE, "", "")),
        ("wrong key", probe.with(PROBE, PROBE, "nope")),
        ("unknown client", probe.with("ghost", "ghost", "x")),
    ];
    if client_id_is_the_user {
        refused.push((
            "username is not the client id",
            probe.with("x", PROBE, &key),
        ));
    }
    for (what, login) in refused {
        assert!(
            !login.publish(&topic, &result),
            "{what}: the login was accepted"
        );
    }
}

/// A device enrols with a bootstrap token through the node `node` (the token login admitted
/// to its token's enrolment topics only: by the callbacks, or by the rendered NATS user),
/// runs as itself, and later gets a rotated key over its session through the cluster.
pub fn a_device_enrols_and_gets_a_rotated_key(fleet: &Fleet, node: &str) {
    let (api, dir) = (fleet.api.clone(), fleet.dir.path().to_owned());
    let client = |args: &[&str]| {
        let (ok, out, err) = super::propeller_client(&api, &dir, args);
        assert!(ok, "propeller {args:?}: {err}");
        out
    };
    // The clusters here listen on plain TCP: the token and the device both allow it.
    let token = client(&[
        "token",
        "create",
        "--insecure-enrol",
        "--domain-id",
        DOMAIN,
        "--channel-id",
        "enrolled",
        "--labels",
        &format!("via={}", fleet.engine),
    ]);
    let token = token.trim();
    let state = dir.join("enrolled-device");
    let join = |machine: &str| {
        super::binary("proplet")
            .args(["join", "--no-run", "--insecure-enrol", "--server"])
            .arg(node)
            .args(["--token", token, "--machine-id", machine, "--state-dir"])
            .arg(&state)
            .output()
            .expect("proplet join")
    };
    let joined = join(&format!("{}-machine", fleet.engine));
    let said = String::from_utf8_lossy(&joined.stderr).into_owned();
    if !joined.status.success() {
        let propeller: Vec<String> = fleet.propeller.stderr.try_iter().collect();
        let tail = &propeller[propeller.len().saturating_sub(80)..];
        panic!(
            "proplet join failed:\n{said}\npropeller's last lines:\n{}",
            tail.join("\n")
        );
    }
    let name = super::enrol::enrolled_name(&said);
    let stored_key = || {
        std::fs::read_to_string(state.join("credentials.toml"))
            .expect("credentials")
            .lines()
            .find(|l| l.starts_with("client_key"))
            .unwrap_or_default()
            .to_owned()
    };
    let first = stored_key();
    let agent = Running::spawn({
        let mut cmd = super::binary("proplet");
        cmd.arg("--state-dir").arg(&state).env("RUST_LOG", "info");
        cmd
    });
    // Running once the broker accepted its subscriptions: on a cluster missing a node, NATS
    // takes up to 4 s per refused one (33 s in all was seen in CI).
    super::standalone::wait_for_phase_within(
        &api,
        &dir,
        &name,
        "Running",
        Duration::from_secs(120),
    );
    let proplet = get_json(&api, &dir, &["get", "proplet", &name]);
    assert_eq!(
        proplet["metadata"]["labels"]["via"], fleet.engine,
        "{proplet:#}"
    );

    // Long enough for the key to arrive on a cluster missing a node (NATS then takes up to
    // 4 s per refused subscription) and for a restart inside it.
    let grace = Duration::from_secs(30);
    client(&["rotate", &format!("proplet/{name}"), "--grace", "30s"]);
    let started = Instant::now();
    while stored_key() == first {
        if started.elapsed() > WAIT {
            let said: Vec<String> = agent.stderr.try_iter().collect();
            panic!(
                "the agent did not get its rotated key through the cluster; it said:\n{}",
                said.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(agent);
    let restart = || {
        let agent = Running::spawn({
            let mut cmd = super::binary("proplet");
            cmd.arg("--state-dir").arg(&state).env("RUST_LOG", "info");
            cmd
        });
        agent.stderr_line("connected to the broker");
    };
    // Within the grace both keys log in (where the broker holds one password per client, the
    // agent falls back to its old key); after it, the new key does.
    restart();
    let in_grace = started.elapsed();
    assert!(in_grace < grace, "the restart took {in_grace:?}");
    std::thread::sleep(grace.saturating_sub(started.elapsed()) + Duration::from_secs(3));
    restart();
    println!(
        "{}: a device enrolled with a token through the cluster, Running as {name}, got its rotated key over its session, and logged in again within the grace and after it",
        fleet.engine
    );
}
