//! Binary transfer over MQTT: `registry/proplet` requests and `registry/server` chunks, plus
//! splitting and reassembly.
//!
//! Reassembly is pure: the [`ChunkAssembler`] never looks at a clock, so timeouts and expiry
//! stay with the agent that owns it.

use std::collections::BTreeMap;

use serde_json::Value;

use super::error::{ChunkError, DecodeError};
use super::fields::{b64_encode, to_bytes, Fields, ObjectBuilder};

/// Raw bytes per chunk before base64, as the upstream proxy (`PROXY_CHUNK_SIZE`) uses.
pub const DEFAULT_RAW_CHUNK_SIZE: usize = 512_000;

/// An agent asks for a Wasm binary (`registry/proplet`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryRequest {
    /// `app_name` (required, non-empty): the task's `image_url`.
    pub app_name: String,
}

impl RegistryRequest {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        Ok(Self {
            app_name: f.req_id("app_name")?,
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("app_name", self.app_name.clone())
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// One piece of a Wasm binary (`registry/server`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryChunk {
    /// `app_name` (required, non-empty).
    pub app_name: String,
    /// `chunk_idx` (required): 0-based, below `total_chunks`.
    pub chunk_idx: u32,
    /// `total_chunks` (required): at least 1.
    pub total_chunks: u32,
    /// `data` (required): the raw bytes, standard base64 on the wire.
    pub data: Vec<u8>,
}

impl RegistryChunk {
    pub(crate) fn from_fields(f: Fields<'_>) -> Result<Self, DecodeError> {
        let app_name = f.req_id("app_name")?;
        let chunk_idx = f.req_u32("chunk_idx")?;
        let total_chunks = f.req_u32("total_chunks")?;
        if total_chunks == 0 {
            return Err(DecodeError::InvalidValue {
                key: "total_chunks".into(),
                reason: "must be at least 1".into(),
            });
        }
        if chunk_idx >= total_chunks {
            return Err(DecodeError::InvalidValue {
                key: "chunk_idx".into(),
                reason: format!("{chunk_idx} is not below total_chunks {total_chunks}"),
            });
        }
        Ok(Self {
            app_name,
            chunk_idx,
            total_chunks,
            data: f.req_base64("data")?,
        })
    }

    /// The JSON object.
    pub fn to_json(&self) -> Value {
        ObjectBuilder::new()
            .put("app_name", self.app_name.clone())
            .put("chunk_idx", self.chunk_idx)
            .put("total_chunks", self.total_chunks)
            .put("data", b64_encode(&self.data))
            .build()
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        to_bytes(&self.to_json())
    }
}

/// Yields the chunks of one binary in index order, copying one chunk at a time.
#[derive(Debug, Clone)]
pub struct ChunkIter<'a> {
    app_name: String,
    pieces: std::slice::Chunks<'a, u8>,
    next_idx: u32,
    total: u32,
    empty_pending: bool,
}

impl Iterator for ChunkIter<'_> {
    type Item = RegistryChunk;

    fn next(&mut self) -> Option<RegistryChunk> {
        let data = match self.pieces.next() {
            Some(piece) => piece.to_vec(),
            None if self.empty_pending => Vec::new(),
            None => return None,
        };
        self.empty_pending = false;
        let chunk = RegistryChunk {
            app_name: self.app_name.clone(),
            chunk_idx: self.next_idx,
            total_chunks: self.total,
            data,
        };
        self.next_idx = self.next_idx.saturating_add(1);
        Some(chunk)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.pieces.len() + usize::from(self.empty_pending);
        (n, Some(n))
    }
}

impl ExactSizeIterator for ChunkIter<'_> {}

/// Splits `binary` into chunks of `raw_chunk_size` bytes (a size of 0 is treated as 1). An empty
/// binary still yields one (empty) chunk, so the receiver can complete.
pub fn split_into_chunks<'a>(
    app_name: &str,
    binary: &'a [u8],
    raw_chunk_size: usize,
) -> Result<ChunkIter<'a>, ChunkError> {
    let size = raw_chunk_size.max(1);
    let pieces = binary.chunks(size);
    let count = pieces.len().max(1);
    let total = u32::try_from(count).map_err(|_| ChunkError::TooManyChunks)?;
    Ok(ChunkIter {
        app_name: app_name.to_owned(),
        pieces,
        next_idx: 0,
        total,
        empty_pending: binary.is_empty(),
    })
}

