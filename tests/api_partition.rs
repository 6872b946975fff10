//! The API server unreachable while tasks run, in Kubernetes mode on a real kube-apiserver.
//! `propeller run --leader-elect` reaches the API server only through a userspace proxy the
//! test stalls: its requests hang, as when packets are dropped rather than refused, while
//! `kubectl` and the devices (on propeller's own broker) carry on.
//!
//! Counted: the leader stops acting before its Lease could expire, and `/readyz` says why;
//! the devices keep running what they were given; the results that arrive meanwhile and the
//! Tasks created meanwhile are written once the API server answers again; every task ends
//! completed with its result, each run executed once (the agents' logs). Also an API server
//! that flaps, 5 s away and 5 s back.
//!
//! Lengths: `PROPELLER_PARTITION_SECS` (20 here, 60 in `scripts/faults.sh api-partition`)
//! and `PROPELLER_FLAP_SECS` (30 here, 60 there). Without the envtest assets the tests
//! print SKIPPED and pass; with `CI=true` they fail instead.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::envtest::{free_port, ControlPlane, Options};
use support::external::AgentLog;
use support::fault_proxy::FaultProxy;
use support::kube::{
    api_addr, apply, cluster, http_body, http_status, mqtt_port, operator_command, through_proxy,
};
use support::{device_agent, device_manifest, nap_task_manifest, Running, ADD_WASM};

/// The leader Lease's duration here: the leader must stop acting within two thirds of it.
const LEASE_SECS: u64 = 6;
const NS: &str = "cut";
const DEVICES: [&str; 2] = ["left", "right"];

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The leader, its devices and the proxy between it and the API server.
struct Cut {
    cp: ControlPlane,
    proxy: FaultProxy,
    operator: AgentLog,
    metrics: u16,
    agents: Vec<AgentLog>,
}

impl Cut {
    fn start() -> Option<Self> {
        let (cp, kubeconfig) = cluster(Options::default())?;
        let proxy = FaultProxy::start(api_addr(&cp));
        let kubeconfig = through_proxy(&cp, &kubeconfig, proxy.port);
        let metrics = free_port();
        let mut cmd = operator_command(&kubeconfig, metrics);
        cmd.args([
            "--leader-elect",
            "--lease-duration",
            &format!("{LEASE_SECS}s"),
        ])
        .args(["--lease-namespace", "propeller-system"]);
        let operator = Running::spawn(cmd);
        let mqtt = mqtt_port(&operator);
        cp.kubectl_ok(&["create", "namespace", NS]);
        let agents = DEVICES
            .iter()
            .map(|name| {
                apply(&cp, NS, &device_manifest(name, mqtt));
                let state = cp.scratch().join(format!("{name}-state"));
                AgentLog::new(device_agent(name, mqtt, &state))
            })
            .collect();
        let cut = Self {
            cp,
            proxy,
            operator: AgentLog::new(operator),
            metrics,
            agents,
        };
        for name in DEVICES {
            cut.wait_tasks_or_proplets("proplets", Duration::from_secs(60), |all| {
                all.get(name)
                    .is_some_and(|p| p["status"]["phase"] == "Running")
            });
        }
        Some(cut)
    }

