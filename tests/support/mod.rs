//! Helpers for tests that run the workspace's binaries as real processes.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub mod browser;
pub mod chart;
pub mod cluster_cases;
pub mod enrol;
pub mod envtest;
pub mod external;
pub mod fault_proxy;
pub mod httpbin;
pub mod image;
pub mod kbs;
pub mod knode;
pub mod kube;
pub mod kueue;
pub mod mqtt_cluster;
pub mod registry;
pub mod standalone;
pub use envtest::pdeathsig;

/// Upper bound on every wait.
pub const WAIT: Duration = Duration::from_secs(20);

/// A command for one of the workspace's binaries (`propeller`, `proplet`).
pub fn binary(name: &str) -> Command {
    // scripts/test.sh builds the binaries before running the tests. Cargo builds binaries
    // only for integration tests of the package that defines them, so locate them next to
    // the test executable.
    let mut dir = std::env::current_exe().expect("test executable path");
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    let bin = dir.join(name);
    assert!(
        bin.exists(),
        "{} missing: run the tests through scripts/test.sh, which builds the binaries first",
        bin.display()
    );
    Command::new(bin)
}

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shell blocks (```` ```sh ````) between `<!-- NAME:begin -->` and `<!-- NAME:end -->`,
/// in order, each as its text, from the one file that has the begin marker: a page of the
/// book (every `*.md` under `docs/src`, sorted by path) or `README.md`.
pub fn doc_blocks(name: &str) -> Vec<String> {
    let root = repo_root();
    let begin = format!("<!-- {name}:begin -->");
    let end = format!("<!-- {name}:end -->");
    let mut files = Vec::new();
    markdown_files(&root.join("docs/src"), &mut files);
    files.sort();
    files.push(root.join("README.md"));
    let mut holders: Vec<(String, String)> = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).expect("a page of the book");
        let shown = path
            .strip_prefix(&root)
            .unwrap_or(&path)
            .display()
            .to_string();
        for _ in text.matches(&begin) {
            holders.push((shown.clone(), text.clone()));
        }
    }
    let (file, text) = match holders.len() {
        1 => holders.remove(0),
        0 => panic!("no file under docs/src nor README.md has {begin}"),
        _ => panic!(
            "{begin} is there {} times, it must be once: {}",
            holders.len(),
            holders
                .iter()
                .map(|(file, _)| file.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let start = text.find(&begin).expect("the begin marker found above");
    let stop = text[start..]
        .find(&end)
        .unwrap_or_else(|| panic!("{file} has {begin} but no {end} after it"));
    let mut blocks = Vec::new();
    // The block being read, and the indentation of its fence (a block in a list item).
    let mut current: Option<(String, usize)> = None;
    for line in text[start..start + stop].lines() {
        let indent = line.len() - line.trim_start().len();
        match (current.as_mut(), line.trim()) {
            (None, "```sh") => current = Some((String::new(), indent)),
            (Some(_), "```") => blocks.extend(current.take().map(|(block, _)| block)),
            (Some((block, fence)), _) => {
                block.push_str(&line[indent.min(*fence)..]);
                block.push('\n');
            }
            (None, _) => {}
        }
    }
    assert!(
        !blocks.is_empty(),
        "{file}: section {name} has no sh blocks"
    );
    blocks
}

/// Every `*.md` file under `dir`, its subdirectories included.
fn markdown_files(dir: &std::path::Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).expect("the book's directory, docs/src");
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            markdown_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "md") {
            out.push(path);
        }
    }
}

/// Keys, tokens and passwords the tests hand to processes ([`secret`]): no log line of a
/// [`Running`] process may contain one.
static SECRETS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Registers `value` as a secret no process may log; `value`.
pub fn secret(value: impl Into<String>) -> String {
    let value = value.into();
    if let Ok(mut secrets) = SECRETS.lock() {
        if !secrets.contains(&value) {
            secrets.push(value.clone());
        }
    }
    value
}

