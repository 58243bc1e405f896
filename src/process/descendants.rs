//! Finding a run's descendants that escaped its process group (`setsid`, double fork).
//!
//! Every worker is started with `RUNWARDEN_RUN_TOKEN=<token>` in its environment, a random
//! secret per run, and children inherit their parent's environment. A process that carries the
//! token therefore descends from that run's worker, whatever group or session it moved to. (A
//! process that scrubbed its environment is not found this way; a per-run cgroup would be the
//! stronger tool where one is available.)

use std::fs;
use std::time::{Duration, Instant};

use super::{Fingerprint, Pid, ProcessError, fingerprint};

/// The environment entry every process of a run carries.
fn needle(token: &str) -> Vec<u8> {
    format!("RUNWARDEN_RUN_TOKEN={token}").into_bytes()
}

/// The variable that marks a hook's processes with its supervisor incarnation's hook token
/// (see [`end_hook_carriers`]).
pub const HOOK_TOKEN_VAR: &str = "RUNWARDEN_HOOK_TOKEN";

fn hook_needle(token: &str) -> Vec<u8> {
    format!("{HOOK_TOKEN_VAR}={token}").into_bytes()
}

/// Processes (other than ourselves) whose environment holds `RUNWARDEN_RUN_TOKEN=<token>`,
/// with their fingerprints, so the caller can signal them only through a verified pidfd.
/// Processes that vanish mid-scan are skipped. An `Err` when the scan cannot be complete:
/// /proc cannot be listed, or a live process's identity or environment cannot be read (out of
/// file descriptors, say). "None found" must mean none: callers clear a run's evidence and
/// release its task on it, so an incomplete scan is not read as an empty one.
///
/// The fingerprint is read BEFORE the environment. The caller's `open_verified(pid, &fp)`
/// re-reads it after opening a pidfd, so the token check and the fd are tied to one process:
/// had the pid been recycled at any point after the fingerprint was read (before the
/// environment was read, or after), the start time differs and verification fails. Reading the
/// environment first would let a stranger that took the pid in between verify against its own
/// fingerprint.
pub fn find_by_token(token: &str) -> Result<Vec<(Pid, Fingerprint)>, ProcessError> {
    if token.is_empty() {
        return Ok(Vec::new());
    }
    find_by_needle(&needle(token))
}

/// Whether any process carries the run's token: a scan of `/proc`, and when it finds none,
/// the pids handed out while it ran, one by one (a process forking away from its pid can put
/// its child where the scan had already passed, and exit before its own turn came; see
/// `end_carriers`). Where `ns_last_pid` cannot be read (a kernel without checkpoint/restore)
/// the scan is all there is, as for `end_carriers`. `None` when it cannot be told (an
/// unreadable environment, `/proc` unreadable, the numbering gone round): callers take it as
/// "carried".
pub fn token_carried(token: &str) -> Option<bool> {
    if token.is_empty() {
        return Some(false);
    }
    let needle = needle(token);
    let since = last_pid();
    if !find_by_needle(&needle).ok()?.is_empty() {
        return Some(true);
    }
    match since {
        Some(since) => carrier_among_since(since, &needle, Pid::MAX as usize),
        None => Some(false),
    }
}

/// [`find_by_token`] for any `VAR=value` entry of the environment.
fn find_by_needle(needle: &[u8]) -> Result<Vec<(Pid, Fingerprint)>, ProcessError> {
    let me = std::process::id() as Pid;
    let dir = fs::read_dir("/proc").map_err(|source| ProcessError::System {
        what: "list /proc",
        source,
    })?;
    let (mut found, mut again) = (Vec::new(), Vec::new());
    for entry in dir {
        let entry = entry.map_err(|source| ProcessError::System {
            what: "list /proc",
            source,
        })?;
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<Pid>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        // Identity first, then the environment (see above).
        let fp = match fingerprint(pid) {
            Ok(fp) => fp,
            Err(e) if e.is_no_such_process() || e.is_refused() => continue,
            Err(e) => return Err(e),
        };
        match carries_now(pid, needle) {
            Env::Carries => found.push((pid, fp)),
            Env::Not => {}
            Env::MidExec => again.push((pid, fp)),
            Env::Unreadable => return Err(unreadable_environ(pid)),
        }
    }
    // Those caught mid-exec, read again after one wait for them all, then one by one.
    if !again.is_empty() {
        std::thread::sleep(MID_EXEC);
        for (pid, fp) in again {
            let env = match carries_now(pid, needle) {
                Env::MidExec => settle_mid_exec(pid, needle),
                env => env,
            };
            match env {
                Env::Carries => found.push((pid, fp)),
                Env::Not => {}
                // Not told apart from a carrier: the scan cannot be complete (the caller
                // keeps the run's evidence and looks again later).
                Env::MidExec => {
                    return Err(ProcessError::Io {
                        pid,
                        what: "read /proc/<pid>/environ",
                        source: std::io::Error::other(
                            "still in the middle of an exec: its environment cannot be read yet",
                        ),
                    });
                }
                Env::Unreadable => return Err(unreadable_environ(pid)),
            }
        }
    }
    Ok(found)
}

fn unreadable_environ(pid: Pid) -> ProcessError {
    ProcessError::Io {
        pid,
        what: "read /proc/<pid>/environ",
        source: std::io::Error::other("the environment of a live process cannot be read"),
    }
}

/// What a read of a process's environment told about the token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Env {
    Carries,
    /// Does not carry it (or is gone, or is a kernel thread).
    Not,
    /// Empty, and not laid out yet (`env_end` 0): caught in the middle of an exec (measured:
    /// one read in ten right after a spawn); to be read again. A process whose environment
    /// is empty (`env -i`) is `Not`, not this.
    MidExec,
    /// A live process whose environment cannot be read (out of file descriptors, say).
    Unreadable,
}

