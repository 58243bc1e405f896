//! Process identity and safe signalling.
//!
//! A pid alone does not name a process: once a process is reaped its pid can be handed to a
//! stranger. runwarden therefore records a [`Fingerprint`] (boot id + start time in clock ticks)
//! when it spawns a worker, and every later decision goes through it:
//!
//! - [`liveness`] gives a verdict that is `Dead` only with proof (no such pid, a zombie, another
//!   boot, another start time) and `Unknown` whenever a probe fails. Unknown is never signalled.
//! - Signals go through a [`PidFd`]: [`open_verified`] opens the pidfd first and re-reads the
//!   fingerprint *after* it is open, so the fd provably refers to the recorded process and a
//!   signal sent through it can never reach a recycled pid.
//! - Workers lead their own process group; the group is signalled
//!   (`pidfd_send_signal(…, PIDFD_SIGNAL_PROCESS_GROUP)`), which works through the leader's pidfd
//!   even after the leader exited or was reaped, for as long as any member lives. Kernels before
//!   6.9 lack the flag; there each member is signalled through its own verified pidfd instead
//!   (`group_fallback`).
//! - [`terminate`] (SIGTERM, wait, SIGKILL) takes a [`Signaller`] so tests can inject failures;
//!   [`terminate_group`] ends a group through a pidfd the caller already holds (its own child).
//! - [`become_subreaper`] and [`reap_orphans`] catch descendants that escaped their group with
//!   `setsid` and were re-parented to the supervisor.
//!
//! Layout: `clone_exec` starts a worker (clone3 + execve) in the common case; `stat` parses
//! `/proc/<pid>/stat`; `fingerprint` reads the boot id and fingerprints; `liveness` gives
//! verdicts and scans process groups; `pidfd` wraps the pidfd syscalls and the
//! open-then-verify step; `signal` holds the signaller and the terminate sequences;
//! `subreaper` adopts and reaps orphans; `descendants` finds what escaped a worker's group;
//! `owned` tracks the children whose owners reap them; `exit_status` reads how a process that
//! is not our child (an adopted worker) ended; `sched` sets the scheduling policy of
//! the supervisor's own threads; `sigchld` tells whether the kernel reaps our children itself.

pub mod clone_exec;
pub mod descendants;
pub mod exit_status;
mod fingerprint;
mod group_fallback;
mod liveness;
pub mod nofile;
pub mod owned;
mod pidfd;
pub mod sched;
pub mod sigchld;
mod signal;
mod stat;
mod subreaper;
#[cfg(test)]
mod testutil;

use std::io;

pub use fingerprint::{Fingerprint, boot_id, fingerprint, fingerprint_of_child};
#[doc(hidden)]
pub use group_fallback::force_group_signal_fallback;
pub use liveness::{DeadReason, Liveness, group_alive, group_members, liveness};
pub use pidfd::{ExitStatus, PidFd, Verified, open_verified};
pub(crate) use signal::AFTER_SIGKILL;
pub use signal::{
    Begun, Ended, PidfdSignaller, Sent, Signaller, Terminating, begin_terminate, deadline_after,
    finish_group_end, terminate, terminate_group,
};
pub use stat::{ProcStat, parse_stat, read_stat};
pub use subreaper::{Subreaper, become_subreaper, own_children, reap_orphans, reap_orphans_among};

/// A process id as the kernel numbers it (`pid_t`).
pub type Pid = i32;

/// The signal type used throughout (nix's, re-exported so callers need not depend on nix).
pub use nix::sys::signal::Signal;

/// Why an operation on a process failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The pid does not exist (or, for a group signal, the group has no member left).
    #[error("no such process: {pid}")]
    NoSuchProcess {
        /// The pid (or group leader's pid) that was looked for.
        pid: Pid,
    },
    /// A system call or `/proc` read about one process failed.
    #[error("{what} failed for pid {pid}: {source}")]
    Io {
        /// The pid the operation was about.
        pid: Pid,
        /// What was attempted, e.g. `"pidfd_open"`.
        what: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
    /// A `/proc/<pid>/stat` line did not parse.
    #[error("cannot parse /proc/{}/stat: {reason}", pid.map_or_else(|| "<pid>".to_owned(), |p| p.to_string()))]
    Parse {
        /// The pid whose stat was read, when known.
        pid: Option<Pid>,
        /// What was wrong with the text.
        reason: String,
    },
    /// SIGKILL was sent but the process (or a member of its group) was still there after
    /// `after` — e.g. in uninterruptible sleep. Not "ended": its run keeps its evidence (and
    /// its task stays unclaimable) until a later attempt proves it gone.
    #[error("pid {pid} (or its group) outlived SIGKILL for {after:?}")]
    SurvivedSigkill {
        /// The pid (or group leader's pid) that was killed.
        pid: Pid,
        /// How long it was waited for.
        after: std::time::Duration,
    },
    /// A system-wide operation failed (reading the boot id, becoming a subreaper).
    #[error("{what} failed: {source}")]
    System {
        /// What was attempted.
        what: &'static str,
        /// The operating system's error.
        #[source]
        source: io::Error,
    },
}

impl ProcessError {
    /// True for [`ProcessError::NoSuchProcess`]: the process (or group) is provably gone.
    pub fn is_no_such_process(&self) -> bool {
        matches!(self, ProcessError::NoSuchProcess { .. })
    }

    /// True for a read of `pid`'s `/proc` files refused for good (EACCES, EPERM: `/proc`
    /// mounted with `hidepid`, another namespace's process): not one this supervisor could
    /// prove its own, or signal, ever. Scans pass over such processes as they do over ones
    /// that vanished; any other failure leaves a scan incomplete.
    pub(crate) fn is_refused(&self) -> bool {
        matches!(
            self,
            ProcessError::Io { source, .. }
                if matches!(source.raw_os_error(), Some(libc::EACCES | libc::EPERM))
        )
    }

    /// Wraps an OS error about `pid`, turning ESRCH into [`ProcessError::NoSuchProcess`].
    pub(crate) fn os(pid: Pid, what: &'static str, source: io::Error) -> Self {
        if source.raw_os_error() == Some(libc::ESRCH) {
            ProcessError::NoSuchProcess { pid }
        } else {
            ProcessError::Io { pid, what, source }
        }
    }
}
