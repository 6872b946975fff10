//! Counters of registry pulls and chunk serving, for `/metrics`.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

/// Labels of [`ImageMetrics::resolutions`].
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct OutcomeLabels {
    /// `resolved` or `failed`.
    pub outcome: String,
}

/// What the image service did. Cheap to clone (the counters are shared).
#[derive(Clone, Debug, Default)]
pub struct ImageMetrics {
    /// Task runs whose image was resolved, by outcome.
    pub resolutions: Family<OutcomeLabels, Counter>,
    /// Layers pulled from a registry (a cached layer is not pulled again).
    pub registry_pulls: Counter,
    /// Bytes pulled from registries.
    pub registry_bytes: Counter,
    /// Chunk transfers to a channel (one serves every device that asked together).
    pub transfers: Counter,
    /// Binary bytes published as chunks.
    pub chunk_bytes: Counter,
}

impl ImageMetrics {
    /// Adds the counters to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "image_resolutions",
            "Task runs whose OCI image was resolved, by outcome",
            self.resolutions.clone(),
        );
        registry.register(
            "image_registry_pulls",
            "Wasm layers pulled from a registry",
            self.registry_pulls.clone(),
        );
        registry.register(
            "image_registry_bytes",
            "Bytes pulled from registries",
            self.registry_bytes.clone(),
        );
        registry.register(
            "image_transfers",
            "Chunk transfers of a binary to a channel",
            self.transfers.clone(),
        );
        registry.register(
            "image_chunk_bytes",
            "Binary bytes published as registry chunks",
            self.chunk_bytes.clone(),
        );
    }
}
