//! The broker against other MQTT peers: Debian's mosquitto clients, a TLS client with a
//! certificate made in the test, and 2,000 concurrent rumqttc clients.

mod common;

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use propeller_broker::server::{BrokerConfig, Credential, EventKind, OfflineCause, TlsSettings};
use rumqttc::{AsyncClient, ConnectReturnCode, MqttOptions, QoS, TlsConfiguration, Transport};
use tokio::process::Command;

async fn run(cmd: &mut Command) -> std::process::Output {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    match tokio::time::timeout(WAIT, cmd.output()).await {
        Ok(Ok(out)) => out,
        Ok(Err(e)) => panic!("cannot run {cmd:?} (is mosquitto-clients installed?): {e}"),
        Err(_) => panic!("{cmd:?} did not finish within {WAIT:?}"),
    }
}

fn mosquitto(tool: &str, port: u16, id: &str, pass: &str) -> Command {
    let mut cmd = Command::new(tool);
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-V", "mqttv311"])
        .args(["-i", id, "-u", id, "-P", pass]);
    cmd
}

#[tokio::test]
async fn mosquitto_clients_connect_with_valid_credentials_only() {
    let mut b = TestBroker::start().await;
    let port = b.addr().port();
    let alive = topic("control/proplet/alive");

    // A subscriber waits for one message; then a publisher sends a heartbeat.
    let mut sub = mosquitto("mosquitto_sub", port, "watcher", "key-w");
    sub.args(["-t", &alive, "-C", "1", "-W", "10", "-q", "1"]);
    sub.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .kill_on_drop(true);
    let sub = match sub.spawn() {
        Ok(child) => child,
        Err(e) => panic!("cannot run mosquitto_sub (is mosquitto-clients installed?): {e}"),
    };
    tokio::time::sleep(Duration::from_millis(300)).await;

    let out = run(mosquitto("mosquitto_pub", port, "dev-a", "key-a").args([
        "-t",
        &alive,
        "-q",
        "1",
        "-m",
        &heartbeat("dev-a"),
    ]))
    .await;
    assert!(out.status.success(), "mosquitto_pub failed: {out:?}");

    let event = b.next_event().await;
    assert_eq!(event.client_id, "dev-a");
    assert!(matches!(event.kind, EventKind::Heartbeat(_)));
    // mosquitto_pub then disconnects cleanly.
    let event = b.next_event().await;
    assert_eq!(
        event.kind,
        EventKind::Offline(OfflineCause::CleanDisconnect)
    );

    let received = match tokio::time::timeout(WAIT, sub.wait_with_output()).await {
        Ok(Ok(out)) => out,
        other => panic!("mosquitto_sub did not finish: {other:?}"),
    };
    assert!(received.status.success(), "{received:?}");
    assert!(String::from_utf8_lossy(&received.stdout).contains("\"dev-a\""));

    // Wrong password and no credentials at all are both refused.
    for args in [vec!["-u", "dev-a", "-P", "nope"], vec![]] {
        let mut cmd = Command::new("mosquitto_pub");
        cmd.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-i", "dev-a"])
            .args(&args)
            .args(["-t", &alive, "-m", &heartbeat("dev-a")]);
        let out = run(&mut cmd).await;
        assert!(!out.status.success(), "refused login succeeded: {args:?}");
    }
    b.assert_no_event(Duration::from_millis(300)).await;
}

/// A broker with only a TLS listener, its certificate self-signed for `localhost` and made
/// here; the broker, its TLS address and the certificate (and the directory holding it).
async fn tls_broker() -> (
    TestBroker,
    std::net::SocketAddr,
    rcgen::CertifiedKey<rcgen::KeyPair>,
    tempfile::TempDir,
) {
    let generated = match rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]) {
        Ok(g) => g,
        Err(e) => panic!("rcgen: {e}"),
    };
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => panic!("{e}"),
    };
    let cert_path = dir.path().join("server.pem");
    let key_path = dir.path().join("server.key");
    let written = std::fs::write(&cert_path, generated.cert.pem())
        .and_then(|_| std::fs::write(&key_path, generated.signing_key.serialize_pem()));
    if let Err(e) = written {
        panic!("{e}");
    }
    let config = BrokerConfig {
        tcp_listen: None,
        tls: Some(TlsSettings {
            listen: ([127, 0, 0, 1], 0).into(),
            cert_path,
            key_path,
            client_ca_path: None,
        }),
        ..BrokerConfig::loopback()
    };
    let b = TestBroker::start_with(config).await;
    let tls_addr = match b.broker.tls_addr() {
        Some(a) => a,
        None => panic!("no TLS listener"),
    };
    (b, tls_addr, generated, dir)
}

