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
