//! Answers devices' `registry/proplet` requests with `registry/server` chunks, the wire format
//! upstream's proxy uses, so upstream proplets work unchanged.
//!
//! Every device on a channel receives every chunk, so one round of chunks serves all devices
//! that asked before it began. A device that asks while a round runs missed only the chunks
//! published before its request arrived: the next round resends just those (both upstream's
//! proplet and ours assemble chunks by index, in any order). A second request from the same
//! device (two tasks waiting for one image) gets a full round. Chunks are paced by a byte
//! rate shared by all transfers, so a large module to many devices leaves the broker room
//! for heartbeats.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use propeller_broker::protocol::{split_into_chunks, Channel, DEFAULT_RAW_CHUNK_SIZE};
use propeller_broker::server::Publisher;
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::metrics::ImageMetrics;
use super::puller::ImagePuller;
use crate::state::lock;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct TransferKey {
    domain: String,
    channel: String,
    name: String,
}

#[derive(Debug, Default)]
struct Transfer {
    /// Devices that asked since the current (or next) round began.
    asked: HashSet<String>,
    /// The current round's first chunk went out: later askers need another round.
    started: bool,
    /// Another round must follow this one.
    again: bool,
    /// Chunks of the current round published so far.
    published: u32,
    /// The current round sends every chunk (not only a prefix).
    full_round: bool,
    /// The next round must send every chunk (a repeat asker, or one that came in during a
    /// prefix round and missed the rest before it).
    next_full: bool,
    /// Otherwise the next round sends chunks `0..resend_upto`: what late askers missed.
    resend_upto: u32,
}

impl Transfer {
    /// The state at the start of a round.
    fn round(full_round: bool) -> Self {
        Self {
            started: true,
            full_round,
            ..Self::default()
        }
    }
}

/// Shares the publishing rate between transfers: each chunk reserves its slot in time.
#[derive(Debug)]
struct Pace {
    bytes_per_sec: u64,
    next_free: Mutex<Instant>,
}

impl Pace {
    async fn reserve(&self, bytes: usize) {
        if self.bytes_per_sec == 0 {
            return;
        }
        let cost = Duration::from_secs_f64(bytes as f64 / self.bytes_per_sec as f64);
        let start = {
            let mut next = lock(&self.next_free);
            let start = (*next).max(Instant::now());
            *next = start + cost;
            start
        };
        tokio::time::sleep_until(start).await;
    }
}

/// Serves binaries the [`ImagePuller`] resolved to the devices that ask for them.
pub struct ImageServer {
    puller: Arc<ImagePuller>,
    publisher: Publisher,
    chunk_size: usize,
    pace: Pace,
    transfers: Mutex<HashMap<TransferKey, Transfer>>,
    metrics: ImageMetrics,
}

impl ImageServer {
    /// A server publishing through `publisher` at `bytes_per_sec` (0: unpaced).
    pub fn new(puller: Arc<ImagePuller>, publisher: Publisher, bytes_per_sec: u64) -> Self {
        Self {
            puller,
            publisher,
            chunk_size: DEFAULT_RAW_CHUNK_SIZE,
            pace: Pace {
                bytes_per_sec,
                next_free: Mutex::new(Instant::now()),
            },
            transfers: Mutex::default(),
            metrics: ImageMetrics::default(),
        }
    }

    /// Counts transfers in `metrics`.
    pub fn with_metrics(mut self, metrics: ImageMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Transfers completed so far.
    pub fn transfers_sent(&self) -> u64 {
        self.metrics.transfers.get()
    }

    /// Handles one request by `client_id` on `domain`/`channel` (never blocks).
    pub fn request(self: &Arc<Self>, client_id: &str, domain: &str, channel: &str, name: &str) {
        let key = TransferKey {
            domain: domain.to_owned(),
            channel: channel.to_owned(),
            name: name.to_owned(),
        };
        let spawn = {
            let mut transfers = lock(&self.transfers);
            match transfers.get_mut(&key) {
                Some(t) => {
                    if t.asked.contains(client_id) || (t.started && !t.full_round) {
                        t.again = true;
                        t.next_full = true;
                    } else if t.started {
                        t.again = true;
                        t.resend_upto = t.resend_upto.max(t.published);
                    }
                    t.asked.insert(client_id.to_owned());
                    false
                }
                None => {
                    let mut t = Transfer::default();
                    t.asked.insert(client_id.to_owned());
                    transfers.insert(key.clone(), t);
                    true
                }
            }
        };
        debug!(
            client = client_id,
            image = name,
            queued = !spawn,
            "binary requested"
        );
        if spawn {
            let this = self.clone();
            tokio::spawn(async move { this.transfer(key).await });
        }
    }

    async fn transfer(self: Arc<Self>, key: TransferKey) {
        if let Err(message) = self.send_rounds(&key).await {
            lock(&self.transfers).remove(&key);
            warn!(image = %key.name, channel = %key.channel, "{message}");
        }
    }

    async fn send_rounds(&self, key: &TransferKey) -> Result<(), String> {
        let channel = Channel::new(key.domain.clone(), key.channel.clone())
            .map_err(|e| format!("cannot answer the request: {e}"))?;
        let binary = match self.puller.binary(&key.name).await {
            Ok(Some(binary)) => binary,
            Ok(None) => {
                return Err(format!(
                    "a device asked for {}, which no task of this propeller resolved; not served",
                    key.name
                ))
            }
            Err(e) => return Err(format!("cannot serve the binary: {e}")),
        };
        let total = binary.len().div_ceil(self.chunk_size).max(1);
        let mut round_end = total;
        if let Some(t) = lock(&self.transfers).get_mut(key) {
            *t = Transfer::round(true);
        }
        loop {
            let chunks = split_into_chunks(&key.name, &binary, self.chunk_size)
                .map_err(|e| format!("cannot split the binary: {e}"))?;
            let mut bytes = 0u64;
            for chunk in chunks.take(round_end) {
                self.pace.reserve(chunk.data.len()).await;
                bytes += chunk.data.len() as u64;
                self.publisher
                    .registry_chunk(&channel, &chunk)
                    .await
                    .map_err(|e| format!("publishing chunk {}: {e}", chunk.chunk_idx))?;
                if let Some(t) = lock(&self.transfers).get_mut(key) {
                    t.published += 1;
                }
            }
            self.metrics.transfers.inc();
            self.metrics.chunk_bytes.inc_by(bytes);
            info!(image = %key.name, channel = %key.channel, chunks = round_end, of = total, "binary sent");
            // Decide, and deregister or start the next round, under one lock: a request
            // cannot slip in between.
            let mut transfers = lock(&self.transfers);
            match transfers.get_mut(key) {
                Some(t) if t.again => {
                    round_end = if t.next_full {
                        total
                    } else {
                        (t.resend_upto as usize).clamp(1, total)
                    };
                    *t = Transfer::round(round_end == total);
                }
                _ => {
                    transfers.remove(key);
                    return Ok(());
                }
            }
        }
    }
}
