//! A stand-in for httpbin.org on 127.0.0.1, so upstream's `http_client` sample runs without
//! the Internet: `/get` and `/post` over HTTP and over HTTPS, with a certificate for
//! `httpbin.org` from a CA made for the test. Answers echo the request as httpbin does
//! (`url` built from the Host header, `headers`, POST `data`), so a test sees what the guest
//! sent; the TLS server names clients asked for are recorded.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The server; it stops when dropped, or a few minutes after it started.
pub struct FakeHttpbin {
    /// Where plain HTTP is served.
    pub http: SocketAddr,
    /// Where HTTPS is served.
    pub https: SocketAddr,
    /// The CA that signed the `httpbin.org` certificate, PEM.
    pub ca_pem: String,
    /// The TLS server names (SNI) of the handshakes so far.
    pub server_names: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl Drop for FakeHttpbin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Longest life of the server.
const LIFETIME: Duration = Duration::from_secs(180);

impl FakeHttpbin {
    pub fn start() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "fake httpbin test CA");
        let ca = ca_params.self_signed(&ca_key).expect("CA certificate");
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().expect("server key");
        let cert = CertificateParams::new(vec!["httpbin.org".to_owned()])
            .expect("server params")
            .signed_by(&key, &issuer)
            .expect("server certificate");
        let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .expect("server TLS config");

        let stop = Arc::new(AtomicBool::new(false));
        let server_names = Arc::new(Mutex::new(Vec::new()));
        let http = listen(stop.clone(), move |stream| serve(stream, "http"));
        let tls = Arc::new(tls);
        let names = server_names.clone();
        let https = listen(stop.clone(), move |stream| {
            let Ok(connection) = rustls::ServerConnection::new(tls.clone()) else {
                return;
            };
            let mut stream = rustls::StreamOwned::new(connection, stream);
            // Complete the handshake first, to learn the name the client asked for.
            while stream.conn.is_handshaking() {
                if stream.conn.complete_io(&mut stream.sock).is_err() {
                    return;
                }
            }
            if let Some(name) = stream.conn.server_name() {
                names.lock().expect("names").push(name.to_owned());
            }
            serve(stream, "https");
        });
        Self {
            http,
            https,
            ca_pem: ca.pem(),
            server_names,
            stop,
        }
    }
}

/// Accepts on an ephemeral loopback port, one thread per connection, until `stop`.
fn listen(stop: Arc<AtomicBool>, handle: impl Fn(TcpStream) + Send + Sync + 'static) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    listener.set_nonblocking(true).expect("nonblocking");
    let handle = Arc::new(handle);
    std::thread::spawn(move || {
        let started = Instant::now();
        while !stop.load(Ordering::Relaxed) && started.elapsed() < LIFETIME {
            match listener.accept() {
                Ok((stream, _)) => {
                    let _ = stream.set_nonblocking(false);
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    let handle = handle.clone();
                    std::thread::spawn(move || handle(stream));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    addr
}

/// Reads one request and answers it as httpbin would, then closes.
fn serve(stream: impl Read + Write, scheme: &str) {
    let mut reader = BufReader::new(stream);
    let Some((method, path, headers, body)) = read_request(&mut reader) else {
        return;
    };
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let host = header("host").unwrap_or_default();
    let echoed: serde_json::Map<String, serde_json::Value> = headers
        .iter()
        .map(|(n, v)| (title_case(n), serde_json::Value::String(v.clone())))
        .collect();
    let mut answer = serde_json::json!({
        "args": {},
        "headers": echoed,
        "origin": "127.0.0.1",
        "url": format!("{scheme}://{host}{path}"),
    });
    let status = match (method.as_str(), path.as_str()) {
        ("GET", "/get") => "200 OK",
        ("POST", "/post") => {
            answer["data"] = String::from_utf8_lossy(&body).into_owned().into();
            answer["form"] = serde_json::json!({});
            answer["files"] = serde_json::json!({});
            answer["json"] = serde_json::Value::Null;
            "200 OK"
        }
        _ => {
            answer = serde_json::json!({"error": format!("no {method} {path} here")});
            "404 Not Found"
        }
    };
    let text = serde_json::to_string_pretty(&answer).expect("json") + "\n";
    let stream = reader.get_mut();
    let _ = write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.flush();
    // Close only after the client has: closing with unread input resets the connection,
    // and a reset may discard the answer before the client reads it.
    let mut rest = [0u8; 1024];
    while matches!(reader.read(&mut rest), Ok(n) if n > 0) {}
}

/// `content-type` → `Content-Type`, as httpbin shows header names.
fn title_case(name: &str) -> String {
    name.split('-')
        .map(|part| {
            let mut chars = part.chars();
            chars.next().map_or(String::new(), |first| {
                first.to_ascii_uppercase().to_string() + &chars.as_str().to_ascii_lowercase()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
}

type Request = (String, String, Vec<(String, String)>, Vec<u8>);

/// Method, path, headers and body (by Content-Length or chunked).
fn read_request(reader: &mut impl BufRead) -> Option<Request> {
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_owned();
    let path = parts.next()?.to_owned();
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).ok()?;
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        headers.push((name.trim().to_owned(), value.trim().to_owned()));
    }
    let value = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v): &(String, String)| v.to_ascii_lowercase())
    };
    let mut body = Vec::new();
    if value("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        loop {
            let mut size = String::new();
            reader.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
            let mut chunk = vec![0; size + 2];
            reader.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    } else if let Some(length) = value("content-length") {
        body.resize(length.parse().ok()?, 0);
        reader.read_exact(&mut body).ok()?;
    }
    Some((method, path, headers, body))
}
