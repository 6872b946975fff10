//! `propeller logs task/NAME`: what a task printed, as its agents sent it.

use std::io::Write as _;

use anyhow::Context;
use clap::Args;
use propeller_broker::protocol::parse_setting_duration;
use serde_json::Value;

use super::standalone::ClientArgs;

/// What `propeller logs` is asked.
#[derive(Args, Debug)]
pub struct LogsArgs {
    /// `task/NAME` (or the task's name alone).
    pub what: String,
    /// Namespace.
    #[arg(short = 'n', long, default_value = "default")]
    pub namespace: String,
    /// Keep printing lines as they arrive, until the task has finished.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Only the last N lines kept.
    #[arg(long)]
    pub tail: Option<usize>,
    /// Only lines newer than this (`30s`, `5m`, `2h`).
    #[arg(long)]
    pub since: Option<String>,
    /// Only the lines of this proplet (a broadcast task runs on several).
    #[arg(long)]
    pub proplet: Option<String>,
    /// Prefix each line with the proplet that printed it (always, for a broadcast task).
    #[arg(long)]
    pub prefix: bool,
    #[command(flatten)]
    pub client: ClientArgs,
}

/// Prints the lines, following them with `-f`.
pub async fn run(args: &LogsArgs) -> anyhow::Result<()> {
    let name = match args.what.split_once('/') {
        Some((kind, name)) if kind.eq_ignore_ascii_case("task") || kind == "tasks" => name,
        Some((kind, _)) => {
            anyhow::bail!("`propeller logs` reads tasks' output: write task/NAME, not {kind}/…")
        }
        None => args.what.as_str(),
    };
    let api = args.client.client()?;
    let task = api
        .request(
            "GET",
            &format!("/v1/objects/task/{}/{name}", args.namespace),
            None,
        )
        .await
        .with_context(|| format!("reading task {}/{name}", args.namespace))?;
    let prefix = args.prefix || task["spec"]["broadcast"].as_bool().unwrap_or(false);
    let mut path = format!("/v1/logs/{}/{name}?follow={}", args.namespace, args.follow);
    if let Some(tail) = args.tail {
        path.push_str(&format!("&tailLines={tail}"));
    }
    if let Some(since) = &args.since {
        let since = parse_setting_duration(since)
            .map_err(|e| anyhow::anyhow!("--since {since:?}: {e}; write a duration such as 5m"))?;
        path.push_str(&format!("&sinceSeconds={}", since.as_secs().max(1)));
    }
    if let Some(proplet) = &args.proplet {
        path.push_str(&format!("&proplet={proplet}"));
    }
    let mut lines = api.stream(&path).await?;
    let mut stdout = std::io::stdout();
    while let Some(line) = lines.next_line().await? {
        let line: Value = serde_json::from_str(&line)
            .with_context(|| format!("a log line is not JSON: {line}"))?;
        writeln!(stdout, "{}", render(&line, prefix)).context("writing to stdout")?;
        stdout.flush().context("writing to stdout")?;
    }
    Ok(())
}

/// One line as printed: its text, after `[proplet]` when prefixed; the agent's own notes
/// (lines dropped at a limit) in brackets.
fn render(line: &Value, prefix: bool) -> String {
    let text = line["text"].as_str().unwrap_or_default();
    let text = if line["stream"] == "agent" {
        format!("[agent: {text}]")
    } else {
        text.to_owned()
    };
    match line["proplet"].as_str() {
        Some(proplet) if prefix && !proplet.is_empty() => format!("[{proplet}] {text}"),
        _ => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_prefixed_when_asked_and_notes_are_marked() {
        let line = serde_json::json!({"proplet": "pi-1", "stream": "stdout", "text": "hi"});
        assert_eq!(render(&line, false), "hi");
        assert_eq!(render(&line, true), "[pi-1] hi");
        let note =
            serde_json::json!({"proplet": "pi-1", "stream": "agent", "text": "3 lines dropped"});
        assert_eq!(render(&note, false), "[agent: 3 lines dropped]");
    }
}
