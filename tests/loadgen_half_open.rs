//! `propeller-loadgen half-open`: many sockets that open and then stall, of mixed kinds, while
//! real devices keep connecting and publishing. Measures from the client side when the broker
//! closes each stalled socket, and how long real devices wait for their CONNACK.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use super::percentile;

/// Stalled sockets and real devices against one broker.
#[derive(clap::Args, Debug)]
pub struct HalfOpenArgs {
    /// Broker port on 127.0.0.1.
    #[arg(long)]
    port: u16,
    /// Stalled sockets to open in total.
    #[arg(long, default_value_t = 10_000)]
    idle: usize,
    /// Stalled sockets being opened at once.
    #[arg(long, default_value_t = 500)]
    open_concurrency: usize,
    /// Real devices: device `i` logs in as `{prefix}-{i}` with password `{prefix}-{i}-key`.
    #[arg(long, default_value_t = 20)]
    devices: usize,
    /// Client id prefix of the real devices.
    #[arg(long, default_value = "real")]
    prefix: String,
    /// Domain id of the devices' channel.
    #[arg(long, default_value = "d")]
    domain: String,
    /// Channel id of the devices' channel.
    #[arg(long, default_value = "c")]
    channel: String,
    /// Pause of a device between one session and the next, in milliseconds.
    #[arg(long, default_value_t = 200)]
    device_pause_ms: u64,
    /// A device that has not got a CONNACK after retrying this long counts as locked out.
    #[arg(long, default_value_t = 15)]
    give_up_secs: u64,
    /// A stalled socket the broker has not closed after this long counts as left open.
    #[arg(long, default_value_t = 30)]
    close_wait_secs: u64,
}

/// What a stalled socket sends before going silent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Nothing at all after the TCP connect.
    Silent,
    /// The first half of a valid CONNECT.
    HalfConnect,
    /// A whole CONNECT with a wrong password.
    BadKeyConnect,
    /// A TLS ClientHello (the listener speaks plain MQTT).
    TlsHello,
    /// Half a websocket upgrade request.
    HalfUpgrade,
}

const KINDS: [Kind; 5] = [
    Kind::Silent,
    Kind::HalfConnect,
    Kind::BadKeyConnect,
    Kind::TlsHello,
    Kind::HalfUpgrade,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Silent => "silent",
            Kind::HalfConnect => "half_connect",
            Kind::BadKeyConnect => "bad_key_connect",
            Kind::TlsHello => "tls_client_hello",
            Kind::HalfUpgrade => "half_websocket_upgrade",
        }
    }
}

/// How one stalled socket ended, seen from the client.
enum Outcome {
    /// The TCP connect itself failed.
    ConnectFailed,
    /// The broker closed it this long after the first bytes.
    Closed(Duration),
    /// Still open after `--close-wait-secs`.
    LeftOpen,
}

fn mqtt_connect(client_id: &str, password: &str) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0b1100_0010, 0, 60];
    for field in [client_id, client_id, password] {
        body.extend_from_slice(&(field.len() as u16).to_be_bytes());
        body.extend_from_slice(field.as_bytes());
    }
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend_from_slice(&body);
    packet
}

fn client_hello() -> anyhow::Result<Vec<u8>> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name = rustls::pki_types::ServerName::try_from("localhost")?;
    let mut client = rustls::ClientConnection::new(Arc::new(config), name)?;
    let mut hello = Vec::new();
    while client.wants_write() {
        client.write_tls(&mut hello)?;
    }
    Ok(hello)
}

/// Connects (holding `permit` only for the connect), sends `first`, then waits for the
/// broker to close the socket.
async fn stalled_socket(
    addr: SocketAddr,
    first: Arc<Vec<u8>>,
    close_wait: Duration,
    permit: tokio::sync::OwnedSemaphorePermit,
    open_now: Arc<AtomicU64>,
    peak_open: Arc<AtomicU64>,
) -> Outcome {
    let connected = tokio::time::timeout(close_wait, TcpStream::connect(addr)).await;
    drop(permit);
    let Ok(Ok(socket)) = connected else {
        return Outcome::ConnectFailed;
    };
    let now = open_now.fetch_add(1, Ordering::Relaxed) + 1;
    peak_open.fetch_max(now, Ordering::Relaxed);
    let outcome = hold(socket, &first, close_wait).await;
    open_now.fetch_sub(1, Ordering::Relaxed);
    outcome
}

