//! Propeller and agents on an external MQTT cluster (RabbitMQ, NATS): starting them, their
//! manifests, and reading what their logs say (connections, task runs).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::standalone::{finished_tasks_within, get_json};
use super::{api_address, binary, Running, ADD_WASM, WAIT};

/// Propeller's own login on the cluster.
pub const PROPELLER_USER: &str = "propeller";
/// The topic domain of every test device.
pub const DOMAIN: &str = "d1";

/// Files propeller reads its secrets from, in `dir`.
pub struct Secrets {
    /// The shared secret of the auth callbacks.
    pub callback: String,
    pub callback_file: PathBuf,
    /// Propeller's password on the cluster.
    pub password: String,
    pub password_file: PathBuf,
}

impl Secrets {
    /// Writes fresh secrets into `dir`.
    pub fn write(dir: &Path) -> Self {
        let callback = super::secret(format!("cb{:030x}", rand_u128()));
        let password = super::secret(format!("pw{:030x}", rand_u128()));
        let callback_file = dir.join("callback-secret");
        let password_file = dir.join("mqtt-password");
        std::fs::write(&callback_file, &callback).expect("write the callback secret");
        std::fs::write(&password_file, &password).expect("write the password");
        Self {
            callback,
            callback_file,
            password,
            password_file,
        }
    }
}

fn rand_u128() -> u128 {
    use std::hash::{BuildHasher, Hasher};
    let mut value = 0u128;
    for _ in 0..2 {
        let part = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        value = (value << 64) | u128::from(part);
    }
    value
}