/// Whether `pid` (not ourselves) carries the token behind `needle`.
fn carries_now(pid: Pid, needle: &[u8]) -> Env {
    if pid == std::process::id() as Pid {
        return Env::Not;
    }
    let gone = || {
        matches!(
            super::read_stat(pid),
            Err(ProcessError::NoSuchProcess { .. })
        )
    };
    match read_environ(pid) {
        Ok(env) if env.is_empty() => match super::read_stat(pid) {
            // A kernel thread has no environment; a zombie, or a process exiting (its memory
            // maybe freed already, its exit held up by a hung mount for as long as that
            // lasts), has none left and can fork no more; a process gone meanwhile carries
            // nothing. A main thread that exited alone shows `Z` and was read through a live
            // thread (`read_environ`).
            Err(_) => Env::Not,
            Ok(s) if s.is_kernel_thread() || s.is_zombie() || s.is_exiting() => Env::Not,
            // Laid out, and empty (`env -i`)? Read again: an exec that finished between the
            // two reads has an environment now, which is what counts.
            Ok(s) if s.env_end.is_some_and(|end| end != 0) => match read_environ(pid) {
                Ok(env) => holds(&env, needle),
                Err(_) if gone() => Env::Not,
                Err(_) => Env::Unreadable,
            },
            // Caught in the middle of an exec: the new image's environment is not laid out yet.
            Ok(_) => Env::MidExec,
        },
        Ok(env) => holds(&env, needle),
        // Refused for good (another namespace's process, a non-dumpable one): nothing can
        // prove it ours, now or later, so it is not taken for a carrier (the limit the docs
        // name, as for a descendant that clears its environment).
        Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => Env::Not,
        // No memory to read: a kernel thread, or a process already exiting.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Env::Not,
        Err(_) if gone() => Env::Not,
        Err(_) => Env::Unreadable,
    }
}

/// Whether the environment block `env` holds `needle` as one of its entries.
fn holds(env: &[u8], needle: &[u8]) -> Env {
    if env.split(|&b| b == 0).any(|var| var == needle) {
        Env::Carries
    } else {
        Env::Not
    }
}

/// [`carries_now`], a process caught mid-exec read again (see [`settle_mid_exec`]); `None`
/// when it cannot be told.
fn carries(pid: Pid, needle: &[u8]) -> Option<bool> {
    let mut env = carries_now(pid, needle);
    if env == Env::MidExec {
        env = settle_mid_exec(pid, needle);
    }
    match env {
        Env::Carries => Some(true),
        Env::Not => Some(false),
        Env::MidExec | Env::Unreadable => None,
    }
}

/// Reads the environment of `pid`, caught mid-exec, again after waits of 1, 2, 4 … 32 ms
/// (63 ms in all) until the exec has laid it out. One still mid-exec after that (an exec held
/// up loading its binary) stays `MidExec`: whether it carries the token cannot be told yet,
/// and taking it for one that does not would close its run with it still running.
fn settle_mid_exec(pid: Pid, needle: &[u8]) -> Env {
    let mut wait = MID_EXEC;
    for _ in 0..MID_EXEC_READS {
        std::thread::sleep(wait);
        match carries_now(pid, needle) {
            Env::MidExec => wait *= 2,
            env => return env,
        }
    }
    Env::MidExec
}

/// How many times [`settle_mid_exec`] reads a process caught mid-exec again.
const MID_EXEC_READS: u32 = 6;

/// How long an exec is given to lay out its environment before it is read again.
const MID_EXEC: Duration = Duration::from_millis(1);

/// Most pids [`carrier_among_recent`] probes one by one; beyond it a scan of /proc is cheaper.
const RECENT_PROBE_LIMIT: usize = 128;

/// Whether a process carrying `token` exists among the pids handed out after `leader`'s, up
/// to the most recent one — `None` when that cannot be told cheaply (more than
/// `RECENT_PROBE_LIMIT` (128) pids, or ns_last_pid or pid_max unreadable): the caller then scans
/// with [`find_by_token`]. Blocking (reads /proc): off the actor threads.
///
/// For a run whose leader started moments ago: every descendant of it was started after it,
/// and pids are handed out in increasing order, wrapping at `pid_max` to 300 — so its
/// descendants are among these pids unless the numbering has come round past the leader (the
/// caller keeps this to young leaders). Pids of our registered children (other workers) are
/// skipped without a syscall, and most of the rest with one (see `kin`). A carrier may fork
/// while the pids are walked (a double fork, a process that keeps moving to a new pid): the
/// walk goes on over the pids handed out meanwhile until none was.
pub fn carrier_among_recent(leader: Pid, token: &str) -> Option<bool> {
    carrier_among_since(leader, &needle(token), RECENT_PROBE_LIMIT)
}

