//! The board's value types: what a task, a run and an event are.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::process::Fingerprint;

/// A task's id (rowid of `tasks`).
pub type TaskId = i64;
/// A run's id (rowid of `task_runs`).
pub type RunId = i64;
/// An event's id: monotonic, the order in which events committed.
pub type EventId = i64;
/// Milliseconds since the Unix epoch. Every function takes `now` so tests control time.
pub type Millis = i64;

/// The current wall-clock time in [`Millis`].
pub fn now_millis() -> Millis {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as Millis)
        .unwrap_or(0)
}

macro_rules! string_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name { $($(#[$vm])* $variant),+ }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The stored (and wire) spelling.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(format!(
                        "unknown {} `{}` (expected one of: {})",
                        stringify!($name),
                        other,
                        [$($text),+].join(", ")
                    )),
                }
            }
        }
    };
}

string_enum! {
    /// Where a task is in its life.
    TaskStatus {
        /// Waiting for a parent to finish.
        Todo => "todo",
        /// Claimable by the dispatcher.
        Ready => "ready",
        /// Has an open run.
        Running => "running",
        /// Needs an operator (`unblock`).
        Blocked => "blocked",
        /// Finished successfully.
        Done => "done",
        /// Put away; never dispatched again.
        Archived => "archived",
    }
}

impl TaskStatus {
    /// True for the statuses a child's parent may be in for the child to become ready.
    pub fn satisfies_dependency(self) -> bool {
        matches!(self, TaskStatus::Done | TaskStatus::Archived)
    }
}

string_enum! {
    /// How a run ended.
    RunOutcome {
        /// The worker reported completion (or exited cleanly under `on_exit_zero = "complete"`).
        Completed => "completed",
        /// The worker (or an operator) blocked the task.
        Blocked => "blocked",
        /// The worker exited without a report, non-zero or by a signal.
        Crashed => "crashed",
        /// The worker could not be started.
        SpawnFailed => "spawn_failed",
        /// The run exceeded its max runtime.
        TimedOut => "timed_out",
        /// The run was released (lease expired with its worker dead, or an operator reclaim).
        Reclaimed => "reclaimed",
        /// No heartbeat for `stale_after`.
        Stale => "stale",
        /// The task was archived while running.
        Archived => "archived",
    }
}

impl RunOutcome {
    /// True when the worker closed its own run (reported `complete` or `block`): it gets the
    /// grace to finish and exit; any other close wants it gone at once. (The reaper's SQL,
    /// `terminal_reap_candidates`, spells the same rule.)
    pub fn closed_by_its_worker(self) -> bool {
        matches!(self, RunOutcome::Completed | RunOutcome::Blocked)
    }
}

/// A task row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: TaskId,
    pub title: String,
    pub body: String,
    pub assignee: Option<String>,
    pub status: TaskStatus,
    pub priority: i64,
    pub created_at: Millis,
    pub updated_at: Millis,
    pub started_at: Option<Millis>,
    pub completed_at: Option<Millis>,
    pub current_run_id: Option<RunId>,
    pub idempotency_key: Option<String>,
    pub max_runtime_ms: Option<i64>,
    pub max_retries: Option<i64>,
    pub consecutive_failures: i64,
    pub not_before: Millis,
    pub result: Option<String>,
    pub block_reason: Option<String>,
}

