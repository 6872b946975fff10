//! A stand-in for httpbin.org on 127.0.0.1, so upstream's `http_client` sample runs without
//! the Internet: `/get` and `/post` over HTTP and over HTTPS, with a certificate for
//! `httpbin.org` from a CA made for the test. Answers echo the request as httpbin does
//! (`url` built from the Host header, `headers`, POST `data`), so a test sees what the guest
//! sent; the TLS server names clients asked for are recorded. Served by axum (hyper) on a
//! runtime of its own, with tokio-rustls for HTTPS.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;

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
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for FakeHttpbin {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
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

        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        let server_names = Arc::new(Mutex::new(Vec::new()));
        let bind = || {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.set_nonblocking(true).expect("nonblocking");
            listener
        };
        let (http_listener, https_listener) = (bind(), bind());
        let http = http_listener.local_addr().expect("addr");
        let https = https_listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let names = server_names.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                let plain = tokio::net::TcpListener::from_std(http_listener).expect("listener");
                let secure = tokio::net::TcpListener::from_std(https_listener).expect("listener");
                let plain =
                    std::future::IntoFuture::into_future(axum::serve(plain, echo_app("http")));
                let secure = serve_tls(secure, acceptor, names);
                tokio::select! {
                    _ = stopped => {}
                    _ = tokio::time::sleep(LIFETIME) => {}
                    _ = plain => {}
                    _ = secure => {}
                }
            });
        });
        Self {
            http,
            https,
            ca_pem: ca.pem(),
            server_names,
            stop: Some(stop),
        }
    }
}

/// Accepts HTTPS connections, records the server name each client asked for, and serves
/// each with the echo app.
async fn serve_tls(
    listener: tokio::net::TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    names: Arc<Mutex<Vec<String>>>,
) {
    let app = echo_app("https");
    while let Ok((stream, _)) = listener.accept().await {
        let (acceptor, names, app) = (acceptor.clone(), names.clone(), app.clone());
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(stream).await else {
                return;
            };
            if let Some(name) = stream.get_ref().1.server_name() {
                names.lock().expect("names").push(name.to_owned());
            }
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app))
                .await;
        });
    }
}

fn echo_app(scheme: &'static str) -> Router {
    Router::new().fallback(echo).with_state(scheme)
}

/// Answers a request as httpbin would.
async fn echo(
    State(scheme): State<&'static str>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> impl IntoResponse {
    let path = uri.path();
    let host = headers
        .get("host")
        .and_then(|h| h.to_str().ok())
        .unwrap_or_default();
    let echoed: serde_json::Map<String, serde_json::Value> = headers
        .iter()
        .map(|(n, v)| {
            let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
            (title_case(n.as_str()), serde_json::Value::String(value))
        })
        .collect();
    let mut answer = serde_json::json!({
        "args": {},
        "headers": echoed,
        "origin": "127.0.0.1",
        "url": format!("{scheme}://{host}{path}"),
    });
    let status = match (method.as_str(), path) {
        ("GET", "/get") => StatusCode::OK,
        ("POST", "/post") => {
            answer["data"] = String::from_utf8_lossy(&body).into_owned().into();
            answer["form"] = serde_json::json!({});
            answer["files"] = serde_json::json!({});
            answer["json"] = serde_json::Value::Null;
            StatusCode::OK
        }
        _ => {
            answer = serde_json::json!({"error": format!("no {method} {path} here")});
            StatusCode::NOT_FOUND
        }
    };
    let text = serde_json::to_string_pretty(&answer).expect("json") + "\n";
    (status, [("content-type", "application/json")], text)
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
