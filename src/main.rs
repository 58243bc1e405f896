//! The `runwarden` binary: parse, set up logging, run. Everything else is in the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    use tracing_subscriber::EnvFilter;
    // A filter that does not parse is said, not silently replaced: someone asked for debug
    // logs and would otherwise wonder where they are.
    let filter = match std::env::var_os("RUNWARDEN_LOG") {
        Some(text) if !text.to_string_lossy().trim().is_empty() => text
            .to_str()
            .ok_or_else(|| "not UTF-8".to_string())
            .and_then(|t| EnvFilter::try_new(t.trim()).map_err(|e| e.to_string()))
            .unwrap_or_else(|why| {
                runwarden::cli::to_stderr(format_args!(
                    "runwarden: RUNWARDEN_LOG={text:?} is not a log filter ({why}); logging at info\n"
                ));
                EnvFilter::new("info")
            }),
        _ => EnvFilter::new("info"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // A log line that cannot be written (stderr a file on a full disk, a pipe whose reader
        // went away) is lost, nothing more. Reporting it would print to that same stderr, and
        // the panic that follows would take down whichever thread was logging — the store's
        // writer, the actor thread — while the process lived on, half a supervisor.
        .log_internal_errors(false)
        // Colour only for a person at a terminal; log files and pipes get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    runwarden::cli::run(runwarden::cli::Cli::parse())
}
