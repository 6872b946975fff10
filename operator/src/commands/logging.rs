//! Log set-up shared by the long-running subcommands.

use tracing_subscriber::EnvFilter;

/// Log line format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Logs to stderr as text, filtered by `RUST_LOG` (default `info`).
pub fn init() {
    init_with(LogFormat::Text);
}

/// Logs to stderr in `format`, filtered by `RUST_LOG` (default `info`). rumqttd logs every
/// closed connection at error level, so its logs are off unless `RUST_LOG` asks for them.
/// Colours only on a terminal: a log file or a collector gets plain text.
pub fn init_with(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,rumqttd=off"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Logs as text to the file at `path` (appended), filtered like [`init`]: the demo keeps its
/// terminal for what it tells the user.
pub fn init_to_file(path: &std::path::Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening the log file {}", path.display()))?;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,rumqttd=off"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::sync::Mutex::new(file))
        .try_init();
    Ok(())
}
