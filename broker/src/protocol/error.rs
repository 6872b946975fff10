//! Error types of the protocol module.
//!
//! Every decode error that concerns a key names that key (nested keys are written with dots,
//! list items with `[i]`, e.g. `monitoring_profile.interval` or `inputs[2]`), so a log line is
//! enough to tell a sender what to fix.

/// Why a payload could not be decoded into a typed message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The payload is larger than the configured maximum; checked before any parsing so an
    /// oversized message costs nothing.
    #[error("payload of {size} bytes exceeds the limit of {max} bytes")]
    TooLarge {
        /// Payload size in bytes.
        size: usize,
        /// Configured maximum in bytes.
        max: usize,
    },
    /// The payload is not valid UTF-8 JSON.
    #[error("payload is not valid JSON: {reason}")]
    NotJson {
        /// Parser message (position and kind of the syntax error; never payload content).
        reason: String,
    },
    /// The payload is valid JSON but not an object; every message of the protocol is one.
    #[error("payload is not a JSON object")]
    NotAnObject,
    /// A required key is absent (or `null`).
    #[error("missing required key `{key}`")]
    MissingKey {
        /// The missing key.
        key: String,
    },
    /// A key holds a JSON value of the wrong type.
    #[error("key `{key}` has the wrong type: expected {expected}")]
    WrongType {
        /// The offending key.
        key: String,
        /// What the key should hold.
        expected: &'static str,
    },
    /// A key has the right type but an unacceptable value (empty id, bad base64, ...).
    #[error("key `{key}` is invalid: {reason}")]
    InvalidValue {
        /// The offending key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl DecodeError {
    /// The key the error is about, if it concerns one; lets callers count errors per key.
    pub fn key(&self) -> Option<&str> {
        match self {
            Self::MissingKey { key }
            | Self::WrongType { key, .. }
            | Self::InvalidValue { key, .. } => Some(key),
            Self::TooLarge { .. } | Self::NotJson { .. } | Self::NotAnObject => None,
        }
    }
}

/// Why a string cannot be used as one level of an MQTT topic.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    /// An empty id would produce `m//c/...`, which no upstream component expects.
    #[error("{what} must not be empty")]
    Empty {
        /// Which id was rejected (`domain`, `channel`, `round id`, ...).
        what: &'static str,
    },
    /// The id contains a character that would add a topic level or act as a wildcard.
    #[error("{what} must not contain {ch:?}")]
    ForbiddenChar {
        /// Which id was rejected.
        what: &'static str,
        /// The forbidden character found.
        ch: char,
    },
}

/// Why a registry chunk was not accepted by a [`ChunkAssembler`](super::ChunkAssembler) or why
/// a binary could not be split.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// The chunk belongs to another image; every agent sees every chunk on the channel.
    #[error("chunk is for `{got}`, expected `{expected}`")]
    WrongApp {
        /// The app name the assembler collects.
        expected: String,
        /// The app name the chunk carries.
        got: String,
    },
    /// `total_chunks` is zero, which can never complete.
    #[error("total_chunks must be at least 1")]
    ZeroTotal,
    /// `chunk_idx` is not below `total_chunks`.
    #[error("chunk index {index} is out of range for {total} chunks")]
    IndexOutOfRange {
        /// The chunk's index.
        index: u32,
        /// The chunk's total.
        total: u32,
    },
    /// The chunk disagrees with earlier chunks about the total.
    #[error("total_chunks {got} differs from {expected} announced by earlier chunks")]
    TotalMismatch {
        /// Total announced by the first accepted chunk.
        expected: u32,
        /// Total of this chunk.
        got: u32,
    },
    /// The index was already received (e.g. the proxy re-sent the image for another agent).
    #[error("chunk index {index} was already received")]
    DuplicateIndex {
        /// The repeated index.
        index: u32,
    },
    /// Accepting the chunk would exceed the configured size cap.
    #[error("assembled size {size} bytes would exceed the limit of {max} bytes")]
    TooLarge {
        /// Size the assembly would reach.
        size: usize,
        /// Configured cap.
        max: usize,
    },
    /// The assembly already completed and handed out its bytes.
    #[error("assembly is already complete")]
    AlreadyComplete,
    /// The binary needs more chunks than `total_chunks` (a `u32`) can count.
    #[error("binary needs more than {max} chunks", max = u32::MAX)]
    TooManyChunks,
}
