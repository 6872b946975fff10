//! `propeller-loadgen`: MQTT load for the benchmarks. Loopback only, bounded in count and
//! time; prints JSON lines.
//!
//! * `fan-in`: N publishers send M messages each to one topic; one subscriber receives them.
//!   Every payload starts with the send time (nanoseconds since the generator started), so
//!   the subscriber measures publish→receive latency on one clock. Prints throughput and
//!   latency percentiles.
//! * `heartbeats`: N simulated proplets, each a real MQTT connection with its own
//!   credential, heartbeat on their channel like the agent does; after a while some of them
//!   go silent (stay connected, stop heartbeating), so the operator's offline detection
//!   can be timed. Prints when each phase started. With `--storm-after-secs`, every
//!   connection is instead dropped at once (no DISCONNECT, as in a network blip) and comes
//!   back within `--storm-spread-ms`, heartbeating again at once.
//! * `push-module`: pushes an `add` Wasm module padded to a given size to an OCI registry as
//!   a CNCF Wasm artifact, and writes the same bytes to a file (for the HTTP comparison).
//!   Prints the manifest digest.
//! * `half-open`: many sockets of mixed kinds that open and then stall (nothing sent, half a
//!   CONNECT, a refused CONNECT, a TLS ClientHello, half a websocket upgrade) while real
//!   devices keep connecting and publishing; prints when the broker closed each kind and the
//!   devices' CONNACK latency (`loadgen_half_open.rs`).
//! * `enrol`: N devices enrol at once with one bootstrap token (the agent's own `proplet
//!   join` code, over TLS), then heartbeat with their new credentials (`loadgen_enrol.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::json;
use tokio::sync::{Barrier, Semaphore};

#[path = "loadgen_enrol.rs"]
mod enrol;
#[path = "loadgen_half_open.rs"]
mod half_open;
#[path = "loadgen_heartbeats.rs"]
mod heartbeats;

/// MQTT load generator for the benchmarks.
#[derive(Parser, Debug)]
struct Cli {
    #[command(subcommand)]
    load: Load,
}

#[derive(Subcommand, Debug)]
enum Load {
    /// Many publishers, one subscriber, one topic.
    FanIn(Args),
    /// Many simulated proplets heartbeating.
    Heartbeats(heartbeats::HeartbeatArgs),
    /// One Wasm artifact pushed to a registry.
    PushModule(PushArgs),
    /// Stalled sockets of mixed kinds while real devices connect.
    HalfOpen(half_open::HalfOpenArgs),
    /// Many devices enrolling at once with one bootstrap token.
    Enrol(enrol::EnrolArgs),
}

