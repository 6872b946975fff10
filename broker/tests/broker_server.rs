//! The embedded broker over real loopback MQTT: authentication, anti-spoofing, events,
//! Offline detection, subscription rules, commands, TLS and idle-socket handling.

mod common;

use std::time::Duration;

use common::*;
use propeller_broker::protocol::{Channel, StopRequest};
use propeller_broker::server::{
    AuthFailure, BrokerConfig, Credential, DropReason, EventKind, KindLabel, OfflineCause,
};
use rumqttc::{AsyncClient, ConnectReturnCode, LastWill, QoS};
use tokio::io::AsyncWriteExt;

const QUIET: Duration = Duration::from_millis(400);

#[tokio::test]
async fn valid_credentials_connect_and_others_are_refused() {
    let b = TestBroker::start().await;
    let addr = b.addr();
    let cases = [
        ("dev-a", "dev-a", "key-a", true),
        ("dev-a", "dev-a", "wrong", false),
        ("dev-a", "", "", false),
        ("dev-a", "dev-b", "key-b", false),
        ("ghost", "ghost", "key-a", false),
    ];
    for (id, user, pass, ok) in cases {
        let (_client, mut eventloop) = AsyncClient::new(options(addr, id, user, pass), 8);
        let code = connack(&mut eventloop).await;
        assert_eq!(
            code == Some(ConnectReturnCode::Success),
            ok,
            "{id}/{user}: got {code:?}"
        );
    }
    let m = b.broker.metrics();
    assert_eq!(m.auth_failures(AuthFailure::WrongKey), 1);
    assert_eq!(m.auth_failures(AuthFailure::Anonymous), 1);
    assert_eq!(m.auth_failures(AuthFailure::UsernameMismatch), 1);
    assert_eq!(m.auth_failures(AuthFailure::UnknownClient), 1);
}

#[tokio::test]
async fn credential_changes_apply_without_restart() {
    let b = TestBroker::start().await;
    let addr = b.addr();
    let (_c, mut el) = AsyncClient::new(options(addr, "new-dev", "new-dev", "k"), 8);
    assert_eq!(connack(&mut el).await, None);
    b.store.insert("new-dev", Credential::proplet("k"));
    let (_c, mut el) = AsyncClient::new(options(addr, "new-dev", "new-dev", "k"), 8);
    assert_eq!(connack(&mut el).await, Some(ConnectReturnCode::Success));
    b.store.remove("new-dev");
    let (_c, mut el) = AsyncClient::new(options(addr, "new-dev", "new-dev", "k"), 8);
    assert_eq!(connack(&mut el).await, None);
}

#[tokio::test]
async fn heartbeat_becomes_an_event_tagged_with_the_publisher() {
    let mut b = TestBroker::start().await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
        .await;
    let event = b.next_event().await;
    assert_eq!(event.client_id, "dev-a");
    assert_eq!(event.domain.as_deref(), Some(DOMAIN));
    assert_eq!(event.channel.as_deref(), Some(CHANNEL));
    match event.kind {
        EventKind::Heartbeat(h) => assert_eq!(h.proplet_id, "dev-a"),
        other => panic!("expected a heartbeat, got {other:?}"),
    }
    assert_eq!(b.broker.metrics().messages_in(KindLabel::alive), 1);
}

