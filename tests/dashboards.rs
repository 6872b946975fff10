//! The Helm chart's Grafana dashboards and Prometheus alerts against a real Prometheus
//! (Debian's `prometheus`) scraping real propellers: every panel's query returns data, and
//! every alert's expression evaluates on data that exists.
//!
//! What is scraped, every second: `propeller standalone --demo` with the embedded broker and
//! its demo agent's own `/metrics`, a second `propeller standalone` whose broker is an
//! external MQTT broker (`propeller broker`) with auth callbacks, and `propeller run` leading
//! on a real kube-apiserver (its requests to the API server). Meanwhile the test does what
//! fills every panel: three devices enrol with a bootstrap token and two later fall silent
//! (Offline, with the detection delay measured), refused sockets, logins and publishes, five
//! tasks that fail and two that complete, a refused callback and a malformed report through
//! the external broker. Then each dashboard target is queried through Prometheus's HTTP API
//! with Grafana's variables substituted, and each metric named in it must have samples. The
//! alert rules are loaded by that Prometheus from the chart's very file: each must evaluate
//! without error and its metrics must have samples; TasksFailing fires and
//! PropletsOfflineInNumbers is pending after the test's failures and silences, while
//! BrokerSessionLost and LeaderMissing stay quiet until the external broker, then every
//! propeller, is stopped. `promtool check rules` passes on the file, and `helm template`
//! puts the same dashboards and rule groups in the chart's ConfigMaps and PrometheusRule.
//!
//! Without `prometheus`/`promtool` (or helm, for the chart part, or the control plane) it
//! prints SKIPPED and passes, except under `CI=true`, where it fails.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use support::envtest::{free_port, helm_binary, Options};
use support::kube::{apply, cluster, operator_command, task_manifest};
use support::mqtt_cluster::http_get;
use support::standalone::{apply_text, finished_tasks, inline_task, wait_for_phase_within};
use support::{
    binary, device_manifest, mosquitto_pub, propeller_client, repo_root, secret, start_broker,
    start_standalone_with, Running, WAIT,
};

const CHART: &str = "configs/helm/propeller";
const RULES: &str = "configs/helm/propeller/alerts/propeller-rules.yaml";
/// What the dashboards' `$__rate_interval` and `$__range` stand for: longer than the whole
/// test, so a panel shows everything the test did, as over a dashboard's time range.
const WINDOW: &str = "5m";
/// The last-seen threshold of the demo's server: its agent heartbeats every 2 s.
const LAST_SEEN: &str = "4s";