async fn hold(mut socket: TcpStream, first: &[u8], close_wait: Duration) -> Outcome {
    let started = Instant::now();
    if !first.is_empty() && socket.write_all(first).await.is_err() {
        return Outcome::Closed(started.elapsed());
    }
    let mut buffer = [0u8; 512];
    loop {
        let left = close_wait.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, socket.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Outcome::Closed(started.elapsed()),
            Ok(Ok(_)) => {}
            Err(_) => return Outcome::LeftOpen,
        }
    }
}

/// Connect latencies (µs) of one device's sessions, and whether it was ever locked out.
struct DeviceReport {
    latencies_us: Vec<u64>,
    refused_attempts: u64,
    locked_out: bool,
    published: u64,
}

async fn real_device(args: Arc<HalfOpenArgs>, i: usize, stop: Arc<AtomicBool>) -> DeviceReport {
    let id = format!("{}-{i}", args.prefix);
    let topic = format!("m/{}/c/{}/control/proplet/alive", args.domain, args.channel);
    let beat = json!({"proplet_id": id, "status": "alive", "namespace": "default"}).to_string();
    let mut report = DeviceReport {
        latencies_us: Vec::new(),
        refused_attempts: 0,
        locked_out: false,
        published: 0,
    };
    while !stop.load(Ordering::Relaxed) {
        let first_try = Instant::now();
        // Retry until a CONNACK, like a device would, for at most --give-up-secs.
        let session = loop {
            let mut options = MqttOptions::new(&id, "127.0.0.1", args.port);
            options.set_credentials(&id, format!("{id}-key"));
            options.set_keep_alive(Duration::from_secs(30));
            let (client, mut eventloop) = AsyncClient::new(options, 8);
            eventloop.network_options.set_connection_timeout(10);
            let attempt = Instant::now();
            let acked = loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                        break ack.code == rumqttc::ConnectReturnCode::Success
                    }
                    Ok(_) => {}
                    Err(_) => break false,
                }
            };
            if acked {
                report
                    .latencies_us
                    .push(attempt.elapsed().as_micros() as u64);
                break Some((client, eventloop));
            }
            report.refused_attempts += 1;
            if first_try.elapsed() > Duration::from_secs(args.give_up_secs) {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let Some((client, mut eventloop)) = session else {
            report.locked_out = true;
            return report;
        };
        // One heartbeat, acknowledged, then a clean disconnect.
        if client
            .publish(&topic, QoS::AtLeastOnce, false, beat.clone())
            .await
            .is_ok()
        {
            let acked = tokio::time::timeout(Duration::from_secs(10), async {
                loop {
                    match eventloop.poll().await {
                        Ok(Event::Incoming(Packet::PubAck(_))) => return true,
                        Ok(_) => {}
                        Err(_) => return false,
                    }
                }
            })
            .await;
            if matches!(acked, Ok(true)) {
                report.published += 1;
            }
        }
        let _ = client.disconnect().await;
        let _ = tokio::time::timeout(Duration::from_millis(500), eventloop.poll()).await;
        tokio::time::sleep(Duration::from_millis(args.device_pause_ms)).await;
    }
    report
}

