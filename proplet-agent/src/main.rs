//! `proplet`: the Propeller device agent.

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::Context;
use propeller_broker::protocol::Channel;
use proplet_agent::agent::{mqtt_options, Agent};
use proplet_agent::config::{AgentCommand, Config, Flags, JoinArgs, Readiness};
use proplet_agent::{credentials, enrol};
use tracing::level_filters::LevelFilter;
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let env = match environment() {
        Ok(env) => env,
        Err(e) => {
            eprintln!("proplet: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut flags = match Flags::from_command_line() {
        Ok(flags) => flags,
        Err(e) => {
            eprintln!("proplet: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    match flags.command.take() {
        Some(AgentCommand::Configured) => return configured(&flags, &env),
        Some(AgentCommand::Join(args)) => match enrol_first(&mut flags, &env, args) {
            Ok(Next::Run) => {}
            Ok(Next::Done) => return ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("proplet: {e:#}");
                return ExitCode::FAILURE;
            }
        },
        None => {
            if let Err(e) = first_boot(&mut flags, &env) {
                eprintln!("proplet: {e:#}");
                return ExitCode::FAILURE;
            }
        }
    }
    let config = match Config::resolve(flags, &env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("proplet: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = proplet_agent::upgrade::handoff(&config.state_dir) {
        eprintln!("proplet: {e}; running this agent");
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        EnvFilter::default().add_directive(LevelFilter::from(config.log_level).into())
    });
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
        agent.clone().run(eventloop, shutdown_signal()).await;
        if let Some(binary) = agent.restart_target() {
            tracing::info!(binary = %binary.display(), "restarting into another agent");
            let error = proplet_agent::upgrade::exec_into(&binary);
            anyhow::bail!("cannot start {}: {error}", binary.display());
        }
        Ok(())
    })
}

/// The process's environment. A variable of the agent's that is not UTF-8 is an error; any
/// other such variable is left out.
fn environment() -> Result<HashMap<String, String>, String> {
    let mut env = HashMap::new();
    for (name, value) in std::env::vars_os() {
        match (name.into_string(), value.into_string()) {
            (Ok(name), Ok(value)) => {
                env.insert(name, value);
            }
            (Ok(name), Err(_)) if name.starts_with("PROPLET_") => {
                return Err(format!("{name}: not valid UTF-8"))
            }
            _ => {}
        }
    }
    Ok(env)
}

/// Where the packaged service keeps its state, and so where `join` writes by default.
const PACKAGED_STATE_DIR: &str = "/var/lib/proplet";
/// The packaged unit.
const PACKAGED_UNIT: &str = "/usr/lib/systemd/system/proplet.service";

/// What to do once enrolled.
enum Next {
    /// Run the agent in this process.
    Run,
    /// Nothing more here (the service runs it, or --no-run).
    Done,
}

/// `proplet configured`: 0 when the device can run, 1 (with the reason) when not.
fn configured(flags: &Flags, env: &HashMap<String, String>) -> ExitCode {
    match flags.readiness(env) {
        Ok(Readiness::Unconfigured) => {
            eprintln!("proplet: not configured: enrol with `proplet join --server mqtts://HOST:8883 --token TOKEN` (or set client_id and client_key in the config file)");
            ExitCode::from(1)
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("proplet: configuration error: {e}");
            ExitCode::from(1)
        }
    }
}

/// `proplet join`: enrols unless this device has credentials already, writes them, then
/// says whether to run here.
fn enrol_first(
    flags: &mut Flags,
    env: &HashMap<String, String>,
    args: JoinArgs,
) -> anyhow::Result<Next> {
    let state_dir = match args.state_dir.clone() {
        Some(dir) => dir,
        None => flags
            .chosen_state_dir(env)?
            .unwrap_or_else(|| PACKAGED_STATE_DIR.into()),
    };
    flags.settings.state_dir = Some(state_dir.clone());
    match credentials::load(&state_dir)? {
        Some(existing) => eprintln!(
            "proplet: this device is already enrolled as {} (credentials in {}); the token is not used. Remove that file to enrol again.",
            existing.client_id,
            state_dir.join(credentials::CREDENTIALS_FILE).display()
        ),
        None => {
            let request = enrol::JoinRequest {
                server: args.server.clone(),
                token: args.token.clone(),
                tls_ca_cert: args
                    .tls_ca_cert
                    .clone()
                    .or(flags.settings.tls_ca_cert.clone()),
                insecure_enrol: args.insecure_enrol,
                machine_id: args.machine_id.clone(),
                timeout: std::time::Duration::from_secs(60),
            };
            let mut credentials = tokio::runtime::Runtime::new()
                .context("starting the async runtime")?
                .block_on(enrol::join(&request))?;
            credentials.tls_ca_cert = credentials
                .tls_ca_cert
                .as_deref()
                .map(|ca| enrol::keep_ca(&state_dir, ca))
                .transpose()?;
            let path = credentials::save(&state_dir, &credentials)?;
            eprintln!(
                "proplet: enrolled as {} in namespace {} (credentials in {})",
                credentials.client_id,
                credentials.namespace,
                path.display()
            );
        }
    }
    if args.no_run {
        return Ok(Next::Done);
    }
    let packaged = std::path::Path::new(PACKAGED_UNIT).exists()
        && std::path::Path::new("/run/systemd/system").is_dir()
        && state_dir == std::path::Path::new(PACKAGED_STATE_DIR);
    if packaged && !args.foreground {
        let status = std::process::Command::new("systemctl")
            .args(["enable", "proplet.service"])
            .status()
            .and_then(|_| {
                std::process::Command::new("systemctl")
                    .args(["restart", "proplet.service"])
                    .status()
            })
            .context("starting proplet.service with systemctl")?;
        if !status.success() {
            anyhow::bail!(
                "systemctl restart proplet.service failed ({status}); see `journalctl -u proplet`"
            );
        }
        eprintln!("proplet: proplet.service started; follow it with `journalctl -u proplet -f`");
        return Ok(Next::Done);
    }
    Ok(Next::Run)
}

/// A first boot with a bootstrap token (`PROPLET_BOOTSTRAP_TOKEN` or `[bootstrap]`) and no
/// credentials: enrol, then run as usual.
fn first_boot(flags: &mut Flags, env: &HashMap<String, String>) -> anyhow::Result<()> {
    if let Readiness::Bootstrap { server, token } = flags.readiness(env)? {
        let args = JoinArgs {
            server,
            token,
            tls_ca_cert: flags.given(env)?.tls_ca_cert,
            insecure_enrol: env
                .get("PROPLET_BOOTSTRAP_INSECURE")
                .is_some_and(|v| v == "true"),
            machine_id: None,
            state_dir: None,
            foreground: true,
            no_run: false,
        };
        enrol_first(flags, env, args)?;
    }
    Ok(())
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
