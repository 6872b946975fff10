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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
use serde_json::json;
use tokio::sync::{Barrier, Semaphore};

#[path = "loadgen_half_open.rs"]
mod half_open;

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
    Heartbeats(HeartbeatArgs),
    /// One Wasm artifact pushed to a registry.
    PushModule(PushArgs),
    /// Stalled sockets of mixed kinds while real devices connect.
    HalfOpen(half_open::HalfOpenArgs),
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

/// Simulated proplets.
#[derive(clap::Args, Debug)]
struct HeartbeatArgs {
    /// Broker port on 127.0.0.1; several, comma-separated, for a cluster's nodes (proplet
    /// `i` connects to the `i`-th modulo their number).
    #[arg(long = "port", value_delimiter = ',', required = true)]
    ports: Vec<u16>,
    /// Number of proplets. Proplet `i` logs in as `{prefix}-{i}` with password
    /// `{prefix}-{i}-key`.
    #[arg(long, default_value_t = 1000)]
    proplets: usize,
    /// Client id prefix.
    #[arg(long, default_value = "hb")]
    prefix: String,
    /// Domain id of the channel.
    #[arg(long, default_value = "d")]
    domain: String,
    /// Channel id.
    #[arg(long, default_value = "c")]
    channel: String,
    /// Seconds between heartbeats of one proplet.
    #[arg(long, default_value_t = 10)]
    interval_secs: u64,
    /// Connections opened at once while connecting.
    #[arg(long, default_value_t = 200)]
    connect_concurrency: usize,
    /// Seconds after the last proplet connected at which `--silent` of them stop
    /// heartbeating (they stay connected).
    #[arg(long, default_value_t = 60)]
    silence_after_secs: u64,
    /// How many proplets go silent.
    #[arg(long, default_value_t = 0)]
    silent: usize,
    /// Seconds after the silence starts at which everything disconnects and the run ends.
    #[arg(long, default_value_t = 60)]
    run_after_silence_secs: u64,
    /// Seconds after the last proplet connected at which every connection drops at once
    /// and reconnects (0: no storm). Replaces the silence.
    #[arg(long, default_value_t = 0)]
    storm_after_secs: u64,
    /// The reconnections of a storm are spread evenly over this many milliseconds.
    #[arg(long, default_value_t = 1000)]
    storm_spread_ms: u64,
}

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
        Load::Heartbeats(args) => heartbeats(args).await,
        Load::PushModule(args) => push_module(args).await,
        Load::HalfOpen(args) => half_open::half_open(args).await,
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

