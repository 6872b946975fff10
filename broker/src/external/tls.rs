//! TLS of propeller's client connection to an external broker (`mqtts://`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::protocol::BrokerAddress;
use crate::server::BrokerError;

/// Where the system's CA bundle is on Debian and most distributions.
const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// CA bundle and client certificate for `mqtts://` addresses (PEM files).
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    /// CA certificates that sign the broker's certificate; the system's bundle when unset.
    pub ca: Option<PathBuf>,
    /// Client certificate chain, for brokers that authenticate clients by certificate.
    pub cert: Option<PathBuf>,
    /// The client certificate's private key.
    pub key: Option<PathBuf>,
}

impl ClientTls {
    /// The rustls configuration, or `None` when no address uses TLS.
    pub(crate) fn rustls_config(
        &self,
        addresses: &[BrokerAddress],
    ) -> Result<Option<Arc<rustls::ClientConfig>>, BrokerError> {
        if !addresses.iter().any(|a| a.tls) {
            return Ok(None);
        }
        let tls_error = |message: String| BrokerError::Tls { message };
        let ca = self
            .ca
            .clone()
            .unwrap_or_else(|| PathBuf::from(SYSTEM_ROOTS));
        let mut roots = rustls::RootCertStore::empty();
        for cert in read_certs(&ca)? {
            roots
                .add(cert)
                .map_err(|e| tls_error(format!("CA file {}: {e}", ca.display())))?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| tls_error(e.to_string()))?
            .with_root_certificates(roots);
        let config = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                let chain = read_certs(cert)?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| tls_error(format!("client key {}: {e}", key.display())))?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| tls_error(format!("client certificate: {e}")))?
            }
            (None, None) => builder.with_no_client_auth(),
            _ => {
                return Err(tls_error(
                    "a client certificate needs both the certificate and its key".into(),
                ))
            }
        };
        Ok(Some(Arc::new(config)))
    }
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, BrokerError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .and_then(|iter| iter.collect::<Result<Vec<_>, _>>())
        .map_err(|e| BrokerError::Tls {
            message: format!("certificates in {}: {e}", path.display()),
        })?;
    if certs.is_empty() {
        return Err(BrokerError::Tls {
            message: format!("no certificate in {}", path.display()),
        });
    }
    Ok(certs)
}
