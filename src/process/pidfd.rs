//! Thin safe wrappers over the pidfd syscalls, and the open-then-verify step.
//!
//! A pidfd refers to one `struct pid` in the kernel, not to a number: as long as we hold it, a
//! signal sent through it reaches that process (or its group) or nobody, never a process that was
//! later given the same pid.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};
use std::{io, ptr};

use rustix::event::{PollFd, PollFlags, poll};
use rustix::io::Errno;
use rustix::process::{PidfdFlags, WaitId, WaitidOptions, pidfd_open, waitid};

use super::liveness::{check_boot, verdict};
use super::{DeadReason, Fingerprint, Liveness, Pid, ProcStat, ProcessError, Signal};
use super::{group_alive, group_fallback, read_stat};

/// `PIDFD_SIGNAL_PROCESS_GROUP` (Linux 6.9, include/uapi/linux/pidfd.h); not in libc 0.2 yet.
const PIDFD_SIGNAL_PROCESS_GROUP: libc::c_uint = 4;

/// An open pidfd. Holding it pins the identity: signals through it can never reach a recycled pid.
#[derive(Debug)]
pub struct PidFd {
    fd: OwnedFd,
    pid: Pid,
}

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    /// It called exit with this code.
    Code(i32),
    /// It was killed by this signal number.
    Signal(i32),
}

impl PidFd {
    /// `pidfd_open(pid, 0)`; ESRCH (no such process), and EINVAL or ENOENT for a pid that names
    /// no process (a thread's id, a reaped leader's group id), are
    /// [`ProcessError::NoSuchProcess`].
    ///
    /// The fd is close-on-exec (the kernel always sets it), so workers never inherit it.
    pub fn open(pid: Pid) -> Result<PidFd, ProcessError> {
        // 0 and negative pids have special meanings to kill(2) and none to pidfd_open.
        let raw = rustix::process::Pid::from_raw(pid).ok_or_else(|| ProcessError::Io {
            pid,
            what: "pidfd_open",
            source: io::Error::from_raw_os_error(libc::EINVAL),
        })?;
        let fd = pidfd_open(raw, PidfdFlags::empty()).map_err(|errno| {
            // With a valid pid and no flags, EINVAL (ENOENT on newer kernels) means the number
            // names no process: it is held only as a thread's id, or as the id of a group whose
            // leader has been reaped. Either way the process it named is gone — an error here
            // would leave its run undecided (and its evidence uncleared) for ever.
            if errno == rustix::io::Errno::INVAL || errno == rustix::io::Errno::NOENT {
                ProcessError::NoSuchProcess { pid }
            } else {
                ProcessError::os(pid, "pidfd_open", errno.into())
            }
        })?;
        Ok(PidFd { fd, pid })
    }

    /// A pidfd the kernel handed back when it started `pid` (clone3's `CLONE_PIDFD`).
    pub(crate) fn from_owned(fd: OwnedFd, pid: Pid) -> PidFd {
        PidFd { fd, pid }
    }

    /// The pid this fd was opened for (in our pid namespace).
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// The inode number of this pidfd on pidfs (Linux 6.9): unique to its process within the
    /// boot (see [`Fingerprint`]). `Ok(None)` where pidfds are not pidfs inodes (older kernels:
    /// every pidfd is the one anonymous inode there) or inode numbers are narrower than 64 bits.
    pub fn pidfs_ino(&self) -> Result<Option<u64>, ProcessError> {
        if !pidfds_are_pidfs(self.fd.as_fd()) {
            return Ok(None);
        }
        let stat = rustix::fs::fstat(&self.fd)
            .map_err(|errno| ProcessError::os(self.pid, "fstat of a pidfd", errno.into()))?;
        Ok(Some(stat.st_ino as u64))
    }

    /// Sends `sig` to the process only.
    pub fn signal(&self, sig: Signal) -> Result<(), ProcessError> {
        self.send_raw(sig as libc::c_int, 0, "pidfd_send_signal")
    }

