//! The agent against the embedded broker on 127.0.0.1: tasks in, results out, across broker
//! and agent restarts, and across a move from one broker to another.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use propeller_broker::protocol::{
    split_into_chunks, Channel, RegistryChunk, ResultValue, StartRequest, StopRequest, TaskResult,
};
use propeller_broker::server::{
    BrokerConfig, BrokerEvent, Credential, CredentialStore, EmbeddedBroker, EventKind,
};
use proplet_agent::agent::{mqtt_options, Agent};
use proplet_agent::config::{AddressSetting, Config, Flags, Interval, Settings};
use tokio::sync::mpsc::UnboundedReceiver;

const WAIT: Duration = Duration::from_secs(30);
const ADD_B64: &str = "AGFzbQEAAAABBwFgAn9/AX8DAgEABwgBBG1haW4AAAoJAQcAIAAgAWoL";

fn channel() -> Channel {
    Channel::new("dom", "chan").unwrap_or_else(|e| panic!("{e}"))
}

struct Broker {
    broker: EmbeddedBroker,
    events: UnboundedReceiver<BrokerEvent>,
}

async fn start_broker(addr: SocketAddr) -> Broker {
    let store = CredentialStore::new();
    store.insert("proplet-1", Credential::proplet("key-1"));
    store.insert("proplet-2", Credential::proplet("key-2"));
    let config = BrokerConfig {
        tcp_listen: Some(addr),
        ..BrokerConfig::loopback()
    };
    // A restarted broker may race the old socket's release: retry the bind briefly.
    let mut last = None;
    for _ in 0..50 {
        match EmbeddedBroker::start(config.clone(), Arc::new(store.clone())).await {
            Ok(mut broker) => {
                let events = broker
                    .take_events()
                    .unwrap_or_else(|| panic!("events taken"));
                return Broker { broker, events };
            }
            Err(e) => {
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    panic!("broker did not start: {last:?}");
}

impl Broker {
    fn addr(&self) -> SocketAddr {
        self.broker
            .tcp_addr()
            .unwrap_or_else(|| panic!("no listener"))
    }

    async fn start(&self, request: &StartRequest) {
        if let Err(e) = self.broker.publisher().start(&channel(), request).await {
            panic!("{e}");
        }
    }

    /// The first event `pick` accepts, skipping others; panics after [`WAIT`].
    async fn wait_for<T>(&mut self, what: &str, pick: impl FnMut(BrokerEvent) -> Option<T>) -> T {
        self.wait_within(WAIT, what, pick).await
    }

    /// The first event `pick` accepts, skipping others; panics after `limit`.
    async fn wait_within<T>(
        &mut self,
        limit: Duration,
        what: &str,
        mut pick: impl FnMut(BrokerEvent) -> Option<T>,
    ) -> T {
        let wait = async {
            loop {
                match self.events.recv().await {
                    Some(event) => {
                        if let Some(found) = pick(event) {
                            return found;
                        }
                    }
                    None => panic!("event stream closed"),
                }
            }
        };
        tokio::time::timeout(limit, wait)
            .await
            .unwrap_or_else(|_| panic!("no {what} within {limit:?}"))
    }

    /// The next result for `task_id` and who published it.
    async fn result(&mut self, task_id: &str) -> (String, TaskResult) {
        self.wait_for(task_id, |e| match e.kind {
            EventKind::Result(r) if r.task_id == task_id => Some((e.client_id, r)),
            _ => None,
        })
        .await
    }

    async fn assert_no_result(&mut self, task_id: &str, quiet: Duration) {
        let pending = tokio::time::timeout(quiet, self.result(task_id));
        if let Ok(r) = pending.await {
            panic!("unexpected result {r:?}");
        }
    }

    /// Waits for the agent's discovery message (it is subscribed by then).
    async fn discovered(&mut self, id: &str) {
        self.wait_for("discovery", |e| {
            (e.client_id == id && matches!(e.kind, EventKind::Discovered(_))).then_some(())
        })
        .await;
        // Subscriptions are sent before discovery; give the SUBACKs a moment.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    /// Waits for a heartbeat from `id`.
    async fn heartbeat(&mut self, id: &str) {
        self.wait_for("heartbeat", |e| {
            (e.client_id == id && matches!(e.kind, EventKind::Heartbeat(_))).then_some(())
        })
        .await;
    }
}

/// Shows the agent's log with a failing test's output (`--nocapture` shows it always).
fn show_logs() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("proplet_agent=info")
        .try_init();
}

/// A loopback address nothing listens on while the returned socket lives (it holds the port
/// without listening): connecting there is refused.
fn dead_address() -> (tokio::net::TcpSocket, SocketAddr) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap_or_else(|e| panic!("{e}"));
    socket
        .bind(([127, 0, 0, 1], 0).into())
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = socket.local_addr().unwrap_or_else(|e| panic!("{e}"));
    (socket, addr)
}

fn agent_config(addr: SocketAddr, id: &str, key: &str, state: &Path) -> Config {
    agent_config_for(&format!("tcp://{addr}"), id, key, state)
}

/// The agent's configuration with `PROPLET_MQTT_ADDRESS` set to `addresses`.
fn agent_config_for(addresses: &str, id: &str, key: &str, state: &Path) -> Config {
    let flags = Flags {
        settings: Settings {
            mqtt_address: Some(AddressSetting::Text(addresses.into())),
            domain_id: Some("dom".into()),
            channel_id: Some("chan".into()),
            client_id: Some(id.into()),
            client_key: Some(key.into()),
            liveliness_interval: Some(Interval(Duration::from_secs(1))),
            state_dir: Some(state.to_owned()),
            chunk_timeout: Some(Interval(Duration::from_secs(10))),
            ..Settings::default()
        },
        ..Flags::default()
    };
    Config::resolve(flags, &Default::default()).unwrap_or_else(|e| panic!("{e}"))
}

struct RunningAgent {
    task: tokio::task::JoinHandle<()>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

fn spawn_agent(config: Config) -> RunningAgent {
    let options = mqtt_options(&config, &channel()).unwrap_or_else(|e| panic!("{e}"));
    let (client, eventloop) = rumqttc::AsyncClient::new(options, 128);
    let agent = Agent::new(config, client).unwrap_or_else(|e| panic!("{e}"));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        agent
            .run(eventloop, async {
                let _ = rx.await;
            })
            .await
    });
    RunningAgent {
        task,
        stop: Some(tx),
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task.abort();
    }
}

fn add_task(id: &str, target: Option<&str>) -> StartRequest {
    use base64::Engine as _;
    StartRequest {
        id: id.into(),
        name: "add".into(),
        file: base64::engine::general_purpose::STANDARD
            .decode(ADD_B64)
            .ok(),
        inputs: vec!["10".into(), "32".into()],
        proplet_id: target.map(str::to_owned),
        ..StartRequest::default()
    }
}

fn wat_task(id: &str, name: &str, wat_text: &str, inputs: &[&str]) -> StartRequest {
    StartRequest {
        id: id.into(),
        name: name.into(),
        file: Some(wat::parse_str(wat_text).unwrap_or_else(|e| panic!("{e}"))),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        proplet_id: Some("proplet-1".into()),
        ..StartRequest::default()
    }
}

/// Counts down from its argument: about a second per 10^9 on a desktop core.
const COUNT: &str = r#"(module (func (export "count") (param i64) (result i64)
  (loop $l (local.set 0 (i64.sub (local.get 0) (i64.const 1)))
    (br_if $l (i64.gt_s (local.get 0) (i64.const 0))))
  (i64.const 7)))"#;