/// [`carrier_among_recent`] for a needle (a run's token, or a hook token): whether a carrier
/// is among the pids handed out after `leader`, probing at most `limit` of them.
fn carrier_among_since(leader: Pid, needle: &[u8], limit: usize) -> Option<bool> {
    /// Where the numbering restarts after a wrap (the kernel's RESERVED_PIDS).
    const FIRST_AFTER_WRAP: Pid = 300;
    let mut last = last_pid()?;
    // Read when the walk must wrap to reach `last`.
    let mut max: Option<Pid> = None;
    let mut pid = leader;
    let mut probed = 0;
    loop {
        while pid != last {
            pid = if last < pid {
                let max = match max {
                    Some(m) => m,
                    None => *max.insert(pid_max()?),
                };
                if pid + 1 >= max {
                    FIRST_AFTER_WRAP
                } else {
                    pid + 1
                }
            } else {
                pid + 1
            };
            probed += 1;
            if pid == leader || probed > limit {
                return None;
            }
            if super::owned::is_registered(pid) {
                continue;
            }
            match kin(pid) {
                Kin::Gone | Kin::SharesOurMemory => {}
                // Unreadable: nothing told about this pid; the caller scans instead.
                Kin::Other => {
                    if carries(pid, needle)? {
                        return Some(true);
                    }
                }
                Kin::Unknown => match super::PidFd::open(pid) {
                    Ok(_) => {
                        if carries(pid, needle)? {
                            return Some(true);
                        }
                    }
                    Err(super::ProcessError::NoSuchProcess { .. }) => {}
                    // Out of fds, say: nothing told about this pid; the caller scans instead.
                    Err(_) => return None,
                },
            }
        }
        match last_pid()? {
            now if now == last => return Some(false),
            now => last = now,
        }
    }
}

/// Whether nothing can have escaped an exited `leader` (a worker of ours started moments
/// ago): every pid handed out since its own is a child of ours that its owner will reap
/// (another worker, a hook), one being started (see `owned::in_flight`), a thread of ours,
/// or names no process — proven with system calls that never wait on another process
/// (`kill(pid, 0)`, `tgkill(us, pid, 0)`), unlike the reads of [`carrier_among_recent`] (an
/// environment, `kcmp`), which wait for a process in the middle of an exec. `false` is only
/// "not proven": a live process that is not ours (a start through std between its fork and
/// its registration is one), more than `RECENT_PROBE_LIMIT` pids, the numbering wrapped, or
/// ns_last_pid unreadable; the caller then looks the long way. Cheap enough for an actor
/// thread: a few syscalls per pid handed out since the leader's.
///
/// A pid in the walk was handed out after the leader's, so it can name a second process (a
/// descendant) only after the numbering has gone all the way round, which a young leader and
/// the 128-pid bound rule out — also for a pid still registered for the microsecond between
/// its owner's reap and its `unregister`. Not covered, as with the long way: a privileged
/// descendant that places itself at a chosen pid (`clone3` with `set_tid`).
pub fn only_ours_since(leader: Pid) -> bool {
    let me = std::process::id() as Pid;
    let Some(mut last) = last_pid() else {
        return false;
    };
    let mut pid = leader;
    loop {
        if last < leader || last - leader > RECENT_PROBE_LIMIT as Pid {
            return false;
        }
        while pid < last {
            pid += 1;
            // In flight first: a start registers its pid, then frees its slot, so a slot
            // seen free means the registration is visible.
            let ours = super::owned::is_in_flight(pid) || super::owned::is_registered(pid);
            if !(ours || names_nothing(pid) || thread_of(me, pid)) {
                return false;
            }
        }
        // A descendant may have forked (and its parent exited) while we walked: the walk goes
        // on over the pids handed out meanwhile until none was.
        match last_pid() {
            Some(now) if now == last => return true,
            // Moved back (written by a privileged process, as a checkpoint restore does):
            // walked pids may be handed out again.
            Some(now) if now < last => return false,
            Some(now) => last = now,
            None => return false,
        }
    }
}

/// `kill(pid, 0)` says no process (nor thread) has the number.
fn names_nothing(pid: Pid) -> bool {
    // SAFETY: signal 0 checks existence and permission; nothing is sent.
    let r = unsafe { libc::kill(pid, 0) };
    r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// `tid` is a thread of process `me` (signal 0 to it within our thread group).
fn thread_of(me: Pid, tid: Pid) -> bool {
    // SAFETY: signal 0 checks existence; nothing is sent.
    unsafe { libc::syscall(libc::SYS_tgkill, me, tid, 0) == 0 }
}

/// What one syscall tells about a pid, before any /proc read (see [`kin`]).
enum Kin {
    /// No process has it.
    Gone,
    /// It shares our address space: one of our threads, or a child of a spawner thread still
    /// between its fork and its exec (which is then our worker being started — a `vfork`-style
    /// spawn shares the parent's memory until exec — not anybody's descendant).
    SharesOurMemory,
    /// Another process.
    Other,
    /// kcmp(2) is not available (or not allowed): look the long way.
    Unknown,
}

/// kcmp(2) of our address space with `pid`'s: a fraction of a microsecond where a pidfd costs
/// several and a /proc read ten. Most pids [`carrier_among_recent`] meets are gone or are
/// workers still being started (pre-exec, in our address space), and those take no read.
fn kin(pid: Pid) -> Kin {
    /// `KCMP_VM` of `enum kcmp_type` (linux/kcmp.h).
    const KCMP_VM: libc::c_long = 1;
    let me = std::process::id() as libc::c_long;
    // SAFETY: kcmp only compares kernel objects of two tasks; no memory is passed.
    let r = unsafe { libc::syscall(libc::SYS_kcmp, me, pid as libc::c_long, KCMP_VM, 0, 0) };
    match r {
        0 => Kin::SharesOurMemory,
        1..=3 => Kin::Other,
        _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) => Kin::Gone,
        _ => Kin::Unknown,
    }
}

