//! Connections that open and then stall, against real listeners on loopback with a short
//! deadline: each is closed by the deadline meant for it, the meters say which, and the
//! connection cap holds while real devices still get in once the stalled ones are gone.
//! Each case prints how long the broker took to close the socket.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use propeller_broker::server::{BrokerConfig, TlsSettings};
use rumqttc::{AsyncClient, ConnectReturnCode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The deadline under test: short, so the cases run in a few seconds.
const DEADLINE: Duration = Duration::from_millis(700);

/// A broker with all three listeners and [`DEADLINE`] as its connect and handshake timeout.
struct Listeners {
    broker: TestBroker,
    _dir: tempfile::TempDir,
}

impl Listeners {
    async fn start(max_connections: usize) -> Self {
        let generated = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])
            .unwrap_or_else(|e| panic!("rcgen: {e}"));
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let cert_path = dir.path().join("server.pem");
        let key_path = dir.path().join("server.key");
        std::fs::write(&cert_path, generated.cert.pem())
            .and_then(|_| std::fs::write(&key_path, generated.signing_key.serialize_pem()))
            .unwrap_or_else(|e| panic!("{e}"));
        let config = BrokerConfig {
            tls: Some(TlsSettings {
                listen: ([127, 0, 0, 1], 0).into(),
                cert_path,
                key_path,
                client_ca_path: None,
            }),
            websocket_listen: Some(([127, 0, 0, 1], 0).into()),
            connect_timeout: DEADLINE,
            max_connections,
            ..BrokerConfig::loopback()
        };
        Self {
            broker: TestBroker::start_with(config).await,
            _dir: dir,
        }
    }

    fn tcp(&self) -> SocketAddr {
        self.broker.addr()
    }

    fn tls(&self) -> SocketAddr {
        self.broker
            .broker
            .tls_addr()
            .unwrap_or_else(|| panic!("no TLS listener"))
    }

    fn ws(&self) -> SocketAddr {
        self.broker
            .broker
            .websocket_addr()
            .unwrap_or_else(|| panic!("no websocket listener"))
    }

    fn refused(&self, reason: &'static str) -> u64 {
        self.broker.broker.metrics().refused_connections(reason)
    }

    /// Waits (up to [`WAIT`]) until the count of `reason` is `expected`: a connection task
    /// counts its end just after it closes the socket.
    async fn refused_reaches(&self, reason: &'static str, expected: u64) {
        let counted = || self.refused(reason);
        eventually(counted, expected, reason).await;
    }
}

/// Polls `read` until it returns `expected`; panics with the last value after [`WAIT`].
async fn eventually(read: impl Fn() -> u64, expected: u64, what: &str) {
    let deadline = Instant::now() + WAIT;
    while read() != expected {
        if Instant::now() > deadline {
            panic!("{what}: counted {}, expected {expected}", read());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn open(addr: SocketAddr) -> TcpStream {
    TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"))
}

/// Sends `first` (possibly nothing), then stays silent and reads until the broker closes the
/// socket; returns how long that took. Panics if it stays open for [`WAIT`].
async fn stall(addr: SocketAddr, first: &[u8], what: &str) -> Duration {
    let mut socket = open(addr).await;
    let started = Instant::now();
    if !first.is_empty() {
        socket
            .write_all(first)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    let closed = wait_closed(&mut socket, what).await;
    let elapsed = closed.duration_since(started);
    println!("{what}: closed by the broker after {elapsed:?} (deadline {DEADLINE:?})");
    elapsed
}

/// Reads (discarding whatever the broker sends) until end of stream or an error.
async fn wait_closed(socket: &mut TcpStream, what: &str) -> Instant {
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + WAIT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, socket.read(&mut buffer)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Instant::now(),
            Ok(Ok(_)) => {}
            Err(_) => panic!("{what}: still open after {WAIT:?}"),
        }
    }
}

/// MQTT 3.1.1 CONNECT with clean session, the given keep-alive, username and password.
fn mqtt_connect(client_id: &str, password: &str, keep_alive: u16) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0b1100_0010];
    body.extend_from_slice(&keep_alive.to_be_bytes());
    for field in [client_id, client_id, password] {
        body.extend_from_slice(&(field.len() as u16).to_be_bytes());
        body.extend_from_slice(field.as_bytes());
    }
    assert!(body.len() < 128, "one-byte remaining length");
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend_from_slice(&body);
    packet
}

/// The first flight of a real TLS client (its ClientHello), which then never answers.
fn client_hello() -> Vec<u8> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap_or_else(|e| panic!("{e}"))
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth();
    let name =
        rustls::pki_types::ServerName::try_from("localhost").unwrap_or_else(|e| panic!("{e}"));
    let mut client =
        rustls::ClientConnection::new(Arc::new(config), name).unwrap_or_else(|e| panic!("{e}"));
    let mut hello = Vec::new();
    while client.wants_write() {
        client
            .write_tls(&mut hello)
            .unwrap_or_else(|e| panic!("{e}"));
    }
    assert!(
        hello.len() > 100,
        "a ClientHello, got {} bytes",
        hello.len()
    );
    hello
}