/// What [`ChunkAssembler::push`] achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkProgress {
    /// More chunks are needed.
    Pending {
        /// Distinct chunks held.
        received: u32,
        /// Chunks expected.
        total: u32,
    },
    /// All chunks arrived; the joined binary.
    Complete(Vec<u8>),
}

/// Reassembles one binary from its chunks, validating each one.
///
/// Unlike the upstream agent it refuses out-of-range indices, reports duplicates and enforces a
/// size cap, so a peer on the channel cannot make it buffer without bound.
#[derive(Debug, Clone)]
pub struct ChunkAssembler {
    app_name: String,
    max_bytes: usize,
    total: Option<u32>,
    chunks: BTreeMap<u32, Vec<u8>>,
    bytes: usize,
    complete: bool,
}

impl ChunkAssembler {
    /// Collects chunks of `app_name`, refusing to hold more than `max_bytes` raw bytes.
    pub fn new(app_name: impl Into<String>, max_bytes: usize) -> Self {
        Self {
            app_name: app_name.into(),
            max_bytes,
            total: None,
            chunks: BTreeMap::new(),
            bytes: 0,
            complete: false,
        }
    }

    /// The image this assembler collects.
    pub fn app_name(&self) -> &str {
        &self.app_name
    }

    /// Chunks expected, once the first chunk arrived.
    pub fn total(&self) -> Option<u32> {
        self.total
    }

    /// Distinct chunks held.
    pub fn received(&self) -> usize {
        self.chunks.len()
    }

    /// Raw bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Whether the binary was already handed out.
    pub fn is_complete(&self) -> bool {
        self.complete
    }

    /// Adds one chunk. A rejected chunk leaves the assembler unchanged.
    pub fn push(&mut self, chunk: RegistryChunk) -> Result<ChunkProgress, ChunkError> {
        if self.complete {
            return Err(ChunkError::AlreadyComplete);
        }
        if chunk.app_name != self.app_name {
            return Err(ChunkError::WrongApp {
                expected: self.app_name.clone(),
                got: chunk.app_name,
            });
        }
        if chunk.total_chunks == 0 {
            return Err(ChunkError::ZeroTotal);
        }
        if chunk.chunk_idx >= chunk.total_chunks {
            return Err(ChunkError::IndexOutOfRange {
                index: chunk.chunk_idx,
                total: chunk.total_chunks,
            });
        }
        if let Some(expected) = self.total {
            if expected != chunk.total_chunks {
                return Err(ChunkError::TotalMismatch {
                    expected,
                    got: chunk.total_chunks,
                });
            }
        }
        if self.chunks.contains_key(&chunk.chunk_idx) {
            return Err(ChunkError::DuplicateIndex {
                index: chunk.chunk_idx,
            });
        }
        let size = self.bytes.saturating_add(chunk.data.len());
        if size > self.max_bytes {
            return Err(ChunkError::TooLarge {
                size,
                max: self.max_bytes,
            });
        }

        let total = chunk.total_chunks;
        self.total = Some(total);
        self.bytes = size;
        self.chunks.insert(chunk.chunk_idx, chunk.data);

        let received = u32::try_from(self.chunks.len()).unwrap_or(u32::MAX);
        if received < total {
            return Ok(ChunkProgress::Pending { received, total });
        }
        // Indices are distinct and below `total`, so all of 0..total are present.
        let mut binary = Vec::with_capacity(self.bytes);
        for data in std::mem::take(&mut self.chunks).into_values() {
            binary.extend_from_slice(&data);
        }
        self.bytes = 0;
        self.complete = true;
        Ok(ChunkProgress::Complete(binary))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(idx: u32, total: u32, data: &[u8]) -> RegistryChunk {
        RegistryChunk {
            app_name: "img".into(),
            chunk_idx: idx,
            total_chunks: total,
            data: data.to_vec(),
        }
    }

    #[test]
    fn split_uses_the_raw_size_and_numbers_chunks() {
        let bin: Vec<u8> = (0..10).collect();
        let chunks: Vec<_> = match split_into_chunks("img", &bin, 4) {
            Ok(it) => it.collect(),
            Err(e) => panic!("{e}"),
        };
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[0], chunk(0, 3, &[0, 1, 2, 3]));
        assert_eq!(chunks[1], chunk(1, 3, &[4, 5, 6, 7]));
        assert_eq!(chunks[2], chunk(2, 3, &[8, 9]));
    }

