//! Resolving registry references and pulling Wasm layers with `oci-client`: one registry pull
//! per layer however many ask at once, the digest verified while streaming to disk, and a
//! size cap enforced before and during the download.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::{BoxFuture, FutureExt, Shared};
use oci_client::client::{Certificate, CertificateEncoding, ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use propeller_broker::protocol::encrypted_module::{frame_ocicrypt_layer, LayerDescriptor};
use tokio::io::AsyncWrite;

use super::artifact::{is_encrypted_layer, is_wasm, not_wasm_reason, wasm_layer, wasm_platform};
use super::cache::{sha256_hex, BlobCache, CacheError};
use super::credentials::RegistryLogins;
use super::metrics::ImageMetrics;
use super::reference::{parse, registry_reference};
use crate::state::lock;

/// Why an image cannot be given to a task. The text ends the task, so it names the image
/// and says what to check.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// The reference does not parse.
    #[error("invalid image reference {reference:?}: {reason}")]
    BadReference {
        /// As written in the Task.
        reference: String,
        /// The parser's message.
        reason: String,
    },
    /// The registry has no such repository, tag or digest.
    #[error("image {reference} not found in its registry")]
    NotFound {
        /// The reference.
        reference: String,
    },
    /// The registry refused the (possibly anonymous) login.
    #[error("registry refused access to {reference} ({reason}); check the Task's imagePullSecrets or the operator's registry login")]
    AuthRefused {
        /// The reference.
        reference: String,
        /// The registry's answer.
        reason: String,
    },
    /// The artifact is not a single Wasm binary.
    #[error("{reference} is not a Wasm artifact: {reason}")]
    NotWasm {
        /// The reference.
        reference: String,
        /// What it is instead.
        reason: String,
    },
    /// The Wasm layer is larger than the configured cap.
    #[error("{reference} is {size} bytes, above the {limit}-byte image limit")]
    TooLarge {
        /// The reference.
        reference: String,
        /// Declared or received size.
        size: u64,
        /// The cap.
        limit: u64,
    },
    /// The registry could not be reached or answered wrongly.
    #[error("pulling {reference} failed: {reason}")]
    Registry {
        /// The reference.
        reference: String,
        /// What happened.
        reason: String,
    },
    /// The registry took longer than the pull time limit.
    #[error("pulling {reference} timed out after {secs} s")]
    Timeout {
        /// The reference.
        reference: String,
        /// The limit.
        secs: u64,
    },
    /// The registry answered the TLS handshake in plain HTTP.
    #[error("pulling {reference} failed: the registry {registry} answered in plain HTTP, not HTTPS; if it serves plain HTTP on purpose (a development registry), start propeller with --registry-plain-http {registry}")]
    PlainHttp {
        /// The reference.
        reference: String,
        /// The registry's `host:port`.
        registry: String,
    },
    /// The image cache failed.
    #[error("image cache: {0}")]
    Cache(String),
    /// The named pull Secret is missing or malformed.
    #[error("registry credentials: {0}")]
    Credentials(String),
}

impl From<CacheError> for ImageError {
    fn from(e: CacheError) -> Self {
        Self::Cache(e.to_string())
    }
}

/// How registries are reached and how much is kept.
#[derive(Debug, Clone)]
pub struct PullerConfig {
    /// Largest Wasm layer accepted.
    pub max_bytes: u64,
    /// Time limit of one resolution (manifest and layer).
    pub timeout: Duration,
    /// Registries (`host:port`) spoken to over plain HTTP, for local development registries.
    pub plain_http: Vec<String>,
    /// Extra trusted CA certificates (PEM), for registries with a private CA.
    pub extra_ca_pem: Option<Vec<u8>>,
    /// Directory of the blob cache.
    pub cache_dir: PathBuf,
    /// Size cap of the blob cache.
    pub cache_bytes: u64,
}

/// What a tag resolved to for one task run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedImage {
    /// `registry/repo@sha256:…`: the name devices ask for.
    pub pinned: String,
    /// Digest of the manifest (what `status.imageDigest` records).
    pub manifest_digest: String,
    /// Digest of the Wasm layer (the cache key).
    pub layer_digest: String,
    /// Size of the layer in bytes.
    pub size: u64,
}

type PullResult = Result<(), ImageError>;