/// Half of a websocket upgrade request: the request line and some headers, no blank line.
const HALF_UPGRADE: &[u8] = b"GET /mqtt HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";

#[tokio::test]
async fn a_socket_that_sends_nothing_is_closed_by_the_connect_deadline() {
    let l = Listeners::start(100).await;
    stall(l.tcp(), &[], "tcp, nothing sent").await;
    l.refused_reaches("connect_timeout", 1).await;
}

#[tokio::test]
async fn half_a_connect_is_closed_by_the_connect_deadline() {
    let l = Listeners::start(100).await;
    let connect = mqtt_connect("dev-a", "key-a", 60);
    stall(
        l.tcp(),
        &connect[..connect.len() / 2],
        "tcp, half a CONNECT",
    )
    .await;
    l.refused_reaches("connect_timeout", 1).await;
    // No session was ever opened for it.
    assert_eq!(l.broker.broker.metrics().connected_clients(), 0);
}

#[tokio::test]
async fn a_connect_then_silence_is_closed_by_its_keep_alive() {
    let l = Listeners::start(100).await;
    // Keep-alive 1 s: rumqttd allows 1.5 times that.
    let elapsed = stall(
        l.tcp(),
        &mqtt_connect("dev-a", "key-a", 1),
        "tcp, CONNECT then silence",
    )
    .await;
    assert!(
        elapsed >= Duration::from_secs(1),
        "closed after {elapsed:?}, before its keep-alive"
    );
    let metrics = l.broker.broker.metrics().clone();
    eventually(|| metrics.keep_alive_expiries(), 1, "keep-alive expiries").await;
    l.refused_reaches("connect_timeout", 0).await;
}

#[tokio::test]
async fn a_connect_with_a_wrong_key_then_silence_is_closed_at_once() {
    let l = Listeners::start(100).await;
    stall(
        l.tcp(),
        &mqtt_connect("dev-a", "wrong", 60),
        "tcp, refused CONNECT then silence",
    )
    .await;
    assert_eq!(
        l.broker
            .broker
            .metrics()
            .auth_failures(propeller_broker::server::AuthFailure::WrongKey),
        1
    );
    l.refused_reaches("connect_timeout", 0).await;
}

#[tokio::test]
async fn a_tls_handshake_left_half_done_is_closed_by_the_handshake_deadline() {
    let l = Listeners::start(100).await;
    stall(l.tls(), &client_hello(), "tls, ClientHello then silence").await;
    stall(l.tls(), &[], "tls, nothing sent").await;
    l.refused_reaches("tls_handshake_timeout", 2).await;
}

#[tokio::test]
async fn a_websocket_upgrade_left_half_done_is_closed_by_the_handshake_deadline() {
    let l = Listeners::start(100).await;
    stall(l.ws(), HALF_UPGRADE, "websocket, half an upgrade request").await;
    stall(l.ws(), &[], "websocket, nothing sent").await;
    l.refused_reaches("websocket_handshake_timeout", 2).await;
}

/// Stalled sockets of every kind fill the cap: the next socket is closed at once and
/// counted; once the deadlines have closed them, a real device gets in.
#[tokio::test]
async fn the_cap_holds_against_stalled_sockets_and_devices_get_in_after_their_deadline() {
    const CAP: usize = 8;
    let l = Listeners::start(CAP).await;
    let connect = mqtt_connect("dev-a", "key-a", 60);
    let hello = client_hello();
    let mut stalled = Vec::new();
    for i in 0..CAP {
        let (addr, first): (SocketAddr, &[u8]) = match i % 4 {
            0 => (l.tcp(), &[]),
            1 => (l.tcp(), &connect[..5]),
            2 => (l.tls(), &hello),
            _ => (l.ws(), HALF_UPGRADE),
        };
        let mut socket = open(addr).await;
        socket
            .write_all(first)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        stalled.push(socket);
    }
    // The cap is taken as sockets are accepted; give the accept loops a moment.
    tokio::time::sleep(DEADLINE / 4).await;
    let mut extra = open(l.tcp()).await;
    wait_closed(&mut extra, "the socket over the cap").await;
    l.refused_reaches("max_connections", 1).await;

    let started = Instant::now();
    for (i, socket) in stalled.iter_mut().enumerate() {
        wait_closed(socket, &format!("stalled socket {i}")).await;
    }
    println!(
        "{CAP} stalled sockets all closed {:?} after the cap refused one",
        started.elapsed()
    );
    let (_client, mut eventloop) = AsyncClient::new(options(l.tcp(), "dev-b", "dev-b", "key-b"), 8);
    assert_eq!(
        connack(&mut eventloop).await,
        Some(ConnectReturnCode::Success)
    );
    let m = l.broker.broker.metrics();
    // Half the stalled sockets were plain TCP (nothing, or a few bytes of a CONNECT).
    l.refused_reaches("connect_timeout", 4).await;
    l.refused_reaches("tls_handshake_timeout", 2).await;
    l.refused_reaches("websocket_handshake_timeout", 2).await;
    assert_eq!(m.connected_clients(), 1);
}