#[tokio::test]
async fn reports_naming_another_proplet_are_dropped_and_counted() {
    let mut b = TestBroker::start().await;
    let mut watcher = connect_as(b.addr(), "watcher", "key-w").await;
    watcher.subscribe(&topic("control/proplet/+")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-b"))
        .await;
    a.publish(
        &topic("control/proplet/results"),
        r#"{"task_id":"t1","proplet_id":"dev-b","result":"42"}"#,
    )
    .await;
    // A genuine one afterwards proves the stream still flows and ordering is kept.
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
        .await;
    let event = b.next_event().await;
    assert_eq!(event.client_id, "dev-a");
    assert!(matches!(event.kind, EventKind::Heartbeat(ref h) if h.proplet_id == "dev-a"));
    assert_eq!(b.broker.metrics().dropped_publishes(DropReason::Spoofed), 2);
    // Other subscribers never see the spoofed messages either.
    let seen = watcher.next_publish().await;
    assert!(
        String::from_utf8_lossy(&seen.payload).contains("\"dev-a\""),
        "{:?}",
        seen.payload
    );
    watcher.assert_no_publish(QUIET).await;
}

#[tokio::test]
async fn devices_cannot_publish_commands() {
    let mut b = TestBroker::start().await;
    let mut victim = connect_as(b.addr(), "dev-b", "key-b").await;
    victim.subscribe(&topic("control/manager/start")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(
        &topic("control/manager/start"),
        r#"{"id":"t","name":"evil","function_name":"main","file":"AA=="}"#,
    )
    .await;
    victim.assert_no_publish(QUIET).await;
    assert_eq!(
        b.broker
            .metrics()
            .dropped_publishes(DropReason::ForbiddenTopic),
        1
    );
    b.assert_no_event(Duration::from_millis(50)).await;
}

#[tokio::test]
async fn device_wildcard_subscriptions_receive_nothing() {
    let b = TestBroker::start().await;
    let mut snoop = connect_as(b.addr(), "dev-b", "key-b").await;
    snoop.subscribe("#").await;
    snoop.subscribe(&topic("control/proplet/alive")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
        .await;
    snoop.assert_no_publish(QUIET).await;
    assert_eq!(b.broker.metrics().denied_subscriptions(), 2);
}

#[tokio::test]
async fn malformed_payloads_are_counted_and_the_stream_goes_on() {
    let mut b = TestBroker::start().await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(&topic("control/proplet/alive"), "{not json")
        .await;
    a.publish(&topic("control/proplet/results"), vec![0xff, 0x00, 0x13])
        .await;
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
        .await;
    let event = b.next_event().await;
    assert!(matches!(event.kind, EventKind::Heartbeat(_)));
    let m = b.broker.metrics();
    assert_eq!(m.decode_errors(KindLabel::alive), 1);
    assert_eq!(m.decode_errors(KindLabel::results), 1);
}

#[tokio::test]
async fn commands_from_the_operator_reach_devices() {
    let b = TestBroker::start().await;
    let mut dev = connect_as(b.addr(), "dev-a", "key-a").await;
    dev.subscribe(&topic("control/manager/stop")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let channel = match Channel::new(DOMAIN, CHANNEL) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    };
    let stop = StopRequest {
        id: "task-1".into(),
        proplet_id: Some("dev-a".into()),
        ..StopRequest::default()
    };
    if let Err(e) = b.broker.publisher().stop(&channel, &stop).await {
        panic!("publish failed: {e}");
    }
    let got = dev.next_publish().await;
    assert_eq!(got.topic, topic("control/manager/stop"));
    assert!(String::from_utf8_lossy(&got.payload).contains("task-1"));
    assert_eq!(b.broker.metrics().messages_out(KindLabel::stop), 1);
}

#[tokio::test]
async fn last_will_and_abrupt_close_yield_offline() {
    let mut b = TestBroker::start().await;
    let mut watcher = connect_as(b.addr(), "watcher", "key-w").await;
    watcher.subscribe(&topic("control/proplet/alive")).await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut opts = options(b.addr(), "dev-a", "dev-a", "key-a");
    opts.set_last_will(LastWill::new(
        topic("control/proplet/alive"),
        r#"{"status":"offline","proplet_id":"dev-a"}"#,
        QoS::AtLeastOnce,
        false,
    ));
    let dev = connect(opts).await;
    // Abrupt: the event loop is dropped, closing the TCP socket without DISCONNECT.
    dev.task.abort();
    drop(dev);
    let event = b.next_event().await;
    assert_eq!(event.client_id, "dev-a");
    assert_eq!(event.kind, EventKind::Offline(OfflineCause::ConnectionLost));
    // rumqttd delivers the Last Will to subscribers.
    let will = watcher.next_publish().await;
    assert!(String::from_utf8_lossy(&will.payload).contains("offline"));

    // A clean DISCONNECT is reported as such.
    let dev = connect_as(b.addr(), "dev-b", "key-b").await;
    if let Err(e) = dev.client.disconnect().await {
        panic!("{e}");
    }
    let event = b.next_event().await;
    assert_eq!(event.client_id, "dev-b");
    assert_eq!(
        event.kind,
        EventKind::Offline(OfflineCause::CleanDisconnect)
    );
}

#[tokio::test]
async fn published_offline_notice_is_an_offline_event() {
    let mut b = TestBroker::start().await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(
        &topic("control/proplet/alive"),
        r#"{"status":"offline","proplet_id":"dev-a"}"#,
    )
    .await;
    let event = b.next_event().await;
    assert!(matches!(
        event.kind,
        EventKind::Offline(OfflineCause::Announced(_))
    ));
}

#[tokio::test]
async fn a_reconnect_does_not_report_the_live_client_offline() {
    let mut b = TestBroker::start().await;
    let first = connect_as(b.addr(), "dev-a", "key-a").await;
    let second = connect_as(b.addr(), "dev-a", "key-a").await;
    // The router closes the first session when the second takes over.
    tokio::time::sleep(QUIET).await;
    second
        .publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
        .await;
    let event = b.next_event().await;
    assert!(
        matches!(event.kind, EventKind::Heartbeat(_)),
        "taken-over session reported {event:?}"
    );
    drop(first);
}

#[tokio::test]
async fn idle_socket_does_not_delay_other_clients() {
    let b = TestBroker::start().await;
    // Opens a socket and sends nothing at all.
    let idle = match tokio::net::TcpStream::connect(b.addr()).await {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    // Also a socket that sends half a CONNECT.
    let mut half = match tokio::net::TcpStream::connect(b.addr()).await {
        Ok(s) => s,
        Err(e) => panic!("{e}"),
    };
    if let Err(e) = half.write_all(&[0x10, 0x20, 0x00]).await {
        panic!("{e}");
    }
    let started = std::time::Instant::now();
    let _a = connect_as(b.addr(), "dev-a", "key-a").await;
    // Bounded by the broker's connect timeout (5 s), not by the idle sockets' lifetime.
    assert!(started.elapsed() < BrokerConfig::default().connect_timeout);
    drop(idle);
}

#[tokio::test]
async fn connection_cap_closes_excess_sockets() {
    let config = BrokerConfig {
        max_connections: 1,
        ..BrokerConfig::loopback()
    };
    let b = TestBroker::start_with(config).await;
    let _a = connect_as(b.addr(), "dev-a", "key-a").await;
    let (_c, mut el) = AsyncClient::new(options(b.addr(), "dev-b", "dev-b", "key-b"), 8);
    assert_eq!(connack(&mut el).await, None);
}

#[tokio::test]
async fn meters_are_exported_in_prometheus_text() {
    let mut b = TestBroker::start().await;
    let a = connect_as(b.addr(), "dev-a", "key-a").await;
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-b"))
        .await;
    a.publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
        .await;
    let _ = b.next_event().await;
    let mut registry = prometheus_client::registry::Registry::with_prefix("propeller");
    b.broker.metrics().register(&mut registry);
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &registry) {
        panic!("{e}");
    }
    for line in [
        "propeller_broker_connected_clients 1",
        "propeller_broker_messages_in_total{kind=\"alive\"} 2",
        "propeller_broker_dropped_publishes_total{reason=\"spoofed\"} 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in:\n{text}");
    }
}

/// A device that reconnects while its previous connection is still open (a half-open socket
/// after a network drop, or a client that gave up waiting for CONNACK) keeps the new one.
/// rumqttd on its own reuses the old connection's id for the new one and then disconnects the
/// new one when the old one's link ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_with_the_same_client_id_replaces_the_old_connection_and_stays() {
    let b = TestBroker::start().await;
    let start = topic("control/manager/start");
    let old = connect_as(b.addr(), "dev-a", "key-a").await;
    let mut new = connect_as(b.addr(), "dev-a", "key-a").await;
    // The broker closes the old connection.
    match tokio::time::timeout(WAIT, old.task).await {
        Ok(_) => {}
        Err(_) => panic!("the old connection of dev-a was not closed"),
    }
    // The new one outlives the old one's end and works.
    tokio::time::sleep(Duration::from_millis(500)).await;
    new.subscribe(&start).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let operator = connect_as(b.addr(), "watcher", "key-w").await;
    operator.publish(&start, r#"{"id":"t1"}"#).await;
    let got = new.next_publish().await;
    assert_eq!(got.topic, start);
    assert!(!new.task.is_finished(), "the new connection was dropped");
}

/// MQTT 3.1.1 CONNECT with clean session, keep-alive 60 s, and a username and password.
fn raw_connect(client_id: &str, username: &str, password: &str) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0b1100_0010, 0, 60];
    for field in [client_id, username, password] {
        body.extend_from_slice(&(field.len() as u16).to_be_bytes());
        body.extend_from_slice(field.as_bytes());
    }
    assert!(body.len() < 128, "one-byte remaining length");
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend_from_slice(&body);
    packet
}

