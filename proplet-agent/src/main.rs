//! `proplet`: the Propeller device agent.

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::Context;
use propeller_broker::protocol::Channel;
use proplet_agent::agent::{mqtt_options, Agent};
use proplet_agent::config::{Config, Flags};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let env: HashMap<String, String> = std::env::vars().collect();
    let config = match Flags::from_command_line().and_then(|flags| Config::resolve(flags, &env)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("proplet: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(config.log_level.to_ascii_lowercase()));
    // Colours only on a terminal: logs piped to a file or a journal stay plain text.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    match run(config) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("proplet: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(config: Config) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    runtime.block_on(async move {
        let channel = Channel::new(&config.domain_id, &config.channel_id)
            .context("domain and channel ids")?;
        let options = mqtt_options(&config, &channel)?;
        let (client, eventloop) = rumqttc::AsyncClient::new(options, 128);
        tracing::info!(
            client_id = config.client_id,
            brokers = %config.brokers,
            "proplet starting"
        );
        let agent = Agent::new(config, client)?;
        if let Some(addr) = agent.serve_telemetry().await? {
            tracing::info!(%addr, "health and metrics endpoint listening");
        }
        agent.run(eventloop, shutdown_signal()).await;
        Ok(())
    })
}

/// Ctrl-C or SIGTERM (systemd and container runtimes stop services with SIGTERM).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
