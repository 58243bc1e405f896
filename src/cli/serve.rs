//! `runwarden serve`: the supervisor in the foreground.

use super::{Cli, CliError, load_config};
use crate::supervisor;

/// Runs the supervisor until SIGTERM or SIGINT, then stops gracefully (exit 0).
pub fn serve(cli: &Cli) -> Result<(), CliError> {
    // Descriptors this process inherited open (a terminal, a build tool's jobserver pipe) are
    // not the workers': close-on-exec from now on, so no start path hands them on. Best
    // effort: a kernel before 5.11 lacks the flag.
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets a flag on our descriptors.
    let marked = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            libc::CLOSE_RANGE_CLOEXEC as libc::c_uint,
        )
    };
    if marked != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot mark inherited descriptors close-on-exec");
    }
    // An ignored SIGCHLD survives exec: a launcher that had it (some shells' `nohup` wrappers,
    // a program that set it for its own children) would have every worker's exit status lost.
    if crate::process::sigchld::children_reaped_by_kernel().unwrap_or(false) {
        match crate::process::sigchld::restore_default_sigchld() {
            Ok(()) => {
                tracing::info!("SIGCHLD was ignored (inherited); given its default action back")
            }
            Err(e) => {
                tracing::warn!(error = %e, "SIGCHLD is ignored and cannot be given its default action back")
            }
        }
    }
    // Room for a pidfd per worker and a descriptor per connection; workers keep the limit
    // this process was started with (see process::nofile).
    match crate::process::nofile::raise() {
        Ok(Some(r)) => tracing::info!(
            from = r.from,
            to = r.to,
            "raised the descriptor limit (workers keep the one it was)"
        ),
        Ok(None) => {}
        Err(e) => tracing::warn!(error = %e, "cannot raise the descriptor limit"),
    }
    let config = load_config(cli)?;
    // Said at start, not found out as EMFILE under load (spawns requeued, accepts retried).
    let needed = crate::process::nofile::needed(
        config.supervisor.max_in_progress,
        config.control.max_connections,
    );
    if let Some(soft) = crate::process::nofile::soft_limit()
        && soft < needed
    {
        tracing::warn!(
            limit = soft,
            needed,
            "the descriptor limit is below what max_in_progress and [control] max_connections may need at once; raise the hard limit (LimitNOFILE=) or lower them"
        );
    }
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
    supervisor::run(config, |_| {}, shutdown).map_err(|e| match e {
        // A mistake in the config found only at start (a working directory not there) is
        // one as much as a bad key is.
        supervisor::SupervisorError::Config(_) => CliError::usage(e.to_string()),
        _ => CliError::failure(e.to_string()),
    })
}
