//! The exit status of a process that is not our child: a worker adopted from a previous
//! incarnation, whose parent is now init (or a subreaper) — the one that reaps it and is told
//! its status by `waitid`. The kernel still tells it to others, while it lasts:
//!
//! - once the process has been reaped, to whoever holds a pidfd of it: `PIDFD_GET_INFO` with
//!   `PIDFD_INFO_EXIT` (Linux 6.15);
//! - while it is a zombie (its parent reaps late, or never — some container inits), in
//!   `/proc/<pid>/stat`'s `exit_code` (field 52). The kernel shows 0 there to a reader that
//!   fails its ptrace-read check of the process (ids, capabilities in the target's namespace,
//!   security modules), which would pass for a clean exit, so it is believed only when the
//!   kernel has said yes to that very check (see `may_read_exit`). And only while the pid
//!   still names the fingerprinted process (a zombie's pid cannot be handed out again until it
//!   is reaped), and the process has exited whole (a leader that exits alone, its other
//!   threads running on, shows `Z` with a code of 0: it is alive). Before Linux 6.15 the field
//!   could keep such a main thread's own 0 after another thread crashed the process, so it is
//!   not read there.
//!
//! Anything else is "unknown", never a guess.

use std::os::fd::AsRawFd;

use super::{ExitStatus, Fingerprint, Pid, PidFd, ProcessError, read_stat};

/// The exit status of `pidfd`'s process — exited, not our child — fingerprinted `fp`, if the
/// kernel still tells it (see the module doc). Reads `/proc`: not for the actor thread.
pub fn of_exited_stranger(pidfd: &PidFd, fp: &Fingerprint) -> Option<ExitStatus> {
    // Reaped between the two looks, the kernel has kept its record for the second.
    for _ in 0..2 {
        if let Some(status) = from_pidfd_info(pidfd) {
            return Some(status);
        }
        match from_zombie(pidfd.pid(), fp) {
            Zombie::Status(status) => return Some(status),
            Zombie::Untold => return None,
            Zombie::Gone => {}
        }
    }
    None
}

/// The exit status of the zombie `pid`, fingerprinted `fp`, if it is one and we may read it
/// (see the module doc). For a process found dead with no pidfd of ours held on it.
pub fn of_zombie(pid: Pid, fp: &Fingerprint) -> Option<ExitStatus> {
    match from_zombie(pid, fp) {
        Zombie::Status(status) => Some(status),
        Zombie::Untold | Zombie::Gone => None,
    }
}

enum Zombie {
    Status(ExitStatus),
    /// No longer there (reaped; maybe the pid holds another process now).
    Gone,
    /// There, but its status cannot be read with certainty.
    Untold,
}

fn from_pidfd_info(pidfd: &PidFd) -> Option<ExitStatus> {
    // SAFETY: pidfd_info is plain integers; all zeroes is a valid value (an empty mask).
    let mut info: libc::pidfd_info = unsafe { std::mem::zeroed() };
    info.mask = u64::from(libc::PIDFD_INFO_EXIT);
    // SAFETY: PIDFD_GET_INFO reads and writes one pidfd_info of the size its number encodes,
    // which is the size of `info`. Older kernels answer ENOTTY or EINVAL: nothing to learn.
    let rc = unsafe { libc::ioctl(pidfd.as_raw_fd(), libc::PIDFD_GET_INFO, &mut info) };
    if rc != 0 || info.mask & u64::from(libc::PIDFD_INFO_EXIT) == 0 {
        return None;
    }
    decode(info.exit_code)
}

fn from_zombie(pid: Pid, fp: &Fingerprint) -> Zombie {
    // The access check first, the stat second: a stat that still shows our zombie proves the
    // pid named it all along (it held the pid from its start and cannot give it up before its
    // reap), so the check was about it too.
    let readable = may_read_exit(pid);
    let stat = match read_stat(pid) {
        Ok(stat) => stat,
        Err(ProcessError::NoSuchProcess { .. }) => return Zombie::Gone,
        Err(_) => return Zombie::Untold,
    };
    if stat.start_ticks != fp.start_ticks {
        return Zombie::Gone;
    }
    // The same start time may be another process's, given the pid within the same clock tick:
    // the pidfs inode, when recorded, says (the pid names our process now, so it did at the
    // stat read: a zombie holds its pid until it is reaped).
    match super::pidfd::pidfs_verdict(pid, fp) {
        None => {}
        Some(super::Liveness::Unknown(_)) => return Zombie::Untold,
        Some(_) => return Zombie::Gone,
    }
    if !stat.is_zombie() || !readable || !field_52_is_the_process_status() {
        return Zombie::Untold;
    }
    match stat.exit_code.and_then(decode) {
        Some(status) => Zombie::Status(status),
        None => Zombie::Untold,
    }
}