/// Pulls and caches Wasm layers. Cheap to share behind an `Arc`.
pub struct ImagePuller {
    config: PullerConfig,
    cache: Arc<BlobCache>,
    /// One client per (registry, login): oci-client keeps the first login it sees for a
    /// registry, so Tasks with different Secrets must not share a client.
    clients: Mutex<HashMap<String, Client>>,
    /// Layer pulls in progress, by layer digest.
    pulls: Mutex<HashMap<String, Shared<BoxFuture<'static, PullResult>>>>,
    /// How each pinned name was resolved, to pull its layer again after an eviction.
    origins: Mutex<HashMap<String, (Reference, OciDescriptor, RegistryAuth)>>,
    metrics: ImageMetrics,
}

impl std::fmt::Debug for ImagePuller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImagePuller")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn auth_key(registry: &str, auth: &RegistryAuth) -> String {
    let secret = match auth {
        RegistryAuth::Anonymous => String::new(),
        RegistryAuth::Basic(u, p) => sha256_hex(format!("basic\0{u}\0{p}").as_bytes()),
        RegistryAuth::Bearer(t) => sha256_hex(format!("bearer\0{t}").as_bytes()),
    };
    format!("{registry}#{secret}")
}

impl ImagePuller {
    /// A puller with its cache opened.
    pub fn new(config: PullerConfig) -> Result<Self, ImageError> {
        // reqwest is built without a bundled crypto provider: use ring, as kube does.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let cache = BlobCache::open(&config.cache_dir, config.cache_bytes)?;
        Ok(Self {
            config,
            cache: Arc::new(cache),
            clients: Mutex::default(),
            pulls: Mutex::default(),
            origins: Mutex::default(),
            metrics: ImageMetrics::default(),
        })
    }

