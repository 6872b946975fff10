//! `propeller-loadgen enrol`: N simulated devices enrol at once with one bootstrap token,
//! each through the agent's own `proplet join` code over TLS, then connect with the
//! credentials they got and heartbeat like the agent until the run ends. Prints one JSON
//! line with the enrolment times.

use super::*;
use proplet_agent::config::TlsFiles;
use proplet_agent::credentials::Credentials;
use proplet_agent::enrol::{join, JoinRequest};

/// Simulated enrolling devices.
#[derive(clap::Args, Debug)]
pub(crate) struct EnrolArgs {
    /// The broker's TLS port on 127.0.0.1.
    #[arg(long)]
    port: u16,
    /// The CA that signed the broker's certificate.
    #[arg(long)]
    ca: std::path::PathBuf,
    /// The bootstrap token.
    #[arg(long)]
    token: String,
    /// Number of devices; device `i` reports machine id `{prefix}-{i}`.
    #[arg(long, default_value_t = 1000)]
    devices: usize,
    /// Machine id prefix.
    #[arg(long, default_value = "loadgen")]
    prefix: String,
    /// Seconds between heartbeats of one device once enrolled.
    #[arg(long, default_value_t = 10)]
    interval_secs: u64,
    /// Seconds the devices keep heartbeating after the last one enrolled.
    #[arg(long, default_value_t = 30)]
    hold_secs: u64,
}

/// One device: enrols, then heartbeats as itself until `stop` flips.
async fn enrolling_device(
    args: Arc<EnrolArgs>,
    i: usize,
    clock: Instant,
    enrolled: tokio::sync::mpsc::UnboundedSender<Result<Duration, String>>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let request = JoinRequest {
        server: format!("mqtts://127.0.0.1:{}", args.port),
        token: args.token.clone(),
        tls_ca_cert: Some(args.ca.clone()),
        insecure_enrol: false,
        machine_id: Some(format!("{}-{i}", args.prefix)),
        timeout: Duration::from_secs(300),
    };
    let credentials: Credentials = match join(&request).await {
        Ok(credentials) => credentials,
        Err(e) => {
            let _ = enrolled.send(Err(format!("{e:#}")));
            return Err(e);
        }
    };
    let _ = enrolled.send(Ok(clock.elapsed()));
    let id = credentials.client_id.clone();
    let mut options = MqttOptions::new(&id, "127.0.0.1", args.port);
    options.set_credentials(&id, &credentials.client_key);
    options.set_keep_alive(Duration::from_secs(60));
    let tls = proplet_agent::agent::tls_config(&TlsFiles {
        ca_cert: args.ca.clone(),
        client: None,
    })?;
    options.set_transport(rumqttc::Transport::tls_with_config(tls));
    let (client, mut eventloop) = AsyncClient::new(options, 16);
    eventloop.network_options.set_connection_timeout(60);
    let alive =
        propeller_broker::protocol::Channel::new(&credentials.domain_id, &credentials.channel_id)
            .map_err(|e| anyhow::anyhow!("channel: {e}"))?
            .alive();
    let beat = propeller_broker::protocol::Heartbeat {
        proplet_id: id.clone(),
        namespace: Some(credentials.namespace.clone()),
        metadata: None,
        metrics: None,
    }
    .encode();
    // Heartbeats from a task of their own: a poll of the event loop must never be cancelled
    // midway (rumqttc's poll is not cancel-safe).
    let publisher = {
        let client = client.clone();
        let interval = Duration::from_secs(args.interval_secs.max(1));
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            loop {
                tick.tick().await;
                let _ = client
                    .publish(&alive, QoS::AtMostOnce, false, beat.clone())
                    .await;
            }
        })
    };
    loop {
        tokio::select! {
            polled = eventloop.poll() => {
                if let Err(e) = polled {
                    eprintln!("{id}: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            _ = stop.changed() => break,
        }
    }
    publisher.abort();
    let _ = client.disconnect().await;
    let _ = tokio::time::timeout(Duration::from_millis(200), eventloop.poll()).await;
    Ok(())
}

pub(crate) async fn enrol(args: EnrolArgs) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Arc::new(args);
    let clock = Instant::now();
    let (enrolled_tx, mut enrolled_rx) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut devices = Vec::with_capacity(args.devices);
    for i in 0..args.devices {
        devices.push(tokio::spawn(enrolling_device(
            args.clone(),
            i,
            clock,
            enrolled_tx.clone(),
            stop_rx.clone(),
        )));
    }
    drop(enrolled_tx);
    let mut times = Vec::with_capacity(args.devices);
    let mut failed = 0usize;
    while times.len() + failed < args.devices {
        let Some(outcome) = enrolled_rx.recv().await else {
            break;
        };
        match outcome {
            Ok(at) => times.push(at),
            Err(e) => {
                failed += 1;
                eprintln!("enrolment failed: {e}");
            }
        }
    }
    let last = times.iter().max().copied().unwrap_or_default();
    println!(
        "{}",
        json!({
            "event": "enrolled",
            "devices": args.devices,
            "enrolled": times.len(),
            "failed": failed,
            "last_enrolled_s": last.as_secs_f64(),
            "p50_ms": percentile_ms(&mut times, 50.0),
            "p99_ms": percentile_ms(&mut times, 99.0),
        })
    );
    tokio::time::sleep(Duration::from_secs(args.hold_secs)).await;
    let _ = stop_tx.send(true);
    for handle in devices {
        let _ = handle.await;
    }
    Ok(())
}

fn percentile_ms(times: &mut [Duration], p: f64) -> f64 {
    if times.is_empty() {
        return 0.0;
    }
    times.sort_unstable();
    let index = ((p / 100.0) * (times.len() - 1) as f64).round() as usize;
    times[index.min(times.len() - 1)].as_secs_f64() * 1000.0
}