/// Whether the kernel shows us the exited `pid`'s real exit code. It does to a reader that
/// passes its ptrace-read check of the process (`PTRACE_MODE_READ_FSCREDS`), and shows 0 to
/// anyone else. The same check guards the `/proc/<pid>/cwd` link, and a process that has
/// exited has no working directory left: its link gives ENOENT past the check and EACCES at
/// it. So ENOENT is a yes; anything else — EACCES, a directory (not exited), another error —
/// a no. Asking the kernel, rather than guessing from ids and capabilities, also covers
/// security modules' ptrace rules and capabilities held in another user namespace.
fn may_read_exit(pid: Pid) -> bool {
    match std::fs::read_link(format!("/proc/{pid}/cwd")) {
        Err(e) => e.raw_os_error() == Some(libc::ENOENT),
        Ok(_) => false,
    }
}

/// Whether a zombie's field 52 is its process's status. It is the main thread's own exit
/// code, and until Linux 6.15 a main thread that exited before the rest of its process kept
/// its own (0, from `pthread_exit`) there when another thread ended the process with a crash,
/// a signal or a code — a crash that would read as a clean exit. Older kernels (some stable
/// branches have the fix, which cannot be told from here) are not asked.
fn field_52_is_the_process_status() -> bool {
    static FIXED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FIXED.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .and_then(|r| kernel_version(&r))
            .is_some_and(|v| v >= (6, 15))
    })
}