/// The registered secret `line` contains, if any.
fn leaked_secret(line: &str) -> Option<String> {
    let secrets = SECRETS.lock().ok()?;
    secrets.iter().find(|s| line.contains(s.as_str())).cloned()
}

/// A child process killed when dropped, with its output lines delivered on channels. Its
/// stderr (its log) is checked for the registered [`secret`]s: a process that logged one
/// fails its test when dropped.
pub struct Running {
    pub child: Child,
    pub stdout: mpsc::Receiver<String>,
    pub stderr: mpsc::Receiver<String>,
    leaks: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    stderr_done: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Running {
    pub fn spawn(mut cmd: Command) -> Self {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        pdeathsig(&mut cmd);
        let mut child = cmd.spawn().expect("spawn child process");
        let stdout = lines(child.stdout.take().expect("piped stdout"), None);
        let leaks = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let stderr_done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stderr = lines(
            child.stderr.take().expect("piped stderr"),
            Some((leaks.clone(), stderr_done.clone())),
        );
        Self {
            child,
            stdout,
            stderr,
            leaks,
            stderr_done,
        }
    }

    /// The log lines so far that contain a registered [`secret`] (the secret itself is not
    /// repeated: only which one, by its length and first characters).
    pub fn leaked(&self) -> Vec<String> {
        self.leaks.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// The first stdout line containing `needle`, within [`WAIT`].
    pub fn stdout_line(&self, needle: &str) -> String {
        wait_for(&self.stdout, needle, "stdout")
    }

    /// The first stderr line containing `needle`, within [`WAIT`].
    pub fn stderr_line(&self, needle: &str) -> String {
        wait_for(&self.stderr, needle, "stderr")
    }

    /// The stderr lines printed so far and not yet read.
    pub fn stderr_so_far(&self) -> Vec<String> {
        self.stderr.try_iter().collect()
    }

    /// The stdout lines printed so far and not yet read.
    pub fn stdout_so_far(&self) -> Vec<String> {
        self.stdout.try_iter().collect()
    }

    /// The first stdout line containing `needle`, within `limit`.
    pub fn stdout_line_within(&self, needle: &str, limit: Duration) -> String {
        wait_for_within(&self.stdout, needle, "stdout", limit)
    }

    /// The first stderr line containing `needle`, within `limit`.
    pub fn stderr_line_within(&self, needle: &str, limit: Duration) -> String {
        wait_for_within(&self.stderr, needle, "stderr", limit)
    }
}

impl Drop for Running {
    /// SIGTERM first, so a process that started children (the standalone demo's agent)
    /// stops them; SIGKILL if it has not exited after a few seconds. Then, unless the test
    /// is already failing, a log that showed a registered secret fails it.
    fn drop(&mut self) {
        self.stop();
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while !self.stderr_done.load(std::sync::atomic::Ordering::SeqCst)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        let leaks = self.leaked();
        if !leaks.is_empty() && !std::thread::panicking() {
            panic!("a process logged a secret:\n{}", leaks.join("\n"));
        }
    }
}

impl Running {
    fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let pid = self.child.id().to_string();
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            let deadline = std::time::Instant::now() + Duration::from_secs(3);
            while std::time::Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The lines of `stream` on a channel; with `checked`, each is also looked at for a
/// registered [`secret`] (recorded in the first part) and the second is set at its end.
type LeakCheck = (
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
);

fn lines(
    stream: impl std::io::Read + Send + 'static,
    checked: Option<LeakCheck>,
) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut receiving = true;
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if let Some((leaks, _)) = &checked {
                if let Some(found) = leaked_secret(&line) {
                    let hint: String = found.chars().take(4).collect();
                    let shown = line.replace(&found, "<SECRET>");
                    if let Ok(mut leaks) = leaks.lock() {
                        leaks.push(format!(
                            "a secret of {} characters starting {hint:?}: {shown}",
                            found.len()
                        ));
                    }
                }
            }
            // Reading goes on after the receiver is gone, so the whole log is checked.
            if receiving && tx.send(line).is_err() {
                receiving = false;
            }
        }
        if let Some((_, done)) = &checked {
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    });
    rx
}

