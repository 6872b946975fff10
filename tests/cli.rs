//! The `propeller` binary, run as a real process.

use std::path::PathBuf;
use std::process::Command;

mod support;

fn propeller() -> Command {
    support::binary("propeller")
}

fn repo_root() -> PathBuf {
    support::repo_root()
}

#[test]
fn crd_prints_six_crds_identical_to_configs_crd() {
    let out = propeller().arg("crd").output().expect("run propeller crd");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).expect("utf-8 output");

    let mut kinds = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&stdout) {
        let v: serde_json::Value =
            serde::Deserialize::deserialize(doc).expect("valid YAML document");
        assert_eq!(v["apiVersion"], "apiextensions.k8s.io/v1");
        assert_eq!(v["kind"], "CustomResourceDefinition");
        kinds.push(
            v["spec"]["names"]["kind"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert_eq!(
        kinds,
        [
            "Proplet",
            "Task",
            "PropellerJob",
            "FederatedJob",
            "TrainingRound",
            "PropletUpgrade"
        ]
    );

    let mut on_disk = String::new();
    for plural in [
        "proplets",
        "tasks",
        "propellerjobs",
        "federatedjobs",
        "trainingrounds",
        "propletupgrades",
    ] {
        let path = repo_root()
            .join("configs/crd")
            .join(format!("{plural}.yaml"));
        on_disk.push_str(
            &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        );
    }
    assert!(
        stdout == on_disk,
        "`propeller crd` differs from configs/crd/"
    );
}

#[test]
fn crd_out_dir_writes_the_same_files() {
    let dir = std::env::temp_dir().join(format!("propeller-crd-test-{}", std::process::id()));
    let out = propeller()
        .args(["crd", "--out-dir"])
        .arg(&dir)
        .output()
        .expect("run propeller crd --out-dir");
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    for plural in [
        "proplets",
        "tasks",
        "propellerjobs",
        "federatedjobs",
        "trainingrounds",
        "propletupgrades",
    ] {
        let written =
            std::fs::read_to_string(dir.join(format!("{plural}.yaml"))).expect("written file");
        let kept = std::fs::read_to_string(
            repo_root()
                .join("configs/crd")
                .join(format!("{plural}.yaml")),
        )
        .expect("kept file");
        assert_eq!(written, kept, "{plural}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_unknown_command_fails_with_usage() {
    let out = propeller()
        .arg("frobnicate")
        .output()
        .expect("run propeller");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unrecognized subcommand 'frobnicate'"),
        "{stderr}"
    );
}

/// `propeller run` whose API server does not answer: it says which server and why, keeps
/// trying, and stops within seconds of SIGTERM or SIGINT, with and without leader election.
#[test]
fn run_without_a_reachable_api_server_says_why_and_stops_on_a_signal() {
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"https://127.0.0.1:{port}\", insecure-skip-tls-verify: true}}\ncontexts:\n- name: x\n  context: {{cluster: c, user: u, namespace: default}}\ncurrent-context: x\nusers:\n- name: u\n  user: {{token: t}}\n"
        ),
    )
    .unwrap();
    for (leader, signal) in [
        (true, "TERM"),
        (false, "TERM"),
        (true, "INT"),
        (false, "INT"),
    ] {
        let log = dir.path().join(format!("log-{leader}-{signal}"));
        let mut cmd = propeller();
        cmd.args([
            "run",
            "--mqtt-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .env("KUBECONFIG", &kubeconfig)
        .env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
        if leader {
            cmd.args(["--leader-elect", "--lease-namespace", "default"]);
        }
        stops_on(
            cmd.spawn().unwrap(),
            &format!("propeller run (leader election {leader})"),
            signal,
            std::time::Duration::from_secs(8),
        );
        let mut text = String::new();
        std::fs::File::open(&log)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert!(
            !text.contains('\u{1b}'),
            "colour codes in a log file:\n{text}"
        );
        if leader {
            assert!(
                text.contains(&format!("server=https://127.0.0.1:{port}/"))
                    && text.contains("Connection refused"),
                "the log names neither the server nor the cause:\n{text}"
            );
        }
    }
}

/// Sends `signal` to a started child and waits up to `limit` for it to exit successfully.
fn stops_on(mut child: std::process::Child, what: &str, signal: &str, limit: std::time::Duration) {
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        child.try_wait().unwrap().is_none(),
        "{what} exited before SIG{signal}"
    );
    let (status, _) = support::signal_and_wait(&mut child, what, signal, limit);
    assert!(status.success(), "{what} after SIG{signal}: {status}");
}

/// The agent, `propeller standalone` and `propeller broker` stop within seconds of SIGTERM or
/// SIGINT, the first two while the broker they dial does not answer.
#[test]
fn every_mode_stops_on_a_signal_while_its_peer_is_unreachable() {
    let dir = tempfile::tempdir().unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let credentials = dir.path().join("credentials.toml");
    std::fs::write(
        &credentials,
        "[[client]]\nid = \"svc\"\nkey = \"svc-key\"\nrole = \"service\"\n",
    )
    .unwrap();
    for signal in ["TERM", "INT"] {
        let quiet = |cmd: &mut Command| {
            cmd.stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null());
        };
        let mut agent = support::binary("proplet");
        agent
            .env("PROPLET_MQTT_ADDRESS", format!("tcp://127.0.0.1:{closed}"))
            .env("PROPLET_DOMAIN_ID", "d")
            .env("PROPLET_CHANNEL_ID", "c")
            .env("PROPLET_CLIENT_ID", "x")
            .env("PROPLET_CLIENT_KEY", "k")
            .env(
                "PROPLET_STATE_DIR",
                dir.path().join(format!("agent-{signal}")),
            );
        quiet(&mut agent);
        stops_on(
            agent.spawn().unwrap(),
            "the agent (broker unreachable)",
            signal,
            std::time::Duration::from_secs(5),
        );
        let mut standalone = propeller();
        standalone
            .args([
                "standalone",
                "--api-listen",
                "127.0.0.1:0",
                "--device-auth",
                "none",
            ])
            .arg("--data-dir")
            .arg(dir.path().join(format!("standalone-{signal}")))
            .arg("--mqtt-broker")
            .arg(format!("mqtt://127.0.0.1:{closed}"));
        quiet(&mut standalone);
        stops_on(
            standalone.spawn().unwrap(),
            "propeller standalone (external broker unreachable)",
            signal,
            std::time::Duration::from_secs(5),
        );
        let mut broker = propeller();
        broker
            .args(["broker", "--mqtt-listen", "127.0.0.1:0", "--credentials"])
            .arg(&credentials);
        quiet(&mut broker);
        stops_on(
            broker.spawn().unwrap(),
            "propeller broker",
            signal,
            std::time::Duration::from_secs(5),
        );
    }
}
