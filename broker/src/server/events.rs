//! Typed events the broker raises in-process for the reconcilers.

use crate::protocol::enrolment::EnrolRequest;
use crate::protocol::{
    Discovery, FlUpdateMessage, Heartbeat, Inbound, InvokeResult, OfflineNotice, PropletMetrics,
    RegistryRequest, TaskLogs, TaskMetrics, TaskResult, UpgradeReport,
};

/// One thing a client told the broker, tagged with the client that was authenticated on the
/// connection it arrived on (never what the payload claims).
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerEvent {
    /// The authenticated MQTT client id of the publisher.
    pub client_id: String,
    /// The topic's `{domain}` level (`None` for the unprefixed FL update topic and for
    /// connection-level events).
    pub domain: Option<String>,
    /// The topic's `{channel}` level.
    pub channel: Option<String>,
    /// What happened.
    pub kind: EventKind,
}

/// Why a proplet is considered gone.
#[derive(Debug, Clone, PartialEq)]
pub enum OfflineCause {
    /// The device (or its Last Will, relayed by itself) published `status: "offline"`.
    Announced(OfflineNotice),
    /// The client sent DISCONNECT.
    CleanDisconnect,
    /// The connection ended without DISCONNECT: TCP close or reset, keep-alive expiry, or the
    /// broker closing it. rumqttd publishes the client's Last Will at this point.
    ConnectionLost,
}

/// The payload of a [`BrokerEvent`].
#[derive(Debug, Clone, PartialEq)]
pub enum EventKind {
    /// `control/proplet/create`.
    Discovered(Discovery),
    /// `control/proplet/alive` with `status: "alive"`, metadata and metrics when present.
    Heartbeat(Heartbeat),
    /// The proplet went away (see [`OfflineCause`]).
    Offline(OfflineCause),
    /// `control/proplet/metrics`: host-level CPU and memory of the proplet's process.
    PropletMetrics(PropletMetrics),
    /// `control/proplet/task_metrics`.
    TaskMetrics(TaskMetrics),
    /// `control/proplet/results`.
    Result(TaskResult),
    /// `control/proplet/invoke_results`.
    InvokeResult(InvokeResult),
    /// `control/proplet/upgrade`: how far an agent upgrade got.
    Upgrade(UpgradeReport),
    /// `control/proplet/logs`: lines a task printed.
    Logs(TaskLogs),
    /// `registry/proplet`: a binary was asked for.
    RegistryRequest(RegistryRequest),
    /// A federated-learning update (prefixed or unprefixed topic).
    FlUpdate(Box<FlUpdateMessage>),
    /// An enrolling device's request (the client id names its token), or why it did not
    /// decode.
    EnrolmentRequest(Result<Box<EnrolRequest>, String>),
}

impl EventKind {
    /// The event for an inbound agent report; `None` for operator-side messages.
    pub fn from_inbound(inbound: Inbound) -> Option<Self> {
        let kind = match inbound {
            Inbound::Discovery(m) => Self::Discovered(m),
            Inbound::Heartbeat(m) => Self::Heartbeat(m),
            Inbound::Offline(m) => Self::Offline(OfflineCause::Announced(m)),
            Inbound::PropletMetrics(m) => Self::PropletMetrics(m),
            Inbound::TaskMetrics(m) => Self::TaskMetrics(m),
            Inbound::Result(m) => Self::Result(m),
            Inbound::InvokeResult(m) => Self::InvokeResult(m),
            Inbound::UpgradeReport(m) => Self::Upgrade(m),
            Inbound::Logs(m) => Self::Logs(m),
            Inbound::RegistryRequest(m) => Self::RegistryRequest(m),
            Inbound::FlUpdate(m) => Self::FlUpdate(m),
            Inbound::Start(_)
            | Inbound::Stop(_)
            | Inbound::Invoke(_)
            | Inbound::Upgrade(_)
            | Inbound::RegistryChunk(_)
            | Inbound::FlRoundStart(_) => return None,
        };
        Some(kind)
    }

    /// A short label for logs.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Discovered(_) => "discovered",
            Self::Heartbeat(_) => "heartbeat",
            Self::Offline(_) => "offline",
            Self::PropletMetrics(_) => "proplet_metrics",
            Self::TaskMetrics(_) => "task_metrics",
            Self::Result(_) => "result",
            Self::InvokeResult(_) => "invoke_result",
            Self::Upgrade(_) => "upgrade",
            Self::Logs(_) => "logs",
            Self::RegistryRequest(_) => "registry_request",
            Self::FlUpdate(_) => "fl_update",
            Self::EnrolmentRequest(_) => "enrolment_request",
        }
    }
}