fn wait_for(rx: &mpsc::Receiver<String>, needle: &str, what: &str) -> String {
    wait_for_within(rx, needle, what, WAIT)
}

fn wait_for_within(
    rx: &mpsc::Receiver<String>,
    needle: &str,
    what: &str,
    limit: Duration,
) -> String {
    let deadline = std::time::Instant::now() + limit;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(line) => seen.push(line),
            Err(_) => panic!(
                "no {what} line containing {needle:?} within {limit:?}; saw:\n{}",
                seen.join("\n")
            ),
        }
    }
}

/// Starts `propeller broker` on an ephemeral loopback port with `credentials` written to a
/// file in `dir`; returns the process and the port.
pub fn start_broker(dir: &std::path::Path, credentials: &str) -> (Running, String) {
    let path = dir.join("credentials.toml");
    std::fs::write(&path, credentials).expect("write credentials");
    let mut cmd = binary("propeller");
    cmd.args(["broker", "--mqtt-listen", "127.0.0.1:0", "--credentials"])
        .arg(&path)
        .env("RUST_LOG", "info");
    let broker = Running::spawn(cmd);
    let line = broker.stdout_line("mqtt listening on");
    let port = line.rsplit(':').next().expect("port").trim().to_owned();
    (broker, port)
}

/// Publishes one message with Debian's `mosquitto_pub` (username = client id); whether the
/// broker accepted the login and the message.
pub fn mosquitto_pub(port: &str, id: &str, key: &str, topic: &str, message: &str) -> bool {
    mosquitto_pub_as(port, id, id, key, topic, message)
}

/// Like [`mosquitto_pub`] with a username that may differ from the client id.
pub fn mosquitto_pub_as(
    port: &str,
    id: &str,
    user: &str,
    key: &str,
    topic: &str,
    message: &str,
) -> bool {
    let out = Command::new("mosquitto_pub")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            port,
            "-i",
            id,
            "-u",
            user,
            "-P",
            key,
        ])
        .args(["-t", topic, "-m", message, "-q", "1"])
        .output()
        .expect("run mosquitto_pub (is mosquitto-clients installed?)");
    out.status.success()
}

impl Running {
    /// Asks the process to stop with SIGTERM (so it can stop its own children) and waits up
    /// to [`WAIT`] for it to exit.
    pub fn terminate(&mut self) {
        let pid = self.child.id();
        signal_and_wait(&mut self.child, &format!("process {pid}"), "TERM", WAIT);
    }
}