    /// Sends `sig` to the process group whose id is this process's pid
    /// (`PIDFD_SIGNAL_PROCESS_GROUP`).
    ///
    /// The kernel resolves the group from the `struct pid` this fd holds, so it works after the
    /// leader exited or was reaped, for as long as any member lives, and can never reach a
    /// recycled pid. ESRCH (no member left, zombies count as members) is
    /// [`ProcessError::NoSuchProcess`].
    ///
    /// On kernels before 6.9 (EINVAL for the flag) each member is signalled through its own
    /// verified pidfd instead; see `group_fallback` for why that reaches the same processes.
    pub fn signal_group(&self, sig: Signal) -> Result<(), ProcessError> {
        if !group_fallback::use_fallback() {
            match self.send_raw(
                sig as libc::c_int,
                PIDFD_SIGNAL_PROCESS_GROUP,
                "pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP)",
            ) {
                Err(err) if group_fallback::is_flag_unsupported(&err) => {}
                other => return other,
            }
        }
        group_fallback::signal_group(self, sig)
    }

    /// [`PidFd::signal_group`] only where the kernel does it in one syscall (Linux ≥ 6.9):
    /// true if sent; false, with nothing sent, where it would take the per-member fallback (a
    /// `/proc` scan) or failed. For callers that must not block (an actor thread) and follow
    /// up with the full [`PidFd::signal_group`] elsewhere.
    pub fn signal_group_at_once(&self, sig: Signal) -> bool {
        !group_fallback::use_fallback()
            && self
                .send_raw(
                    sig as libc::c_int,
                    PIDFD_SIGNAL_PROCESS_GROUP,
                    "pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP)",
                )
                .is_ok()
    }

    /// Whether the group still has any member, zombies included: signal 0 to the group, which
    /// checks delivery without sending anything (a `/proc` scan on kernels before 6.9).
    pub fn group_exists(&self) -> Result<bool, ProcessError> {
        self.group_signal0()
            .unwrap_or_else(|| group_fallback::group_exists(self))
    }

    /// [`Self::group_exists`] by its one syscall, which never waits on another process;
    /// `None` where that syscall is not available (kernels before 6.9 scan /proc instead) or
    /// failed.
    pub fn group_exists_now(&self) -> Option<bool> {
        self.group_signal0()?.ok()
    }

    /// Signal 0 to the group through the pidfd; `None` where the flag is not available (the
    /// first refusal is recorded, so later calls skip the syscall).
    fn group_signal0(&self) -> Option<Result<bool, ProcessError>> {
        if group_fallback::use_fallback() {
            return None;
        }
        match self.send_raw(0, PIDFD_SIGNAL_PROCESS_GROUP, "pidfd_send_signal(0, group)") {
            Ok(()) => Some(Ok(true)),
            Err(ProcessError::NoSuchProcess { .. }) => Some(Ok(false)),
            Err(err) if group_fallback::is_flag_unsupported(&err) => None,
            Err(err) => Some(Err(err)),
        }
    }