#[tokio::test]
async fn tls_listener_accepts_a_client_that_trusts_its_certificate() {
    let (mut b, tls_addr, generated, _dir) = tls_broker().await;
    let mut roots = rustls::RootCertStore::empty();
    if let Err(e) = roots.add(generated.cert.der().clone()) {
        panic!("{e}");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let client_config = match rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
    {
        Ok(b) => b.with_root_certificates(roots).with_no_client_auth(),
        Err(e) => panic!("{e}"),
    };
    let mut opts = MqttOptions::new("dev-a", "localhost", tls_addr.port());
    opts.set_credentials("dev-a", "key-a");
    opts.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
        Arc::new(client_config),
    )));
    let _client = b.heartbeat_arrives(opts).await;

    // A plaintext client on the TLS port gets no session.
    let (_c, mut el) = AsyncClient::new(options(tls_addr, "dev-b", "dev-b", "key-b"), 8);
    assert_ne!(connack(&mut el).await, Some(ConnectReturnCode::Success));
}

/// The TLS listener speaks TLS 1.2 and 1.3 only, with forward-secret AEAD suites only:
/// OpenSSL's own client, allowed to offer anything, is refused TLS 1.0, 1.1 and a TLS 1.2
/// suite without ECDHE or without AES-GCM/ChaCha20.
#[tokio::test]
async fn tls_listener_speaks_tls_1_2_and_1_3_with_forward_secret_aead_suites_only() {
    let (_b, tls_addr, _generated, _dir) = tls_broker().await;
    let connect = tls_addr.to_string();
    let handshake = |args: &[&str]| {
        let mut cmd = Command::new("openssl");
        cmd.args(["s_client", "-connect", &connect, "-servername", "localhost"])
            .args(args);
        cmd
    };
    let cases: [(&[&str], bool); 7] = [
        (&["-tls1_3"], true),
        (&["-tls1_2"], true),
        (
            &["-tls1_2", "-cipher", "ECDHE-ECDSA-AES128-GCM-SHA256"],
            true,
        ),
        (&["-tls1_1", "-cipher", "DEFAULT:@SECLEVEL=0"], false),
        (&["-tls1", "-cipher", "DEFAULT:@SECLEVEL=0"], false),
        (
            &["-tls1_2", "-cipher", "AES128-GCM-SHA256:@SECLEVEL=0"],
            false,
        ),
        (
            &["-tls1_2", "-cipher", "ECDHE-ECDSA-AES128-SHA:@SECLEVEL=0"],
            false,
        ),
    ];
    for (args, accepted) in cases {
        let out = run(&mut handshake(args)).await;
        let text = String::from_utf8_lossy(&out.stdout);
        let established = text.contains("Cipher is ") && !text.contains("Cipher is (NONE)");
        assert_eq!(
            established,
            accepted,
            "openssl s_client {args:?}:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test]
async fn two_thousand_concurrent_clients_are_all_heard() {
    const CLIENTS: usize = 2000;
    const BEATS: usize = 2;
    let mut b = TestBroker::start().await;
    for i in 0..CLIENTS {
        b.store
            .insert(format!("p{i}"), Credential::proplet(format!("k{i}")));
    }
    let addr = b.addr();
    let mut clients = Vec::with_capacity(CLIENTS);
    for i in 0..CLIENTS {
        clients.push(tokio::spawn(async move {
            let id = format!("p{i}");
            let mut opts = options(addr, &id, &id, &format!("k{i}"));
            opts.set_keep_alive(Duration::from_secs(60));
            let (client, mut eventloop) = AsyncClient::new(opts, 16);
            for _ in 0..BEATS {
                if let Err(e) = client
                    .publish(
                        topic("control/proplet/alive"),
                        QoS::AtLeastOnce,
                        false,
                        heartbeat(&id),
                    )
                    .await
                {
                    panic!("{id}: {e}");
                }
            }
            // Drive the connection until both PUBACKs are in, then keep it open. Like a real
            // device, retry when the connect attempt times out on a loaded machine; rumqttc
            // resends unacknowledged publishes after reconnecting.
            let mut acked = 0;
            let mut failures = 0;
            while acked < BEATS {
                match eventloop.poll().await {
                    Ok(rumqttc::Event::Incoming(rumqttc::Packet::PubAck(_))) => acked += 1,
                    Ok(_) => {}
                    Err(e) if failures < 5 => {
                        failures += 1;
                        eprintln!("{id}: retrying after {e}");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    Err(e) => panic!("{id}: {e}"),
                }
            }
            (client, eventloop)
        }));
    }
    let mut heard: HashMap<String, usize> = HashMap::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    // QoS 1 allows a duplicate after a retried connect, so count clients fully heard.
    let mut complete = 0;
    while complete < CLIENTS {
        let event = match tokio::time::timeout_at(deadline, b.events.recv()).await {
            Ok(Some(e)) => e,
            Ok(None) => panic!("event stream closed"),
            Err(_) => panic!("only {complete} of {CLIENTS} clients fully heard within 120 s"),
        };
        if let EventKind::Heartbeat(h) = &event.kind {
            assert_eq!(h.proplet_id, event.client_id);
            let count = heard.entry(event.client_id).or_default();
            *count += 1;
            if *count == BEATS {
                complete += 1;
            }
        }
    }
    assert_eq!(heard.len(), CLIENTS);
    let mut still_open = Vec::with_capacity(CLIENTS);
    for c in clients {
        match c.await {
            Ok(pair) => still_open.push(pair),
            Err(e) => panic!("client task failed: {e}"),
        }
    }
    assert_eq!(b.broker.metrics().connected_clients(), CLIENTS as i64);
}

#[tokio::test]
async fn websocket_listener_carries_mqtt() {
    let config = BrokerConfig {
        websocket_listen: Some(([127, 0, 0, 1], 0).into()),
        ..BrokerConfig::loopback()
    };
    let mut b = TestBroker::start_with(config).await;
    let ws = match b.broker.websocket_addr() {
        Some(a) => a,
        None => panic!("no websocket listener"),
    };
    let mut opts = MqttOptions::new("dev-a", format!("ws://{ws}/mqtt"), ws.port());
    opts.set_credentials("dev-a", "key-a");
    opts.set_transport(Transport::Ws);
    let _client = b.heartbeat_arrives(opts).await;

    // A silent socket on the websocket port is dropped after the handshake deadline and
    // does not hold up others (the connect above went through with it open).
    let _idle = tokio::net::TcpStream::connect(ws).await;
    let (_c, mut el) = AsyncClient::new(options(b.addr(), "dev-b", "dev-b", "key-b"), 8);
    assert_eq!(connack(&mut el).await, Some(ConnectReturnCode::Success));
}

#[tokio::test]
async fn tls_listener_can_require_client_certificates() {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
    let mut ca_params =
        CertificateParams::new(Vec::<String>::new()).unwrap_or_else(|e| panic!("{e}"));
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params
        .self_signed(&ca_key)
        .unwrap_or_else(|e| panic!("{e}"));
    let issuer = Issuer::new(ca_params, ca_key);
    let issue = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap_or_else(|e| panic!("{e}"));
        let params = CertificateParams::new(names).unwrap_or_else(|e| panic!("{e}"));
        let cert = params
            .signed_by(&key, &issuer)
            .unwrap_or_else(|e| panic!("{e}"));
        (cert, key)
    };
    let (server_cert, server_key) = issue(vec!["localhost".into()]);
    let (client_cert, client_key) = issue(vec!["dev-a".into()]);

    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{e}"));
        path
    };
    let config = BrokerConfig {
        tcp_listen: None,
        tls: Some(TlsSettings {
            listen: ([127, 0, 0, 1], 0).into(),
            cert_path: write("server.pem", server_cert.pem()),
            key_path: write("server.key", server_key.serialize_pem()),
            client_ca_path: Some(write("ca.pem", ca.pem())),
        }),
        ..BrokerConfig::loopback()
    };
    let mut b = TestBroker::start_with(config).await;
    let port = b.broker.tls_addr().map(|a| a.port()).unwrap_or_default();

    let client_config = |with_cert: bool| {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(ca.der().clone())
            .unwrap_or_else(|e| panic!("{e}"));
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap_or_else(|e| panic!("{e}"))
            .with_root_certificates(roots);
        let config = if with_cert {
            let key = rustls::pki_types::PrivateKeyDer::try_from(client_key.serialize_der())
                .unwrap_or_else(|e| panic!("{e}"));
            builder
                .with_client_auth_cert(vec![client_cert.der().clone()], key)
                .unwrap_or_else(|e| panic!("{e}"))
        } else {
            builder.with_no_client_auth()
        };
        let mut opts = MqttOptions::new("dev-a", "localhost", port);
        opts.set_credentials("dev-a", "key-a");
        opts.set_transport(Transport::tls_with_config(TlsConfiguration::Rustls(
            Arc::new(config),
        )));
        opts
    };
    let (_c, mut el) = AsyncClient::new(client_config(false), 8);
    assert_ne!(connack(&mut el).await, Some(ConnectReturnCode::Success));
    let _client = b.heartbeat_arrives(client_config(true)).await;
}
