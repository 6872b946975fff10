//! How a guest's outgoing `wasi:http` requests leave the agent.
//!
//! Every request passes the host allow-list, then goes out on its own HTTP/1.1 connection
//! under the agent's timeouts. Two settings serve devices whose network differs from the
//! guest's idea of it:
//! - host overrides (`PROPLET_HTTP_RESOLVE`) send a `host:port` to another address and port,
//!   like curl's `--connect-to`: a local mirror, a gateway, a test server. The guest's Host
//!   header, and the name the TLS handshake sends and verifies, stay the ones it asked for.
//! - extra trust roots (`PROPLET_HTTP_CA_FILE`) are added to the Mozilla roots, so services
//!   behind a private CA can be reached over HTTPS.

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::uri::Scheme;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use wasmtime_wasi_http::{Error, RequestOptions, WasiBody};

/// Rules for the HTTP requests a guest sends through `wasi:http/outgoing-handler`: the same
/// bounds as the agent's own binary fetches, plus where hosts really are and whom to trust.
#[derive(Debug, Clone, PartialEq)]
pub struct OutgoingHttp {
    /// Hosts a guest may reach (exact names, or `*.example.com` for subdomains); empty: any.
    pub allow_hosts: Vec<String>,
    /// Limit on connecting, on the first response byte and between body bytes.
    pub timeout: Duration,
    /// Where to connect instead, for the `host:port`s they name.
    pub overrides: Vec<HostOverride>,
    /// Roots trusted besides the Mozilla ones.
    pub extra_roots: Vec<CertificateDer<'static>>,
}

impl Default for OutgoingHttp {
    fn default() -> Self {
        Self {
            allow_hosts: Vec::new(),
            timeout: Duration::from_secs(30),
            overrides: Vec::new(),
            extra_roots: Vec::new(),
        }
    }
}

/// One `HOST:PORT:ADDRESS[:PORT]` entry of `PROPLET_HTTP_RESOLVE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostOverride {
    /// The host the guest names (compared without regard to case).
    pub host: String,
    /// The port the guest names, or its scheme's default.
    pub port: u16,
    /// Where to connect instead: an IP address or a host name.
    pub to_host: String,
    /// The port to connect to.
    pub to_port: u16,
}

/// Why the extra trust roots cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RootsError {
    /// The file cannot be read or is not PEM.
    #[error("{path}: {message}")]
    Read {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The file holds no `CERTIFICATE` block.
    #[error("{0}: no PEM certificate in it")]
    Empty(String),
    /// A certificate cannot serve as a trust anchor.
    #[error("{path}: certificate #{index} is not a usable CA certificate: {message}")]
    Unusable {
        /// The file.
        path: String,
        /// Its position in the file, from 1.
        index: usize,
        /// What rustls said.
        message: String,
    },
}

impl OutgoingHttp {
    /// Whether a request to `host` is allowed.
    pub fn allows(&self, host: &str) -> bool {
        let host = host.to_ascii_lowercase();
        self.allow_hosts.is_empty()
            || self.allow_hosts.iter().any(|rule| {
                let rule = rule.to_ascii_lowercase();
                match rule.strip_prefix("*.") {
                    Some(domain) => host.ends_with(&format!(".{domain}")),
                    None => host == rule,
                }
            })
    }

    /// Where to connect for a request to `host:port`.
    pub fn destination<'a>(&'a self, host: &'a str, port: u16) -> (&'a str, u16) {
        self.overrides
            .iter()
            .find(|o| o.port == port && o.host.eq_ignore_ascii_case(host))
            .map_or((host, port), |o| (o.to_host.as_str(), o.to_port))
    }

    /// The TLS client settings for guests' HTTPS: rustls on `ring`, the Mozilla roots and the
    /// extra ones.
    pub fn tls_config(&self) -> Result<rustls::ClientConfig, rustls::Error> {
        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        for cert in &self.extra_roots {
            roots.add(cert.clone())?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        Ok(rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth())
    }

    /// The guest's timeouts, never longer than the agent's.
    fn limits(&self, asked: Option<RequestOptions>) -> Limits {
        let asked = asked.unwrap_or_default();
        let cap = |value: Option<Duration>| value.map_or(self.timeout, |v| v.min(self.timeout));
        Limits {
            connect: cap(asked.connect_timeout),
            first_byte: cap(asked.first_byte_timeout),
            // Tokio's timers need a positive period.
            between_bytes: cap(asked.between_bytes_timeout).max(Duration::from_nanos(1)),
        }
    }
}

