//! Shared helpers: a broker on 127.0.0.1 with an ephemeral port, rumqttc clients, bounded waits.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use propeller_broker::server::{
    BrokerConfig, BrokerEvent, Credential, CredentialStore, EmbeddedBroker, EventKind, Role,
};
use rumqttc::{AsyncClient, ConnectReturnCode, Event, EventLoop, MqttOptions, Packet, QoS};
use tokio::sync::mpsc::UnboundedReceiver;

/// Upper bound on every wait in these tests.
pub const WAIT: Duration = Duration::from_secs(10);

pub const DOMAIN: &str = "dom";
pub const CHANNEL: &str = "chan";

pub fn topic(path: &str) -> String {
    format!("m/{DOMAIN}/c/{CHANNEL}/{path}")
}

pub struct TestBroker {
    pub broker: EmbeddedBroker,
    pub store: CredentialStore,
    pub events: UnboundedReceiver<BrokerEvent>,
}

impl TestBroker {
    pub async fn start() -> Self {
        Self::start_with(BrokerConfig::loopback()).await
    }

    pub async fn start_with(config: BrokerConfig) -> Self {
        let store = CredentialStore::new();
        store.insert("dev-a", Credential::proplet("key-a"));
        store.insert("dev-b", Credential::proplet("key-b"));
        store.insert("watcher", Credential::new("key-w", Role::Service));
        let mut broker = match EmbeddedBroker::start(config, Arc::new(store.clone())).await {
            Ok(b) => b,
            Err(e) => panic!("broker did not start: {e}"),
        };
        let events = match broker.take_events() {
            Some(rx) => rx,
            None => panic!("event stream already taken"),
        };
        Self {
            broker,
            store,
            events,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        match self.broker.tcp_addr() {
            Some(a) => a,
            None => panic!("no TCP listener"),
        }
    }

    /// The next event, or a panic after [`WAIT`].
    pub async fn next_event(&mut self) -> BrokerEvent {
        match tokio::time::timeout(WAIT, self.events.recv()).await {
            Ok(Some(e)) => e,
            Ok(None) => panic!("event stream closed"),
            Err(_) => panic!("no event within {WAIT:?}"),
        }
    }

    /// Connects with `opts` as `dev-a`, sends a heartbeat and checks it arrives as an event.
    pub async fn heartbeat_arrives(&mut self, opts: MqttOptions) -> Client {
        let client = connect(opts).await;
        client
            .publish(&topic("control/proplet/alive"), heartbeat("dev-a"))
            .await;
        let event = self.next_event().await;
        assert_eq!(event.client_id, "dev-a");
        assert!(matches!(event.kind, EventKind::Heartbeat(_)), "{event:?}");
        client
    }

    /// Asserts no event arrives within `quiet`.
    pub async fn assert_no_event(&mut self, quiet: Duration) {
        if let Ok(Some(e)) = tokio::time::timeout(quiet, self.events.recv()).await {
            panic!("unexpected event {e:?}");
        }
    }
}

pub fn options(addr: SocketAddr, id: &str, user: &str, pass: &str) -> MqttOptions {
    let mut opts = MqttOptions::new(id, addr.ip().to_string(), addr.port());
    opts.set_keep_alive(Duration::from_secs(30));
    if !user.is_empty() || !pass.is_empty() {
        opts.set_credentials(user, pass);
    }
    opts
}

/// Polls until CONNACK; returns its code, or `None` if the connection failed first.
pub async fn connack(eventloop: &mut EventLoop) -> Option<ConnectReturnCode> {
    let wait = async {
        loop {
            match eventloop.poll().await {
                Ok(Event::Incoming(Packet::ConnAck(ack))) => return Some(ack.code),
                Ok(_) => continue,
                Err(_) => return None,
            }
        }
    };
    match tokio::time::timeout(WAIT, wait).await {
        Ok(r) => r,
        Err(_) => panic!("neither CONNACK nor an error within {WAIT:?}"),
    }
}

/// A connected client whose event loop runs in the background.
pub struct Client {
    pub client: AsyncClient,
    pub task: tokio::task::JoinHandle<()>,
    pub incoming: UnboundedReceiver<rumqttc::Publish>,
}

pub async fn connect(opts: MqttOptions) -> Client {
    let (client, mut eventloop) = AsyncClient::new(opts, 64);
    match connack(&mut eventloop).await {
        Some(ConnectReturnCode::Success) => {}
        other => panic!("connect failed: {other:?}"),
    }
    let (tx, incoming) = tokio::sync::mpsc::unbounded_channel();
    let task = tokio::spawn(async move {
        while let Ok(event) = eventloop.poll().await {
            if let Event::Incoming(Packet::Publish(p)) = event {
                let _ = tx.send(p);
            }
        }
    });
    Client {
        client,
        task,
        incoming,
    }
}

pub async fn connect_as(addr: SocketAddr, id: &str, key: &str) -> Client {
    connect(options(addr, id, id, key)).await
}

impl Client {
    pub async fn publish(&self, topic: &str, payload: impl Into<Vec<u8>>) {
        if let Err(e) = self
            .client
            .publish(topic, QoS::AtLeastOnce, false, payload.into())
            .await
        {
            panic!("publish failed: {e}");
        }
    }

    pub async fn subscribe(&self, filter: &str) {
        if let Err(e) = self.client.subscribe(filter, QoS::AtLeastOnce).await {
            panic!("subscribe failed: {e}");
        }
    }

    pub async fn next_publish(&mut self) -> rumqttc::Publish {
        match tokio::time::timeout(WAIT, self.incoming.recv()).await {
            Ok(Some(p)) => p,
            Ok(None) => panic!("client event loop ended"),
            Err(_) => panic!("no publish within {WAIT:?}"),
        }
    }

    pub async fn assert_no_publish(&mut self, quiet: Duration) {
        if let Ok(Some(p)) = tokio::time::timeout(quiet, self.incoming.recv()).await {
            panic!("unexpected publish on {}: {:?}", p.topic, p.payload);
        }
    }
}

pub fn heartbeat(id: &str) -> String {
    format!(r#"{{"status":"alive","proplet_id":"{id}","namespace":"default"}}"#)
}
