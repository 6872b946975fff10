//! Enrolment as a user does it: `propeller standalone` with a TLS listener, and tokens made
//! with `propeller token create`.

use std::path::{Path, PathBuf};

use super::{binary, propeller_client, Running};

/// `propeller standalone` with a TLS listener, its data in `<dir>/server`.
pub struct TlsServer {
    /// The process.
    pub process: Running,
    /// Its API address.
    pub api: String,
    /// Its plain MQTT port.
    pub plain_port: String,
    /// Its TLS MQTT port.
    pub tls_port: String,
    /// The CA devices trust (made by the server in its data directory).
    pub ca: PathBuf,
    /// Its data directory.
    pub data: PathBuf,
}

impl TlsServer {
    /// Starts one on ephemeral loopback ports.
    pub fn start(dir: &Path) -> Self {
        let data = dir.join("server");
        let mut cmd = binary("propeller");
        cmd.args(["standalone", "--api-listen", "127.0.0.1:0", "--data-dir"])
            .arg(&data)
            .args(["--mqtt-listen", "127.0.0.1:0"])
            .args(["--mqtt-tls-listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info");
        let process = Running::spawn(cmd);
        let port = |line: &str| {
            line.rsplit(':')
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned()
        };
        let plain_port = port(&process.stdout_line("mqtt listening on"));
        let tls_line = process.stdout_line("mqtts listening on");
        let tls_port = tls_line
            .split_whitespace()
            .nth(3)
            .map(port)
            .expect("the TLS port");
        let api = super::api_address(&process);
        let ca = data.join("tls/ca.pem");
        assert!(ca.exists(), "{tls_line}");
        Self {
            process,
            api,
            plain_port,
            tls_port,
            ca,
            data,
        }
    }

    /// Runs a client command against it: (success, stdout, stderr).
    pub fn client(&self, args: &[&str]) -> (bool, String, String) {
        propeller_client(&self.api, &self.data, args)
    }

    /// Makes a token with `propeller token create ARGS`; returns it.
    pub fn token(&self, args: &[&str]) -> String {
        let mut all = vec!["token", "create"];
        all.extend(args);
        let (ok, out, err) = self.client(&all);
        assert!(ok, "token create: {err}");
        assert!(err.contains("only time the token is shown"), "{err}");
        let token = super::secret(out.trim());
        assert_eq!(token.len(), 23, "{out}");
        // The secret half alone must not be logged either.
        if let Some((_, half)) = token.split_once('.') {
            super::secret(half);
        }
        token
    }

    /// The `mqtts://` address devices enrol through.
    pub fn tls_url(&self) -> String {
        format!("mqtts://127.0.0.1:{}", self.tls_port)
    }
}

/// The Proplet name `proplet join` printed ("enrolled as NAME ...") in `said`.
pub fn enrolled_name(said: &str) -> String {
    said.split("enrolled as ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no \"enrolled as\" in {said:?}"))
        .to_owned()
}

/// `proplet join` over TLS as machine `machine` into `state`, then running as the agent, in
/// the background (it prints "enrolled as NAME" once enrolled).
pub fn join_and_run(port: &str, token: &str, machine: &str, ca: &Path, state: &Path) -> Running {
    let mut cmd = binary("proplet");
    cmd.args(["join", "--server"])
        .arg(format!("mqtts://127.0.0.1:{port}"))
        .args(["--token", token, "--machine-id", machine, "--tls-ca-cert"])
        .arg(ca)
        .arg("--state-dir")
        .arg(state)
        .env("RUST_LOG", "info");
    Running::spawn(cmd)
}