/// Spins until the agent's time limit ends it: its (error) result comes that long after the
/// start, however fast the machine.
const SPIN: &str = r#"(module (func (export "spin") (loop $l (br $l))))"#;

fn timed_out(r: &TaskResult) -> bool {
    r.error.as_deref().is_some_and(|e| e.contains("time limit"))
}

fn text(r: &TaskResult) -> &str {
    match &r.results {
        ResultValue::Text(t) => t,
        ResultValue::Json(_) => "",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_returns_42_and_errors_come_back_as_results() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _agent = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    b.start(&add_task("t-add", Some("proplet-1"))).await;
    let (publisher, result) = b.result("t-add").await;
    assert_eq!(publisher, "proplet-1");
    assert_eq!((text(&result), result.error.as_deref()), ("42", None));

    b.start(&wat_task(
        "t-trap",
        "boom",
        r#"(module (func (export "boom") unreachable))"#,
        &[],
    ))
    .await;
    let (_, result) = b.result("t-trap").await;
    assert!(
        result
            .error
            .as_deref()
            .is_some_and(|e| e.contains("unreachable")),
        "{result:?}"
    );

    let mut garbage = add_task("t-bad", Some("proplet-1"));
    garbage.file = Some(b"definitely not wasm".to_vec());
    b.start(&garbage).await;
    let (_, result) = b.result("t-bad").await;
    assert!(
        result
            .error
            .as_deref()
            .is_some_and(|e| e.contains("invalid wasm")),
        "{result:?}"
    );

    let mut neither = add_task("t-empty", Some("proplet-1"));
    neither.file = None;
    b.start(&neither).await;
    let (_, result) = b.result("t-empty").await;
    assert!(result.error.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_interrupts_and_duplicates_are_ignored() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _agent = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    let spin = wat_task(
        "t-spin",
        "spin",
        r#"(module (func (export "spin") (loop $l (br $l))))"#,
        &[],
    );
    let spin = StartRequest {
        daemon: true,
        ..spin
    };
    b.start(&spin).await;
    b.start(&spin).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let stop = StopRequest {
        id: "t-spin".into(),
        proplet_id: Some("proplet-1".into()),
        ..StopRequest::default()
    };
    if let Err(e) = b.broker.publisher().stop(&channel(), &stop).await {
        panic!("{e}");
    }
    let (_, result) = b.result("t-spin").await;
    assert!(
        result.error.as_deref().is_some_and(|e| e.contains("stop")),
        "{result:?}"
    );
    // The duplicate start never ran, so no second result comes.
    b.assert_no_result("t-spin", Duration::from_millis(800))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targeting_and_broadcast() {
    let s1 = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let s2 = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _a1 = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", s1.path()));
    b.discovered("proplet-1").await;
    let _a2 = spawn_agent(agent_config(b.addr(), "proplet-2", "key-2", s2.path()));
    b.discovered("proplet-2").await;

    b.start(&add_task("t-for-2", Some("proplet-2"))).await;
    let (publisher, _) = b.result("t-for-2").await;
    assert_eq!(publisher, "proplet-2");
    b.assert_no_result("t-for-2", Duration::from_millis(500))
        .await;

    let mut broadcast = add_task("t-all", None);
    broadcast.broadcast = true;
    b.start(&broadcast).await;
    let (first, _) = b.result("t-all").await;
    let (second, _) = b.result("t-all").await;
    let mut both = [first, second];
    both.sort();
    assert_eq!(both, ["proplet-1".to_owned(), "proplet-2".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binaries_arrive_in_registry_chunks() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _agent = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    let mut task = add_task("t-oci", Some("proplet-1"));
    let binary = task.file.take().unwrap_or_default();
    task.image_url = Some("docker.io/acme/add:1.0".into());
    b.start(&task).await;
    // The agent asks for the image; serve it in 7-byte chunks.
    let request = b
        .wait_for("registry request", |e| match e.kind {
            EventKind::RegistryRequest(r) => Some(r),
            _ => None,
        })
        .await;
    assert_eq!(request.app_name, "docker.io/acme/add:1.0");
    let chunks: Vec<RegistryChunk> = split_into_chunks(&request.app_name, &binary, 7)
        .unwrap_or_else(|e| panic!("{e}"))
        .collect();
    for chunk in chunks.iter().rev() {
        if let Err(e) = b.broker.publisher().registry_chunk(&channel(), chunk).await {
            panic!("{e}");
        }
    }
    let (_, result) = b.result("t-oci").await;
    assert_eq!(text(&result), "42", "{result:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_above_the_module_limit_fails_at_its_first_chunk() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let mut config = agent_config(b.addr(), "proplet-1", "key-1", state.path());
    config.max_module_size = 1000;
    // Long enough that a failure by timeout could not pass for the size error.
    config.chunk_timeout = Duration::from_secs(600);
    let _agent = spawn_agent(config);
    b.discovered("proplet-1").await;

    let mut task = add_task("t-big", Some("proplet-1"));
    task.file = None;
    task.image_url = Some("docker.io/acme/big:1.0".into());
    b.start(&task).await;
    let request = b
        .wait_for("registry request", |e| match e.kind {
            EventKind::RegistryRequest(r) => Some(r),
            _ => None,
        })
        .await;
    // 5,000 bytes in 500-byte chunks: the first one announces at least 4,501 bytes.
    let binary = vec![0u8; 5000];
    let first = split_into_chunks(&request.app_name, &binary, 500)
        .unwrap_or_else(|e| panic!("{e}"))
        .next()
        .unwrap_or_else(|| panic!("no chunk"));
    if let Err(e) = b
        .broker
        .publisher()
        .registry_chunk(&channel(), &first)
        .await
    {
        panic!("{e}");
    }
    let (_, result) = b.result("t-big").await;
    let error = result.error.clone().unwrap_or_default();
    assert!(
        error.contains("image docker.io/acme/big:1.0 (10 chunks) is at least 4501 bytes")
            && error.contains("module size limit of 1000 bytes (PROPLET_MAX_MODULE_SIZE)"),
        "{result:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn result_survives_a_broker_restart_exactly_once() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let addr = b.addr();
    let _agent = spawn_agent(agent_config(addr, "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    b.start(&wat_task("t-long", "count", COUNT, &["1500000000"]))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(b);
    // The task finishes while the broker is down; its result waits in the spool.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut b = start_broker(addr).await;
    let (publisher, result) = b.result("t-long").await;
    assert_eq!((publisher.as_str(), text(&result)), ("proplet-1", "7"));
    b.assert_no_result("t-long", Duration::from_millis(1500))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spooled_result_survives_an_agent_restart() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let addr = b.addr();
    let agent = spawn_agent(agent_config(addr, "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    b.start(&wat_task("t-kept", "count", COUNT, &["1000000000"]))
        .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(b);
    // Wait until the result is on disk, then kill the agent.
    let spool_dir = state.path().join("spool");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let queued = proplet_agent::spool::pending_in(&spool_dir).unwrap_or(0);
        if queued == 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "result never spooled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut agent = agent;
    agent.stop = None;
    agent.task.abort();
    drop(agent);

    let mut b = start_broker(addr).await;
    let _agent = spawn_agent(agent_config(addr, "proplet-1", "key-1", state.path()));
    let (_, result) = b.result("t-kept").await;
    assert_eq!(text(&result), "7");
}

/// A one-file HTTP server on 127.0.0.1 serving `body` at `/add.wasm` (404 elsewhere).
async fn serve_http(body: Vec<u8>) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let addr = listener.local_addr().unwrap_or_else(|e| panic!("{e}"));
    let task = tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 1024];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&request);
                let response = if head.starts_with("GET /add.wasm ") {
                    let mut r = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/wasm\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    r.extend_from_slice(&body);
                    r
                } else {
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        .to_vec()
                };
                let _ = socket.write_all(&response).await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_fetch_with_digest_pin() {
    use base64::Engine as _;
    use sha2::Digest as _;
    let binary = base64::engine::general_purpose::STANDARD
        .decode(ADD_B64)
        .unwrap_or_else(|e| panic!("{e}"));
    let digest: String = sha2::Sha256::digest(&binary)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let (http, server) = serve_http(binary).await;
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _agent = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    let from_url = |id: &str, url: String| {
        let mut t = add_task(id, Some("proplet-1"));
        t.file = None;
        t.image_url = Some(url);
        t
    };
    b.start(&from_url(
        "t-http",
        format!("http://{http}/add.wasm#sha256={digest}"),
    ))
    .await;
    let (_, result) = b.result("t-http").await;
    assert_eq!(text(&result), "42", "{result:?}");

    let wrong = "0".repeat(64);
    b.start(&from_url(
        "t-pin",
        format!("http://{http}/add.wasm#sha256={wrong}"),
    ))
    .await;
    let (_, result) = b.result("t-pin").await;
    assert!(
        result
            .error
            .as_deref()
            .is_some_and(|e| e.contains("digest mismatch")),
        "{result:?}"
    );

    b.start(&from_url("t-404", format!("http://{http}/missing.wasm")))
        .await;
    let (_, result) = b.result("t-404").await;
    assert!(
        result.error.as_deref().is_some_and(|e| e.contains("404")),
        "{result:?}"
    );
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn task_metrics_describe_the_task_itself() {
    use propeller_broker::protocol::MonitoringProfile;
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _agent = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", state.path()));
    b.discovered("proplet-1").await;

    let mut task = wat_task(
        "t-metrics",
        "spin",
        r#"(module (memory 3) (func (export "spin") (loop $l (br $l))))"#,
        &[],
    );
    task.daemon = true;
    task.monitoring_profile = Some(MonitoringProfile {
        interval_secs: 1,
        ..MonitoringProfile::standard()
    });
    b.start(&task).await;
    // The second sample has a CPU figure (it needs two readings of the thread's CPU time).
    let mut samples = Vec::new();
    while samples.len() < 2 {
        let sample = b
            .wait_for("task metrics", |e| match e.kind {
                EventKind::TaskMetrics(m) if m.task_id == "t-metrics" => Some(m),
                _ => None,
            })
            .await;
        samples.push(sample);
    }
    let last = &samples[1].metrics;
    assert_eq!(last.memory_bytes, Some(3 * 65536), "{last:?}");
    assert!(last.uptime_seconds.is_some_and(|u| u >= 1), "{last:?}");
    // A spinning guest keeps its thread busy: well above idle.
    assert!(last.cpu_percent.is_some_and(|c| c > 30.0), "{last:?}");
    assert_eq!(
        samples[1].aggregated.as_ref().and_then(|a| a.sample_count),
        Some(2)
    );

    let stop = StopRequest {
        id: "t-metrics".into(),
        proplet_id: Some("proplet-1".into()),
        ..StopRequest::default()
    };
    if let Err(e) = b.broker.publisher().stop(&channel(), &stop).await {
        panic!("{e}");
    }
    let (_, result) = b.result("t-metrics").await;
    assert!(result.error.is_some());
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n");
    socket
        .write_all(request.as_bytes())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut response = String::new();
    socket
        .read_to_string(&mut response)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    response
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics_endpoint() {
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let mut flags_config = agent_config(b.addr(), "proplet-1", "key-1", state.path());
    flags_config.telemetry = Some(([127, 0, 0, 1], 0).into());
    let options = mqtt_options(&flags_config, &channel()).unwrap_or_else(|e| panic!("{e}"));
    let (client, eventloop) = rumqttc::AsyncClient::new(options, 128);
    let agent = Agent::new(flags_config, client).unwrap_or_else(|e| panic!("{e}"));
    let addr = match agent.serve_telemetry().await {
        Ok(Some(a)) => a,
        other => panic!("endpoint not started: {other:?}"),
    };
    // Not connected yet: alive but not ready.
    assert!(http_get(addr, "/health").await.starts_with("HTTP/1.1 200"));
    assert!(http_get(addr, "/ready").await.starts_with("HTTP/1.1 503"));

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(agent.run(eventloop, async {
        let _ = stop_rx.await;
    }));
    b.discovered("proplet-1").await;
    assert!(http_get(addr, "/ready").await.starts_with("HTTP/1.1 200"));
    b.start(&add_task("t-count", Some("proplet-1"))).await;
    let _ = b.result("t-count").await;
    let metrics = http_get(addr, "/metrics").await;
    for line in [
        "proplet_tasks_started_total 1",
        "proplet_tasks_succeeded_total 1",
        "proplet_tasks_running 0",
        "proplet_mqtt_connected 1",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in:\n{metrics}");
    }
    assert!(http_get(addr, "/other").await.starts_with("HTTP/1.1 404"));
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(WAIT, task).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latent_tasks_answer_invocations() {
    use propeller_broker::protocol::InvokeRequest;
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let _agent = spawn_agent(agent_config(b.addr(), "proplet-1", "key-1", state.path()));
    // Discovery carries the address used to reach the broker.
    let ip = b
        .wait_for("discovery", |e| match e.kind {
            EventKind::Discovered(d) => Some(d.metadata.and_then(|m| m.ip)),
            _ => None,
        })
        .await;
    assert_eq!(ip.as_deref(), Some("127.0.0.1"));
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut latent = add_task("t-latent", Some("proplet-1"));
    latent.latent = true;
    b.start(&latent).await;
    // Deploying a latent task publishes nothing; give it a moment to compile.
    b.assert_no_result("t-latent", Duration::from_millis(500))
        .await;
    let invoke = |invocation: &str, inputs: &[&str]| InvokeRequest {
        id: "t-latent".into(),
        proplet_id: Some("proplet-1".into()),
        invocation_id: Some(invocation.into()),
        inputs: inputs.iter().map(|s| s.to_string()).collect(),
        ..InvokeRequest::default()
    };
    for (id, inputs, expected) in [("inv-1", vec!["1", "2"], "3"), ("inv-2", vec![], "42")] {
        if let Err(e) = b
            .broker
            .publisher()
            .invoke(&channel(), &invoke(id, &inputs))
            .await
        {
            panic!("{e}");
        }
        let reply = b
            .wait_for("invoke result", |e| match e.kind {
                EventKind::InvokeResult(r) if r.invocation_id == id => Some(r),
                _ => None,
            })
            .await;
        assert_eq!(
            reply.results,
            ResultValue::Text(expected.into()),
            "{reply:?}"
        );
        assert_eq!(reply.error, None);
    }
    let mut unknown = invoke("inv-3", &[]);
    unknown.id = "nope".into();
    if let Err(e) = b.broker.publisher().invoke(&channel(), &unknown).await {
        panic!("{e}");
    }
    let reply = b
        .wait_for("invoke result", |e| match e.kind {
            EventKind::InvokeResult(r) if r.invocation_id == "inv-3" => Some(r),
            _ => None,
        })
        .await;
    assert!(reply.error.is_some_and(|e| e.contains("not deployed")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_first_broker_is_skipped_for_the_next() {
    show_logs();
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (_hold, dead) = dead_address();
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let config = agent_config_for(
        &format!("tcp://{dead}, tcp://{}", b.addr()),
        "proplet-1",
        "key-1",
        state.path(),
    );
    assert_eq!(config.brokers.len(), 2);
    let _agent = spawn_agent(config);
    b.discovered("proplet-1").await;
    b.heartbeat("proplet-1").await;

    b.start(&add_task("t-on-b", Some("proplet-1"))).await;
    let (publisher, result) = b.result("t-on-b").await;
    assert_eq!((publisher.as_str(), text(&result)), ("proplet-1", "42"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_its_broker_stops_the_agent_moves_to_the_other_and_back() {
    show_logs();
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut a = start_broker(([127, 0, 0, 1], 0).into()).await;
    let mut b = start_broker(([127, 0, 0, 1], 0).into()).await;
    let a_addr = a.addr();
    let mut config = agent_config_for(
        &format!("tcp://{a_addr},tcp://{}", b.addr()),
        "proplet-1",
        "key-1",
        state.path(),
    );
    config.task_timeout = Duration::from_secs(3);
    let _agent = spawn_agent(config);
    a.discovered("proplet-1").await;

    // A task started through A finishes after A is gone: its result reaches B, once.
    a.start(&wat_task("t-moved", "spin", SPIN, &[])).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(a);
    // (The result may come before or after the agent's discovery on B: wait for it first.)
    let (publisher, result) = b.result("t-moved").await;
    assert_eq!(publisher, "proplet-1");
    assert!(timed_out(&result), "{result:?}");
    b.assert_no_result("t-moved", Duration::from_millis(1500))
        .await;
    b.heartbeat("proplet-1").await;

    // Round-robin: with A back on its address, B stopping sends the agent to A again, and it
    // takes tasks there (so it subscribed again).
    let mut a = start_broker(a_addr).await;
    drop(b);
    a.discovered("proplet-1").await;
    a.heartbeat("proplet-1").await;
    a.start(&add_task("t-back-on-a", Some("proplet-1"))).await;
    let (_, result) = a.result("t-back-on-a").await;
    assert_eq!(text(&result), "42");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_spooled_while_no_broker_answers_goes_to_the_next_one_once() {
    show_logs();
    let state = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let mut a = start_broker(([127, 0, 0, 1], 0).into()).await;
    let (hold, b_addr) = dead_address();
    let mut config = agent_config_for(
        &format!("tcp://{},tcp://{b_addr}", a.addr()),
        "proplet-1",
        "key-1",
        state.path(),
    );
    config.task_timeout = Duration::from_secs(2);
    let _agent = spawn_agent(config);
    a.discovered("proplet-1").await;

    a.start(&wat_task("t-spooled", "spin", SPIN, &[])).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(a);
    // Neither broker answers: the result waits in the spool.
    let spool_dir = state.path().join("spool");
    let deadline = tokio::time::Instant::now() + WAIT;
    while proplet_agent::spool::pending_in(&spool_dir).unwrap_or(0) != 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "result never spooled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(hold);
    let mut b = start_broker(b_addr).await;
    // The agent alternates between the two addresses with a growing backoff (1 s, 2 s, 4 s,
    // ... ± 20 %) since A stopped: B is reached at the latest after the 16 s wait.
    let (publisher, result) = b
        .wait_within(Duration::from_secs(90), "t-spooled", |e| match e.kind {
            EventKind::Result(r) if r.task_id == "t-spooled" => Some((e.client_id, r)),
            _ => None,
        })
        .await;
    assert_eq!(publisher, "proplet-1");
    assert!(timed_out(&result), "{result:?}");
    b.assert_no_result("t-spooled", Duration::from_millis(1500))
        .await;
    b.heartbeat("proplet-1").await;
    assert_eq!(proplet_agent::spool::pending_in(&spool_dir).unwrap_or(1), 0);
}