    #[test]
    fn split_edge_cases() {
        let empty: Vec<_> = split_into_chunks("img", &[], DEFAULT_RAW_CHUNK_SIZE)
            .map(Iterator::collect)
            .unwrap_or_default();
        assert_eq!(empty, vec![chunk(0, 1, &[])]);
        let zero_size: Vec<_> = split_into_chunks("img", &[7, 8], 0)
            .map(Iterator::collect)
            .unwrap_or_default();
        assert_eq!(zero_size, vec![chunk(0, 2, &[7]), chunk(1, 2, &[8])]);
        let it = split_into_chunks("img", &[0; 1_024_001], DEFAULT_RAW_CHUNK_SIZE);
        assert_eq!(it.map(|i| i.len()), Ok(3));
    }

    #[test]
    fn assembles_out_of_order() {
        let mut a = ChunkAssembler::new("img", 100);
        assert_eq!(
            a.push(chunk(2, 3, b"ef")),
            Ok(ChunkProgress::Pending {
                received: 1,
                total: 3
            })
        );
        assert_eq!(
            a.push(chunk(0, 3, b"ab")),
            Ok(ChunkProgress::Pending {
                received: 2,
                total: 3
            })
        );
        assert_eq!(
            a.push(chunk(1, 3, b"cd")),
            Ok(ChunkProgress::Complete(b"abcdef".to_vec()))
        );
        assert!(a.is_complete());
        assert_eq!(a.push(chunk(0, 3, b"ab")), Err(ChunkError::AlreadyComplete));
    }

    #[test]
    fn rejects_invalid_chunks_without_changing_state() {
        let mut a = ChunkAssembler::new("img", 5);
        assert!(a.push(chunk(0, 2, b"abc")).is_ok());
        assert_eq!(
            a.push(chunk(0, 2, b"abc")),
            Err(ChunkError::DuplicateIndex { index: 0 })
        );
        assert_eq!(
            a.push(chunk(1, 3, b"d")),
            Err(ChunkError::TotalMismatch {
                expected: 2,
                got: 3
            })
        );
        assert_eq!(
            a.push(chunk(2, 2, b"d")),
            Err(ChunkError::IndexOutOfRange { index: 2, total: 2 })
        );
        assert_eq!(a.push(chunk(0, 0, b"d")), Err(ChunkError::ZeroTotal));
        assert_eq!(
            a.push(chunk(1, 2, b"def")),
            Err(ChunkError::TooLarge { size: 6, max: 5 })
        );
        let mut other = chunk(1, 2, b"d");
        other.app_name = "other".into();
        assert_eq!(
            a.push(other),
            Err(ChunkError::WrongApp {
                expected: "img".into(),
                got: "other".into()
            })
        );
        assert_eq!(a.received(), 1);
        assert_eq!(a.bytes(), 3);
        assert_eq!(
            a.push(chunk(1, 2, b"de")),
            Ok(ChunkProgress::Complete(b"abcde".to_vec()))
        );
    }

    #[test]
    fn split_then_assemble_restores_the_binary() {
        let bin: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let mut a = ChunkAssembler::new("img", bin.len());
        let mut out = None;
        let chunks: Vec<_> = split_into_chunks("img", &bin, 333)
            .into_iter()
            .flatten()
            .collect();
        assert_eq!(chunks.len(), 16);
        for c in chunks.into_iter().rev() {
            if let Ok(ChunkProgress::Complete(b)) = a.push(c) {
                out = Some(b);
            }
        }
        assert_eq!(out, Some(bin));
    }
}
