//! `runwarden serve`: the supervisor in the foreground.

use super::{Cli, CliError, load_config};
use crate::supervisor;

/// Runs the supervisor until SIGTERM or SIGINT, then stops gracefully (exit 0).
pub fn serve(cli: &Cli) -> Result<(), CliError> {
    let config = load_config(cli)?;
    let shutdown = async {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers; stop with SIGKILL");
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
    };
    supervisor::run(config, |_| {}, shutdown).map_err(|e| CliError::failure(e.to_string()))
}
