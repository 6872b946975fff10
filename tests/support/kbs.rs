//! A real Key Broker Service: Confidential Containers' trustee `kbs` with its built-in
//! attestation service and `sample` verifier (`../shared/kbs`). Its own script sets it up
//! (admin key pair and token, allow-all resource policy, local storage) and starts it once;
//! that process is stopped at once and the service started again as this test's child, on
//! the same loopback port and with TLS (a test CA's certificate for 127.0.0.1), so it is
//! stopped by pid when dropped and dies with the test.
//!
//! Admin calls go to the same service restarted on plain HTTP for the call: behind TLS this
//! build of trustee matches its admin ACL against the whole request URL (`https://host/…`),
//! while it accepts only rules anchored at `^/`, so no admin call passes over HTTPS.
//! Resources and policies are on disk and survive the restarts.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{repo_root, Running};

/// A running KBS.
pub struct Kbs {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// The same port on plain HTTP, for admin calls.
    http_url: String,
    /// The PEM CA file its certificate is signed by.
    pub ca_file: PathBuf,
    state: PathBuf,
    token: String,
    process: Option<Running>,
    _dir: tempfile::TempDir,
}

impl Kbs {
    /// Sets up and starts a KBS; `None` (after printing why) when `../shared/kbs` is missing
    /// outside CI.
    pub fn start() -> Option<Self> {
        let shared = repo_root().join("../shared/kbs");
        let script = shared.join("kbs-up.sh");
        if !script.is_file() {
            let why = format!("no Key Broker Service at {}", shared.display());
            assert!(std::env::var_os("CI").is_none(), "{why}");
            println!("SKIPPED: {why}");
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let state = dir.path().join("state");
        let out = Command::new("bash")
            .arg(&script)
            .arg("--state")
            .arg(&state)
            .arg("--port")
            .arg(super::envtest::free_port().to_string())
            .output()
            .expect("run kbs-up.sh");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "kbs-up.sh failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        let value = |name: &str| {
            stdout
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{name}=")))
                .unwrap_or_else(|| panic!("no {name} in {stdout}"))
                .to_owned()
        };
        let pid: i32 = value("KBS_PID").parse().expect("KBS_PID");
        // The script's process is not ours: stopped here, and ours takes its place.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while unsafe { libc::kill(pid, 0) } == 0 {
            assert!(Instant::now() < deadline, "kbs {pid} ignores SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
        let token = std::fs::read_to_string(value("KBS_ADMIN_TOKEN")).expect("admin token");
        let (ca, certificate, key) = super::envtest::serving_certificate();
        let ca_file = state.join("ca.pem");
        for (name, pem) in [
            ("ca.pem", &ca),
            ("tls.crt", &certificate),
            ("tls.key", &key),
        ] {
            std::fs::write(state.join(name), pem).expect("write TLS file");
        }
        let config = state.join("config.toml");
        let plain = std::fs::read_to_string(&config).expect("KBS config");
        std::fs::write(state.join("config-http.toml"), &plain).expect("write KBS config");
        assert!(plain.contains("insecure_http = true"), "{plain}");
        let tls = plain.replace(
            "insecure_http = true",
            &format!(
                "insecure_http = false\nprivate_key = \"{}\"\ncertificate = \"{}\"",
                state.join("tls.key").display(),
                state.join("tls.crt").display()
            ),
        );
        std::fs::write(&config, tls).expect("write KBS config");
        let mut kbs = Self {
            http_url: value("KBS_URL"),
            url: value("KBS_URL").replace("http://", "https://"),
            ca_file,
            state,
            token: token.trim().to_owned(),
            process: None,
            _dir: dir,
        };
        kbs.restart();
        Some(kbs)
    }

    /// Starts the service (again) on TLS as this process's child and waits until it answers.
    pub fn restart(&mut self) {
        self.serve("config.toml", &self.url.clone());
    }

    fn serve(&mut self, config: &str, url: &str) {
        self.process = None;
        let mut cmd = Command::new(self.state.join("kbs"));
        cmd.arg("--config-file")
            .arg(self.state.join(config))
            .env("RUST_LOG", "info");
        let process = Running::spawn(cmd);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.curl(&["-o", "/dev/null", &format!("{url}/kbs/v0/auth")]) == "000" {
            assert!(
                Instant::now() < deadline,
                "the KBS does not answer at {url}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.process = Some(process);
    }

    /// Stops the service (by pid).
    pub fn stop(&mut self) {
        self.process = None;
    }

    /// `curl -s -w '%{http_code}' ARGS`: the status code.
    fn curl(&self, args: &[&str]) -> String {
        let out = Command::new("curl")
            .args(["-s", "-w", "%{http_code}", "--max-time", "10", "--cacert"])
            .arg(&self.ca_file)
            .args(args)
            .output()
            .expect("run curl");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// An admin call that must answer 200, made on plain HTTP (see the module's note); the
    /// service is back on TLS after it.
    fn admin(&mut self, method: &str, path: &str, content_type: &str, body: &std::path::Path) {
        let http = self.http_url.clone();
        self.serve("config-http.toml", &http);
        let url = format!("{http}/kbs/v0/{path}");
        let bearer = format!("Authorization: Bearer {}", self.token);
        let content = format!("Content-Type: {content_type}");
        let data = format!("@{}", body.display());
        let response = self.state.join("admin-response");
        let code = self.curl(&[
            "-o",
            response.to_str().expect("utf-8 path"),
            "-X",
            method,
            "-H",
            &bearer,
            "-H",
            &content,
            "--data-binary",
            &data,
            &url,
        ]);
        assert_eq!(
            code,
            "200",
            "{method} {path}: {}",
            std::fs::read_to_string(&response).unwrap_or_default()
        );
        self.restart();
    }

    /// Puts `bytes` at resource `path` (`REPOSITORY/TYPE/TAG`).
    pub fn put(&mut self, path: &str, bytes: &[u8]) {
        let file = self.state.join("upload");
        std::fs::write(&file, bytes).expect("write resource");
        self.admin(
            "POST",
            &format!("resource/{path}"),
            "application/octet-stream",
            &file,
        );
        std::fs::remove_file(&file).expect("remove the upload");
    }

    /// Sets the resource policy (Rego).
    pub fn set_policy(&mut self, rego: &str) {
        use base64::Engine;
        let encoded = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(rego);
        let file = self.state.join("policy.json");
        std::fs::write(&file, format!(r#"{{"policy":"{encoded}"}}"#)).expect("write policy");
        self.admin("POST", "resource-policy", "application/json", &file);
    }

    /// The service's log lines so far that contain `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        self.process
            .as_ref()
            .map(|p| p.stderr_so_far().into_iter().chain(p.stdout_so_far()))
            .into_iter()
            .flatten()
            .filter(|l| l.contains(needle))
            .collect()
    }
}

/// A resource policy that gives nothing to anyone.
pub const DENY_ALL: &str = "package policy\n\ndefault allow = false\n";
