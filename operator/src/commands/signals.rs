//! Stop signals of the long-running subcommands.

/// Resolves on Ctrl-C (SIGINT) or SIGTERM, so `kill`, systemd and Kubernetes stop the
/// process as gracefully as a terminal does.
pub async fn terminated() {
    let terminate = async {
        #[cfg(unix)]
        if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        {
            s.recv().await;
            return;
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}
