//! The operator against a real kube-apiserver (etcd, RBAC, CEL on): the CRDs and every
//! manifest as the server judges them, and `propeller run` as a separate process with the
//! rights of the ServiceAccount `configs/rbac` binds, never as admin.
//!
//! Each test starts its own control plane (`support::envtest`, about 6 s) because nextest
//! runs every test in a process of its own. Without the envtest assets the tests print one
//! SKIPPED line and pass; with `CI=true` they fail instead.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::envtest::{free_port, ControlPlane, Options};
use support::kube::{
    apply, cluster, event_reasons, get, http_body, http_status, mqtt_port, operator_command,
    task_manifest, wait_event_reason, wait_gone, wait_http, wait_phase, wait_phase_explained,
    wait_until, STATUS_WAIT,
};
use support::{binary, repo_root, Running};

/// Liveness threshold the operator runs with in these tests.
const THRESHOLD_SECS: u64 = support::kube::LAST_SEEN_THRESHOLD_SECS;

/// A control plane with one operator (`operator-a`) leading and an empty namespace `ns`;
/// the operator's MQTT port.
fn operator_in(options: Options, ns: &str) -> Option<(ControlPlane, Running, u16)> {
    let (cp, kubeconfig) = cluster(options)?;
    let (operator, mqtt, _) = start_operator(&kubeconfig, "operator-a");
    cp.kubectl_ok(&["create", "namespace", ns]);
    Some((cp, operator, mqtt))
}

/// `propeller run` as the ServiceAccount, with leader election on; returns the process and
/// its MQTT and metrics ports once it leads and listens.
fn start_operator(kubeconfig: &Path, identity: &str) -> (Running, u16, u16) {
    start_operator_with(kubeconfig, identity, &[])
}

/// [`start_operator`] with more flags.
fn start_operator_with(kubeconfig: &Path, identity: &str, extra: &[&str]) -> (Running, u16, u16) {
    let (process, metrics) = spawn_operator_with(kubeconfig, identity, extra);
    let mqtt = mqtt_port(&process);
    (process, mqtt, metrics)
}

fn spawn_operator(kubeconfig: &Path, identity: &str) -> (Running, u16) {
    spawn_operator_with(kubeconfig, identity, &[])
}

fn spawn_operator_with(kubeconfig: &Path, identity: &str, extra: &[&str]) -> (Running, u16) {
    let metrics = free_port();
    let mut cmd = operator_command(kubeconfig, metrics);
    cmd.args(["--leader-elect", "--lease-namespace", "propeller-system"])
        .args(extra)
        .env("HOSTNAME", identity);
    (Running::spawn(cmd), metrics)
}

/// An external Proplet `name` in `namespace` with its key Secret, and its real agent.
fn device(cp: &ControlPlane, namespace: &str, name: &str, mqtt: u16) -> Running {
    apply(cp, namespace, &support::device_manifest(name, mqtt));
    start_agent(cp, name, mqtt)
}

fn start_agent(cp: &ControlPlane, name: &str, mqtt: u16) -> Running {
    support::device_agent(name, mqtt, &cp.scratch().join(format!("{name}-state")))
}

/// At most the first 600 characters of an API server's answer: refusals quote whole
/// inline modules.
fn shorten(text: &str) -> String {
    let mut short: String = text.chars().take(600).collect();
    if short.len() < text.len() {
        short.push_str("...");
    }
    short
}

/// The last 3,000 characters of a log.
fn shorten_tail(text: &str) -> String {
    let skip = text.chars().count().saturating_sub(3000);
    text.chars().skip(skip).collect()
}

/// Every YAML file under `dir`, at any depth.
fn yaml_files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = yaml_files(dir);
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.path().is_dir() {
            out.extend(yaml_files_under(&entry.path()));
        }
    }
    out
}

