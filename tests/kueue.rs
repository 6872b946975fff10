//! Kueue admission of PropellerJobs with the real Kueue v0.19.2 (`../shared/envtest/kueue`)
//! on a real API server (with kube-controller-manager's garbage collector), `propeller run
//! --kueue` as its ServiceAccount with `configs/rbac` and `configs/kueue`, and real agents
//! running real Wasm.
//!
//! Without the envtest or Kueue assets the test prints one SKIPPED line and passes; with
//! `CI=true` it fails instead.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::envtest::{free_port, ControlPlane, Options};
use support::kube::{apply, cluster, get, mqtt_port, operator_command, STATUS_WAIT};
use support::kueue::Kueue;
use support::{device_agent, device_manifest, repo_root, Running};

const NS: &str = "fleet";
/// How long a job of long-running tasks may take to finish, queueing included.
const JOB_WAIT: Duration = Duration::from_secs(240);

/// The queues: a ClusterQueue `cq` of 4 slots (lower priority preempted within it) fed by
/// LocalQueues `lq-a` and `lq-b`; a ClusterQueue `pi-cq` of 2 slots on the ResourceFlavor
/// `pi` (node label `arch: arm64`) fed by `lq-pi`; priority classes `low` and `high`.
const QUEUES: &str = r#"
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: default-flavor}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {name: pi}
spec:
  nodeLabels: {arch: arm64}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: cq}
spec:
  namespaceSelector: {}
  preemption: {withinClusterQueue: LowerPriority}
  resourceGroups:
  - coveredResources: [propeller.absmach.eu/slots]
    flavors:
    - name: default-flavor
      resources:
      - {name: propeller.absmach.eu/slots, nominalQuota: 4}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {name: pi-cq}
spec:
  namespaceSelector: {}
  resourceGroups:
  - coveredResources: [propeller.absmach.eu/slots]
    flavors:
    - name: pi
      resources:
      - {name: propeller.absmach.eu/slots, nominalQuota: 2}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: lq-a, namespace: fleet}
spec: {clusterQueue: cq}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: lq-b, namespace: fleet}
spec: {clusterQueue: cq}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {name: lq-pi, namespace: fleet}
spec: {clusterQueue: pi-cq}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata: {name: low}
value: 10
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: WorkloadPriorityClass
metadata: {name: high}
value: 1000
"#;

/// A module whose `spin(n)` counts down from n·10⁹ and returns `n`, base64: a task that
/// runs for seconds, stopped only by its agent.
fn spin_module() -> String {
    support::standalone::spin_module_by(1_000_000_000)
}

/// A parallel PropellerJob of `tasks` tasks each running `spin(n)`, in LocalQueue `queue`
/// (none: not Kueue-managed) with priority class `priority`.
fn job(name: &str, queue: Option<&str>, priority: Option<&str>, tasks: usize, n: u32) -> String {
    let mut labels = String::new();
    if let Some(queue) = queue {
        labels += &format!("\n    kueue.x-k8s.io/queue-name: {queue}");
    }
    if let Some(priority) = priority {
        labels += &format!("\n    kueue.x-k8s.io/priority-class: {priority}");
    }
    let labels = if labels.is_empty() {
        String::new()
    } else {
        format!("\n  labels:{labels}")
    };
    let file = spin_module();
    let specs: String = (0..tasks)
        .map(|i| {
            format!("  - name: t{i}\n    functionName: spin\n    file: {file}\n    inputs: [{n}]\n")
        })
        .collect();
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: PropellerJob\nmetadata:\n  name: {name}{labels}\nspec:\n  name: {name}\n  executionMode: parallel\n  tasks:\n{specs}"
    )
}

/// (status, reason, message) of condition `type_` of `object`.
fn condition(object: &Value, type_: &str) -> Option<(String, String, String)> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (s("status"), s("reason"), s("message"))
        })
}

struct Setup {
    cp: ControlPlane,
    kueue: Kueue,
    operator: Running,
}