/// Sends SIG`signal` (`TERM`, `INT`, ...) to `child` and waits up to `limit` for it to exit;
/// its exit status and how long that took. Panics naming `what` (after killing it) if it is
/// still running then.
pub fn signal_and_wait(
    child: &mut Child,
    what: &str,
    signal: &str,
    limit: Duration,
) -> (std::process::ExitStatus, Duration) {
    let sent = std::time::Instant::now();
    let _ = Command::new("kill")
        .args([format!("-{signal}"), child.id().to_string()])
        .status();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return (status, sent.elapsed());
        }
        if sent.elapsed() > limit {
            let _ = child.kill();
            panic!("{what} still running {limit:?} after SIG{signal}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `propeller standalone` on ephemeral loopback ports with its data in `dir`; returns the
/// process, the API address and the MQTT port.
pub fn start_standalone(dir: &std::path::Path, extra: &[&str]) -> (Running, String, String) {
    start_standalone_with(dir, extra, &[])
}

/// [`start_standalone`] with more environment (the demo's agent inherits it too). `extra` may
/// name its own `--api-listen`; with `--mqtt-broker` (an external broker, no MQTT listener)
/// the MQTT port returned is empty.
pub fn start_standalone_with(
    dir: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Running, String, String) {
    register_api_token(dir);
    let mut cmd = binary("propeller");
    cmd.arg("standalone");
    if !extra.contains(&"--api-listen") {
        cmd.args(["--api-listen", "127.0.0.1:0"]);
    }
    cmd.arg("--data-dir")
        .arg(dir)
        .args(extra)
        .envs(env.iter().copied())
        .env("RUST_LOG", "info");
    let external = extra.contains(&"--mqtt-broker");
    if !extra.contains(&"--mqtt-listen") && !external {
        cmd.args(["--mqtt-listen", "127.0.0.1:0"]);
    }
    let server = Running::spawn(cmd);
    let port = if external {
        server.stdout_line("mqtt: external broker");
        String::new()
    } else {
        let mqtt = server.stdout_line("mqtt listening on");
        mqtt.rsplit(':').next().expect("port").trim().to_owned()
    };
    let addr = api_address(&server);
    (server, addr, port)
}

/// Gives a data directory without one an API token (owner-only, as propeller writes it)
/// that is a registered [`secret`], so every log of the test is checked for it; an existing
/// token is registered as it is.
fn register_api_token(dir: &std::path::Path) {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("api-token");
    if let Ok(existing) = std::fs::read_to_string(&path) {
        secret(existing.trim());
        return;
    }
    let mut random = [0u8; 24];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut random))
        .expect("read /dev/urandom");
    let token: String = random.iter().map(|b| format!("{b:02x}")).collect();
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(token.as_bytes()))
        .expect("write the API token");
    secret(token);
}

/// The API address `propeller standalone` prints at start (`api listening on http://...`).
pub fn api_address(server: &Running) -> String {
    let api = server.stdout_line("api listening on http://");
    api.split("http://")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("api address")
        .to_owned()
}

/// Runs a `propeller` client command against the standalone API at `api` with data in `dir`;
/// returns (success, stdout, stderr).
pub fn propeller_client(api: &str, dir: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = binary("propeller")
        .args(args)
        .args(["--server", api, "--data-dir"])
        .arg(dir)
        .output()
        .expect("run propeller");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Serves `body` to every GET on 127.0.0.1 until `stop` is set or a minute passes.
pub fn serve_file(body: Vec<u8>) -> (String, std::sync::Arc<std::sync::atomic::AtomicBool>) {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    listener.set_nonblocking(true).expect("nonblocking");
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !stopped.load(Ordering::Relaxed) && std::time::Instant::now() < deadline {
            match listener.accept() {
                Ok((mut socket, _)) => {
                    let _ = socket.set_nonblocking(false);
                    let _ = socket.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                    let mut head = [0u8; 2048];
                    let _ = socket.read(&mut head);
                    let _ = write!(
                        socket,
                        "HTTP/1.1 200 OK\r\nContent-Type: application/wasm\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = socket.write_all(&body);
                }
                Err(_) => std::thread::sleep(std::time::Duration::from_millis(20)),
            }
        }
    });
    (addr, stop)
}

