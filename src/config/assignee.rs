//! `[assignees.NAME]` and `[[hooks]]`: the commands runwarden runs, and how.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::serde_helpers::{duration, name_or_id, opt_duration, rlimits, umask};

/// `[assignees.NAME]`: how the workers of one assignee are run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssigneeConfig {
    /// The worker's argv (required, non-empty); no shell unless the user writes one.
    pub command: Vec<String>,
    /// Live workers of this assignee. Default 1; at least 1.
    #[serde(default = "default_assignee_max_in_progress")]
    pub max_in_progress: u32,
    /// A run longer than this is ended. Default `None` (no limit); `"0s"` also means none.
    #[serde(default, with = "opt_duration")]
    pub max_runtime: Option<Duration>,
    /// Overrides `retries.max_retries` for this assignee's tasks.
    #[serde(default)]
    pub max_retries: Option<u32>,
    /// A clean exit without a report counts as this.
    #[serde(default)]
    pub on_exit_zero: OnExitZero,
    /// Added to the worker's environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Working directory; `None` means `<data_dir>/work/<task id>`. Absolute after load.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// Exit codes that requeue the task after `retry_cooldown` without counting a failure.
    #[serde(default)]
    pub retry_exit_codes: Vec<i32>,
    /// Exit codes that block the task at once, with no retry.
    #[serde(default)]
    pub fail_exit_codes: Vec<i32>,
    /// Delay before a run that exited with a `retry_exit_codes` code is retried. Default 30s.
    #[serde(default = "default_thirty_seconds", with = "duration")]
    pub retry_cooldown: Duration,
    /// Run the worker as this user (name, or a numeric uid). Looked up at load time.
    #[serde(default, with = "name_or_id")]
    pub user: Option<String>,
    /// Run the worker with this group (name, or a numeric gid); defaults to `user`'s primary group.
    #[serde(default, with = "name_or_id")]
    pub group: Option<String>,
    /// Resolved from `user` at load time; not a config key.
    #[serde(skip)]
    pub uid: Option<u32>,
    /// Resolved from `group` (else `user`'s primary group) at load time; not a config key.
    #[serde(skip)]
    pub gid: Option<u32>,
    /// The worker's umask, written `"022"` (octal digits) or as a TOML integer (`0o022`); ≤ 0o777.
    #[serde(default, with = "umask")]
    pub umask: Option<u32>,
    /// Resource limits by name (`nofile`, `as`, `nproc`, `cpu`, `fsize`, `core`, `memlock`,
    /// `stack`, `data`); `"unlimited"` is stored as `u64::MAX` (`RLIM_INFINITY`).
    #[serde(default, with = "rlimits")]
    pub rlimits: BTreeMap<String, u64>,
}

fn default_assignee_max_in_progress() -> u32 {
    1
}

fn default_thirty_seconds() -> Duration {
    Duration::from_secs(30)
}

impl AssigneeConfig {
    /// An assignee running `command` with every other key at its default: for tests and embedding.
    pub fn new<S: Into<String>>(command: impl IntoIterator<Item = S>) -> AssigneeConfig {
        AssigneeConfig {
            command: command.into_iter().map(Into::into).collect(),
            max_in_progress: default_assignee_max_in_progress(),
            max_runtime: None,
            max_retries: None,
            on_exit_zero: OnExitZero::Complete,
            env: BTreeMap::new(),
            cwd: None,
            retry_exit_codes: Vec::new(),
            fail_exit_codes: Vec::new(),
            retry_cooldown: default_thirty_seconds(),
            user: None,
            group: None,
            uid: None,
            gid: None,
            umask: None,
            rlimits: BTreeMap::new(),
        }
    }
}

/// How a worker that exits 0 without having reported is recorded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExitZero {
    /// The task is completed.
    #[default]
    Complete,
    /// The run counts as crashed (for workers that must report explicitly).
    Crash,
}

/// `[[hooks]]`: a command run when one of the listed events is recorded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookConfig {
    /// Event kinds that fire the hook, e.g. `["gave_up", "crashed"]`; non-empty.
    pub on: Vec<String>,
    /// The hook's argv; non-empty.
    pub command: Vec<String>,
    /// The hook is killed after this long. Default 30s; must be > 0.
    #[serde(default = "default_thirty_seconds", with = "duration")]
    pub timeout: Duration,
}

impl HookConfig {
    /// A hook running `command` on the events `on`, with the default timeout.
    pub fn new<S: Into<String>, T: Into<String>>(
        on: impl IntoIterator<Item = S>,
        command: impl IntoIterator<Item = T>,
    ) -> HookConfig {
        HookConfig {
            on: on.into_iter().map(Into::into).collect(),
            command: command.into_iter().map(Into::into).collect(),
            timeout: default_thirty_seconds(),
        }
    }
}

/// The resource a `rlimits` key names, or `None` for a name runwarden does not accept.
pub fn rlimit_resource(name: &str) -> Option<nix::sys::resource::Resource> {
    use nix::sys::resource::Resource;
    Some(match name {
        "nofile" => Resource::RLIMIT_NOFILE,
        "as" => Resource::RLIMIT_AS,
        "nproc" => Resource::RLIMIT_NPROC,
        "cpu" => Resource::RLIMIT_CPU,
        "fsize" => Resource::RLIMIT_FSIZE,
        "core" => Resource::RLIMIT_CORE,
        "memlock" => Resource::RLIMIT_MEMLOCK,
        "stack" => Resource::RLIMIT_STACK,
        "data" => Resource::RLIMIT_DATA,
        _ => return None,
    })
}

/// The names accepted in `rlimits`, in the order the error message lists them.
pub const RLIMIT_NAMES: [&str; 9] = [
    "nofile", "as", "nproc", "cpu", "fsize", "core", "memlock", "stack", "data",
];