impl Setup {
    /// A control plane with `options`, the real Kueue configured with the book's
    /// integration entry, `configs/kueue`, the namespace with `queues`, `propeller run
    /// --kueue` as its ServiceAccount, and `devices` Running with their real agents; the
    /// setup, the MQTT port and the agents. `None` when the assets are missing.
    fn start(
        options: Options,
        queues: &str,
        devices: &[&str],
    ) -> Option<(Setup, u16, Vec<Running>)> {
        let (cp, kubeconfig) = cluster(options)?;
        let integrations =
            std::fs::read_to_string(repo_root().join("configs/kueue/kueue-integration.yaml"))
                .expect("configs/kueue/kueue-integration.yaml");
        let kueue = Kueue::start(&cp, &integrations)?;
        let loaded = std::fs::read_to_string(&kueue.log).unwrap_or_default();
        let first = loaded.lines().next().unwrap_or_default();
        assert!(
            first.contains("PropellerJob.v1.propeller.propeller.absmach.eu"),
            "Kueue did not load the integration entry: {first}"
        );
        cp.kubectl_ok(&["apply", "-k", "configs/kueue"]);
        cp.kubectl_ok(&["create", "namespace", NS]);
        apply(&cp, NS, queues);
        let mut cmd = operator_command(&kubeconfig, free_port());
        cmd.arg("--kueue");
        let operator = Running::spawn(cmd);
        let mqtt = mqtt_port(&operator);
        let setup = Setup {
            cp,
            kueue,
            operator,
        };
        let mut agents = Vec::new();
        for name in devices {
            apply(&setup.cp, NS, &device_manifest(name, mqtt));
            let state = setup.cp.scratch().join(format!("{name}-state"));
            agents.push(device_agent(name, mqtt, &state));
        }
        for name in devices {
            setup.wait("proplet", name, "Running", STATUS_WAIT, |o| {
                o["status"]["phase"] == "Running"
            });
        }
        Some((setup, mqtt, agents))
    }