/// Runs the case and prints one JSON summary line; fails if a device was locked out or a
/// stalled socket was left open.
pub async fn half_open(args: HalfOpenArgs) -> anyhow::Result<()> {
    let args = Arc::new(args);
    let addr = SocketAddr::from(([127, 0, 0, 1], args.port));
    let close_wait = Duration::from_secs(args.close_wait_secs);
    let payloads: Vec<Arc<Vec<u8>>> = {
        let connect = mqtt_connect(&format!("{}-0", args.prefix), "not-the-key");
        let good = mqtt_connect(
            &format!("{}-0", args.prefix),
            &format!("{}-0-key", args.prefix),
        );
        vec![
            Arc::new(Vec::new()),
            Arc::new(good[..good.len() / 2].to_vec()),
            Arc::new(connect),
            Arc::new(client_hello().context("building a ClientHello")?),
            Arc::new(b"GET /mqtt HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n".to_vec()),
        ]
    };

    let stop = Arc::new(AtomicBool::new(false));
    let devices: Vec<_> = (0..args.devices)
        .map(|i| tokio::spawn(real_device(args.clone(), i, stop.clone())))
        .collect();
    // Let every device in once before the stalled sockets arrive.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let started = Instant::now();
    let opening = Arc::new(Semaphore::new(args.open_concurrency.max(1)));
    let open_now = Arc::new(AtomicU64::new(0));
    let peak_open = Arc::new(AtomicU64::new(0));
    let mut stalled = Vec::with_capacity(args.idle);
    for n in 0..args.idle {
        let kind = KINDS[n % KINDS.len()];
        let first = payloads[n % KINDS.len()].clone();
        let permit = opening.clone().acquire_owned().await.context("open gate")?;
        let (open_now, peak_open) = (open_now.clone(), peak_open.clone());
        stalled.push(tokio::spawn(async move {
            let outcome =
                stalled_socket(addr, first, close_wait, permit, open_now, peak_open).await;
            (kind, outcome)
        }));
    }
    let opened_in = started.elapsed();
    let mut by_kind: Vec<(Kind, Vec<u64>, u64, u64)> =
        KINDS.iter().map(|k| (*k, Vec::new(), 0, 0)).collect();
    for task in stalled {
        let (kind, outcome) = task.await.context("stalled socket task")?;
        let Some(slot) = by_kind.iter_mut().find(|(k, ..)| *k == kind) else {
            continue;
        };
        match outcome {
            Outcome::Closed(after) => slot.1.push(after.as_millis() as u64),
            Outcome::ConnectFailed => slot.2 += 1,
            Outcome::LeftOpen => slot.3 += 1,
        }
    }
    let all_closed_in = started.elapsed();
    // Devices keep going one more second with the broker quiet again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let (mut refused, mut locked_out, mut sessions, mut published) = (0, 0, 0, 0);
    for device in devices {
        let r = device.await.context("device task")?;
        sessions += r.latencies_us.len();
        latencies.extend(r.latencies_us);
        refused += r.refused_attempts;
        published += r.published;
        locked_out += u64::from(r.locked_out);
    }
    latencies.sort_unstable();

    let mut kinds = serde_json::Map::new();
    let mut left_open = 0;
    for (kind, mut closed_ms, connect_failed, open) in by_kind {
        closed_ms.sort_unstable();
        left_open += open;
        kinds.insert(
            kind.name().into(),
            json!({
                "closed_by_broker": closed_ms.len(),
                "closed_at_once_under_1s": closed_ms.iter().filter(|&&ms| ms < 1000).count(),
                "close_ms_p50": percentile(&closed_ms, 50.0),
                "close_ms_max": closed_ms.last().copied().unwrap_or(0),
                "tcp_connect_failed": connect_failed,
                "left_open": open,
            }),
        );
    }
    println!(
        "{}",
        json!({
            "event": "half_open_done",
            "stalled_sockets": args.idle,
            "opened_in_ms": opened_in.as_millis() as u64,
            "all_closed_in_ms": all_closed_in.as_millis() as u64,
            "peak_open_client_side": peak_open.load(Ordering::Relaxed),
            "kinds": kinds,
            "devices": args.devices,
            "device_sessions": sessions,
            "device_refused_attempts": refused,
            "devices_locked_out": locked_out,
            "device_heartbeats_acked": published,
            "connack_us_p50": percentile(&latencies, 50.0),
            "connack_us_p99": percentile(&latencies, 99.0),
            "connack_us_max": latencies.last().copied().unwrap_or(0),
        })
    );
    if locked_out > 0 {
        anyhow::bail!(
            "{locked_out} real devices could not connect within {} s",
            args.give_up_secs
        );
    }
    if left_open > 0 {
        anyhow::bail!("{left_open} stalled sockets were still open after {close_wait:?}");
    }
    if sessions == 0 {
        anyhow::bail!("no real device session at all");
    }
    Ok(())
}
