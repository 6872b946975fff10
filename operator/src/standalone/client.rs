//! The client side of the standalone API: a small HTTP/1.1 client for loopback, and the
//! table, YAML and describe renderings `propeller get/describe` print.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why a request to the standalone API failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached.
    #[error(
        "cannot reach the standalone API at {addr}: {source} (is `propeller standalone` running?)"
    )]
    Connect {
        /// Address tried.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
    /// The exchange broke off.
    #[error("talking to the standalone API: {0}")]
    Io(#[from] std::io::Error),
    /// The answer was not HTTP with JSON.
    #[error("unexpected answer from the standalone API: {0}")]
    Protocol(String),
    /// The server refused the request; its message says why.
    #[error("{message}")]
    Refused {
        /// HTTP status.
        status: u16,
        /// The server's explanation.
        message: String,
    },
}

/// Talks to `propeller standalone` over loopback.
#[derive(Debug, Clone)]
pub struct ApiClient {
    addr: String,
    token: String,
}

impl ApiClient {
    /// A client of the API at `addr` (`host:port`) using `token`.
    pub fn new(addr: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            token: token.into(),
        }
    }

    /// Sends one request; returns the JSON body of a 2xx answer.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Value, ClientError> {
        let mut stream =
            TcpStream::connect(&self.addr)
                .await
                .map_err(|source| ClientError::Connect {
                    addr: self.addr.clone(),
                    source,
                })?;
        let body = body.unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            self.token,
            body.len()
        );
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await?;
        let (status, payload) = split_response(&raw)?;
        let value: Value = if payload.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(payload)
                .map_err(|e| ClientError::Protocol(format!("body is not JSON: {e}")))?
        };
        if (200..300).contains(&status) {
            Ok(value)
        } else {
            Err(ClientError::Refused {
                status,
                message: value["error"]
                    .as_str()
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("HTTP {status}")),
            })
        }
    }
}

/// Status code and body of a raw HTTP/1.1 response (identity or chunked body).
fn split_response(raw: &[u8]) -> Result<(u16, &[u8]), ClientError> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| ClientError::Protocol("no end of headers".into()))?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| ClientError::Protocol("no status line".into()))?;
    let body = &raw[end + 4..];
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Err(ClientError::Protocol(
            "chunked bodies are not expected from the standalone API".into(),
        ));
    }
    Ok((status, body))
}

/// One printer column of a kind, from its CRD.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Header.
    pub name: String,
    /// JSONPath into the object.
    pub path: String,
    /// `date` columns print as ages.
    pub is_date: bool,
}

/// The printer columns of `kind` as its CRD declares them.
pub fn columns(kind: &str) -> Vec<Column> {
    for crd in crate::crd::all_crds() {
        if crd.spec.names.kind != kind {
            continue;
        }
        return crd
            .spec
            .versions
            .first()
            .and_then(|v| v.additional_printer_columns.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|c| Column {
                name: c.name.to_uppercase(),
                path: c.json_path,
                is_date: c.type_ == "date",
            })
            .collect();
    }
    Vec::new()
}

/// Evaluates the JSONPath subset printer columns use: `.a.b`, and `[?(@.k=="v")]` on lists.
pub fn eval_path<'a>(obj: &'a Value, path: &str) -> Option<&'a Value> {
    let mut current = obj;
    let mut rest = path;
    while !rest.is_empty() {
        if let Some(filter) = rest.strip_prefix("[?(@.") {
            let close = filter.find(")]")?;
            let (cond, after) = (&filter[..close], &filter[close + 2..]);
            let (key, wanted) = cond.split_once("==")?;
            let wanted = wanted.trim_matches('"');
            current = current
                .as_array()?
                .iter()
                .find(|item| item[key].as_str() == Some(wanted))?;
            rest = after;
        } else if let Some(field) = rest.strip_prefix('.') {
            let end = field.find(['.', '[']).unwrap_or(field.len());
            current = current.get(&field[..end])?;
            rest = &field[end..];
        } else {
            return None;
        }
    }
    Some(current)
}

