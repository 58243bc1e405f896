//! The `runwarden` command line: argument parsing and one function per command. Thin: every
//! command calls the library (or, for commands on a running supervisor, the control client).

mod serve;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;

/// Exit code for refused operations and runtime failures.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for usage and configuration mistakes.
pub const EXIT_USAGE: u8 = 2;

/// runwarden: supervise agent workers for a task board.
#[derive(Debug, Parser)]
#[command(name = "runwarden", version, about)]
pub struct Cli {
    /// Config file (default: $RUNWARDEN_CONFIG, else ./config.toml).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Control socket (default: from the config).
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Machine-readable JSON output.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the supervisor in the foreground until SIGTERM/SIGINT.
    Serve,
}

/// A CLI failure: a one-line message and the exit code.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub code: u8,
}

impl CliError {
    /// A refused operation or runtime failure (exit 1).
    pub fn failure(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            code: EXIT_FAILURE,
        }
    }

    /// A usage or configuration mistake (exit 2).
    pub fn usage(message: impl Into<String>) -> Self {
        CliError {
            message: message.into(),
            code: EXIT_USAGE,
        }
    }
}

/// Loads the config the global flags name.
pub fn load_config(cli: &Cli) -> Result<Config, CliError> {
    let path = Config::resolve_path(cli.config.as_deref());
    let mut config = Config::load(&path).map_err(|e| CliError::usage(e.to_string()))?;
    if let Some(socket) = &cli.socket {
        config.supervisor.socket =
            Some(std::path::absolute(socket).unwrap_or_else(|_| socket.clone()));
    }
    Ok(config)
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> ExitCode {
    let result = match &cli.command {
        Command::Serve => serve::serve(&cli),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("runwarden: {}", e.message);
            ExitCode::from(e.code)
        }
    }
}
