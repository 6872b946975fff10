//! `propeller logs task/NAME`: what a task printed, as its agents sent it.

use std::io::Write as _;

use anyhow::Context;
use clap::Args;
use propeller_broker::protocol::parse_setting_duration;
use serde_json::Value;

use propeller_operator::standalone::client::ApiClient;

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
    /// Read from `propeller run`'s log endpoint at HOST:PORT (HTTPS) instead of
    /// standalone's API; the token (--token) must be one the API server accepts, for a user
    /// allowed `get` on `tasks/log`.
    #[arg(long, env = "PROPELLER_LOGS_ENDPOINT")]
    pub endpoint: Option<String>,
    /// The CA certificate (PEM) the endpoint's certificate is verified with (`ca.pem` in
    /// its --logs-tls-dir when propeller made it).
    #[arg(long, env = "PROPELLER_LOGS_CA_CERT", requires = "endpoint")]
    pub ca_cert: Option<std::path::PathBuf>,
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
    let (api, broadcast) = match &args.endpoint {
        Some(endpoint) => (endpoint_client(args, endpoint)?, false),
        None => {
            let api = args.client.client()?;
            let task = api
                .request(
                    "GET",
                    &format!("/v1/objects/task/{}/{name}", args.namespace),
                    None,
                )
                .await
                .with_context(|| format!("reading task {}/{name}", args.namespace))?;
            (api, task["spec"]["broadcast"].as_bool().unwrap_or(false))
        }
    };
    // Through the endpoint the task is not read: lines are prefixed once a second proplet
    // shows up.
    let mut prefix = args.prefix || broadcast;
    let mut first_proplet: Option<String> = None;
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
        let proplet = line["proplet"].as_str().unwrap_or_default();
        match &first_proplet {
            None if !proplet.is_empty() => first_proplet = Some(proplet.to_owned()),
            Some(first) if !proplet.is_empty() && first != proplet => prefix = true,
            _ => {}
        }
        writeln!(stdout, "{}", render(&line, prefix)).context("writing to stdout")?;
        stdout.flush().context("writing to stdout")?;
    }
    Ok(())
}

/// The client of `propeller run`'s log endpoint at `endpoint`.
fn endpoint_client(args: &LogsArgs, endpoint: &str) -> anyhow::Result<ApiClient> {
    let token = args.client.token.clone().ok_or_else(|| {
        anyhow::anyhow!(
            "--endpoint needs --token (or PROPELLER_TOKEN): a token the API server accepts, such as `kubectl create token NAME`"
        )
    })?;
    let ca = args.ca_cert.as_ref().ok_or_else(|| {
        anyhow::anyhow!(
            "--endpoint needs --ca-cert: the CA certificate the endpoint's is verified with"
        )
    })?;
    let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
    let host = endpoint
        .rsplit_once(':')
        .map_or(endpoint, |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    Ok(ApiClient::https(endpoint, host, &pem, token)?)
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
