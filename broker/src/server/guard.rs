//! The enforcement point: an MQTT 3.1.1 codec wrapped around rumqttd's own.
//!
//! rumqttd 0.20 offers authentication but no authorization hook and no event hook. It does,
//! however, run every network connection through its own clone of the server's `Protocol`
//! value, and it calls that value for every packet read and written. [`Guard`] uses this:
//!
//! - on CONNECT it records the client id and the role its credential grants;
//! - on the CONNACK it writes back it learns the session was accepted;
//! - every PUBLISH read is judged by [`super::policy::judge_publish`]: routed (raising the typed
//!   event with the *authenticated* client id) or rewritten to an inert sink;
//! - every SUBSCRIBE filter a device may not have is rewritten to an inert literal;
//! - when rumqttd drops the connection, the guard is dropped with it and raises Offline.
//!
//! Limits of this mechanism, stated plainly: a refused publish is acknowledged (rewritten,
//! not rejected), since MQTT 3.1.1 has no negative PUBACK; a refused subscription gets a
//! successful SUBACK but never receives anything.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Bytes, BytesMut};
use rumqttd::protocol::v4::V4;
use rumqttd::protocol::{ConnectReturnCode, Packet, Protocol};
use tokio::sync::mpsc::UnboundedSender;
use tracing::{debug, warn};

use crate::protocol::{classify, Decoder};

use super::auth::{login_over, CredentialSource, Role, Transport};
use super::events::{BrokerEvent, EventKind, OfflineCause};
use super::metrics::{BrokerMetrics, KindLabel};
use super::policy::{judge_publish, may_subscribe_as, Verdict, DENIED_FILTER, DROPPED_TOPIC};

/// State shared by every connection of one broker.
pub(crate) struct Shared {
    pub(crate) credentials: Arc<dyn CredentialSource>,
    pub(crate) events: UnboundedSender<BrokerEvent>,
    pub(crate) metrics: BrokerMetrics,
    pub(crate) decoder: Decoder,
    /// The serial of the live session of each client id, so a session taken over by a newer
    /// connection of the same client does not report the client offline when it closes.
    sessions: Mutex<HashMap<String, u64>>,
    next_serial: AtomicU64,
}

impl Shared {
    pub(crate) fn new(
        credentials: Arc<dyn CredentialSource>,
        events: UnboundedSender<BrokerEvent>,
        metrics: BrokerMetrics,
        decoder: Decoder,
    ) -> Self {
        Self {
            credentials,
            events,
            metrics,
            decoder,
            sessions: Mutex::new(HashMap::new()),
            next_serial: AtomicU64::new(1),
        }
    }

    fn emit(&self, event: BrokerEvent) {
        // A closed receiver means nobody consumes events (e.g. during shutdown); routing goes on.
        let _ = self.events.send(event);
    }
}

/// What one connection has shown so far.
#[derive(Default)]
struct Session {
    client_id: Option<String>,
    role: Option<Role>,
    serial: u64,
    accepted: AtomicBool,
    clean_disconnect: bool,
}

/// rumqttd's V4 codec plus our per-connection authorization and event extraction.
pub(crate) struct Guard {
    shared: Arc<Shared>,
    codec: V4,
    transport: Transport,
    session: Session,
}

impl Guard {
    /// The prototype the server clones once per connection.
    pub(crate) fn new(shared: Arc<Shared>, transport: Transport) -> Self {
        Self {
            shared,
            codec: V4,
            transport,
            session: Session::default(),
        }
    }

    fn on_connect(&mut self, client_id: &str, username: &str, password: &str) {
        self.session.serial = self.shared.next_serial.fetch_add(1, Ordering::Relaxed);
        self.session.client_id = Some(client_id.to_owned());
        // rumqttd's auth hook decides acceptance with the same function. Failures are counted
        // here because rumqttd refuses a CONNECT without login before calling the hook.
        match login_over(
            self.shared.credentials.as_ref(),
            client_id,
            username,
            password,
            self.transport,
        ) {
            Ok(credential) => self.session.role = Some(credential.role()),
            Err(failure) => {
                self.session.role = None;
                self.shared.metrics.auth_failure(failure);
                warn!(client_id, reason = failure.as_str(), "login refused");
            }
        }
    }