/// Reads the CONNACK on `socket`; panics unless it accepts the connection.
async fn expect_accepted(socket: &mut tokio::net::TcpStream, what: &str) {
    use tokio::io::AsyncReadExt;
    let mut connack = [0u8; 4];
    tokio::time::timeout(WAIT, socket.read_exact(&mut connack))
        .await
        .expect("CONNACK in time")
        .expect("CONNACK");
    assert_eq!(connack, [0x20, 0x02, 0x00, 0x00], "{what}: accepted");
}

/// Connects `dev-a` over a raw socket and reads its CONNACK.
async fn raw_session(addr: std::net::SocketAddr) -> tokio::net::TcpStream {
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket
        .write_all(&raw_connect("dev-a", "dev-a", "key-a"))
        .await
        .unwrap();
    expect_accepted(&mut socket, "first connection").await;
    socket
}

/// The race behind devices thrown out after a reconnect: the replaced connection's link ends
/// just as the new connection takes over its connection id. Its end must not be taken for
/// the new connection's. Closing the old socket while the new CONNECT is on its way makes
/// the old link end either before or after the takeover, so repeated rounds hit both orders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_of_a_replaced_connection_does_not_drop_its_successor() {
    use tokio::io::AsyncReadExt;
    let b = TestBroker::start().await;
    for round in 0..20 {
        let old = raw_session(b.addr()).await;
        let mut new = tokio::net::TcpStream::connect(b.addr()).await.unwrap();
        let connect = raw_connect("dev-a", "dev-a", "key-a");
        let (sent, ()) = tokio::join!(new.write_all(&connect), async { drop(old) });
        sent.unwrap();
        expect_accepted(&mut new, &format!("round {round}")).await;
        // Give the old link time to end, then check the new connection still answers.
        tokio::time::sleep(Duration::from_millis(100)).await;
        new.write_all(&[0xC0, 0x00]).await.unwrap();
        let mut pingresp = [0u8; 2];
        let answered = tokio::time::timeout(WAIT, new.read_exact(&mut pingresp)).await;
        assert!(
            matches!(answered, Ok(Ok(_))) && pingresp == [0xD0, 0x00],
            "round {round}: the new connection was dropped ({answered:?})"
        );
    }
}