/// `tests/guests/http-get` built from source for `wasm32-wasip2`: a WASI 0.2 command that GETs
/// `$TARGET_URL` through `wasi:http` and prints `status N` and the body.
pub fn http_get_guest() -> Vec<u8> {
    let root = repo_root();
    let target_dir = root.join("target/guests");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = Command::new(cargo)
        .args(["build", "--quiet", "--release", "--target", "wasm32-wasip2"])
        .arg("--manifest-path")
        .arg(root.join("tests/guests/http-get/Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .status()
        .expect("run cargo");
    assert!(
        built.success(),
        "building the guest failed (rustup target add wasm32-wasip2?)"
    );
    std::fs::read(target_dir.join("wasm32-wasip2/release/http-get-guest.wasm")).expect("guest")
}

/// A WASI command printing a federated-learning update. Which one depends on the parity of
/// the size of its environment, which differs between participants whose PROPLET_ID
/// lengths differ (`a` and `bb`): one reports [1, 2] from 1 sample, the other [3, 6] from 3
/// samples. Whichever is which, FedAvg is (1·[1,2] + 3·[3,6]) / 4 = [2.5, 5].
pub fn fl_module() -> Vec<u8> {
    use base64::Engine;
    let b64 = |text: &str| base64::engine::general_purpose::STANDARD.encode(text);
    let even = format!(r#"{{"update_b64":"{}","num_samples":1}}"#, b64("[1,2]"));
    let odd = format!(r#"{{"update_b64":"{}","num_samples":3}}"#, b64("[3,6]"));
    let escape = |s: &str| s.replace('"', "\\\"");
    wat::parse_str(format!(
        r#"(module
             (import "wasi_snapshot_preview1" "environ_sizes_get" (func $sizes (param i32 i32) (result i32)))
             (import "wasi_snapshot_preview1" "fd_write" (func $write (param i32 i32 i32 i32) (result i32)))
             (memory (export "memory") 1)
             (data (i32.const 256) "{even}")
             (data (i32.const 1024) "{odd}")
             (func (export "_start")
               (drop (call $sizes (i32.const 0) (i32.const 4)))
               (if (i32.and (i32.load (i32.const 4)) (i32.const 1))
                 (then (i32.store (i32.const 16) (i32.const 1024)) (i32.store (i32.const 20) (i32.const {odd_len})))
                 (else (i32.store (i32.const 16) (i32.const 256)) (i32.store (i32.const 20) (i32.const {even_len}))))
               (drop (call $write (i32.const 1) (i32.const 16) (i32.const 1) (i32.const 24)))))"#,
        even = escape(&even),
        odd = escape(&odd),
        even_len = even.len(),
        odd_len = odd.len(),
    ))
    .expect("wat")
}

/// The add(i32, i32) module of the samples, exported as `add`, base64.
pub const ADD_WASM: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwcBA2FkZAAACgkBBwAgACABags=";

/// A module whose `nap(ms, n)` sleeps `ms` milliseconds (WASI `poll_oneoff` on the
/// monotonic clock: no CPU spent) and returns `n + 1000`; base64.
pub fn nap_module() -> String {
    use base64::Engine;
    let wasm = wat::parse_str(
        r#"(module
             (import "wasi_snapshot_preview1" "poll_oneoff"
               (func $poll (param i32 i32 i32 i32) (result i32)))
             (memory (export "memory") 1)
             (func (export "nap") (param $ms i32) (param $n i32) (result i32)
               ;; One subscription at 0: a relative timeout on the monotonic clock (id 1).
               (i64.store (i32.const 0) (i64.const 0))
               (i32.store8 (i32.const 8) (i32.const 0))
               (i32.store (i32.const 16) (i32.const 1))
               (i64.store (i32.const 24)
                 (i64.mul (i64.extend_i32_u (local.get $ms)) (i64.const 1000000)))
               (i64.store (i32.const 32) (i64.const 0))
               (i32.store16 (i32.const 40) (i32.const 0))
               (drop (call $poll (i32.const 0) (i32.const 64) (i32.const 1) (i32.const 128)))
               (i32.add (local.get $n) (i32.const 1000))))"#,
    )
    .expect("valid WAT");
    base64::engine::general_purpose::STANDARD.encode(wasm)
}

/// Task `nap-{i}` sleeping `ms` milliseconds on [`nap_module`], its result `i + 1000`.
pub fn nap_task_manifest(i: u64, ms: u64) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: Task\nmetadata:\n  name: nap-{i}\nspec:\n  name: nap-{i}\n  functionName: nap\n  file: {}\n  inputs: [{ms}, {i}]\n",
        nap_module()
    )
}

