//! Propeller deployed as users deploy it, on a real single-node cluster (kubelet,
//! containerd, kube-proxy, cluster DNS: `../shared/envtest/node`): the images built from our
//! Dockerfiles' runtime stage, the chart installed with the book's commands, an agent pod
//! the operator runs, tasks as Job pods, a device outside the cluster over TLS through a
//! NodePort, an upgrade while tasks run, and the uninstall.
//!
//! One node per run (each start takes ~15 s and kube-proxy is host-wide), so the whole
//! deployment is one test whose stages print their names and times. Without the node kit
//! or root it prints one SKIPPED line, except under `CI=true`, where that is a failure.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use support::chart::{
    assert_release_gone, node_with_images, operator_pods, readme_steps, stage, NAMESPACE,
    RESULT_WORKLOAD,
};
use support::image;
use support::knode::Node;
use support::{repo_root, Running};
/// The devices' agents, cross-built by `scripts/build-agent-cross.sh` (profile dev here).
const CROSS_TARGETS: [&str; 2] = ["aarch64-unknown-linux-gnu", "armv7-unknown-linux-gnueabihf"];

/// The host pid of the container process whose command line starts with `program`.
fn container_process(program: &str, args: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.starts_with(program) && cmdline.contains(args)).then_some(pid)
        })
}

/// What a process runs as: (uid, no_new_privs, root filesystem read-only).
fn process_confinement(pid: u32) -> (u32, bool, bool) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().next().unwrap_or_default().to_owned())
            .unwrap_or_default()
    };
    let uid: u32 = field("Uid:").parse().expect("uid");
    let no_new_privs = field("NoNewPrivs:") == "1";
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    let root_read_only = mounts
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/"))
        .is_some_and(|l| {
            l.split_whitespace()
                .nth(5)
                .is_some_and(|o| o.split(',').any(|f| f == "ro"))
        });
    (uid, no_new_privs, root_read_only)
}

fn assert_confined(what: &str, program: &str, args: &str) {
    let pid = container_process(program, args)
        .unwrap_or_else(|| panic!("no process of {what} ({program} {args}) on the host"));
    let (uid, no_new_privs, read_only) = process_confinement(pid);
    assert_eq!(uid, 65532, "{what} runs as uid {uid}");
    assert!(no_new_privs, "{what} may gain privileges (NoNewPrivs 0)");
    assert!(read_only, "{what}'s root filesystem is writable");
    eprintln!("{what}: pid {pid}, uid 65532, no_new_privs, read-only root");
}

fn task_manifest(name: &str, spec: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  name: {name}\n{spec}"
    )
}

fn job_task(name: &str, args: &[&str], extra: &str) -> String {
    let args = serde_json::to_string(args).expect("json");
    task_manifest(
        name,
        &format!(
            "  imageUrl: {RESULT_WORKLOAD}\n  cliArgs: {args}\n  preferredPropletType: k8s\n{extra}"
        ),
    )
}

fn phase_is(wanted: &'static str) -> impl Fn(&str) -> bool {
    move |phase: &str| phase == wanted
}

/// Lets the Job pods of namespace `default` write the results the operator reads.
const RESULT_WRITER_RBAC: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: result-writer
  namespace: default
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [configmaps, secrets]
  verbs: [create]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: result-writer
  namespace: default
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: result-writer
subjects:
- kind: ServiceAccount
  name: default
  namespace: default
"#;

/// The ClusterIP of the chart's Service `propeller`.
fn propeller_service_ip(node: &Node) -> String {
    node.kubectl_ok(&[
        "-n",
        NAMESPACE,
        "get",
        "service",
        "propeller",
        "-o",
        "jsonpath={.spec.clusterIP}",
    ])
}