/// The pid most recently handed out in our pid namespace (`/proc/sys/kernel/ns_last_pid`).
/// The file is kept open and read at offset 0 each time (the value is produced afresh by every
/// read): a tenth of an open-read-close on every worker exit.
fn last_pid() -> Option<Pid> {
    use std::os::unix::fs::FileExt;
    static FILE: std::sync::OnceLock<Option<fs::File>> = std::sync::OnceLock::new();
    let file = FILE
        .get_or_init(|| fs::File::open("/proc/sys/kernel/ns_last_pid").ok())
        .as_ref()?;
    let mut buf = [0u8; 16];
    let n = file.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// `/proc/sys/kernel/pid_max` (read when needed: it may be changed while we run).
fn pid_max() -> Option<Pid> {
    fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// `/proc/<pid>/environ`, or why it cannot be read. A process whose main thread has exited
/// alone (`pthread_exit` in main; its other threads run on) shows no environment through its
/// main thread; it is the whole process's, so it is read through a thread that still runs.
fn read_environ(pid: Pid) -> std::io::Result<Vec<u8>> {
    let env = fs::read(format!("/proc/{pid}/environ"));
    if env.as_ref().is_ok_and(|e| !e.is_empty()) {
        return env;
    }
    if !super::read_stat(pid).is_ok_and(|s| s.main_thread_exited_alone()) {
        return env;
    }
    let threads = fs::read_dir(format!("/proc/{pid}/task"))?;
    let through_thread = threads
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<Pid>().ok())
        .filter(|&tid| tid != pid)
        .find_map(|tid| {
            fs::read(format!("/proc/{pid}/task/{tid}/environ"))
                .ok()
                .filter(|e| !e.is_empty())
        });
    through_thread.map_or(env, Ok)
}

/// The value of `name` in the environment of the process behind `fd` (verified by its
/// caller), read while the pidfd pins it; `None` if it has none or it cannot be read.
pub fn environ_var(fd: &super::PidFd, name: &str) -> Option<Vec<u8>> {
    let env = read_environ(fd.pid()).ok()?;
    // Read after the environment: the pid still names the process the pidfd pins.
    if fd.wait_exit(Duration::ZERO).unwrap_or(true) {
        return None;
    }
    let prefix = format!("{name}=");
    env.split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(prefix.as_bytes()))
        .map(<[u8]>::to_vec)
}

/// Signals one straggler: its whole group when it leads one (a `setsid` escapee does), else
/// the process alone. Errors (already gone) are ignored: the goal is that it is gone.
pub fn signal_straggler(fd: &super::PidFd, sig: super::Signal) {
    let pid = fd.pid();
    let leads_group = super::read_stat(pid).is_ok_and(|s| s.pgrp == pid);
    let _ = if leads_group {
        fd.signal_group(sig)
    } else {
        fd.signal(sig)
    };
}

/// A live child of ours that nobody owns (see [`live_orphans`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    /// Its pid.
    pub pid: Pid,
    /// Its fingerprint, read before its environment (see [`find_by_token`]).
    pub fingerprint: Fingerprint,
    /// `RUNWARDEN_RUN_TOKEN` from its environment, if any.
    pub token: Option<String>,
    /// `RUNWARDEN_RUN_ID` from its environment, if any (and a number).
    pub run_id: Option<i64>,
}

/// The run token and run id in an environment block.
fn run_vars(env: &[u8]) -> (Option<String>, Option<i64>) {
    let mut token = None;
    let mut run_id = None;
    for var in env.split(|&b| b == 0) {
        if let Some(t) = var.strip_prefix(b"RUNWARDEN_RUN_TOKEN=") {
            token.get_or_insert_with(|| String::from_utf8_lossy(t).into_owned());
        } else if let Some(id) = var.strip_prefix(b"RUNWARDEN_RUN_ID=")
            && run_id.is_none()
        {
            run_id = std::str::from_utf8(id).ok().and_then(|id| id.parse().ok());
        }
    }
    (token, run_id)
}

/// Live (non-zombie) children of ours that nobody owns: descendants of workers re-parented to
/// us (we are a subreaper) after their parent died. Each with the fingerprint from the stat
/// that found it (read before its environment, so a later `open_verified` against it proves the
/// environment was this process's), and its run token and run id, if it carries them.
/// `children` is one scan of /proc ([`super::own_children`]), shared with the orphan reaper.
pub fn live_orphans(children: &[super::ProcStat]) -> Vec<Orphan> {
    let Ok(boot_id) = super::boot_id() else {
        return Vec::new();
    };
    children
        .iter()
        .filter(|s| !s.is_zombie() && !super::owned::is_registered(s.pid))
        .map(|s| {
            let (token, run_id) = read_environ(s.pid)
                .map(|env| run_vars(&env))
                .unwrap_or_default();
            Orphan {
                pid: s.pid,
                // Found by a scan: no pidfd was held from its start, so no inode is known.
                fingerprint: Fingerprint {
                    boot_id: boot_id.clone(),
                    start_ticks: s.start_ticks,
                    pidfs_ino: None,
                },
                token,
                run_id,
            }
        })
        .collect()
}

/// Ends the orphans (see [`live_orphans`]) that `is_stray(run_id, token)` claims: leftovers of
/// a finished run of the caller's that escaped its worker's group. The caller must answer true
/// only for a run of its own board that carries that very token and is over: an orphan of
/// another supervisor sharing this process, or a worker left running for adoption, carries a
/// token the caller cannot vouch for and must never be signalled. Orphans without a run id or
/// token are left alone. Each is signalled through a pidfd verified against the fingerprint
/// read before its environment (SIGTERM; SIGKILL after `kill_timeout`). Blocking. Returns what
/// was ended, for the caller to record. `children`: as for [`live_orphans`].
pub fn end_stray_orphans(
    children: &[super::ProcStat],
    is_stray: &dyn Fn(i64, &str) -> bool,
    kill_timeout: Duration,
) -> Vec<EndedStray> {
    let mut signalled = Vec::new();
    for orphan in live_orphans(children) {
        let (Some(token), Some(run_id)) = (&orphan.token, orphan.run_id) else {
            continue;
        };
        if !is_stray(run_id, token) {
            continue;
        }
        if let Ok(super::Verified::Ours(fd)) = super::open_verified(orphan.pid, &orphan.fingerprint)
        {
            signal_straggler(&fd, super::Signal::SIGTERM);
            signalled.push((run_id, fd));
        }
    }
    let deadline = super::deadline_after(kill_timeout);
    signalled
        .into_iter()
        .map(|(run_id, fd)| {
            let left = deadline.saturating_duration_since(Instant::now());
            let sigkill = !fd.wait_exit(left).unwrap_or(false);
            if sigkill {
                signal_straggler(&fd, super::Signal::SIGKILL);
            }
            EndedStray {
                run_id,
                pid: fd.pid(),
                sigkill,
            }
        })
        .collect()
}