/// A module whose `print(count, gap_ms)` writes `line 0` … `line {count-1}` to stdout,
/// `gap_ms` apart, then `line {count}` to stderr, and returns `count`.
pub fn printer_module() -> String {
    use base64::Engine;
    let wasm = wat::parse_str(
        r#"(module
             (import "wasi_snapshot_preview1" "fd_write"
               (func $write (param i32 i32 i32 i32) (result i32)))
             (import "wasi_snapshot_preview1" "clock_time_get"
               (func $clock (param i32 i64 i32) (result i32)))
             (memory (export "memory") 1)
             (data (i32.const 64) "line ")
             (func $now (result i64)
               (drop (call $clock (i32.const 1) (i64.const 1) (i32.const 0)))
               (i64.load (i32.const 0)))
             (func $line (param $fd i32) (param $n i32)
               (local $tmp i32) (local $digits i32) (local $i i32)
               (local.set $tmp (local.get $n))
               (local.set $digits (i32.const 1))
               (block $done (loop $count
                 (br_if $done (i32.lt_u (local.get $tmp) (i32.const 10)))
                 (local.set $tmp (i32.div_u (local.get $tmp) (i32.const 10)))
                 (local.set $digits (i32.add (local.get $digits) (i32.const 1)))
                 (br $count)))
               (local.set $tmp (local.get $n))
               (local.set $i (local.get $digits))
               (loop $emit
                 (local.set $i (i32.sub (local.get $i) (i32.const 1)))
                 (i32.store8 (i32.add (i32.const 69) (local.get $i))
                   (i32.add (i32.const 48) (i32.rem_u (local.get $tmp) (i32.const 10))))
                 (local.set $tmp (i32.div_u (local.get $tmp) (i32.const 10)))
                 (br_if $emit (i32.gt_u (local.get $i) (i32.const 0))))
               (i32.store8 (i32.add (i32.const 69) (local.get $digits)) (i32.const 10))
               (i32.store (i32.const 16) (i32.const 64))
               (i32.store (i32.const 20) (i32.add (local.get $digits) (i32.const 6)))
               (drop (call $write (local.get $fd) (i32.const 16) (i32.const 1) (i32.const 32))))
             (func (export "print") (param $count i32) (param $gap i32) (result i32)
               (local $k i32) (local $until i64)
               (block $end (loop $each
                 (br_if $end (i32.ge_u (local.get $k) (local.get $count)))
                 (call $line (i32.const 1) (local.get $k))
                 (local.set $until (i64.add (call $now)
                   (i64.mul (i64.extend_i32_u (local.get $gap)) (i64.const 1000000))))
                 (block $waited (loop $wait
                   (br_if $waited (i64.ge_u (call $now) (local.get $until)))
                   (br $wait)))
                 (local.set $k (i32.add (local.get $k) (i32.const 1)))
                 (br $each)))
               (call $line (i32.const 2) (local.get $count))
               (local.get $count)))"#,
    )
    .expect("valid WAT");
    base64::engine::general_purpose::STANDARD.encode(wasm)
}

/// An external Proplet `name` on channel d1/c1 with the Secret holding its key
/// `<name>-secret`, as one manifest.
pub fn device_manifest(name: &str, mqtt_port: impl std::fmt::Display) -> String {
    secret(format!("{name}-secret"));
    format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}-key\nstringData:\n  key: {name}-secret\n---\n\
apiVersion: propeller.propeller.absmach.eu/v1\nkind: Proplet\nmetadata:\n  name: {name}\nspec:\n  type: external\n  external:\n    capabilities: [wasm]\n  connectionConfig:\n    mqttAddress: tcp://127.0.0.1:{mqtt_port}\n    domainId: d1\n    channelId: c1\n    clientId: {name}\n    clientKeySecretRef: {{name: {name}-key, key: key}}\n"
    )
}

