//! Wasm binaries served as registry chunks over MQTT: the request and the assembly.

use propeller_broker::protocol::{
    ChunkAssembler, ChunkError, ChunkProgress, RegistryChunk, RegistryRequest,
};
use rumqttc::QoS;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::wasm::RunError;

use super::{Agent, Fetch};

impl Agent {
    /// Requests `image` from the registry proxy and waits for all its chunks.
    pub(super) async fn fetch_chunks(&self, image: &str) -> Result<Vec<u8>, String> {
        let (tx, rx) = oneshot::channel();
        {
            let mut fetches = self.lock_fetches();
            fetches
                .entry(image.to_owned())
                .or_insert_with(|| Fetch {
                    assembler: ChunkAssembler::new(image, self.config.max_module_size),
                    waiters: Vec::new(),
                })
                .waiters
                .push(tx);
        }
        self.request_chunks(image).await?;
        match tokio::time::timeout(self.config.chunk_timeout, rx).await {
            Ok(Ok(outcome)) => outcome,
            _ => {
                self.lock_fetches().remove(image);
                Err(format!(
                    "timed out after {:?} waiting for the chunks of {image}",
                    self.config.chunk_timeout
                ))
            }
        }
    }

    /// Asks the registry proxy for `image`'s chunks.
    async fn request_chunks(&self, image: &str) -> Result<(), String> {
        let request = RegistryRequest {
            app_name: image.to_owned(),
        };
        self.client
            .publish(
                self.channel.registry_request(),
                QoS::AtMostOnce,
                false,
                request.encode(),
            )
            .await
            .map_err(|e| format!("cannot request {image}: {e}"))
    }

    /// Asks again for every image whose chunks are still awaited, on a new connection: the
    /// chunks on their way when the last one dropped went with it. The chunks already held
    /// are kept; propeller sends the image again and the repeats are dropped.
    pub(super) async fn ask_again_for_chunks(&self) {
        let images: Vec<String> = self.lock_fetches().keys().cloned().collect();
        for image in images {
            info!(image, "chunks asked for again after a reconnect");
            if let Err(e) = self.request_chunks(&image).await {
                warn!(image, %e, "chunks not asked for again");
            }
        }
    }

    /// Collects a chunk, but only for images this proplet asked for.
    pub(super) fn on_chunk(&self, chunk: RegistryChunk) {
        let mut fetches = self.lock_fetches();
        let Some(fetch) = fetches.get_mut(&chunk.app_name) else {
            return;
        };
        let name = chunk.app_name.clone();
        let limit = self.config.max_module_size;
        // Chunks before the last are all of one size: their count announces the least size
        // of the binary, so one that cannot fit is refused at its first chunk, not its last.
        let announced = (chunk.chunk_idx + 1 < chunk.total_chunks)
            .then(|| u64::from(chunk.total_chunks - 1) * chunk.data.len() as u64 + 1);
        let outcome = match announced {
            Some(least) if least > limit as u64 => Err(RunError::TooLarge {
                what: format!("image {name} ({} chunks)", chunk.total_chunks),
                size: least,
                at_least: true,
                limit,
            }
            .to_string()),
            _ => match fetch.assembler.push(chunk) {
                Ok(ChunkProgress::Complete(bytes)) => Ok(bytes),
                Ok(ChunkProgress::Pending { received, total }) => {
                    debug!(image = name, received, total, "chunk stored");
                    return;
                }
                // propeller resends the first chunks for devices that asked late.
                Err(error @ ChunkError::DuplicateIndex { .. }) => {
                    debug!(image = name, %error, "chunk already held");
                    return;
                }
                Err(ChunkError::TooLarge { size, max }) => Err(RunError::TooLarge {
                    what: format!("image {name}"),
                    size: size as u64,
                    at_least: true,
                    limit: max,
                }
                .to_string()),
                Err(error) => {
                    warn!(image = name, %error, "chunk rejected");
                    return;
                }
            },
        };
        if let Some(done) = fetches.remove(&name) {
            for waiter in done.waiters {
                let _ = waiter.send(outcome.clone());
            }
        }
    }
}