/// An orphan [`end_stray_orphans`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndedStray {
    /// The finished run whose token it carried.
    pub run_id: i64,
    pub pid: Pid,
    /// True when it outlived SIGTERM by `kill_timeout` and was sent SIGKILL.
    pub sigkill: bool,
}

/// Opens verified pidfds for every process carrying `token` (see [`find_by_token`], whose
/// error it passes on: the scan could not be complete).
pub fn pidfds_by_token(token: &str) -> Result<Vec<super::PidFd>, ProcessError> {
    if token.is_empty() {
        return Ok(Vec::new());
    }
    pidfds_by_needle(&needle(token))
}

fn pidfds_by_needle(needle: &[u8]) -> Result<Vec<super::PidFd>, ProcessError> {
    Ok(find_by_needle(needle)?
        .into_iter()
        .filter_map(|(pid, fp)| match super::open_verified(pid, &fp) {
            Ok(super::Verified::Ours(fd)) => Some(fd),
            _ => None,
        })
        .collect())
}

/// Ends every process carrying `token`: SIGTERM to each verified carrier, once (its whole group
/// when it leads one), a wait of up to `kill_timeout` for each (the deadline is shared), SIGKILL
/// to those still running; then a carrier that appeared meanwhile (forked by one being ended)
/// gets the same, within what is left of the deadline, and a last scan SIGKILLs any newer one. Every signal goes through a pidfd verified against a fingerprint read
/// before the token (see [`find_by_token`]). Blocking. Returns how many carriers were
/// signalled, or an error when one SIGKILLed is still there after `AFTER_SIGKILL` (5 s)
/// (uninterruptible sleep), or when a scan could not be complete: callers keep the run's
/// evidence then, since "ended" must mean gone.
pub fn end_token_carriers(
    token: &str,
    kill_timeout: Duration,
) -> Result<CarriersEnded, super::ProcessError> {
    let deadline = super::deadline_after(kill_timeout);
    let carriers = pidfds_by_token(token)?;
    signal_carriers_once(&carriers, super::Signal::SIGTERM, Signalled::default());
    end_carriers(carriers, &needle(token), deadline, &[])
}

/// What [`end_token_carriers`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CarriersEnded {
    /// How many carriers were signalled.
    pub count: usize,
    /// Whether any of them had to be SIGKILLed (still there at the deadline, or found only by
    /// the scan after it).
    pub sigkill: bool,
}

/// [`end_token_carriers`] for the processes of hooks started by a supervisor incarnation whose
/// hook token was `token` (`RUNWARDEN_HOOK_TOKEN`): what its hooks left running when it was
/// killed, which nothing else records. Blocking.
pub fn end_hook_carriers(token: &str, kill_timeout: Duration) -> Result<usize, ProcessError> {
    if token.is_empty() {
        return Ok(0);
    }
    let needle = hook_needle(token);
    let deadline = super::deadline_after(kill_timeout);
    let carriers = pidfds_by_needle(&needle)?;
    signal_carriers_once(&carriers, super::Signal::SIGTERM, Signalled::default());
    Ok(end_carriers(carriers, &needle, deadline, &[])?.count)
}

/// Sends `sig` to each carrier once: to its whole group when it leads one (its members are
/// then not signalled again on their own), else to it alone. What the caller has just
/// signalled itself is passed over (see [`Signalled`]). A second SIGTERM is not harmless:
/// many programs take it as "stop now, skip the clean-up".
fn signal_carriers_once(carriers: &[super::PidFd], sig: super::Signal, done: Signalled) {
    let groups_of: Vec<Option<Pid>> = carriers
        .iter()
        .map(|fd| super::read_stat(fd.pid()).ok().map(|s| s.pgrp))
        .collect();
    let mut signalled: std::collections::HashSet<Pid> = done.group.into_iter().collect();
    // Leaders first: their groups take their members with them — but not a group the process
    // already signalled is in: its other members get theirs one by one.
    for (fd, group) in carriers.iter().zip(&groups_of) {
        if *group == Some(fd.pid())
            && done.process_group != Some(fd.pid())
            && signalled.insert(fd.pid())
        {
            let _ = fd.signal_group(sig);
        }
    }
    for (fd, group) in carriers.iter().zip(&groups_of) {
        if Some(fd.pid()) != done.process && !group.is_some_and(|g| signalled.contains(&g)) {
            let _ = fd.signal(sig);
        }
    }
}

/// What a caller of [`signal_carriers_once`] has just signalled itself.
#[derive(Debug, Clone, Copy, Default)]
struct Signalled {
    /// A whole group: its members are passed over.
    group: Option<Pid>,
    /// One process, passed over wherever it is now ...
    process: Option<Pid>,
    /// ... and the group it is in now (a carrier's, say), which is then not signalled as a
    /// whole: that would reach it again.
    process_group: Option<Pid>,
}

