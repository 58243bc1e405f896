//! runwarden — an actor-based process supervisor for a SQLite board of agent tasks.
//!
//! A board of tasks lives in SQLite. A dispatcher claims ready tasks and spawns one worker
//! process per run; the worker's pid and spawn fingerprint (boot id + process start time) are
//! written on the run row. Workers report back over a local control socket. The supervisor ends
//! every worker whose run no longer wants it — crashed, timed out, lost its lease, archived, or
//! reported "done" and then hung — after the right grace period, killing its whole process
//! tree, and it never signals a process that is not provably the one it spawned.
//!
//! # Layout
//!
//! - [`board`]: the SQLite schema, migrations, every transition and sweep. Synchronous; the
//!   only module that contains SQL. Usable alone (the invariant tests drive it directly).
//! - [`process`]: process identity ([`process::Fingerprint`], [`process::liveness`]) and safe
//!   signalling (pidfd opened, fingerprint re-verified, whole process group signalled),
//!   descendant tracking, the subreaper's orphan reaping, the scheduling policy of the
//!   supervisor's own threads ([`process::sched`]).
//! - [`actors`]: the running supervisor — `StoreActor` (the only writer: one thread, group
//!   commit, publishes each commit's events as one batch), `DispatcherActor` (claims within
//!   caps, adopts a previous incarnation's workers), `WorkerActor` (one per live run; its
//!   process is started on the supervisor's `Spawner` threads and watched through its pidfd),
//!   `ReaperActor` (ends closed runs' workers after the grace), `HookActor`.
//! - [`control`]: the control socket — NDJSON protocol, server, blocking client.
//! - [`supervisor`]: boot and shutdown of the whole runtime; [`Supervisor::start`] for
//!   embedding, [`supervisor::run`] for `runwarden serve`.
//! - [`config`]: `config.toml`, every key defaulted, unknown keys refused by name.
//! - [`lock`]: one supervisor per board (an `flock`ed lock file naming its holder).
//! - `data_dir` (internal): the data directory's `logs/` and `work/`, whether it is the
//!   supervisor's alone, and the modes that follow.
//! - `copy_check` (internal): at start, whether the board is a copy of one in use (another
//!   data dir's, in this boot), whose workers are then disowned, never adopted or signalled.
//! - [`cli`]: the thin `runwarden` command line.
#![deny(rust_2018_idioms)]

pub mod actors;
pub mod board;
pub mod cli;
pub mod config;
pub mod control;
mod copy_check;
mod data_dir;
pub mod lock;
pub mod process;
pub mod supervisor;

pub use supervisor::{Services, Supervisor, SupervisorError, SupervisorHandle};

/// `now + d`, saturating far in the future instead of panicking on an absurd duration (a
/// `--timeout`, a config value in years). One implementation: the process module's.
pub use process::deadline_after;