#[test]
fn the_chart_images_and_agents_work_on_a_real_node() {
    let Some((work, node)) = node_with_images() else {
        return;
    };

    // The book's install, with the local image instead of a registry's.
    let install = readme_steps("install");
    let local = install
        .replace(
            "image.repository=propeller",
            "image.repository=localhost/propeller",
        )
        .replace("image.tag=latest", "image.tag=t1");
    assert_ne!(
        local, install,
        "the book's install names no image to replace"
    );
    let operator = stage("helm install to a Ready operator", || {
        work.run(&node, &local);
        operator_pods(&node)
            .into_iter()
            .next()
            .expect("an operator pod")
    });
    stage(
        "leader election, /metrics and MQTT through the Service",
        || {
            node.wait_for(
                &["-n", NAMESPACE, "lease", "propeller-leader"],
                "{.spec.holderIdentity}",
                Duration::from_secs(60),
                |holder| holder == operator,
            );
            let cluster_ip = propeller_service_ip(&node);
            let metrics = Command::new("curl")
                .args(["-sf", "--max-time", "10"])
                .arg(format!("http://{cluster_ip}:8080/metrics"))
                .output()
                .expect("curl");
            let text = String::from_utf8_lossy(&metrics.stdout);
            assert!(
                metrics.status.success() && text.contains("propeller_"),
                "/metrics through the Service: {text}"
            );
            // The broker answers on the Service's MQTT port: a login it does not know is refused
            // (it closes the connection; the agents' logins below are the positive proof).
            let refused = Command::new("mosquitto_pub")
                .args([
                    "-h",
                    &cluster_ip,
                    "-p",
                    "1883",
                    "-i",
                    "nobody",
                    "-u",
                    "nobody",
                ])
                .args(["-P", "wrong", "-t", "x", "-m", "x", "-q", "1"])
                .output()
                .expect("mosquitto_pub");
            let said = String::from_utf8_lossy(&refused.stderr).to_lowercase();
            assert!(
                !refused.status.success()
                    && ["not authori", "refused", "connection was lost"]
                        .iter()
                        .any(|s| said.contains(s)),
                "MQTT through the Service: {said}"
            );
            // In-cluster configuration: the pod has no kubeconfig, only its ServiceAccount.
            let env = node.kubectl_ok(&[
                "-n",
                NAMESPACE,
                "get",
                "pod",
                &operator,
                "-o",
                "jsonpath={.spec.containers[0].env[*].name} {.spec.serviceAccountName}",
            ]);
            assert!(!env.contains("KUBECONFIG"), "{env}");
            assert!(env.ends_with(" propeller"), "{env}");
        },
    );
    stage("the operator's pod is confined", || {
        assert_confined("the operator", "/usr/local/bin/propeller", "run");
    });

    // The sample k8s proplet, pointed at the local agent image.
    stage(
        "a k8s proplet: its Deployment's pod dials the broker by DNS",
        || {
            let sample =
                std::fs::read_to_string(repo_root().join("configs/samples/proplet-k8s.yaml"))
                    .expect("sample");
            let local = sample.replace("image: proplet:latest", "image: localhost/proplet:t1");
            assert_ne!(local, sample, "the sample names no agent image to replace");
            assert!(local.contains("mqttAddress: tcp://propeller.propeller-system.svc:1883"));
            node.apply(&local);
            node.wait_for(
                &["proplet", "k8s-proplet"],
                "{.status.phase}",
                Duration::from_secs(120),
                phase_is("Running"),
            );
            assert_confined("the k8s proplet's agent", "/usr/local/bin/proplet", "");
        },
    );

    stage("tasks as Job pods: five result sources", || {
        node.apply(RESULT_WRITER_RBAC);
        for source in [
            "job-annotation",
            "termination-message",
            "configmap",
            "secret",
            "pod-annotation",
        ] {
            let name = format!("from-{source}");
            let expected = format!("result-{source}");
            let began = Instant::now();
            node.apply(&job_task(&name, &[source, &expected], ""));
            node.wait_for(
                &["-n", "default", "task", &name],
                "{.status.phase}",
                Duration::from_secs(90),
                |phase| {
                    assert_ne!(phase, "failed", "task {name} failed");
                    phase == "completed"
                },
            );
            let results = node.kubectl_ok(&[
                "-n",
                "default",
                "get",
                "task",
                &name,
                "-o",
                "jsonpath={.status.results}",
            ]);
            assert_eq!(results, expected, "{source}");
            eprintln!(
                "{source}: create -> completed in {:.1} s",
                began.elapsed().as_secs_f64()
            );
        }
    });
    stage("a failing Job and one past its timeout", || {
        node.apply(&job_task("exits-3", &["none", "-", "--exit", "3"], ""));
        node.apply(&job_task(
            "too-slow",
            &["none", "-", "--sleep", "600"],
            "  timeoutSeconds: 5\n",
        ));
        for (name, says) in [("exits-3", "exited with code 3 (Error)"), ("too-slow", "")] {
            node.wait_for(
                &["-n", "default", "task", name],
                "{.status.phase}",
                Duration::from_secs(90),
                phase_is("failed"),
            );
            let error = node.kubectl_ok(&[
                "-n",
                "default",
                "get",
                "task",
                name,
                "-o",
                "jsonpath={.status.error}",
            ]);
            eprintln!("{name}: {error}");
            assert!(error.contains(says), "{name}: {error}");
            if name == "too-slow" {
                let lower = error.to_lowercase();
                assert!(
                    lower.contains("deadline") || lower.contains("time"),
                    "{name}: {error}"
                );
                // The Job's own deadline stops the workload too.
                node.wait_for(
                    &["-n", "default", "job", "too-slow-job"],
                    "{.status.conditions[?(@.type==\"Failed\")].reason}",
                    Duration::from_secs(60),
                    |reason| reason == "DeadlineExceeded",
                );
            }
        }
    });

    // A device outside the cluster, over TLS through a NodePort.
    let (ca, cert, key) = support::envtest::serving_certificate_for(&[node.node_ip.as_str()]);
    std::fs::write(work.path().join("ca.crt"), &ca).expect("ca");
    std::fs::write(work.path().join("mqtt.crt"), &cert).expect("cert");
    std::fs::write(work.path().join("mqtt.key"), &key).expect("key");
    let node_port = stage("helm upgrade: TLS on a NodePort", || {
        let output = work.run(&node, &readme_steps("devices"));
        output.lines().last().unwrap_or_default().trim().to_owned()
    });
    assert!(node_port.parse::<u16>().is_ok(), "nodePort: {node_port:?}");
    let state = tempfile::tempdir().expect("agent state");
    let device = stage(
        "a device outside the cluster: Running, then add -> 42",
        || {
            node.kubectl_ok(&[
                "apply",
                "-f",
                &repo_root()
                    .join("configs/samples/proplet-external.yaml")
                    .display()
                    .to_string(),
            ]);
            let began = Instant::now();
            let mut agent = support::binary("proplet");
            agent
                .env(
                    "PROPLET_MQTT_ADDRESS",
                    format!("mqtts://{}:{node_port}", node.node_ip),
                )
                .env("PROPLET_MQTT_TLS_CA_CERT", work.path().join("ca.crt"))
                .env("PROPLET_DOMAIN_ID", "default-domain")
                .env("PROPLET_CHANNEL_ID", "default-channel")
                .env("PROPLET_CLIENT_ID", "edge-device")
                .env("PROPLET_CLIENT_KEY", "change-me-edge-device-key")
                .env("PROPLET_STATE_DIR", state.path())
                .env("PROPLET_LOG_LEVEL", "info");
            let device = Running::spawn(agent);
            node.wait_for(
                &["proplet", "edge-device"],
                "{.status.phase}",
                Duration::from_secs(60),
                phase_is("Running"),
            );
            eprintln!(
                "edge-device Running {:.1} s after its agent started",
                began.elapsed().as_secs_f64()
            );
            let add = std::fs::read_to_string(repo_root().join("configs/samples/task-add.yaml"))
                .expect("task sample");
            let pinned = format!("{add}  propletSelector:\n    propletId: edge-device\n");
            let began = Instant::now();
            node.apply(&pinned);
            node.wait_for(
                &["task", "wasm-add"],
                "{.status.phase}",
                Duration::from_secs(60),
                phase_is("completed"),
            );
            eprintln!(
                "wasm-add: create -> completed in {:.2} s",
                began.elapsed().as_secs_f64()
            );
            let results = node.kubectl_ok(&[
                "get",
                "task",
                "wasm-add",
                "-o",
                "jsonpath={.status.results}",
            ]);
            assert_eq!(results, "42");
            device
        },
    );

    stage(
        "the agents as users flash them: aarch64 and armv7 under qemu, through the NodePort",
        || {
            let agents: Vec<PathBuf> = CROSS_TARGETS
                .iter()
                .map(|t| repo_root().join(format!("target/{t}/debug/proplet")))
                .collect();
            let missing: Vec<String> = agents
                .iter()
                .filter(|a| !a.is_file())
                .map(|a| a.display().to_string())
                .collect();
            if !missing.is_empty() {
                assert!(
                    std::env::var("PROPELLER_QEMU_AGENTS").as_deref() != Ok("required"),
                    "PROPELLER_QEMU_AGENTS=required but no agent at {missing:?} \
                 (AGENT_PROFILE=dev scripts/build-agent-cross.sh builds them)"
                );
                eprintln!(
                "skipped: no cross-built agents at {missing:?} (AGENT_PROFILE=dev scripts/build-agent-cross.sh)"
            );
                return;
            }
            let out = Command::new(repo_root().join("scripts/check-agents-qemu.sh"))
                .args(["--no-build", "--broker"])
                .arg(format!("mqtts://{}:{node_port}", node.node_ip))
                .current_dir(repo_root())
                .env("KUBECONFIG", &node.kubeconfig)
                .env("AGENT_PROFILE", "dev")
                .env("PROPLET_MQTT_TLS_CA_CERT", work.path().join("ca.crt"))
                .output()
                .expect("run scripts/check-agents-qemu.sh");
            let report = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            eprintln!("{report}");
            assert!(out.status.success(), "scripts/check-agents-qemu.sh failed");
            for target in CROSS_TARGETS {
                assert!(
                    report.contains(&format!("PASS {target}")),
                    "{target}: {report}"
                );
            }
        },
    );

    stage(
        "helm upgrade to a new image while tasks run: 0 lost, 0 doubled",
        || {
            let out = Command::new("ctr")
                .arg("-a")
                .arg(node.containerd_socket())
                .args([
                    "-n",
                    "k8s.io",
                    "images",
                    "tag",
                    "localhost/propeller:t1",
                    "localhost/propeller:t2",
                ])
                .output()
                .expect("ctr tag");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let spin = support::standalone::spin_module();
            let tasks: Vec<String> = (0..20).map(|i| format!("during-upgrade-{i}")).collect();
            let manifests: Vec<String> = tasks
            .iter()
            .map(|name| {
                task_manifest(
                    name,
                    &format!(
                        "  functionName: spin\n  file: {spin}\n  inputs: [400000000]\n  propletSelector:\n    propletId: edge-device\n"
                    ),
                )
            })
            .collect();
            let _ = (device.stdout_so_far(), device.stderr_so_far());
            node.apply(&manifests.join("---\n"));
            let uids: Vec<(String, String)> = tasks
                .iter()
                .map(|name| {
                    let uid = node.kubectl_ok(&[
                        "-n",
                        "default",
                        "get",
                        "task",
                        name,
                        "-o",
                        "jsonpath={.metadata.uid}",
                    ]);
                    (name.clone(), uid)
                })
                .collect();
            // Some tasks are running on the device when the old pod stops.
            node.wait_for(
                &["-n", "default", "task", &tasks[0]],
                "{.status.phase}",
                Duration::from_secs(60),
                |p| p == "running" || p == "completed",
            );
            let unfinished = tasks
                .iter()
                .filter(|name| {
                    node.kubectl_ok(&[
                        "-n",
                        "default",
                        "get",
                        "task",
                        name,
                        "-o",
                        "jsonpath={.status.phase}",
                    ]) != "completed"
                })
                .count();
            eprintln!("{unfinished} of 20 tasks unfinished when the upgrade began");
            assert!(
                unfinished > 0,
                "every task finished before the upgrade: make them longer"
            );
            let previous = operator_pods(&node);
            work.run(
            &node,
            "helm upgrade propeller configs/helm/propeller -n propeller-system --reuse-values --set image.tag=t2\nkubectl -n propeller-system rollout status deploy/propeller --timeout=180s",
        );
            let now = operator_pods(&node);
            let leader = now
                .iter()
                .find(|p| !previous.contains(p))
                .expect("a new operator pod")
                .clone();
            let image = node.kubectl_ok(&[
                "-n",
                NAMESPACE,
                "get",
                "pod",
                &leader,
                "-o",
                "jsonpath={.spec.containers[0].image}",
            ]);
            assert_eq!(image, "localhost/propeller:t2");
            node.wait_for(
                &["-n", NAMESPACE, "lease", "propeller-leader"],
                "{.spec.holderIdentity}",
                Duration::from_secs(60),
                |holder| holder == leader,
            );
            for name in &tasks {
                node.wait_for(
                    &["-n", "default", "task", name],
                    "{.status.phase}",
                    Duration::from_secs(180),
                    |phase| {
                        assert_ne!(phase, "failed", "{name} failed across the upgrade");
                        phase == "completed"
                    },
                );
            }
            // Each ran once on the device (the agent logs "task succeeded" with the task's uid).
            std::thread::sleep(Duration::from_secs(1));
            let lines: Vec<String> = device
                .stdout_so_far()
                .into_iter()
                .chain(device.stderr_so_far())
                .filter(|l| l.contains("task succeeded"))
                .collect();
            let mut runs: HashMap<&str, usize> = HashMap::new();
            for (name, uid) in &uids {
                runs.insert(
                    name,
                    lines.iter().filter(|l| l.contains(uid.as_str())).count(),
                );
            }
            let not_once: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
            assert!(
                not_once.is_empty(),
                "tasks not run exactly once: {not_once:?}"
            );
            eprintln!("20 tasks across the upgrade: each completed, each run once on the device");
        },
    );

    stage(
        "the book's console step: HTTPS on the Service, a user's token",
        || {
            work.run(&node, &readme_steps("console"));
            node.apply(
                "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  name: console-viewer\n  namespace: default\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRole\nmetadata:\n  name: console-viewer\nrules:\n- apiGroups: [propeller.propeller.absmach.eu]\n  resources: [proplets]\n  verbs: [get, list, watch]\n---\n\
apiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata:\n  name: console-viewer\nroleRef:\n  apiGroup: rbac.authorization.k8s.io\n  kind: ClusterRole\n  name: console-viewer\nsubjects:\n- kind: ServiceAccount\n  name: console-viewer\n  namespace: default\n",
            );
            let token = node.kubectl_ok(&["-n", "default", "create", "token", "console-viewer"]);
            let token = support::secret(token.trim());
            let cluster_ip = propeller_service_ip(&node);
            // The made certificate's CA stays in the pod: what is checked here is the chart's
            // wiring and the API server's word on the token, not the browser's trust.
            let get = |path: &str, token: Option<&str>| {
                let mut curl = Command::new("curl");
                curl.args(["-sk", "--max-time", "10", "-w", "\n%{http_code}"])
                    .arg(format!("https://{cluster_ip}:9443{path}"));
                if let Some(token) = token {
                    curl.args(["-H", &format!("Authorization: Bearer {token}")]);
                }
                let out = curl.output().expect("curl");
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            let page = get("/console/", None);
            assert!(
                page.ends_with("200") && page.contains("console.js"),
                "{page}"
            );
            let anonymous = get("/v1/objects/proplet", None);
            assert!(anonymous.ends_with("401"), "{anonymous}");
            let listed = get("/v1/objects/proplet", Some(&token));
            assert!(
                listed.ends_with("200") && listed.contains("k8s-proplet"),
                "{listed}"
            );
            let tasks = get("/v1/objects/task", Some(&token));
            assert!(
                tasks.ends_with("403") && tasks.contains("may not list tasks"),
                "{tasks}"
            );
            eprintln!("console on the Service: the page for anyone, proplets for the viewer, tasks refused (403), no token 401");
        },
    );

    stage(
        "deleting the k8s proplet removes its Deployment and pod",
        || {
            node.kubectl_ok(&[
                "delete",
                "proplet",
                "k8s-proplet",
                "--wait=true",
                "--timeout=60s",
            ]);
            for kind in ["deployment", "pods"] {
                node.wait_for(
                    &[kind, "-l", "app.kubernetes.io/instance=k8s-proplet"],
                    "{.items[*].metadata.name}",
                    Duration::from_secs(60),
                    str::is_empty,
                );
            }
        },
    );
    stage(
        "helm uninstall leaves no operator objects; the CRDs stay",
        || {
            work.run(&node, &readme_steps("uninstall"));
            assert_release_gone(&node, Duration::from_secs(60));
            let crds = node.kubectl_ok(&["get", "crd", "-o", "name"]);
            assert!(
                crds.contains("tasks.propeller.propeller.absmach.eu"),
                "{crds}"
            );
        },
    );
    drop(device);
}

#[test]
fn the_dockerfiles_runtime_stage_is_what_the_test_images_reproduce() {
    let root = repo_root();
    let operator =
        std::fs::read_to_string(root.join("configs/docker/propeller.Dockerfile")).unwrap();
    let stage = image::runtime_stage(&operator).unwrap();
    assert_eq!(stage.entrypoint, ["/usr/local/bin/propeller"]);
    assert_eq!(stage.cmd, Some(vec!["run".to_owned()]));
    assert_eq!(stage.user, "65532:65532");
    assert_eq!(stage.exposed, [1883, 8883, 8080]);
    let agent = std::fs::read_to_string(root.join("configs/docker/proplet.Dockerfile")).unwrap();
    let stage = image::runtime_stage(&agent).unwrap();
    assert_eq!(
        stage.env,
        [(
            "PROPLET_STATE_DIR".to_owned(),
            "/var/lib/proplet".to_owned()
        )]
    );
    assert!(stage
        .copies
        .contains(&("/out/state".to_owned(), "/var/lib/proplet".to_owned())));
}

#[test]
fn a_runtime_step_the_test_image_cannot_reproduce_is_refused() {
    let err = image::runtime_stage(
        "FROM rust AS builder\nRUN make\nFROM gcr.io/distroless/cc-debian12\nRUN apt-get install -y curl\n",
    )
    .unwrap_err();
    assert!(err.contains("RUN cannot be reproduced"), "{err}");
    let err = image::runtime_stage("FROM gcr.io/distroless/cc-debian12\nCOPY x /x\n").unwrap_err();
    assert!(err.contains("COPY --from=builder"), "{err}");
    let err = image::runtime_stage("FROM debian:bookworm-slim\n").unwrap_err();
    assert!(err.contains("unknown to the reader"), "{err}");
}
