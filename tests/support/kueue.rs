//! A real Kueue v0.19.2 controller-manager (`../shared/envtest/kueue`) against a test's
//! control plane: started by its own script, stopped by pid when dropped (and killed by the
//! script's watchdog if this process dies first).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use super::envtest::ControlPlane;
use super::repo_root;

/// A running Kueue manager.
pub struct Kueue {
    script: PathBuf,
    workdir: String,
    /// Its log (JSON lines).
    pub log: PathBuf,
}

impl Kueue {
    /// Starts Kueue against `cp` (its CRDs, webhooks and manager) with the shipped
    /// configuration's `integrations` replaced by `integrations` (a YAML document holding
    /// only that key); `None` (after printing why) when `../shared/envtest/kueue` is missing
    /// outside CI.
    pub fn start(cp: &ControlPlane, integrations: &str) -> Option<Self> {
        let dir = repo_root().join("../shared/envtest/kueue");
        let script = dir.join("kueue-up.sh");
        if !script.is_file() {
            let why = format!("no Kueue at {}", dir.display());
            assert!(std::env::var_os("CI").is_none(), "{why}");
            println!("SKIPPED: {why}");
            return None;
        }
        let shipped = std::fs::read_to_string(dir.join("config.yaml")).expect("Kueue's config");
        let head = shipped
            .split_once("\nintegrations:")
            .map(|(head, _)| head)
            .expect("the shipped config has an integrations section");
        let config = cp.scratch().join("kueue-config.yaml");
        std::fs::write(&config, format!("{head}\n{integrations}")).expect("write Kueue config");
        let cache = repo_root().join("target/kueue-envtest");
        let out = Command::new("bash")
            .arg(&script)
            .arg(&cache)
            .env("KUEUE_CONFIG", &config)
            .env("KUBECONFIG", &cp.admin_kubeconfig)
            .env("KUEUE_WATCH_PID", std::process::id().to_string())
            .output()
            .expect("run kueue-up.sh");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "kueue-up.sh failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let values: BTreeMap<&str, &str> =
            stdout.lines().filter_map(|l| l.split_once('=')).collect();
        let workdir = values
            .get("KUEUE_WORKDIR")
            .unwrap_or_else(|| panic!("no KUEUE_WORKDIR in {stdout}"))
            .to_string();
        let log = PathBuf::from(values.get("KUEUE_LOG").copied().unwrap_or_default());
        Some(Self {
            script,
            workdir,
            log,
        })
    }

    /// The last `n` lines of Kueue's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Kueue {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(&self.script)
            .args(["stop", &self.workdir])
            .output();
    }
}