/// A run row: one attempt at a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Run {
    pub id: RunId,
    pub task_id: TaskId,
    pub attempt: i64,
    pub assignee: Option<String>,
    /// Secret a worker presents to act on its own run. Never serialized to clients.
    #[serde(skip_serializing, default)]
    pub token: String,
    pub claimer: String,
    pub outcome: Option<RunOutcome>,
    pub started_at: Millis,
    pub ended_at: Option<Millis>,
    pub lease_expires_at: Millis,
    pub heartbeat_at: Option<Millis>,
    /// The pid the worker was spawned with; kept for history after the evidence is cleared.
    pub spawned_pid: Option<i64>,
    /// Evidence of a possibly-live worker; cleared once the worker is known to be gone.
    pub worker_pid: Option<i64>,
    pub worker_boot_id: Option<String>,
    pub worker_start_ticks: Option<i64>,
    pub exit_code: Option<i64>,
    pub exit_signal: Option<i64>,
    pub error: Option<String>,
    pub summary: Option<String>,
    /// Where this run's output starts in its task's log, recorded with the worker's evidence
    /// (`None` for runs recorded before schema v7, or whose worker was found by its token by a
    /// build that still adopted such workers).
    /// Internal: not part of the protocol.
    #[serde(skip, default)]
    pub log_start: Option<LogStart>,
    /// The silence (no heartbeat, ms) the supervisors watching this run had heard from its
    /// worker at the last refresh of its lease; reset by a heartbeat. For `stale_after` across
    /// restarts. Internal: not part of the protocol.
    #[serde(skip, default)]
    pub silence_ms: i64,
    /// The worker's pidfs inode number, part of its evidence where known (see
    /// [`Fingerprint`]). Internal: not part of the protocol.
    #[serde(skip, default)]
    pub worker_pidfs_ino: Option<i64>,
}

/// Where a run's output starts in its task's log, so that a crash quotes that run's output
/// only. The default (nothing known) is the whole log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogStart {
    /// The log's size when the worker got it.
    pub offset: u64,
    /// The log's rotation then (`actors::spawn::log_generation`): after another rotation, all
    /// of the log is the run's.
    pub generation: Option<String>,
}

impl Run {
    /// The recorded spawn fingerprint, if the row has a complete one.
    pub fn fingerprint(&self) -> Option<Fingerprint> {
        fingerprint_of(
            self.worker_boot_id.clone(),
            self.worker_start_ticks,
            self.worker_pidfs_ino,
        )
    }

    /// True while the run is open.
    pub fn is_open(&self) -> bool {
        self.ended_at.is_none()
    }
}

/// One row of the append-only event log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub id: EventId,
    pub task_id: Option<TaskId>,
    pub run_id: Option<RunId>,
    pub kind: String,
    pub payload: serde_json::Value,
    pub at: Millis,
}

/// A comment on a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comment {
    pub id: i64,
    pub task_id: TaskId,
    pub author: String,
    pub body: String,
    pub at: Millis,
}

/// What `create_task` needs. Only the title is required (a request without one is told
/// that it is missing).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTask {
    pub title: String,
    #[serde(default)]
    pub body: String,
    #[serde(default)]
    pub assignee: Option<String>,
    #[serde(default)]
    pub priority: i64,
    #[serde(default)]
    pub parents: Vec<TaskId>,
    #[serde(default)]
    pub max_runtime_ms: Option<i64>,
    #[serde(default)]
    pub max_retries: Option<i64>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

impl NewTask {
    /// A task with just a title (no assignee: it is never dispatched until one is set).
    pub fn titled(title: impl Into<String>) -> Self {
        NewTask {
            title: title.into(),
            ..NewTask::default()
        }
    }

    /// The same task for `assignee`.
    pub fn for_assignee(mut self, assignee: impl Into<String>) -> Self {
        self.assignee = Some(assignee.into());
        self
    }
}

/// What `create_task` returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Created {
    pub id: TaskId,
    /// True when an open task with the same idempotency key already existed (nothing was created).
    pub existed: bool,
}

/// A successful claim: the new run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Claim {
    pub task_id: TaskId,
    pub run_id: RunId,
    pub attempt: i64,
    pub token: String,
}

/// Worker evidence left on a run that was just closed: the reaper's input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClosedRun {
    pub task_id: TaskId,
    pub run_id: RunId,
    pub outcome: RunOutcome,
    pub ended_at: Millis,
    pub pid: Option<i32>,
    pub fingerprint: Option<Fingerprint>,
}

