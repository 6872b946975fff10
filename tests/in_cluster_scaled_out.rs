//! The scaled-out install as users deploy it, on a real single-node cluster
//! (`../shared/envtest/node`): a 3-node MQTT cluster (NATS, then RabbitMQ asking the
//! replicas' callbacks through their Service), the chart with three sharded replicas
//! installed with the book's steps ("Scaling out"), an agent pod the operator runs and a
//! device outside the cluster through a NodePort, bursts of tasks split over the replicas
//! while a replica's pod is deleted and the release is scaled to five and then two, and the
//! uninstall.
//!
//! The brokers are processes on the node's host, listening on the node's address, and the
//! pods reach them through Services without a selector whose EndpointSlices name that
//! address: the node kit can build images only from files on this machine (`support::image`),
//! and host processes are what `support::mqtt_cluster` already starts, stops by pid and
//! reads the logs of. Without the node kit, root or the broker it prints one SKIPPED line,
//! except under `CI=true`, where that is a failure.

mod support;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use support::chart::{
    assert_release_gone, node_with_images, operator_pod_ips, operator_pods, readme_steps, stage,
    NAMESPACE,
};
use support::external::{add_task, device_agent, device_manifest, AgentLog, PROPELLER_USER};
use support::knode::Node;
use support::mqtt_cluster::{NatsCluster, RabbitCluster};

/// The device outside the cluster, on its own channel.
const DEVICE: &str = "edge-1";
/// The agent the operator runs as a pod.
const POD_PROPLET: &str = "pod-proplet";
const SHARD_LEASES: &str = "propeller.absmach.eu/shard-group=propeller";

/// The MQTT cluster under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Nats,
    RabbitMq,
}

impl Engine {
    /// The namespace of its Services, and their names' prefix.
    fn name(self) -> &'static str {
        match self {
            Engine::Nats => "nats",
            Engine::RabbitMq => "rabbitmq",
        }
    }

    /// The nodes as the pods address them (the book's install steps name them).
    fn addresses(self) -> String {
        let name = self.name();
        (0..3)
            .map(|i| format!("mqtt://{name}-{i}.{name}:1883"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The book's install step for it.
    fn install_step(self) -> &'static str {
        match self {
            Engine::Nats => "scale-out-install",
            Engine::RabbitMq => "scale-out-rabbitmq-install",
        }
    }
}

/// A running cluster of either engine.
enum Cluster {
    Nats(NatsCluster),
    Rabbit(RabbitCluster),
}

impl Cluster {
    fn mqtt_addrs(&self) -> Vec<SocketAddr> {
        match self {
            Cluster::Nats(c) => c.mqtt_addrs(),
            Cluster::Rabbit(c) => c.mqtt_addrs(),
        }
    }

    /// What the cluster keeps of the replicas' sessions: on NATS their report subscriptions'
    /// JetStream consumers (devices never subscribe to `control/proplet`), on RabbitMQ their
    /// queues (`mqtt-subscription-propeller-<pod>qos1`).
    fn replica_sessions(&self) -> Vec<String> {
        match self {
            Cluster::Nats(c) => c
                .consumer_filters()
                .into_iter()
                .filter(|f| f.contains("control.proplet"))
                .collect(),
            Cluster::Rabbit(c) => c
                .queues()
                .into_iter()
                .filter(|q| q.starts_with("mqtt-subscription-propeller-"))
                .collect(),
        }
    }
}

/// Services `{engine}-0`..`{engine}-2` in namespace `{engine}` (port 1883, each to one
/// node's MQTT listener) and the NodePort Service `{engine}-devices` (to all three) for
/// devices outside.
fn broker_services(engine: Engine, nodes: &[SocketAddr]) -> String {
    let ns = engine.name();
    let mut docs = vec![format!(
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {ns}\n"
    )];
    let slice = |service: &str, index: usize, node: &SocketAddr| {
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {service}-{index}\n  namespace: {ns}\n  labels:\n    kubernetes.io/service-name: {service}\naddressType: IPv4\nports:\n- name: mqtt\n  port: {port}\n  protocol: TCP\nendpoints:\n- addresses: [\"{ip}\"]\n",
            port = node.port(),
            ip = node.ip(),
        )
    };
    let devices = format!("{ns}-devices");
    for (i, node) in nodes.iter().enumerate() {
        let service = format!("{ns}-{i}");
        docs.push(format!(
            "apiVersion: v1\nkind: Service\nmetadata:\n  name: {service}\n  namespace: {ns}\nspec:\n  ports:\n  - name: mqtt\n    port: 1883\n    protocol: TCP\n"
        ));
        docs.push(slice(&service, i, node));
        docs.push(slice(&devices, i, node));
    }
    docs.push(format!(
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: {devices}\n  namespace: {ns}\nspec:\n  type: NodePort\n  ports:\n  - name: mqtt\n    port: 1883\n    protocol: TCP\n"
    ));
    docs.join("---\n")
}

/// A Proplet of type `k8s` on a channel of its own: the operator runs its agent as a pod
/// that dials the NATS nodes by their Services.
fn pod_proplet(engine: Engine) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {POD_PROPLET}-key\n  namespace: default\nstringData:\n  key: {POD_PROPLET}-secret\n---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {POD_PROPLET}\n  namespace: default\nspec:\n  type: k8s\n  k8s:\n    image: localhost/proplet:t1\n    replicas: 1\n    logLevel: info\n  resources:\n    cpu: 100m\n    memory: 128Mi\n  connectionConfig:\n    domainId: {domain}\n    channelId: {POD_PROPLET}\n    clientId: {POD_PROPLET}\n    clientKeySecretRef: {{name: {POD_PROPLET}-key, key: key}}\n    mqttAddress: \"{addresses}\"\n",
        domain = support::external::DOMAIN,
        addresses = engine.addresses(),
    )
}

