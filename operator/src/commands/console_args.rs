//! `propeller run`'s web console: its flags, and starting it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use propeller_operator::k8s::console_api::{self, ConsoleAccess};
use propeller_operator::k8s::user_access::UserAccess;
use propeller_operator::task_logs::LogStore;

use super::log_endpoint_args::{https_listener, ServingFiles};

/// Where and how the web console listens.
#[derive(Args, Debug, Clone)]
pub struct ConsoleArgs {
    /// Serve the web console over HTTPS at this address (path /console/). Users sign in with
    /// a token the API server accepts and see and change what RBAC allows them. Off when
    /// unset.
    #[arg(long, env = "PROPELLER_CONSOLE_LISTEN")]
    pub console_listen: Option<SocketAddr>,
    /// The console's certificate chain (PEM); with --console-tls-key. When unset, one is made
    /// in --console-tls-dir.
    #[arg(long, env = "PROPELLER_CONSOLE_TLS_CERT", requires = "console_tls_key")]
    pub console_tls_cert: Option<PathBuf>,
    /// The private key of --console-tls-cert (PEM).
    #[arg(long, env = "PROPELLER_CONSOLE_TLS_KEY", requires = "console_tls_cert")]
    pub console_tls_key: Option<PathBuf>,
    /// Where a certificate is made when none is given, with the CA browsers must trust
    /// (`ca.pem`); a directory `propeller-console-tls` in the system's temporary directory
    /// when unset.
    #[arg(long, env = "PROPELLER_CONSOLE_TLS_DIR")]
    pub console_tls_dir: Option<PathBuf>,
    /// A DNS name or address the made certificate is for (repeat it; `localhost` and
    /// `127.0.0.1` always are).
    #[arg(
        long = "console-tls-name",
        env = "PROPELLER_CONSOLE_TLS_NAMES",
        value_delimiter = ','
    )]
    pub console_tls_names: Vec<String>,
}

impl ConsoleArgs {
    /// Starts the console when asked; the address it listens on. `config` is how propeller
    /// reaches the API server: the users' clients keep its address and CA, with their tokens.
    pub async fn start(
        &self,
        client: kube::Client,
        config: kube::Config,
        logs: Arc<LogStore>,
    ) -> anyhow::Result<Option<SocketAddr>> {
        let Some(listen) = self.console_listen else {
            return Ok(None);
        };
        let (listener, acceptor) = https_listener(
            listen,
            ServingFiles {
                cert: self.console_tls_cert.clone(),
                key: self.console_tls_key.clone(),
                dir: self.console_tls_dir.clone(),
                names: &self.console_tls_names,
                default_dir: "propeller-console-tls",
            },
            "the console",
        )
        .await?;
        let bound = listener.local_addr()?;
        let access = UserAccess::new(client, Some(config));
        tokio::spawn(console_api::serve(
            listener,
            acceptor,
            ConsoleAccess { access, logs },
        ));
        Ok(Some(bound))
    }
}
