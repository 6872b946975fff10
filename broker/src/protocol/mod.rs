//! The MQTT protocol spoken between the operator, the agents and the upstream components.
//!
//! Pure and I/O-free, so the agent and the operator can use it without the broker server:
//!
//! - [`Channel`]: the `m/{domain}/c/{channel}/…` layout and the subscription filters of each
//!   side; [`classify`] for incoming topics;
//! - one typed struct per message with the exact upstream JSON keys, each with `to_json` and
//!   `encode`;
//! - [`decode`] / [`Decoder`]: the single entry point from `(topic kind, payload)` to a typed
//!   [`Inbound`] message, tolerant where upstream components disagree and strict about size,
//!   required keys and types, with errors naming the offending key;
//! - [`split_into_chunks`] and [`ChunkAssembler`] for binaries sent over `registry/server`.

mod address;
mod control;
pub mod encrypted_module;
pub mod enrolment;
mod error;
mod fields;
mod fl;
mod logs;
mod registry;
mod reports;
pub mod sealed_grant;
mod time;
mod topics;
mod upgrade;

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;

pub use address::{AddressError, BrokerAddress};
pub use control::{
    targets, InvokeRequest, MonitoringProfile, StartRequest, StopRequest, DEFAULT_STOP_STATE,
};
pub use error::{ChunkError, DecodeError, TopicError};
pub use fl::{round_number, FlRoundId, FlRoundStart, FlUpdate, FlUpdateMessage};
pub use logs::{LogLine, LogStream, TaskLogs, MAX_LINE_BYTES as MAX_LOG_LINE_BYTES};
pub use registry::{
    split_into_chunks, ChunkAssembler, ChunkIter, ChunkProgress, RegistryChunk, RegistryRequest,
    DEFAULT_RAW_CHUNK_SIZE,
};
pub use reports::{
    AggregatedMetrics, CpuMetrics, Discovery, Heartbeat, HeartbeatMetrics, InvokeResult,
    MemoryMetrics, OfflineNotice, ProcessMetrics, PropletMetadata, PropletMetrics, ResultValue,
    TaskMetrics, TaskResult,
};
pub use time::{
    parse_duration, parse_setting_duration, whole_seconds, Timestamp, NANOSECOND_INTERVAL_THRESHOLD,
};
pub use topics::{
    classify, refused_filters, unprefixed_fl_update_topic, Channel, ChannelRef, TopicKind,
    TopicSegment, UNPREFIXED_FL_UPDATE_FILTER,
};
pub use upgrade::{BusyPolicy, UpgradeAction, UpgradeReport, UpgradeRequest, UpgradeState};

use fields::{parse_object, Fields};
use reports::decode_alive;

/// Default payload limit: the upstream agent's MQTT packet limit (10 MiB), comfortably above
/// the largest proxy chunk (~683 kB encoded).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 10 * 1024 * 1024;

/// A decoded message, whichever topic it came from.
#[derive(Debug, Clone, PartialEq)]
pub enum Inbound {
    /// From `control/proplet/create`.
    Discovery(Discovery),
    /// From `control/proplet/alive` with status `alive` (or none).
    Heartbeat(Heartbeat),
    /// From `control/proplet/alive` with status `offline`: a Last Will, never a heartbeat.
    Offline(OfflineNotice),
    /// From `control/proplet/metrics`.
    PropletMetrics(PropletMetrics),
    /// From `control/proplet/task_metrics`.
    TaskMetrics(TaskMetrics),
    /// From `control/proplet/results`.
    Result(TaskResult),
    /// From `control/proplet/invoke_results`.
    InvokeResult(InvokeResult),
    /// From `control/proplet/upgrade`.
    UpgradeReport(UpgradeReport),
    /// From `control/proplet/logs`.
    Logs(TaskLogs),
    /// From `control/manager/start` (boxed: by far the largest message).
    Start(Box<StartRequest>),
    /// From `control/manager/stop`.
    Stop(StopRequest),
    /// From `control/manager/invoke`.
    Invoke(InvokeRequest),
    /// From `control/manager/upgrade`.
    Upgrade(UpgradeRequest),
    /// From `registry/proplet`.
    RegistryRequest(RegistryRequest),
    /// From `registry/server`.
    RegistryChunk(RegistryChunk),
    /// From `fl/rounds/start`.
    FlRoundStart(FlRoundStart),
    /// From `fl/rounds/{round}/updates/{proplet}`, prefixed or not.
    FlUpdate(Box<FlUpdateMessage>),
}

impl Inbound {
    /// The topic kind this message travels on.
    pub fn kind(&self) -> TopicKind {
        match self {
            Self::Discovery(_) => TopicKind::Discovery,
            Self::Heartbeat(_) | Self::Offline(_) => TopicKind::Alive,
            Self::PropletMetrics(_) => TopicKind::PropletMetrics,
            Self::TaskMetrics(_) => TopicKind::TaskMetrics,
            Self::Result(_) => TopicKind::Results,
            Self::InvokeResult(_) => TopicKind::InvokeResults,
            Self::UpgradeReport(_) => TopicKind::UpgradeReport,
            Self::Logs(_) => TopicKind::Logs,
            Self::Upgrade(_) => TopicKind::Upgrade,
            Self::Start(_) => TopicKind::Start,
            Self::Stop(_) => TopicKind::Stop,
            Self::Invoke(_) => TopicKind::Invoke,
            Self::RegistryRequest(_) => TopicKind::RegistryRequest,
            Self::RegistryChunk(_) => TopicKind::RegistryChunk,
            Self::FlRoundStart(_) => TopicKind::FlRoundStart,
            Self::FlUpdate(m) => TopicKind::FlUpdate {
                round_id: m.round_id.clone(),
                proplet_id: m.proplet_id.clone(),
            },
        }
    }