/// `5s`, `3m`, `2h`, `4d`, like kubectl's ages.
pub fn age(since: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let secs = (now - since).num_seconds().max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn cell(obj: &Value, column: &Column, now: DateTime<Utc>) -> String {
    match eval_path(obj, &column.path) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) if column.is_date => s
            .parse::<DateTime<Utc>>()
            .map(|t| age(t, now))
            .unwrap_or_else(|_| s.clone()),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// The rows of `objects` as `kubectl get` prints them: NAME (and NAMESPACE when `wide`),
/// then the kind's printer columns, aligned.
pub fn table(kind: &str, objects: &[Value], wide: bool, now: DateTime<Utc>) -> String {
    let cols = columns(kind);
    let mut header = Vec::new();
    if wide {
        header.push("NAMESPACE".to_owned());
    }
    header.push("NAME".to_owned());
    header.extend(cols.iter().map(|c| c.name.clone()));
    let mut rows = vec![header];
    for obj in objects {
        let mut row = Vec::new();
        if wide {
            row.push(
                obj["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned(),
            );
        }
        row.push(obj["metadata"]["name"].as_str().unwrap_or("").to_owned());
        row.extend(cols.iter().map(|c| cell(obj, c, now)));
        rows.push(row);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        out.push_str(line.join("   ").trim_end());
        out.push('\n');
    }
    out
}

/// `propeller describe`: identity, spec, status fields, conditions and recent events.
pub fn describe(obj: &Value, events: &[Value]) -> String {
    let mut out = String::new();
    let meta = &obj["metadata"];
    let line = |k: &str, v: &Value| {
        format!(
            "{k:<14}{}\n",
            v.as_str().map_or_else(|| v.to_string(), str::to_owned)
        )
    };
    out.push_str(&line("Name:", &meta["name"]));
    out.push_str(&line("Namespace:", &meta["namespace"]));
    out.push_str(&line("Kind:", &obj["kind"]));
    out.push_str(&line("UID:", &meta["uid"]));
    out.push_str(&line("Created:", &meta["creationTimestamp"]));
    if let Some(labels) = meta["labels"].as_object() {
        let text: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
            .collect();
        out.push_str(&format!("{:<14}{}\n", "Labels:", text.join(", ")));
    }
    let yaml = |v: &Value| serde_yaml_ng::to_string(v).unwrap_or_default();
    let indent = |text: String| -> String { text.lines().map(|l| format!("  {l}\n")).collect() };
    out.push_str("Spec:\n");
    out.push_str(&indent(yaml(&obj["spec"])));
    let mut status = obj["status"].clone();
    let conditions = status
        .as_object_mut()
        .and_then(|s| s.remove("conditions"))
        .and_then(|c| c.as_array().cloned())
        .unwrap_or_default();
    out.push_str("Status:\n");
    if status.is_null() {
        out.push_str("  (none yet)\n");
    } else {
        out.push_str(&indent(yaml(&status)));
    }
    out.push_str("Conditions:\n");
    if conditions.is_empty() {
        out.push_str("  (none)\n");
    }
    let mut seen = BTreeMap::new();
    for c in &conditions {
        seen.insert(
            c["type"].as_str().unwrap_or_default().to_owned(),
            format!(
                "  {:<10} {:<6} {:<22} {}\n",
                c["type"].as_str().unwrap_or_default(),
                c["status"].as_str().unwrap_or_default(),
                c["reason"].as_str().unwrap_or_default(),
                c["message"].as_str().unwrap_or_default()
            ),
        );
    }
    for line in seen.values() {
        out.push_str(line);
    }
    out.push_str("Events:\n");
    if events.is_empty() {
        out.push_str("  (none recorded since the server started)\n");
    }
    for e in events {
        out.push_str(&format!(
            "  {:<30} {:<8} {:<14} {}\n",
            e["time"].as_str().unwrap_or_default(),
            e["type"].as_str().unwrap_or_default(),
            e["reason"].as_str().unwrap_or_default(),
            e["message"].as_str().unwrap_or_default()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use serde_json::json;

    #[test]
    fn printer_paths_with_filters_and_nesting() {
        let obj = json!({"status": {"phase": "Running", "conditions": [
            {"type": "Healthy", "status": "False"}, {"type": "Ready", "status": "True"}]}});
        assert_eq!(eval_path(&obj, ".status.phase"), Some(&json!("Running")));
        assert_eq!(
            eval_path(&obj, ".status.conditions[?(@.type==\"Ready\")].status"),
            Some(&json!("True"))
        );
        assert_eq!(eval_path(&obj, ".status.missing"), None);
    }

    #[test]
    fn a_task_table_has_the_crd_columns_and_ages() {
        let now = Utc
            .with_ymd_and_hms(2026, 11, 22, 12, 0, 0)
            .single()
            .unwrap_or_default();
        let task = json!({"metadata": {"name": "add", "namespace": "default",
                                       "creationTimestamp": "2026-11-22T11:55:00Z"},
                          "spec": {"name": "add"},
                          "status": {"phase": "completed", "assignedProplet": "pi"}});
        let text = table("Task", &[task], false, now);
        let mut lines = text.lines();
        let header = lines.next().unwrap_or_default();
        assert!(header.starts_with("NAME"), "{header}");
        assert!(header.contains("PHASE") && header.contains("PROPLET") && header.contains("AGE"));
        let row = lines.next().unwrap_or_default();
        assert!(row.starts_with("add"));
        assert!(
            row.contains("completed") && row.contains("pi") && row.ends_with("5m"),
            "{row}"
        );
    }

    #[test]
    fn responses_split_into_status_and_body() {
        let raw = b"HTTP/1.1 422 Unprocessable Entity\r\ncontent-type: application/json\r\ncontent-length: 13\r\n\r\n{\"error\":\"x\"}";
        let (status, body) = split_response(raw).unwrap_or((0, b""));
        assert_eq!(status, 422);
        assert_eq!(body, b"{\"error\":\"x\"}");
        assert!(split_response(b"garbage").is_err());
    }

    #[test]
    fn describe_shows_spec_status_and_conditions() {
        let obj = json!({"kind": "Task", "metadata": {"name": "add", "namespace": "default"},
                         "spec": {"name": "add"},
                         "status": {"phase": "pending", "conditions": [
                            {"type": "Scheduled", "status": "False", "reason": "NoCandidates", "message": "no proplets"}]}});
        let events = [
            json!({"time": "2026-11-22T12:00:00Z", "type": "Warning", "reason": "NoCandidates", "message": "waiting"}),
        ];
        let text = describe(&obj, &events);
        assert!(text.contains("Events:") && text.contains("Warning"));
        assert!(text.contains("Name:         add"));
        assert!(text.contains("phase: pending"));
        assert!(text.contains("NoCandidates") && text.contains("no proplets"));
    }
}