    /// The objects of `kind` in the namespace, by name.
    fn list(&self, kind: &str) -> BTreeMap<String, Value> {
        let out = self.cp.kubectl_ok(&["-n", NS, "get", kind, "-o", "json"]);
        let list: Value = serde_json::from_str(&out).expect("list JSON");
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|o| Some((o["metadata"]["name"].as_str()?.to_owned(), o.clone())))
            .collect()
    }

    /// Waits until `done` holds for the list of `kind`; how long it took.
    fn wait_tasks_or_proplets(
        &self,
        kind: &str,
        limit: Duration,
        done: impl Fn(&BTreeMap<String, Value>) -> bool,
    ) -> Duration {
        let started = Instant::now();
        loop {
            let all = self.list(kind);
            if done(&all) {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < limit,
                "{kind} not as expected within {limit:?}: {:#?}",
                all.iter()
                    .map(|(n, o)| (n, o["status"].clone()))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until every task is completed; how long it took.
    fn wait_all_completed(&self, count: usize, limit: Duration) -> Duration {
        self.wait_tasks_or_proplets("tasks", limit, |all| {
            all.len() == count && all.values().all(|t| t["status"]["phase"] == "completed")
        })
    }

    /// `/readyz`'s status and body.
    fn readiness(&self) -> (Option<u16>, String) {
        (
            http_status(self.metrics, "/readyz"),
            http_body(self.metrics, "/readyz"),
        )
    }

    /// Waits until `/readyz` answers `status`; how long it took and the body.
    fn wait_readiness(&self, status: u16, limit: Duration) -> (Duration, String) {
        let started = Instant::now();
        loop {
            let (now, body) = self.readiness();
            if now == Some(status) {
                return (started.elapsed(), body);
            }
            assert!(
                started.elapsed() < limit,
                "/readyz did not answer {status} within {limit:?}: {now:?} {body}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Tasks whose run an agent started more than once.
    fn run_twice(&mut self) -> Vec<(String, usize)> {
        let mut runs: BTreeMap<String, usize> = BTreeMap::new();
        for agent in &mut self.agents {
            for (id, n) in agent.runs() {
                *runs.entry(id).or_default() += n;
            }
        }
        runs.into_iter().filter(|(_, n)| *n > 1).collect()
    }

    /// Results the agents reported so far.
    fn reported(&mut self) -> usize {
        self.agents
            .iter_mut()
            .map(|a| a.count("task succeeded"))
            .sum()
    }

    /// Asserts each task's result: `nap-i` returns `i + 1000`, `add-i` `i + 1`.
    fn assert_results(&self) {
        for (name, task) in self.list("tasks") {
            let i: i64 = name
                .rsplit('-')
                .next()
                .and_then(|i| i.parse().ok())
                .unwrap_or_default();
            let expected = if name.starts_with("nap-") {
                i + 1000
            } else {
                i + 1
            };
            assert_eq!(
                task["status"]["results"],
                expected.to_string(),
                "{name}: {:#}",
                task["status"]
            );
        }
    }
}

fn add_task(prefix: &str, i: usize) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {prefix}-{i}\nspec:\n  name: {prefix}-{i}\n  functionName: add\n  file: {ADD_WASM}\n  inputs: [{i}, 1]\n"
    )
}

#[test]
fn a_leader_cut_off_from_the_api_server_stops_acting_keeps_what_devices_report_and_finishes_after()
{
    let Some(mut cut) = Cut::start() else {
        return;
    };
    let partition = Duration::from_secs(setting("PROPELLER_PARTITION_SECS", 20));
    // Eight tasks (two agents, four slots each) that finish one after another while the API
    // server is away.
    let naps = 8;
    let span = partition.as_millis() as u64 - 6_000;
    let manifest = (0..naps)
        .map(|i| nap_task_manifest(i as u64, 4_000 + span * i as u64 / naps as u64))
        .collect::<Vec<_>>()
        .join("---\n");
    apply(&cut.cp, NS, &manifest);
    cut.wait_tasks_or_proplets("tasks", Duration::from_secs(60), |all| {
        all.len() == naps && all.values().all(|t| t["status"]["phase"] == "running")
    });
    let before = cut.reported();

    let cut_at = Instant::now();
    cut.proxy.set_stalled(true);
    let (fenced_after, reason) = cut.wait_readiness(503, Duration::from_secs(LEASE_SECS));
    assert!(reason.contains("not renewed"), "{reason}");
    // The log says so at its next look, after the renewal in flight has timed out.
    cut.operator.wait_for(
        "leader Lease not renewed in time: fenced",
        Duration::from_secs(LEASE_SECS),
    );
    // Tasks created meanwhile (kubectl reaches the API server, propeller does not).
    let late = 8;
    let manifest = (0..late)
        .map(|i| add_task("late", i))
        .collect::<Vec<_>>()
        .join("---\n");
    apply(&cut.cp, NS, &manifest);
    while cut_at.elapsed() < partition {
        let (status, body) = cut.readiness();
        assert_eq!(status, Some(503), "ready while cut off: {body}");
        std::thread::sleep(Duration::from_millis(500));
    }
    let during = cut.reported() - before;
    let unchanged = cut
        .list("tasks")
        .values()
        .filter(|t| t["status"]["phase"] == "running")
        .count();

    cut.proxy.set_stalled(false);
    let (ready_after, _) = cut.wait_readiness(200, Duration::from_secs(30));
    let done_after = ready_after + cut.wait_all_completed(naps + late, Duration::from_secs(60));
    cut.assert_results();
    let twice = cut.run_twice();
    println!(
        "partition of {partition:?}: fenced {fenced_after:.1?} after the cut (Lease {LEASE_SECS} s, \
         fence at {} s); {during} results reported by the devices meanwhile, {unchanged} tasks \
         still shown running at the heal; every one of {} tasks completed {done_after:.1?} after \
         the heal, ready again {ready_after:.1?} after it; runs executed twice: {twice:?}",
        LEASE_SECS * 2 / 3,
        naps + late,
    );
    assert!(
        fenced_after < Duration::from_secs(LEASE_SECS),
        "fenced only after {fenced_after:?}"
    );
    assert!(
        during >= naps / 2,
        "only {during} results reached propeller during the partition"
    );
    assert!(
        unchanged >= during.min(naps) / 2,
        "results were written while the API server was away? {unchanged} running"
    );
    assert!(twice.is_empty(), "runs executed twice: {twice:?}");
}

#[test]
fn a_flapping_api_server_fences_and_unfences_the_leader_and_loses_nothing() {
    let Some(mut cut) = Cut::start() else {
        return;
    };
    let flapping = Duration::from_secs(setting("PROPELLER_FLAP_SECS", 30));
    let started = Instant::now();
    let mut applied = 0;
    let mut fenced_seen = 0;
    let mut was_fenced = false;
    while started.elapsed() < flapping {
        let away = (started.elapsed().as_secs() / 5) % 2 == 1;
        cut.proxy.set_stalled(away);
        let manifest = (applied..applied + 4)
            .map(|i| add_task("flap", i))
            .collect::<Vec<_>>()
            .join("---\n");
        apply(&cut.cp, NS, &manifest);
        applied += 4;
        let fenced = cut.readiness().0 == Some(503);
        fenced_seen += usize::from(fenced && !was_fenced);
        was_fenced = fenced;
        std::thread::sleep(Duration::from_millis(700));
    }
    cut.proxy.set_stalled(false);
    let done_after = cut.wait_all_completed(applied, Duration::from_secs(60));
    cut.wait_readiness(200, Duration::from_secs(30));
    cut.assert_results();
    let twice = cut.run_twice();
    let fences = cut
        .operator
        .count("leader Lease not renewed in time: fenced");
    println!(
        "flapping for {flapping:?} (5 s away, 5 s back): {applied} tasks, {fences} fences in the \
         leader's log ({fenced_seen} seen on /readyz), all completed {done_after:.1?} after the \
         last return; runs executed twice: {twice:?}"
    );
    assert!(
        fences >= 2,
        "the leader never stopped acting: {fences} fences"
    );
    assert!(twice.is_empty(), "runs executed twice: {twice:?}");
    let still = cut
        .operator
        .lines()
        .iter()
        .any(|l| l.contains("leadership lost"));
    assert!(!still, "the leader gave up its Lease");
}
