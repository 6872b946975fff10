//! Log set-up shared by the long-running subcommands.

use tracing_subscriber::EnvFilter;

/// Logs to stderr, filtered by `RUST_LOG` (default `info`). rumqttd logs every closed
/// connection at error level, so its logs are off unless `RUST_LOG` asks for them.
pub fn init() {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,rumqttd=off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
