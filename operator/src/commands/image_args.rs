//! Registry and image-serving flags of `propeller run` and `propeller standalone`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytesize::ByteSize;
use clap::Args;
use propeller_broker::protocol::parse_setting_duration;
use propeller_broker::server::Publisher;
use propeller_operator::oci::{Images, ImagesConfig, PullSecrets, PullerConfig, RegistryLogins};

/// How Tasks' OCI `imageUrl`s are pulled, cached and served to devices.
#[derive(Args, Debug, Clone)]
pub struct ImageArgs {
    /// Directory of the pulled-image cache (default: `images/` in the data directory for
    /// standalone mode, the system temporary directory for `run`).
    #[arg(long, env = "PROPELLER_IMAGE_CACHE_DIR")]
    pub image_cache_dir: Option<PathBuf>,
    /// Size cap of the image cache; least recently used images are evicted first.
    #[arg(long, env = "PROPELLER_IMAGE_CACHE_SIZE", default_value = "1GiB")]
    pub image_cache_size: ByteSize,
    /// Largest Wasm image accepted; a bigger one fails its task.
    #[arg(long, env = "PROPELLER_IMAGE_MAX_SIZE", default_value = "100MiB")]
    pub image_max_size: ByteSize,
    /// Time limit of resolving and pulling one image.
    #[arg(long, env = "PROPELLER_IMAGE_PULL_TIMEOUT", default_value = "60s", value_parser = parse_setting_duration)]
    pub image_pull_timeout: Duration,
    /// Pace of chunk publishing to devices, per second (0 = unpaced).
    #[arg(long, env = "PROPELLER_IMAGE_CHUNK_RATE", default_value = "16MiB")]
    pub image_chunk_rate: ByteSize,
    /// Docker config JSON (`~/.docker/config.json` format, or a mounted
    /// `kubernetes.io/dockerconfigjson` Secret's `.dockerconfigjson`) with the operator's
    /// registry logins; Tasks' `imagePullSecrets` take precedence.
    #[arg(long, env = "PROPELLER_REGISTRY_AUTH_FILE")]
    pub registry_auth_file: Option<PathBuf>,
    /// PEM file of extra CA certificates trusted for registries (a private CA). TLS
    /// verification stays on.
    #[arg(long, env = "PROPELLER_REGISTRY_CA_FILE")]
    pub registry_ca_file: Option<PathBuf>,
    /// Registries (`host:port`, comma-separated) spoken to over plain HTTP, such as a local
    /// development registry.
    #[arg(long, env = "PROPELLER_REGISTRY_PLAIN_HTTP", value_delimiter = ',')]
    pub registry_plain_http: Vec<String>,
}

impl ImageArgs {
    /// The image service, its cache in `--image-cache-dir` or `default_dir`.
    pub fn images(
        &self,
        default_dir: &Path,
        publisher: Publisher,
        secrets: Arc<dyn PullSecrets>,
    ) -> anyhow::Result<Arc<Images>> {
        let logins = match &self.registry_auth_file {
            Some(path) => {
                let json = std::fs::read(path)
                    .with_context(|| format!("reading the registry logins {}", path.display()))?;
                RegistryLogins::parse(&json)
                    .map_err(anyhow::Error::msg)
                    .with_context(|| format!("parsing the registry logins {}", path.display()))?
            }
            None => RegistryLogins::default(),
        };
        let extra_ca_pem = match &self.registry_ca_file {
            Some(path) => Some(
                std::fs::read(path)
                    .with_context(|| format!("reading the registry CA {}", path.display()))?,
            ),
            None => None,
        };
        let cache_dir = self
            .image_cache_dir
            .clone()
            .unwrap_or_else(|| default_dir.to_owned());
        let config = ImagesConfig {
            puller: PullerConfig {
                max_bytes: self.image_max_size.as_u64(),
                timeout: self.image_pull_timeout,
                plain_http: self
                    .registry_plain_http
                    .iter()
                    .map(|h| h.trim().to_owned())
                    .filter(|h| !h.is_empty())
                    .collect(),
                extra_ca_pem,
                cache_dir: cache_dir.clone(),
                cache_bytes: self.image_cache_size.as_u64(),
            },
            logins,
            chunk_rate: self.image_chunk_rate.as_u64(),
        };
        Images::new(config, publisher, secrets)
            .with_context(|| format!("opening the image cache in {}", cache_dir.display()))
    }
}