/// Parses `PROPLET_HTTP_RESOLVE`: comma-separated `HOST:PORT:ADDRESS[:PORT]` entries (IPv6
/// addresses in brackets; without the last port, the first one is kept).
pub fn parse_overrides(text: &str) -> Result<Vec<HostOverride>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            parse_override(entry).map_err(|message| {
                format!("{entry:?}: {message} (expected HOST:PORT:ADDRESS[:PORT])")
            })
        })
        .collect()
}

fn parse_override(entry: &str) -> Result<HostOverride, String> {
    let (host, rest) = split_host(entry)?;
    let rest = rest.ok_or("missing port and address")?;
    let (port, target) = rest.split_once(':').ok_or("missing address")?;
    let port = parse_port(port)?;
    let (to_host, to_port) = split_host(target)?;
    let to_port = match to_port {
        Some(p) => parse_port(p)?,
        None => port,
    };
    Ok(HostOverride {
        host: host.to_ascii_lowercase(),
        port,
        to_host: to_host.to_owned(),
        to_port,
    })
}

/// `name` or `[v6]`, then what follows its `:` if anything.
fn split_host(text: &str) -> Result<(&str, Option<&str>), String> {
    let (host, rest) = if let Some(bracketed) = text.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or("unclosed `[`")?;
        host.parse::<std::net::Ipv6Addr>()
            .map_err(|_| format!("{host:?} is not an IPv6 address"))?;
        let rest = match after.strip_prefix(':') {
            Some(rest) => Some(rest),
            None if after.is_empty() => None,
            None => return Err(format!("unexpected {after:?} after `]`")),
        };
        (host, rest)
    } else {
        match text.split_once(':') {
            Some((host, rest)) => (host, Some(rest)),
            None => (text, None),
        }
    };
    let name_like = host
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':'));
    if host.is_empty() || !name_like {
        return Err(format!("{host:?} is not a host name or IP address"));
    }
    Ok((host, rest))
}

fn parse_port(text: &str) -> Result<u16, String> {
    match text.parse::<u16>() {
        Ok(port) if port > 0 => Ok(port),
        _ => Err(format!("{text:?} is not a port number")),
    }
}

/// Reads the PEM certificates in `path` and checks each can be a trust anchor.
pub fn load_roots(path: &Path) -> Result<Vec<CertificateDer<'static>>, RootsError> {
    use rustls::pki_types::pem::PemObject;
    let shown = path.display().to_string();
    let read = |message: String| RootsError::Read {
        path: shown.clone(),
        message,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| read(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| read(e.to_string()))?;
    if certs.is_empty() {
        return Err(RootsError::Empty(shown));
    }
    let mut store = rustls::RootCertStore::empty();
    for (i, cert) in certs.iter().enumerate() {
        store.add(cert.clone()).map_err(|e| RootsError::Unusable {
            path: shown.clone(),
            index: i + 1,
            message: e.to_string(),
        })?;
    }
    Ok(certs)
}

/// Timeouts of one request.
#[derive(Debug, Clone, Copy)]
struct Limits {
    connect: Duration,
    first_byte: Duration,
    between_bytes: Duration,
}

/// Most a guest may write into a GET, HEAD or CONNECT body that states no length.
const UNSIZED_BODY_LIMIT: usize = 1 << 20;

/// What drives a connection until its response body is done; errors go to the guest.
pub(crate) type Driver = Box<dyn Future<Output = Result<(), Error>> + Send>;

trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// Sends `request` under `policy`; the response's body is read as the guest reads it.
pub(crate) async fn send(
    policy: Arc<OutgoingHttp>,
    mut request: http::Request<WasiBody>,
    options: Option<RequestOptions>,
) -> Result<(http::Response<WasiBody>, Driver), Error> {
    let uri = request.uri();
    let https = uri.scheme() == Some(&Scheme::HTTPS);
    let host = uri
        .host()
        .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_owned())
        .filter(|h| !h.is_empty())
        .ok_or(Error::HttpRequestUriInvalid)?;
    if !policy.allows(&host) {
        return Err(Error::HttpRequestDenied);
    }
    let port = uri.port_u16().unwrap_or(if https { 443 } else { 80 });
    // Only the path goes on the request line; the Host header carries the authority.
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    *request.uri_mut() = http::Uri::try_from(path).map_err(|_| Error::HttpRequestUriInvalid)?;
    let limits = policy.limits(options);
    settle_unsized_body(&mut request, limits.first_byte).await?;

    let (to_host, to_port) = policy.destination(&host, port);
    let tcp = tokio::time::timeout(limits.connect, TcpStream::connect((to_host, to_port)))
        .await
        .map_err(|_| Error::ConnectionTimeout)?
        .map_err(Error::Connect)?;
    let _ = tcp.set_nodelay(true);
    let stream: Box<dyn Stream> = if https {
        let name = ServerName::try_from(host.clone()).map_err(|_| Error::HttpRequestUriInvalid)?;
        let config = policy
            .tls_config()
            .map_err(|e| Error::InternalError(Some(format!("TLS settings: {e}"))))?;
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tls = tokio::time::timeout(limits.connect, connector.connect(name, tcp))
            .await
            .map_err(|_| Error::ConnectionTimeout)?
            .map_err(Error::Tls)?;
        Box::new(tls)
    } else {
        Box::new(tcp)
    };
    let io = wasmtime_wasi_http::io::TokioIo::new(stream);
    let (mut sender, connection) =
        tokio::time::timeout(limits.connect, hyper::client::conn::http1::handshake(io))
            .await
            .map_err(|_| Error::ConnectionTimeout)??;
    // Aborted when wasmtime drops the driver, that is when the guest is done with the response.
    let connection = wasmtime_wasi::runtime::spawn(connection);
    let response = tokio::time::timeout(limits.first_byte, sender.send_request(request))
        .await
        .map_err(|_| Error::ConnectionReadTimeout)??;
    let response = response.map(|incoming| {
        PacedBody {
            incoming,
            limit: limits.between_bytes,
            deadline: Box::pin(tokio::time::sleep(limits.between_bytes)),
        }
        .boxed_unsync()
    });
    let driver = async move { connection.await.map_err(Error::from) };
    Ok((response, Box::new(driver) as Driver))
}

/// Reads to its end a body that hyper would drop unsent, and sends what it held.
///
/// hyper writes a GET, HEAD or CONNECT request that states no length with no body at all and
/// drops the body stream right after the head. A guest still writing or finishing that body
/// (wasi:http guests finish it while they wait for the response) then finds its stream
/// closed: the "connection reset" upstream's http_client sample reported for its plain GET
/// whenever the request went out fast. Waiting for the guest to finish, within the time the
/// response may take, keeps its stream open, and anything it wrote is sent with a
/// Content-Length instead of being lost.
async fn settle_unsized_body(
    request: &mut http::Request<WasiBody>,
    limit: Duration,
) -> Result<(), Error> {
    let method = request.method();
    let unsized_bodyless = matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::CONNECT
    ) && !request.headers().contains_key(http::header::CONTENT_LENGTH)
        && !request
            .headers()
            .contains_key(http::header::TRANSFER_ENCODING);
    if !unsized_bodyless || request.body().is_end_stream() {
        return Ok(());
    }
    let method = method.clone();
    let empty = http_body_util::Empty::new()
        .map_err(|never| match never {})
        .boxed_unsync();
    let mut body = std::mem::replace(request.body_mut(), empty);
    let read = async {
        let mut held = Vec::new();
        while let Some(frame) = body.frame().await {
            // Trailers need a chunked body, which these methods do not get: only data counts.
            if let Ok(data) = frame?.into_data() {
                if held.len() + data.len() > UNSIZED_BODY_LIMIT {
                    return Err(Error::HttpRequestBodySize(Some(
                        (held.len() + data.len()) as u64,
                    )));
                }
                held.extend_from_slice(&data);
            }
        }
        Ok(held)
    };
    let held = tokio::time::timeout(limit, read).await.map_err(|_| {
        Error::InternalError(Some(format!(
            "the guest did not finish the body of its {method} request within {limit:?}"
        )))
    })??;
    if !held.is_empty() {
        *request.body_mut() = http_body_util::Full::new(Bytes::from(held))
            .map_err(|never| match never {})
            .boxed_unsync();
    }
    Ok(())
}