/// A task with its runs, recent events and comments (`show`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskDetail {
    #[serde(flatten)]
    pub task: Task,
    pub parents: Vec<TaskId>,
    pub children: Vec<TaskId>,
    pub runs: Vec<Run>,
    pub events: Vec<Event>,
    pub comments: Vec<Comment>,
    /// Older runs left out to keep the reply bounded (see `Tx::task_detail`); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted_runs: u64,
    /// Older comments left out the same way; absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted_comments: u64,
    /// Of the most recent events asked for, the older ones left out the same way (the `events`
    /// op pages through all of them); absent when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub omitted_events: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Filters for `list_tasks`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TaskFilter {
    pub status: Option<TaskStatus>,
    pub assignee: Option<String>,
    /// At most this many (default 1000; values above 10 000 are clamped to 10 000).
    pub limit: Option<u32>,
}

/// How a failed run (crash, timeout, spawn failure, stale) affects its task.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub outcome: RunOutcome,
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    pub error: String,
    /// Retries allowed when neither the task nor the caller's assignee sets one.
    pub default_max_retries: i64,
    /// Delay before the next attempt (the caller computes backoff and jitter).
    pub backoff_ms: i64,
    /// False for "requeue without counting" (e.g. a rate-limit exit code).
    pub counts: bool,
    /// True to block at once, without retrying (e.g. a fail exit code).
    pub give_up_now: bool,
}

/// Every event kind the board writes (docs/lifecycle.md lists what each means). Hooks are
/// checked against it at load, so `on = ["gaveup"]` is refused instead of never firing.
pub const EVENT_KINDS: [&str; 28] = [
    "created",
    "linked",
    "commented",
    "promoted",
    "demoted",
    "claimed",
    "worker_spawned",
    "worker_adopted",
    "worker_disowned",
    "worker_found",
    "heartbeat",
    "worker_exited",
    "worker_group_ended",
    "stray_descendants_ended",
    "run_closed",
    "completed",
    "blocked",
    "unblocked",
    "archived",
    "reclaimed",
    "retry_scheduled",
    "gave_up",
    "terminal_worker_reaped",
    "terminal_worker_gone",
    "pruned",
    "terminal_worker_pid_recycled",
    "reclaim_deferred",
    "event_ids_reserved",
];

/// The fingerprint stored in a run's `worker_boot_id`, `worker_start_ticks` and
/// `worker_pidfs_ino` columns, if it holds a whole one (the inode is optional).
pub(crate) fn fingerprint_of(
    boot_id: Option<String>,
    start_ticks: Option<i64>,
    pidfs_ino: Option<i64>,
) -> Option<Fingerprint> {
    Some(Fingerprint {
        boot_id: boot_id?,
        start_ticks: u64::try_from(start_ticks?).ok()?,
        pidfs_ino: pidfs_ino.map(ino_from_column),
    })
}

/// A pidfs inode number as its column stores it: its 64 bits, as SQLite's signed integer.
pub(crate) fn ino_to_column(ino: u64) -> i64 {
    ino as i64
}

/// The inverse of [`ino_to_column`].
pub(crate) fn ino_from_column(stored: i64) -> u64 {
    stored as u64
}

#[cfg(test)]
mod event_kind_tests {
    use std::collections::BTreeSet;

    /// The kinds the docs' table names (first column, in backticks), the user-facing truth.
    fn documented() -> BTreeSet<String> {
        let doc = include_str!("../../docs/lifecycle.md");
        let table = doc
            .split("## Event kinds")
            .nth(1)
            .expect("docs/lifecycle.md has an event kinds section");
        table
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .filter_map(|l| l.split('|').nth(1))
            .flat_map(|cell| cell.split('`').skip(1).step_by(2).map(str::to_string))
            .collect()
    }

    #[test]
    fn event_kinds_are_the_documented_ones() {
        let listed: BTreeSet<String> = super::EVENT_KINDS.iter().map(|k| k.to_string()).collect();
        assert_eq!(
            listed.len(),
            super::EVENT_KINDS.len(),
            "a kind listed twice"
        );
        assert_eq!(listed, documented());
    }
}
