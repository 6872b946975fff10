//! Broker meters, in a prometheus-client registry the operator serves on `/metrics`.
//!
//! rumqttd's own exporter is deliberately not used: it installs a global recorder.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::protocol::TopicKind;

use super::auth::AuthFailure;
use super::policy::DropReason;

/// Topic kinds as a metric label (`other` for topics outside the protocol).
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum KindLabel {
    discovery,
    alive,
    proplet_metrics,
    task_metrics,
    results,
    invoke_results,
    upgrade_report,
    logs,
    start,
    stop,
    invoke,
    upgrade,
    registry_request,
    registry_chunk,
    fl_round_start,
    fl_update,
    other,
}

impl KindLabel {
    /// The label of a classified topic.
    pub fn of(kind: Option<&TopicKind>) -> Self {
        match kind {
            None => Self::other,
            Some(TopicKind::Discovery) => Self::discovery,
            Some(TopicKind::Alive) => Self::alive,
            Some(TopicKind::PropletMetrics) => Self::proplet_metrics,
            Some(TopicKind::TaskMetrics) => Self::task_metrics,
            Some(TopicKind::Results) => Self::results,
            Some(TopicKind::InvokeResults) => Self::invoke_results,
            Some(TopicKind::Start) => Self::start,
            Some(TopicKind::Stop) => Self::stop,
            Some(TopicKind::Invoke) => Self::invoke,
            Some(TopicKind::UpgradeReport) => Self::upgrade_report,
            Some(TopicKind::Logs) => Self::logs,
            Some(TopicKind::Upgrade) => Self::upgrade,
            Some(TopicKind::RegistryRequest) => Self::registry_request,
            Some(TopicKind::RegistryChunk) => Self::registry_chunk,
            Some(TopicKind::FlRoundStart) => Self::fl_round_start,
            Some(TopicKind::FlUpdate { .. }) => Self::fl_update,
        }
    }
}

/// Label set `{kind=...}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    /// The topic kind.
    pub kind: KindLabel,
}

/// Label set `{reason=...}`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    /// Why.
    pub reason: &'static str,
}

/// Every meter of the broker. Cheap to clone: clones share the same values.
#[derive(Debug, Clone, Default)]
pub struct BrokerMetrics {
    connected_clients: Gauge,
    messages_in: Family<KindLabels, Counter>,
    messages_out: Family<KindLabels, Counter>,
    auth_failures: Family<ReasonLabels, Counter>,
    dropped: Family<ReasonLabels, Counter>,
    decode_errors: Family<KindLabels, Counter>,
    denied_subscriptions: Counter,
    refused_connections: Family<ReasonLabels, Counter>,
    keep_alive_expiries: Counter,
}

impl BrokerMetrics {
    /// Adds every meter to `registry` under the `broker` prefix: the process's registry
    /// carries `propeller`, so the names read `propeller_broker_*`.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("broker");
        r.register(
            "connected_clients",
            "MQTT clients with an accepted session",
            self.connected_clients.clone(),
        );
        r.register(
            "messages_in",
            "PUBLISH packets received, by topic kind",
            self.messages_in.clone(),
        );
        r.register(
            "messages_out",
            "PUBLISH packets sent to network clients, by topic kind",
            self.messages_out.clone(),
        );
        r.register(
            "auth_failures",
            "Refused logins, by reason",
            self.auth_failures.clone(),
        );
        r.register(
            "dropped_publishes",
            "Publishes not routed: spoofed, forbidden topic or malformed",
            self.dropped.clone(),
        );
        r.register(
            "decode_errors",
            "Payloads that failed to decode, by topic kind",
            self.decode_errors.clone(),
        );
        r.register(
            "denied_subscriptions",
            "Subscription filters a device was not allowed",
            self.denied_subscriptions.clone(),
        );
        r.register(
            "refused_connections",
            "Sockets closed before an MQTT session: connection cap, TLS or websocket handshake \
             failed or timed out, no CONNECT in time, closed before CONNECT",
            self.refused_connections.clone(),
        );
        r.register(
            "keep_alive_expiries",
            "Sessions closed because the client went silent past its keep-alive",
            self.keep_alive_expiries.clone(),
        );
    }

    pub(crate) fn client_connected(&self) {
        self.connected_clients.inc();
    }

    pub(crate) fn client_disconnected(&self) {
        self.connected_clients.dec();
    }

    pub(crate) fn message_in(&self, kind: KindLabel) {
        self.messages_in.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn message_out(&self, kind: KindLabel) {
        self.messages_out.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn auth_failure(&self, failure: AuthFailure) {
        self.auth_failures
            .get_or_create(&ReasonLabels {
                reason: failure.as_str(),
            })
            .inc();
    }

    pub(crate) fn dropped(&self, reason: DropReason) {
        self.dropped
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .inc();
    }

    pub(crate) fn decode_error(&self, kind: KindLabel) {
        self.decode_errors.get_or_create(&KindLabels { kind }).inc();
    }

    pub(crate) fn denied_subscription(&self) {
        self.denied_subscriptions.inc();
    }

    pub(crate) fn keep_alive_expired(&self) {
        self.keep_alive_expiries.inc();
    }

    pub(crate) fn refused_connection(&self, reason: &'static str) {
        self.refused_connections
            .get_or_create(&ReasonLabels { reason })
            .inc();
    }

    /// Clients with an accepted session now.
    pub fn connected_clients(&self) -> i64 {
        self.connected_clients.get()
    }

    /// Publishes received on topics of `kind`.
    pub fn messages_in(&self, kind: KindLabel) -> u64 {
        self.messages_in.get_or_create(&KindLabels { kind }).get()
    }

    /// Publishes sent to network clients on topics of `kind`.
    pub fn messages_out(&self, kind: KindLabel) -> u64 {
        self.messages_out.get_or_create(&KindLabels { kind }).get()
    }

    /// Refused logins for `failure`.
    pub fn auth_failures(&self, failure: AuthFailure) -> u64 {
        self.auth_failures
            .get_or_create(&ReasonLabels {
                reason: failure.as_str(),
            })
            .get()
    }

    /// Publishes dropped for `reason`.
    pub fn dropped_publishes(&self, reason: DropReason) -> u64 {
        self.dropped
            .get_or_create(&ReasonLabels {
                reason: reason.as_str(),
            })
            .get()
    }

    /// Payloads of `kind` that failed to decode.
    pub fn decode_errors(&self, kind: KindLabel) -> u64 {
        self.decode_errors.get_or_create(&KindLabels { kind }).get()
    }

    /// Subscription filters refused to devices.
    pub fn denied_subscriptions(&self) -> u64 {
        self.denied_subscriptions.get()
    }

    /// Sockets closed before an MQTT session for `reason` (`max_connections`,
    /// `tls_handshake_timeout`, `tls_handshake_failed`, `websocket_handshake_timeout`,
    /// `websocket_handshake_failed`, `connect_timeout`, `closed_before_connect`).
    pub fn refused_connections(&self, reason: &'static str) -> u64 {
        self.refused_connections
            .get_or_create(&ReasonLabels { reason })
            .get()
    }

    /// Sessions closed because their client went silent past its keep-alive.
    pub fn keep_alive_expiries(&self) -> u64 {
        self.keep_alive_expiries.get()
    }
}
