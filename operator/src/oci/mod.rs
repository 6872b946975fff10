//! Wasm modules from OCI registries, served to devices over MQTT by propeller itself (the job
//! of upstream's separate proxy): a Task's `imageUrl` is resolved once per run to a manifest
//! digest (recorded in `status.imageDigest`), its Wasm layer is pulled into a size-capped
//! on-disk cache, and devices that ask on `registry/proplet` get it as `registry/server`
//! chunks under the digest-pinned name their start message carried.
//!
//! Resolution runs beside the reconcilers, never inside one: the Task plan asks for it, the
//! reconcile returns, and the outcome wakes the Task's next reconcile, which reads it as
//! an observation (a failure ends the task with the registry's reason, within seconds).

pub mod artifact;
pub mod cache;
pub mod credentials;
pub mod metrics;
pub mod puller;
pub use propeller_core::image_reference as reference;
pub mod responder;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use propeller_broker::server::{BrokerEvent, EventKind, Publisher};
use tracing::{info, warn};

use crate::crd::task::Task;
use crate::decision::task::ImageObservation;
use crate::state::lock;
pub use credentials::RegistryLogins;
pub use metrics::ImageMetrics;
pub use puller::{ImageError, ImagePuller, PullerConfig, ResolvedImage};
pub use responder::ImageServer;

/// Reads the Docker config JSON of a pull Secret (the API server or the embedded store).
pub trait PullSecrets: Send + Sync {
    /// The `.dockerconfigjson` of Secret `name` in `namespace`, or why it cannot be used.
    fn docker_config<'a>(
        &'a self,
        namespace: &'a str,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>, String>>;
}

/// Settings of registry access and chunk serving.
#[derive(Debug, Clone)]
pub struct ImagesConfig {
    /// How registries are reached and how much is cached.
    pub puller: PullerConfig,
    /// The operator's own logins (used when a Task names no Secret for the registry).
    pub logins: RegistryLogins,
    /// Chunk publishing pace in bytes per second (0: unpaced).
    pub chunk_rate: u64,
}

/// How long a finished resolution is remembered for a run that did not read it.
const FORGET_AFTER: Duration = Duration::from_secs(3600);

struct RunImage {
    state: ImageObservation,
    at: Instant,
}

type WakeTask = Box<dyn Fn(&str) + Send + Sync>;

/// Registry resolution for Task runs and the serving of the results to devices.
pub struct Images {
    puller: Arc<ImagePuller>,
    server: Arc<ImageServer>,
    logins: RegistryLogins,
    secrets: Arc<dyn PullSecrets>,
    /// Resolutions by (task UID, run count before the run).
    runs: Mutex<HashMap<(String, i64), RunImage>>,
    wake_task: OnceLock<WakeTask>,
    metrics: ImageMetrics,
}

fn run_key(task: &Task) -> (String, i64) {
    (
        task.metadata.uid.clone().unwrap_or_default(),
        task.status.as_ref().and_then(|s| s.run_count).unwrap_or(0),
    )
}

impl Images {
    /// Opens the cache and prepares serving through `publisher`.
    pub fn new(
        config: ImagesConfig,
        publisher: Publisher,
        secrets: Arc<dyn PullSecrets>,
    ) -> Result<Arc<Self>, ImageError> {
        let metrics = ImageMetrics::default();
        let puller = Arc::new(ImagePuller::new(config.puller)?.with_metrics(metrics.clone()));
        let server = Arc::new(
            ImageServer::new(puller.clone(), publisher, config.chunk_rate)
                .with_metrics(metrics.clone()),
        );
        Ok(Arc::new(Self {
            puller,
            server,
            logins: config.logins,
            secrets,
            runs: Mutex::default(),
            wake_task: OnceLock::new(),
            metrics,
        }))
    }

    /// Sets what is called with a Task's UID when its resolution finished (once).
    pub fn on_resolved(&self, wake_task: impl Fn(&str) + Send + Sync + 'static) {
        let _ = self.wake_task.set(Box::new(wake_task));
    }

    /// The service's counters.
    pub fn metrics(&self) -> &ImageMetrics {
        &self.metrics
    }

    /// Where this run's resolution stands, if it was asked for.
    pub fn observe(&self, task: &Task) -> Option<ImageObservation> {
        lock(&self.runs)
            .get(&run_key(task))
            .map(|r| r.state.clone())
    }

    /// Starts resolving the task's `imageUrl` for its next run, unless already under way.
    pub fn resolve(self: &Arc<Self>, task: &Task) {
        let key = run_key(task);
        {
            let mut runs = lock(&self.runs);
            runs.retain(|_, r| {
                r.state == ImageObservation::Resolving || r.at.elapsed() < FORGET_AFTER
            });
            if runs.contains_key(&key) {
                return;
            }
            runs.insert(
                key.clone(),
                RunImage {
                    state: ImageObservation::Resolving,
                    at: Instant::now(),
                },
            );
        }
        let image = task.spec.image_url.clone().unwrap_or_default();
        let namespace = task
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let secrets: Vec<String> = task
            .spec
            .image_pull_secrets
            .iter()
            .map(|s| s.name.clone())
            .collect();
        let name = task.metadata.name.clone().unwrap_or_default();
        let this = self.clone();
        tokio::spawn(async move {
            let outcome = this.resolve_now(&image, &namespace, &secrets).await;
            let label = if outcome.is_ok() {
                "resolved"
            } else {
                "failed"
            };
            this.metrics
                .resolutions
                .get_or_create(&metrics::OutcomeLabels {
                    outcome: label.into(),
                })
                .inc();
            let state = match outcome {
                Ok(resolved) => {
                    info!(task = %name, image = %image, digest = %resolved.manifest_digest, bytes = resolved.size, "image resolved");
                    ImageObservation::Resolved {
                        digest: resolved.manifest_digest,
                    }
                }
                Err(error) => {
                    warn!(task = %name, image = %image, "{error}");
                    ImageObservation::Failed(error.to_string())
                }
            };
            lock(&this.runs).insert(
                key.clone(),
                RunImage {
                    state,
                    at: Instant::now(),
                },
            );
            if let Some(wake_task) = this.wake_task.get() {
                wake_task(&key.0);
            }
        });
    }

    async fn resolve_now(
        &self,
        image: &str,
        namespace: &str,
        secrets: &[String],
    ) -> Result<ResolvedImage, ImageError> {
        let mut logins = self.logins.clone();
        for secret in secrets {
            let json = self
                .secrets
                .docker_config(namespace, secret)
                .await
                .map_err(|e| {
                    ImageError::Credentials(format!("Secret {namespace}/{secret}: {e}"))
                })?;
            let parsed = RegistryLogins::parse(&json).map_err(|e| {
                ImageError::Credentials(format!("Secret {namespace}/{secret}: {e}"))
            })?;
            logins.merge(&parsed);
        }
        self.puller.resolve(image, &logins).await
    }

    /// Answers a `registry/proplet` request; `false` if `event` is something else.
    pub fn handle_request(&self, event: &BrokerEvent) -> bool {
        let EventKind::RegistryRequest(request) = &event.kind else {
            return false;
        };
        match (&event.domain, &event.channel) {
            (Some(domain), Some(channel)) => {
                self.server
                    .request(&event.client_id, domain, channel, &request.app_name);
            }
            _ => warn!(client = %event.client_id, "registry request without a channel; ignored"),
        }
        true
    }
}
