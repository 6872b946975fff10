//! Daemons that move: a daemon whose device stops answering is placed on another matching
//! device once its proplet has been Offline for the task's `offlineTolerationSeconds`, and
//! the copy left on the first device is fenced (stopped as soon as it is back, its output
//! refused meanwhile). Real agents on `propeller standalone`; the first device is frozen
//! with SIGSTOP, so that its copy is still there, running, when it comes back.

mod support;

use std::time::{Duration, Instant};

use support::standalone::{apply_text, get_json, wait_for_phase};
use support::{propeller_client, start_standalone, Running};

/// The threshold after which a silent proplet is Offline, in both modes here.
const THRESHOLD_SECS: u64 = support::kube::LAST_SEEN_THRESHOLD_SECS;
/// The daemon's toleration of an Offline proplet.
const TOLERATION_SECS: u64 = 3;

/// How the scenario reads and writes the objects: through standalone's API or kubectl.
trait Control {
    fn apply(&self, manifest: &str);
    /// The Task `roam`'s status.
    fn daemon(&self) -> serde_json::Value;
    fn wait_running(&self, proplet: &str);
    /// The lines of the daemon's log `proplet` sent, when this mode reads them here.
    fn lines_from(&self, proplet: &str) -> Option<usize>;
    /// What the task's Events say.
    fn events(&self) -> String;
}

/// `name`'s Proplet (labelled `role: edge`) for its agent on `port`.
fn edge_manifest(name: &str, port: impl std::fmt::Display) -> String {
    support::device_manifest(name, port).replace(
        &format!("metadata:\n  name: {name}\nspec:"),
        &format!("metadata:\n  name: {name}\n  labels:\n    role: edge\nspec:"),
    )
}

fn signal(agent: &Running, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(agent.child.id()).expect("pid");
    // SAFETY: a signal to a child process this test started and still holds.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill {pid}");
}

