//! `config.toml`: runwarden's configuration.
//!
//! Every key has a default, durations are humantime strings (`"2m"`, `"500ms"`, `"0s"`), and a
//! mistake — an unknown key, a bad value, an unknown user — is refused at load time with a one-line
//! message naming the key, so a typo never silently falls back to a default.
//!
//! Relative paths are resolved against the directory that holds the config file, so the supervisor
//! and every CLI invocation agree on where the board lives whatever their working directory.
//!
//! Layout: this file holds the API and the supervisor-wide sections; `assignee` the
//! `[assignees.*]` and `[[hooks]]` tables; `serde_helpers` the value formats
//! (durations, umask, rlimits); `validate` the checks and path resolution done after parsing;
//! `diagnose` the turning of a serde/toml error into a one-line message with its line and column.

mod assignee;
mod diagnose;
mod serde_helpers;
mod validate;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use self::assignee::{AssigneeConfig, HookConfig, OnExitZero, RLIMIT_NAMES, rlimit_resource};
use self::serde_helpers::duration;

/// The environment variable that names the config file when `--config` is not given.
pub const CONFIG_ENV: &str = "RUNWARDEN_CONFIG";

/// The config file used when neither `--config` nor `$RUNWARDEN_CONFIG` names one.
pub const DEFAULT_CONFIG_FILE: &str = "config.toml";

/// Shown in errors in place of a path for a config that did not come from a file.
const INLINE: &str = "<inline>";
/// The "file" named by an error in a config built in code (see [`Config::validate`]).
const IN_CODE: &str = "<config built in code>";

/// Why a config could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read (missing, unreadable, not UTF-8).
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file that was asked for.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file was read but is not a valid config. `message` is one line and names the key,
    /// e.g. "unknown key `foo` in \[supervisor\] (line 3, column 1)".
    #[error("invalid config {path}: {message}")]
    Invalid {
        /// The file (or `<inline>` for a config given as a string).
        path: PathBuf,
        /// What is wrong, naming the key and what was expected.
        message: String,
    },
}

/// The whole configuration, with relative paths already resolved and user names looked up.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The file it was read from (absolute); `None` when built in code or from a string.
    #[serde(skip)]
    pub path: Option<PathBuf>,
    /// `[supervisor]`: where the data lives and how the supervisor paces itself.
    #[serde(default)]
    pub supervisor: SupervisorConfig,
    /// `[reaper]`: how closed runs' workers are ended.
    #[serde(default)]
    pub reaper: ReaperConfig,
    /// `[leases]`: claim lifetimes.
    #[serde(default)]
    pub leases: LeasesConfig,
    /// `[retries]`: failure budget and backoff.
    #[serde(default)]
    pub retries: RetriesConfig,
    /// `[control]`: the Unix control socket.
    #[serde(default)]
    pub control: ControlConfig,
    /// `[retention]`: how long finished tasks are kept.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// `[assignees.NAME]`: who runs tasks, and how.
    #[serde(default)]
    pub assignees: BTreeMap<String, AssigneeConfig>,
    /// `[[hooks]]`: commands run on board events.
    #[serde(default)]
    pub hooks: Vec<HookConfig>,
}

/// `[supervisor]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisorConfig {
    /// Holds board.db, logs/, work/ and the lock file. Default `.runwarden`, resolved against the
    /// config file's directory at load time (it is relative only in `SupervisorConfig::default()`).
    pub data_dir: PathBuf,
    /// The control socket; `None` means `<data_dir>/control.sock`.
    pub socket: Option<PathBuf>,
    /// Period of the time-based sweeps. Default 1s; must be > 0.
    #[serde(with = "duration")]
    pub tick: Duration,
    /// Live workers, all assignees together. Default 8; at least 1.
    pub max_in_progress: u32,
    /// What happens to live workers when the supervisor is told to stop.
    pub shutdown: ShutdownMode,
    /// SQLite `PRAGMA synchronous`.
    pub synchronous: Synchronous,
    /// Size at which a task's log file is rotated, checked at each start and tick (one backup
    /// of its last `log_max_bytes` kept). Default 10 MiB; at least 1024.
    pub log_max_bytes: u64,
    /// Become a child subreaper (default true): workers' escaped descendants re-parent to the
    /// supervisor, which ends them with their run and reaps their zombies. An embedding
    /// program that waits for children of its own may turn it off (it then loses that
    /// guarantee for descendants that leave their worker's process group). The process is
    /// put back as it was once the last supervisor that made it a subreaper has stopped.
    pub subreaper: bool,
    /// The kernel policy of the supervisor's own threads (store, actors, spawners).
    pub scheduling: Scheduling,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            data_dir: PathBuf::from(".runwarden"),
            socket: None,
            tick: Duration::from_secs(1),
            max_in_progress: 8,
            shutdown: ShutdownMode::Leave,
            synchronous: Synchronous::Full,
            log_max_bytes: 10 * 1024 * 1024,
            subreaper: true,
            scheduling: Scheduling::Batch,
        }
    }
}

