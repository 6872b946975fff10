#![allow(dead_code)]
//! Real 3-node MQTT broker clusters for tests: RabbitMQ 3.10 (`rabbitmq_mqtt` with the HTTP
//! auth backend) and NATS 2.9 (JetStream + MQTT), set up as the book's "Scaling out"
//! (`docs/src/scaling-out.md`) describes.
//!
//! Every server listens on loopback ports chosen with [`free_port`], keeps its files in a
//! fresh temporary directory and is stopped by pid when the cluster is dropped (also on
//! panic) and, through `PR_SET_PDEATHSIG`, when the test process dies. RabbitMQ gets an epmd
//! of its own on a private port; 4369, 5672 and 25672 are never used. A start whose port was
//! taken by another process in the meantime is retried on other ports.
//!
//! Without the servers' binaries a test is skipped with one `SKIPPED (...)` line; with
//! `CI=true` a missing binary fails the test instead.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::envtest::free_port;
use super::pdeathsig;

/// Starts tried before giving up when another process took one of the chosen ports.
const LAUNCH_ATTEMPTS: usize = 5;
/// How long RabbitMQ's nodes get to boot, join and report 3 running nodes.
const RABBIT_START_TIMEOUT: Duration = Duration::from_secs(180);
/// Upper bound on one `rabbitmqctl` call.
const CTL_TIMEOUT: Duration = Duration::from_secs(90);
/// How long NATS gets to be healthy on all nodes and to accept the warm-up connects.
const NATS_START_TIMEOUT: Duration = Duration::from_secs(60);
/// Lines of each node's log in [`RabbitCluster::log_tail`] and [`NatsCluster::log_tail`].
const TAIL_LINES: usize = 40;
/// Debian's RabbitMQ scripts; `/usr/sbin/rabbitmq*` are wrappers that `su rabbitmq`.
const DEBIAN_RABBITMQ_BIN: &str = "/usr/lib/rabbitmq/bin";

/// Why a cluster did not come up; a taken port is worth another try on other ports.
enum StartFailure {
    PortTaken(String),
    Other(String),
}

/// Retries `launch` on new ports while a port was taken, like the envtest control plane.
fn launch_with_retries<T>(what: &str, mut launch: impl FnMut() -> Result<T, StartFailure>) -> T {
    for attempt in 1.. {
        match launch() {
            Ok(cluster) => return cluster,
            Err(StartFailure::PortTaken(why)) if attempt < LAUNCH_ATTEMPTS => {
                eprintln!("{what} start {attempt}: a port was taken; again on other ports:\n{why}");
            }
            Err(StartFailure::PortTaken(why) | StartFailure::Other(why)) => {
                panic!("{what} did not start: {why}")
            }
        }
    }
    unreachable!("the loop returns or panics")
}

/// `None` after one SKIPPED line, or a panic under `CI=true`.
fn skip<T>(what: &str, why: &str, how: &str) -> Option<T> {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{what} tests cannot be skipped in CI: {why}");
    }
    eprintln!("SKIPPED (no {what}): {why}. {how}");
    None
}

/// Whether `mosquitto_pub`, `mosquitto_sub` and `stdbuf` are there for a test that drives
/// the brokers with them; prints one SKIPPED line (or panics under `CI=true`) when not.
pub fn mosquitto_clients_available() -> bool {
    match ["mosquitto_pub", "mosquitto_sub", "stdbuf"]
        .into_iter()
        .find(|name| on_path(name).is_none())
    {
        None => true,
        Some(name) => skip::<()>(
            "mosquitto clients",
            &format!("{name} is not on PATH"),
            "Install them with `apt-get install mosquitto-clients`.",
        )
        .is_some(),
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// The first of `name` on PATH and `extra` directories.
fn find_binary(name: &str, extra: &[&str]) -> Option<PathBuf> {
    on_path(name).or_else(|| {
        extra
            .iter()
            .map(|dir| Path::new(dir).join(name))
            .find(|p| p.is_file())
    })
}

/// `count` distinct ports from [`free_port`].
fn distinct_ports(count: usize) -> Vec<u16> {
    let mut ports: Vec<u16> = Vec::with_capacity(count);
    while ports.len() < count {
        let port = free_port();
        if !ports.contains(&port) {
            ports.push(port);
        }
    }
    ports
}

/// A cheap random token (RandomState is seeded per process and per call).
fn random_token() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut token = String::new();
    for _ in 0..2 {
        let n = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        token.push_str(&format!("{n:016X}"));
    }
    token
}

fn temp_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .unwrap_or_else(|e| panic!("creating a temporary directory for {prefix}: {e}"))
}

fn write_file(path: &Path, text: &str) {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .unwrap_or_else(|e| panic!("creating {}: {e}", parent.display()));
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
}

/// The last `lines` lines of a file, or a note that it is missing.
fn file_tail(path: &Path, lines: usize) -> String {
    match std::fs::read(path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            // A killed node's peers log a failed route dial every second: keep the last one.
            const REDIAL: &str = "Error trying to connect to route";
            let redials = text.lines().filter(|l| l.contains(REDIAL)).count();
            let mut all: Vec<&str> = Vec::new();
            let mut seen = 0;
            for line in text.lines() {
                if line.contains(REDIAL) {
                    seen += 1;
                    if seen < redials {
                        continue;
                    }
                }
                all.push(line);
            }
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("({} unreadable: {e})", path.display()),
    }
}