    pub(super) fn send_raw(
        &self,
        sig: libc::c_int,
        flags: libc::c_uint,
        what: &'static str,
    ) -> Result<(), ProcessError> {
        // SAFETY: plain syscall on an fd we own; a null siginfo asks the kernel to fill in a
        // SI_USER one, as kill(2) would.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.fd.as_raw_fd(),
                sig,
                ptr::null::<libc::siginfo_t>(),
                flags,
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(ProcessError::os(self.pid, what, io::Error::last_os_error()))
        }
    }

    /// Waits up to `timeout` for the process to exit (the pidfd polls readable once it is a
    /// zombie or reaped); true if it exited in time. Retries on EINTR with the time left.
    pub fn wait_exit(&self, timeout: Duration) -> Result<bool, ProcessError> {
        let start = Instant::now();
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            let mut fds = [PollFd::new(&self.fd, PollFlags::IN)];
            match poll(&mut fds, poll_millis(left)) {
                Ok(0) if left.is_zero() => return Ok(false),
                // Woken before the deadline (or the timeout was clamped): poll again.
                Ok(0) | Err(Errno::INTR) => continue,
                Ok(_) if fds[0].revents().intersects(PollFlags::IN | PollFlags::HUP) => {
                    return Ok(true);
                }
                Ok(_) => {
                    return Err(ProcessError::Io {
                        pid: self.pid,
                        what: "poll(pidfd)",
                        source: io::Error::other(format!(
                            "unexpected poll events {:?}",
                            fds[0].revents()
                        )),
                    });
                }
                Err(errno) => return Err(ProcessError::os(self.pid, "poll(pidfd)", errno.into())),
            }
        }
    }

    /// Borrows the fd, so an async runtime can watch it for readability (= exit).
    pub fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// `waitid(P_PIDFD, fd, WEXITED | WNOHANG)`: reaps the process if it has exited.
    ///
    /// Only meaningful for our own child: for any other process (or one already reaped) the
    /// kernel answers ECHILD, returned as an error. `Ok(None)` means it has not exited yet.
    pub fn try_reap(&self) -> Result<Option<ExitStatus>, ProcessError> {
        let status = waitid(
            WaitId::PidFd(self.fd.as_fd()),
            WaitidOptions::EXITED | WaitidOptions::NOHANG,
        )
        .map_err(|errno| ProcessError::os(self.pid, "waitid(P_PIDFD)", errno.into()))?;
        let Some(status) = status else {
            return Ok(None);
        };
        if let (true, Some(code)) = (status.exited(), status.exit_status()) {
            return Ok(Some(ExitStatus::Code(code as i32)));
        }
        if let Some(sig) = status.terminating_signal() {
            return Ok(Some(ExitStatus::Signal(sig as i32)));
        }
        Err(ProcessError::Io {
            pid: self.pid,
            what: "waitid(P_PIDFD)",
            source: io::Error::other("waitid reported neither an exit code nor a signal"),
        })
    }
}

impl AsFd for PidFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// For runtimes that register raw fds (e.g. tokio's `AsyncFd`).
impl AsRawFd for PidFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// `PIDFS_MAGIC` (include/uapi/linux/magic.h), the `f_type` of a pidfd's file system.
const PIDFS_MAGIC: i64 = 0x5049_4446;

/// Whether this kernel's pidfds are inodes of pidfs, each process its own (Linux 6.9), with
/// 64-bit inode numbers. Asked of the first pidfd seen; a failed answer is not kept.
fn pidfds_are_pidfs(fd: BorrowedFd<'_>) -> bool {
    static ANSWER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if let Some(&yes) = ANSWER.get() {
        return yes;
    }
    let Ok(fs) = rustix::fs::fstatfs(fd) else {
        return false;
    };
    // On 32-bit the kernel splits the number into an inode and a generation: not unique alone.
    // `f_type` is an i64 on x86_64, narrower on some targets.
    #[allow(clippy::unnecessary_cast)]
    let yes = fs.f_type as i64 == PIDFS_MAGIC && std::mem::size_of::<libc::ino_t>() == 8;
    *ANSWER.get_or_init(|| yes)
}

/// Whether the process `pidfd` refers to is the one `expected` names by its pidfs inode:
/// `None` when that decides nothing (no inode recorded, or pidfds carry none here), else the
/// verdict — `Some(Ok(false))` is a different process that was given the pid.
fn same_pidfs_inode(pidfd: &PidFd, expected: &Fingerprint) -> Option<Result<bool, ProcessError>> {
    let want = expected.pidfs_ino?;
    match pidfd.pidfs_ino() {
        Ok(Some(ino)) => Some(Ok(ino == want)),
        Ok(None) => None,
        Err(e) => Some(Err(e)),
    }
}