/// On SIGTERM, what becomes of the workers still running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShutdownMode {
    /// Leave them running; the next incarnation adopts or reaps them by fingerprint.
    #[default]
    Leave,
    /// End them (SIGTERM, then SIGKILL after `reaper.kill_timeout`) before exiting.
    Terminate,
}

/// SQLite's `synchronous` setting for the board (WAL mode).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Synchronous {
    /// Every commit is fsynced: no committed transition is lost on power failure.
    #[default]
    Full,
    /// WAL checkpoints are fsynced, commits are not: faster, may lose the last commits on power loss.
    Normal,
}

impl Synchronous {
    /// The value for `PRAGMA synchronous = …`.
    pub fn as_pragma(&self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// How the supervisor's own threads are scheduled (see `process::sched`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheduling {
    /// `SCHED_BATCH`: a supervisor thread that wakes up does not preempt the running thread
    /// (same nice value, same share of the CPU): fewer context switches, less CPU per run. A
    /// thread a host put under another policy than the normal one keeps it. Workers and hooks
    /// start under the normal policy.
    #[default]
    Batch,
    /// The policy the threads were started with, untouched.
    Normal,
}

/// `[reaper]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReaperConfig {
    /// A closed run's worker is ended this long after the close. Default 2m.
    #[serde(with = "duration")]
    pub grace: Duration,
    /// SIGTERM → this long → SIGKILL. Default 5s.
    #[serde(with = "duration")]
    pub kill_timeout: Duration,
}

impl Default for ReaperConfig {
    fn default() -> Self {
        ReaperConfig {
            grace: Duration::from_secs(120),
            kill_timeout: Duration::from_secs(5),
        }
    }
}

/// `[leases]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LeasesConfig {
    /// How long a claim lasts without renewal. Default 15m; must be > 0.
    #[serde(with = "duration")]
    pub claim_ttl: Duration,
    /// A run with no heartbeat for this long is stale. Default 0s = off.
    #[serde(with = "duration")]
    pub stale_after: Duration,
}

impl Default for LeasesConfig {
    fn default() -> Self {
        LeasesConfig {
            claim_ttl: Duration::from_secs(15 * 60),
            stale_after: Duration::ZERO,
        }
    }
}

/// `[retries]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetriesConfig {
    /// Failed runs retried before the task gives up. Default 2.
    pub max_retries: u32,
    /// Delay before a failed task is retried; grows with each further failure. Default 5s.
    #[serde(with = "duration")]
    pub backoff: Duration,
    /// Ceiling of the backoff. Default 5m; at least `backoff`.
    #[serde(with = "duration")]
    pub backoff_max: Duration,
}

impl Default for RetriesConfig {
    fn default() -> Self {
        RetriesConfig {
            max_retries: 2,
            backoff: Duration::from_secs(5),
            backoff_max: Duration::from_secs(5 * 60),
        }
    }
}

/// `[retention]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetentionConfig {
    /// A task `done` or `archived` this long ago (its last change: finishing, archiving) is
    /// deleted from the board
    /// with its runs, events, comments and links, its log files and its default work directory,
    /// once no worker of it may be alive. Default 0s: kept for ever.
    #[serde(with = "duration")]
    pub finished: Duration,
}

/// `[control]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ControlConfig {
    /// A connection idle this long is closed. Default 30s; must be > 0.
    #[serde(with = "duration")]
    pub idle_timeout: Duration,
    /// Connections served at once. Default 256; at least 1.
    pub max_connections: u32,
    /// Longest request line accepted. Default 1 MiB; at least 1024.
    pub max_request_bytes: u64,
    /// Peers (by `SO_PEERCRED` uid) allowed besides root and the supervisor's own uid. Default none.
    pub allowed_uids: Vec<u32>,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            idle_timeout: Duration::from_secs(30),
            max_connections: 256,
            max_request_bytes: 1024 * 1024,
            allowed_uids: Vec::new(),
        }
    }
}