fn port_taken(text: &str) -> bool {
    let text = text.to_ascii_lowercase();
    [
        "address already in use",
        "eaddrinuse",
        // RabbitMQ's prelaunch on a taken distribution port.
        "dist_port_already_used",
    ]
    .iter()
    .any(|needle| text.contains(needle))
}

/// Spawns `cmd` with stdin closed and stdout and stderr appended to `log`; it dies with the
/// thread that started it.
fn spawn_logged(mut cmd: Command, log: &Path) -> Child {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("opening {}: {e}", log.display()));
    let err = file.try_clone().expect("log file handle");
    cmd.stdin(Stdio::null()).stdout(file).stderr(err);
    pdeathsig(&mut cmd);
    cmd.spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", cmd.get_program().to_string_lossy()))
}

/// Whether our epmd answers on `port`: a NAMES_REQ is answered with epmd's own port, which
/// another program that took the port would not do.
fn epmd_answers(port: u16) -> bool {
    epmd_names(port).is_some()
}

/// epmd's answer to NAMES_REQ on `port` (`name rmq1 at port 12345` lines), if it is an epmd
/// listening on that port.
fn epmd_names(port: u16) -> Option<String> {
    let mut stream =
        TcpStream::connect_timeout(&loopback(port), Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    stream.write_all(&[0, 1, b'n']).ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).ok()?;
    let own_port = answer.get(..4)?;
    (u32::from_be_bytes(own_port.try_into().ok()?) == u32::from(port))
        .then(|| String::from_utf8_lossy(&answer[4..]).into_owned())
}

/// Whether something accepts TCP connections on `addr`.
fn listening(addr: SocketAddr) -> bool {
    TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok()
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Sends SIGKILL to `pid`.
fn sigkill(pid: u32) {
    // SAFETY: kill(2) has no memory effects in this process.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
}

/// Kills a child and reaps it.
fn kill_child(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Runs `cmd` (stdin closed, output captured), killing it after `limit`; a timeout shows as
/// a failed status with a note at the end of stderr.
pub fn output_within(mut cmd: Command, limit: Duration) -> Output {
    let shown = std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|s| s.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    pdeathsig(&mut cmd);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("running {shown}: {e}"));
    let collect = |mut stream: Box<dyn Read + Send>| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = stream.read_to_end(&mut bytes);
            let _ = tx.send(bytes);
        });
        rx
    };
    let stdout = collect(Box::new(child.stdout.take().expect("piped stdout")));
    let stderr = collect(Box::new(child.stderr.take().expect("piped stderr")));
    let deadline = Instant::now() + limit;
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                timed_out = true;
                let _ = child.kill();
                break child.wait().expect("wait for a killed child");
            }
        }
    };
    // A grandchild may hold the pipes open; do not wait for it long.
    let grace = Duration::from_secs(2);
    let stdout = stdout.recv_timeout(grace).unwrap_or_default();
    let mut stderr = stderr.recv_timeout(grace).unwrap_or_default();
    if timed_out {
        stderr.extend_from_slice(format!("\n[{shown}: killed after {limit:?}]").as_bytes());
    }
    Output {
        status,
        stdout,
        stderr,
    }
}

fn describe(out: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim_end(),
        String::from_utf8_lossy(&out.stderr).trim_end()
    )
}