/// [`liveness`](super::liveness)'s check of a pidfs inode, for a pid whose start time matched:
/// `None` when it changes nothing, else the verdict it forces.
pub(crate) fn pidfs_verdict(pid: Pid, expected: &Fingerprint) -> Option<Liveness> {
    expected.pidfs_ino?;
    let pidfd = match PidFd::open(pid) {
        Ok(pidfd) => pidfd,
        Err(ProcessError::NoSuchProcess { .. }) => {
            return Some(Liveness::Dead(DeadReason::NoSuchProcess));
        }
        Err(err) => return Some(Liveness::Unknown(err.to_string())),
    };
    match same_pidfs_inode(&pidfd, expected)? {
        Ok(true) => None,
        Ok(false) => Some(Liveness::Dead(DeadReason::Recycled)),
        Err(err) => Some(Liveness::Unknown(err.to_string())),
    }
}

/// poll(2) takes milliseconds as an i32: round up (so a sub-millisecond rest still sleeps rather
/// than spinning) and clamp (the caller loops until the real deadline).
fn poll_millis(left: Duration) -> i32 {
    let micros = left.as_micros();
    i32::try_from(micros.div_ceil(1000)).unwrap_or(i32::MAX)
}

/// The result of [`open_verified`].
#[derive(Debug)]
pub enum Verified {
    /// The pidfd refers to the fingerprinted process: safe to signal through it.
    Ours(PidFd),
    /// Not provably the fingerprinted process; carries the verdict (Dead(..) or Unknown(..)).
    /// Never signal it.
    NotOurs(Liveness),
}

/// Opening a pidfd and re-verifying the fingerprint AFTER the fd is open closes the race where
/// the pid is recycled between check and kill.
///
/// Why the order proves identity: the fingerprinted process held `pid` continuously from its
/// start until the moment we read a matching start time, and the fd was opened inside that span,
/// so the fd refers to it. Checking first and opening second would leave a window for the pid to
/// be reaped and handed to a stranger.
///
/// A zombie is `NotOurs(Dead(Zombie))`, except a zombie group leader whose group still has live
/// members: those are the worker's own descendants, reachable safely through this fd with
/// [`PidFd::signal_group`], so it is `Ours`.
pub fn open_verified(pid: Pid, expected: &Fingerprint) -> Result<Verified, ProcessError> {
    Ok(match open_checked(pid, expected)? {
        Checked::Ours { pidfd, .. } => Verified::Ours(pidfd),
        Checked::NotOurs(verdict) => Verified::NotOurs(verdict),
    })
}

/// [`open_verified`] that also returns the stat read for the verification, so callers can act
/// on its fields (pgrp) without a second read that might see a recycled pid.
pub(crate) enum Checked {
    Ours { pidfd: PidFd, stat: ProcStat },
    NotOurs(Liveness),
}

