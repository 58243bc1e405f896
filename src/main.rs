//! The `runwarden` binary: parse, set up logging, run. Everything else is in the library.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    use tracing_subscriber::EnvFilter;
    // A filter that does not parse is said, not silently replaced: someone asked for debug
    // logs and would otherwise wonder where they are.
    let filter = match std::env::var("RUNWARDEN_LOG") {
        Ok(text) if !text.trim().is_empty() => {
            EnvFilter::try_new(text.trim()).unwrap_or_else(|e| {
                eprintln!(
                    "runwarden: RUNWARDEN_LOG={text:?} is not a log filter ({e}); logging at info"
                );
                EnvFilter::new("info")
            })
        }
        Err(std::env::VarError::NotUnicode(text)) => {
            eprintln!("runwarden: RUNWARDEN_LOG={text:?} is not a log filter; logging at info");
            EnvFilter::new("info")
        }
        _ => EnvFilter::new("info"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a person at a terminal; log files and pipes get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    runwarden::cli::run(runwarden::cli::Cli::parse())
}
