//! Signalling a process group on kernels without `PIDFD_SIGNAL_PROCESS_GROUP` (Linux < 6.9,
//! which answers EINVAL to any non-zero `pidfd_send_signal` flags).
//!
//! The group is then reached member by member, never with a bare `kill()`:
//!
//! - the leader through the caller's pidfd ([`PidFd::signal`]);
//! - every other member found by scanning `/proc` for `pgrp == leader pid`, each through its OWN
//!   pidfd, opened and then re-verified: its stat is read again after `pidfd_open`, and it must
//!   still be in the group with the start time the scan saw. The fd then provably names the
//!   process the scan found in the group (see `open_verified` for why the order proves it).
//!
//! Why a `/proc` scan by number finds exactly the pinned group's members, even once the leader
//! was reaped and we hold only its pidfd: the kernel does not hand out a pid number whose
//! `struct pid` is still attached to any task, as a pid, a process group id or a session id. So
//! while the leader is unreaped, or any member (zombies included) still has it as its pgid, the
//! number names our group and no other. It can only be reused once the group is empty, and then
//! only a process that was given the number itself can start a new group under it.
//!
//! That last case is detected: if the leader is reaped and yet `/proc/<leader pid>` exists, the
//! number was freed and reused, so our group was empty at that point, and any "member" found is a
//! stranger's: nothing is signalled. The probe of the leader comes after the scan, so a leader
//! still unreaped at that point held the number throughout the scan (exact). The one case left
//! open would need, within the milliseconds of one scan, our whole group to end and be reaped,
//! the pid space to wrap around to this number, the new holder to start a group, and itself to
//! exit and be reaped while members of its group live on.

use std::sync::atomic::{AtomicBool, Ordering};

use super::liveness::all_stats_checked;
use super::{PidFd, ProcStat, ProcessError, Signal, read_stat};

/// Set once the kernel answered EINVAL to `PIDFD_SIGNAL_PROCESS_GROUP`: later calls go straight
/// to the fallback.
static FLAG_UNSUPPORTED: AtomicBool = AtomicBool::new(false);
/// Test hook: use the fallback even where the kernel supports the flag.
static FORCE_FALLBACK: AtomicBool = AtomicBool::new(false);

/// Test hook: makes every group signal (and group probe) of this process use the per-member
/// fallback, as on a kernel older than 6.9. Process-wide: a test binary that forces it should
/// force it for all its tests.
#[doc(hidden)]
pub fn force_group_signal_fallback(on: bool) {
    FORCE_FALLBACK.store(on, Ordering::SeqCst);
}

/// True when group signals must use the fallback (known unsupported, or forced).
pub(super) fn use_fallback() -> bool {
    FORCE_FALLBACK.load(Ordering::SeqCst) || FLAG_UNSUPPORTED.load(Ordering::Relaxed)
}

/// True if `err` is the kernel refusing the flag; records it (and warns, once) if so.
pub(super) fn is_flag_unsupported(err: &ProcessError) -> bool {
    let einval = matches!(err, ProcessError::Io { source, .. }
        if source.raw_os_error() == Some(libc::EINVAL));
    if einval && !FLAG_UNSUPPORTED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "this kernel lacks PIDFD_SIGNAL_PROCESS_GROUP (Linux >= 6.9); process groups are \
             signalled member by member through verified pidfds"
        );
    }
    einval
}

/// True if the leader behind `leader` has not been reaped yet (a zombie counts): a signal 0
/// through its pidfd reaches it.
fn leader_unreaped(leader: &PidFd) -> Result<bool, ProcessError> {
    match leader.send_raw(0, 0, "pidfd_send_signal(0)") {
        Ok(()) => Ok(true),
        Err(ProcessError::NoSuchProcess { .. }) => Ok(false),
        Err(err) => Err(err),
    }
}

/// After a scan: true if the leader is reaped and its number has been given to another
/// process, i.e. whatever the scan found under that number is not our group.
fn number_recycled(leader: &PidFd) -> Result<bool, ProcessError> {
    if leader_unreaped(leader)? {
        return Ok(false);
    }
    Ok(!matches!(
        read_stat(leader.pid()),
        Err(ProcessError::NoSuchProcess { .. })
    ))
}

/// Processes (zombies included) whose pgrp is the leader's pid, from one /proc scan; an
/// `Err` when the scan cannot be complete (an unread member must not read as "group gone").
fn scan(leader: &PidFd) -> Result<Vec<ProcStat>, ProcessError> {
    let pgid = leader.pid();
    let mut stats = all_stats_checked()?;
    stats.retain(|s| s.pgrp == pgid);
    Ok(stats)
}

/// A member's own pidfd, opened after the scan saw `seen`, kept only if a stat read with the fd
/// open still shows it in the group with the same start time.
fn open_member(seen: &ProcStat) -> Option<PidFd> {
    let fd = PidFd::open(seen.pid).ok()?;
    let now = read_stat(seen.pid).ok()?;
    (now.pgrp == seen.pgrp && now.start_ticks == seen.start_ticks).then_some(fd)
}

/// `signal_group` without the flag: `sig` to every member, each through a verified pidfd.
/// NoSuchProcess if nothing of the group was there to receive it (as ESRCH with the flag).
pub(super) fn signal_group(leader: &PidFd, sig: Signal) -> Result<(), ProcessError> {
    let pgid = leader.pid();
    let found = scan(leader)?;
    let leader_seen = found.iter().any(|s| s.pid == pgid);
    // Members pinned before deciding, so the decision covers exactly the processes signalled.
    let members: Vec<PidFd> = found
        .iter()
        .filter(|s| s.pid != pgid)
        .filter_map(open_member)
        .collect();
    if number_recycled(leader)? {
        return Err(ProcessError::NoSuchProcess { pid: pgid });
    }
    let mut delivered = false;
    let mut first_error = None;
    // The leader only if the scan saw it in its own group: one that moved to another group is
    // not a member, as with the flag.
    let targets = leader_seen
        .then_some(leader)
        .into_iter()
        .chain(members.iter());
    for fd in targets {
        match fd.signal(sig) {
            Ok(()) => delivered = true,
            // Gone since the scan: nothing to do for it.
            Err(ProcessError::NoSuchProcess { .. }) => {}
            Err(err) => {
                tracing::warn!(pid = fd.pid(), pgid, ?sig, error = %err, "cannot signal group member");
                first_error.get_or_insert(err);
            }
        }
    }
    match (delivered, first_error) {
        (true, _) => Ok(()),
        (false, Some(err)) => Err(err),
        (false, None) => Err(ProcessError::NoSuchProcess { pid: pgid }),
    }
}

/// `group_exists` without the flag: any process (zombies included) in the group.
pub(super) fn group_exists(leader: &PidFd) -> Result<bool, ProcessError> {
    let found = scan(leader)?;
    if found.is_empty() {
        return Ok(false);
    }
    Ok(!number_recycled(leader)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_einval_means_the_flag_is_unsupported() {
        // Not EINVAL: not recorded, so the flag keeps being tried.
        let eperm = ProcessError::Io {
            pid: 1,
            what: "pidfd_send_signal",
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        };
        assert!(!is_flag_unsupported(&eperm));
        assert!(!is_flag_unsupported(&ProcessError::NoSuchProcess {
            pid: 1
        }));
    }
}
