//! The operator on a real API server, as the tests drive it: a control plane with the CRDs
//! and the operator's rights, `kubectl` reads and applies as the user, waits for the statuses
//! the operator writes, and its HTTP endpoints.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::envtest::{ControlPlane, Options};
use super::{Running, ADD_WASM};

/// Upper bound on every wait for a status the operator writes.
pub const STATUS_WAIT: Duration = Duration::from_secs(60);

/// A control plane with the CRDs, the `propeller-system` namespace, the operator's
/// ServiceAccount and `configs/rbac` installed; `None` when the assets are missing.
pub fn cluster(options: Options) -> Option<(ControlPlane, PathBuf)> {
    let cp = ControlPlane::start(options)?;
    cp.install_crds();
    cp.install_operator_rbac();
    let kubeconfig = cp.service_account_kubeconfig("propeller-system", "propeller");
    Some((cp, kubeconfig))
}

/// Liveness threshold the operator runs with in the tests, seconds.
pub const LAST_SEEN_THRESHOLD_SECS: u64 = 3;

/// `propeller run` as `kubeconfig`'s user: MQTT on a free loopback port, metrics on
/// `metrics`, JSON logs, a [`LAST_SEEN_THRESHOLD_SECS`] liveness threshold, heartbeats and
/// status flushes every second. Callers add their flags and start it.
pub fn operator_command(kubeconfig: &Path, metrics: u16) -> Command {
    let mut cmd = super::binary("propeller");
    cmd.args(["run", "--mqtt-listen", "127.0.0.1:0", "--metrics-listen"])
        .arg(format!("127.0.0.1:{metrics}"))
        .args([
            "--last-seen-threshold",
            &format!("{LAST_SEEN_THRESHOLD_SECS}s"),
            "--liveliness-interval",
            "1s",
            "--status-flush-interval",
            "1s",
            "--log-format",
            "json",
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "info");
    cmd
}

/// The MQTT port from the operator's `mqtt listening` log line (JSON logs).
pub fn mqtt_port(operator: &Running) -> u16 {
    let line = operator.stderr_line_within("mqtt listening", STATUS_WAIT);
    let entry: Value = serde_json::from_str(&line).unwrap_or_default();
    entry["fields"]["addr"]
        .as_str()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"))
}

/// `kubectl apply` of `manifest` in `namespace`, as the admin (the user).
pub fn apply(cp: &ControlPlane, namespace: &str, manifest: &str) {
    let out = cp.kubectl_stdin(&["-n", namespace, "apply", "-f", "-"], manifest);
    assert!(
        out.status.success(),
        "kubectl apply: {}\n{manifest}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The object as JSON, or `None` when it does not exist.
pub fn get(cp: &ControlPlane, namespace: &str, kind: &str, name: &str) -> Option<Value> {
    let out = cp
        .kubectl()
        .args(["-n", namespace, "get", kind, name, "-o", "json"])
        .output()
        .expect("run kubectl");
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("NotFound"), "kubectl get {kind} {name}: {err}");
        return None;
    }
    Some(serde_json::from_slice(&out.stdout).expect("kubectl JSON"))
}

/// Polls `kind/name` until `done` holds for it; the object then.
pub fn wait_until(
    cp: &ControlPlane,
    namespace: &str,
    kind: &str,
    name: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
) -> Value {
    wait_until_explained(cp, namespace, kind, name, what, done, String::new)
}

/// [`wait_until`], whose failure adds what `explain` tells then.
pub fn wait_until_explained(
    cp: &ControlPlane,
    namespace: &str,
    kind: &str,
    name: &str,
    what: &str,
    done: impl Fn(&Value) -> bool,
    explain: impl Fn() -> String,
) -> Value {
    let started = Instant::now();
    loop {
        let object = get(cp, namespace, kind, name);
        if let Some(object) = &object {
            if done(object) {
                return object.clone();
            }
        }
        if started.elapsed() >= STATUS_WAIT {
            panic!(
                "{kind}/{name}: not {what} within {STATUS_WAIT:?}; last seen:\n{:#}\n{}",
                object.map(|o| o["status"].clone()).unwrap_or(Value::Null),
                explain()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn wait_phase(cp: &ControlPlane, ns: &str, kind: &str, name: &str, phase: &str) -> Value {
    wait_until(cp, ns, kind, name, phase, |o| {
        o["status"]["phase"].as_str() == Some(phase)
    })
}

/// [`wait_phase`], failing with what else it takes to see why: the `related` kinds in
/// `ns` and what the `processes` logged.
pub fn wait_phase_explained(
    cp: &ControlPlane,
    ns: &str,
    kind: &str,
    name: &str,
    phase: &str,
    related: &[&str],
    processes: &[(&str, &Running)],
) -> Value {
    let explain = || {
        let mut story = String::new();
        for kind in related {
            let out = cp
                .kubectl()
                .args(["-n", ns, "get", kind, "-o", "yaml"])
                .output();
            let text = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
            story += &format!("--- {kind}:\n{}\n", text.unwrap_or_default());
        }
        for (who, process) in processes {
            let lines = process.stderr_so_far();
            let tail = &lines[lines.len().saturating_sub(80)..];
            story += &format!("--- {who} logged:\n{}\n", tail.join("\n"));
        }
        story
    };
    wait_until_explained(
        cp,
        ns,
        kind,
        name,
        phase,
        |o| o["status"]["phase"].as_str() == Some(phase),
        explain,
    )
}

pub fn wait_gone(cp: &ControlPlane, ns: &str, kind: &str, name: &str) {
    let started = Instant::now();
    while get(cp, ns, kind, name).is_some() {
        assert!(
            started.elapsed() < STATUS_WAIT,
            "{kind}/{name} still exists after {STATUS_WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

pub fn task_manifest(name: &str, inputs: &str, extra: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: add\n  file: {ADD_WASM}\n  inputs: {inputs}\n{extra}"
    )
}

/// The HTTP status of `GET path` on a loopback port, or `None` when nothing answers.
pub fn http_status(port: u16, path: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply).ok()?;
    reply.split_whitespace().nth(1)?.parse().ok()
}

pub fn wait_http(port: u16, path: &str, status: u16) {
    let started = Instant::now();
    while http_status(port, path) != Some(status) {
        assert!(
            started.elapsed() < STATUS_WAIT,
            "{path} on {port} never answered {status}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The body of a GET on 127.0.0.1:`port`.
pub fn http_body(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .expect("request");
    let mut reply = String::new();
    stream.read_to_string(&mut reply).expect("reply");
    reply
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

/// Reasons of the Events recorded about `name` in `namespace`.
pub fn event_reasons(cp: &ControlPlane, namespace: &str, name: &str) -> Vec<String> {
    let out = cp.kubectl_ok(&[
        "-n",
        namespace,
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.name={name}"),
        "-o",
        "json",
    ]);
    let list: Value = serde_json::from_str(&out).expect("events JSON");
    list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|e| e["reason"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits until `name` in `namespace` has an Event with `reason`, for at most [`STATUS_WAIT`].
pub fn wait_event_reason(cp: &ControlPlane, namespace: &str, name: &str, reason: &str) {
    let started = Instant::now();
    while !event_reasons(cp, namespace, name)
        .iter()
        .any(|r| r == reason)
    {
        assert!(
            started.elapsed() < STATUS_WAIT,
            "no {reason} Event for {name}: {:?}",
            event_reasons(cp, namespace, name)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The API server's address (loopback).
pub fn api_addr(cp: &ControlPlane) -> std::net::SocketAddr {
    cp.url
        .trim_start_matches("https://")
        .parse()
        .expect("the API server's address")
}

/// A kubeconfig like `kubeconfig` whose server is a proxy to the API server on loopback
/// port `proxy_port` (the serving certificate names 127.0.0.1, so TLS still verifies).
pub fn through_proxy(cp: &ControlPlane, kubeconfig: &Path, proxy_port: u16) -> PathBuf {
    let text = std::fs::read_to_string(kubeconfig).expect("read kubeconfig");
    assert!(text.contains(&cp.url), "{text}");
    let path = kubeconfig.with_extension(format!("via-{proxy_port}"));
    let proxied = format!("https://127.0.0.1:{proxy_port}");
    std::fs::write(&path, text.replace(&cp.url, &proxied)).expect("write kubeconfig");
    path
}