/// The real `proplet` agent of [`device_manifest`]'s device `name`, heartbeating every
/// second, with its state in `state_dir`.
pub fn device_agent(
    name: &str,
    mqtt_port: impl std::fmt::Display,
    state_dir: &std::path::Path,
) -> Running {
    device_agent_with(name, mqtt_port, state_dir, &[])
}

/// [`device_agent`] with more settings in its environment.
pub fn device_agent_with(
    name: &str,
    mqtt_port: impl std::fmt::Display,
    state_dir: &std::path::Path,
    env: &[(&str, &str)],
) -> Running {
    let mut cmd = binary("proplet");
    cmd.envs(env.iter().copied());
    cmd.envs(device_agent_env(name, mqtt_port, state_dir));
    Running::spawn(cmd)
}

/// The environment of [`device_agent`]'s agent.
pub fn device_agent_env(
    name: &str,
    mqtt_port: impl std::fmt::Display,
    state_dir: &std::path::Path,
) -> Vec<(String, String)> {
    [
        (
            "PROPLET_MQTT_ADDRESS",
            format!("tcp://127.0.0.1:{mqtt_port}"),
        ),
        ("PROPLET_DOMAIN_ID", "d1".into()),
        ("PROPLET_CHANNEL_ID", "c1".into()),
        ("PROPLET_CLIENT_ID", name.into()),
        ("PROPLET_CLIENT_KEY", format!("{name}-secret")),
        ("PROPLET_STATE_DIR", state_dir.display().to_string()),
        ("PROPLET_LIVELINESS_INTERVAL", "1".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// A PropellerJob `mode` in that execution mode: `first` = add(1, 2), `second` = add(3, 4),
/// the second depending on the first in `configurable` mode.
pub fn propeller_job_manifest(mode: &str) -> String {
    let depends = if mode == "configurable" {
        "\n    dependsOn: [first]"
    } else {
        ""
    };
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: PropellerJob\nmetadata:\n  name: {mode}\nspec:\n  name: {mode}\n  executionMode: {mode}\n  tasks:\n  - name: first\n    functionName: add\n    file: {ADD_WASM}\n    inputs: [1, 2]\n  - name: second\n    functionName: add\n    file: {ADD_WASM}\n    inputs: [3, 4]{depends}\n"
    )
}

/// A FederatedJob `fl` of two FedAvg rounds over participants `a` and `bb`, whose training
/// module is served at `http_addr`.
pub fn federated_job_manifest(http_addr: &str) -> String {
    format!(
        "apiVersion: propeller.propeller.absmach.eu/v1\nkind: FederatedJob\nmetadata:\n  name: fl\nspec:\n  experimentId: fl-e2e\n  taskWasmImage: http://{http_addr}/train.wasm\n  participants:\n  - propletId: a\n  - propletId: bb\n  rounds:\n    total: 2\n  kOfN: 2\n  aggregator:\n    algorithm: fedavg\n"
    )
}

/// A directory to follow the book in, as a user's checkout: `target` links to this one's,
/// and `propeller-data` is standalone's data directory; (the directory, its path, the data
/// directory).
pub fn book_workdir() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let work = dir.path().to_owned();
    std::os::unix::fs::symlink(repo_root().join("target"), work.join("target")).expect("symlink");
    let data = work.join("propeller-data");
    std::fs::create_dir_all(&data).expect("data dir");
    (dir, work, data)
}

/// Runs the book's `script` as a user types it: bash with `set -euo pipefail`, in `work`,
/// against the standalone API at `api`, for at most a minute; its stdout, once it succeeded.
pub fn run_book_script(work: &std::path::Path, api: &str, script: &str) -> String {
    let out = Command::new("timeout")
        .args(["60", "bash", "-c", &format!("set -euo pipefail\n{script}")])
        .current_dir(work)
        .env("PROPELLER_API", api)
        .output()
        .expect("run bash");
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{printed}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    printed
}