/// Connects `id`, retrying a few times; returns once the CONNACK accepted it.
async fn connect_proplet(
    args: &HeartbeatArgs,
    id: &str,
    index: usize,
) -> anyhow::Result<(AsyncClient, rumqttc::EventLoop)> {
    let port = args.ports[index % args.ports.len()];
    let mut options = MqttOptions::new(id, "127.0.0.1", port);
    options.set_credentials(id, format!("{id}-key"));
    options.set_keep_alive(Duration::from_secs(60));
    let (client, mut eventloop) = AsyncClient::new(options, 16);
    // Wait out a slow CONNACK during the connect storm instead of reconnecting after
    // rumqttc's default 5 s: a client that reconnects while its first attempt is still being
    // accepted runs into rumqttd 0.20's takeover race (BENCHMARKS.md, section 4), which would
    // then be measured instead of the heartbeat load.
    eventloop.network_options.set_connection_timeout(60);
    let mut failures = 0;
    loop {
        match eventloop.poll().await {
            Ok(Event::Incoming(Packet::ConnAck(ack))) => {
                if ack.code != rumqttc::ConnectReturnCode::Success {
                    bail!("{id}: refused: {:?}", ack.code);
                }
                return Ok((client, eventloop));
            }
            Ok(_) => {}
            Err(e) => {
                failures += 1;
                if failures == 5 {
                    bail!("{id}: {e}");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Signals of one heartbeat run that every simulated proplet follows.
struct Signals {
    connected: tokio::sync::mpsc::UnboundedSender<()>,
    reconnected: tokio::sync::mpsc::UnboundedSender<()>,
    beating: tokio::sync::watch::Receiver<bool>,
    storm: tokio::sync::watch::Receiver<bool>,
    stop: tokio::sync::watch::Receiver<bool>,
}

/// One simulated proplet: connects, heartbeats every `interval` while `beating` says so,
/// keeps the connection (pings) until `stop` flips. When `storm` flips it drops the
/// connection without a DISCONNECT, waits its share of the spread, and connects again.
async fn simulated_proplet(
    args: Arc<HeartbeatArgs>,
    i: usize,
    connecting: Arc<Semaphore>,
    signals: Signals,
) -> anyhow::Result<()> {
    let id = format!("{}-{i}", args.prefix);
    let alive = propeller_broker::protocol::Channel::new(&args.domain, &args.channel)
        .map_err(|e| anyhow::anyhow!("channel: {e}"))?
        .alive();
    let beat = propeller_broker::protocol::Heartbeat {
        proplet_id: id.clone(),
        namespace: Some("default".into()),
        metadata: None,
        metrics: None,
    }
    .encode();
    let permit = connecting.acquire().await.context("connect gate")?;
    let (mut client, mut eventloop) = connect_proplet(&args, &id, i).await?;
    drop(permit);
    let _ = signals.connected.send(());
    let mut stop = signals.stop.clone();
    let mut storm = signals.storm.clone();
    let mut stormed = false;
    loop {
        let publisher = {
            let client = client.clone();
            let mut stop = stop.clone();
            let beating = signals.beating.clone();
            let alive = alive.clone();
            let beat = beat.clone();
            let interval = Duration::from_secs(args.interval_secs.max(1));
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(interval);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stop.changed() => return,
                    }
                    if *beating.borrow() {
                        let _ = client
                            .publish(&alive, QoS::AtMostOnce, false, beat.clone())
                            .await;
                    }
                }
            })
        };
        let storm_now = loop {
            tokio::select! {
                polled = eventloop.poll() => {
                    if let Err(e) = polled {
                        publisher.abort();
                        bail!("{id}: connection lost: {e}");
                    }
                }
                _ = stop.changed() => break false,
                changed = storm.changed(), if !stormed => {
                    if changed.is_ok() && *storm.borrow() {
                        break true;
                    }
                }
            }
        };
        publisher.abort();
        if !storm_now {
            break;
        }
        // The blip: the socket closes with no DISCONNECT, as when a network drops.
        stormed = true;
        drop(client);
        drop(eventloop);
        let spread = args.storm_spread_ms.max(1);
        let share = (i as u64).saturating_mul(spread) / (args.proplets.max(1) as u64);
        tokio::time::sleep(Duration::from_millis(share)).await;
        (client, eventloop) = connect_proplet(&args, &id, i).await?;
        let _ = signals.reconnected.send(());
    }
    let _ = client.disconnect().await;
    // Let the DISCONNECT go out.
    let _ = tokio::time::timeout(Duration::from_millis(200), eventloop.poll()).await;
    Ok(())
}

async fn heartbeats(args: HeartbeatArgs) -> anyhow::Result<()> {
    let args = Arc::new(args);
    if args.silent > args.proplets {
        bail!("--silent cannot exceed --proplets");
    }
    let connecting = Arc::new(Semaphore::new(args.connect_concurrency.max(1)));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (_loud_tx, loud_rx) = tokio::sync::watch::channel(true);
    let (quiet_tx, quiet_rx) = tokio::sync::watch::channel(true);
    let (storm_tx, storm_rx) = tokio::sync::watch::channel(false);
    let (reconnected_tx, mut reconnected_rx) = tokio::sync::mpsc::unbounded_channel();
    println!(
        "{}",
        json!({"event": "connecting", "proplets": args.proplets, "unix_ms": unix_ms()})
    );
    let (connected_tx, mut connected_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut proplets = tokio::task::JoinSet::new();
    for i in 0..args.proplets {
        // The first `silent` proplets are the ones that go quiet.
        let beating = if i < args.silent {
            quiet_rx.clone()
        } else {
            loud_rx.clone()
        };
        let signals = Signals {
            connected: connected_tx.clone(),
            reconnected: reconnected_tx.clone(),
            beating,
            storm: storm_rx.clone(),
            stop: stop_rx.clone(),
        };
        proplets.spawn(simulated_proplet(
            args.clone(),
            i,
            connecting.clone(),
            signals,
        ));
    }
    let all_connected = async {
        let mut count = 0;
        while count < args.proplets {
            tokio::select! {
                Some(()) = connected_rx.recv() => count += 1,
                // A proplet that ends now has failed to connect.
                Some(done) = proplets.join_next() => match done {
                    Ok(Err(e)) => return Err(e),
                    Ok(Ok(())) => bail!("a proplet ended before the run"),
                    Err(e) => bail!("proplet task: {e}"),
                },
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(600), all_connected)
        .await
        .context("the proplets did not connect within 600 s")??;
    println!("{}", json!({"event": "connected", "unix_ms": unix_ms()}));
    if args.storm_after_secs > 0 {
        tokio::time::sleep(Duration::from_secs(args.storm_after_secs)).await;
        storm_tx.send_replace(true);
        println!("{}", json!({"event": "storm", "unix_ms": unix_ms()}));
        let mut back = 0;
        let all_back = async {
            while back < args.proplets {
                tokio::select! {
                    Some(()) = reconnected_rx.recv() => back += 1,
                    Some(done) = proplets.join_next() => match done {
                        Ok(Err(e)) => return Err(e),
                        Ok(Ok(())) => bail!("a proplet ended during the storm"),
                        Err(e) => bail!("proplet task: {e}"),
                    },
                }
            }
            Ok(())
        };
        tokio::time::timeout(Duration::from_secs(600), all_back)
            .await
            .context("the proplets did not reconnect within 600 s")??;
        println!("{}", json!({"event": "reconnected", "unix_ms": unix_ms()}));
        tokio::time::sleep(Duration::from_secs(args.run_after_silence_secs)).await;
    } else {
        tokio::time::sleep(Duration::from_secs(args.silence_after_secs)).await;
        if args.silent > 0 {
            quiet_tx.send_replace(false);
            println!(
                "{}",
                json!({"event": "silenced", "count": args.silent, "unix_ms": unix_ms()})
            );
        }
        tokio::time::sleep(Duration::from_secs(args.run_after_silence_secs)).await;
    }
    stop_tx.send_replace(true);
    let mut failed = 0;
    while let Some(done) = proplets.join_next().await {
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                failed += 1;
                if failed <= 5 {
                    eprintln!("{e:#}");
                }
            }
            Err(e) => {
                failed += 1;
                eprintln!("proplet task: {e}");
            }
        }
    }
    println!(
        "{}",
        json!({"event": "done", "failed": failed, "unix_ms": unix_ms()})
    );
    if failed > 0 {
        bail!("{failed} simulated proplets failed");
    }
    Ok(())
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