    /// Polls `kind/name` until `done` holds, for at most `limit`; the object then.
    fn wait(
        &self,
        kind: &str,
        name: &str,
        what: &str,
        limit: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let started = Instant::now();
        loop {
            let object = get(&self.cp, NS, kind, name);
            if let Some(object) = &object {
                if done(object) {
                    return object.clone();
                }
            }
            if started.elapsed() >= limit {
                panic!(
                    "{kind}/{name}: not {what} within {limit:?}; last seen:\n{:#}\n{}",
                    object.map(|o| o["status"].clone()).unwrap_or(Value::Null),
                    self.story()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The Workloads, jobs and tasks of the namespace, and both logs' ends.
    fn story(&self) -> String {
        let mut story = String::new();
        for kind in ["workloads.kueue.x-k8s.io", "propellerjobs", "tasks"] {
            let out = self
                .cp
                .kubectl()
                .args(["-n", NS, "get", kind, "-o", "wide"])
                .output();
            let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            story += &format!("--- {kind}:\n{}\n", text.unwrap_or_default());
        }
        let lines = self.operator.stderr_so_far();
        story += &format!(
            "--- propeller logged:\n{}\n--- kueue logged:\n{}\n",
            lines[lines.len().saturating_sub(60)..].join("\n"),
            self.kueue.log_tail(40)
        );
        story
    }

    fn job_phase(&self, name: &str, phase: &str, limit: Duration) -> Value {
        self.wait("propellerjob", name, phase, limit, |o| {
            o["status"]["phase"] == phase
        })
    }

    /// Waits until job `name`'s `Suspended` condition is `status` (with `reason`, if given).
    fn suspended(&self, name: &str, status: &str, reason: Option<&str>) -> Value {
        self.wait(
            "propellerjob",
            name,
            &format!("Suspended={status} ({reason:?})"),
            STATUS_WAIT,
            |o| {
                condition(o, "Suspended")
                    .is_some_and(|(s, r, _)| s == status && reason.is_none_or(|want| r == want))
            },
        )
    }

    fn workload(&self, job: &str) -> Option<Value> {
        get(
            &self.cp,
            NS,
            "workloads.kueue.x-k8s.io",
            &format!("propellerjob-{job}"),
        )
    }

    /// The tasks of job `name`.
    fn tasks_of(&self, name: &str) -> Vec<Value> {
        let out = self.cp.kubectl_ok(&[
            "-n",
            NS,
            "get",
            "tasks",
            "-l",
            &format!("propeller.propeller.absmach.eu/job={name}"),
            "-o",
            "json",
        ]);
        let list: Value = serde_json::from_str(&out).unwrap_or_default();
        list["items"].as_array().cloned().unwrap_or_default()
    }

    fn event_reasons(&self, name: &str) -> Vec<String> {
        support::kube::event_reasons(&self.cp, NS, name)
    }
}

#[test]
fn kueue_queues_admits_preempts_and_restricts_propeller_jobs_on_real_agents() {
    let started = Instant::now();
    let Some((setup, mqtt, mut agents)) = Setup::start(
        Options {
            controller_manager: true,
            ..Options::default()
        },
        QUEUES,
        &["edge-a", "edge-b", "edge-pi"],
    ) else {
        return;
    };
    let cp = &setup.cp;
    cp.kubectl_ok(&["-n", NS, "label", "proplet", "edge-pi", "arch=arm64"]);
    println!("set up in {:?}", started.elapsed());

    // --- 4 slots, three jobs of 2: two run, the third waits with Kueue's reason.
    apply(cp, NS, &job("j1", Some("lq-a"), None, 2, 5));
    apply(cp, NS, &job("j2", Some("lq-b"), None, 2, 5));
    for name in ["j1", "j2"] {
        setup.wait("propellerjob", name, "admitted", STATUS_WAIT, |o| {
            condition(o, "QuotaReserved").is_some_and(|(s, _, _)| s == "True")
        });
    }
    apply(cp, NS, &job("j3", Some("lq-a"), None, 2, 4));
    let waiting = setup.wait("propellerjob", "j3", "waiting on quota", STATUS_WAIT, |o| {
        condition(o, "QuotaReserved")
            .is_some_and(|(s, _, m)| s == "False" && m.contains("insufficient"))
    });
    let (held, reason, _) = condition(&waiting, "Suspended").unwrap_or_default();
    assert_eq!((held.as_str(), reason.as_str()), ("True", "Pending"));
    assert_eq!(
        waiting["status"]["phase"], "Pending",
        "{:#}",
        waiting["status"]
    );
    assert!(
        setup.tasks_of("j3").is_empty(),
        "a waiting job creates no task"
    );
    assert!(setup.event_reasons("j3").contains(&"Suspended".to_owned()));
    for name in ["j1", "j2"] {
        setup.job_phase(name, "Completed", JOB_WAIT);
        let workload = setup.workload(name).unwrap_or_default();
        assert_eq!(
            condition(&workload, "Finished").map(|c| c.0),
            Some("True".to_owned()),
            "{name}'s Workload: {:#}",
            workload["status"]
        );
    }
    let j3 = setup.job_phase("j3", "Completed", JOB_WAIT);
    assert_eq!(
        condition(&j3, "Suspended").map(|c| c.1),
        Some("Resumed".into())
    );
    println!("queueing shown at {:?}", started.elapsed());

    // --- Preemption: a high-priority job evicts a running low-priority one, whose runs are
    // stopped; it is given back its quota, re-admitted later, and finishes.
    apply(cp, NS, &job("low", Some("lq-a"), Some("low"), 4, 8));
    setup.wait(
        "propellerjob",
        "low",
        "running its 4 tasks",
        STATUS_WAIT,
        |_| {
            let tasks = setup.tasks_of("low");
            tasks.len() == 4 && tasks.iter().all(|t| t["status"]["phase"] == "running")
        },
    );
    apply(cp, NS, &job("high", Some("lq-b"), Some("high"), 2, 4));
    let evicted = setup.suspended("low", "True", Some("Preempted"));
    println!("low preempted: {:#}", evicted["status"]["conditions"]);
    setup.wait("propellerjob", "low", "stopped", STATUS_WAIT, |_| {
        setup
            .tasks_of("low")
            .iter()
            .all(|t| t["status"]["phase"] == "pending" && t["spec"]["suspend"] == true)
    });
    let high = setup.job_phase("high", "Completed", JOB_WAIT);
    assert_eq!(high["status"]["completedCount"], 2);
    let low = setup.job_phase("low", "Completed", JOB_WAIT);
    assert_eq!(low["status"]["completedCount"], 4, "{:#}", low["status"]);
    for task in setup.tasks_of("high") {
        assert_eq!(task["status"]["runCount"], 1, "{:#}", task["status"]);
    }
    for task in setup.tasks_of("low") {
        // Started, stopped by the eviction, started again once: one finished run.
        assert_eq!(task["status"]["runCount"], 2, "{:#}", task["status"]);
        assert_eq!(task["status"]["results"], "8", "{:#}", task["status"]);
    }
    assert!(setup.event_reasons("low").contains(&"Resumed".to_owned()));
    println!("preemption shown at {:?}", started.elapsed());

    // --- A ResourceFlavor's node labels restrict the job to the proplets carrying them.
    apply(cp, NS, &job("on-pi", Some("lq-pi"), None, 2, 1));
    setup.job_phase("on-pi", "Completed", JOB_WAIT);
    for task in setup.tasks_of("on-pi") {
        assert_eq!(task["status"]["assignedProplet"], "edge-pi", "{task:#}");
        assert_eq!(
            task["spec"]["propletSelector"]["matchLabels"]["arch"],
            "arm64"
        );
    }

    // --- A job without the label is not Kueue's: it runs at once, with no Workload.
    apply(cp, NS, &job("free", None, None, 2, 1));
    let free = setup.job_phase("free", "Completed", JOB_WAIT);
    assert!(condition(&free, "QuotaReserved").is_none());
    assert!(setup.workload("free").is_none());

    // --- Deleting a job gives its quota back: the one waiting behind it is admitted.
    apply(cp, NS, &job("hog", Some("lq-a"), None, 4, 30));
    setup.wait("propellerjob", "hog", "admitted", STATUS_WAIT, |o| {
        condition(o, "QuotaReserved").is_some_and(|(s, _, _)| s == "True")
    });
    apply(cp, NS, &job("next", Some("lq-b"), None, 2, 1));
    setup.suspended("next", "True", Some("Pending"));
    cp.kubectl_ok(&["-n", NS, "delete", "propellerjob", "hog", "--wait=false"]);
    setup.job_phase("next", "Completed", JOB_WAIT);

    // --- The book's example queues and job, as applied there, on a device in `default`.
    apply(cp, "default", &device_manifest("edge-d", mqtt));
    agents.push(device_agent(
        "edge-d",
        mqtt,
        &cp.scratch().join("edge-d-state"),
    ));
    cp.kubectl_ok(&["apply", "-f", "configs/kueue/examples/queues.yaml"]);
    cp.kubectl_ok(&["apply", "-f", "configs/kueue/examples/job.yaml"]);
    let example = support::kube::wait_until(
        cp,
        "default",
        "propellerjob",
        "queued-sum",
        "Completed",
        |o| o["status"]["phase"] == "Completed",
    );
    assert_eq!(
        condition(&example, "QuotaReserved").map(|c| c.0),
        Some("True".into())
    );
    let workload = get(
        cp,
        "default",
        "workloads.kueue.x-k8s.io",
        "propellerjob-queued-sum",
    )
    .unwrap_or_default();
    assert_eq!(workload["spec"]["priority"], 1000, "{workload:#}");
    assert_eq!(workload["spec"]["podSets"][0]["count"], 2, "{workload:#}");
    println!("all shown at {:?}", started.elapsed());
    drop(agents);
}

/// What Kueue adds, measured (`scripts/bench-kueue.sh`; ignored in the suite): `ROUNDS`
/// pairs of one-task jobs, a plain one and a queued one alternating, after warm-ups; from
/// just before `kubectl apply` to the task's `startedAt` (the start sent to its device), and
/// the API server's requests per job of each kind (its own request counter).
#[test]
#[ignore = "a benchmark: scripts/bench-kueue.sh"]
fn bench_what_kueue_adds_from_create_to_first_task_running() {
    const ROUNDS: usize = 20;
    const WARMUPS: usize = 3;
    let queues = QUEUES.replace("nominalQuota: 4}", "nominalQuota: 1000}");
    let Some((setup, _, agents)) = Setup::start(Options::default(), &queues, &["edge-a", "edge-b"])
    else {
        return;
    };
    let cp = &setup.cp;
    // One job: seconds from just before its apply to its task's startedAt.
    let run = |name: &str, queued: bool| -> f64 {
        let manifest = job(name, queued.then_some("lq-a"), None, 1, 0);
        let before = chrono::Utc::now();
        apply(cp, NS, &manifest);
        let done = setup.job_phase(name, "Completed", JOB_WAIT);
        let tasks = setup.tasks_of(name);
        let started = tasks
            .iter()
            .filter_map(|t| t["status"]["startedAt"].as_str())
            .filter_map(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
            .min()
            .unwrap_or_else(|| panic!("{name}: no startedAt: {:#}", done["status"]));
        (started.with_timezone(&chrono::Utc) - before).as_seconds_f64()
    };
    for i in 0..WARMUPS {
        run(&format!("warm-plain-{i}"), false);
        run(&format!("warm-queued-{i}"), true);
    }
    let mut plain = Vec::new();
    let mut queued = Vec::new();
    let mut plain_requests = BTreeMap::new();
    let mut queued_requests = BTreeMap::new();
    for i in 0..ROUNDS {
        for (is_queued, times, requests) in [
            (false, &mut plain, &mut plain_requests),
            (true, &mut queued, &mut queued_requests),
        ] {
            let name = format!("{}-{i}", if is_queued { "queued" } else { "plain" });
            let before = request_counts(cp);
            times.push(run(&name, is_queued));
            // The job's last writes (its Workload's Finished) land after it completes.
            std::thread::sleep(Duration::from_millis(500));
            for (key, n) in request_counts(cp) {
                let delta = n - before.get(&key).copied().unwrap_or(0.0);
                if delta > 0.0 {
                    *requests.entry(key).or_insert(0.0) += delta;
                }
            }
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "create -> first task started, median of {ROUNDS} (s): plain {:.3}, Kueue-managed {:.3}, Kueue adds {:.3}",
        median(&mut plain),
        median(&mut queued),
        median(&mut queued) - median(&mut plain)
    );
    for (what, requests) in [
        ("plain", &plain_requests),
        ("Kueue-managed", &queued_requests),
    ] {
        println!("API requests per {what} job (verb resource/subresource: count), all clients:");
        for (key, n) in requests {
            println!("  {key}: {:.1}", n / ROUNDS as f64);
        }
    }
    drop(agents);
}

/// The API server's request counter for the kinds a job touches, by verb and resource, from
/// its `/metrics` (every client's, this test's `kubectl` reads included).
fn request_counts(cp: &ControlPlane) -> BTreeMap<String, f64> {
    let text = cp.kubectl_ok(&["get", "--raw", "/metrics"]);
    let mut counts = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("apiserver_request_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels
                .split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.trim_end_matches('"').to_owned())
                .unwrap_or_default()
        };
        let resource = label("resource");
        let kinds = ["workloads", "propellerjobs", "tasks", "events"];
        if !kinds.contains(&resource.as_str()) {
            continue;
        }
        let subresource = label("subresource");
        let key = format!(
            "{} {resource}{}",
            label("verb"),
            if subresource.is_empty() {
                String::new()
            } else {
                format!("/{subresource}")
            }
        );
        *counts.entry(key).or_insert(0.0) += value.parse::<f64>().unwrap_or(0.0);
    }
    counts
}