/// A response body that fails when the server pauses longer than `limit` between frames.
struct PacedBody {
    incoming: hyper::body::Incoming,
    limit: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl Body for PacedBody {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = &mut *self;
        match Pin::new(&mut this.incoming).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let next = tokio::time::Instant::now() + this.limit;
                this.deadline.as_mut().reset(next);
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(Error::from(e)))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(Error::ConnectionReadTimeout))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.incoming.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.incoming.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(host: &str, port: u16, to_host: &str, to_port: u16) -> HostOverride {
        HostOverride {
            host: host.into(),
            port,
            to_host: to_host.into(),
            to_port,
        }
    }

    #[test]
    fn overrides_map_a_host_and_port_to_another_address_and_port() {
        assert_eq!(
            parse_overrides("httpbin.org:443:127.0.0.1:40123, HttpBin.org:80:127.0.0.1:40124"),
            Ok(vec![
                entry("httpbin.org", 443, "127.0.0.1", 40123),
                entry("httpbin.org", 80, "127.0.0.1", 40124),
            ])
        );
        // curl's --resolve form keeps the port; IPv6 goes in brackets; names are allowed.
        assert_eq!(
            parse_overrides("api.example.com:443:10.0.0.7,[::1]:80:[fe80::1]:8080,a:1:mirror.lan"),
            Ok(vec![
                entry("api.example.com", 443, "10.0.0.7", 443),
                entry("::1", 80, "fe80::1", 8080),
                entry("a", 1, "mirror.lan", 1),
            ])
        );
        assert_eq!(parse_overrides(" , "), Ok(vec![]));
    }

    #[test]
    fn bad_overrides_say_which_entry_and_why() {
        for (text, why) in [
            ("httpbin.org", "missing port and address"),
            ("httpbin.org:443", "missing address"),
            (
                "httpbin.org:https:127.0.0.1",
                "\"https\" is not a port number",
            ),
            ("httpbin.org:443:127.0.0.1:0", "\"0\" is not a port number"),
            (
                "httpbin.org:443:127.0.0.1:99999",
                "\"99999\" is not a port number",
            ),
            (
                "httpbin.org:443::::1",
                "\"\" is not a host name or IP address",
            ),
            ("httpbin.org:443:[::1", "unclosed `[`"),
            (
                "httpbin.org:443:[nope]:1",
                "\"nope\" is not an IPv6 address",
            ),
            (":443:127.0.0.1", "\"\" is not a host name or IP address"),
            ("http://a:1:b", "\"//a\" is not a port number"),
            ("a b:1:c", "\"a b\" is not a host name or IP address"),
        ] {
            let error = parse_overrides(&format!("ok.example:1:127.0.0.1, {text}"))
                .err()
                .unwrap_or_default();
            assert!(
                error.contains(&format!("{text:?}")) && error.contains(why),
                "{text}: {error}"
            );
        }
    }

    #[test]
    fn destination_follows_the_first_matching_override() {
        let policy = OutgoingHttp {
            overrides: vec![
                entry("httpbin.org", 443, "127.0.0.1", 40123),
                entry("httpbin.org", 443, "127.0.0.2", 1),
            ],
            ..OutgoingHttp::default()
        };
        assert_eq!(policy.destination("HTTPBIN.org", 443), ("127.0.0.1", 40123));
        assert_eq!(policy.destination("httpbin.org", 80), ("httpbin.org", 80));
        assert_eq!(policy.destination("example.org", 443), ("example.org", 443));
    }

    /// A loopback server that answers one request; the request as it arrived.
    fn answer_once() -> (u16, std::sync::mpsc::Receiver<String>) {
        use std::io::{Read, Write};
        let listener = match std::net::TcpListener::bind("127.0.0.1:0") {
            Ok(l) => l,
            Err(e) => panic!("{e}"),
        };
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        let (seen, request) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let mut text = Vec::new();
            let mut buf = [0u8; 1024];
            // The head, then as many body bytes as it announces.
            while let Ok(n @ 1..) = stream.read(&mut buf) {
                text.extend_from_slice(&buf[..n]);
                let head_end = text.windows(4).position(|w| w == b"\r\n\r\n");
                let Some(end) = head_end else { continue };
                let head = String::from_utf8_lossy(&text[..end]).to_ascii_lowercase();
                let length = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if text.len() >= end + 4 + length {
                    break;
                }
            }
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok");
            let _ = seen.send(String::from_utf8_lossy(&text).into_owned());
        });
        (port, request)
    }

    /// A request body fed by the test, chunk by chunk, like a guest's output stream.
    fn guest_body(chunks: tokio::sync::mpsc::Receiver<Bytes>) -> WasiBody {
        let frames = futures_util::stream::unfold(chunks, |mut chunks| async move {
            let chunk = chunks.recv().await?;
            Some((Ok(Frame::data(chunk)), chunks))
        });
        http_body_util::StreamBody::new(frames).boxed_unsync()
    }

    /// Sends a GET whose body the test writes to after the send began; whether each
    /// write was taken, and the request the server saw.
    async fn get_with_late_body(chunks: &[&'static str]) -> (Vec<bool>, String) {
        let (port, seen) = answer_once();
        let (writer, reader) = tokio::sync::mpsc::channel(4);
        let request = http::Request::get(format!("http://127.0.0.1:{port}/get"))
            .header(http::header::HOST, format!("127.0.0.1:{port}"))
            .body(guest_body(reader));
        let request = match request {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        let sent = tokio::spawn(send(Arc::new(OutgoingHttp::default()), request, None));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut taken = Vec::new();
        for chunk in chunks {
            taken.push(
                writer
                    .send(Bytes::from_static(chunk.as_bytes()))
                    .await
                    .is_ok(),
            );
        }
        drop(writer);
        match sent.await {
            Ok(Ok((response, _driver))) => assert_eq!(response.status(), 200),
            Ok(Err(e)) => panic!("send: {e}"),
            Err(e) => panic!("{e}"),
        }
        let request = seen
            .recv_timeout(Duration::from_secs(10))
            .unwrap_or_default();
        (taken, request)
    }

    #[tokio::test]
    async fn a_get_body_the_guest_finishes_late_stays_open_and_is_sent_with_its_length() {
        let (taken, request) = get_with_late_body(&["he", "llo"]).await;
        assert_eq!(
            taken,
            [true, true],
            "the body stream was closed under the guest"
        );
        assert!(request.starts_with("GET /get HTTP/1.1\r\n"), "{request}");
        assert!(request.contains("content-length: 5\r\n"), "{request}");
        assert!(request.ends_with("\r\n\r\nhello"), "{request}");
        // An empty body is finished late too, and the GET goes out without one.
        let (taken, request) = get_with_late_body(&[""]).await;
        assert_eq!(taken, [true]);
        assert!(
            !request.to_ascii_lowercase().contains("content-length"),
            "{request}"
        );
        assert!(request.ends_with("\r\n\r\n"), "{request}");
    }

    #[test]
    fn guest_timeouts_are_capped_by_the_agents() {
        let policy = OutgoingHttp {
            timeout: Duration::from_secs(30),
            ..OutgoingHttp::default()
        };
        let limits = policy.limits(Some(RequestOptions {
            connect_timeout: Some(Duration::from_secs(5)),
            first_byte_timeout: Some(Duration::from_secs(600)),
            between_bytes_timeout: Some(Duration::ZERO),
        }));
        assert_eq!(limits.connect, Duration::from_secs(5));
        assert_eq!(limits.first_byte, Duration::from_secs(30));
        assert_eq!(limits.between_bytes, Duration::from_nanos(1));
        assert_eq!(policy.limits(None).connect, Duration::from_secs(30));
    }

    #[test]
    fn extra_roots_must_be_pem_ca_certificates() {
        let dir = match tempfile::tempdir() {
            Ok(d) => d,
            Err(e) => panic!("{e}"),
        };
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            if let Err(e) = std::fs::write(&path, text) {
                panic!("{e}");
            }
            path
        };
        let missing = dir.path().join("missing.pem");
        assert!(matches!(load_roots(&missing), Err(RootsError::Read { .. })));
        let empty = write("empty.pem", "not a certificate\n");
        assert_eq!(
            load_roots(&empty),
            Err(RootsError::Empty(empty.display().to_string()))
        );
        let garbage = write(
            "garbage.pem",
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        );
        assert!(matches!(
            load_roots(&garbage),
            Err(RootsError::Unusable { index: 1, .. })
        ));
        let ca = || {
            let mut params = rcgen::CertificateParams::new(Vec::new())?;
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params.self_signed(&rcgen::KeyPair::generate()?)
        };
        let (first, second) = match (ca(), ca()) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => panic!("{e}"),
        };
        let both = write("ca.pem", &(first.pem() + &second.pem()));
        let roots = match load_roots(&both) {
            Ok(r) => r,
            Err(e) => panic!("{e}"),
        };
        assert_eq!(roots.len(), 2);
        let policy = OutgoingHttp {
            extra_roots: roots,
            ..OutgoingHttp::default()
        };
        assert!(policy.tls_config().is_ok());
    }
}