pub(crate) fn open_checked(pid: Pid, expected: &Fingerprint) -> Result<Checked, ProcessError> {
    // Another boot: the pid belongs to someone of this boot; do not even open it.
    if let Some(verdict) = check_boot(expected) {
        return Ok(Checked::NotOurs(verdict));
    }
    let pidfd = match PidFd::open(pid) {
        Ok(pidfd) => pidfd,
        Err(ProcessError::NoSuchProcess { .. }) => {
            return Ok(Checked::NotOurs(Liveness::Dead(DeadReason::NoSuchProcess)));
        }
        Err(err) => return Err(err),
    };
    // With a pidfs inode on record the fd alone says whose it is: a process given the pid in
    // the worker's own clock tick has the same start time and another inode.
    match same_pidfs_inode(&pidfd, expected) {
        None | Some(Ok(true)) => {}
        Some(Ok(false)) => return Ok(Checked::NotOurs(Liveness::Dead(DeadReason::Recycled))),
        Some(Err(err)) => return Ok(Checked::NotOurs(Liveness::Unknown(err.to_string()))),
    }
    // The fingerprint is read only now, with the fd open (see open_verified).
    let stat = match read_stat(pid) {
        Ok(stat) => stat,
        Err(ProcessError::NoSuchProcess { .. }) => {
            return Ok(Checked::NotOurs(Liveness::Dead(DeadReason::NoSuchProcess)));
        }
        Err(err) => return Ok(Checked::NotOurs(Liveness::Unknown(err.to_string()))),
    };
    match verdict(&stat, expected) {
        Liveness::Alive => Ok(Checked::Ours { pidfd, stat }),
        // While the leader is an unreaped zombie its pid cannot be reused, so the live members
        // group_alive finds are its group's.
        Liveness::Dead(DeadReason::Zombie) if stat.pgrp == pid && group_alive(pid) => {
            Ok(Checked::Ours { pidfd, stat })
        }
        other => Ok(Checked::NotOurs(other)),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::process::fingerprint;
    use crate::process::testutil::{spawn_leader, wait_until};

    #[test]
    fn open_missing_pid_is_no_such_process() {
        assert!(PidFd::open(1 << 23).unwrap_err().is_no_such_process());
        assert!(!PidFd::open(0).unwrap_err().is_no_such_process());
        assert!(!PidFd::open(-1).unwrap_err().is_no_such_process());
    }

    #[test]
    fn a_pid_that_names_no_process_is_no_such_process() {
        // A reaped leader whose group lives on: the number is still the group's id.
        let (pidfd, _guard) = spawn_leader("sleep 30 & exit 0");
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert_eq!(pidfd.try_reap().unwrap(), Some(ExitStatus::Code(0)));
        assert!(pidfd.group_exists().unwrap(), "the sleep keeps the group");
        let err = PidFd::open(pidfd.pid()).unwrap_err();
        assert!(err.is_no_such_process(), "{err:?}");

        // A thread's id (not a thread-group leader).
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        let err = PidFd::open(tid).unwrap_err();
        assert!(err.is_no_such_process(), "thread {tid}: {err:?}");
        drop(stop_tx);
        t.join().unwrap();
    }

    #[test]
    fn wait_exit_signal_and_reap() {
        let (pidfd, _guard) = spawn_leader("exec sleep 30");
        assert_eq!(pidfd.try_reap().unwrap(), None);
        assert!(!pidfd.wait_exit(Duration::from_millis(30)).unwrap());
        pidfd.signal(Signal::SIGKILL).unwrap();
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert_eq!(
            pidfd.try_reap().unwrap(),
            Some(ExitStatus::Signal(libc::SIGKILL))
        );
        // Reaped: the group is empty, a second reap has no child to reap.
        assert!(
            pidfd
                .signal_group(Signal::SIGTERM)
                .unwrap_err()
                .is_no_such_process()
        );
        assert!(!pidfd.group_exists().unwrap());
        assert!(pidfd.try_reap().is_err());
    }

    #[test]
    fn signal_group_at_once_signals_or_says_it_did_not() {
        let (pidfd, _guard) = spawn_leader("exec sleep 30");
        // (The same syscall as signal_group, whose reach over a whole group is tested there.)
        assert!(
            pidfd.signal_group_at_once(Signal::SIGTERM),
            "this kernel has the flag"
        );
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert_eq!(
            pidfd.try_reap().unwrap(),
            Some(ExitStatus::Signal(libc::SIGTERM))
        );
        // Nobody left to signal: false, not an error.
        assert!(!pidfd.signal_group_at_once(Signal::SIGTERM));
    }

    #[test]
    fn reap_reports_exit_code() {
        let (pidfd, _guard) = spawn_leader("exit 3");
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert_eq!(pidfd.try_reap().unwrap(), Some(ExitStatus::Code(3)));
    }

    #[test]
    fn open_verified_verdicts() {
        let (pidfd, _guard) = spawn_leader("exec sleep 30");
        let pid = pidfd.pid();
        let fp = fingerprint(pid).unwrap();
        assert!(matches!(open_verified(pid, &fp), Ok(Verified::Ours(fd)) if fd.pid() == pid));

        let recycled = Fingerprint {
            start_ticks: fp.start_ticks + 1,
            ..fp.clone()
        };
        assert!(matches!(
            open_verified(pid, &recycled),
            Ok(Verified::NotOurs(Liveness::Dead(DeadReason::Recycled)))
        ));
        let other_boot = Fingerprint {
            boot_id: "other".into(),
            ..fp.clone()
        };
        assert!(matches!(
            open_verified(pid, &other_boot),
            Ok(Verified::NotOurs(Liveness::Dead(DeadReason::OtherBoot)))
        ));
        assert!(matches!(
            open_verified(1 << 23, &fp),
            Ok(Verified::NotOurs(Liveness::Dead(DeadReason::NoSuchProcess)))
        ));

        // An exited leader with nothing left in its group is a plain zombie: not ours to signal.
        pidfd.signal(Signal::SIGKILL).unwrap();
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert!(matches!(
            open_verified(pid, &fp),
            Ok(Verified::NotOurs(Liveness::Dead(DeadReason::Zombie)))
        ));
    }

    #[test]
    fn zombie_leader_with_live_members_is_still_ours() {
        let (pidfd, _guard) = spawn_leader("sleep 30 & exit 0");
        let pid = pidfd.pid();
        let fp = fingerprint(pid).unwrap();
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert!(wait_until(Duration::from_secs(10), || group_alive(pid)));
        assert!(matches!(open_verified(pid, &fp), Ok(Verified::Ours(_))));
        // The group is reachable through the zombie leader's pidfd.
        pidfd.signal_group(Signal::SIGKILL).unwrap();
        assert!(wait_until(Duration::from_secs(10), || !group_alive(pid)));
        assert!(matches!(
            open_verified(pid, &fp),
            Ok(Verified::NotOurs(Liveness::Dead(DeadReason::Zombie)))
        ));
    }

    /// A leader that exited alone (`pthread_exit` in main) while another of its threads runs
    /// shows `Z` in `/proc`: alive, ours, its group alive — and signalled through its pidfd.
    #[test]
    fn a_leader_whose_other_threads_run_is_alive_and_ours() {
        let left = crate::process::testutil::ThreadsLeft::start();
        let pid = left.0;
        let fp = fingerprint(pid).unwrap();
        let stat = crate::process::read_stat(pid).unwrap();
        assert_eq!((stat.state, stat.threads), ('Z', 2));
        assert_eq!(crate::process::liveness(pid, &fp), Liveness::Alive);
        assert!(group_alive(pid));
        let Ok(Verified::Ours(pidfd)) = open_verified(pid, &fp) else {
            panic!("not ours: {:?}", open_verified(pid, &fp).map(|_| ()));
        };
        pidfd.signal_group(Signal::SIGKILL).unwrap();
        assert!(wait_until(Duration::from_secs(10), || {
            crate::process::read_stat(pid).is_ok_and(|s| s.is_zombie())
        }));
    }

    #[test]
    fn poll_millis_rounds_up_and_clamps() {
        assert_eq!(poll_millis(Duration::ZERO), 0);
        assert_eq!(poll_millis(Duration::from_micros(1)), 1);
        assert_eq!(poll_millis(Duration::from_millis(15)), 15);
        assert_eq!(poll_millis(Duration::from_secs(u64::MAX)), i32::MAX);
    }

    #[test]
    fn group_kill_guard_is_harmless_after_exit() {
        let (pidfd, guard) = spawn_leader("exit 0");
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        drop(guard);
    }
}
