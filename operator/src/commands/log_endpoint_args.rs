//! `propeller run`'s task log endpoint: its flags, and starting it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Args;
use propeller_broker::server::{tls_acceptor, TlsSettings};
use propeller_operator::k8s::log_access::{self, LogAccess};
use propeller_operator::k8s::user_access::UserAccess;
use propeller_operator::task_logs::LogStore;

use super::serving_tls::serving_files;

/// Where and how the task log endpoint listens.
#[derive(Args, Debug, Clone)]
pub struct LogEndpointArgs {
    /// Serve task logs over HTTPS at this address (`propeller logs --endpoint`); callers
    /// need a token the API server accepts and `get` on `tasks/log`. Off when unset.
    #[arg(long, env = "PROPELLER_LOGS_LISTEN")]
    pub logs_listen: Option<SocketAddr>,
    /// The endpoint's certificate chain (PEM); with --logs-tls-key. When unset, one is made
    /// in --logs-tls-dir.
    #[arg(long, env = "PROPELLER_LOGS_TLS_CERT", requires = "logs_tls_key")]
    pub logs_tls_cert: Option<PathBuf>,
    /// The private key of --logs-tls-cert (PEM).
    #[arg(long, env = "PROPELLER_LOGS_TLS_KEY", requires = "logs_tls_cert")]
    pub logs_tls_key: Option<PathBuf>,
    /// Where a certificate is made when none is given, with the CA clients trust (`ca.pem`);
    /// a directory `propeller-logs-tls` in the system's temporary directory when unset.
    #[arg(long, env = "PROPELLER_LOGS_TLS_DIR")]
    pub logs_tls_dir: Option<PathBuf>,
    /// A DNS name or address the made certificate is for (repeat it; `localhost` and
    /// `127.0.0.1` always are).
    #[arg(
        long = "logs-tls-name",
        env = "PROPELLER_LOGS_TLS_NAMES",
        value_delimiter = ','
    )]
    pub logs_tls_names: Vec<String>,
}

impl LogEndpointArgs {
    /// Starts the endpoint when asked; the address it listens on.
    pub async fn start(
        &self,
        client: kube::Client,
        logs: Arc<LogStore>,
    ) -> anyhow::Result<Option<SocketAddr>> {
        let Some(listen) = self.logs_listen else {
            return Ok(None);
        };
        let (listener, acceptor) = https_listener(
            listen,
            ServingFiles {
                cert: self.logs_tls_cert.clone(),
                key: self.logs_tls_key.clone(),
                dir: self.logs_tls_dir.clone(),
                names: &self.logs_tls_names,
                default_dir: "propeller-logs-tls",
            },
            "the log endpoint",
        )
        .await?;
        let bound = listener.local_addr()?;
        let access = UserAccess::new(client, None);
        tokio::spawn(log_access::serve(
            listener,
            acceptor,
            LogAccess { access, logs },
        ));
        Ok(Some(bound))
    }
}

/// An HTTPS endpoint's certificate: given, or made in a directory for some names.
pub struct ServingFiles<'a> {
    /// The certificate chain given (PEM).
    pub cert: Option<PathBuf>,
    /// Its private key (PEM).
    pub key: Option<PathBuf>,
    /// Where one is made otherwise.
    pub dir: Option<PathBuf>,
    /// Names a made certificate is for besides `localhost` and `127.0.0.1`.
    pub names: &'a [String],
    /// The directory in the system's temporary directory used when `dir` is unset.
    pub default_dir: &'static str,
}

/// Binds `listen` and makes the TLS acceptor of an HTTPS endpoint (`what`, for messages).
pub async fn https_listener(
    listen: SocketAddr,
    files: ServingFiles<'_>,
    what: &str,
) -> anyhow::Result<(tokio::net::TcpListener, tokio_rustls::TlsAcceptor)> {
    let (cert_path, key_path) = match (files.cert, files.key) {
        (Some(cert), Some(key)) => (cert, key),
        _ => {
            let dir = files
                .dir
                .unwrap_or_else(|| std::env::temp_dir().join(files.default_dir));
            let mut names = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
            names.extend(files.names.iter().cloned());
            let made = serving_files(&dir, &names)
                .with_context(|| format!("making {what}'s certificate in {}", dir.display()))?;
            (made.cert, made.key)
        }
    };
    let acceptor = tls_acceptor(&TlsSettings {
        listen,
        cert_path,
        key_path,
        client_ca_path: None,
    })
    .with_context(|| format!("{what}'s TLS"))?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {what} {listen}"))?;
    Ok((listener, acceptor))
}