impl Config {
    /// Reads, parses and validates the config at `path`; relative paths in it are resolved
    /// against the file's directory.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        // Absolute first, so `config.toml` (parent "") resolves against the working directory
        // and `Config::path` means the same file from anywhere.
        let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
        let text = std::fs::read_to_string(&path).map_err(|source| ConfigError::Read {
            path: path.clone(),
            source,
        })?;
        let base_dir = path.parent().unwrap_or_else(|| Path::new("/"));
        let mut config = parse(&text, base_dir).map_err(|message| ConfigError::Invalid {
            path: path.clone(),
            message,
        })?;
        config.path = Some(path);
        Ok(config)
    }

    /// Parses and validates `text` as if it were a file in `base_dir`. Errors name `<inline>`.
    pub fn from_toml_str(text: &str, base_dir: &Path) -> Result<Config, ConfigError> {
        let base_dir = std::path::absolute(base_dir).unwrap_or_else(|_| base_dir.to_path_buf());
        parse(text, &base_dir).map_err(|message| ConfigError::Invalid {
            path: PathBuf::from(INLINE),
            message,
        })
    }

    /// A config with every default, its data dir at `data_dir` (made absolute), no assignees and
    /// no hooks: for tests and embedding.
    pub fn with_data_dir(data_dir: impl Into<PathBuf>) -> Config {
        let data_dir = data_dir.into();
        let data_dir = std::path::absolute(&data_dir).unwrap_or(data_dir);
        Config {
            path: None,
            supervisor: SupervisorConfig {
                data_dir,
                ..SupervisorConfig::default()
            },
            reaper: ReaperConfig::default(),
            leases: LeasesConfig::default(),
            retries: RetriesConfig::default(),
            control: ControlConfig::default(),
            retention: RetentionConfig::default(),
            assignees: BTreeMap::new(),
            hooks: Vec::new(),
        }
    }

    /// Checks a config built or changed in code the way [`Config::load`] checks a file: every
    /// range and relation, `user` and `group` looked up (they set `uid` and `gid`), relative
    /// paths resolved against the config file's directory, else the working directory. A
    /// supervisor runs it when it starts, so an embedded config skips no check — a `user` set in
    /// code is honoured, not silently ignored. Idempotent.
    pub fn validate(&mut self) -> Result<(), ConfigError> {
        let base_dir = match self.path.as_deref().and_then(Path::parent) {
            Some(dir) => dir.to_path_buf(),
            None => std::path::absolute(".").unwrap_or_else(|_| PathBuf::from("/")),
        };
        validate::validate_and_resolve(self, &base_dir).map_err(|p| self.invalid(p.render("")))
    }

    /// Refuses a configured working directory that does not exist (or is not a directory), naming
    /// the key. Run when a supervisor starts, not at load: other commands load the config too,
    /// as users who may not reach the directory. The supervisor never creates one (as root).
    pub fn check_working_dirs(&self) -> Result<(), ConfigError> {
        for (name, a) in &self.assignees {
            let Some(cwd) = &a.cwd else { continue };
            let problem = match std::fs::metadata(cwd) {
                Ok(m) if m.is_dir() => continue,
                Ok(_) => format!("{} is not a directory", cwd.display()),
                Err(e) => format!("cannot use {}: {e}", cwd.display()),
            };
            return Err(self.invalid(format!("[assignees.{name}] cwd: {problem}")));
        }
        Ok(())
    }

    /// Refuses a resource limit no worker of its assignee could be given, naming the key:
    /// `nofile` above the system's maximum (`fs.nr_open`), or any limit above this process's
    /// hard limit for a worker that does not run as root (the limits are set in the worker
    /// after it has become its user, and only root may raise a hard limit). Run when a
    /// supervisor starts, not at load: the limits are the starting process's. Without it, every
    /// run of the assignee would end `spawn_failed`.
    pub fn check_rlimits(&self) -> Result<(), ConfigError> {
        use nix::sys::resource::{Resource, getrlimit};
        let root = nix::unistd::geteuid().is_root();
        let nr_open = crate::process::nofile::nr_open();
        let shown = |v: u64| {
            if v == u64::MAX {
                "unlimited".to_string()
            } else {
                v.to_string()
            }
        };
        for (name, a) in &self.assignees {
            let as_root = root && a.uid.is_none_or(|uid| uid == 0);
            for (limit, &value) in &a.rlimits {
                let Some(resource) = rlimit_resource(limit) else {
                    continue;
                };
                let problem = match nr_open {
                    Some(max) if resource == Resource::RLIMIT_NOFILE && value > max => {
                        Some(format!(
                            "{} is above the system's maximum (fs.nr_open = {max})",
                            shown(value)
                        ))
                    }
                    _ if as_root => None,
                    _ => match getrlimit(resource) {
                        Ok((_, hard)) if value > hard => Some(format!(
                            "{} is above this supervisor's hard limit ({}); only a worker that \
                             runs as root may raise it",
                            shown(value),
                            shown(hard)
                        )),
                        _ => None,
                    },
                };
                if let Some(problem) = problem {
                    return Err(
                        self.invalid(format!("[assignees.{name}] rlimits.{limit}: {problem}"))
                    );
                }
            }
        }
        Ok(())
    }

    /// An `Invalid` error about this config (its file, or [`IN_CODE`]).
    pub(crate) fn invalid(&self, message: String) -> ConfigError {
        ConfigError::Invalid {
            path: self.path.clone().unwrap_or_else(|| PathBuf::from(IN_CODE)),
            message,
        }
    }

    /// The board database: `<data_dir>/board.db`.
    pub fn db_path(&self) -> PathBuf {
        self.supervisor.data_dir.join("board.db")
    }

    /// The directory of the workers' log files: `<data_dir>/logs`.
    pub fn logs_dir(&self) -> PathBuf {
        self.supervisor.data_dir.join("logs")
    }

    /// The parent of the default per-task working directories: `<data_dir>/work`.
    pub fn work_dir(&self) -> PathBuf {
        self.supervisor.data_dir.join("work")
    }

    /// The lock that keeps a second supervisor off the same data dir: `<data_dir>/supervisor.lock`.
    pub fn lock_path(&self) -> PathBuf {
        self.supervisor.data_dir.join("supervisor.lock")
    }

    /// The control socket: `supervisor.socket` if set, else `<data_dir>/control.sock`.
    pub fn socket_path(&self) -> PathBuf {
        match &self.supervisor.socket {
            Some(socket) => socket.clone(),
            None => self.supervisor.data_dir.join("control.sock"),
        }
    }

    /// Refuses a task for an assignee this config does not have (a typo would otherwise leave
    /// the task `ready` for ever, with nothing to run it); a task with no assignee is fine.
    pub fn check_assignee(&self, name: Option<&str>) -> Result<(), String> {
        match name {
            Some(name) if !self.assignees.contains_key(name) => {
                let known: Vec<&str> = self.assignees.keys().map(String::as_str).collect();
                Err(format!(
                    "no assignee `{name}` is configured (configured: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ))
            }
            _ => Ok(()),
        }
    }

    /// The settings of assignee `name`, if it is configured.
    pub fn assignee(&self, name: &str) -> Option<&AssigneeConfig> {
        self.assignees.get(name)
    }

    /// Of `waiting` (tasks waiting per assignee name), those for assignees this config does
    /// not have: they never run until it has them again.
    pub fn unconfigured(
        &self,
        mut waiting: std::collections::BTreeMap<String, i64>,
    ) -> std::collections::BTreeMap<String, i64> {
        waiting.retain(|name, _| self.assignee(name).is_none());
        waiting
    }

    /// Which config file to use: the explicit flag, else `$RUNWARDEN_CONFIG` (if non-empty),
    /// else `./config.toml`.
    pub fn resolve_path(flag: Option<&Path>) -> PathBuf {
        if let Some(flag) = flag {
            return flag.to_path_buf();
        }
        match std::env::var_os(CONFIG_ENV) {
            Some(env) if !env.is_empty() => PathBuf::from(env),
            _ => PathBuf::from(DEFAULT_CONFIG_FILE),
        }
    }
}

/// Parse, then validate and resolve; the error is the one-line message of `ConfigError::Invalid`.
fn parse(text: &str, base_dir: &Path) -> Result<Config, String> {
    // Syntax first: a malformed file gets toml's position, not a confusing type error.
    let table: toml::Table = text.parse().map_err(|e| diagnose::syntax_error(text, &e))?;
    let mut config: Config = toml::Value::Table(table.clone())
        .try_into()
        .map_err(|e| diagnose::schema_error(text, &table, &e))?;
    validate::validate_and_resolve(&mut config, base_dir).map_err(|p| p.render(text))?;
    Ok(config)
}