    fn on_publish(&self, publish: &mut rumqttd::protocol::Publish) {
        let Some(client_id) = self.session.client_id.as_deref() else {
            return;
        };
        // A PUBLISH before CONNACK cannot reach the router; be strict anyway.
        let role = self.session.role.unwrap_or(Role::Proplet);
        // A reference-counted handle, so the topic can be read while `publish` is rewritten.
        let topic_bytes = publish.topic.clone();
        let Ok(topic) = std::str::from_utf8(&topic_bytes) else {
            sink(publish);
            return;
        };
        let decision = judge_publish(
            &self.shared.decoder,
            role,
            client_id,
            topic,
            &publish.payload,
        );
        let label = KindLabel::of(decision.kind.as_ref());
        self.shared.metrics.message_in(label);
        if let Some(error) = &decision.decode_error {
            self.shared.metrics.decode_error(label);
            debug!(client_id, topic, %error, "undecodable payload");
        }
        match decision.verdict {
            Verdict::Route(Some(event)) => self.shared.emit(*event),
            Verdict::Route(None) => {}
            Verdict::Drop(reason) => {
                self.shared.metrics.dropped(reason);
                warn!(
                    client_id,
                    topic,
                    reason = reason.as_str(),
                    "publish dropped"
                );
                sink(publish);
            }
        }
    }

    fn on_subscribe(&self, subscribe: &mut rumqttd::protocol::Subscribe) {
        let role = self.session.role.unwrap_or(Role::Proplet);
        let client_id = self.session.client_id.as_deref().unwrap_or("");
        for filter in &mut subscribe.filters {
            if !may_subscribe_as(role, client_id, &filter.path) {
                self.shared.metrics.denied_subscription();
                warn!(
                    client_id = self.session.client_id.as_deref().unwrap_or(""),
                    filter = filter.path,
                    "subscription denied"
                );
                filter.path = DENIED_FILTER.to_owned();
            }
        }
    }

    fn on_connack_sent(&self) {
        if self.session.accepted.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.metrics.client_connected();
        if let Some(client_id) = &self.session.client_id {
            let mut sessions = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            sessions.insert(client_id.clone(), self.session.serial);
        }
    }
}

/// Rewrites a refused publish into an empty, unretained message on the inert sink topic.
fn sink(publish: &mut rumqttd::protocol::Publish) {
    publish.topic = Bytes::from_static(DROPPED_TOPIC.as_bytes());
    publish.payload = Bytes::new();
    publish.retain = false;
}

impl Clone for Guard {
    /// Each connection starts with a fresh session; only the shared state is shared.
    fn clone(&self) -> Self {
        Self::new(self.shared.clone(), self.transport)
    }
}

impl Protocol for Guard {
    fn read_mut(
        &mut self,
        stream: &mut BytesMut,
        max_size: usize,
    ) -> Result<Packet, rumqttd::protocol::Error> {
        let mut packet = self.codec.read_mut(stream, max_size)?;
        match &mut packet {
            Packet::Connect(connect, _, _, _, login) => {
                let (user, pass) = login
                    .as_ref()
                    .map(|l| (l.username.as_str(), l.password.as_str()))
                    .unwrap_or(("", ""));
                let client_id = connect.client_id.clone();
                self.on_connect(&client_id, user, pass);
            }
            Packet::Publish(publish, _) => self.on_publish(publish),
            Packet::Subscribe(subscribe, _) => self.on_subscribe(subscribe),
            Packet::Disconnect(..) => self.session.clean_disconnect = true,
            _ => {}
        }
        Ok(packet)
    }

    fn write(
        &self,
        packet: Packet,
        write: &mut BytesMut,
    ) -> Result<usize, rumqttd::protocol::Error> {
        match &packet {
            Packet::ConnAck(ack, _) if ack.code == ConnectReturnCode::Success => {
                self.on_connack_sent();
            }
            Packet::Publish(publish, _) => {
                let kind = std::str::from_utf8(&publish.topic)
                    .ok()
                    .and_then(classify)
                    .map(|(_, kind)| kind);
                self.shared
                    .metrics
                    .message_out(KindLabel::of(kind.as_ref()));
            }
            _ => {}
        }
        self.codec.write(packet, write)
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.session.accepted.load(Ordering::Acquire) {
            return;
        }
        self.shared.metrics.client_disconnected();
        let Some(client_id) = self.session.client_id.take() else {
            return;
        };
        let still_current = {
            let mut sessions = self
                .shared
                .sessions
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if sessions.get(&client_id) == Some(&self.session.serial) {
                sessions.remove(&client_id);
                true
            } else {
                false
            }
        };
        if !still_current || self.session.role != Some(Role::Proplet) {
            return;
        }
        let cause = if self.session.clean_disconnect {
            OfflineCause::CleanDisconnect
        } else {
            OfflineCause::ConnectionLost
        };
        self.shared.emit(BrokerEvent {
            client_id,
            domain: None,
            channel: None,
            kind: EventKind::Offline(cause),
        });
    }
}
