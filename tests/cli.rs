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
fn crd_prints_five_crds_identical_to_configs_crd() {
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
            "TrainingRound"
        ]
    );

    let mut on_disk = String::new();
    for plural in [
        "proplets",
        "tasks",
        "propellerjobs",
        "federatedjobs",
        "trainingrounds",
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
        let mut child = cmd.spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_secs(2));
        assert!(
            child.try_wait().unwrap().is_none(),
            "propeller run (leader election {leader}) exited instead of retrying: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        let sent = std::time::Instant::now();
        Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        let deadline = sent + std::time::Duration::from_secs(8);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "propeller run (leader election {leader}) still running 8 s after SIG{signal}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(status.success(), "exit status {status}");
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