    /// Counts pulls in `metrics`.
    pub fn with_metrics(mut self, metrics: ImageMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    fn client(&self, registry: &str, auth: &RegistryAuth) -> Client {
        lock(&self.clients)
            .entry(auth_key(registry, auth))
            .or_insert_with(|| {
                let protocol = if self.config.plain_http.is_empty() {
                    ClientProtocol::Https
                } else {
                    ClientProtocol::HttpsExcept(self.config.plain_http.clone())
                };
                let extra_root_certificates = self
                    .config
                    .extra_ca_pem
                    .iter()
                    .map(|pem| Certificate {
                        encoding: CertificateEncoding::Pem,
                        data: pem.clone(),
                    })
                    .collect();
                Client::new(ClientConfig {
                    protocol,
                    extra_root_certificates,
                    platform_resolver: Some(Box::new(wasm_platform)),
                    connect_timeout: Some(Duration::from_secs(10)),
                    read_timeout: Some(self.config.timeout),
                    ..ClientConfig::default()
                })
            })
            .clone()
    }

    /// Resolves `image_url` to a manifest digest, checks it is a Wasm artifact within the
    /// size cap, and makes sure its layer is in the cache; `logins` gives the registry's.
    pub async fn resolve(
        self: &Arc<Self>,
        image_url: &str,
        logins: &RegistryLogins,
    ) -> Result<ResolvedImage, ImageError> {
        let written = registry_reference(image_url).unwrap_or(image_url);
        let reference = parse(written).map_err(|reason| ImageError::BadReference {
            reference: image_url.to_owned(),
            reason,
        })?;
        let auth = logins.for_registry(reference.resolve_registry());
        let name = reference.whole();
        let secs = self.config.timeout.as_secs();
        tokio::time::timeout(self.config.timeout, self.resolve_parsed(reference, auth))
            .await
            .unwrap_or(Err(ImageError::Timeout {
                reference: name,
                secs,
            }))
    }

    async fn resolve_parsed(
        self: &Arc<Self>,
        reference: Reference,
        auth: RegistryAuth,
    ) -> Result<ResolvedImage, ImageError> {
        let name = reference.whole();
        let client = self.client(reference.resolve_registry(), &auth);
        let (manifest, manifest_digest) = client
            .pull_image_manifest(&reference, &auth)
            .await
            .map_err(|e| classify(&name, e))?;
        let layer = wasm_layer(&manifest)
            .map_err(|reason| ImageError::NotWasm {
                reference: name.clone(),
                reason,
            })?
            .clone();
        let size = u64::try_from(layer.size).unwrap_or(0);
        if size > self.config.max_bytes {
            return Err(ImageError::TooLarge {
                reference: name,
                size,
                limit: self.config.max_bytes,
            });
        }
        self.ensure_layer(&client, &reference, &layer).await?;
        let cache = self.cache.clone();
        let digest = layer.digest.clone();
        // Only the magic bytes: the digest was checked when the layer was pulled.
        let head = tokio::task::spawn_blocking(move || cache.head(&digest, 4))
            .await
            .map_err(|e| ImageError::Cache(e.to_string()))??;
        match head {
            // Ciphertext: whether it holds Wasm only the device that decrypts it can tell.
            Some(_) if is_encrypted_layer(&layer) => {}
            Some(head) if is_wasm(&head) => {}
            Some(head) => {
                return Err(ImageError::NotWasm {
                    reference: name,
                    reason: not_wasm_reason(&head),
                })
            }
            None => {
                return Err(ImageError::Cache(format!(
                    "layer {} vanished from the cache",
                    layer.digest
                )))
            }
        }
        let pinned = Reference::with_digest(
            reference.registry().to_owned(),
            reference.repository().to_owned(),
            manifest_digest.clone(),
        )
        .whole();
        let cache = self.cache.clone();
        let (key, layer_digest) = (pinned.clone(), layer.digest.clone());
        let framing = framing_of(&layer);
        tokio::task::spawn_blocking(move || {
            cache.remember(&key, &layer_digest, framing.as_deref())
        })
        .await
        .map_err(|e| ImageError::Cache(e.to_string()))??;
        lock(&self.origins).insert(pinned.clone(), (reference, layer.clone(), auth));
        Ok(ResolvedImage {
            pinned,
            manifest_digest,
            layer_digest: layer.digest,
            size,
        })
    }

    /// Pulls `layer` into the cache unless it is there; concurrent callers share one pull.
    async fn ensure_layer(
        self: &Arc<Self>,
        client: &Client,
        reference: &Reference,
        layer: &OciDescriptor,
    ) -> PullResult {
        if self.cache.contains(&layer.digest) {
            return Ok(());
        }
        let pull = {
            let mut pulls = lock(&self.pulls);
            pulls
                .entry(layer.digest.clone())
                .or_insert_with(|| {
                    let this = self.clone();
                    let (client, reference, layer) =
                        (client.clone(), reference.clone(), layer.clone());
                    async move {
                        let result = this.pull_layer(&client, &reference, &layer).await;
                        lock(&this.pulls).remove(&layer.digest);
                        result
                    }
                    .boxed()
                    .shared()
                })
                .clone()
        };
        pull.await
    }

    async fn pull_layer(
        &self,
        client: &Client,
        reference: &Reference,
        layer: &OciDescriptor,
    ) -> PullResult {
        let name = reference.whole();
        let scratch = self.cache.scratch()?;
        let file = tokio::fs::File::from_std(
            scratch
                .reopen()
                .map_err(|e| ImageError::Cache(e.to_string()))?,
        );
        let limit = self.config.max_bytes;
        let writer = Capped {
            inner: file,
            written: 0,
            limit,
        };
        tracing::info!(image = %name, digest = %layer.digest, size = layer.size, "pulling Wasm layer");
        if let Err(e) = client.pull_blob(reference, layer, writer).await {
            if let OciDistributionError::IoError(io) = &e {
                if io.kind() == std::io::ErrorKind::FileTooLarge {
                    return Err(ImageError::TooLarge {
                        reference: name,
                        size: limit.saturating_add(1),
                        limit,
                    });
                }
            }
            return Err(classify(&name, e));
        }
        let cache = self.cache.clone();
        let digest = layer.digest.clone();
        tokio::task::spawn_blocking(move || cache.commit(scratch, &digest))
            .await
            .map_err(|e| ImageError::Cache(e.to_string()))??;
        self.metrics.registry_pulls.inc();
        self.metrics
            .registry_bytes
            .inc_by(u64::try_from(layer.size).unwrap_or(0));
        Ok(())
    }

    /// The binary devices asking for `name` get, pulling it again if it was evicted. `None`
    /// if this process never resolved `name` (devices cannot make it pull arbitrary images).
    pub async fn binary(self: &Arc<Self>, name: &str) -> Result<Option<Vec<u8>>, ImageError> {
        let cache = self.cache.clone();
        let key = name.to_owned();
        let cached = tokio::task::spawn_blocking(move || -> Result<_, CacheError> {
            let Some((digest, framing)) = cache.lookup(&key) else {
                return Ok(None);
            };
            Ok(Some((cache.get(&digest)?, digest, framing)))
        })
        .await
        .map_err(|e| ImageError::Cache(e.to_string()))??;
        let Some((bytes, digest, framing)) = cached else {
            return Ok(None);
        };
        let framed = |layer: Vec<u8>| match framing.as_deref().map(serde_json::from_str) {
            Some(Ok(descriptor)) => Ok(frame_ocicrypt_layer(&descriptor, &layer)),
            Some(Err(e)) => Err(ImageError::Cache(format!(
                "the recorded descriptor of {name}'s encrypted layer is damaged: {e}"
            ))),
            None => Ok(layer),
        };
        if let Some(bytes) = bytes {
            return framed(bytes).map(Some);
        }
        let origin = lock(&self.origins).get(name).cloned();
        let (reference, layer, auth) = match origin {
            Some(origin) => origin,
            None => {
                // Resolved by an earlier process: pull anonymously by digest.
                let reference = parse(name).map_err(|reason| ImageError::BadReference {
                    reference: name.to_owned(),
                    reason,
                })?;
                let layer = OciDescriptor {
                    digest: digest.clone(),
                    ..OciDescriptor::default()
                };
                (reference, layer, RegistryAuth::Anonymous)
            }
        };
        let client = self.client(reference.resolve_registry(), &auth);
        client
            .store_auth_if_needed(reference.resolve_registry(), &auth)
            .await;
        self.ensure_layer(&client, &reference, &layer).await?;
        let cache = self.cache.clone();
        let bytes = tokio::task::spawn_blocking(move || cache.get(&digest))
            .await
            .map_err(|e| ImageError::Cache(e.to_string()))??;
        bytes.map(framed).transpose()
    }
}

/// The descriptor devices need to decrypt `layer` (one JSON line), if ocicrypt encrypted it.
fn framing_of(layer: &OciDescriptor) -> Option<String> {
    is_encrypted_layer(layer).then(|| {
        let descriptor = LayerDescriptor {
            media_type: layer.media_type.clone(),
            annotations: layer
                .annotations
                .iter()
                .flatten()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        };
        serde_json::to_string(&descriptor).unwrap_or_default()
    })
}

/// Maps oci-client's errors onto what a user can act on.
fn classify(reference: &str, error: OciDistributionError) -> ImageError {
    let reference = reference.to_owned();
    match error {
        OciDistributionError::AuthenticationFailure(reason) => {
            ImageError::AuthRefused { reference, reason }
        }
        OciDistributionError::UnauthorizedError { url } => ImageError::AuthRefused {
            reference,
            reason: format!("401 from {url}"),
        },
        OciDistributionError::ImageManifestNotFoundError(_) => ImageError::NotFound { reference },
        OciDistributionError::RegistryError { envelope, url } => {
            let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
            let any = |wanted: &[OciErrorCode]| codes.iter().any(|c| wanted.contains(c));
            if any(&[
                OciErrorCode::ManifestUnknown,
                OciErrorCode::NameUnknown,
                OciErrorCode::NotFound,
                OciErrorCode::BlobUnknown,
            ]) {
                ImageError::NotFound { reference }
            } else if any(&[OciErrorCode::Unauthorized, OciErrorCode::Denied]) {
                ImageError::AuthRefused {
                    reference,
                    reason: envelope.to_string(),
                }
            } else {
                ImageError::Registry {
                    reference,
                    reason: format!("{url}: {envelope}"),
                }
            }
        }
        OciDistributionError::ServerError { code, url, message } => match code {
            401 | 403 => ImageError::AuthRefused {
                reference,
                reason: format!("{code} from {url}"),
            },
            404 => ImageError::NotFound { reference },
            _ => ImageError::Registry {
                reference,
                reason: format!("{url}: HTTP {code} {message}"),
            },
        },
        OciDistributionError::ImageIndexParsingNoPlatformResolverError
        | OciDistributionError::IncompatibleLayerMediaTypeError(_)
        | OciDistributionError::UnsupportedMediaTypeError(_) => ImageError::NotWasm {
            reference,
            reason: error.to_string(),
        },
        OciDistributionError::RequestError(e) => {
            let reason = crate::errors::error_chain(&e);
            // rustls reads an HTTP answer to its ClientHello as a record of a type TLS
            // does not have.
            if reason.contains("InvalidContentType") {
                let registry = super::reference::parse(&reference)
                    .map(|r| r.registry().to_owned())
                    .unwrap_or_default();
                return ImageError::PlainHttp {
                    reference,
                    registry,
                };
            }
            ImageError::Registry { reference, reason }
        }
        other => ImageError::Registry {
            reference,
            reason: other.to_string(),
        },
    }
}

/// A writer that refuses to grow past `limit` bytes (a registry may send more than the
/// manifest declared).
struct Capped<W> {
    inner: W,
    written: u64,
    limit: u64,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for Capped<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if self.written.saturating_add(buf.len() as u64) > self.limit {
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::FileTooLarge,
                "layer exceeds the image size limit",
            )));
        }
        let this = &mut *self;
        let poll = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &poll {
            this.written += *n as u64;
        }
        poll
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
