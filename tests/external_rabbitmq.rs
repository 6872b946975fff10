//! Propeller on a 3-node RabbitMQ cluster (Debian's `rabbitmq-server` with `rabbitmq_mqtt`
//! and `rabbitmq_auth_backend_http`), propeller being the cluster's authentication backend.
//!
//! One cluster serves the whole test (it takes 15-25 s to form); the cases run in order:
//! the shared cluster cases (`support/cluster_cases.rs`), the device policy enforced by
//! RabbitMQ through propeller's callbacks, a device enrolling and getting a rotated key
//! through the cluster, and new logins refused while propeller is down.

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use support::cluster_cases::{
    a_device_enrols_and_gets_a_rotated_key, a_last_will_crosses_nodes,
    a_node_killed_under_a_running_task, probe_logins, propeller_killed_in_a_burst,
    tasks_dags_broadcasts_and_jobs, Fleet, PROBE,
};
use support::envtest::reserve_port;
use support::external::{
    add_task, expect_results, start_propeller, Probe, Secrets, DOMAIN, PROPELLER_USER,
};
use support::mqtt_cluster::RabbitCluster;
use support::standalone::apply_text;
use support::WAIT;

#[test]
fn rabbitmq_cluster_carries_the_fleet_with_propeller_as_its_auth_backend() {
    let dir = tempfile::tempdir().expect("temp dir");
    let secrets = Secrets::write(dir.path());
    let reserved = reserve_port();
    let auth_base = format!(
        "http://127.0.0.1:{}/rabbitmq/{}",
        reserved.port, secrets.callback
    );
    let started = Instant::now();
    let Some(mut cluster) = RabbitCluster::start(&auth_base) else {
        return;
    };
    println!("rabbitmq: 3 nodes up in {:?}", started.elapsed());
    let nodes: Vec<String> = cluster
        .mqtt_addrs()
        .iter()
        .map(|a| format!("mqtt://{a}"))
        .collect();
    let callback_port = reserved.release();
    let propeller_args = vec![
        "--auth-callback-listen".into(),
        format!("127.0.0.1:{callback_port}"),
        "--auth-callback-secret-file".into(),
        secrets.callback_file.display().to_string(),
        "--mqtt-username".into(),
        PROPELLER_USER.into(),
        "--mqtt-password-file".into(),
        secrets.password_file.display().to_string(),
    ];
    let mut fleet = Fleet::start("rabbitmq", dir, nodes.clone(), propeller_args);
    fleet.apply_devices();
    fleet.start_three_agents();
    println!(
        "rabbitmq: 3 proplets Running {:?} after the start",
        started.elapsed()
    );

    tasks_dags_broadcasts_and_jobs(&mut fleet);
    the_device_policy_is_enforced_through_the_callbacks(&fleet);
    a_last_will_crosses_nodes(&mut fleet);
    let dead = a_node_killed_under_a_running_task(&mut fleet, |i| cluster.kill_node(i));
    let live: Vec<String> = (0..3)
        .filter(|i| *i != dead)
        .map(|i| nodes[i].clone())
        .collect();
    propeller_killed_in_a_burst(&mut fleet);
    a_device_enrols_and_gets_a_rotated_key(&fleet, &live[0]);
    propeller_down_refuses_new_logins(&mut fleet, &live[0]);
    the_demo_runs_through_the_cluster(&fleet, &live, callback_port);
}

