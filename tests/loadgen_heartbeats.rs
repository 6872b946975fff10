//! `propeller-loadgen heartbeats`: simulated proplets, each a real MQTT connection with its
//! own login, heartbeating like the agent; some go silent, or all drop and reconnect at once
//! (a storm), on request. Prints its events as JSON lines.

use super::*;

/// Simulated proplets.
#[derive(clap::Args, Debug)]
pub(crate) struct HeartbeatArgs {
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
    /// Number of the first proplet: several processes share one fleet (each holds at most
    /// what the descriptor limit allows), e.g. `--first 15000 --proplets 15000`.
    #[arg(long, default_value_t = 0)]
    first: usize,
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
    /// Milliseconds between one proplet's task-log batches, each one line for every task
    /// propeller started on it (0: no logs): a Task pinned to each proplet makes a fleet of
    /// devices printing a line per interval, as real agents send it (QoS 1).
    #[arg(long, default_value_t = 0)]
    log_every_ms: u64,
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
    let id = format!("{}-{}", args.prefix, args.first + i);
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
    let channel = propeller_broker::protocol::Channel::new(&args.domain, &args.channel)
        .map_err(|e| anyhow::anyhow!("channel: {e}"))?;
    let started: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
    let permit = connecting.acquire().await.context("connect gate")?;
    let (mut client, mut eventloop) = connect_proplet(&args, &id, i).await?;
    drop(permit);
    if args.log_every_ms > 0 {
        client
            .subscribe(channel.start(), QoS::AtLeastOnce)
            .await
            .context("subscribe to starts")?;
    }
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
            let logger = (args.log_every_ms > 0).then(|| {
                print_lines(
                    client.clone(),
                    channel.logs(),
                    id.clone(),
                    started.clone(),
                    Duration::from_millis(args.log_every_ms),
                )
            });
            tokio::spawn(async move {
                let _logger = logger.map(AbortOnDrop);
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
                polled = eventloop.poll() => match polled {
                    Err(e) => {
                        publisher.abort();
                        bail!("{id}: connection lost: {e}");
                    }
                    Ok(Event::Incoming(Packet::Publish(publish))) => {
                        let start = propeller_broker::protocol::decode(
                            &propeller_broker::protocol::TopicKind::Start,
                            &publish.payload,
                        );
                        if let Ok(propeller_broker::protocol::Inbound::Start(start)) = start {
                            if start.proplet_id.as_deref() == Some(id.as_str()) {
                                started.lock().unwrap_or_else(|e| e.into_inner()).push(start.id);
                            }
                        }
                    }
                    Ok(_) => {}
                },
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

pub(crate) async fn heartbeats(args: HeartbeatArgs) -> anyhow::Result<()> {
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

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Publishes, every `every`, one log line for each task in `started`, as proplet `id`.
fn print_lines(
    client: AsyncClient,
    topic: String,
    id: String,
    started: Arc<std::sync::Mutex<Vec<String>>>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut n = 0u64;
        loop {
            tick.tick().await;
            let tasks = started.lock().unwrap_or_else(|e| e.into_inner()).clone();
            for task_id in tasks {
                n += 1;
                let batch = propeller_broker::protocol::TaskLogs {
                    task_id,
                    proplet_id: id.clone(),
                    lines: vec![propeller_broker::protocol::LogLine {
                        at_ms: chrono::Utc::now().timestamp_millis(),
                        stream: propeller_broker::protocol::LogStream::Stdout,
                        text: format!("line {n} from {id}: the device is fine"),
                    }],
                };
                let _ = client
                    .publish(&topic, QoS::AtLeastOnce, false, batch.encode())
                    .await;
            }
        }
    })
}