/// Waits until the daemon's status satisfies `done`; every status seen on the way must name
/// at most one proplet running it. Returns the status.
fn watch_until(
    control: &dyn Control,
    what: &str,
    limit: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let started = Instant::now();
    loop {
        let status = control.daemon();
        assert!(
            status["broadcastProplets"]
                .as_array()
                .is_none_or(Vec::is_empty),
            "{status:#}"
        );
        if done(&status) {
            return status;
        }
        assert!(
            started.elapsed() < limit,
            "{what} not within {limit:?}: {status:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The daemon on two matching devices: the one running it is frozen (SIGSTOP), the daemon
/// moves to the other once the frozen one has been Offline for the toleration, and the
/// frozen one, thawed with its copy still running, is sent a stop.
fn a_daemon_moves_and_its_copy_is_fenced(
    control: &dyn Control,
    mut agents: Vec<(&'static str, Running)>,
) {
    // Prints a line every 200 ms for hours: a daemon.
    control.apply(&format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: roam\nspec:\n  name: roam\n  functionName: print\n  file: {}\n  inputs: [100000, 200]\n  daemon: true\n  offlineTolerationSeconds: {TOLERATION_SECS}\n  propletSelector:\n    matchLabels:\n      role: edge\n",
        support::printer_module()
    ));
    let first = watch_until(control, "the daemon running", support::WAIT, |s| {
        s["phase"] == "running"
    });
    let from = first["assignedProplet"]
        .as_str()
        .expect("assigned")
        .to_owned();
    if agents[0].0 != from {
        agents.swap(0, 1);
    }
    let to = agents[1].0;
    agents[0]
        .1
        .stderr_line_within("task accepted", Duration::from_secs(10));
    // Its copy prints before the freeze (where this mode reads the lines).
    let deadline = Instant::now() + Duration::from_secs(10);
    while control.lines_from(&from) == Some(0) {
        assert!(Instant::now() < deadline, "no line from {from}'s copy");
        std::thread::sleep(Duration::from_millis(200));
    }

    let frozen_at = Instant::now();
    signal(&agents[0].1, libc::SIGSTOP);
    let moved = watch_until(
        control,
        "the daemon running elsewhere",
        Duration::from_secs(60),
        |s| s["phase"] == "running" && s["assignedProplet"] == to,
    );
    let moved_after = frozen_at.elapsed();
    assert_eq!(moved["runCount"], 2, "{moved:#}");
    let displaced = moved["displacedRuns"].as_array().expect("displaced runs");
    assert_eq!(displaced.len(), 1, "{moved:#}");
    assert_eq!(displaced[0]["proplet"], from.as_str());
    assert_eq!(displaced[0]["run"], 1);
    // Not before its proplet was Offline (the threshold, less a heartbeat's interval) and
    // the toleration ran out.
    assert!(
        moved_after >= Duration::from_secs(THRESHOLD_SECS + TOLERATION_SECS - 1),
        "moved after {moved_after:?}"
    );
    agents[1]
        .1
        .stderr_line_within("task accepted", Duration::from_secs(10));
    let kept_from_first = control.lines_from(&from);

    // The frozen device comes back with its copy still running: it is sent a stop.
    let thawed_at = Instant::now();
    signal(&agents[0].1, libc::SIGCONT);
    control.wait_running(&from);
    agents[0]
        .1
        .stderr_line_within("stop requested", Duration::from_secs(30));
    let stopped_after = thawed_at.elapsed();
    let fenced = watch_until(
        control,
        "the displaced run forgotten",
        Duration::from_secs(30),
        |s| s["displacedRuns"].as_array().is_none_or(Vec::is_empty),
    );
    assert_eq!(fenced["assignedProplet"], to, "{fenced:#}");
    assert_eq!(fenced["phase"], "running");
    assert_eq!(fenced["runCount"], 2);
    // The second device keeps printing; nothing the first one's copy printed after the move
    // was taken.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        control.lines_from(&from),
        kept_from_first,
        "lines from the displaced copy were taken"
    );
    assert!(control.lines_from(to).is_none_or(|n| n > 0), "{to} prints");
    println!(
        "daemon moved from {from} to {to} {:.1} s after {from} froze (threshold {THRESHOLD_SECS} s, toleration {TOLERATION_SECS} s); {from} back: its copy stopped {:.1} s after it thawed\n{}",
        moved_after.as_secs_f64(),
        stopped_after.as_secs_f64(),
        control.events()
    );
}

/// `propeller standalone`, through its API.
struct Standalone {
    api: String,
    dir: std::path::PathBuf,
}

impl Control for Standalone {
    fn apply(&self, manifest: &str) {
        apply_text(&self.api, &self.dir, "manifest.yaml", manifest);
    }
    fn daemon(&self) -> serde_json::Value {
        get_json(&self.api, &self.dir, &["get", "task", "roam"])["status"].clone()
    }
    fn wait_running(&self, proplet: &str) {
        wait_for_phase(&self.api, &self.dir, proplet, "Running");
    }
    fn lines_from(&self, proplet: &str) -> Option<usize> {
        let (ok, out, err) =
            propeller_client(&self.api, &self.dir, &["logs", "task/roam", "--prefix"]);
        assert!(ok, "propeller logs: {err}");
        let prefix = format!("[{proplet}] ");
        Some(out.lines().filter(|l| l.starts_with(&prefix)).count())
    }
    fn events(&self) -> String {
        propeller_client(&self.api, &self.dir, &["describe", "task", "roam"]).1
    }
}

#[test]
fn a_daemon_moves_off_a_frozen_device_and_its_copy_there_is_stopped_when_it_returns() {
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path();
    let threshold = format!("{THRESHOLD_SECS}s");
    let (_server, api, port) = start_standalone(work, &["--last-seen-threshold", &threshold]);
    let control = Standalone {
        api,
        dir: work.to_owned(),
    };
    let agents = ["east", "west"]
        .into_iter()
        .map(|name| {
            control.apply(&edge_manifest(name, &port));
            let agent = support::device_agent(name, &port, &work.join(format!("{name}-state")));
            (name, agent)
        })
        .collect::<Vec<_>>();
    for (name, _) in &agents {
        control.wait_running(name);
    }
    a_daemon_moves_and_its_copy_is_fenced(&control, agents);
}

/// `propeller run` on a real API server, through kubectl.
struct Kubernetes {
    cp: support::envtest::ControlPlane,
}

const NAMESPACE: &str = "roaming";

impl Control for Kubernetes {
    fn apply(&self, manifest: &str) {
        support::kube::apply(&self.cp, NAMESPACE, manifest);
    }
    fn daemon(&self) -> serde_json::Value {
        support::kube::get(&self.cp, NAMESPACE, "task", "roam")
            .map(|t| t["status"].clone())
            .unwrap_or_default()
    }
    fn wait_running(&self, proplet: &str) {
        support::kube::wait_phase(&self.cp, NAMESPACE, "proplet", proplet, "Running");
    }
    fn lines_from(&self, _proplet: &str) -> Option<usize> {
        None
    }
    fn events(&self) -> String {
        self.cp.kubectl_ok(&[
            "-n",
            NAMESPACE,
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=roam",
            "-o",
            "custom-columns=TYPE:.type,REASON:.reason,MESSAGE:.message",
        ])
    }
}

#[test]
fn on_a_real_api_server_a_daemon_moves_off_a_frozen_device_and_its_copy_is_stopped() {
    use support::envtest::{free_port, Options};
    let Some((cp, kubeconfig)) = support::kube::cluster(Options::default()) else {
        return;
    };
    let operator = Running::spawn(support::kube::operator_command(&kubeconfig, free_port()));
    let mqtt = support::kube::mqtt_port(&operator);
    cp.kubectl_ok(&["create", "namespace", NAMESPACE]);
    let control = Kubernetes { cp };
    let agents = ["east", "west"]
        .into_iter()
        .map(|name| {
            control.apply(&edge_manifest(name, mqtt));
            let state = control.cp.scratch().join(format!("{name}-state"));
            (name, support::device_agent(name, mqtt, &state))
        })
        .collect::<Vec<_>>();
    for (name, _) in &agents {
        control.wait_running(name);
    }
    a_daemon_moves_and_its_copy_is_fenced(&control, agents);
}