/// The phase of every Task of namespace `default` whose name starts with `prefix`.
fn phases(node: &Node, prefix: &str) -> BTreeMap<String, String> {
    node.kubectl_ok(&[
        "-n",
        "default",
        "get",
        "tasks",
        "-o",
        "jsonpath={range .items[*]}{.metadata.name} {.status.phase} {.status.results}{\"\\n\"}{end}",
    ])
    .lines()
    .filter(|l| l.starts_with(prefix))
    .map(|l| {
        let mut words = l.split_whitespace();
        let name = words.next().unwrap_or_default().to_owned();
        let rest: Vec<&str> = words.collect();
        (name, rest.join(" "))
    })
    .collect()
}

/// Applies `count` add tasks named `{prefix}-{i}` (1 + 2 each).
fn burst(node: &Node, prefix: &str, count: usize) {
    let manifests: Vec<String> = (0..count)
        .map(|i| add_task(&format!("{prefix}-{i}"), 1, 2, ""))
        .collect();
    node.apply(&manifests.join("---\n"));
}

/// Waits until every task of the burst completed with 3; panics on a failure or after `limit`.
fn wait_burst(node: &Node, prefix: &str, count: usize, limit: Duration) -> Duration {
    let began = Instant::now();
    loop {
        let now = phases(node, prefix);
        let failed: Vec<_> = now
            .iter()
            .filter(|(_, p)| p.starts_with("failed"))
            .collect();
        assert!(failed.is_empty(), "{prefix} tasks failed: {failed:?}");
        let done = now.values().filter(|p| p.as_str() == "completed 3").count();
        if done == count {
            return began.elapsed();
        }
        assert!(
            began.elapsed() < limit,
            "{done} of {count} {prefix} tasks completed within {limit:?}: {now:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The sum of the samples of `series` (name and labels as written, e.g.
/// `propeller_shard_owned{kind="Task"}`) on a pod's `/metrics`; `None` when it does not answer.
fn metric(ip: &str, series: &str) -> Option<f64> {
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .arg(format!("http://{ip}:8080/metrics"))
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.starts_with(series))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

/// The holders of the group's member Leases.
fn member_leases(node: &Node) -> Vec<String> {
    node.kubectl_ok(&[
        "-n",
        NAMESPACE,
        "get",
        "lease",
        "-l",
        SHARD_LEASES,
        "-o",
        "jsonpath={.items[*].spec.holderIdentity}",
    ])
    .split_whitespace()
    .map(str::to_owned)
    .collect()
}

/// Waits until the group has `count` member Leases, each held by a live operator pod, and
/// every pod's `/metrics` says it acts with `count` members.
fn wait_members(node: &Node, count: usize, limit: Duration) -> Duration {
    let began = Instant::now();
    loop {
        let leases = member_leases(node);
        let pods = operator_pod_ips(node);
        let settled = leases.len() == count
            && pods.len() == count
            && pods
                .values()
                .all(|ip| metric(ip, "propeller_shard_members") == Some(count as f64));
        if settled {
            return began.elapsed();
        }
        assert!(
            began.elapsed() < limit,
            "not {count} members within {limit:?}: Leases {leases:?}, pods {pods:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Tasks each replica owns, by pod (`propeller_shard_owned{kind="Task"}`), once the
/// replicas' gauges (refreshed every few seconds) add up to `total`.
fn owned_tasks(node: &Node, total: usize) -> BTreeMap<String, f64> {
    let began = Instant::now();
    loop {
        let owned: BTreeMap<String, f64> = operator_pod_ips(node)
            .into_iter()
            .map(|(pod, ip)| {
                let owned = metric(&ip, "propeller_shard_owned{kind=\"Task\"}").unwrap_or(-1.0);
                (pod, owned)
            })
            .collect();
        if owned.values().sum::<f64>() == total as f64 {
            return owned;
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "the replicas' owned Tasks do not add up to {total}: {owned:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The agent pod's log so far, and its restarts.
fn pod_agent_log(node: &Node) -> (Vec<String>, String) {
    let selector = format!("app.kubernetes.io/instance={POD_PROPLET}");
    let log = node.kubectl_ok(&["-n", "default", "logs", "-l", &selector, "--tail=-1"]);
    let restarts = node.kubectl_ok(&[
        "-n",
        "default",
        "get",
        "pods",
        "-l",
        &selector,
        "-o",
        "jsonpath={.items[*].status.containerStatuses[*].restartCount}",
    ]);
    (log.lines().map(str::to_owned).collect(), restarts)
}

/// Starts the agent a task ran with, by task id, from log lines ("task accepted task_id=...").
fn accepted(lines: &[String], runs: &mut BTreeMap<String, usize>) {
    for line in lines.iter().filter(|l| l.contains("task accepted")) {
        if let Some(id) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("task_id="))
        {
            *runs.entry(id.trim_matches('"').to_owned()).or_default() += 1;
        }
    }
}

#[test]
fn three_replicas_on_a_nats_cluster_install_scale_and_uninstall_on_a_real_node() {
    scaled_out(Engine::Nats);
}

#[test]
fn three_replicas_on_a_rabbitmq_cluster_install_scale_and_uninstall_on_a_real_node() {
    scaled_out(Engine::RabbitMq);
}

/// The book's install with the local image instead of a registry's.
fn with_local_image(step: &str) -> String {
    let local = step
        .replace(
            "image.repository=propeller",
            "image.repository=localhost/propeller",
        )
        .replace("image.tag=latest", "image.tag=t1");
    assert_ne!(local, step, "the book's step names no image to replace");
    local
}

/// The ClusterIP of the Service `propeller`, once helm has created it.
fn propeller_service_ip(node: &Node, limit: Duration) -> String {
    node.wait_for(
        &["-n", NAMESPACE, "service", "propeller"],
        "{.spec.clusterIP}",
        limit,
        |ip| ip.parse::<IpAddr>().is_ok(),
    )
}

fn scaled_out(engine: Engine) {
    let Some((work, node)) = node_with_images() else {
        return;
    };
    let read = |file: &str| {
        std::fs::read_to_string(work.path().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
    };
    let node_ip: IpAddr = node.node_ip.parse().expect("the node's address");
    let install = readme_steps(engine.install_step());
    assert!(install.contains(&engine.addresses()), "{install}");
    let install = with_local_image(&install);

    // The book's steps 1 to 3.
    stage("propeller's login", || {
        work.run(&node, &readme_steps("scale-out-login"))
    });
    let began = Instant::now();
    let cluster = match engine {
        Engine::Nats => {
            work.run(&node, &readme_steps("scale-out-render"));
            let password = read("propeller-mqtt.password").trim().to_owned();
            let nats = stage("a 3-node NATS cluster on the node's address", || {
                NatsCluster::start_on(
                    node_ip,
                    &read("authorization.conf"),
                    PROPELLER_USER,
                    &password,
                )
            });
            let Some(nats) = nats else { return };
            let cluster = Cluster::Nats(nats);
            node.apply(&broker_services(engine, &cluster.mqtt_addrs()));
            stage("helm install", || work.run_timed(&node, &install));
            cluster
        }
        Engine::RabbitMq => {
            let said = work.run(&node, &readme_steps("scale-out-callback"));
            let secret = said.lines().last().unwrap_or_default().trim().to_owned();
            assert!(secret.len() >= 16, "the callback secret: {said:?}");
            // RabbitMQ asks the Service, which exists once helm has made it; the replicas
            // are Ready once RabbitMQ accepts their login. The nodes start on this thread,
            // which they live as long as.
            std::thread::scope(|scope| {
                let installing = scope.spawn(|| work.run_timed(&node, &install));
                let service = propeller_service_ip(&node, Duration::from_secs(60));
                let auth_base = format!("http://{service}:8090/rabbitmq/{secret}");
                let rabbit = stage("a 3-node RabbitMQ cluster on the node's address", || {
                    RabbitCluster::start_on(node_ip, &auth_base)
                });
                let cluster = rabbit.map(Cluster::Rabbit);
                if let Some(cluster) = &cluster {
                    node.apply(&broker_services(engine, &cluster.mqtt_addrs()));
                }
                match installing.join() {
                    Ok(_) => cluster,
                    Err(panic) => std::panic::resume_unwind(panic),
                }
            })
            .expect("RabbitMQ")
        }
    };
    stage("three replicas Ready, a Lease each", || {
        let pods = operator_pods(&node);
        assert_eq!(pods.len(), 3, "{pods:?}");
        let settled = wait_members(&node, 3, Duration::from_secs(120));
        eprintln!(
            "three replicas Ready {:.1} s after helm install began, members settled {:.1} s later",
            (began.elapsed() - settled).as_secs_f64(),
            settled.as_secs_f64()
        );
        let mut holders = member_leases(&node);
        holders.sort();
        let mut pods = pods;
        pods.sort();
        assert_eq!(holders, pods, "one Lease per replica, held by it");
    });

    // The fleet: an agent pod and a device through the NodePort (on NATS, step 2 again).
    let node_port = node.kubectl_ok(&[
        "-n",
        engine.name(),
        "get",
        "service",
        &format!("{}-devices", engine.name()),
        "-o",
        "jsonpath={.spec.ports[0].nodePort}",
    ]);
    let device_address = format!("mqtt://{}:{node_port}", node.node_ip);
    let state = tempfile::tempdir().expect("agent state");
    let mut device = stage("an agent pod and a device outside: both Running", || {
        node.apply(&pod_proplet(engine));
        node.apply(&device_manifest(DEVICE, &device_address));
        if let Cluster::Nats(nats) = &cluster {
            work.run(&node, &readme_steps("scale-out-render"));
            let rendered = read("authorization.conf");
            assert!(
                rendered.contains(&format!("user: \"{DEVICE}\""))
                    && rendered.contains(&format!("user: \"{POD_PROPLET}\"")),
                "the devices are not in the rendered authorization:\n{rendered}"
            );
            nats.reload_authorization(&rendered);
        }
        let device = AgentLog::new(device_agent(DEVICE, &device_address, state.path()));
        for proplet in [DEVICE, POD_PROPLET] {
            node.wait_for(
                &["-n", "default", "proplet", proplet],
                "{.status.phase}",
                Duration::from_secs(180),
                |p| p == "Running",
            );
        }
        device
    });

    stage("200 tasks split over the three replicas", || {
        burst(&node, "spread", 200);
        let took = wait_burst(&node, "spread", 200, Duration::from_secs(300));
        let owned = owned_tasks(&node, 200);
        eprintln!(
            "200 tasks completed in {:.1} s; Tasks owned by replica: {owned:?}",
            took.as_secs_f64()
        );
        assert!(owned.values().all(|n| *n > 0.0), "{owned:?}");
    });

    stage("a replica's pod deleted during a burst", || {
        burst(&node, "deleted", 100);
        node.wait_for(
            &["-n", "default", "task", "deleted-5"],
            "{.status.phase}",
            Duration::from_secs(120),
            |p| p == "completed",
        );
        let pods = operator_pod_ips(&node);
        let victim = pods.keys().next().expect("a replica").clone();
        let survivors: Vec<String> = pods
            .iter()
            .filter(|(pod, _)| **pod != victim)
            .map(|(_, ip)| ip.clone())
            .collect();
        let handoffs = |ip: &str| metric(ip, "propeller_shard_handoffs_total").unwrap_or(0.0);
        let before: Vec<f64> = survivors.iter().map(|ip| handoffs(ip)).collect();
        let deleted = Instant::now();
        node.kubectl_ok(&["-n", NAMESPACE, "delete", "pod", &victim, "--wait=false"]);
        loop {
            let now: Vec<f64> = survivors.iter().map(|ip| handoffs(ip)).collect();
            if now.iter().zip(&before).all(|(n, b)| n > b) {
                break;
            }
            assert!(
                deleted.elapsed() < Duration::from_secs(60),
                "the survivors did not take {victim}'s share within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "{victim}'s share taken by both survivors {:.1} s after kubectl delete pod",
            deleted.elapsed().as_secs_f64()
        );
        wait_burst(&node, "deleted", 100, Duration::from_secs(300));
        let back = wait_members(&node, 3, Duration::from_secs(120));
        eprintln!(
            "the Deployment's new pod a member {:.1} s after the burst completed",
            back.as_secs_f64()
        );
    });

    let resize = readme_steps("scale-out-resize");
    assert!(resize.contains("--set replicas=5"), "{resize}");
    for (replicas, prefix, total) in [(5, "five", 400), (2, "two", 500)] {
        stage(
            &format!("helm upgrade to {replicas} replicas during a burst"),
            || {
                burst(&node, prefix, 100);
                let began = Instant::now();
                work.run(
                    &node,
                    &resize.replace("--set replicas=5", &format!("--set replicas={replicas}")),
                );
                let settled = wait_members(&node, replicas, Duration::from_secs(180));
                eprintln!(
                    "{replicas} members {:.1} s after helm upgrade",
                    (began.elapsed() - settled).as_secs_f64() + settled.as_secs_f64()
                );
                wait_burst(&node, prefix, 100, Duration::from_secs(300));
                let owned = owned_tasks(&node, total);
                eprintln!("Tasks owned by replica with {replicas}: {owned:?}");
                assert_eq!(owned.len(), replicas, "{owned:?}");
                assert!(owned.values().all(|n| *n > 0.0), "{owned:?}");
            },
        );
    }

    stage("every task ran once; no agent reconnected", || {
        let mut runs = device.runs();
        let (pod_log, restarts) = pod_agent_log(&node);
        accepted(&pod_log, &mut runs);
        let total: usize = runs.values().sum();
        let twice: Vec<_> = runs.iter().filter(|(_, n)| **n > 1).collect();
        eprintln!("{total} task starts on the two agents for 500 tasks");
        assert!(twice.is_empty(), "tasks run twice: {twice:?}");
        assert_eq!(total, 500, "task starts on the agents");
        assert_eq!(device.sessions(), 1, "the device reconnected");
        let pod_sessions = pod_log
            .iter()
            .filter(|l| l.contains("connected to the broker"))
            .count();
        assert_eq!(pod_sessions, 1, "the agent pod reconnected");
        assert_eq!(restarts, "0", "the agent pod restarted");
        // One per live replica: those that left ended their sessions as they stopped.
        let sessions = cluster.replica_sessions();
        assert_eq!(
            sessions.len(),
            2,
            "replicas' sessions on the cluster: {sessions:?}"
        );
    });

    stage("the book's uninstall leaves nothing of the release", || {
        work.run_timed(&node, &readme_steps("scale-out-uninstall"));
        assert_release_gone(&node, Duration::from_secs(60));
        for file in ["propeller-mqtt.password", "propeller-login.toml"] {
            assert!(!work.path().join(file).exists(), "{file} left");
        }
        // Kept, a session would hold every report for a client id no pod will use again.
        let sessions = cluster.replica_sessions();
        assert!(
            sessions.is_empty(),
            "the replicas' sessions outlived the release: {sessions:?}"
        );
    });
    drop(device);
    drop(cluster);
}