/// `propeller standalone` on the cluster at `brokers` (comma-separated URLs), its data in
/// `dir`; `extra` says how devices are authenticated. Returns the process and its API.
pub fn start_propeller(dir: &Path, brokers: &str, extra: &[&str]) -> (Running, String) {
    let mut cmd = binary("propeller");
    cmd.args(["standalone", "--api-listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir)
        .args(["--mqtt-broker", brokers])
        .args(extra)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1");
    let server = Running::spawn(cmd);
    let addr = api_address(&server);
    (server, addr)
}

/// A Secret and an external Proplet `name` on a channel of its own (`m/d1/c/{name}`), the
/// layout that binds a report's topic to one proplet.
pub fn device_manifest(name: &str, brokers: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {name}-secret\n---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\nspec:\n  type: external\n  external:\n    capabilities: [wasm]\n  connectionConfig:\n    mqttAddress: \"{brokers}\"\n    domainId: {DOMAIN}\n    channelId: {name}\n    clientId: {name}\n    clientKeySecretRef: {{name: {name}-key, key: key}}\n"
    )
}

/// The real agent of device `name`, given the cluster's nodes in the order it should try them.
pub fn device_agent(name: &str, brokers: &str, state_dir: &Path) -> Running {
    let mut cmd = binary("proplet");
    cmd.env("PROPLET_MQTT_ADDRESS", brokers)
        .env("PROPLET_DOMAIN_ID", DOMAIN)
        .env("PROPLET_CHANNEL_ID", name)
        .env("PROPLET_CLIENT_ID", name)
        .env("PROPLET_CLIENT_KEY", format!("{name}-secret"))
        .env("PROPLET_STATE_DIR", state_dir)
        .env("PROPLET_LIVELINESS_INTERVAL", "1")
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1");
    Running::spawn(cmd)
}

/// An agent process and every log line it printed so far.
pub struct AgentLog {
    pub process: Running,
    lines: Vec<String>,
}

impl AgentLog {
    pub fn new(process: Running) -> Self {
        Self {
            process,
            lines: Vec::new(),
        }
    }

    /// Reads what was printed since the last call; returns all lines so far.
    pub fn lines(&mut self) -> &[String] {
        self.lines.extend(self.process.stdout.try_iter());
        self.lines.extend(self.process.stderr.try_iter());
        &self.lines
    }

    /// How many broker sessions it opened so far.
    pub fn sessions(&mut self) -> usize {
        self.count("connected to the broker")
    }

    /// The broker of its latest session (`host:port`), from its log.
    pub fn current_broker(&mut self) -> Option<String> {
        let line = self
            .lines()
            .iter()
            .rev()
            .find(|l| l.contains("connected to the broker"))?
            .clone();
        let url = field(&line, "broker")?;
        Some(url.rsplit("://").next().unwrap_or(&url).to_owned())
    }

    /// How many lines contain `needle`.
    pub fn count(&mut self, needle: &str) -> usize {
        self.lines().iter().filter(|l| l.contains(needle)).count()
    }

    /// How many times each task id was accepted (run) by this agent.
    pub fn runs(&mut self) -> BTreeMap<String, usize> {
        let mut runs = BTreeMap::new();
        for line in self.lines() {
            if !line.contains("task accepted") {
                continue;
            }
            if let Some(id) = field(line, "task_id") {
                *runs.entry(id).or_default() += 1;
            }
        }
        runs
    }

    /// Waits until a line containing `needle` appears (among all lines so far).
    pub fn wait_for(&mut self, needle: &str, limit: Duration) {
        let started = Instant::now();
        while self.count(needle) == 0 {
            assert!(
                started.elapsed() < limit,
                "agent did not print {needle:?} within {limit:?}; its log:\n{}",
                self.lines().join("\n")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The value of `name=value` in a tracing text line.
fn field(line: &str, name: &str) -> Option<String> {
    let start = line.find(&format!("{name}="))? + name.len() + 1;
    let rest = &line[start..];
    let value: String = rest
        .trim_start_matches('"')
        .chars()
        .take_while(|c| !c.is_whitespace() && *c != '"')
        .collect();
    Some(value)
}

/// A Task computing add(a, b) with an inline module; `extra` is more of its spec (indented
/// two spaces), e.g. a selector.
pub fn add_task(name: &str, a: i64, b: i64, extra: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: {name}\nspec:\n  name: {name}\n  functionName: add\n  file: {ADD_WASM}\n  inputs: [{a}, {b}]\n{extra}"
    )
}

/// The tasks' uids by name (agents log the uid as the task id).
pub fn task_ids(api: &str, dir: &Path) -> BTreeMap<String, String> {
    get_json(api, dir, &["get", "task"])
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            Some((
                t["metadata"]["name"].as_str()?.to_owned(),
                t["metadata"]["uid"].as_str()?.to_owned(),
            ))
        })
        .collect()
}

/// Waits for `names` to finish and checks each completed with `expected`.
pub fn expect_results(api: &str, dir: &Path, names: &[&str], expected: &str, limit: Duration) {
    let done = finished_tasks_within(api, dir, names, limit);
    for name in names {
        let task = &done[*name];
        assert_eq!(
            task["status"]["phase"], "completed",
            "{name}: {:#}",
            task["status"]
        );
        assert_eq!(
            task["status"]["results"].to_string().trim_matches('"'),
            expected,
            "{name}: {:#}",
            task["status"]
        );
    }
}

/// Runs `mosquitto_pub` (one QoS 1 message) with `args`; true when it exited 0 within 10 s.
pub fn mosquitto_pub(args: &[&str]) -> bool {
    mosquitto("mosquitto_pub", args)
}

/// A device logging in with `mosquitto_pub` / `mosquitto_sub` on one broker node.
pub struct Probe {
    pub host: String,
    pub port: String,
    pub client_id: String,
    pub username: String,
    pub password: String,
}

impl Probe {
    /// The device `name` (its key is `{name}-secret`) on node `url` (`mqtt://host:port`).
    pub fn device(url: &str, name: &str) -> Self {
        let (host, port) = url
            .trim_start_matches("mqtt://")
            .rsplit_once(':')
            .expect("host:port");
        Self {
            host: host.to_owned(),
            port: port.to_owned(),
            client_id: name.to_owned(),
            username: name.to_owned(),
            password: format!("{name}-secret"),
        }
    }

    /// The same node with other login fields.
    pub fn with(&self, client_id: &str, username: &str, password: &str) -> Self {
        Self {
            host: self.host.clone(),
            port: self.port.clone(),
            client_id: client_id.to_owned(),
            username: username.to_owned(),
            password: password.to_owned(),
        }
    }

    fn args(&self) -> Vec<String> {
        let mut args = vec![
            "-h",
            &self.host,
            "-p",
            &self.port,
            "-q",
            "1",
            "-i",
            &self.client_id,
        ]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>();
        if !self.username.is_empty() {
            args.extend(["-u".to_owned(), self.username.clone()]);
            args.extend(["-P".to_owned(), self.password.clone()]);
        }
        args
    }

    /// Publishes one QoS 1 message; true when the broker took it (exit 0 within 10 s).
    pub fn publish(&self, topic: &str, message: &str) -> bool {
        let mut args = self.args();
        args.extend(["-t", topic, "-m", message].map(str::to_owned));
        mosquitto_pub(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Subscribes to `filter` for `seconds`, in the background, until the first message.
    pub fn watch(&self, filter: &str, seconds: u32) -> Watch {
        let mut cmd = Command::new("timeout");
        cmd.arg((seconds + 4).to_string())
            .arg("mosquitto_sub")
            .args(self.args())
            .args(["-t", filter, "-C", "1", "-W", &seconds.to_string()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        Watch(cmd.spawn().expect("start mosquitto_sub"))
    }
}

/// A running `mosquitto_sub`.
pub struct Watch(std::process::Child);

impl Watch {
    /// Waits for it to end; what it saw.
    pub fn finish(self) -> SubOutcome {
        let output = self.0.wait_with_output().expect("mosquitto_sub");
        SubOutcome {
            received: String::from_utf8_lossy(&output.stdout).into_owned(),
            said: String::from_utf8_lossy(&output.stderr).into_owned(),
            code: output.status.code(),
        }
    }
}

/// What `mosquitto_sub` saw.
#[derive(Debug)]
pub struct SubOutcome {
    pub received: String,
    pub said: String,
    pub code: Option<i32>,
}

impl SubOutcome {
    /// The broker refused the subscription (SUBACK failure) or closed the connection.
    pub fn refused(&self) -> bool {
        self.received.is_empty()
            && ["denied", "Connection", "connection", "Error"]
                .iter()
                .any(|word| self.said.contains(word))
    }
}

fn mosquitto(tool: &str, args: &[&str]) -> bool {
    let mut cmd = Command::new("timeout");
    cmd.arg("10").arg(tool).args(args);
    cmd.status().is_ok_and(|s| s.success())
}

/// Waits until `check` holds, failing with `what` after [`WAIT`] times `factor`.
pub fn eventually(what: &str, factor: u32, mut check: impl FnMut() -> bool) {
    let limit = WAIT * factor;
    let started = Instant::now();
    while !check() {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
