//! Public listeners in front of rumqttd.
//!
//! rumqttd's `Server` binds its own socket (so it cannot report an ephemeral port) and runs
//! the TLS handshake inside its accept loop with no timeout, so one silent client stalls every
//! other connect. Our listeners accept on the public addresses, enforce the connection cap,
//! run each TLS handshake in its own task under a deadline, and then relay bytes to rumqttd's
//! plain listener on a loopback port. MQTT-level timeouts (CONNECT wait, keep-alive) remain
//! rumqttd's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, warn};

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
pub(crate) fn tls_acceptor(settings: &TlsSettings) -> Result<TlsAcceptor, BrokerError> {
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
pub(crate) struct Relay {
    pub(crate) backend: SocketAddr,
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

/// Accepts on `listener` until the task is aborted, relaying each connection to rumqttd.
pub(crate) async fn serve(listener: TcpListener, relay: Relay, front: Front) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // Reap finished relays so the set does not grow with the connection count.
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
        let Ok(permit) = relay.slots.clone().try_acquire_owned() else {
            relay.metrics.refused_connection("max_connections");
            warn!(%peer, "connection refused: connection limit reached");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let relay = relay.clone();
        let front = front.clone();
        connections.spawn(async move {
            let _permit = permit;
            match front {
                Front::Plain => pipe(stream, &relay, peer).await,
                Front::WebSocket => pipe_websocket(stream, &relay, peer).await,
                Front::Tls(acceptor) => {
                    match tokio::time::timeout(relay.handshake_timeout, acceptor.accept(stream))
                        .await
                    {
                        Ok(Ok(tls_stream)) => pipe(tls_stream, &relay, peer).await,
                        Ok(Err(error)) => {
                            relay.metrics.refused_connection("tls_handshake_failed");
                            debug!(%peer, %error, "TLS handshake failed");
                        }
                        Err(_) => {
                            relay.metrics.refused_connection("tls_handshake_timeout");
                            debug!(%peer, "TLS handshake timed out");
                        }
                    }
                }
            }
        });
    }
}

async fn pipe<S>(mut client: S, relay: &Relay, peer: SocketAddr)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let Some(mut backend) = backend_for(relay, peer).await else {
        return;
    };
    // 4 KiB each way instead of tokio's 8 KiB: device traffic is small packets, and at ten
    // thousand connections the buffers are a large part of the broker's memory.
    if let Err(error) = tokio::io::copy_bidirectional_with_sizes(
        &mut client,
        &mut backend,
        RELAY_BUFFER,
        RELAY_BUFFER,
    )
    .await
    {
        debug!(%peer, %error, "connection ended");
    }
}

/// Relays MQTT carried in websocket binary frames. The handshake runs under the same
/// deadline as TLS handshakes.
async fn pipe_websocket(stream: TcpStream, relay: &Relay, peer: SocketAddr) {
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
    let websocket = match tokio::time::timeout(relay.handshake_timeout, handshake).await {
        Ok(Ok(ws)) => ws,
        Ok(Err(error)) => {
            relay
                .metrics
                .refused_connection("websocket_handshake_failed");
            debug!(%peer, %error, "websocket handshake failed");
            return;
        }
        Err(_) => {
            relay
                .metrics
                .refused_connection("websocket_handshake_timeout");
            debug!(%peer, "websocket handshake timed out");
            return;
        }
    };
    let Some(backend) = backend_for(relay, peer).await else {
        return;
    };
    let (mut ws_out, mut ws_in) = websocket.split();
    let (mut core_in, mut core_out) = tokio::io::split(backend);
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
    // Either side closing ends the relay; dropping the other half closes its socket.
    tokio::select! {
        _ = upstream => {}
        _ = downstream => {}
    }
}

/// Bytes buffered per direction of a relayed connection.
const RELAY_BUFFER: usize = 4096;

/// Our end of a connection to rumqttd. rumqttd leaves Nagle's algorithm on for its
/// sockets, so a small packet it sends right after another (a start request after a PUBACK)
/// is held until we acknowledge the first, and Linux delays that ACK by up to 40 ms. Asking
/// for an immediate ACK after every read takes that wait out of each command's latency.
struct CoreConnection(TcpStream);

impl AsyncRead for CoreConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.0).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            #[cfg(any(target_os = "linux", target_os = "android"))]
            let _ = self.0.set_quickack(true);
        }
        polled
    }
}

impl AsyncWrite for CoreConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The rumqttd connection for one client, or `None` (counted and logged) if unreachable.
async fn backend_for(relay: &Relay, peer: SocketAddr) -> Option<CoreConnection> {
    match connect_backend(relay.backend).await {
        Ok(stream) => Some(CoreConnection(stream)),
        Err(error) => {
            relay.metrics.refused_connection("backend_unavailable");
            warn!(%peer, %error, "broker core not reachable");
            None
        }
    }
}

/// Connects to rumqttd's loopback listener, waiting briefly for it right after start-up.
async fn connect_backend(addr: SocketAddr) -> std::io::Result<TcpStream> {
    let mut attempt = 0;
    loop {
        match TcpStream::connect(addr).await {
            Ok(stream) => {
                let _ = stream.set_nodelay(true);
                return Ok(stream);
            }
            Err(error) if attempt < 40 && error.kind() == std::io::ErrorKind::ConnectionRefused => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
            Err(error) => return Err(error),
        }
    }
}