/// The rest of [`end_token_carriers`] for carriers already sent SIGTERM: waits for them until
/// `deadline`, SIGKILLs those still there, and any carrier that appeared meanwhile. Carriers
/// in `not_mine` are someone else's to end (the caller's signaller): never signalled here,
/// and never taken for new ones while they run.
fn end_carriers(
    carriers: Vec<super::PidFd>,
    needle: &[u8],
    deadline: Instant,
    not_mine: &[super::PidFd],
) -> Result<CarriersEnded, super::ProcessError> {
    let mut killed = Vec::new();
    for fd in &carriers {
        let left = deadline.saturating_duration_since(Instant::now());
        if !fd.wait_exit(left).unwrap_or(false) {
            signal_straggler(fd, super::Signal::SIGKILL);
            killed.push(fd);
        }
    }
    // A carrier may have forked after the first scan (a clean-up child started by its
    // SIGTERM handler, say); its children carry the token too. They get their own SIGTERM and
    // what is left of the deadline, as the first ones had, then SIGKILL. Verification only
    // passes live processes, so everything found here is still running.
    // The same process: the same pid, still held by a carrier that has not exited (one that
    // has, and was reaped, may have passed its pid on to a new carrier).
    let known = |fd: &super::PidFd, among: &[super::PidFd]| {
        among
            .iter()
            .any(|c| c.pid() == fd.pid() && !c.wait_exit(Duration::ZERO).unwrap_or(false))
    };
    let late: Vec<super::PidFd> = pidfds_by_needle(needle)?
        .into_iter()
        .filter(|fd| !known(fd, &carriers) && !known(fd, not_mine))
        .collect();
    signal_carriers_once(&late, super::Signal::SIGTERM, Signalled::default());
    for fd in &late {
        let left = deadline.saturating_duration_since(Instant::now());
        if !fd.wait_exit(left).unwrap_or(false) {
            signal_straggler(fd, super::Signal::SIGKILL);
            killed.push(fd);
        }
    }
    // Whatever carries the token still (forked in the meantime) has had its time: SIGKILL,
    // and again for as long as new carriers turn up. A process that keeps forking away from
    // its pid (the parent exits as its child starts) is gone from one look by the time it is
    // signalled, and only a look that finds nothing new proves the tree gone; one still
    // turning up after AFTER_SIGKILL fails the end (the run keeps its evidence, the end is
    // tried again).
    let after_kill = super::deadline_after(super::AFTER_SIGKILL);
    let mut last: Vec<super::PidFd> = Vec::new();
    let mut last_count = 0;
    loop {
        let since = last_pid();
        let found: Vec<super::PidFd> = pidfds_by_needle(needle)?
            .into_iter()
            .filter(|fd| {
                !known(fd, &carriers)
                    && !known(fd, &late)
                    && !known(fd, &last)
                    && !known(fd, not_mine)
            })
            .collect();
        let Some(first) = found.first() else {
            // A look that finds nothing proves the tree gone only if no carrier was started
            // while it ran: a process forking away from its pid can put its child where the
            // scan had already passed (and exit before its own turn came). The pids handed
            // out meanwhile are looked at one by one (until none more was).
            // Every pid handed out since, however many a busy host handed out meanwhile (a
            // pid is a syscall or two; a scan is the whole of /proc): only a full round of
            // the numbering stops the walk.
            match since.map(|since| carrier_among_since(since, needle, Pid::MAX as usize)) {
                // ns_last_pid unreadable: the look is all there is.
                None | Some(Some(false)) => break,
                // A carrier was started behind the scan, or that cannot be told (an
                // environment unreadable, the numbering gone round): look again, as for one
                // found, after a moment.
                Some(_) if Instant::now() < after_kill => {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Some(_) => {
                    return Err(super::ProcessError::System {
                        what: "prove a run's processes gone",
                        source: std::io::Error::other(format!(
                            "for {:?}, processes carrying its token kept being started, or the pids handed out meanwhile could not all be read",
                            super::AFTER_SIGKILL
                        )),
                    });
                }
            }
        };
        for fd in &found {
            signal_straggler(fd, super::Signal::SIGKILL);
        }
        if Instant::now() >= after_kill {
            // Still turning up: SIGKILLed where found, and the end fails (tried again).
            return Err(super::ProcessError::SurvivedSigkill {
                pid: first.pid(),
                after: super::AFTER_SIGKILL,
            });
        }
        last_count += found.len();
        // Those that have exited are done with: their pids may come back as new carriers.
        last.retain(|fd| !fd.wait_exit(Duration::ZERO).unwrap_or(false));
        last.extend(found);
    }
    let killed_any = !killed.is_empty() || last_count > 0;
    // Their own AFTER_SIGKILL to be gone in, whatever the looks above took.
    let gone_by = super::deadline_after(super::AFTER_SIGKILL);
    for fd in killed.into_iter().chain(&last) {
        let left = gone_by.saturating_duration_since(Instant::now());
        if !fd.wait_exit(left).unwrap_or(false) {
            return Err(super::ProcessError::SurvivedSigkill {
                pid: fd.pid(),
                after: super::AFTER_SIGKILL,
            });
        }
    }
    Ok(CarriersEnded {
        count: carriers.len() + late.len() + last_count,
        sigkill: killed_any,
    })
}

/// Ends a run's whole tree: SIGTERM to the leader's group (through the pidfd we hold) and to
/// every process carrying the run's token outside it, once each; after `kill_timeout`,
/// SIGKILL to whatever is left (see [`end_token_carriers`]). `group_signalled`: the caller
/// has just sent the group its SIGTERM (it is not sent again). `Sigkill` when anything of
/// the tree, in the group or out of it, needed SIGKILL. Blocking (waits up to
/// `kill_timeout`): call it off the actor threads.
pub fn terminate_tree(
    leader: &super::PidFd,
    token: &str,
    kill_timeout: Duration,
    group_signalled: bool,
) -> Result<super::Ended, super::ProcessError> {
    let deadline = super::deadline_after(kill_timeout);
    // The group first: the /proc scan for stragglers takes milliseconds and must not delay
    // the signal the worker itself is waiting for.
    let group_signalled = group_signalled || leader.signal_group(super::Signal::SIGTERM).is_ok();
    // A scan that cannot be complete does not hold up the group's end; it fails the whole end
    // afterwards, so the run's evidence is kept and the end tried again.
    let (stragglers, incomplete) = match pidfds_by_token(token) {
        Ok(found) => (found, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    // A leader with no group of its own left (it moved to another) gets its SIGTERM from
    // `terminate_group` below: not as a carrier too. One whose group was signalled is a
    // carrier like any other: in that group (passed over) or, moved out while members stayed,
    // signalled where it is now.
    let (leader_fd, others): (Vec<_>, Vec<_>) = stragglers
        .into_iter()
        .partition(|fd| !group_signalled && fd.pid() == leader.pid());
    signal_carriers_once(
        &others,
        super::Signal::SIGTERM,
        Signalled {
            group: group_signalled.then(|| leader.pid()),
            ..Signalled::default()
        },
    );
    let stragglers: Vec<_> = others.into_iter().chain(leader_fd).collect();
    let ended = if group_signalled {
        super::finish_group_end(leader, deadline)
    } else {
        // No group led by it (it left its own): ended alone, from its SIGTERM on.
        super::terminate_group(leader, kill_timeout)
    };
    // Their SIGTERM went out with the group's: one deadline for both. A straggler still there
    // after SIGKILL fails the whole end, as a group member would.
    let carriers = end_carriers(stragglers, &needle(token), deadline, &[])?;
    if let Some(e) = incomplete {
        return Err(e);
    }
    match ended? {
        super::Ended::Sigterm if carriers.sigkill => Ok(super::Ended::Sigkill),
        how => Ok(how),
    }
}

/// The rest of a run's end for a leader that [`super::begin_terminate`] has just sent its
/// SIGTERM (to the group its pid numbers, and to it where it left that group): every process
/// carrying the run's token outside that group gets its SIGTERM now, once, and the group and
/// they share the one deadline before SIGKILL — as [`terminate_tree`] does for a worker we own.
/// (Ended one after the other, a stubborn tree took `kill_timeout` twice, and its escapees got
/// their SIGTERM only once the group was gone.) The leader and its group stay the signaller's
/// ([`super::Terminating::finish`]): nothing here signals them, even when their end fails —
/// the run then keeps its evidence, and the next sweep ends and records them. Blocking. The
/// leader's end says `Sigkill` when anything of the tree needed SIGKILL; errors as for
/// [`terminate_tree`].
pub fn finish_tree_end(
    leader: super::Terminating<'_>,
    token: &str,
) -> Result<(super::Ended, CarriersEnded), super::ProcessError> {
    let deadline = leader.deadline();
    let pid = leader.pid();
    let (found, incomplete) = match pidfds_by_token(token) {
        Ok(found) => (found, None),
        Err(e) => (Vec::new(), Some(e)),
    };
    let in_group = |fd: &super::PidFd| super::read_stat(fd.pid()).is_ok_and(|s| s.pgrp == pid);
    let (signallers, others): (Vec<_>, Vec<_>) = found
        .into_iter()
        .partition(|fd| fd.pid() == pid || in_group(fd));
    // The group it may have moved to since (a carrier's): not signalled as a whole.
    let now_in = super::read_stat(pid).ok().map(|s| s.pgrp);
    let done = Signalled {
        group: Some(pid),
        process: Some(pid),
        process_group: now_in.filter(|&g| g != pid),
    };
    signal_carriers_once(&others, super::Signal::SIGTERM, done);
    let ended = leader.finish();
    let carriers = end_carriers(others, &needle(token), deadline, &signallers);
    if let (Err(_), Ok(c)) | (Ok(super::Ended::NotOurs(_)), Ok(c)) = (&ended, &carriers)
        && c.count > 0
    {
        // Not on the board (the run's verdict is not decided yet): said here.
        tracing::warn!(
            pid,
            carriers = c.count,
            sigkill = c.sigkill,
            "ended a closed run's escaped processes; its leader's own end is left to the next sweep"
        );
    }
    let carriers = carriers?;
    if let Some(e) = incomplete {
        return Err(e);
    }
    let ended = match ended? {
        super::Ended::Sigterm if carriers.sigkill => super::Ended::Sigkill,
        how => how,
    };
    Ok((ended, carriers))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process whose main thread exited alone still carries its environment (it is alive):
    /// found by it, through a thread that runs on.
    #[test]
    fn a_process_whose_main_thread_exited_alone_is_found_by_its_environment() {
        // The child is forked: its environment is ours as we started.
        let ours = fs::read("/proc/self/environ").unwrap();
        let needle = ours
            .split(|&b| b == 0)
            .find(|v| !v.is_empty())
            .expect("a variable in our environment")
            .to_vec();
        let left = crate::process::testutil::ThreadsLeft::start();
        assert_eq!(carries_now(left.0, &needle), Env::Carries);
        assert_eq!(
            carries_now(left.0, b"RUNWARDEN_RUN_TOKEN=nobody's"),
            Env::Not
        );
    }

    /// A process started with an empty environment (`env -i`) is no process caught
    /// mid-exec: it is told apart by where its environment ends (laid out), found carrying
    /// nothing, and a scan with it alive is complete — it would otherwise fail every scan
    /// for as long as it ran.
    #[test]
    fn a_process_with_an_empty_environment_carries_nothing_and_holds_no_scan_up() {
        let mut child = std::process::Command::new("/bin/sleep")
            .arg("30")
            .env_clear()
            .spawn()
            .expect("start sleep with no environment");
        let pid = child.id() as Pid;
        let laid_out = (0..1000).any(|_| {
            let done =
                super::super::read_stat(pid).is_ok_and(|s| s.env_end.is_some_and(|end| end != 0));
            if !done {
                std::thread::sleep(Duration::from_millis(1));
            }
            done
        });
        let raw = fs::read(format!("/proc/{pid}/environ"));
        let env = carries_now(pid, b"RUNWARDEN_RUN_TOKEN=abc");
        let scan = find_by_token("abc");
        let _ = child.kill();
        let _ = child.wait();
        assert!(laid_out, "its exec never laid out its environment");
        assert_eq!(raw.expect("its environment"), b"", "an empty environment");
        assert_eq!(env, Env::Not);
        assert_eq!(scan.expect("a complete scan"), []);
    }

    #[test]
    fn run_vars_reads_token_and_run_id_once() {
        let env = b"A=1\0RUNWARDEN_RUN_ID=42\0RUNWARDEN_RUN_TOKEN=abc\0RUNWARDEN_RUN_TOKEN=x\0";
        assert_eq!(run_vars(env), (Some("abc".into()), Some(42)));
        assert_eq!(run_vars(b"RUNWARDEN_RUN_ID=nope\0"), (None, None));
        assert_eq!(run_vars(b""), (None, None));
    }

    #[test]
    fn a_carrier_started_after_the_leader_is_found_among_recent_pids() {
        use std::process::{Command, Stdio};
        let token = format!("recent-{}-{:x}", std::process::id(), rand::random::<u64>());
        let spawn = |env: Option<&str>| {
            let mut cmd = Command::new("sleep");
            cmd.arg("30").stdin(Stdio::null());
            if let Some(t) = env {
                cmd.env("RUNWARDEN_RUN_TOKEN", t);
            }
            cmd.spawn().unwrap()
        };
        let mut leader = spawn(None);
        let mut carrier = spawn(Some(&token));
        let leader_pid = leader.id() as Pid;
        // `None` (too many pids handed out meanwhile by parallel tests) is the documented
        // fallback to a full scan; a wrong answer is not.
        let found = carrier_among_recent(leader_pid, &token);
        let quiet = last_pid().is_some_and(|l| l >= leader_pid && l - leader_pid < 64);
        if quiet {
            assert_eq!(found, Some(true));
        }
        assert_ne!(found, Some(false));
        assert_ne!(
            carrier_among_recent(leader_pid, "another-token"),
            Some(true)
        );
        // Only pids after the leader's count: the carrier is not among those after its own.
        assert_ne!(
            carrier_among_recent(carrier.id() as Pid, &token),
            Some(true)
        );
        for child in [&mut leader, &mut carrier] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    #[test]
    fn a_leader_that_leads_no_group_is_ended_by_terminate_tree() {
        // Started in our own group (as a leader that left its group would be): the group
        // signal finds no group led by it, and it is a token carrier too. It gets its SIGTERM
        // (on its own: not through a group), then SIGKILL, and the end says so. (That it gets
        // only one cannot be seen here: two sent microseconds apart arrive as one pending
        // signal. tests/sigterm_once.rs sees it where the sends are apart.)
        use std::process::{Command, Stdio};
        let dir = tempfile::tempdir().unwrap();
        let token = format!("alone-{}-{:x}", std::process::id(), rand::random::<u64>());
        let mut child = Command::new("sh")
            .args([
                "-c",
                "trap 'echo TERM >> terms' TERM; : > ready; while :; do sleep 0.05 & wait $!; done",
            ])
            .current_dir(dir.path())
            .env("RUNWARDEN_RUN_TOKEN", &token)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let pidfd = super::super::PidFd::open(child.id() as Pid).unwrap();
        let ready = crate::process::testutil::wait_until(Duration::from_secs(10), || {
            dir.path().join("ready").exists()
        });
        let ended =
            ready.then(|| terminate_tree(&pidfd, &token, Duration::from_millis(500), false));
        let _ = pidfd.signal(super::super::Signal::SIGKILL);
        let _ = child.wait();
        assert!(ready, "the trap was never set");
        assert_eq!(ended.unwrap().unwrap(), super::super::Ended::Sigkill);
        assert!(
            crate::process::testutil::wait_until(Duration::from_secs(5), || {
                fs::read_to_string(dir.path().join("terms")).is_ok_and(|t| t.contains("TERM"))
            }),
            "it never got SIGTERM"
        );
    }

    #[test]
    fn a_leader_followed_by_nothing_alive_is_settled_quickly() {
        use std::process::{Command, Stdio};
        // A fresh leader each try, reaped at once: only what parallel tests start in the
        // microseconds after it can make a try "not proven".
        let settled = (0..50).any(|_| {
            let mut leader = Command::new("true").stdin(Stdio::null()).spawn().unwrap();
            let pid = leader.id() as Pid;
            leader.wait().unwrap();
            only_ours_since(pid)
        });
        assert!(settled, "50 tries, none proven");
    }

    #[test]
    fn a_live_process_started_after_the_leader_that_is_not_ours_is_never_passed_over() {
        use std::process::{Command, Stdio};
        let spawn = || {
            Command::new("sleep")
                .arg("30")
                .stdin(Stdio::null())
                .spawn()
                .unwrap()
        };
        let mut leader = spawn();
        let leader_pid = leader.id() as Pid;
        let _ = leader.kill();
        let _ = leader.wait();
        let mut stranger = spawn();
        assert!(
            !only_ours_since(leader_pid),
            "a live unregistered process after the leader"
        );
        let _ = stranger.kill();
        let _ = stranger.wait();
    }

    #[test]
    fn find_by_token_never_matches_an_empty_token() {
        assert!(find_by_token("").unwrap().is_empty());
    }
}
