//! The exit status of a process that is not our child: a worker adopted from a previous
//! incarnation, whose parent is now init (or a subreaper) — the one that reaps it and is told
//! its status by `waitid`. The kernel still tells it to others, while it lasts:
//!
//! - once the process has been reaped, to whoever holds a pidfd of it: `PIDFD_GET_INFO` with
//!   `PIDFD_INFO_EXIT` (Linux 6.15);
//! - while it is a zombie (its parent reaps late, or never — some container inits), in
//!   `/proc/<pid>/stat`'s `exit_code` (field 52). The kernel shows 0 there to a reader without
//!   ptrace-read access to the process, which would pass for a clean exit, so it is believed
//!   only when that access is certain: `CAP_SYS_PTRACE`, or the zombie's user and group ids
//!   (real, effective, saved) all ours. And only while the pid still names the fingerprinted
//!   process (a zombie's pid cannot be handed out again until it is reaped).
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
    // The ids first, the stat second: a stat that still shows our zombie proves the pid named
    // it all along (it held the pid from its start and cannot give it up before its reap), so
    // the ids were its own too.
    let ids = read_ids(pid);
    let stat = match read_stat(pid) {
        Ok(stat) => stat,
        Err(ProcessError::NoSuchProcess { .. }) => return Zombie::Gone,
        Err(_) => return Zombie::Untold,
    };
    if stat.start_ticks != fp.start_ticks {
        return Zombie::Gone;
    }
    if !stat.is_zombie() {
        return Zombie::Untold;
    }
    let (Some(code), Some(ids)) = (stat.exit_code, ids) else {
        return Zombie::Untold;
    };
    if !(may_trace_any() || ids.all_are(ours())) {
        return Zombie::Untold;
    }
    match decode(code) {
        Some(status) => Zombie::Status(status),
        None => Zombie::Untold,
    }
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

/// Real, effective and saved user and group ids (the `Uid:` and `Gid:` lines of
/// `/proc/<pid>/status`).
struct Ids {
    uids: [u32; 3],
    gids: [u32; 3],
}

impl Ids {
    fn all_are(&self, (uid, gid): (u32, u32)) -> bool {
        self.uids.iter().all(|&u| u == uid) && self.gids.iter().all(|&g| g == gid)
    }
}

fn read_ids(pid: Pid) -> Option<Ids> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let three = |key: &str| -> Option<[u32; 3]> {
        let line = text.lines().find_map(|l| l.strip_prefix(key))?;
        let mut ids = line.split_ascii_whitespace().map(|f| f.parse().ok());
        Some([ids.next()??, ids.next()??, ids.next()??])
    };
    Some(Ids {
        uids: three("Uid:")?,
        gids: three("Gid:")?,
    })
}

/// The ids the kernel compares a zombie's with for a ptrace-read check of ours (the
/// filesystem ids, which follow the effective ones: runwarden never sets them apart).
fn ours() -> (u32, u32) {
    // SAFETY: getters without arguments; they cannot fail.
    unsafe { (libc::geteuid(), libc::getegid()) }
}

/// Whether we hold `CAP_SYS_PTRACE` (bit 19 of `CapEff` in `/proc/self/status`).
fn may_trace_any() -> bool {
    const CAP_SYS_PTRACE: u32 = 19;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|text| {
            let hex = text.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_PTRACE) != 0)
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
    /// grandchild's pid and the parent.
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

    #[test]
    fn a_zombie_strangers_exit_is_read_from_proc() {
        for (script, expected) in SCRIPTS {
            let (pid, mut parent) = stranger(script, "read x; wait");
            let pidfd = PidFd::open(pid).expect("pidfd of the grandchild");
            let fp = fingerprint(pid).expect("its fingerprint");
            assert!(
                pidfd.wait_exit(Duration::from_secs(10)).unwrap(),
                "it exits"
            );
            assert!(
                read_stat(pid).unwrap().is_zombie(),
                "{script}: left a zombie"
            );
            assert_eq!(of_exited_stranger(&pidfd, &fp), Some(expected), "{script}");
            assert_eq!(of_zombie(pid, &fp), Some(expected), "{script}");
            drop(parent.stdin.take());
            parent.wait().unwrap();
        }
    }

    /// Needs Linux 6.15 (`PIDFD_INFO_EXIT`); fails on an older kernel rather than pass unseen.
    #[test]
    fn a_reaped_strangers_exit_is_told_through_its_pidfd() {
        for (script, expected) in SCRIPTS {
            let (pid, mut parent) = stranger(script, "wait");
            let pidfd = PidFd::open(pid).expect("pidfd of the grandchild");
            let fp = fingerprint(pid).expect("its fingerprint");
            assert!(
                pidfd.wait_exit(Duration::from_secs(10)).unwrap(),
                "it exits"
            );
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

    #[test]
    fn another_process_on_the_pid_is_never_read() {
        let (pid, mut parent) = stranger("exit 3", "read x; wait");
        let fp = fingerprint(pid).expect("its fingerprint");
        assert!(
            poll(|| read_stat(pid).is_ok_and(|s| s.is_zombie()).then_some(())).is_some(),
            "never a zombie"
        );
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
