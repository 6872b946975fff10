//! Public listeners in front of rumqttd's connection handling.
//!
//! rumqttd's `Server::start` binds its own socket (so it cannot report an ephemeral port) and
//! runs the TLS handshake inside its accept loop with no timeout, so one silent client stalls
//! every other connect. Our listeners accept on the public addresses, enforce the connection
//! cap, run each TLS or websocket handshake in its own task under a deadline, and then hand
//! the stream to rumqttd (`Server::serve_connection`, from our patch of rumqttd) in the same
//! task. A connection costs one socket, with no relay in between. MQTT-level timeouts (CONNECT
//! wait, keep-alive) remain rumqttd's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use rumqttd::{ConnectionEnd, Server};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

use super::guard::Guard;
use super::metrics::BrokerMetrics;
use super::BrokerError;

/// PEM files for the TLS listener.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    /// Where to listen, e.g. `0.0.0.0:8883`.
    pub listen: SocketAddr,
    /// Server certificate chain (PEM).
    pub cert_path: PathBuf,
    /// Server private key (PEM).
    pub key_path: PathBuf,
    /// When set, clients must present a certificate signed by one of these CAs (PEM).
    pub client_ca_path: Option<PathBuf>,
}

/// Builds the TLS acceptor, with rustls on the `ring` provider chosen explicitly (the process
/// also hosts kube's TLS stack, so nothing is left to a process-wide default).
pub fn tls_acceptor(settings: &TlsSettings) -> Result<TlsAcceptor, BrokerError> {
    let tls_error = |what: &str, path: &PathBuf, detail: String| BrokerError::Tls {
        message: format!("{what} {}: {detail}", path.display()),
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&settings.cert_path)
        .map_err(|e| {
            tls_error(
                "cannot read certificate",
                &settings.cert_path,
                e.to_string(),
            )
        })?
        .collect::<Result<_, _>>()
        .map_err(|e| tls_error("bad certificate", &settings.cert_path, e.to_string()))?;
    if certs.is_empty() {
        return Err(tls_error(
            "no certificate in",
            &settings.cert_path,
            "expected a PEM CERTIFICATE block".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&settings.key_path)
        .map_err(|e| tls_error("cannot read private key", &settings.key_path, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| BrokerError::Tls {
            message: e.to_string(),
        })?;
    let builder = match &settings.client_ca_path {
        None => builder.with_no_client_auth(),
        Some(ca_path) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca_path)
                .map_err(|e| tls_error("cannot read client CA", ca_path, e.to_string()))?
            {
                let cert = cert.map_err(|e| tls_error("bad client CA", ca_path, e.to_string()))?;
                roots
                    .add(cert)
                    .map_err(|e| tls_error("unusable client CA", ca_path, e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| tls_error("client CA rejected", ca_path, e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        tls_error(
            "key does not match certificate",
            &settings.key_path,
            e.to_string(),
        )
    })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Everything a front listener needs per connection.
#[derive(Clone)]
pub(crate) struct Intake {
    /// rumqttd's connection handling, shared by every listener.
    pub(crate) core: Arc<Server<Guard>>,
    /// The same for connections that came over TLS (its logins know they are encrypted).
    pub(crate) encrypted_core: Arc<Server<Guard>>,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) handshake_timeout: Duration,
    pub(crate) metrics: BrokerMetrics,
}

/// How a public listener turns an accepted socket into an MQTT byte stream.
#[derive(Clone)]
pub(crate) enum Front {
    /// MQTT directly over TCP.
    Plain,
    /// MQTT over TLS.
    Tls(TlsAcceptor),
    /// MQTT over websocket (binary frames, subprotocol `mqtt`).
    WebSocket,
}

/// Accepts on `listener` until the task is aborted, handing each connection to rumqttd.
pub(crate) async fn serve(listener: TcpListener, intake: Intake, front: Front) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Reap finished connections so the set does not grow with the connection count.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(error) => {
                // Typically EMFILE: back off briefly instead of spinning.
                warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = intake.slots.clone().try_acquire_owned() else {
            intake.metrics.refused_connection("max_connections");
            warn!(%peer, "connection refused: connection limit reached");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let intake = intake.clone();
        let front = front.clone();
        connections.spawn(async move {
            let _permit = permit;
            serve_one(stream, peer, &intake, front).await;
        });
    }
}

/// Runs one accepted connection to its end. A plain connection's task holds only rumqttd's
/// link: the TLS and websocket arms, whose handshake and bridge state are larger, are boxed
/// so that they do not size every plain connection's task.
async fn serve_one(stream: TcpStream, peer: SocketAddr, intake: &Intake, front: Front) {
    match front {
        Front::Plain => {
            let end = intake.core.serve_connection(stream).await;
            count_end(&intake.metrics, end);
        }
        Front::WebSocket => Box::pin(pipe_websocket(stream, intake, peer)).await,
        Front::Tls(acceptor) => Box::pin(serve_tls(stream, peer, intake, acceptor)).await,
    }
}

/// Runs the TLS handshake under the handshake deadline, then the MQTT connection over it.
async fn serve_tls(stream: TcpStream, peer: SocketAddr, intake: &Intake, acceptor: TlsAcceptor) {
    match tokio::time::timeout(intake.handshake_timeout, acceptor.accept(stream)).await {
        Ok(Ok(tls_stream)) => {
            let end = intake.encrypted_core.serve_connection(tls_stream).await;
            count_end(&intake.metrics, end);
        }
        Ok(Err(error)) => {
            intake.metrics.refused_connection("tls_handshake_failed");
            debug!(%peer, %error, "TLS handshake failed");
        }
        Err(_) => {
            intake.metrics.refused_connection("tls_handshake_timeout");
            debug!(%peer, "TLS handshake timed out");
        }
    }
}

/// Relays MQTT carried in websocket binary frames. The handshake runs under the same
/// deadline as TLS handshakes.
async fn pipe_websocket(stream: TcpStream, intake: &Intake, peer: SocketAddr) {
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
    use tokio_tungstenite::tungstenite::http::HeaderValue;
    use tokio_tungstenite::tungstenite::Message;

    // The closure's signature (and its large error type) is tungstenite's `Callback`.
    #[allow(clippy::result_large_err)]
    let offer_mqtt = |request: &Request, mut response: Response| {
        let offered = request
            .headers()
            .get_all("sec-websocket-protocol")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim() == "mqtt");
        if offered {
            response
                .headers_mut()
                .insert("sec-websocket-protocol", HeaderValue::from_static("mqtt"));
        }
        Ok(response)
    };
    let handshake = tokio_tungstenite::accept_hdr_async(stream, offer_mqtt);
    let websocket = match tokio::time::timeout(intake.handshake_timeout, handshake).await {
        Ok(Ok(ws)) => ws,
        Ok(Err(error)) => {
            intake
                .metrics
                .refused_connection("websocket_handshake_failed");
            debug!(%peer, %error, "websocket handshake failed");
            return;
        }
        Err(_) => {
            intake
                .metrics
                .refused_connection("websocket_handshake_timeout");
            debug!(%peer, "websocket handshake timed out");
            return;
        }
    };
    // rumqttd reads and writes a byte stream: an in-memory pipe carries the frames' bytes.
    let (bridge_end, core_end) = tokio::io::duplex(WEBSOCKET_PIPE_BUFFER);
    let (mut ws_out, mut ws_in) = websocket.split();
    let (mut core_in, mut core_out) = tokio::io::split(bridge_end);
    let upstream = async {
        while let Some(message) = ws_in.next().await {
            match message {
                Ok(Message::Binary(bytes)) => {
                    if core_out.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
                Ok(Message::Close(_)) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = core_out.shutdown().await;
    };
    let downstream = async {
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            match core_in.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let frame = Message::Binary(buffer[..n].to_vec().into());
                    if ws_out.send(frame).await.is_err() {
                        break;
                    }
                }
            }
        }
        let _ = ws_out.close().await;
    };
    // Either side closing ends the bridge, and dropping the bridge's end of the pipe ends
    // rumqttd's connection. rumqttd's side is never cancelled: it must tell its router.
    let bridge = async {
        tokio::select! {
            _ = upstream => {}
            _ = downstream => {}
        }
    };
    let (end, ()) = tokio::join!(intake.core.serve_connection(core_end), bridge);
    count_end(&intake.metrics, end);
}

/// Counts connections that a deadline closed, or that never became an MQTT session. Refused
/// logins are counted by the guard, which knows why (`auth_failures`).
fn count_end(metrics: &BrokerMetrics, end: ConnectionEnd) {
    match end {
        ConnectionEnd::ConnectTimeout => metrics.refused_connection("connect_timeout"),
        ConnectionEnd::ClosedBeforeConnect => metrics.refused_connection("closed_before_connect"),
        ConnectionEnd::KeepAliveTimeout => metrics.keep_alive_expired(),
        ConnectionEnd::ConnectRefused | ConnectionEnd::LinkFailed | ConnectionEnd::Ended => {}
    }
}

/// Bytes buffered per direction between a websocket and rumqttd.
const WEBSOCKET_PIPE_BUFFER: usize = 16 * 1024;
