//! The client side of the standalone API (hyper over loopback, including streaming
//! watches), and the table, YAML and describe renderings `propeller get/describe` print.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde_json::Value;
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

/// Talks to `propeller standalone` over loopback, or to an HTTPS endpoint of propeller (the
/// task log endpoint of `propeller run`).
#[derive(Clone)]
pub struct ApiClient {
    addr: String,
    token: String,
    tls: Option<Tls>,
}

/// How an HTTPS endpoint is reached: the server name its certificate must carry and the
/// roots it is verified with.
#[derive(Clone)]
struct Tls {
    connector: tokio_rustls::TlsConnector,
    name: rustls::pki_types::ServerName<'static>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiClient")
            .field("addr", &self.addr)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// A response whose body is still arriving (a watch).
pub struct LineStream {
    body: hyper::body::Incoming,
    buffer: Vec<u8>,
}

impl LineStream {
    /// The next complete line (without its newline); `None` when the server ended the body.
    pub async fn next_line(&mut self) -> Result<Option<String>, ClientError> {
        use http_body_util::BodyExt;
        loop {
            if let Some(end) = self.buffer.iter().position(|b| *b == b'\n') {
                let rest = self.buffer.split_off(end + 1);
                let mut line = std::mem::replace(&mut self.buffer, rest);
                line.pop();
                return Ok(Some(String::from_utf8_lossy(&line).into_owned()));
            }
            match self.body.frame().await {
                Some(frame) => {
                    let frame = frame.map_err(|e| ClientError::Protocol(e.to_string()))?;
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
                None => return Ok(None),
            }
        }
    }
}

impl ApiClient {
    /// A client of the API at `addr` (`host:port`) using `token`.
    pub fn new(addr: impl Into<String>, token: impl Into<String>) -> Self {
        Self {
            addr: addr.into(),
            token: token.into(),
            tls: None,
        }
    }

    /// A client of the HTTPS endpoint at `addr` (`host:port`), whose certificate is for
    /// `host` and is verified with the CA certificates in `ca_pem` (PEM).
    pub fn https(
        addr: impl Into<String>,
        host: &str,
        ca_pem: &[u8],
        token: impl Into<String>,
    ) -> Result<Self, ClientError> {
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem) {
            let cert = cert.map_err(|e| ClientError::Protocol(format!("CA certificate: {e}")))?;
            roots
                .add(cert)
                .map_err(|e| ClientError::Protocol(format!("CA certificate: {e}")))?;
        }
        if roots.is_empty() {
            return Err(ClientError::Protocol(
                "no CA certificate in the file given".into(),
            ));
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ClientError::Protocol(e.to_string()))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let name = rustls::pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| ClientError::Protocol(format!("server name {host}: {e}")))?;
        Ok(Self {
            addr: addr.into(),
            token: token.into(),
            tls: Some(Tls {
                connector: tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)),
                name,
            }),
        })
    }

    /// Sends one request over a new connection; the status and the body still arriving.
    async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<(u16, hyper::body::Incoming), ClientError> {
        let stream =
            TcpStream::connect(&self.addr)
                .await
                .map_err(|source| ClientError::Connect {
                    addr: self.addr.clone(),
                    source,
                })?;
        let _ = stream.set_nodelay(true);
        let mut sender = match &self.tls {
            None => open(stream).await?,
            Some(tls) => {
                let stream = tls
                    .connector
                    .connect(tls.name.clone(), stream)
                    .await
                    .map_err(|e| ClientError::Protocol(format!("TLS with {}: {e}", self.addr)))?;
                open(stream).await?
            }
        };
        let request = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.addr)
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "text/plain")
            .body(http_body_util::Full::new(bytes::Bytes::from(
                body.unwrap_or_default().to_owned(),
            )))
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
        Ok((response.status().as_u16(), response.into_body()))
    }

    /// Sends one request; returns the JSON body of a 2xx answer.
    pub async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Value, ClientError> {
        let (status, incoming) = self.send(method, path, body).await?;
        let value = json_body(incoming).await?;
        if (200..300).contains(&status) {
            Ok(value)
        } else {
            Err(refused(status, &value))
        }
    }

    /// Opens a streaming GET (a watch); the lines arrive as the server sends them.
    pub async fn stream(&self, path: &str) -> Result<LineStream, ClientError> {
        let (status, body) = self.send("GET", path, None).await?;
        if !(200..300).contains(&status) {
            let value = json_body(body).await.unwrap_or(Value::Null);
            return Err(refused(status, &value));
        }
        Ok(LineStream {
            body,
            buffer: Vec::new(),
        })
    }
}

/// An HTTP/1.1 exchange over `io`, its connection driven in the background.
async fn open<IO>(
    io: IO,
) -> Result<hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>, ClientError>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| ClientError::Protocol(e.to_string()))?;
    tokio::spawn(connection);
    Ok(sender)
}

/// The whole body as JSON (`null` when empty).
async fn json_body(incoming: hyper::body::Incoming) -> Result<Value, ClientError> {
    use http_body_util::BodyExt;
    let payload = incoming
        .collect()
        .await
        .map_err(|e| ClientError::Protocol(e.to_string()))?
        .to_bytes();
    if payload.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice(&payload)
        .map_err(|e| ClientError::Protocol(format!("body is not JSON: {e}")))
}

/// The server's refusal, with its `{"error": …}` message when it sent one.
fn refused(status: u16, value: &Value) -> ClientError {
    ClientError::Refused {
        status,
        message: value["error"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("HTTP {status}")),
    }
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
    let rows = table_cells(kind, objects, wide, now);
    render_rows(&rows, &column_widths(&rows))
}

/// The header and one row per object, cell by cell.
pub fn table_cells(
    kind: &str,
    objects: &[Value],
    wide: bool,
    now: DateTime<Utc>,
) -> Vec<Vec<String>> {
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
    rows
}

/// The widest cell of each column.
pub fn column_widths(rows: &[Vec<String>]) -> Vec<usize> {
    let columns = rows.first().map_or(0, Vec::len);
    (0..columns)
        .map(|i| {
            rows.iter()
                .map(|r| r.get(i).map_or(0, |c| c.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect()
}

/// Rows padded to `widths` (a later row of a watch keeps the first table's alignment).
pub fn render_rows(rows: &[Vec<String>], widths: &[usize]) -> String {
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let w = widths.get(i).copied().unwrap_or(0);
                format!("{c:<w$}")
            })
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
