//! The `runwarden` command line: argument parsing and one function per command. Thin: `serve`
//! calls the library; every other command talks to the running supervisor through the control
//! [`Client`].
//!
//! Layout: this file holds the arguments, the dispatch and the connection helpers; `serve` runs
//! the supervisor; `tasks` the task commands (add, ls, show, runs, unblock, archive, reclaim,
//! link, comment); `worker` the commands a worker runs on its own run (complete, block,
//! heartbeat); `watch` the commands that follow things (events, logs, wait); `admin` status,
//! reap, shutdown and completions; `output` tables, times, colour and JSON.

/// `eprintln!` that never panics: see [`to_stderr`].
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cli::to_stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprint!` that never panics: see [`to_stderr`].
macro_rules! say_raw {
    ($($arg:tt)*) => {
        $crate::cli::to_stderr(format_args!($($arg)*))
    };
}

mod admin;
mod output;
mod serve;
mod tasks;
mod watch;
mod worker;

use std::path::PathBuf;
use std::process::ExitCode;

use std::time::Duration;

use clap::{Parser, Subcommand};

use crate::board::TaskId;
use crate::config::Config;
use crate::control::client::{Client, ClientError};

/// Exit code for refused operations and runtime failures.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code for usage and configuration mistakes.
pub const EXIT_USAGE: u8 = 2;
/// Exit code of `wait` when its timeout passes first.
pub const EXIT_TIMEOUT: u8 = 124;
/// Exit code of `wait` and `events --follow` when no supervisor is running as they start, or
/// it went away and could not be reached again within `RUNWARDEN_CONNECT_WAIT`; of `wait`
/// also when the supervisor could not be asked (refused, `unauthorized`).
pub const EXIT_LOST: u8 = 3;

/// Writes to stderr. A stderr that cannot be written (a full disk under the log file it was
/// sent to, a reader that went away) loses the text, never the command's outcome: `eprintln!`
/// would panic there, and a command that did its work would exit 101.
pub fn to_stderr(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let _ = std::io::stderr().lock().write_fmt(args);
}

/// The environment variable a worker finds its supervisor's socket in.
pub const SOCKET_ENV: &str = "RUNWARDEN_SOCKET";

/// How long an operator's command waits for each answer of the supervisor before it gives up
/// (exit 124): a stopped or wedged supervisor must not hang a script. `RUNWARDEN_TIMEOUT` (a
/// humantime duration; `0s` waits for ever) overrides. Following commands (`events --follow`,
/// `wait`) wait for events as long as they are asked to.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// The environment variable that overrides [`REPLY_TIMEOUT`].
pub const TIMEOUT_ENV: &str = "RUNWARDEN_TIMEOUT";

/// runwarden: supervise agent workers for a task board.
#[derive(Debug, Parser)]
#[command(
    name = "runwarden",
    version,
    about,
    after_help = "The control socket is --socket, else the config's (--config), else $RUNWARDEN_SOCKET \
                  (set inside workers), else the one of $RUNWARDEN_CONFIG or ./config.toml."
)]
pub struct Cli {
    /// Config file (default: $RUNWARDEN_CONFIG, else ./config.toml).
    #[arg(long, global = true, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Control socket (default: --config's, else $RUNWARDEN_SOCKET, as inside a worker, else
    /// the one of $RUNWARDEN_CONFIG or ./config.toml).
    #[arg(long, global = true, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Machine-readable JSON output (stable snake_case field names).
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the supervisor in the foreground until SIGTERM/SIGINT or `runwarden shutdown`.
    Serve,
    /// Add a task; prints its id.
    Add(tasks::AddArgs),
    /// List tasks, newest first.
    Ls(tasks::LsArgs),
    /// Show a task: its state, runs, recent events and comments.
    Show {
        /// The task.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        id: TaskId,
        /// How many recent events to show.
        #[arg(long, default_value_t = 20)]
        events: u32,
    },
    /// List a task's runs (attempts).
    Runs {
        /// The task.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        id: TaskId,
    },
    /// Print the event log, or one task's; --follow keeps printing events as they commit,
    /// riding out a supervisor restart (exit 3 if no supervisor is running, or it does not
    /// come back within RUNWARDEN_CONNECT_WAIT).
    Events(watch::EventsArgs),
    /// Print a task's log file; --follow keeps printing as it grows.
    Logs(watch::LogsArgs),
    /// Mark a task done. Inside a worker, ID defaults to the worker's own task.
    Complete(worker::CompleteArgs),
    /// Block a task: `block ID REASON`, or `block REASON` inside a worker.
    #[command(override_usage = "runwarden block [ID] REASON [--force]")]
    Block(worker::BlockArgs),
    /// Return a blocked task to ready (its failure count reset).
    Unblock {
        /// The task.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        id: TaskId,
    },
    /// Archive a task; a worker still running for it (its task running, or done and within the
    /// reaper's grace) is ended at once.
    Archive {
        /// The task.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        id: TaskId,
    },
    /// Release a running task back to ready; its worker is ended.
    Reclaim {
        /// The task.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        id: TaskId,
        /// Recorded on the run.
        #[arg(long)]
        reason: Option<String>,
    },
    /// Make CHILD wait until PARENT is done.
    Link {
        /// The task to wait for.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        parent: TaskId,
        /// The task that waits.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        child: TaskId,
    },
    /// Comment on a task.
    Comment {
        /// The task.
        #[arg(value_parser = task_id, allow_negative_numbers = true)]
        id: TaskId,
        /// The comment.
        text: String,
        /// Author shown with the comment (default: your user name).
        #[arg(long)]
        author: Option<String>,
    },
    /// Inside a worker: report that the run is alive (refreshes its heartbeat and lease).
    Heartbeat(worker::HeartbeatArgs),
    /// Show the supervisor's state: pid, uptime, live workers, tasks per status.
    Status,
    /// Wait for tasks: exit 0 once all are done (one archived after it completed counts as
    /// done, also in --json), 1 as soon as one ends blocked or archived without completing,
    /// 124 on timeout, 3 if no supervisor is running, it went away and did not come back (a
    /// restart is ridden out) or it could not be asked (permission, `unauthorized`), 2 for a
    /// task that does not exist or a usage mistake.
    Wait(watch::WaitArgs),
    /// Run the terminal-worker reaper's sweep now.
    Reap,
    /// Ask the supervisor to stop gracefully.
    Shutdown,
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// A CLI failure: a one-line message and the exit code.
#[derive(Debug)]
pub struct CliError {
    /// What went wrong; empty for a quiet exit (e.g. stdout closed).
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

    /// An exit with nothing more to say (stdout was closed by the reader).
    pub fn quiet() -> Self {
        CliError {
            message: String::new(),
            code: EXIT_FAILURE,
        }
    }
}

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Timeout => CliError {
                message: format!(
                    "no answer from the supervisor within {} (stopped or overloaded?); a \
                     request it was sent may still be carried out; {TIMEOUT_ENV} sets how \
                     long to wait",
                    reply_timeout()
                        .ok()
                        .flatten()
                        .map(|t| humantime::format_duration(t).to_string())
                        .unwrap_or_default()
                ),
                code: EXIT_TIMEOUT,
            },
            e => CliError::failure(e.to_string()),
        }
    }
}

/// Parses a task id argument: a clear message for what is not one (clap's own says "invalid
/// digit found in string", and takes `-1` for an unknown flag).
pub(crate) fn task_id(s: &str) -> Result<TaskId, String> {
    match s.trim().parse::<TaskId>() {
        Ok(id) if id >= 1 => Ok(id),
        _ => Err("task ids are whole numbers from 1".into()),
    }
}

/// [`REPLY_TIMEOUT`], or `$RUNWARDEN_TIMEOUT` (`None`: wait for ever). A value that does not
/// parse is a usage error: a typo must not silently leave the default in force.
pub fn reply_timeout() -> Result<Option<Duration>, CliError> {
    let wait =
        env_duration(TIMEOUT_ENV, "30s, 2m, or 0s to wait for ever")?.unwrap_or(REPLY_TIMEOUT);
    Ok((!wait.is_zero()).then_some(wait))
}

/// The duration in environment variable `var` (`None`: unset or blank). A value that does not
/// parse is a usage error naming the variable, with `examples` of what would.
pub(crate) fn env_duration(var: &str, examples: &str) -> Result<Option<Duration>, CliError> {
    match std::env::var_os(var) {
        Some(v) if !v.to_string_lossy().trim().is_empty() => v
            .to_str()
            .ok_or_else(|| "not UTF-8".to_string())
            .and_then(|s| humantime::parse_duration(s.trim()).map_err(|e| e.to_string()))
            .map(Some)
            .map_err(|why| {
                CliError::usage(format!(
                    "{var}={v:?} is not a duration ({why}); e.g. {examples}"
                ))
            }),
        _ => Ok(None),
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

/// The control socket to use: `--socket`, else the `--config` file's, else
/// `$RUNWARDEN_SOCKET` (a worker: it need not be able to read the config), else the socket of
/// `$RUNWARDEN_CONFIG` or `./config.toml`.
pub fn socket_path(cli: &Cli) -> Result<PathBuf, CliError> {
    if let Some(socket) = &cli.socket {
        return Ok(socket.clone());
    }
    if cli.config.is_none()
        && let Some(socket) = std::env::var_os(SOCKET_ENV).filter(|s| !s.is_empty())
    {
        return Ok(PathBuf::from(socket));
    }
    let config = load_config(cli).map_err(|e| {
        CliError::usage(format!(
            "{} (to reach a supervisor without its config, pass --socket PATH)",
            e.message
        ))
    })?;
    Ok(config.socket_path())
}

/// Connects to the supervisor and says hello; each answer is waited for at most
/// [`reply_timeout`].
pub fn connect(cli: &Cli) -> Result<Client, CliError> {
    Ok(try_connect(&socket_path(cli)?, reply_timeout()?)?)
}

/// Connects to the socket at `path` and says hello, each answer waited for at most `timeout`.
pub(crate) fn try_connect(
    path: &std::path::Path,
    timeout: Option<Duration>,
) -> Result<Client, ClientError> {
    let mut client = Client::connect(path)?;
    client.set_read_timeout(timeout)?;
    client.set_write_timeout(timeout)?;
    client.hello()?;
    Ok(client)
}

/// How long a worker's report, `wait` and `events --follow` try to reach a supervisor that
/// went away (a restart): 60 s, or `$RUNWARDEN_CONNECT_WAIT`. A value that does not parse is a
/// usage error, as for `RUNWARDEN_TIMEOUT`: a typo must not silently leave the default.
pub(crate) fn connect_wait() -> Result<Duration, CliError> {
    Ok(env_duration("RUNWARDEN_CONNECT_WAIT", "60s, 5m")?.unwrap_or(CONNECT_WAIT))
}

/// [`connect_wait`]'s default.
const CONNECT_WAIT: Duration = Duration::from_secs(60);

/// Failures a restart or a busy moment of the supervisor explains, after which nothing of a
/// request was applied (a request the server read is answered before it closes): worth
/// connecting again.
pub(crate) fn is_passing(e: &ClientError) -> bool {
    match e {
        ClientError::NotRunning { .. } | ClientError::Closed => true,
        ClientError::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        ClientError::Server { code, .. } => {
            code == crate::control::protocol::code::UNAVAILABLE
                || code == crate::control::protocol::code::TOO_MANY_CONNECTIONS
        }
        _ => false,
    }
}

/// Runs the parsed command line.
pub fn run(cli: Cli) -> ExitCode {
    let out = output::Out::new(cli.json);
    let result = match &cli.command {
        Command::Serve => serve::serve(&cli),
        Command::Add(args) => tasks::add(&cli, out, args),
        Command::Ls(args) => tasks::ls(&cli, out, args),
        Command::Show { id, events } => tasks::show(&cli, out, *id, *events),
        Command::Runs { id } => tasks::runs(&cli, out, *id),
        Command::Events(args) => watch::events(&cli, out, args),
        Command::Logs(args) => watch::logs(&cli, out, args),
        Command::Complete(args) => worker::complete(&cli, out, args),
        Command::Block(args) => worker::block(&cli, out, args),
        Command::Unblock { id } => tasks::unblock(&cli, out, *id),
        Command::Archive { id } => tasks::archive(&cli, out, *id),
        Command::Reclaim { id, reason } => tasks::reclaim(&cli, out, *id, reason.clone()),
        Command::Link { parent, child } => tasks::link(&cli, out, *parent, *child),
        Command::Comment { id, text, author } => {
            tasks::comment(&cli, out, *id, text, author.clone())
        }
        Command::Heartbeat(args) => worker::heartbeat(&cli, out, args),
        Command::Status => admin::status(&cli, out),
        Command::Wait(args) => watch::wait(&cli, out, args),
        Command::Reap => admin::reap(&cli, out),
        Command::Shutdown => admin::shutdown(&cli, out),
        Command::Completions { shell } => admin::completions(*shell),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if !e.message.is_empty() {
                say!("runwarden: {}", e.message);
            }
            ExitCode::from(e.code)
        }
    }
}
