//! Meters of the connection to an external broker (`propeller_broker_external_*`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Label of a refused inbound message.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why it was refused (`spoofed`, `malformed`).
    pub reason: String,
}

/// Connection state and traffic of propeller's client session on the external broker.
#[derive(Debug, Clone, Default)]
pub struct ExternalMetrics {
    /// 1 while connected and subscribed, 0 otherwise.
    pub connected: Gauge,
    /// Connections made after the first.
    pub reconnects: Counter,
    /// Failed connection attempts (refused, unreachable, dropped).
    pub connect_failures: Counter,
    /// Messages received from the broker.
    pub received: Counter,
    /// Messages published to the broker.
    pub published: Counter,
    /// Received device reports that were refused.
    pub dropped: Family<ReasonLabel, Counter>,
    /// 1 when devices are authenticated by propeller (callbacks or a rendered config), 0 when
    /// the broker lets anyone in and reports are taken as they claim.
    pub devices_authenticated: Gauge,
}

impl ExternalMetrics {
    /// Registers every meter under `broker_external_*`.
    pub fn register(&self, registry: &mut Registry) {
        let sub = registry.sub_registry_with_prefix("broker_external");
        sub.register(
            "connected",
            "Whether propeller is connected and subscribed to the external broker",
            self.connected.clone(),
        );
        sub.register(
            "reconnects",
            "Connections to the external broker after the first",
            self.reconnects.clone(),
        );
        sub.register(
            "connect_failures",
            "Failed or lost connections to the external broker",
            self.connect_failures.clone(),
        );
        sub.register(
            "messages_received",
            "Messages received from the external broker",
            self.received.clone(),
        );
        sub.register(
            "messages_published",
            "Messages published to the external broker",
            self.published.clone(),
        );
        sub.register(
            "reports_dropped",
            "Device reports from the external broker that were refused",
            self.dropped.clone(),
        );
        sub.register(
            "devices_authenticated",
            "1 when the broker authenticates devices with propeller's credentials",
            self.devices_authenticated.clone(),
        );
    }
}
