//! Propeller on a 3-node NATS cluster (Debian's `nats-server` 2.9 with JetStream and MQTT).
//! NATS 2.9 cannot call propeller back, so propeller renders the device policy as the
//! cluster's `authorization` block (`--device-auth rendered --broker-config-file`) and reloads
//! the servers after each change.
//!
//! One cluster serves the whole test; the cases run in order: the shared cluster cases
//! (`support/cluster_cases.rs`, among them a device enrolling through the token's rendered
//! user and getting a rotated key) and the device policy as NATS enforces it.

mod support;

use std::time::{Duration, Instant};

use support::cluster_cases::{
    a_device_enrols_and_gets_a_rotated_key, a_last_will_crosses_nodes,
    a_node_killed_under_a_running_task, probe_logins, propeller_killed_in_a_burst,
    tasks_dags_broadcasts_and_jobs, Fleet, DEVICES, PROBE,
};
use support::external::{eventually, Probe, Secrets, DOMAIN, PROPELLER_USER};
use support::mqtt_cluster::NatsCluster;

#[test]
fn nats_cluster_carries_the_fleet_with_a_rendered_device_policy() {
    let dir = tempfile::tempdir().expect("temp dir");
    let secrets = Secrets::write(dir.path());
    let propeller_only = format!(
        "authorization {{\n  users: [\n    {{ user: \"{PROPELLER_USER}\", password: \"{}\" }}\n  ]\n}}\n",
        secrets.password
    );
    let started = Instant::now();
    let Some(mut cluster) = NatsCluster::start(&propeller_only, PROPELLER_USER, &secrets.password)
    else {
        return;
    };
    println!("nats: 3 nodes up in {:?}", started.elapsed());
    let nodes: Vec<String> = cluster
        .mqtt_addrs()
        .iter()
        .map(|a| format!("mqtt://{a}"))
        .collect();
    let propeller_args = vec![
        "--device-auth".into(),
        "rendered".into(),
        "--broker-config-file".into(),
        cluster.authorization_path().display().to_string(),
        "--broker-config-reload".into(),
        cluster.reload_command(),
        "--mqtt-username".into(),
        PROPELLER_USER.into(),
        "--mqtt-password-file".into(),
        secrets.password_file.display().to_string(),
    ];
    let mut fleet = Fleet::start("nats", dir, nodes.clone(), propeller_args);
    fleet.apply_devices();
    let path = cluster.authorization_path();
    let mut rendered = String::new();
    eventually("the devices in the rendered authorization", 1, || {
        rendered = std::fs::read_to_string(&path).unwrap_or_default();
        DEVICES
            .iter()
            .chain([&PROBE])
            .all(|d| rendered.contains(&format!("user: \"{d}\"")))
    });
    // propeller has sent the reload too; this waits until every node has done one.
    cluster.reload_authorization(&rendered);
    fleet.start_three_agents();
    println!(
        "nats: 3 proplets Running {:?} after the start",
        started.elapsed()
    );

    tasks_dags_broadcasts_and_jobs(&mut fleet);
    the_rendered_policy_is_enforced(&fleet, &secrets.password);
    a_last_will_crosses_nodes(&mut fleet);
    let dead = a_node_killed_under_a_running_task(&mut fleet, |i| cluster.kill_node(i));
    propeller_killed_in_a_burst(&mut fleet);
    a_device_enrols_and_gets_a_rotated_key(&fleet, &nodes[(dead + 1) % nodes.len()]);
}

/// What NATS refuses with the rendered authorization: unknown users and wrong passwords at
/// login (CONNACK 5), wildcards and other proplets' channels at subscribe (SUBACK 128). A
/// device's publish on a topic it may not use is acknowledged and dropped by NATS, so it is
/// shown by a subscriber that does not receive it.
fn the_rendered_policy_is_enforced(fleet: &Fleet, propeller_password: &str) {
    let probe = Probe::device(&fleet.nodes[0], PROBE);
    probe_logins(&probe, false);
    let own = |leaf: &str| format!("m/{DOMAIN}/c/{PROBE}/{leaf}");
    let key = probe.password.clone();
    let mine = probe
        .with("probe-own", PROBE, &key)
        .watch(&own("control/manager/start"), 3);
    let outcome = mine.finish();
    assert!(
        !outcome.refused(),
        "the device's own subscription: {outcome:?}"
    );
    for filter in [
        "#".to_owned(),
        format!("m/{DOMAIN}/c/bb/control/manager/start"),
        format!("m/{DOMAIN}/c/+/control/manager/start"),
    ] {
        let outcome = probe
            .with("probe-sub", PROBE, &key)
            .watch(&filter, 4)
            .finish();
        assert!(
            outcome.refused(),
            "a device subscribed to {filter}: {outcome:?}"
        );
    }
    // A start forged by the probe for bb is acknowledged and dropped: bb's subscription gets
    // the start propeller's login publishes after it, first.
    let start = format!("m/{DOMAIN}/c/bb/control/manager/start");
    let bb = Probe::device(&fleet.nodes[0], "bb").with("bb-watch", "bb", "bb-secret");
    let watch = bb.watch(&start, 8);
    std::thread::sleep(Duration::from_secs(2));
    let forged = r#"{"forged":"by the probe"}"#;
    let genuine = r#"{"sent":"by propeller"}"#;
    assert!(probe.publish(&start, forged));
    let service = probe.with("propeller-check", PROPELLER_USER, propeller_password);
    assert!(service.publish(&start, genuine));
    let outcome = watch.finish();
    assert_eq!(
        outcome.received.trim(),
        genuine,
        "the first start bb received"
    );
    println!("nats: anonymous, wrong key and unknown logins refused; '#', wildcard and other channels' subscriptions refused; a forged start dropped");
}