/// The README's demo (`propeller standalone --demo`) with `--mqtt-broker`: its agent and the
/// quickstart's tasks go through the cluster, propeller answering its callbacks.
fn the_demo_runs_through_the_cluster(fleet: &Fleet, live: &[String], callback_port: u16) {
    let demo_dir = fleet.dir.path().join("demo");
    std::fs::create_dir_all(&demo_dir).expect("demo dir");
    let args: Vec<String> = vec![
        "--auth-callback-listen".into(),
        format!("127.0.0.1:{callback_port}"),
        "--auth-callback-secret-file".into(),
        fleet
            .dir
            .path()
            .join("callback-secret")
            .display()
            .to_string(),
        "--mqtt-client-id".into(),
        "propeller-demo".into(),
        "--mqtt-password-file".into(),
        fleet.dir.path().join("mqtt-password").display().to_string(),
        "--demo".into(),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let started = Instant::now();
    let (demo, _api) = start_propeller(&demo_dir, &live.join(","), &args);
    let line = demo.stdout_line_within("demo finished", Duration::from_secs(60));
    assert!(line.contains("tasks 3 completed"), "{line}");
    println!(
        "rabbitmq: the demo through the cluster: {line:?} after {:?}",
        started.elapsed()
    );
}

/// Logins and topics RabbitMQ refuses because propeller's callbacks say so. The probe
/// device has a Proplet and a key but no agent its logins would displace.
fn the_device_policy_is_enforced_through_the_callbacks(fleet: &Fleet) {
    let (api, dir) = (fleet.api.clone(), fleet.dir.path().to_owned());
    let probe = Probe::device(&fleet.nodes[1], PROBE);
    probe_logins(&probe, true);
    let own = |leaf: &str| format!("m/{DOMAIN}/c/{PROBE}/{leaf}");
    let result = format!(r#"{{"task_id":"no-such-task","proplet_id":"{PROBE}","results":"1"}}"#);
    assert!(
        !probe.publish(&own("control/manager/start"), "{}"),
        "a device published a manager command"
    );
    assert!(
        !probe.publish(&format!("m/{DOMAIN}/c/bb/control/proplet/results"), &result),
        "a device published on another proplet's channel"
    );
    // Subscriptions RabbitMQ accepts but then delivers nothing to: the callback refused the
    // binding. Traffic flows on each meanwhile: the agents' heartbeats every second, and a
    // task's start on bb's channel.
    let filters = [
        "#".to_owned(),
        format!("m/{DOMAIN}/c/+/control/proplet/alive"),
        format!("m/{DOMAIN}/c/bb/control/proplet/alive"),
        format!("m/{DOMAIN}/c/bb/control/manager/start"),
    ];
    let watches: Vec<_> = filters.iter().map(|f| (f, probe.watch(f, 5))).collect();
    std::thread::sleep(Duration::from_millis(1500));
    let pinned = "  propletSelector:\n    propletId: bb\n";
    apply_text(&api, &dir, "peek.yaml", &add_task("peek", 2, 40, pinned));
    expect_results(&api, &dir, &["peek"], "42", WAIT);
    for (filter, watch) in watches {
        let outcome = watch.finish();
        assert!(
            outcome.received.is_empty(),
            "a device read {filter}: {outcome:?}"
        );
    }
    println!("rabbitmq: anonymous, wrong key, username != client id and unknown client refused; a manager publish and another channel's publish refused; '#', wildcards and another channel's reports and starts delivered nothing");
}

/// With propeller stopped, RabbitMQ cannot reach its auth backend: a new login is refused,
/// while the agents' sessions continue.
fn propeller_down_refuses_new_logins(fleet: &mut Fleet, node: &str) {
    let probe = Probe::device(node, PROBE);
    let topic = format!("m/{DOMAIN}/c/{PROBE}/control/proplet/results");
    let result = format!(r#"{{"task_id":"no-such-task","proplet_id":"{PROBE}","results":"1"}}"#);
    assert!(
        probe.publish(&topic, &result),
        "a valid login was refused while propeller runs"
    );
    let sessions: BTreeMap<&str, usize> = fleet
        .agents
        .iter_mut()
        .map(|(k, a)| (*k, a.sessions()))
        .collect();
    fleet.propeller.terminate();
    assert!(
        !probe.publish(&topic, &result),
        "a new login was accepted while propeller is down"
    );
    std::thread::sleep(Duration::from_secs(2));
    for (name, agent) in fleet.agents.iter_mut() {
        assert_eq!(
            agent.sessions(),
            sessions[name],
            "agent {name} lost its session"
        );
    }
    println!("rabbitmq: propeller stopped: a new login refused, the agents' sessions kept");
}
