//! Adopting and reaping orphaned descendants of workers.
//!
//! A worker's descendant that left the worker's process group (`setsid`, `setpgid`) escapes the
//! group signal. As a child subreaper the supervisor becomes the parent of such a descendant once
//! its own parent exits, so it is never lost to init; and since nobody else will wait for it, its
//! zombie must be reaped here or it pins a pid (and a process-table slot) forever.

use nix::errno::Errno;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};

use super::liveness::all_stats;
use super::{Pid, ProcStat, ProcessError};

/// This process is a child subreaper while a `Subreaper` lives (see [`become_subreaper`]).
#[derive(Debug)]
#[must_use = "the process stops being a subreaper when the last one is dropped"]
pub struct Subreaper(());

/// Live [`Subreaper`]s, and whether the process was a subreaper before the first of them.
static HOLDERS: std::sync::Mutex<(usize, bool)> = std::sync::Mutex::new((0, false));

/// Make this process a child subreaper (prctl PR_SET_CHILD_SUBREAPER) so orphaned descendants of
/// workers re-parent to us, for as long as the returned value (or another) lives. When the
/// last is dropped — every supervisor of the process has stopped — the process is put back as
/// it was: a host that embedded a supervisor no longer adopts orphans nobody will reap.
pub fn become_subreaper() -> Result<Subreaper, ProcessError> {
    let failed = |what, errno: rustix::io::Errno| ProcessError::System {
        what,
        source: errno.into(),
    };
    let mut holders = HOLDERS.lock().unwrap_or_else(|p| p.into_inner());
    if holders.0 == 0 {
        let was = rustix::process::child_subreaper()
            .map_err(|e| failed("prctl(PR_GET_CHILD_SUBREAPER)", e))?
            .is_some();
        if !was {
            rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
                .map_err(|e| failed("prctl(PR_SET_CHILD_SUBREAPER)", e))?;
        }
        holders.1 = was;
    }
    holders.0 += 1;
    Ok(Subreaper(()))
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        let mut holders = HOLDERS.lock().unwrap_or_else(|p| p.into_inner());
        holders.0 -= 1;
        if holders.0 == 0
            && !holders.1
            && let Err(e) = rustix::process::set_child_subreaper(None)
        {
            tracing::warn!(error = %e, "cannot stop being a child subreaper");
        }
    }
}

/// Reap every zombie child of ours whose pid is not in `keep` (our live workers, reaped by their
/// owners): scans /proc/*/stat for ppid == getpid() && state == 'Z', then waitpid(that pid,
/// WNOHANG). Returns the reaped pids.
///
/// `keep(pid)` must be true for every child that something else will wait for (a worker's
/// `Child`, any other `Command` the process runs): reaping it here would steal its exit status.
pub fn reap_orphans(keep: &dyn Fn(Pid) -> bool) -> Vec<Pid> {
    reap_orphans_among(&own_children(), keep)
}

/// Our children as one scan of /proc sees them (zombies included): what [`reap_orphans_among`]
/// and the stray-descendant sweep both work from, so a tick scans /proc once, not twice.
pub fn own_children() -> Vec<ProcStat> {
    let me = std::process::id() as Pid;
    all_stats()
        .map(|stats| stats.filter(|stat| stat.ppid == me).collect())
        .unwrap_or_default()
}

/// [`reap_orphans`] over children already scanned by [`own_children`].
pub fn reap_orphans_among(children: &[ProcStat], keep: &dyn Fn(Pid) -> bool) -> Vec<Pid> {
    let orphans: Vec<Pid> = children
        .iter()
        .filter(|stat| stat.is_zombie())
        .map(|stat| stat.pid)
        .filter(|&pid| !keep(pid))
        .collect();

    let mut reaped = Vec::new();
    if orphans.is_empty() {
        return reaped;
    }
    // Each one is checked again with spawns held off, through its waitpid: a child spawned
    // (and registered) since the scan is never taken for an orphan. Held once for the lot, so
    // spawns wait once, not once per orphan.
    let owned = super::owned::reaping();
    for pid in orphans {
        if owned.is_registered(pid) {
            continue;
        }
        // WNOHANG: if the pid was reaped elsewhere and reused by a live child meanwhile, this
        // returns at once instead of blocking on it. __WALL: also reap clone children whose exit
        // signal is not SIGCHLD.
        match waitpid(
            nix::unistd::Pid::from_raw(pid),
            Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL),
        ) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(status) => {
                tracing::debug!(pid, ?status, "reaped orphaned descendant");
                reaped.push(pid);
            }
            // Reaped by someone else between the scan and now.
            Err(Errno::ECHILD) => {}
            Err(err) => tracing::warn!(pid, error = %err, "cannot reap orphaned descendant"),
        }
    }
    reaped
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::process::read_stat;
    use crate::process::testutil::wait_until;

    #[test]
    #[expect(
        clippy::zombie_processes,
        reason = "reaping it is what reap_orphans is tested on"
    )]
    fn reaps_a_zombie_child_not_kept_and_spares_kept_ones() {
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as Pid;
        assert!(wait_until(Duration::from_secs(10), || {
            read_stat(pid).is_ok_and(|stat| stat.is_zombie())
        }));
        // Tests run in parallel threads of this process: keep every child but this one.
        assert_eq!(reap_orphans(&|_| true), Vec::<Pid>::new());
        assert!(read_stat(pid).is_ok_and(|stat| stat.is_zombie()));
        assert_eq!(reap_orphans(&|other| other != pid), [pid]);
        assert!(read_stat(pid).unwrap_err().is_no_such_process());
    }
}
