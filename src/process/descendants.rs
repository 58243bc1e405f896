//! Finding a run's descendants that escaped its process group (`setsid`, double fork).
//!
//! Every worker is started with `RUNWARDEN_RUN_TOKEN=<token>` in its environment, a random
//! secret per run, and children inherit their parent's environment. A process that carries the
//! token therefore descends from that run's worker, whatever group or session it moved to. (A
//! process that scrubbed its environment is not found this way; a per-run cgroup would be the
//! stronger tool where one is available.)

use std::fs;

use super::{Fingerprint, Pid, fingerprint};

/// The environment entry every process of a run carries.
fn needle(token: &str) -> Vec<u8> {
    format!("RUNWARDEN_RUN_TOKEN={token}").into_bytes()
}

/// Processes (other than ourselves) whose environment holds `RUNWARDEN_RUN_TOKEN=<token>`,
/// with their fingerprints, so the caller can signal them only through a verified pidfd.
/// Unreadable entries (vanished, permission) are skipped.
pub fn find_by_token(token: &str) -> Vec<(Pid, Fingerprint)> {
    if token.is_empty() {
        return Vec::new();
    }
    let needle = needle(token);
    let me = std::process::id() as Pid;
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in dir.flatten() {
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
        let Ok(env) = fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        if env.split(|&b| b == 0).any(|var| var == needle.as_slice())
            && let Ok(fp) = fingerprint(pid)
        {
            found.push((pid, fp));
        }
    }
    found
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

/// The run token in a process's environment, if any.
fn token_of(pid: Pid) -> Option<String> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|var| {
        var.strip_prefix(b"RUNWARDEN_RUN_TOKEN=")
            .map(|t| String::from_utf8_lossy(t).into_owned())
    })
}

/// Live (non-zombie) children of ours that nobody owns: descendants of workers re-parented to
/// us (we are a subreaper) after their parent died. Each with its run token, if it carries one.
pub fn live_orphans() -> Vec<(Pid, Option<String>)> {
    let me = std::process::id() as Pid;
    let Some(stats) = super::liveness::all_stats() else {
        return Vec::new();
    };
    stats
        .filter(|s| s.ppid == me && !s.is_zombie() && !super::owned::is_registered(s.pid))
        .map(|s| (s.pid, token_of(s.pid)))
        .collect()
}

/// The run id in a process's environment (`RUNWARDEN_RUN_ID`), if any.
fn run_id_of(pid: Pid) -> Option<i64> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|var| {
        std::str::from_utf8(var.strip_prefix(b"RUNWARDEN_RUN_ID=")?)
            .ok()?
            .parse()
            .ok()
    })
}

/// Ends the orphans (see [`live_orphans`]) that `is_stray(run_id, token)` claims: leftovers of
/// a finished run of the caller's that escaped its worker's group. The caller must answer true
/// only for a run of its own board that carries that very token and is over: an orphan of
/// another supervisor sharing this process, or a worker left running for adoption, carries a
/// token the caller cannot vouch for and must never be signalled. Orphans without a run id or
/// token are left alone. Each is signalled through a pidfd verified against the fingerprint
/// read here (SIGTERM; SIGKILL after `kill_timeout`). Blocking. Returns the pids ended.
pub fn end_stray_orphans(
    is_stray: &dyn Fn(i64, &str) -> bool,
    kill_timeout: std::time::Duration,
) -> Vec<Pid> {
    let mut fds = Vec::new();
    for (pid, token) in live_orphans() {
        let (Some(token), Some(run_id)) = (token, run_id_of(pid)) else {
            continue;
        };
        if !is_stray(run_id, &token) {
            continue;
        }
        let Ok(fp) = fingerprint(pid) else { continue };
        if let Ok(super::Verified::Ours(fd)) = super::open_verified(pid, &fp) {
            signal_straggler(&fd, super::Signal::SIGTERM);
            fds.push(fd);
        }
    }
    let deadline = std::time::Instant::now() + kill_timeout;
    for fd in &fds {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if !fd.wait_exit(left).unwrap_or(false) {
            signal_straggler(fd, super::Signal::SIGKILL);
        }
    }
    fds.iter().map(|fd| fd.pid()).collect()
}

/// Opens verified pidfds for every process carrying `token` (see [`find_by_token`]).
pub fn pidfds_by_token(token: &str) -> Vec<super::PidFd> {
    find_by_token(token)
        .into_iter()
        .filter_map(|(pid, fp)| match super::open_verified(pid, &fp) {
            Ok(super::Verified::Ours(fd)) => Some(fd),
            _ => None,
        })
        .collect()
}

/// Ends a run's whole tree: SIGTERM to the leader's group (through the pidfd we hold) and to
/// every process carrying the run's token outside it; after `kill_timeout`, SIGKILL to
/// whatever is left. Blocking (waits up to `kill_timeout`): call it off the actor threads.
pub fn terminate_tree(
    leader: &super::PidFd,
    token: &str,
    kill_timeout: std::time::Duration,
) -> Result<super::Ended, super::ProcessError> {
    let deadline = std::time::Instant::now() + kill_timeout;
    // The group first: the /proc scan for stragglers takes milliseconds and must not delay
    // the signal the worker itself is waiting for. (terminate_group repeats it; harmless.)
    let _ = leader.signal_group(super::Signal::SIGTERM);
    let stragglers = pidfds_by_token(token);
    for fd in &stragglers {
        signal_straggler(fd, super::Signal::SIGTERM);
    }
    let ended = super::terminate_group(leader, kill_timeout);
    for fd in &stragglers {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if !fd.wait_exit(left).unwrap_or(false) {
            signal_straggler(fd, super::Signal::SIGKILL);
        }
    }
    // A straggler may have forked after the first scan; its children carry the token too.
    for fd in pidfds_by_token(token) {
        signal_straggler(&fd, super::Signal::SIGKILL);
    }
    ended
}