#[test]
fn every_dashboard_panel_and_alert_evaluates_on_real_data() {
    let Some(tools) = Tools::find() else {
        return;
    };
    let started = Instant::now();
    let stage = |what: &str| eprintln!("[{:>5.1}s] {what}", started.elapsed().as_secs_f64());
    let dir = tempfile::tempdir().expect("temp dir");
    let root = repo_root();

    // The rule file as promtool sees it, and the chart's copies of both files.
    let rules_path = root.join(RULES);
    let out = Command::new(&tools.promtool)
        .args(["check", "rules"])
        .arg(&rules_path)
        .output()
        .expect("run promtool");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let rules = alert_rules(&rules_path);
    assert!(out.status.success(), "promtool check rules: {said}");
    assert!(
        said.contains(&format!("SUCCESS: {} rules found", rules.len())),
        "{said}"
    );
    let dashboards = dashboards(&root.join(CHART).join("dashboards"));
    check_chart(&root, &dashboards, &rules_path);
    stage("promtool check rules passed; chart checked");

    // Ports told in advance, so Prometheus scrapes from the very start.
    let ports = distinct_ports(5);
    let (prom_port, a_api_port, c_api_port, agent_port, k_metrics_port) =
        (ports[0], ports[1], ports[2], ports[3], ports[4]);
    let callback_port = distinct_ports(1)[0];
    let a_dir = dir.path().join("a");
    let c_dir = dir.path().join("c");
    std::fs::create_dir_all(&a_dir).expect("data dir");
    std::fs::create_dir_all(&c_dir).expect("data dir");

    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
rule_files:\n- {rules}\n\
scrape_configs:\n\
- job_name: propeller\n  authorization:\n    credentials_file: {a_token}\n  static_configs:\n  - targets: ['127.0.0.1:{a_api_port}']\n\
- job_name: propeller-external\n  authorization:\n    credentials_file: {c_token}\n  static_configs:\n  - targets: ['127.0.0.1:{c_api_port}']\n\
- job_name: proplet\n  static_configs:\n  - targets: ['127.0.0.1:{agent_port}']\n\
- job_name: propeller-k8s\n  static_configs:\n  - targets: ['127.0.0.1:{k_metrics_port}']\n",
        rules = rules_path.display(),
        a_token = a_dir.join("api-token").display(),
        c_token = c_dir.join("api-token").display(),
    );
    let Some((cp, kubeconfig)) = cluster(Options::default()) else {
        return;
    };
    let prom = Prometheus::start(&tools.prometheus, dir.path(), &config, prom_port);
    stage("prometheus ready");

    // Kubernetes mode, leading: its requests to the API server are counted.
    let mut leading = operator_command(&kubeconfig, k_metrics_port);
    leading
        .args(["--leader-elect", "--lease-namespace", "propeller-system"])
        .env("HOSTNAME", "dash-leader");
    let mut leading = Running::spawn(leading);
    apply(&cp, "default", &task_manifest("waits", "[1, 2]", ""));

    // The external broker and the propeller that uses it, with auth callbacks.
    let (broker, broker_port) = start_broker(
        dir.path(),
        "[[client]]\nid = \"propeller\"\nkey = \"dash-service-key\"\nrole = \"service\"\n\
[[client]]\nid = \"tester\"\nkey = \"dash-tester-key\"\nrole = \"service\"\n",
    );
    let password = dir.path().join("mqtt-password");
    std::fs::write(&password, secret("dash-service-key")).expect("password file");
    let callback_secret = dir.path().join("callback-secret");
    let callback_key = secret("dash-callback-secret-0123456789");
    std::fs::write(&callback_secret, &callback_key).expect("callback secret");
    let c_api = format!("127.0.0.1:{c_api_port}");
    let callback_listen = format!("127.0.0.1:{callback_port}");
    let broker_url = format!("mqtt://127.0.0.1:{broker_port}");
    let (mut external, _, _) = start_standalone_with(
        &c_dir,
        &[
            "--api-listen",
            &c_api,
            "--mqtt-broker",
            &broker_url,
            "--mqtt-password-file",
            path_str(&password),
            "--device-auth",
            "callback",
            "--auth-callback-listen",
            &callback_listen,
            "--auth-callback-secret-file",
            path_str(&callback_secret),
        ],
        &[],
    );

    // The demo, its agent serving its own /metrics.
    let a_api = format!("127.0.0.1:{a_api_port}");
    let agent_port_text = agent_port.to_string();
    let (mut server, api, mqtt_port) = start_standalone_with(
        &a_dir,
        &[
            "--demo",
            "--api-listen",
            &a_api,
            "--last-seen-threshold",
            LAST_SEEN,
        ],
        &[
            ("PROPLET_METRICS_ENABLED", "true"),
            ("PROPLET_METRICS_PORT", &agent_port_text),
        ],
    );
    server.stdout_line("demo finished:");
    stage("demo finished; external propeller connected");
    for job in [
        "propeller",
        "propeller-external",
        "proplet",
        "propeller-k8s",
    ] {
        prom.wait_for(&format!("up{{job=\"{job}\"}} == 1"));
    }
    prom.wait_for(r#"propeller_leader{job="propeller-k8s"} == 1"#);
    prom.wait_for(
        r#"propeller_apiserver_requests_total{job="propeller-k8s", resource="tasks/status", verb="patch"} > 0"#,
    );
    stage("every target scraped");

    // Three devices enrol with one bootstrap token, the first alone so that the enrolment
    // counter is seen to grow.
    let (ok, out, err) = propeller_client(
        &api,
        &a_dir,
        &["token", "create", "--insecure-enrol", "--ttl", "10m"],
    );
    assert!(ok, "token create: {err}");
    let token = secret(out.trim());
    if let Some((_, half)) = token.split_once('.') {
        secret(half);
    }
    let mut devices = vec![join(&mqtt_port, &token, "dash-1", &dir.path().join("d1"))];
    let mut names = vec![enrolled(&api, &a_dir, &devices[0])];
    prom.wait_for(r#"propeller_enrolments_total{outcome="enrolled"} == 1"#);
    for n in 2..=3 {
        devices.push(join(
            &mqtt_port,
            &token,
            &format!("dash-{n}"),
            &dir.path().join(format!("d{n}")),
        ));
    }
    for device in &devices[1..] {
        names.push(enrolled(&api, &a_dir, device));
    }
    stage("three devices enrolled and Running");

    // They fall silent (stopped, their connections left open): Offline past the threshold,
    // the first alone so that the detection-delay histogram is seen to grow.
    signal(&devices[0], "STOP");
    wait_for_phase_within(&api, &a_dir, &names[0], "Offline", WAIT);
    prom.wait_for(r#"propeller_proplet_offline_delay_seconds_count{stage="status_written"} == 1"#);
    for device in &devices[1..] {
        signal(device, "STOP");
    }
    for name in &names[1..] {
        wait_for_phase_within(&api, &a_dir, name, "Offline", WAIT);
    }
    for device in &mut devices {
        let _ = device.child.kill();
        let _ = device.child.wait();
    }
    stage("three devices Offline");

    // Refusals, twice, seen by a scrape in between.
    apply_text(
        &api,
        &a_dir,
        "pi.yaml",
        &device_manifest("dash-pi", &mqtt_port),
    );
    let alive = "m/d1/c/c1/control/proplet/alive";
    for round in 1..=2 {
        // A malformed heartbeat, sent again until the device's key is known to the broker.
        let deadline = Instant::now() + WAIT;
        while !mosquitto_pub(&mqtt_port, "dash-pi", "dash-pi-secret", alive, "{not json") {
            assert!(
                Instant::now() < deadline,
                "the broker never took dash-pi's key"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        drop(std::net::TcpStream::connect(("127.0.0.1", port_of(&mqtt_port))).expect("connect"));
        assert!(
            !mosquitto_pub(&mqtt_port, "dash-pi", "wrong-key", "x", "x"),
            "a wrong key was accepted"
        );
        mosquitto_pub(
            &mqtt_port,
            "dash-pi",
            "dash-pi-secret",
            "m/d1/c/c1/control/manager/start",
            "{}",
        );
        let answer = http_get(
            callback_listen.parse().expect("callback address"),
            &format!("/rabbitmq/{callback_key}/user?username=nobody&password=x"),
        )
        .expect("callback answer");
        assert!(answer.ends_with("deny"), "{answer}");
        mosquitto_pub(
            &broker_port,
            "tester",
            "dash-tester-key",
            alive,
            "{not json",
        );
        for expr in [
            format!(
                r#"propeller_broker_refused_connections_total{{reason="closed_before_connect"}} >= {round}"#
            ),
            format!(r#"propeller_broker_auth_failures_total{{reason="wrong_key"}} >= {round}"#),
            format!(r#"propeller_broker_dropped_publishes_total{{reason="malformed"}} >= {round}"#),
            format!(
                r#"propeller_broker_dropped_publishes_total{{reason="forbidden_topic"}} >= {round}"#
            ),
            format!(r#"propeller_broker_decode_errors_total{{kind="alive"}} >= {round}"#),
            format!(r#"propeller_broker_callback_decisions_total{{result="deny"}} >= {round}"#),
            format!(
                r#"propeller_broker_external_reports_dropped_total{{reason="malformed"}} >= {round}"#
            ),
        ] {
            prom.wait_for(&expr);
        }
    }
    stage("refusals counted");

    // Five tasks that trap and two that complete, on the demo's agent (the only Running one).
    let boom = boom_module();
    let mut manifest = String::new();
    let mut task_names = Vec::new();
    for n in 1..=5 {
        let name = format!("boom-{n}");
        manifest.push_str(&format!(
            "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: boom\n  file: {boom}\n  inputs: []\n---\n"
        ));
        task_names.push(name);
    }
    for n in 1..=2 {
        let name = format!("sum-{n}");
        manifest.push_str(&inline_task(&name, "[20, 22]"));
        manifest.push_str("---\n");
        task_names.push(name);
    }
    apply_text(&api, &a_dir, "tasks.yaml", &manifest);
    let names_ref: Vec<&str> = task_names.iter().map(String::as_str).collect();
    let finished = finished_tasks(&api, &a_dir, &names_ref);
    for (name, task) in &finished {
        let expected = if name.starts_with("boom") {
            "failed"
        } else {
            "completed"
        };
        assert_eq!(
            task["status"]["phase"], expected,
            "{name}: {:#}",
            task["status"]
        );
    }
    prom.wait_for(r#"propeller_tasks{job="propeller", phase="failed"} == 5"#);
    prom.wait_for(r#"propeller_tasks{job="propeller", phase="completed"} == 5"#);
    prom.wait_for("proplet_tasks_failed_total >= 5");
    prom.wait_for(r#"propeller_tasks_finished_total{job="propeller", phase="failed"} == 5"#);
    stage("tasks finished and scraped");

    // Every panel of every dashboard.
    let mut report = Vec::new();
    for (file, dashboard) in &dashboards {
        check_dashboard_shape(file, dashboard);
        for variable in dashboard["templating"]["list"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if variable["type"] == "query" {
                let definition = variable["definition"].as_str().unwrap_or_default();
                let values = prom.label_values(definition);
                assert!(
                    !values.is_empty(),
                    "{file}: variable {} ({definition}) has no values",
                    variable["name"]
                );
                report.push(format!(
                    "{file}: ${} = {values:?}",
                    variable["name"].as_str().unwrap_or_default()
                ));
            }
        }
        for panel in panels(dashboard) {
            let title = panel["title"].as_str().unwrap_or_default();
            for target in panel["targets"].as_array().into_iter().flatten() {
                let raw = target["expr"].as_str().unwrap_or_default();
                let expr = grafana_substitute(raw);
                let result = prom
                    .query(&expr)
                    .unwrap_or_else(|e| panic!("{file} {title:?}: {expr}: {e}"));
                let values: Vec<String> = result
                    .iter()
                    .map(|s| s["value"][1].as_str().unwrap_or_default().to_owned())
                    .collect();
                assert!(
                    values.iter().any(|v| v != "NaN"),
                    "{file} {title:?}: no data (empty or NaN only) for {expr}: {values:?}"
                );
                for selector in selectors(&expr) {
                    let found = prom
                        .query(&selector)
                        .unwrap_or_else(|e| panic!("{file} {title:?}: {selector}: {e}"));
                    assert!(
                        !found.is_empty(),
                        "{file} {title:?}: no samples of {selector} (in {expr})"
                    );
                }
                report.push(format!(
                    "{file} {title:?}: {} series, e.g. {}",
                    values.len(),
                    summary(&result)
                ));
            }
        }
    }
    stage("every dashboard query returned data");

    // Every alert: its expression evaluates, the metrics it reads have samples, and
    // Prometheus evaluated the rule file it loaded without error.
    for rule in &rules {
        let expr = rule["expr"].as_str().expect("expr");
        let name = rule["alert"].as_str().expect("alert name");
        let result = prom
            .query(expr)
            .unwrap_or_else(|e| panic!("alert {name}: {expr}: {e}"));
        let selectors = selectors(expr);
        assert!(
            !selectors.is_empty(),
            "alert {name} reads no metric: {expr}"
        );
        for selector in selectors {
            let found = prom
                .query(&selector)
                .unwrap_or_else(|e| panic!("alert {name}: {selector}: {e}"));
            assert!(!found.is_empty(), "alert {name}: no samples of {selector}");
        }
        report.push(format!(
            "alert {name}: {} series now: {}",
            result.len(),
            summary(&result)
        ));
    }
    let loaded = prom.get_json("/api/v1/rules");
    let mut evaluated = Vec::new();
    for group in loaded["data"]["groups"].as_array().into_iter().flatten() {
        for rule in group["rules"].as_array().into_iter().flatten() {
            assert_eq!(rule["health"], "ok", "{rule:#}");
            evaluated.push(rule["name"].as_str().unwrap_or_default().to_owned());
        }
    }
    let expected: Vec<String> = rules
        .iter()
        .map(|r| r["alert"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(evaluated, expected, "the rules Prometheus loaded");

    // What the test did makes two alerts active; the other two are quiet until their
    // conditions come.
    prom.wait_for(r#"ALERTS{alertname="TasksFailing", alertstate="firing", job="propeller"}"#);
    prom.wait_for(
        r#"ALERTS{alertname="PropletsOfflineInNumbers", alertstate="pending", job="propeller"}"#,
    );
    for quiet in ["BrokerSessionLost", "LeaderMissing"] {
        let active = prom
            .query(&format!("ALERTS{{alertname=\"{quiet}\"}}"))
            .expect("ALERTS");
        assert!(active.is_empty(), "{quiet} is active: {active:?}");
    }
    stage("alerts evaluated; TasksFailing fires, PropletsOfflineInNumbers pending");

    drop(broker);
    prom.wait_for(r#"ALERTS{alertname="BrokerSessionLost", job="propeller-external"}"#);
    stage("external broker stopped: BrokerSessionLost pending");
    server.terminate();
    external.terminate();
    leading.terminate();
    prom.wait_for(r#"ALERTS{alertname="LeaderMissing"}"#);
    stage("every propeller stopped: LeaderMissing pending");

    for line in &report {
        eprintln!("{line}");
    }
    drop(prom);
    stage("done");
}

/// The binaries the test needs.
struct Tools {
    prometheus: PathBuf,
    promtool: PathBuf,
}

impl Tools {
    /// `prometheus` and `promtool` on PATH; `None` after one SKIPPED line without them, a
    /// failure under `CI=true`.
    fn find() -> Option<Self> {
        let on_path = |name: &str| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|dir| dir.join(name))
                    .find(|p| p.is_file())
            })
        };
        match (on_path("prometheus"), on_path("promtool")) {
            (Some(prometheus), Some(promtool)) => Some(Self {
                prometheus,
                promtool,
            }),
            _ => {
                let why = "prometheus and promtool are not on PATH (Debian's prometheus \
                           package; scripts/test.sh installs it)";
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    panic!("the dashboards test cannot be skipped in CI: {why}");
                }
                eprintln!("SKIPPED: {why}");
                None
            }
        }
    }
}

/// A Prometheus server on loopback with its data in a temporary directory; stopped (SIGTERM,
/// then SIGKILL) when dropped.
struct Prometheus {
    addr: SocketAddr,
    _process: Running,
}

impl Prometheus {
    fn start(bin: &Path, dir: &Path, config: &str, port: u16) -> Self {
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("prometheus-data").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn");
        let process = Running::spawn(cmd);
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(answer) = http_get(addr, "/-/ready") {
                if answer.starts_with("HTTP/1.0 200") || answer.starts_with("HTTP/1.1 200") {
                    break;
                }
            }
            assert!(
                Instant::now() < deadline,
                "prometheus did not become ready within {WAIT:?}: {:?}",
                process.stderr_so_far()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self {
            addr,
            _process: process,
        }
    }

    /// The JSON body of a GET on the HTTP API.
    fn get_json(&self, path_and_query: &str) -> Value {
        let answer = http_get(self.addr, path_and_query)
            .unwrap_or_else(|e| panic!("GET {path_and_query}: {e}"));
        let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
        serde_json::from_str(body).unwrap_or_else(|e| panic!("GET {path_and_query}: {e}: {answer}"))
    }

    /// An instant query now: its result vector, or Prometheus's error.
    fn query(&self, expr: &str) -> Result<Vec<Value>, String> {
        let answer = self.get_json(&format!("/api/v1/query?query={}", url_encode(expr)));
        if answer["status"] != "success" {
            return Err(format!("{}: {}", answer["errorType"], answer["error"]));
        }
        match answer["data"]["resultType"].as_str() {
            Some("vector") => Ok(answer["data"]["result"]
                .as_array()
                .cloned()
                .unwrap_or_default()),
            other => Err(format!("result type {other:?}, not a vector")),
        }
    }

    /// The values of a Grafana `label_values(METRIC, LABEL)` variable.
    fn label_values(&self, definition: &str) -> Vec<String> {
        let inner = definition
            .strip_prefix("label_values(")
            .and_then(|rest| rest.strip_suffix(')'))
            .unwrap_or_else(|| panic!("not a label_values(metric, label): {definition}"));
        let (metric, label) = inner.rsplit_once(',').expect("metric, label");
        let answer = self.get_json(&format!(
            "/api/v1/label/{}/values?match[]={}",
            label.trim(),
            url_encode(metric.trim())
        ));
        answer["data"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()
    }

    /// Waits (at most [`WAIT`]) until `expr` returns a series.
    fn wait_for(&self, expr: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            match self.query(expr) {
                Ok(result) if !result.is_empty() => return,
                Ok(_) => {}
                Err(e) => panic!("{expr}: {e}"),
            }
            assert!(
                Instant::now() < deadline,
                "prometheus did not show {expr} within {WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// `proplet join` over plain TCP with `token` as machine `machine`, then running as the
/// agent here, heartbeating every second.
fn join(mqtt_port: &str, token: &str, machine: &str, state: &Path) -> Running {
    let mut cmd = binary("proplet");
    cmd.args(["join", "--foreground", "--insecure-enrol", "--server"])
        .arg(format!("tcp://127.0.0.1:{mqtt_port}"))
        .args(["--token", token, "--machine-id", machine, "--state-dir"])
        .arg(state)
        .env("PROPLET_LIVELINESS_INTERVAL", "1")
        .env("RUST_LOG", "info");
    Running::spawn(cmd)
}

/// The name `device` enrolled as, once its Proplet is Running.
fn enrolled(api: &str, data: &Path, device: &Running) -> String {
    let name = support::enrol::enrolled_name(&device.stderr_line("enrolled as"));
    wait_for_phase_within(api, data, &name, "Running", WAIT);
    name
}

fn signal(process: &Running, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(process.child.id().to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{signal}");
}

/// A module whose `boom()` traps, as base64.
fn boom_module() -> String {
    use base64::Engine;
    let wasm =
        wat::parse_str(r#"(module (func (export "boom") (result i32) unreachable))"#).expect("wat");
    base64::engine::general_purpose::STANDARD.encode(wasm)
}

/// `count` loopback ports, different from each other.
fn distinct_ports(count: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::new();
    while ports.len() < count {
        let port = free_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    ports
}

fn port_of(text: &str) -> u16 {
    text.parse().expect("a port number")
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 path")
}

/// The alert rules of a rule file, in order.
fn alert_rules(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("the rule file");
    let file: Value = serde_yaml_ng::from_str(&text).expect("the rule file's YAML");
    let rules: Vec<Value> = file["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect();
    assert!(!rules.is_empty(), "{} has no rules", path.display());
    for rule in &rules {
        assert!(rule["alert"].is_string(), "not an alert: {rule}");
        for annotation in ["summary", "description", "runbook_url"] {
            assert!(
                rule["annotations"][annotation].is_string(),
                "alert {} has no {annotation}",
                rule["alert"]
            );
        }
        let runbook = rule["annotations"]["runbook_url"]
            .as_str()
            .unwrap_or_default();
        let anchor = runbook
            .split_once("docs/src/operations.md#")
            .map(|(_, anchor)| anchor)
            .unwrap_or_else(|| panic!("{runbook} is not a section of docs/src/operations.md"));
        let operations = std::fs::read_to_string(repo_root().join("docs/src/operations.md"))
            .expect("docs/src/operations.md");
        assert!(
            operations
                .lines()
                .any(|l| l.starts_with('#') && heading_anchor(l) == anchor),
            "docs/src/operations.md has no heading #{anchor} (runbook of {})",
            rule["alert"]
        );
    }
    rules
}

/// The anchor mdBook and GitHub give a Markdown heading line.
fn heading_anchor(line: &str) -> String {
    line.trim_start_matches('#')
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every `*.json` dashboard in `dir`, by file name, sorted.
fn dashboards(dir: &Path) -> Vec<(String, Value)> {
    let mut found: Vec<(String, Value)> = std::fs::read_dir(dir)
        .expect("the chart's dashboards directory")
        .map(|entry| entry.expect("entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "json"))
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("dashboard");
            let json =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            (name, json)
        })
        .collect();
    found.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(
        found.len() >= 3,
        "dashboards: {:?}",
        found.iter().map(|d| &d.0).collect::<Vec<_>>()
    );
    found
}

/// A dashboard's panels, those inside rows included, rows themselves left out.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            if panel["type"] != "row" {
                out.push(panel);
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// What Grafana needs of a provisioned dashboard: a uid, a Prometheus data source chosen
/// through the `datasource` variable, and every query on it.
fn check_dashboard_shape(file: &str, dashboard: &Value) {
    assert!(dashboard["uid"].is_string(), "{file}: no uid");
    assert!(dashboard["title"].is_string(), "{file}: no title");
    assert!(
        dashboard["schemaVersion"].as_u64() >= Some(36),
        "{file}: schemaVersion {}",
        dashboard["schemaVersion"]
    );
    let variables = dashboard["templating"]["list"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        variables.iter().any(|v| v["name"] == "datasource"
            && v["type"] == "datasource"
            && v["query"] == "prometheus"),
        "{file}: no datasource variable of type prometheus"
    );
    let panels = panels(dashboard);
    assert!(!panels.is_empty(), "{file}: no panels");
    let mut ids = std::collections::BTreeSet::new();
    for panel in panels {
        let title = &panel["title"];
        assert!(
            ids.insert(panel["id"].to_string()),
            "{file}: panel id {} twice",
            panel["id"]
        );
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "{file} {title}"
        );
        let targets = panel["targets"].as_array().cloned().unwrap_or_default();
        assert!(!targets.is_empty(), "{file} {title}: no query");
        for target in targets {
            assert_eq!(
                target["datasource"]["uid"], "${datasource}",
                "{file} {title}"
            );
            assert!(target["expr"].is_string(), "{file} {title}: {target}");
        }
    }
}

/// A panel query as Grafana sends it: its variables replaced (every job, the window).
fn grafana_substitute(expr: &str) -> String {
    let done = expr
        .replace("$__rate_interval", WINDOW)
        .replace("$__range", WINDOW)
        .replace("$job", ".+");
    assert!(!done.contains('$'), "a variable left in {done}");
    done
}

/// The metric selectors of ours (`propeller_*`, `proplet_*`) in a PromQL expression, each
/// with its label matchers.
fn selectors(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
        } else if c.is_ascii_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':'))
            {
                i += 1;
            }
            let name: String = chars[start..i].iter().collect();
            if !(name.starts_with("propeller_") || name.starts_with("proplet_")) {
                continue;
            }
            let mut selector = name;
            let mut j = i;
            while j < chars.len() && chars[j].is_whitespace() {
                j += 1;
            }
            if j < chars.len() && chars[j] == '{' {
                let mut quoted = false;
                let mut k = j;
                while k < chars.len() {
                    match chars[k] {
                        '"' => quoted = !quoted,
                        '\\' if quoted => k += 1,
                        '}' if !quoted => break,
                        _ => {}
                    }
                    k += 1;
                }
                selector.extend(&chars[j..=k.min(chars.len() - 1)]);
                i = k + 1;
            }
            if !found.contains(&selector) {
                found.push(selector);
            }
        } else {
            i += 1;
        }
    }
    found
}

/// A few series of a result, with their labels and values, for the test's report.
fn summary(result: &[Value]) -> String {
    result
        .iter()
        .take(4)
        .map(|s| {
            let labels: Vec<String> = s["metric"]
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| *k != "instance")
                .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                .collect();
            format!(
                "{{{}}} {}",
                labels.join(","),
                s["value"][1].as_str().unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `helm template` ships the very dashboards and rule groups checked here: a ConfigMap per
/// dashboard labelled for Grafana's sidecar, and a PrometheusRule only where its CRD is.
fn check_chart(root: &Path, dashboards: &[(String, Value)], rules_path: &Path) {
    use serde::Deserialize;
    let Some(helm) = helm_binary() else {
        assert!(
            !std::env::var("CI").is_ok_and(|v| v == "true"),
            "CI=true needs helm (on PATH or ../shared/envtest/helm.xz)"
        );
        eprintln!("SKIPPED (the chart part): no helm on PATH nor ../shared/envtest/helm.xz");
        return;
    };
    let home = tempfile::tempdir().expect("helm home");
    let render = |extra: &[&str]| -> Vec<Value> {
        let out = Command::new(&helm)
            .args([
                "template",
                "propeller",
                CHART,
                "--namespace",
                "propeller-system",
            ])
            .args(extra)
            .current_dir(root)
            .env("HOME", home.path())
            .env("XDG_CACHE_HOME", home.path().join("cache"))
            .env("XDG_CONFIG_HOME", home.path().join("config"))
            .env("XDG_DATA_HOME", home.path().join("data"))
            .output()
            .expect("run helm");
        assert!(
            out.status.success(),
            "helm template {extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        serde_yaml_ng::Deserializer::from_str(&text)
            .filter_map(|d| Value::deserialize(d).ok())
            .filter(|d| d.is_object())
            .collect()
    };
    let of = |docs: &[Value], kind: &str| -> Vec<Value> {
        docs.iter().filter(|d| d["kind"] == kind).cloned().collect()
    };
    let plain = render(&[]);
    assert!(
        of(&plain, "PrometheusRule").is_empty(),
        "a PrometheusRule without its CRD"
    );
    let maps = of(&plain, "ConfigMap");
    for (file, dashboard) in dashboards {
        let map = maps
            .iter()
            .find(|m| m["data"][file.as_str()].is_string())
            .unwrap_or_else(|| panic!("no ConfigMap holds {file}"));
        let shipped = map["data"][file.as_str()].as_str().unwrap_or_default();
        let shipped: Value = serde_json::from_str(shipped).expect("the ConfigMap's JSON");
        assert_eq!(&shipped, dashboard, "{file} in its ConfigMap");
        assert_eq!(
            map["metadata"]["labels"]["grafana_dashboard"], "1",
            "{map:#}"
        );
    }
    let with_crd = render(&["--api-versions", "monitoring.coreos.com/v1/PrometheusRule"]);
    let rule = of(&with_crd, "PrometheusRule");
    assert_eq!(rule.len(), 1, "one PrometheusRule with its CRD");
    let file: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(rules_path).expect("the rule file"))
            .expect("the rule file's YAML");
    assert_eq!(
        rule[0]["spec"]["groups"], file["groups"],
        "the PrometheusRule's groups"
    );
    let off = render(&[
        "--api-versions",
        "monitoring.coreos.com/v1/PrometheusRule",
        "--set",
        "alerts.enabled=false,dashboards.enabled=false",
    ]);
    assert!(of(&off, "PrometheusRule").is_empty() && of(&off, "ConfigMap").is_empty());
}

#[test]
fn selectors_and_anchors_are_read_as_promql_and_mdbook_do() {
    assert_eq!(
        selectors(
            r#"max by (job) (propeller_proplets{job=~".+", phase="Off}line"}) / sum(rate(proplet_tasks_failed_total[5m])) and absent(propeller_proplets)"#
        ),
        [
            r#"propeller_proplets{job=~".+", phase="Off}line"}"#,
            "proplet_tasks_failed_total",
            "propeller_proplets",
        ]
    );
    assert!(selectors(r#"up{job="propeller_x"} == 0"#).is_empty());
    assert_eq!(heading_anchor("#### LeaderMissing"), "leadermissing");
    assert_eq!(
        heading_anchor("## Dashboards and alerts"),
        "dashboards-and-alerts"
    );
}