/// A padded `add` module for the image benchmarks.
#[derive(clap::Args, Debug)]
struct PushArgs {
    /// Registry `host:port`, spoken to over plain HTTP.
    #[arg(long)]
    registry: String,
    /// `repository:tag` in the registry.
    #[arg(long)]
    reference: String,
    /// Size of the module in bytes (a custom section pads it).
    #[arg(long)]
    size: usize,
    /// Fill byte of the padding, so modules of one size differ.
    #[arg(long, default_value_t = b'x')]
    fill: u8,
    /// Also write the module here.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

/// Fan-in load.
#[derive(clap::Args, Debug)]
struct Args {
    /// Broker port on 127.0.0.1.
    #[arg(long)]
    port: u16,
    /// Number of publishers.
    #[arg(long, default_value_t = 1)]
    publishers: usize,
    /// Messages per publisher.
    #[arg(long, default_value_t = 1000)]
    messages: usize,
    /// QoS of publishes and of the subscription (0 or 1).
    #[arg(long, default_value_t = 0)]
    qos: u8,
    /// Payload size in bytes (at least 8).
    #[arg(long, default_value_t = 200)]
    payload: usize,
    /// Client ids are `{prefix}-{i}` and `{prefix}-sub`; the password is `--key`.
    #[arg(long, default_value = "bench")]
    prefix: String,
    /// Password of every client (username = client id).
    #[arg(long, default_value = "bench-key")]
    key: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
}

const TOPIC: &str = "bench/fanin";

fn qos(level: u8) -> anyhow::Result<QoS> {
    match level {
        0 => Ok(QoS::AtMostOnce),
        1 => Ok(QoS::AtLeastOnce),
        other => bail!("QoS {other} is not benchmarked; use 0 or 1"),
    }
}

fn options(args: &Args, id: &str) -> MqttOptions {
    let mut o = MqttOptions::new(id, "127.0.0.1", args.port);
    o.set_credentials(id, &args.key);
    o.set_keep_alive(Duration::from_secs(30));
    o.set_max_packet_size(64 * 1024, 64 * 1024);
    o
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().load {
        Load::FanIn(args) => fan_in(args).await,
        Load::Heartbeats(args) => heartbeats::heartbeats(args).await,
        Load::PushModule(args) => push_module(args).await,
        Load::HalfOpen(args) => half_open::half_open(args).await,
        Load::Enrol(args) => enrol::enrol(args).await,
    }
}

/// `add(i32, i32)` with a custom section making the whole module `size` bytes or a few more.
fn padded_add(size: usize, fill: u8) -> anyhow::Result<Vec<u8>> {
    let mut module = wat::parse_str(
        r#"(module (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add))"#,
    )?;
    let name = b"padding";
    let payload = size.saturating_sub(module.len() + name.len() + 8);
    let mut section = Vec::new();
    leb128(&mut section, name.len() as u64);
    section.extend_from_slice(name);
    section.resize(section.len() + payload, fill);
    module.push(0);
    leb128(&mut module, section.len() as u64);
    module.extend_from_slice(&section);
    Ok(module)
}

fn leb128(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

async fn push_module(args: PushArgs) -> anyhow::Result<()> {
    use oci_client::client::{ClientConfig, ClientProtocol, Config, ImageLayer};
    use oci_client::manifest::OciImageManifest;
    use oci_client::secrets::RegistryAuth;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let module = padded_add(args.size, args.fill)?;
    if let Some(path) = &args.out {
        std::fs::write(path, &module).with_context(|| format!("writing {}", path.display()))?;
    }
    let reference: oci_client::Reference = format!("{}/{}", args.registry, args.reference)
        .parse()
        .context("reference")?;
    let client = oci_client::Client::new(ClientConfig {
        protocol: ClientProtocol::Http,
        ..ClientConfig::default()
    });
    let config = Config::new(
        br#"{"architecture":"wasm","os":"wasip1","layerDigests":[]}"#.to_vec(),
        "application/vnd.wasm.config.v0+json".into(),
        None,
    );
    let layers = vec![ImageLayer::new(module, "application/wasm".into(), None)];
    let manifest = OciImageManifest::build(&layers, &config, None);
    client
        .push(
            &reference,
            &layers,
            config,
            &RegistryAuth::Anonymous,
            Some(manifest),
        )
        .await
        .context("push")?;
    let (_, digest) = client
        .pull_image_manifest(&reference, &RegistryAuth::Anonymous)
        .await
        .context("reading the manifest back")?;
    println!("{digest}");
    Ok(())
}

fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

async fn fan_in(args: Args) -> anyhow::Result<()> {
    if args.payload < 8 {
        bail!("--payload must be at least 8 bytes (it carries the send time)");
    }
    let level = qos(args.qos)?;
    let clock = Instant::now();
    let expected = args.publishers * args.messages;
    let deadline = Duration::from_secs(args.timeout_secs);

    // Subscriber first, so nothing is published before it listens.
    let (sub, mut sub_loop) =
        AsyncClient::new(options(&args, &format!("{}-sub", args.prefix)), 10_000);
    sub.subscribe(TOPIC, level).await?;
    let subscribed = async {
        loop {
            match sub_loop.poll().await {
                Ok(Event::Incoming(Packet::SubAck(_))) => return Ok(()),
                Ok(Event::Incoming(Packet::ConnAck(ack)))
                    if ack.code != rumqttc::ConnectReturnCode::Success =>
                {
                    bail!("subscriber refused: {:?}", ack.code)
                }
                Ok(_) => {}
                Err(e) => bail!("subscriber: {e}"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(10), subscribed)
        .await
        .context("subscriber did not get its SUBACK in 10 s")??;
    let receiver = tokio::spawn(async move {
        let mut latencies = Vec::with_capacity(expected);
        let mut last = Duration::ZERO;
        // QoS 0 may lose messages: once they flow, stop after 3 s without any.
        while latencies.len() < expected {
            let polled = if latencies.is_empty() {
                sub_loop.poll().await
            } else {
                match tokio::time::timeout(Duration::from_secs(3), sub_loop.poll()).await {
                    Ok(polled) => polled,
                    Err(_) => break,
                }
            };
            match polled {
                Ok(Event::Incoming(Packet::Publish(p))) if p.payload.len() >= 8 => {
                    let now = clock.elapsed();
                    let mut sent = [0u8; 8];
                    sent.copy_from_slice(&p.payload[..8]);
                    let sent = u64::from_le_bytes(sent);
                    latencies.push((now.as_nanos() as u64).saturating_sub(sent));
                    last = now;
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
        (latencies, last)
    });

    // Publishers connect, wait for each other, then send as fast as the broker takes it.
    let barrier = Arc::new(Barrier::new(args.publishers + 1));
    let first_send = Arc::new(AtomicU64::new(u64::MAX));
    let mut handles = Vec::new();
    for i in 0..args.publishers {
        let (client, mut eventloop) =
            AsyncClient::new(options(&args, &format!("{}-{i}", args.prefix)), 1000);
        let barrier = barrier.clone();
        let first_send = first_send.clone();
        let (messages, payload) = (args.messages, args.payload);
        handles.push(tokio::spawn(async move {
            // Drive the connection until CONNACK; a refused or reset connect is retried
            // (rumqttc reconnects on the next poll), so one hiccup does not stall the run.
            let mut failures = 0;
            let connected = loop {
                match eventloop.poll().await {
                    Ok(Event::Incoming(Packet::ConnAck(_))) => break Ok(()),
                    Ok(_) => {}
                    Err(e) => {
                        failures += 1;
                        if failures == 5 {
                            break Err(anyhow::anyhow!("publisher {i}: {e}"));
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            };
            // Reach the barrier even on failure, so the others are not left waiting.
            barrier.wait().await;
            connected?;
            let driver = tokio::spawn(async move {
                // QoS 1: wait for every PUBACK; QoS 0: until the outgoing queue drains.
                let mut acked = 0;
                loop {
                    match eventloop.poll().await {
                        Ok(Event::Incoming(Packet::PubAck(_))) => {
                            acked += 1;
                            if acked == messages {
                                return;
                            }
                        }
                        Ok(_) => {}
                        Err(_) => return,
                    }
                }
            });
            for _ in 0..messages {
                let mut body = vec![0u8; payload];
                let now = clock.elapsed().as_nanos() as u64;
                first_send.fetch_min(now, Ordering::Relaxed);
                body[..8].copy_from_slice(&now.to_le_bytes());
                client.publish(TOPIC, level, false, body).await?;
            }
            Ok::<_, anyhow::Error>((client, driver))
        }));
    }
    tokio::time::timeout(Duration::from_secs(60), barrier.wait())
        .await
        .context("publishers did not all connect within 60 s")?;
    let mut keep = Vec::new();
    for h in handles {
        keep.push(h.await.context("publisher task")??);
    }
    let (latencies, last) = match tokio::time::timeout(deadline, receiver).await {
        Ok(done) => done.context("receiver task")?,
        Err(_) => bail!("not every message arrived within {}s", args.timeout_secs),
    };
    for (client, driver) in keep {
        driver.abort();
        let _ = client.disconnect().await;
    }
    let mut sorted = latencies.clone();
    sorted.sort_unstable();
    let start = first_send.load(Ordering::Relaxed);
    let seconds = (last.as_nanos() as u64).saturating_sub(start) as f64 / 1e9;
    let received = sorted.len();
    println!(
        "{}",
        json!({
            "publishers": args.publishers,
            "qos": args.qos,
            "payload": args.payload,
            "sent": expected,
            "received": received,
            "seconds": seconds,
            "msgs_per_s": if seconds > 0.0 { received as f64 / seconds } else { 0.0 },
            "p50_us": percentile(&sorted, 50.0) / 1000,
            "p99_us": percentile(&sorted, 99.0) / 1000,
        })
    );
    Ok(())
}