/// `(major, minor)` of a kernel release string such as `6.18.2-arch1`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.trim().split(['.', '-', '+']);
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// `waitpid`'s status word: an exit code or a terminating signal.
fn decode(status: i32) -> Option<ExitStatus> {
    if libc::WIFEXITED(status) {
        Some(ExitStatus::Code(libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(ExitStatus::Signal(libc::WTERMSIG(status)))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use std::io::BufRead;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::process::fingerprint;

    /// Starts `script` in a grandchild of ours (so not our child) under a parent `sh` that then
    /// runs `then`: `read x; wait` leaves the grandchild a zombie until the parent's stdin is
    /// closed (`sh` reaps nobody while it reads), `wait` reaps it at once. Returns the
    /// grandchild's pid and the parent. `script` must outlive the parent's way into `read`
    /// (it sleeps first): `sh` collects a finished background job between commands.
    fn stranger(script: &str, then: &str) -> (Pid, Child) {
        let mut parent = Command::new("sh")
            .arg("-c")
            .arg(format!("sh -c '{script}' & echo $!; {then}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sh");
        let mut line = String::new();
        std::io::BufReader::new(parent.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        (line.trim().parse().expect("a pid"), parent)
    }

    /// [`stranger`] once it has exited: its pid, a pidfd and fingerprint taken while it ran,
    /// and the parent.
    fn exited_stranger(script: &str, then: &str) -> (Pid, PidFd, Fingerprint, Child) {
        let (pid, parent) = stranger(script, then);
        let pidfd = PidFd::open(pid).expect("pidfd of the grandchild");
        let fp = fingerprint(pid).expect("its fingerprint");
        assert!(
            pidfd.wait_exit(Duration::from_secs(10)).unwrap(),
            "{script}: it exits"
        );
        (pid, pidfd, fp, parent)
    }

    /// [`stranger`] under a parent that leaves it a zombie, once it is one.
    fn zombie_stranger(script: &str) -> (Pid, Fingerprint, Child) {
        let (pid, parent) = stranger(script, "read x; wait");
        let fp = fingerprint(pid).expect("its fingerprint");
        assert!(
            poll(|| read_stat(pid).is_ok_and(|s| s.is_zombie()).then_some(())).is_some(),
            "{script}: never a zombie"
        );
        (pid, fp, parent)
    }

    /// Polls `f` every 5 ms until it returns `Some`, for at most 10 s.
    fn poll<T>(mut f: impl FnMut() -> Option<T>) -> Option<T> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = f() {
                return Some(v);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    const SCRIPTS: [(&str, ExitStatus); 3] = [
        ("sleep 0.2; exit 7", ExitStatus::Code(7)),
        ("sleep 0.2; exit 0", ExitStatus::Code(0)),
        ("sleep 0.2; kill -9 $$", ExitStatus::Signal(libc::SIGKILL)),
    ];

    #[test]
    fn kernel_versions_are_read_from_their_release() {
        assert_eq!(kernel_version("6.18.0\n"), Some((6, 18)));
        assert_eq!(kernel_version("6.15-rc1"), Some((6, 15)));
        assert_eq!(kernel_version("5.10.0-28-amd64"), Some((5, 10)));
        assert_eq!(kernel_version("6"), None);
        assert_eq!(kernel_version("x.y"), None);
        assert!((6, 14) < (6, 15) && (7, 0) > (6, 15));
    }

    #[test]
    fn decodes_codes_and_signals() {
        assert_eq!(decode(7 << 8), Some(ExitStatus::Code(7)));
        assert_eq!(decode(0), Some(ExitStatus::Code(0)));
        assert_eq!(
            decode(libc::SIGKILL),
            Some(ExitStatus::Signal(libc::SIGKILL))
        );
        // A core dump's flag does not hide the signal.
        assert_eq!(
            decode(libc::SIGSEGV | 0x80),
            Some(ExitStatus::Signal(libc::SIGSEGV))
        );
    }

    /// Needs Linux 6.15 (field 52 is not read before it); fails on an older kernel rather than
    /// pass unseen.
    #[test]
    fn a_zombie_strangers_exit_is_read_from_proc() {
        for (script, expected) in SCRIPTS {
            let (pid, pidfd, fp, mut parent) = exited_stranger(script, "read x; wait");
            assert!(
                read_stat(pid).unwrap().is_zombie(),
                "{script}: left a zombie"
            );
            assert_eq!(
                of_exited_stranger(&pidfd, &fp),
                Some(expected),
                "{script} (needs Linux 6.15)"
            );
            assert_eq!(of_zombie(pid, &fp), Some(expected), "{script}");
            drop(parent.stdin.take());
            parent.wait().unwrap();
        }
    }

    /// Needs Linux 6.15 (`PIDFD_INFO_EXIT`); fails on an older kernel rather than pass unseen.
    #[test]
    fn a_reaped_strangers_exit_is_told_through_its_pidfd() {
        for (script, expected) in SCRIPTS {
            let (pid, pidfd, fp, mut parent) = exited_stranger(script, "wait");
            // Its parent's `wait` reaps it: from then on only the pidfd tells, never the pid.
            let gone = poll(|| {
                (!matches!(read_stat(pid), Ok(s) if s.start_ticks == fp.start_ticks)).then_some(())
            });
            assert!(gone.is_some(), "{script}: never reaped by its parent");
            assert_eq!(of_zombie(pid, &fp), None, "{script}");
            assert_eq!(
                of_exited_stranger(&pidfd, &fp),
                Some(expected),
                "{script} (PIDFD_INFO_EXIT needs Linux 6.15)"
            );
            parent.wait().unwrap();
        }
    }

    /// A leader that exited alone shows `Z` with a code of 0 while its other threads run on:
    /// no exit to tell.
    #[test]
    fn a_leader_whose_other_threads_run_has_no_exit_status() {
        let left = crate::process::testutil::ThreadsLeft::start();
        let fp = fingerprint(left.0).expect("its fingerprint");
        let stat = read_stat(left.0).unwrap();
        assert_eq!((stat.state, stat.exit_code), ('Z', Some(0)));
        assert_eq!(of_zombie(left.0, &fp), None);
        let pidfd = PidFd::open(left.0).unwrap();
        assert_eq!(of_exited_stranger(&pidfd, &fp), None);
    }

    /// A reader the kernel does not let see a zombie's exit code is shown 0 — a clean exit to
    /// look at — and must not believe it. Needs root (to drop to another user), as CI has.
    #[test]
    fn a_reader_without_access_is_never_told_a_clean_exit() {
        let (pid, fp, mut parent) = zombie_stranger("sleep 0.2; exit 7");
        assert_eq!(of_zombie(pid, &fp), Some(ExitStatus::Code(7)), "as root");
        // A reader that runs as nobody, in a child of ours.
        // SAFETY: the child makes system calls, reads /proc and exits with _exit; it never
        // returns into the test harness.
        let reader = unsafe { libc::fork() };
        assert!(reader >= 0, "fork");
        if reader == 0 {
            let code = unsafe {
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(65534) != 0
                    || libc::setuid(65534) != 0
                {
                    2 // not root: the test cannot run its scenario
                } else if read_stat(pid).ok().map(|s| s.exit_code) != Some(Some(0)) {
                    3 // the kernel showed the code: nothing to test
                } else if of_zombie(pid, &fp).is_some() {
                    1
                } else {
                    0
                }
            };
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        assert_eq!(unsafe { libc::waitpid(reader, &mut status, 0) }, reader);
        drop(parent.stdin.take());
        parent.wait().unwrap();
        assert!(libc::WIFEXITED(status), "reader status {status:#x}");
        match libc::WEXITSTATUS(status) {
            0 => {}
            1 => panic!("a reader without access believed the 0 it was shown"),
            2 => panic!("cannot drop to uid 65534: this test needs root"),
            3 => panic!("the kernel showed the exit code to uid 65534: no denied read to test"),
            other => panic!("reader exited {other}"),
        }
    }

    #[test]
    fn another_process_on_the_pid_is_never_read() {
        let (pid, fp, mut parent) = zombie_stranger("sleep 0.2; exit 3");
        let other = Fingerprint {
            start_ticks: fp.start_ticks + 1,
            ..fp.clone()
        };
        assert_eq!(of_zombie(pid, &other), None);
        assert_eq!(of_zombie(pid, &fp), Some(ExitStatus::Code(3)));
        drop(parent.stdin.take());
        parent.wait().unwrap();
    }
}