    /// The payload bytes, as the message's own `encode` writes them.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Discovery(m) => m.encode(),
            Self::Heartbeat(m) => m.encode(),
            Self::Offline(m) => m.encode(),
            Self::PropletMetrics(m) => m.encode(),
            Self::TaskMetrics(m) => m.encode(),
            Self::Result(m) => m.encode(),
            Self::InvokeResult(m) => m.encode(),
            Self::UpgradeReport(m) => m.encode(),
            Self::Logs(m) => m.encode(),
            Self::Upgrade(m) => m.encode(),
            Self::Start(m) => m.encode(),
            Self::Stop(m) => m.encode(),
            Self::Invoke(m) => m.encode(),
            Self::RegistryRequest(m) => m.encode(),
            Self::RegistryChunk(m) => m.encode(),
            Self::FlRoundStart(m) => m.encode(),
            Self::FlUpdate(m) => m.envelope.encode(),
        }
    }

    /// The agent id the message claims to come from, for checking it against the authenticated
    /// MQTT client: `proplet_id` of agent reports (the topic's participant level for FL
    /// updates). `None` for operator-side messages and for reports that carry no id (embedded
    /// results, registry requests).
    pub fn claimed_proplet_id(&self) -> Option<&str> {
        match self {
            Self::Discovery(m) => Some(&m.proplet_id),
            Self::Heartbeat(m) => Some(&m.proplet_id),
            Self::Offline(m) => Some(&m.proplet_id),
            Self::PropletMetrics(m) => Some(&m.proplet_id),
            Self::TaskMetrics(m) => m.proplet_id.as_deref(),
            Self::Result(m) => m.proplet_id.as_deref(),
            Self::InvokeResult(m) => m.proplet_id.as_deref(),
            Self::FlUpdate(m) => Some(m.proplet_id.as_str()),
            Self::UpgradeReport(m) => Some(&m.proplet_id),
            Self::Logs(m) => Some(&m.proplet_id),
            Self::Upgrade(_)
            | Self::Start(_)
            | Self::Stop(_)
            | Self::Invoke(_)
            | Self::RegistryRequest(_)
            | Self::RegistryChunk(_)
            | Self::FlRoundStart(_) => None,
        }
    }
}

/// Decodes payloads with a size limit checked before any parsing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decoder {
    max_payload_bytes: usize,
}

impl Default for Decoder {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_PAYLOAD_BYTES)
    }
}

impl Decoder {
    /// A decoder refusing payloads above `max_payload_bytes`.
    pub const fn new(max_payload_bytes: usize) -> Self {
        Self { max_payload_bytes }
    }

    /// The configured limit.
    pub const fn max_payload_bytes(&self) -> usize {
        self.max_payload_bytes
    }

    /// Decodes `payload` as the message type `kind` carries.
    pub fn decode(&self, kind: &TopicKind, payload: &[u8]) -> Result<Inbound, DecodeError> {
        if payload.len() > self.max_payload_bytes {
            return Err(DecodeError::TooLarge {
                size: payload.len(),
                max: self.max_payload_bytes,
            });
        }
        let obj = parse_object(payload)?;
        let f = Fields::root(&obj);
        let msg = match kind {
            TopicKind::Discovery => Inbound::Discovery(Discovery::from_fields(f)?),
            TopicKind::Alive => decode_alive(f)?,
            TopicKind::PropletMetrics => Inbound::PropletMetrics(PropletMetrics::from_fields(f)?),
            TopicKind::TaskMetrics => Inbound::TaskMetrics(TaskMetrics::from_fields(f)?),
            TopicKind::Results => Inbound::Result(TaskResult::from_fields(f)?),
            TopicKind::InvokeResults => Inbound::InvokeResult(InvokeResult::from_fields(f)?),
            TopicKind::UpgradeReport => Inbound::UpgradeReport(UpgradeReport::from_fields(f)?),
            TopicKind::Logs => Inbound::Logs(TaskLogs::from_fields(f)?),
            TopicKind::Upgrade => Inbound::Upgrade(UpgradeRequest::from_fields(f)?),
            TopicKind::Start => Inbound::Start(Box::new(StartRequest::from_fields(f)?)),
            TopicKind::Stop => Inbound::Stop(StopRequest::from_fields(f)?),
            TopicKind::Invoke => Inbound::Invoke(InvokeRequest::from_fields(f)?),
            TopicKind::RegistryRequest => {
                Inbound::RegistryRequest(RegistryRequest::from_fields(f)?)
            }
            TopicKind::RegistryChunk => Inbound::RegistryChunk(RegistryChunk::from_fields(f)?),
            TopicKind::FlRoundStart => Inbound::FlRoundStart(FlRoundStart::from_fields(f)?),
            TopicKind::FlUpdate {
                round_id,
                proplet_id,
            } => Inbound::FlUpdate(Box::new(FlUpdateMessage {
                round_id: round_id.clone(),
                proplet_id: proplet_id.clone(),
                envelope: FlUpdate::from_fields(f)?,
            })),
        };
        Ok(msg)
    }
}

/// Decodes with [`DEFAULT_MAX_PAYLOAD_BYTES`]; see [`Decoder::decode`].
pub fn decode(kind: &TopicKind, payload: &[u8]) -> Result<Inbound, DecodeError> {
    Decoder::default().decode(kind, payload)
}