/// One MQTT 3.1.1 CONNECT (clean session) to `addr` and a DISCONNECT; the CONNACK return
/// code (0 = accepted, 4 = bad user name or password, 5 = not authorised), or why there was
/// none within `limit`.
pub fn mqtt_connack(
    addr: SocketAddr,
    client_id: &str,
    user: &str,
    password: &str,
    limit: Duration,
) -> Result<u8, String> {
    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend_from_slice(&(s.len() as u16).to_be_bytes());
        out.extend_from_slice(s.as_bytes());
    }
    let mut body = Vec::new();
    string(&mut body, "MQTT");
    body.push(4); // protocol level 3.1.1
    body.push(0x80 | 0x40 | 0x02); // user name, password, clean session
    body.extend_from_slice(&30u16.to_be_bytes()); // keep-alive seconds
    string(&mut body, client_id);
    string(&mut body, user);
    string(&mut body, password);
    let mut packet = vec![0x10];
    let mut len = body.len();
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        packet.push(byte);
        if len == 0 {
            break;
        }
    }
    packet.extend_from_slice(&body);

    let mut stream = TcpStream::connect_timeout(&addr, limit)
        .map_err(|e| format!("connecting to {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(limit))
        .and_then(|_| stream.set_write_timeout(Some(limit)))
        .map_err(|e| format!("socket timeouts: {e}"))?;
    stream
        .write_all(&packet)
        .map_err(|e| format!("sending CONNECT to {addr}: {e}"))?;
    let mut connack = [0u8; 4];
    stream
        .read_exact(&mut connack)
        .map_err(|e| format!("no CONNACK from {addr} within {limit:?}: {e}"))?;
    if connack[0] != 0x20 || connack[1] != 2 {
        return Err(format!("not a CONNACK from {addr}: {connack:02x?}"));
    }
    let _ = stream.write_all(&[0xE0, 0x00]);
    Ok(connack[3])
}

// ---------------------------------------------------------------------------------------
// RabbitMQ

/// Paths of RabbitMQ's scripts and epmd.
#[derive(Clone)]
struct RabbitTools {
    server: PathBuf,
    ctl: PathBuf,
    epmd: PathBuf,
}

fn find_rabbit_tools() -> Result<RabbitTools, String> {
    let script = |name: &str| {
        let debian = Path::new(DEBIAN_RABBITMQ_BIN).join(name);
        if debian.is_file() {
            Some(debian)
        } else {
            on_path(name)
        }
    };
    let server = script("rabbitmq-server").ok_or_else(|| {
        format!("neither {DEBIAN_RABBITMQ_BIN}/rabbitmq-server nor rabbitmq-server on PATH")
    })?;
    let ctl = script("rabbitmqctl").ok_or("rabbitmqctl not found beside rabbitmq-server")?;
    let epmd = find_binary("epmd", &["/usr/lib/erlang/bin"]).ok_or("epmd is not on PATH")?;
    Ok(RabbitTools { server, ctl, epmd })
}

struct RabbitNode {
    /// `rmqN@localhost`.
    name: String,
    dir: PathBuf,
    mqtt: SocketAddr,
    /// Environment of the node and of `rabbitmqctl` calls about it.
    env: Vec<(String, String)>,
    /// `rabbitmq-server`, which becomes the beam: with RABBITMQ_ALLOW_INPUT the script
    /// `exec`s erl instead of forking it, so PR_SET_PDEATHSIG covers the beam.
    child: Option<Child>,
}

impl RabbitNode {
    fn log_path(&self) -> PathBuf {
        self.dir.join("log").join(format!("{}.log", self.name))
    }

    fn console_path(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    fn tail(&self, lines: usize) -> String {
        format!(
            "--- {} log ---\n{}\n--- {} console ---\n{}",
            self.name,
            file_tail(&self.log_path(), lines),
            self.name,
            file_tail(&self.console_path(), 10)
        )
    }

    /// The pid the beam wrote to RABBITMQ_PID_FILE, if that process is still a beam.
    fn beam_pid(&self) -> Option<u32> {
        let pid: u32 = std::fs::read_to_string(self.dir.join("beam.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline)
            .contains("beam")
            .then_some(pid)
    }

    /// SIGKILL to the beam (by the pid it recorded, and as our child) and waits for it.
    fn kill(&mut self) {
        let beam = self.beam_pid();
        if let Some(pid) = beam {
            sigkill(pid);
        }
        let child_pid = self.child.as_ref().map(Child::id);
        if let Some(child) = &mut self.child {
            kill_child(child);
        }
        self.child = None;
        // Only if the script forked after all: the beam is not our child, so poll for it.
        if let Some(pid) = beam.filter(|pid| Some(*pid) != child_pid) {
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline && process_alive(pid) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// Why the node's process has exited, if it has.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }
}

/// Whether `pid` exists and is not a zombie.
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Three RabbitMQ nodes `rmq{1,2,3}@localhost` in one cluster, with MQTT and the HTTP auth
/// backend; everything is killed when this is dropped.
pub struct RabbitCluster {
    nodes: Vec<RabbitNode>,
    epmd: Option<Child>,
    tools: RabbitTools,
    dir: tempfile::TempDir,
}

impl RabbitCluster {
    /// 3 nodes rmq{1,2,3}@localhost joined into one cluster; rabbitmq_mqtt +
    /// rabbitmq_auth_backend_http enabled; auth_backends.1 = http with
    /// user_path/vhost_path/resource_path/topic_path = `{auth_base}/user` etc. (GET).
    /// mqtt.allow_anonymous=false, mqtt.vhost=/, mqtt.exchange=amq.topic. Blocks until
    /// `cluster_status` shows 3 running nodes. `None` (after one SKIPPED line) when RabbitMQ
    /// is not installed, outside CI; panics when the cluster does not come up.
    pub fn start(auth_base: &str) -> Option<Self> {
        Self::start_on(IpAddr::from([127, 0, 0, 1]), auth_base)
    }

    /// [`RabbitCluster::start`] with the MQTT listeners on `mqtt_host` instead of loopback
    /// (a host address that pods reach); distribution and AMQP stay on loopback. Start it
    /// from the thread that lives as long as the cluster should (the nodes die with it).
    pub fn start_on(mqtt_host: IpAddr, auth_base: &str) -> Option<Self> {
        let tools = match find_rabbit_tools() {
            Ok(tools) => tools,
            Err(why) => {
                return skip(
                    "RabbitMQ",
                    &why,
                    "Install it with `apt-get install rabbitmq-server` (scripts/test.sh \
                     does, with a policy-rc.d that keeps the package from starting a \
                     system node).",
                )
            }
        };
        let auth_base = auth_base.trim_end_matches('/');
        Some(launch_with_retries("RabbitMQ cluster", || {
            Self::launch(tools.clone(), mqtt_host, auth_base)
        }))
    }

    /// The MQTT listener of each node, in node order.
    pub fn mqtt_addrs(&self) -> Vec<SocketAddr> {
        self.nodes.iter().map(|n| n.mqtt).collect()
    }

    /// The names of the cluster's queues (an MQTT session's QoS 1 subscriptions are the
    /// queue `mqtt-subscription-<client id>qos1`, kept until a clean-session connect).
    pub fn queues(&self) -> Vec<String> {
        let out = self.ctl(0, &["list_queues", "name", "--quiet", "--no-table-headers"]);
        assert!(out.status.success(), "list_queues: {}", describe(&out));
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// `kill -9` of node `index`'s beam (0-based) by pid; the node stays dead.
    pub fn kill_node(&mut self, index: usize) {
        let node = self
            .nodes
            .get_mut(index)
            .unwrap_or_else(|| panic!("no RabbitMQ node {index} (there are 3, 0-based)"));
        node.kill();
    }

    /// The last ~40 lines of each node's log (and a few of its console output), for
    /// failure messages.
    pub fn log_tail(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.tail(TAIL_LINES))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn launch(
        tools: RabbitTools,
        mqtt_host: IpAddr,
        auth_base: &str,
    ) -> Result<Self, StartFailure> {
        let started = Instant::now();
        let dir = temp_dir("rabbitmq-cluster-");
        let root = dir.path().to_path_buf();
        let home = root.join("home");
        let cookie = home.join(".erlang.cookie");
        write_file(&cookie, &random_token());
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&cookie, std::fs::Permissions::from_mode(0o400))
                .expect("cookie permissions");
        }
        // epmd, the CLI's distribution ports, and per node AMQP, MQTT and distribution.
        let ports = distinct_ports(2 + 3 * 3);
        let (epmd_port, ctl_min) = (ports[0], ports[1]);
        // The CLI tries each port of its range until one is free.
        let ctl_max = ctl_min.saturating_add(16);

        let mut cluster = RabbitCluster {
            nodes: Vec::new(),
            epmd: None,
            tools,
            dir,
        };

        let mut epmd = Command::new(&cluster.tools.epmd);
        epmd.args(["-port", &epmd_port.to_string(), "-address", "127.0.0.1"]);
        let epmd_log = root.join("epmd.log");
        cluster.epmd = Some(spawn_logged(epmd, &epmd_log));
        loop {
            if let Some(Ok(Some(status))) = cluster.epmd.as_mut().map(Child::try_wait) {
                // epmd says why only to syslog; an epmd that exits at once lost its port.
                return Err(StartFailure::PortTaken(format!(
                    "epmd on port {epmd_port} exited ({status}):\n{}",
                    file_tail(&epmd_log, 20)
                )));
            }
            if epmd_answers(epmd_port) {
                break;
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err(StartFailure::Other(format!(
                    "epmd not listening on {epmd_port} within 10 s:\n{}",
                    file_tail(&epmd_log, 20)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }

        for i in 0..3 {
            let n = i + 1;
            let name = format!("rmq{n}@localhost");
            let node_dir = root.join(format!("n{n}"));
            let (amqp, mqtt, dist) = (ports[2 + 3 * i], ports[3 + 3 * i], ports[4 + 3 * i]);
            write_file(
                &node_dir.join("rabbitmq.conf"),
                &format!(
                    "listeners.tcp.default = 127.0.0.1:{amqp}\n\
                     mqtt.listeners.tcp.default = {mqtt_listen}\n\
                     mqtt.allow_anonymous = false\n\
                     mqtt.vhost = /\n\
                     mqtt.exchange = amq.topic\n\
                     auth_backends.1 = http\n\
                     auth_http.http_method = get\n\
                     auth_http.user_path = {auth_base}/user\n\
                     auth_http.vhost_path = {auth_base}/vhost\n\
                     auth_http.resource_path = {auth_base}/resource\n\
                     auth_http.topic_path = {auth_base}/topic\n\
                     log.file.level = info\n",
                    mqtt_listen = SocketAddr::new(mqtt_host, mqtt),
                ),
            );
            write_file(&node_dir.join("advanced.config"), "[].\n");
            // What `rabbitmq-plugins --offline enable` would write.
            write_file(
                &node_dir.join("enabled_plugins"),
                "[rabbitmq_auth_backend_http,rabbitmq_mqtt].\n",
            );
            // Keeps /etc/rabbitmq/rabbitmq-env.conf out; the distribution port on loopback
            // only; -noinput because RABBITMQ_ALLOW_INPUT (set for the exec) drops it.
            write_file(
                &node_dir.join("rabbitmq-env.conf"),
                "SERVER_ADDITIONAL_ERL_ARGS=\"-kernel inet_dist_use_interface {127,0,0,1} \
                 -noinput\"\n",
            );
            std::fs::create_dir_all(node_dir.join("mnesia")).expect("mnesia dir");
            std::fs::create_dir_all(node_dir.join("log")).expect("log dir");
            let path = |p: &str| node_dir.join(p).display().to_string();
            let env: Vec<(String, String)> = [
                ("HOME", home.display().to_string()),
                ("ERL_EPMD_PORT", epmd_port.to_string()),
                ("ERL_EPMD_ADDRESS", "127.0.0.1".into()),
                ("RABBITMQ_NODENAME", name.clone()),
                ("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1".into()),
                ("RABBITMQ_NODE_PORT", amqp.to_string()),
                ("RABBITMQ_DIST_PORT", dist.to_string()),
                ("RABBITMQ_CTL_DIST_PORT_MIN", ctl_min.to_string()),
                ("RABBITMQ_CTL_DIST_PORT_MAX", ctl_max.to_string()),
                ("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf")),
                ("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf")),
                ("RABBITMQ_ADVANCED_CONFIG_FILE", path("advanced.config")),
                ("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins")),
                ("RABBITMQ_MNESIA_BASE", path("mnesia")),
                ("RABBITMQ_LOG_BASE", path("log")),
                ("RABBITMQ_PID_FILE", path("beam.pid")),
                ("RABBITMQ_ALLOW_INPUT", "true".into()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v))
            .collect();
            cluster.nodes.push(RabbitNode {
                name,
                dir: node_dir,
                mqtt: SocketAddr::new(mqtt_host, mqtt),
                env,
                child: None,
            });
        }

        // All three boot at once, started from this thread so PR_SET_PDEATHSIG ties them to
        // the test's thread.
        for node in &mut cluster.nodes {
            let mut cmd = Command::new(&cluster.tools.server);
            cmd.envs(node.env.iter().map(|(k, v)| (k, v)))
                .env_remove("NOTIFY_SOCKET")
                .env_remove("RABBITMQ_ENV_LOADED")
                .current_dir(&node.dir);
            node.child = Some(spawn_logged(cmd, &node.console_path()));
        }

        let deadline = started + RABBIT_START_TIMEOUT;
        let ctl = &cluster.tools.ctl;
        let abort = AtomicBool::new(false);
        let booted: Vec<Result<(), StartFailure>> = std::thread::scope(|scope| {
            let abort = &abort;
            let waits: Vec<_> = cluster
                .nodes
                .iter_mut()
                .map(|node| {
                    scope.spawn(move || {
                        let result = await_boot(ctl, node, epmd_port, deadline, abort);
                        if result.is_err() {
                            abort.store(true, Ordering::Relaxed);
                        }
                        result
                    })
                })
                .collect();
            waits
                .into_iter()
                .map(|w| w.join().expect("boot wait thread"))
                .collect()
        });
        let booted_in = started.elapsed();
        // The failure that caused the others, not "another node failed".
        let mut failures: Vec<StartFailure> = booted.into_iter().filter_map(Result::err).collect();
        failures.sort_by_key(|f| match f {
            StartFailure::PortTaken(_) => 0,
            StartFailure::Other(why) if why.contains("another node failed") => 2,
            StartFailure::Other(_) => 1,
        });
        if let Some(failure) = failures.into_iter().next() {
            return Err(failure);
        }

        // Nodes 2 and 3 join node 1: stop_app on both at once, then join and start_app one
        // node after the other. Two concurrent start_apps once left the MQTT plugin's Raft
        // cluster (client ID tracking) without a leader, start_app hanging.
        cluster.ctl_on_joiners(&["stop_app"])?;
        for i in 1..3 {
            cluster.ctl_ok(i, &["join_cluster", "rmq1@localhost"])?;
            cluster.ctl_ok(i, &["start_app"])?;
        }

        loop {
            let out = cluster.ctl(0, &["cluster_status", "--formatter", "json"]);
            let running = serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .ok()
                .and_then(|v| v["running_nodes"].as_array().map(Vec::len))
                .unwrap_or(0);
            if out.status.success() && running == 3 {
                break;
            }
            if Instant::now() > deadline {
                return Err(StartFailure::Other(format!(
                    "cluster_status did not show 3 running nodes within {RABBIT_START_TIMEOUT:?}: \
                     {}\n{}",
                    describe(&out),
                    cluster.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        // MQTT subscription queues are durable classic queues on one node (RabbitMQ 3.x): a
        // client whose queue's node died could not subscribe again on another node until it
        // returned. Mirrored on every node, the queue outlives its node (the book's "Scaling
        // out").
        cluster.ctl_ok(
            0,
            &[
                "set_policy",
                "--apply-to",
                "queues",
                "mqtt-subscriptions",
                "^mqtt-subscription-",
                r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#,
            ],
        )?;
        for (i, addr) in cluster.mqtt_addrs().into_iter().enumerate() {
            while !listening(addr) {
                if Instant::now() > deadline {
                    return Err(StartFailure::Other(format!(
                        "node {} does not accept MQTT connections on {addr}:\n{}",
                        i + 1,
                        cluster.log_tail()
                    )));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        eprintln!(
            "RabbitMQ cluster up in {:.1} s (nodes booted in {:.1} s), MQTT on {:?}, files in {}",
            started.elapsed().as_secs_f64(),
            booted_in.as_secs_f64(),
            cluster.mqtt_addrs(),
            cluster.dir.path().display()
        );
        Ok(cluster)
    }

    /// `rabbitmqctl -n <node> args...` about node `index`, bounded by [`CTL_TIMEOUT`].
    fn ctl(&self, index: usize, args: &[&str]) -> Output {
        ctl_command(&self.tools.ctl, &self.nodes[index], args)
    }

    fn ctl_ok(&self, index: usize, args: &[&str]) -> Result<(), StartFailure> {
        let out = self.ctl(index, args);
        if out.status.success() {
            Ok(())
        } else {
            Err(StartFailure::Other(format!(
                "rabbitmqctl -n {} {} failed: {}\n{}",
                self.nodes[index].name,
                args.join(" "),
                describe(&out),
                self.log_tail()
            )))
        }
    }

    /// The same `rabbitmqctl` call on nodes 2 and 3 at once.
    fn ctl_on_joiners(&self, args: &[&str]) -> Result<(), StartFailure> {
        let results: Vec<Result<(), StartFailure>> = std::thread::scope(|scope| {
            let calls: Vec<_> = (1..3)
                .map(|i| scope.spawn(move || self.ctl_ok(i, args)))
                .collect();
            calls
                .into_iter()
                .map(|c| c.join().expect("rabbitmqctl thread"))
                .collect()
        });
        results.into_iter().collect()
    }
}

fn ctl_command(ctl: &Path, node: &RabbitNode, args: &[&str]) -> Output {
    let mut cmd = Command::new(ctl);
    cmd.envs(node.env.iter().map(|(k, v)| (k, v)))
        .env_remove("RABBITMQ_ENV_LOADED")
        .arg("-n")
        .arg(&node.name)
        .args(args)
        .current_dir(&node.dir);
    output_within(cmd, CTL_TIMEOUT)
}

/// Waits until `node` has booted: its log says "Server startup complete", or (should a
/// version word it differently) it is registered with epmd, something accepts connections on
/// its MQTT port (which a program that took the port could be) and `rabbitmqctl
/// await_startup` then succeeds. await_startup alone fails at once while the node is not
/// registered yet and polls only every 10 s while it boots. Gives up when `abort` is set
/// (another node failed).
fn await_boot(
    ctl: &Path,
    node: &mut RabbitNode,
    epmd_port: u16,
    deadline: Instant,
    abort: &AtomicBool,
) -> Result<(), StartFailure> {
    let failed = |node: &mut RabbitNode, why: String| {
        // A node that failed to boot is still writing why (and a crash dump).
        let until = Instant::now() + Duration::from_secs(10);
        while node.exited().is_none() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(100));
        }
        let log = node.tail(TAIL_LINES);
        let why = format!("{}: {why}\n{log}", node.name);
        if port_taken(&log) {
            StartFailure::PortTaken(why)
        } else {
            StartFailure::Other(why)
        }
    };
    let short_name = node.name.split('@').next().unwrap_or_default().to_owned();
    loop {
        if let Some(status) = node.exited() {
            return Err(failed(node, format!("exited while booting ({status})")));
        }
        let logged = std::fs::read(node.log_path())
            .is_ok_and(|log| String::from_utf8_lossy(&log).contains("Server startup complete"));
        if logged {
            return Ok(());
        }
        if listening(node.mqtt)
            && epmd_names(epmd_port)
                .is_some_and(|names| names.contains(&format!("name {short_name} at")))
        {
            break;
        }
        if abort.load(Ordering::Relaxed) {
            return Err(StartFailure::Other(format!(
                "{}: not waited for, another node failed",
                node.name
            )));
        }
        if Instant::now() > deadline {
            return Err(failed(
                node,
                format!("not booted within {RABBIT_START_TIMEOUT:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = ctl_command(ctl, node, &["await_startup", "--timeout", "60"]);
    if !out.status.success() || node.exited().is_some() {
        return Err(failed(
            node,
            format!("await_startup failed: {}", describe(&out)),
        ));
    }
    Ok(())
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("RabbitMQ logs at the failure:\n{}", self.log_tail());
        }
        // SIGKILL to every beam first so they die together, then reap them; epmd last.
        for node in &self.nodes {
            if let Some(pid) = node.beam_pid() {
                sigkill(pid);
            }
            if let Some(child) = &node.child {
                sigkill(child.id());
            }
        }
        for node in &mut self.nodes {
            node.kill();
        }
        if let Some(epmd) = &mut self.epmd {
            kill_child(epmd);
        }
    }
}

// ---------------------------------------------------------------------------------------
// NATS

struct NatsNode {
    /// `n1`, `n2`, `n3`: server_name and directory.
    name: String,
    dir: PathBuf,
    http: u16,
    mqtt: u16,
    child: Option<Child>,
}

impl NatsNode {
    fn log_path(&self) -> PathBuf {
        self.dir.join("nats.log")
    }

    fn console_path(&self) -> PathBuf {
        self.dir.join("console.log")
    }

    fn tail(&self, lines: usize) -> String {
        let mut text = format!(
            "--- {} log ---\n{}",
            self.name,
            file_tail(&self.log_path(), lines)
        );
        let console = file_tail(&self.console_path(), 10);
        if !console.trim().is_empty() {
            text.push_str(&format!("\n--- {} console ---\n{console}", self.name));
        }
        text
    }

    fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    fn count_in_log(&self, needle: &str) -> usize {
        std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).matches(needle).count())
            .unwrap_or(0)
    }
}

/// Three NATS servers with JetStream and MQTT, routed to each other; everything is killed
/// when this is dropped.
pub struct NatsCluster {
    nodes: Vec<NatsNode>,
    dir: tempfile::TempDir,
    /// The address every node's MQTT listener is bound to.
    mqtt_host: IpAddr,
}

impl NatsCluster {
    /// 3 nodes with JetStream + MQTT, routes between them; the config of each node
    /// `include`s the file `authorization.conf` in the cluster's dir, whose content is
    /// `authorization` (a NATS config block, e.g. `authorization { users: [...] }`). Waits
    /// until /healthz is ok on all 3 and warms each with one MQTT connect as
    /// `warm_user`/`warm_password` (the first MQTT connect on a server creates its
    /// JetStream consumers), retrying. `None` (after one SKIPPED line) when nats-server is
    /// not installed, outside CI; panics when the cluster does not come up.
    pub fn start(authorization: &str, warm_user: &str, warm_password: &str) -> Option<Self> {
        Self::start_on(
            IpAddr::from([127, 0, 0, 1]),
            authorization,
            warm_user,
            warm_password,
        )
    }

    /// [`NatsCluster::start`] with the MQTT listeners on `mqtt_host` instead of loopback
    /// (a host address that pods reach); routes and monitoring stay on loopback.
    pub fn start_on(
        mqtt_host: IpAddr,
        authorization: &str,
        warm_user: &str,
        warm_password: &str,
    ) -> Option<Self> {
        let Some(binary) = find_binary("nats-server", &["/usr/sbin", "/usr/bin"]) else {
            return skip(
                "NATS",
                "nats-server is not on PATH nor in /usr/sbin",
                "Install it with `apt-get install nats-server`.",
            );
        };
        Some(launch_with_retries("NATS cluster", || {
            Self::launch(&binary, mqtt_host, authorization, warm_user, warm_password)
        }))
    }

    /// The MQTT listener of each node, in node order.
    pub fn mqtt_addrs(&self) -> Vec<SocketAddr> {
        self.nodes
            .iter()
            .map(|n| SocketAddr::new(self.mqtt_host, n.mqtt))
            .collect()
    }

    /// The file every node `include`s for its `authorization` block.
    pub fn authorization_path(&self) -> PathBuf {
        self.dir.path().join("authorization.conf")
    }

    /// The pids of the live nodes, in node order.
    pub fn pids(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .filter_map(|n| n.child.as_ref().map(Child::id))
            .collect()
    }

    /// The shell command that makes every node live now reload its configuration (for
    /// `--broker-config-reload`; a node killed later is skipped: kill signals the others and
    /// reports the dead one).
    pub fn reload_command(&self) -> String {
        let pids = self
            .pids()
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        format!("kill -HUP {pids}; true")
    }

    /// Rewrites authorization.conf and reloads every live node (SIGHUP, what
    /// `nats-server --signal reload=<pid>` sends); returns once each has logged the reload.
    pub fn reload_authorization(&self, authorization: &str) {
        let path = self.dir.path().join("authorization.conf");
        let partial = self.dir.path().join(".authorization.conf.new");
        write_file(&partial, authorization);
        std::fs::rename(&partial, &path)
            .unwrap_or_else(|e| panic!("replacing {}: {e}", path.display()));
        const DONE: &str = "Reloaded server configuration";
        const FAILED: &str = "Failed to reload server configuration";
        let mut waiting = Vec::new();
        for node in &self.nodes {
            let Some(child) = &node.child else { continue };
            let before = (node.count_in_log(DONE), node.count_in_log(FAILED));
            // SAFETY: kill(2) has no memory effects in this process.
            unsafe {
                libc::kill(child.id() as libc::pid_t, libc::SIGHUP);
            }
            waiting.push((node, before));
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        for (node, (done, failed)) in waiting {
            loop {
                if node.count_in_log(FAILED) > failed {
                    panic!(
                        "{} refused the new authorization:\n{authorization}\n{}",
                        node.name,
                        node.tail(TAIL_LINES)
                    );
                }
                if node.count_in_log(DONE) > done {
                    break;
                }
                if Instant::now() > deadline {
                    panic!(
                        "{} did not log {DONE:?} within 15 s of SIGHUP:\n{}",
                        node.name,
                        node.tail(TAIL_LINES)
                    );
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// The filter subject of every JetStream consumer the first live node reports: one per
    /// QoS 1 subscription of an MQTT session, connected or not (NATS keeps a session's
    /// consumers until a clean-session connect with its client id ends it).
    pub fn consumer_filters(&self) -> Vec<String> {
        let node = self
            .nodes
            .iter()
            .find(|n| n.child.is_some())
            .expect("a live NATS node");
        let answer = http_get(
            loopback(node.http),
            "/jsz?accounts=true&streams=true&consumers=true&config=true",
        )
        .unwrap_or_else(|e| panic!("{}'s /jsz: {e}", node.name));
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        let jsz: serde_json::Value = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("{}'s /jsz is not JSON ({e}): {answer}", node.name));
        let mut filters = Vec::new();
        for account in jsz["account_details"].as_array().into_iter().flatten() {
            for stream in account["stream_detail"].as_array().into_iter().flatten() {
                for consumer in stream["consumer_detail"].as_array().into_iter().flatten() {
                    filters.push(
                        consumer["config"]["filter_subject"]
                            .as_str()
                            .unwrap_or_default()
                            .to_owned(),
                    );
                }
            }
        }
        filters
    }

    /// `kill -9` of node `index` (0-based) by pid; the node stays dead.
    pub fn kill_node(&mut self, index: usize) {
        let node = self
            .nodes
            .get_mut(index)
            .unwrap_or_else(|| panic!("no NATS node {index} (there are 3, 0-based)"));
        if let Some(child) = &mut node.child {
            kill_child(child);
        }
        node.child = None;
    }

    /// The last ~40 lines of each node's log, for failure messages.
    pub fn log_tail(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.tail(TAIL_LINES))
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn launch(
        binary: &Path,
        mqtt_host: IpAddr,
        authorization: &str,
        warm_user: &str,
        warm_password: &str,
    ) -> Result<Self, StartFailure> {
        let started = Instant::now();
        let dir = temp_dir("nats-cluster-");
        let root = dir.path().to_path_buf();
        write_file(&root.join("authorization.conf"), authorization);
        // Per node: client, HTTP monitoring, route, MQTT.
        let ports = distinct_ports(4 * 3);
        let route = |i: usize| ports[4 * i + 2];
        let routes = (0..3)
            .map(|i| format!("nats-route://127.0.0.1:{}", route(i)))
            .collect::<Vec<_>>()
            .join(", ");
        let mut cluster = NatsCluster {
            nodes: Vec::new(),
            dir,
            mqtt_host,
        };
        for i in 0..3 {
            let name = format!("n{}", i + 1);
            let node_dir = root.join(&name);
            let (client, http, mqtt) = (ports[4 * i], ports[4 * i + 1], ports[4 * i + 3]);
            let js = node_dir.join("js");
            // Include paths are relative to the including file.
            write_file(
                &node_dir.join("nats.conf"),
                &format!(
                    "server_name: {name}\n\
                     listen: 127.0.0.1:{client}\n\
                     http: 127.0.0.1:{http}\n\
                     cluster {{\n  name: mqc\n  listen: 127.0.0.1:{route}\n  routes: [{routes}]\n}}\n\
                     jetstream {{\n  store_dir: \"{js}\"\n  max_memory_store: 64MB\n  max_file_store: 512MB\n}}\n\
                     mqtt {{\n  listen: \"{mqtt_listen}\"\n}}\n\
                     include \"../authorization.conf\"\n",
                    route = route(i),
                    js = js.display(),
                    mqtt_listen = SocketAddr::new(mqtt_host, mqtt),
                ),
            );
            let mut node = NatsNode {
                name,
                dir: node_dir,
                http,
                mqtt,
                child: None,
            };
            let mut cmd = Command::new(binary);
            cmd.arg("-c")
                .arg(node.dir.join("nats.conf"))
                .arg("-l")
                .arg(node.log_path())
                .current_dir(&node.dir);
            node.child = Some(spawn_logged(cmd, &node.console_path()));
            cluster.nodes.push(node);
        }

        let deadline = started + NATS_START_TIMEOUT;
        let fail = |node: &NatsNode, why: String| {
            let log = node.tail(TAIL_LINES);
            let why = format!("{}: {why}\n{log}", node.name);
            if port_taken(&log) {
                StartFailure::PortTaken(why)
            } else {
                StartFailure::Other(why)
            }
        };
        for node in &mut cluster.nodes {
            loop {
                if !node.alive() {
                    return Err(fail(node, "exited while starting".into()));
                }
                match http_get(loopback(node.http), "/healthz") {
                    Ok(answer)
                        if answer.lines().next().is_some_and(|l| l.contains(" 200 "))
                            && answer.contains("ok") =>
                    {
                        break
                    }
                    answer => {
                        if Instant::now() > deadline {
                            return Err(fail(
                                node,
                                format!(
                                    "/healthz not ok within {NATS_START_TIMEOUT:?}: {answer:?}"
                                ),
                            ));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        let healthy_in = started.elapsed();

        for (i, node) in cluster.nodes.iter_mut().enumerate() {
            let mut attempt = 0;
            loop {
                attempt += 1;
                let id = format!("warm-{}-{attempt}-{}", node.name, std::process::id());
                let result = mqtt_connack(
                    SocketAddr::new(mqtt_host, node.mqtt),
                    &id,
                    warm_user,
                    warm_password,
                    Duration::from_secs(10),
                );
                if result == Ok(0) {
                    break;
                }
                if !node.alive() {
                    return Err(fail(node, "exited during the MQTT warm-up".into()));
                }
                if Instant::now() > deadline {
                    return Err(fail(
                        node,
                        format!(
                            "MQTT warm-up connect as {warm_user:?} to node {} failed for \
                             {NATS_START_TIMEOUT:?}, last: {result:?} (CONNACK 5 = not authorised)",
                            i + 1
                        ),
                    ));
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        }
        eprintln!(
            "NATS cluster up in {:.1} s (healthy in {:.1} s), MQTT on {:?}, files in {}",
            started.elapsed().as_secs_f64(),
            healthy_in.as_secs_f64(),
            cluster.mqtt_addrs(),
            cluster.dir.path().display()
        );
        Ok(cluster)
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("NATS logs at the failure:\n{}", self.log_tail());
        }
        for node in &self.nodes {
            if let Some(child) = &node.child {
                sigkill(child.id());
            }
        }
        for node in &mut self.nodes {
            if let Some(child) = &mut node.child {
                kill_child(child);
            }
        }
    }
}

/// A plain HTTP/1.0 GET; the whole answer (status line, headers, body).
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer)?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}