/// The files a kustomization includes, following nested kustomizations.
fn kustomized_files(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string(dir.join("kustomization.yaml")).expect("kustomization");
    let doc: Value = serde_yaml_ng::from_str(&text).expect("kustomization YAML");
    let mut out = Vec::new();
    for resource in doc["resources"].as_array().into_iter().flatten() {
        let path = dir.join(resource.as_str().unwrap_or_default());
        if path.is_dir() {
            out.extend(kustomized_files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Every YAML file directly in `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_sample_and_install_file_passes_a_server_side_dry_run() {
    let Some((cp, _)) = cluster(Options::default()) else {
        return;
    };
    let mut refused = Vec::new();
    let mut checked = 0;
    let mut dry_run = |what: String, args: Vec<String>| {
        let out = cp.kubectl().args(&args).output().expect("run kubectl");
        checked += 1;
        if !out.status.success() {
            refused.push(format!(
                "{what}: {}",
                shorten(&String::from_utf8_lossy(&out.stderr))
            ));
        }
    };
    // Server-side apply: large inline modules do not fit the client-side annotation.
    let apply = ["apply", "--server-side", "--dry-run=server"].map(String::from);
    let samples = repo_root().join("tests/fixtures/upstream-samples");
    let ours = repo_root().join("configs/samples");
    let quickstart = repo_root().join("configs/samples/quickstart");
    let mut judged: Vec<PathBuf> = Vec::new();
    for file in yaml_files(&samples)
        .into_iter()
        .chain(yaml_files(&ours))
        .chain(yaml_files(&quickstart))
    {
        if file.file_name().is_some_and(|n| n == "kustomization.yaml") {
            continue;
        }
        judged.push(file.clone());
        let path = file.display().to_string();
        let args = [
            &["-n".into(), "default".into()][..],
            &apply,
            &["-f".into(), path.clone()],
        ];
        dry_run(path, args.concat());
    }
    // The kustomizations, as kubectl builds them.
    let kustomizations = [
        "configs/crd",
        "configs/rbac",
        "configs/deploy",
        "configs/kueue",
        "configs/samples",
    ];
    for dir in kustomizations {
        dry_run(
            format!("-k {dir}"),
            [&apply[..], &["-k".into(), dir.into()]].concat(),
        );
        judged.extend(kustomized_files(&repo_root().join(dir)));
    }
    // Kueue's configuration entry is no manifest, and the examples are Kueue's kinds: the
    // Kueue test starts the real Kueue with the one and applies the others.
    for file in [
        "kueue-integration.yaml",
        "examples/queues.yaml",
        "examples/job.yaml",
    ] {
        judged.push(repo_root().join("configs/kueue").join(file));
    }
    // Nothing under configs/ escapes: every manifest was judged directly or through a
    // kustomization, except the Helm chart (the chart test renders it for the server).
    let unjudged: Vec<PathBuf> = yaml_files_under(&repo_root().join("configs"))
        .into_iter()
        .filter(|f| !f.starts_with(repo_root().join("configs/helm")))
        .filter(|f| f.file_name().is_some_and(|n| n != "kustomization.yaml"))
        .filter(|f| !judged.iter().any(|j| same_file(j, f)))
        .collect();
    assert!(
        unjudged.is_empty(),
        "manifests no test sends to the API server: {unjudged:?}"
    );
    assert!(checked > 30, "only {checked} manifests found");
    assert!(
        refused.is_empty(),
        "the API server refused:\n{}",
        refused.join("\n")
    );
}

#[test]
fn external_proplets_run_tasks_dags_broadcasts_and_jobs_through_the_operator() {
    let ns = "e2e";
    let Some((cp, operator, mqtt)) = operator_in(Options::default(), ns) else {
        return;
    };
    let _a = device(&cp, ns, "edge-a", mqtt);
    let mut b = device(&cp, ns, "edge-b", mqtt);
    wait_phase(&cp, ns, "proplet", "edge-a", "Running");
    wait_phase(&cp, ns, "proplet", "edge-b", "Running");

    // The quick start's task, exactly as the book's Kubernetes steps apply it.
    cp.kubectl_ok(&["-n", ns, "apply", "-f", "configs/samples/task-add.yaml"]);
    let add = wait_phase(&cp, ns, "task", "wasm-add", "completed");
    assert_eq!(add["status"]["results"], "42", "{:#}", add["status"]);
    let scheduled = add["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Scheduled"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(scheduled["reason"], "PropletAssigned", "{scheduled:#}");
    assert!(
        scheduled["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("assigned to edge-")),
        "{scheduled:#}"
    );
    let reasons = event_reasons(&cp, ns, "wasm-add");
    assert!(
        !reasons.iter().any(|r| r == "Completed"),
        "a success is in the status, not an Event: {reasons:?}"
    );

    // A DAG: second runs after first; the failure branch is skipped.
    let dag = [
        task_manifest("first", "[10, 32]", "  workflowId: wf\n"),
        task_manifest(
            "second",
            "[100, 200]",
            "  workflowId: wf\n  dependsOn: [first]\n  runIf: success\n",
        ),
        task_manifest(
            "on-failure",
            "[1, 1]",
            "  workflowId: wf\n  dependsOn: [first]\n  runIf: failure\n",
        ),
    ]
    .join("---\n");
    apply(&cp, ns, &dag);
    let first = wait_phase(&cp, ns, "task", "first", "completed");
    let second = wait_phase(&cp, ns, "task", "second", "completed");
    assert_eq!(second["status"]["results"], "300");
    let (done, started) = (
        first["status"]["finishedAt"].as_str().unwrap_or_default(),
        second["status"]["startedAt"].as_str().unwrap_or_default(),
    );
    assert!(started >= done, "second started {started} before {done}");
    wait_phase(&cp, ns, "task", "on-failure", "skipped");
    assert!(event_reasons(&cp, ns, "on-failure")
        .iter()
        .any(|r| r == "Skipped"));

    // Broadcast to both agents: every result kept.
    cp.kubectl_ok(&[
        "-n",
        ns,
        "apply",
        "-f",
        "configs/samples/task-broadcast.yaml",
    ]);
    let broadcast = wait_phase(&cp, ns, "task", "wasm-add-everywhere", "completed");
    let results = broadcast["status"]["results"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert_eq!(results.len(), 2, "{:#}", broadcast["status"]);
    assert!(results.values().all(|r| r["results"] == "3"), "{results:?}");

    // A PropellerJob in each execution mode.
    for mode in ["parallel", "sequential", "configurable"] {
        apply(&cp, ns, &support::propeller_job_manifest(mode));
    }
    for mode in ["parallel", "sequential", "configurable"] {
        wait_phase(&cp, ns, "pjob", mode, "Completed");
        let first = wait_phase(&cp, ns, "task", &format!("{mode}-first"), "completed");
        let second = wait_phase(&cp, ns, "task", &format!("{mode}-second"), "completed");
        assert_eq!(first["status"]["results"], "3", "{mode}");
        assert_eq!(second["status"]["results"], "7", "{mode}");
    }

    // The agent killed without a goodbye: Offline within the threshold + 2 s, Running
    // again once it is back.
    let killed = Instant::now();
    let _ = b.child.kill();
    let _ = b.child.wait();
    wait_phase(&cp, ns, "proplet", "edge-b", "Offline");
    let offline_after = killed.elapsed();
    eprintln!("edge-b Offline {offline_after:?} after SIGKILL");
    assert!(
        offline_after <= Duration::from_secs(THRESHOLD_SECS + 2),
        "Offline after {offline_after:?}"
    );
    b = start_agent(&cp, "edge-b", mqtt);
    wait_phase(&cp, ns, "proplet", "edge-b", "Running");

    // Delete: the finalizer is released and the Task goes.
    cp.kubectl_ok(&["-n", ns, "delete", "task", "wasm-add", "--wait=false"]);
    wait_gone(&cp, ns, "task", "wasm-add");
    drop(b);
    drop(operator);
}

/// Whether `object` carries no finalizer.
fn holds_no_finalizer(object: &Value) -> bool {
    object["metadata"]["finalizers"]
        .as_array()
        .is_none_or(|f| f.is_empty())
}

/// The Task finalizer costs the API server a request of its own, so only a task written
/// `running` gets it: a quick task never does, and one deleted while its young run is out is
/// stopped from the Task watch's deletion.
#[test]
fn a_quick_task_gets_no_finalizer_one_with_a_ttl_goes_and_a_run_deleted_without_one_is_stopped() {
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    // A long running-write delay keeps the spinning task `scheduled`, without the
    // finalizer, for the whole test.
    let (operator, mqtt, _) =
        start_operator_with(&kubeconfig, "operator-a", &["--running-write-delay", "5m"]);
    let ns = "finalizers";
    cp.kubectl_ok(&["create", "namespace", ns]);
    let agent = device(&cp, ns, "edge", mqtt);
    wait_phase(&cp, ns, "proplet", "edge", "Running");

    apply(&cp, ns, &task_manifest("quick", "[1, 2]", ""));
    let quick = wait_phase(&cp, ns, "task", "quick", "completed");
    assert_eq!(quick["status"]["results"], "3");
    assert!(holds_no_finalizer(&quick), "{:#}", quick["metadata"]);
    // `ttlSecondsAfterFinished`: the operator deletes it once that has passed.
    apply(
        &cp,
        ns,
        &task_manifest(
            "brief",
            "[2, 3]",
            "  ttlSecondsAfterFinished: 1
",
        ),
    );
    wait_gone(&cp, ns, "task", "brief");
    assert!(get(&cp, ns, "task", "quick").is_some(), "quick went too");

    apply(
        &cp,
        ns,
        &support::standalone::spin_task("young", 2_000_000_000, ""),
    );
    let young = wait_phase(&cp, ns, "task", "young", "scheduled");
    let uid = young["metadata"]["uid"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(!uid.is_empty(), "{young:#}");
    let sent = Instant::now();
    while !agent
        .stderr_so_far()
        .iter()
        .any(|l| l.contains("task accepted") && l.contains(&uid))
    {
        assert!(sent.elapsed() < STATUS_WAIT, "the agent never took {uid}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let young = get(&cp, ns, "task", "young").expect("the young task");
    assert_eq!(young["status"]["phase"], "scheduled", "{young:#}");
    assert!(holds_no_finalizer(&young), "{:#}", young["metadata"]);

    cp.kubectl_ok(&["-n", ns, "delete", "task", "young", "--wait=false"]);
    wait_gone(&cp, ns, "task", "young");
    let stopped = agent.stderr_line_within("stop requested", STATUS_WAIT);
    assert!(stopped.contains(&uid), "{stopped}");
    wait_event_reason(&cp, ns, "young", "Stopped");
    drop(agent);
    drop(operator);
}

#[test]
fn leader_election_fails_over_and_a_task_applied_meanwhile_runs_once() {
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let (mut leader, mqtt_a, metrics_a) = start_operator(&kubeconfig, "operator-a");
    let (standby, metrics_b) = spawn_operator(&kubeconfig, "operator-b");
    // Only the leader is ready (once its caches are filled; its MQTT listener comes
    // first); the standby answers /healthz but not /readyz.
    wait_http(metrics_a, "/readyz", 200);
    wait_http(metrics_b, "/healthz", 200);
    assert_eq!(http_status(metrics_b, "/readyz"), Some(503));
    let lease = get(&cp, "propeller-system", "lease", "propeller-leader").expect("lease");
    assert_eq!(lease["spec"]["holderIdentity"], "operator-a");
    let duration = lease["spec"]["leaseDurationSeconds"].as_u64().unwrap_or(15);

    let ns = "failover";
    cp.kubectl_ok(&["create", "namespace", ns]);
    apply(
        &cp,
        ns,
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: dev-key\nstringData:\n  key: dev-secret\n---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: dev\nspec:\n  type: external\n  connectionConfig:\n    mqttAddress: tcp://127.0.0.1:1883\n    domainId: d1\n    channelId: c1\n    clientId: dev\n    clientKeySecretRef: {name: dev-key, key: key}\n",
    );
    let agent_a = start_agent(&cp, "dev", mqtt_a);
    wait_phase(&cp, ns, "proplet", "dev", "Running");

    // The standby has not opened the MQTT listener: devices can only reach the leader.
    assert!(
        !standby
            .stderr_so_far()
            .iter()
            .any(|l| l.contains("mqtt listening")),
        "the standby listens for MQTT"
    );

    // SIGKILL: no graceful release of the Lease.
    let killed = Instant::now();
    let _ = leader.child.kill();
    let _ = leader.child.wait();
    drop(agent_a);
    apply(&cp, ns, &task_manifest("during-failover", "[20, 22]", ""));
    let mqtt_b = mqtt_port(&standby);
    let took_over = killed.elapsed();
    eprintln!("operator-b led {took_over:?} after operator-a was killed (lease {duration} s)");
    assert!(
        took_over <= Duration::from_secs(duration + 5),
        "the standby led after {took_over:?} (lease {duration} s)"
    );
    wait_http(metrics_b, "/readyz", 200);
    let agent_b = start_agent(&cp, "dev", mqtt_b);
    let task = wait_phase(&cp, ns, "task", "during-failover", "completed");
    assert_eq!(task["status"]["results"], "42");
    // Counted on the device's side: the start arrived once.
    let uid = task["metadata"]["uid"].as_str().expect("uid");
    let accepted = agent_b
        .stderr_so_far()
        .iter()
        .filter(|l| l.contains("task accepted") && l.contains(uid))
        .count();
    assert_eq!(accepted, 1, "the agent accepted the task {accepted} times");
    assert_eq!(
        task["status"]["runCount"], 1,
        "the task was scheduled more than once: {:#}",
        task["status"]
    );
}

/// The one Pod matching `selector`, once it exists.
fn wait_pod(cp: &ControlPlane, ns: &str, selector: &str) -> Value {
    let started = Instant::now();
    loop {
        let out = cp.kubectl_ok(&["-n", ns, "get", "pods", "-l", selector, "-o", "json"]);
        let list: Value = serde_json::from_str(&out).expect("pods JSON");
        if let Some(pod) = list["items"].as_array().and_then(|items| items.first()) {
            return pod.clone();
        }
        assert!(
            started.elapsed() < STATUS_WAIT,
            "no pod matching {selector} within {STATUS_WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Plays the kubelet: `pod`'s container exited 0 with termination `message`.
fn succeed_pod(cp: &ControlPlane, ns: &str, pod: &Value, message: &str) {
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let terminated = serde_json::json!({"terminated": {
        "exitCode": 0, "reason": "Completed", "message": message,
        "startedAt": now, "finishedAt": now,
    }});
    set_pod_status(
        cp,
        ns,
        pod,
        serde_json::json!({
            "phase": "Succeeded",
            "containerStatuses": [container_status(pod, terminated, false)],
        }),
    );
}

/// Plays the kubelet: writes `status` to the Pod's status subresource.
fn set_pod_status(cp: &ControlPlane, ns: &str, pod: &Value, status: Value) {
    let name = pod["metadata"]["name"].as_str().expect("pod name");
    let patch = serde_json::json!({ "status": status }).to_string();
    cp.kubectl_ok(&[
        "-n",
        ns,
        "patch",
        "pod",
        name,
        "--subresource=status",
        "--type=merge",
        "-p",
        &patch,
    ]);
}

/// The status of a Pod whose only container is `state` (`running` or `terminated`).
fn container_status(pod: &Value, state: Value, ready: bool) -> Value {
    let container = &pod["spec"]["containers"][0];
    serde_json::json!({
        "name": container["name"],
        "image": container["image"],
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "state": state,
    })
}

#[test]
fn a_k8s_proplet_gets_its_deployment_and_its_tasks_run_as_jobs() {
    let ns = "jobs";
    let Some((cp, _operator, _)) = operator_in(
        Options {
            controller_manager: true,
            ..Options::default()
        },
        ns,
    ) else {
        return;
    };
    cp.kubectl_ok(&["-n", ns, "apply", "-f", "configs/samples/proplet-k8s.yaml"]);
    let deployment = wait_until(
        &cp,
        ns,
        "deployment",
        "k8s-proplet-proplet",
        "created",
        |_| true,
    );
    let owner = &deployment["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "Proplet", "{owner:#}");
    assert_eq!(owner["name"], "k8s-proplet");
    assert_eq!(owner["controller"], true);

    // The kubelet's part: the Deployment's Pod runs and is Ready.
    let selector = deployment["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("deployment selector")
        .iter()
        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(",");
    let pod = wait_pod(&cp, ns, &selector);
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    set_pod_status(
        &cp,
        ns,
        &pod,
        serde_json::json!({
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
            "containerStatuses": [container_status(&pod, serde_json::json!({"running": {"startedAt": now}}), true)],
        }),
    );
    wait_phase(&cp, ns, "proplet", "k8s-proplet", "Running");

    // One task per result source, in the order the operator reads them.
    let result = "propeller.propeller.absmach.eu/result";
    for source in [
        "job-annotation",
        "termination",
        "configmap",
        "secret",
        "pod-annotation",
    ] {
        let task = format!("from-{source}");
        let job = format!("{task}-job");
        apply(
            &cp,
            ns,
            &format!(
                "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {task}\nspec:\n  name: {task}\n  imageUrl: registry.example/app/add:1.0\n  inputs: [1, 2]\n  preferredPropletType: k8s\n"
            ),
        );
        wait_until(&cp, ns, "job", &job, "created", |_| true);
        let pod = wait_pod(&cp, ns, &format!("job-name={job}"));
        let pod_name = pod["metadata"]["name"].as_str().unwrap_or_default();
        let expected = format!("result-{source}");
        let mut message = String::new();
        match source {
            "job-annotation" => {
                cp.kubectl_ok(&[
                    "-n",
                    ns,
                    "annotate",
                    "job",
                    &job,
                    &format!("{result}={expected}"),
                ]);
            }
            "termination" => message = expected.clone(),
            "configmap" => {
                cp.kubectl_ok(&[
                    "-n",
                    ns,
                    "create",
                    "configmap",
                    &format!("{job}-result"),
                    &format!("--from-literal=result={expected}"),
                ]);
            }
            "secret" => {
                cp.kubectl_ok(&[
                    "-n",
                    ns,
                    "create",
                    "secret",
                    "generic",
                    &format!("{job}-result"),
                    &format!("--from-literal=result={expected}"),
                ]);
            }
            _ => {
                cp.kubectl_ok(&[
                    "-n",
                    ns,
                    "annotate",
                    "pod",
                    pod_name,
                    &format!("{result}={expected}"),
                ]);
            }
        }
        succeed_pod(&cp, ns, &pod, &message);
        // The job controller sees the Pod succeed and completes the Job.
        wait_until(&cp, ns, "job", &job, "Complete", |j| {
            j["status"]["conditions"].as_array().is_some_and(|cs| {
                cs.iter()
                    .any(|c| c["type"] == "Complete" && c["status"] == "True")
            })
        });
        let done = wait_phase(&cp, ns, "task", &task, "completed");
        assert_eq!(done["status"]["results"], expected.as_str(), "{source}");
    }

    // Suspending a task that runs as a Job suspends its Job (the job controller removes its
    // Pod); resuming it resumes the Job, whose new Pod then finishes the task.
    apply(
        &cp,
        ns,
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: held\nspec:\n  name: held\n  imageUrl: registry.example/app/add:1.0\n  inputs: [1, 2]\n  preferredPropletType: k8s\n",
    );
    wait_until(&cp, ns, "job", "held-job", "created", |_| true);
    let first = wait_pod(&cp, ns, "job-name=held-job");
    let suspend = |value: bool| {
        cp.kubectl_ok(&[
            "-n",
            ns,
            "patch",
            "task",
            "held",
            "--type=merge",
            "-p",
            &format!("{{\"spec\":{{\"suspend\":{value}}}}}"),
        ]);
    };
    suspend(true);
    wait_until(&cp, ns, "job", "held-job", "suspended", |j| {
        j["spec"]["suspend"] == true
    });
    wait_gone(
        &cp,
        ns,
        "pod",
        first["metadata"]["name"].as_str().unwrap_or_default(),
    );
    let held = wait_phase(&cp, ns, "task", "held", "pending");
    assert!(
        held["status"]["conditions"].as_array().is_some_and(|cs| cs
            .iter()
            .any(|c| c["type"] == "Suspended" && c["status"] == "True")),
        "{:#}",
        held["status"]
    );
    suspend(false);
    wait_until(&cp, ns, "job", "held-job", "resumed", |j| {
        j["spec"]["suspend"] != true
    });
    let pod = wait_pod(&cp, ns, "job-name=held-job");
    succeed_pod(&cp, ns, &pod, "result-resumed");
    let done = wait_phase(&cp, ns, "task", "held", "completed");
    assert_eq!(done["status"]["results"], "result-resumed");

    // Deleting releases the finalizer and the garbage collector removes what the Task and
    // the Proplet owned.
    cp.kubectl_ok(&["-n", ns, "delete", "task", "from-secret", "--wait=false"]);
    wait_gone(&cp, ns, "task", "from-secret");
    wait_gone(&cp, ns, "job", "from-secret-job");
    cp.kubectl_ok(&["-n", ns, "delete", "proplet", "k8s-proplet", "--wait=false"]);
    wait_gone(&cp, ns, "proplet", "k8s-proplet");
    wait_gone(&cp, ns, "deployment", "k8s-proplet-proplet");
}

/// One row of `tests/fixtures/admission-cases.yaml`.
#[derive(serde::Deserialize)]
struct AdmissionCase {
    name: String,
    expect: String,
    #[serde(default)]
    message: Option<String>,
    object: Value,
}

#[test]
fn the_api_server_and_client_side_admission_judge_every_case_alike() {
    let Some((cp, _)) = cluster(Options::default()) else {
        return;
    };
    let path = repo_root().join("tests/fixtures/admission-cases.yaml");
    let text = std::fs::read_to_string(&path).expect("read the admission cases");
    let cases: Vec<AdmissionCase> = serde_yaml_ng::from_str(&text).expect("parse the cases");
    assert!(cases.len() >= 30, "only {} cases", cases.len());
    let admission = propeller_operator::validation::Admission::new();
    let mut wrong = Vec::new();
    for case in &cases {
        let out = cp.kubectl_stdin(
            &["create", "--dry-run=server", "-o", "name", "-f", "-"],
            &case.object.to_string(),
        );
        let server = if out.status.success() {
            Ok(())
        } else {
            Err(shorten(&String::from_utf8_lossy(&out.stderr)))
        };
        let client = admission
            .admit(&case.object, None)
            .map(|_| ())
            .map_err(|e| e.to_string());
        match (case.expect.as_str(), &server) {
            ("accepted", Err(e)) => wrong.push(format!("{}: the server refused: {e}", case.name)),
            ("refused", Ok(())) => wrong.push(format!("{}: the server accepted", case.name)),
            ("refused", Err(e)) => {
                let message = case.message.as_deref().unwrap_or_default();
                if !e.contains(message) {
                    wrong.push(format!(
                        "{}: the server said {e:?}, not {message:?}",
                        case.name
                    ));
                }
            }
            _ => {}
        }
        if server.is_ok() != client.is_ok() {
            wrong.push(format!(
                "{}: server {:?} but client-side admission {:?}",
                case.name, server, client
            ));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The shell blocks of the book's Kubernetes page (`docs/src/kubernetes.md`) between the
/// `k8s-steps` markers, in order.
fn readme_steps() -> String {
    support::doc_blocks("k8s-steps").concat()
}

#[test]
fn the_readme_kubernetes_steps_run_as_written() {
    let Some((cp, _)) = cluster(Options::default()) else {
        return;
    };
    let steps = readme_steps();
    assert!(steps.contains("propeller run"), "{steps}");
    // A scratch directory that looks like the repository root, so the steps' files
    // (propeller.kubeconfig, the agent's state) land there and not in the checkout.
    let work = cp.scratch().join("readme");
    std::fs::create_dir_all(&work).expect("scratch dir");
    for entry in ["configs", "target"] {
        std::os::unix::fs::symlink(repo_root().join(entry), work.join(entry)).expect("symlink");
    }
    let mut cmd = std::process::Command::new("timeout");
    cmd.args(["120", "bash", "-euo", "pipefail", "-c"])
        .arg(format!("{steps}\nkill $(jobs -p)\n"))
        .current_dir(&work)
        .env("KUBECONFIG", &cp.admin_kubeconfig)
        .env("TMPDIR", &work)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(work.join("steps.out")).expect("output file"))
        .stderr(std::fs::File::create(work.join("steps.err")).expect("output file"));
    // Its own process group, so whatever the steps start in the background is stopped
    // with it even when a step fails.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    support::pdeathsig(&mut cmd);
    let mut child = cmd.spawn().expect("run bash");
    let group = child.id();
    let status = child.wait().expect("steps exit status");
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .status();
    let stdout = std::fs::read_to_string(work.join("steps.out")).unwrap_or_default();
    let stderr = std::fs::read_to_string(work.join("steps.err")).unwrap_or_default();
    assert!(
        status.success(),
        "the book's Kubernetes steps failed ({status}):\n{stdout}\n{}",
        shorten_tail(&stderr)
    );
    assert_eq!(stdout.lines().last(), Some("42"), "{stdout}");
}

/// A module whose `boom` export traps, base64.
fn trap_module() -> String {
    use base64::Engine;
    let wasm = wat::parse_str(r#"(module (func (export "boom") (result i32) unreachable))"#)
        .expect("valid WAT");
    base64::engine::general_purpose::STANDARD.encode(wasm)
}

#[test]
fn recurring_tasks_run_at_their_tick_and_waits_and_failures_are_recorded_as_events() {
    use chrono::Timelike;
    let ns = "events";
    let Some((cp, _operator, mqtt)) = operator_in(Options::default(), ns) else {
        return;
    };
    // Before any proplet exists: the task waits, and says why once.
    apply(&cp, ns, &task_manifest("early", "[1, 2]", ""));
    wait_until(&cp, ns, "task", "early", "waiting for candidates", |t| {
        t["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Scheduled" && c["reason"] == "NoCandidates")
        })
    });
    let _agent = device(&cp, ns, "worker", mqtt);
    wait_phase(&cp, ns, "proplet", "worker", "Running");
    apply(
        &cp,
        ns,
        &task_manifest(
            "tick",
            "[20, 22]",
            "  schedule: \"* * * * *\"\n  isRecurring: true\n",
        ),
    );
    let boom = trap_module();
    apply(
        &cp,
        ns,
        &format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: boom\nspec:\n  name: boom\n  functionName: boom\n  file: {boom}\n"
        ),
    );
    apply(
        &cp,
        ns,
        &task_manifest(
            "after-boom",
            "[1, 1]",
            "  workflowId: wf\n  dependsOn: [boom]\n",
        ),
    );
    wait_phase(&cp, ns, "task", "early", "completed");
    let failed = wait_phase(&cp, ns, "task", "boom", "failed");
    assert!(
        failed["status"]["error"]
            .as_str()
            .is_some_and(|e| !e.is_empty()),
        "{:#}",
        failed["status"]
    );
    wait_phase(&cp, ns, "task", "after-boom", "skipped");

    let waiting = get(&cp, ns, "task", "tick").expect("tick");
    let first_tick: chrono::DateTime<chrono::Utc> = waiting["status"]["nextRun"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("nextRun while waiting: {:#}", waiting["status"]));
    assert_eq!(first_tick.second(), 0, "ticks are on the minute");
    let started = Instant::now();
    let status = loop {
        let task = get(&cp, ns, "task", "tick").expect("tick");
        if task["status"]["runCount"].as_i64() == Some(1) && task["status"]["phase"] == "completed"
        {
            break task["status"].clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(75),
            "no run at the tick: {:#}",
            task["status"]
        );
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(status["results"], "42");
    let ran: chrono::DateTime<chrono::Utc> = status["startedAt"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .expect("startedAt");
    assert!(
        ran >= first_tick && ran < first_tick + chrono::Duration::seconds(3),
        "started {ran}, tick {first_tick}"
    );

    // One Event per waiting or failed state, as `kubectl describe` shows them.
    for (task, reason) in [
        ("early", "NoCandidates"),
        ("tick", "WaitingForSchedule"),
        ("boom", "Failed"),
        ("after-boom", "Skipped"),
    ] {
        let reasons = event_reasons(&cp, ns, task);
        assert_eq!(
            reasons.iter().filter(|r| *r == reason).count(),
            1,
            "{task}: {reasons:?}"
        );
    }
    let described = cp.kubectl_ok(&["-n", ns, "describe", "task", "boom"]);
    assert!(described.contains("Failed"), "{described}");
}

#[test]
fn a_federated_job_of_two_rounds_stores_the_fedavg_model_in_a_configmap() {
    use base64::Engine;
    let ns = "fl";
    let Some((cp, _operator, mqtt)) = operator_in(Options::default(), ns) else {
        return;
    };
    let (http, stop) = support::serve_file(support::fl_module());
    let _a = device(&cp, ns, "a", mqtt);
    let _b = device(&cp, ns, "bb", mqtt);
    wait_phase(&cp, ns, "proplet", "a", "Running");
    wait_phase(&cp, ns, "proplet", "bb", "Running");
    apply(&cp, ns, &support::federated_job_manifest(&http));
    let job = wait_phase_explained(
        &cp,
        ns,
        "federatedjob",
        "fl",
        "Completed",
        &["trainingrounds", "tasks", "proplets"],
        &[
            ("operator", &_operator),
            ("agent a", &_a),
            ("agent bb", &_b),
        ],
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(job["status"]["completedRounds"], 2, "{:#}", job["status"]);
    let model_ref = job["status"]["aggregatedModelRef"]
        .as_str()
        .expect("model ref");
    let cm = get(&cp, ns, "configmap", model_ref).expect("the model ConfigMap");
    let b64 = base64::engine::general_purpose::STANDARD;
    let stored = b64
        .decode(
            cm["binaryData"]["model.json"]
                .as_str()
                .expect("model bytes"),
        )
        .expect("base64");
    let model: Value = serde_json::from_slice(&stored).expect("model json");
    assert_eq!(model["num_samples"], 4);
    let vector = b64
        .decode(model["update_b64"].as_str().expect("update"))
        .expect("base64");
    let vector: Vec<f64> = serde_json::from_slice(&vector).expect("vector");
    assert_eq!(vector, vec![2.5, 5.0]);
    // Owned by its round, which the FederatedJob owns: deleting the job removes both.
    let owner = &cm["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "TrainingRound", "{owner:#}");
}

#[test]
fn oci_images_from_a_private_registry_run_through_the_operator() {
    use support::registry::{add_module, pull_secret_manifest, Layout, Registry};
    let Some(registry) = Registry::start(Some(("ci", "s3cret"))) else {
        return;
    };
    let add = add_module(0);
    let digest = registry.push("wasm/add:1.0", &add, Layout::WasmArtifact);
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let cache = cp.scratch().join("images");
    let cache = cache.to_str().expect("utf-8 path");
    let (_operator, mqtt, _) = start_operator_with(
        &kubeconfig,
        "operator-a",
        &[
            "--registry-plain-http",
            &registry.host,
            "--image-cache-dir",
            cache,
        ],
    );
    let ns = "oci";
    cp.kubectl_ok(&["create", "namespace", ns]);
    let _a = device(&cp, ns, "edge-a", mqtt);
    let _b = device(&cp, ns, "edge-b", mqtt);
    wait_phase(&cp, ns, "proplet", "edge-a", "Running");
    wait_phase(&cp, ns, "proplet", "edge-b", "Running");
    // The real API server checks that a dockerconfigjson Secret holds a Docker config.
    apply(
        &cp,
        ns,
        &pull_secret_manifest("registry-login", &registry.host, "ci", "s3cret"),
    );
    let image = format!("{}/wasm/add:1.0", registry.host);
    let task = |name: &str, inputs: &str, extra: &str| {
        format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: add\n  imageUrl: {image}\n  inputs: {inputs}\n{extra}"
        )
    };
    let login = "  imagePullSecrets:\n  - name: registry-login\n";
    apply(
        &cp,
        ns,
        &[
            task("private", "[40, 2]", login),
            task(
                "everywhere",
                "[1, 2]",
                &format!("{login}  broadcast: true\n"),
            ),
            task("no-login", "[1, 1]", ""),
        ]
        .join("---\n"),
    );
    let private = wait_phase(&cp, ns, "task", "private", "completed");
    assert_eq!(
        private["status"]["results"], "42",
        "{:#}",
        private["status"]
    );
    assert_eq!(private["status"]["imageDigest"], digest.as_str());
    let everywhere = wait_phase(&cp, ns, "task", "everywhere", "completed");
    let results = everywhere["status"]["results"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert_eq!(results.len(), 2, "{:#}", everywhere["status"]);
    assert!(results.values().all(|r| r["results"] == "3"), "{results:?}");
    let refused = wait_phase(&cp, ns, "task", "no-login", "failed");
    let error = refused["status"]["error"].as_str().unwrap_or_default();
    assert!(error.contains("registry refused access"), "{error}");
    assert!(event_reasons(&cp, ns, "no-login")
        .iter()
        .any(|r| r == "ImageUnavailable"));
}

/// Value sets that exercise every branch of the chart's templates.
const CHART_VALUES: [(&str, &str); 5] = [
    ("defaults", ""),
    (
        "tls-namespaced",
        r#"watchNamespace: edge
domainId: factory
channelId: line-1
scheduler: priority
lastSeenThreshold: 45s
livelinessInterval: 15s
statusFlushInterval: 2s
taskTimeout: 30m
logFormat: text
tls: {enabled: true, secretName: propeller-tls, clientCA: true, disablePlain: true}
credentialsSecret: propeller-clients
extraArgs: ["--lease-name=custom"]
extraEnv: [{name: RUST_LOG, value: debug}]
service: {type: LoadBalancer, annotations: {example.com/lb: internal}}
serviceAccount: {annotations: {example.com/role: propeller}}
imagePullSecrets: [{name: regcred}]
podAnnotations: {prometheus.io/scrape: "true"}
nodeSelector: {kubernetes.io/os: linux}
tolerations: [{key: edge, operator: Exists, effect: NoSchedule}]
image: {tag: ""}
fullnameOverride: prop
images: {cacheSize: 400MiB, volumeSize: 512Mi, registryLoginSecret: registry-login}
"#,
    ),
    (
        "no-rbac-no-leader",
        "rbac: {create: false}\nserviceAccount: {create: false, name: existing}\nleaderElect: false\nresources: {}\n",
    ),
    ("cluster-wide-images", "images: {registryLoginSecret: registry-login}\n"),
    (
        "sharded",
        "replicas: 3\nbroker: {external: {addresses: [mqtt://nats-0.nats:1883, mqtt://nats-1.nats:1883], deviceAuth: none}}\nsharding: {leaseDuration: 10s}\nkueue: {enabled: true}\n",
    ),
];

/// Value sets the chart must refuse, with a word of the message.
const BAD_CHART_VALUES: [(&str, &str, &str); 4] = [
    (
        "unknown scheduler",
        "scheduler: random\n",
        "scheduler must be",
    ),
    (
        "tls without secret",
        "tls: {enabled: true}\n",
        "tls.enabled needs",
    ),
    (
        "no listener",
        "tls: {disablePlain: true}\n",
        "disablePlain needs",
    ),
    ("bad log format", "logFormat: xml\n", "logFormat must be"),
];

/// Checks the API server cannot make: Services reach a container port, bindings name the
/// pods' ServiceAccount and existing roles.
fn check_rendered_chart(name: &str, rendered: &str) {
    use serde::Deserialize;
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(rendered)
        .filter_map(|d| Value::deserialize(d).ok())
        .filter(|d| d.is_object())
        .collect();
    let of = |kind: &str| -> Vec<&Value> { docs.iter().filter(|d| d["kind"] == kind).collect() };
    let deployments = of("Deployment");
    assert_eq!(deployments.len(), 1, "{name}: one Deployment");
    let pod = &deployments[0]["spec"]["template"]["spec"];
    let ports: Vec<&str> = pod["containers"][0]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    for service in of("Service") {
        for port in service["spec"]["ports"].as_array().into_iter().flatten() {
            let target = port["targetPort"].as_str().unwrap_or_default();
            assert!(
                ports.contains(&target),
                "{name}: Service port {port} targets no container port {ports:?}"
            );
        }
    }
    // Sharded replicas (replicas > 1 on an external broker): --shard instead of leader
    // election, a PodDisruptionBudget, spread over nodes, no leader Lease.
    let args = pod["containers"][0]["args"].to_string();
    let sharded = deployments[0]["spec"]["replicas"].as_u64() > Some(1)
        && rendered.contains("PROPELLER_MQTT_BROKER");
    assert_eq!(args.contains("--shard"), sharded, "{name}: {args}");
    assert_eq!(
        of("PodDisruptionBudget").len(),
        usize::from(sharded),
        "{name}"
    );
    if sharded {
        assert!(!args.contains("--leader-elect"), "{name}: {args}");
        assert!(of("Lease").is_empty(), "{name}: a leader Lease");
        assert!(
            pod["affinity"]["podAntiAffinity"].is_object(),
            "{name}: {:#}",
            pod["affinity"]
        );
    }
    // Kueue admission (on in the sharded set): the flag and the rights on Workloads together.
    let kueue = args.contains("--kueue");
    let grants_workloads = of("ClusterRole")
        .iter()
        .any(|r| r.to_string().contains("workloads/status"));
    assert_eq!(kueue, name == "sharded", "{name}: {args}");
    assert_eq!(
        grants_workloads, kueue,
        "{name}: Workload rights without --kueue or the reverse"
    );
    let account = pod["serviceAccountName"].as_str().unwrap_or_default();
    let roles: Vec<&str> = of("ClusterRole")
        .into_iter()
        .chain(of("Role"))
        .filter_map(|r| r["metadata"]["name"].as_str())
        .collect();
    for binding in of("ClusterRoleBinding")
        .into_iter()
        .chain(of("RoleBinding"))
    {
        for subject in binding["subjects"].as_array().into_iter().flatten() {
            assert_eq!(subject["name"], account, "{name}: binding {binding}");
        }
        let role = binding["roleRef"]["name"].as_str().unwrap_or_default();
        assert!(
            roles.contains(&role),
            "{name}: binding to missing role {role}"
        );
    }
}

#[test]
fn the_helm_chart_lints_renders_and_passes_a_server_side_dry_run() {
    let Some((cp, _)) = cluster(Options::default()) else {
        return;
    };
    let Some(helm) = support::envtest::helm_binary() else {
        eprintln!("SKIPPED: helm not found (neither on PATH nor ../shared/envtest/helm.xz)");
        return;
    };
    let home = cp.scratch().join("helm-home");
    std::fs::create_dir_all(&home).expect("helm home");
    let run_helm = |args: &[&str]| {
        let mut cmd = std::process::Command::new(&helm);
        cmd.args(args)
            .current_dir(repo_root())
            .env("HOME", &home)
            .env("XDG_CACHE_HOME", home.join("cache"))
            .env("XDG_CONFIG_HOME", home.join("config"))
            .env("XDG_DATA_HOME", home.join("data"));
        cmd.output().expect("run helm")
    };
    cp.kubectl_ok(&["create", "namespace", "edge"]);
    let chart = "configs/helm/propeller";
    for (name, values) in CHART_VALUES {
        let file = cp.scratch().join(format!("values-{name}.yaml"));
        std::fs::write(&file, values).expect("values file");
        let file = file.to_str().expect("utf-8 path");
        let lint = run_helm(&["lint", "--strict", chart, "-f", file]);
        assert!(
            lint.status.success(),
            "helm lint ({name}):\n{}{}",
            String::from_utf8_lossy(&lint.stdout),
            String::from_utf8_lossy(&lint.stderr)
        );
        let out = run_helm(&[
            "template",
            "propeller",
            chart,
            "--namespace",
            "propeller-system",
            "-f",
            file,
        ]);
        assert!(
            out.status.success(),
            "helm template ({name}): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let rendered = String::from_utf8_lossy(&out.stdout).into_owned();
        check_rendered_chart(name, &rendered);
        let dry = cp.kubectl_stdin(
            &["apply", "--server-side", "--dry-run=server", "-f", "-"],
            &rendered,
        );
        assert!(
            dry.status.success(),
            "the API server refused the chart ({name}): {}",
            shorten(&String::from_utf8_lossy(&dry.stderr))
        );
        let objects = String::from_utf8_lossy(&dry.stdout).lines().count();
        eprintln!("chart values {name}: {objects} objects accepted by the API server");
    }
    for (name, values, message) in BAD_CHART_VALUES {
        let file = cp.scratch().join("bad-values.yaml");
        std::fs::write(&file, values).expect("values file");
        let out = run_helm(&[
            "template",
            "propeller",
            chart,
            "-f",
            file.to_str().expect("path"),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(message),
            "{name}: {err}"
        );
    }
    let crds = cp
        .kubectl()
        .args([
            "apply",
            "--server-side",
            "--dry-run=server",
            "-f",
            "configs/helm/propeller/crds",
        ])
        .current_dir(repo_root())
        .output()
        .expect("kubectl");
    assert!(
        crds.status.success(),
        "{}",
        String::from_utf8_lossy(&crds.stderr)
    );
}

/// `propeller run` (as the ServiceAccount, leading) on a 3-node NATS cluster instead of the
/// embedded broker: `--device-auth rendered` keeps the servers' authorization current from
/// the Proplets and their Secrets, agents on different nodes log in with their Proplets'
/// keys, and the quick start's task completes. `/readyz` follows the broker session and
/// `/metrics` shows it; `propeller broker-config` prints the same users from the cluster.
#[test]
fn the_operator_runs_devices_through_an_external_nats_cluster() {
    use support::cluster_cases::DEVICES;
    use support::external::{device_agent, device_manifest, PROPELLER_USER};
    let ns = "ext";
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let password = "operator-password-0123456789";
    let initial = format!(
        "authorization {{\n  users: [\n    {{ user: \"{PROPELLER_USER}\", password: \"{password}\" }}\n  ]\n}}\n"
    );
    let Some(nats) = support::mqtt_cluster::NatsCluster::start(&initial, PROPELLER_USER, password)
    else {
        return;
    };
    let nodes: Vec<String> = nats
        .mqtt_addrs()
        .iter()
        .map(|a| format!("mqtt://{a}"))
        .collect();
    let password_file = cp.scratch().join("mqtt-password");
    std::fs::write(&password_file, password).expect("write the password");
    let authorization = nats.authorization_path().display().to_string();
    let reload = nats.reload_command();
    let password_path = password_file.display().to_string();
    let brokers = nodes.join(",");
    let (operator, metrics) = spawn_operator_with(
        &kubeconfig,
        "operator-ext",
        &[
            "--mqtt-broker",
            &brokers,
            "--mqtt-username",
            PROPELLER_USER,
            "--mqtt-password-file",
            &password_path,
            "--device-auth",
            "rendered",
            "--broker-config-file",
            &authorization,
            "--broker-config-reload",
            &reload,
        ],
    );
    wait_http(metrics, "/readyz", 200);
    cp.kubectl_ok(&["create", "namespace", ns]);
    for name in DEVICES {
        apply(&cp, ns, &device_manifest(name, &brokers));
    }
    let started = Instant::now();
    let rendered = loop {
        let text = std::fs::read_to_string(nats.authorization_path()).unwrap_or_default();
        if DEVICES
            .iter()
            .all(|d| text.contains(&format!("user: \"{d}\"")))
        {
            break text;
        }
        assert!(
            started.elapsed() < STATUS_WAIT,
            "the operator did not render the devices: {text}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    nats.reload_authorization(&rendered);
    let agents: Vec<Running> = DEVICES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let order: Vec<&str> = (0..3).map(|k| nodes[(i + k) % 3].as_str()).collect();
            device_agent(
                name,
                &order.join(","),
                &cp.scratch().join(format!("{name}-state")),
            )
        })
        .collect();
    for name in DEVICES {
        wait_phase_explained(
            &cp,
            ns,
            "proplet",
            name,
            "Running",
            &["proplets"],
            &[("operator", &operator)],
        );
    }
    cp.kubectl_ok(&["-n", ns, "apply", "-f", "configs/samples/task-add.yaml"]);
    let task = wait_phase_explained(
        &cp,
        ns,
        "task",
        "wasm-add",
        "completed",
        &["tasks", "proplets"],
        &[("operator", &operator)],
    );
    assert_eq!(task["status"]["results"], "42", "{:#}", task["status"]);
    let text = http_body(metrics, "/metrics");
    assert!(
        text.contains("propeller_broker_external_connected 1"),
        "{text}"
    );
    assert!(
        text.contains("propeller_broker_external_devices_authenticated 1"),
        "{text}"
    );
    // The one-shot rendering from the API server names the same devices.
    let out = binary("propeller")
        .args(["broker-config", "--format", "nats", "-n", ns])
        .env("KUBECONFIG", &cp.admin_kubeconfig)
        .output()
        .expect("run propeller broker-config");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for name in DEVICES {
        assert!(printed.contains(&format!("user: \"{name}\"")), "{printed}");
        assert!(
            printed.contains(&format!("\"m.d1.c.{name}.control.proplet.alive\"")),
            "{printed}"
        );
    }
    drop(agents);
}

#[test]
fn a_device_enrols_with_a_token_through_the_operator_on_a_real_api_server() {
    let ns = "fleet";
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    cp.kubectl_ok(&["create", "namespace", ns]);
    let (ca, cert, key) = support::envtest::serving_certificate();
    let dir = cp.scratch().join("enrol");
    std::fs::create_dir_all(&dir).expect("scratch");
    for (name, text) in [
        ("ca.pem", &ca),
        ("server.pem", &cert),
        ("server-key.pem", &key),
    ] {
        std::fs::write(dir.join(name), text).expect("write certificate");
    }
    let tls = free_port();
    let (_operator, _mqtt, metrics) = start_operator_with(
        &kubeconfig,
        "operator-a",
        &[
            "--token-namespace",
            "propeller-system",
            "--tls-listen",
            &format!("127.0.0.1:{tls}"),
            "--tls-cert",
            &dir.join("server.pem").display().to_string(),
            "--tls-key",
            &dir.join("server-key.pem").display().to_string(),
        ],
    );

    // The token, made by a user with `propeller token create --kubernetes`.
    let created = binary("propeller")
        .args(["token", "create", "--kubernetes", "--token-namespace"])
        .args([
            "propeller-system",
            "-n",
            ns,
            "--labels",
            "site=lab",
            "--uses",
            "5",
        ])
        .env("KUBECONFIG", &cp.admin_kubeconfig)
        .output()
        .expect("propeller token create");
    assert!(
        created.status.success(),
        "{}",
        String::from_utf8_lossy(&created.stderr)
    );
    let token = String::from_utf8_lossy(&created.stdout).trim().to_owned();
    let id = &token[..6];
    let stored = get(
        &cp,
        "propeller-system",
        "secret",
        &format!("bootstrap-token-{id}"),
    )
    .expect("the token's Secret");
    let data = stored["data"].to_string();
    let secret_b64 = base64_of(&token[7..]);
    assert!(
        !data.contains(&secret_b64),
        "only a digest is stored: {data}"
    );

    // The device joins over TLS and runs.
    let state = dir.join("device");
    let mut agent = support::enrol::join_and_run(
        &tls.to_string(),
        &token,
        "kube-machine",
        &dir.join("ca.pem"),
        &state,
    );
    let said = agent.stderr_line_within("enrolled as", STATUS_WAIT);
    let name = support::enrol::enrolled_name(&said);
    let proplet = wait_phase(&cp, ns, "proplet", &name, "Running");
    assert_eq!(proplet["metadata"]["labels"]["site"], "lab", "{proplet:#}");
    assert_eq!(
        proplet["metadata"]["labels"]["propeller.absmach.eu/enrolled-with"],
        id
    );
    let reasons = event_reasons(&cp, ns, &name);
    assert!(reasons.iter().any(|r| r == "Enrolled"), "{reasons:?}");
    let token_secret = get(
        &cp,
        "propeller-system",
        "secret",
        &format!("bootstrap-token-{id}"),
    )
    .expect("the token's Secret");
    assert_eq!(
        token_secret["data"]["uses"],
        base64_of("1"),
        "{token_secret:#}"
    );

    // Ready for tasks.
    apply(
        &cp,
        ns,
        &task_manifest(
            "enrolled-add",
            "[20, 22]",
            &format!("  propletSelector:\n    propletId: {name}\n"),
        ),
    );
    let done = wait_phase(&cp, ns, "task", "enrolled-add", "completed");
    assert_eq!(done["status"]["results"], "42", "{:#}", done["status"]);
    let text = http_body(metrics, "/metrics");
    assert!(
        text.contains("propeller_enrolments_total{outcome=\"enrolled\"} 1"),
        "{text}"
    );
    agent.terminate();
}

fn base64_of(text: &str) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(text)
}

/// `propeller logs --endpoint` against `propeller run`'s log endpoint; (success, stdout,
/// stderr).
fn logs_through_endpoint(
    port: u16,
    ca: &Path,
    token: &str,
    args: &[&str],
) -> (bool, String, String) {
    let out = binary("propeller")
        .arg("logs")
        .args(args)
        .args(["--endpoint", &format!("127.0.0.1:{port}"), "--ca-cert"])
        .arg(ca)
        .args(["--token", token])
        .output()
        .expect("run propeller logs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The HTTP status curl gets from the log endpoint with `token` (none: no header).
fn endpoint_status(port: u16, ca: &Path, token: Option<&str>, path: &str) -> String {
    let mut curl = std::process::Command::new("curl");
    curl.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert"])
        .arg(ca)
        .arg(format!("https://127.0.0.1:{port}{path}"));
    if let Some(token) = token {
        curl.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    let out = curl.output().expect("run curl");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn task_logs_are_served_only_to_callers_the_api_server_allows() {
    let ns = "logs";
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let tls = cp.scratch().join("logs-tls");
    let port = free_port();
    let (operator, mqtt, _) = start_operator_with(
        &kubeconfig,
        "operator-a",
        &[
            "--logs-listen",
            &format!("127.0.0.1:{port}"),
            "--logs-tls-dir",
            &tls.display().to_string(),
        ],
    );
    operator.stderr_line_within("task log endpoint listening", Duration::from_secs(30));
    cp.kubectl_ok(&["create", "namespace", ns]);
    let _agent = device(&cp, ns, "printer", mqtt);
    wait_phase(&cp, ns, "proplet", "printer", "Running");
    let file = support::printer_module();
    apply(
        &cp,
        ns,
        &format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: chatty\nspec:\n  name: chatty\n  functionName: print\n  file: {file}\n  inputs: [5, 100]\n"
        ),
    );
    wait_phase(&cp, ns, "task", "chatty", "completed");
    // A reader allowed `get tasks/log` in the namespace, and a stranger with no role.
    apply(
        &cp,
        ns,
        "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: reader\n---\n\
apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: stranger\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata:\n  name: task-log-reader\nrules:\n- apiGroups: [propeller.propeller.absmach.eu]\n  resources: [tasks/log]\n  verbs: [get]\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata:\n  name: task-log-reader\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: Role\n  name: task-log-reader\nsubjects:\n- kind: ServiceAccount\n  name: reader\n  namespace: logs\n",
    );
    let reader = cp.kubectl_ok(&["-n", ns, "create", "token", "reader"]);
    let stranger = cp.kubectl_ok(&["-n", ns, "create", "token", "stranger"]);
    let (reader, stranger) = (reader.trim(), stranger.trim());
    support::secret(reader);
    support::secret(stranger);
    let ca = tls.join("ca.pem");
    let path = format!("/v1/logs/{ns}/chatty");
    assert_eq!(endpoint_status(port, &ca, None, &path), "401", "no token");
    assert_eq!(
        endpoint_status(port, &ca, Some("not-a-token"), &path),
        "401"
    );
    assert_eq!(endpoint_status(port, &ca, Some(stranger), &path), "403");
    let expected: Vec<String> = (0..=5).map(|i| format!("line {i}")).collect();
    let started = std::time::Instant::now();
    loop {
        let (ok, out, err) = logs_through_endpoint(port, &ca, reader, &["task/chatty", "-n", ns]);
        assert!(ok, "{err}");
        let lines: Vec<String> = out.lines().map(str::to_owned).collect();
        if lines == expected {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the reader got {lines:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let (ok, _, err) = logs_through_endpoint(port, &ca, stranger, &["task/chatty", "-n", ns]);
    assert!(!ok && err.contains("may not get tasks/log"), "{err}");
    println!("task logs through the endpoint: 401 without a valid token, 403 without the role, the lines with it");
}
