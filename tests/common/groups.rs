//! Process-group scenarios shared by the group-termination tests (with the kernel's group
//! signal, and with the per-member fallback).

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use runwarden::process::{
    Ended, Fingerprint, Liveness, Pid, PidfdSignaller, fingerprint, group_alive, group_members,
    liveness, terminate,
};

use super::proc_guard::{ChildGuard, wait_until};

/// Generous bound for the kernel and init to catch up; every wait polls, none sleeps blindly.
pub const SETTLE: Duration = Duration::from_secs(10);

/// Spawns `sh -c script` as the leader of its own process group.
pub fn spawn_group(script: &str) -> ChildGuard {
    ChildGuard::spawn(
        Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .process_group(0),
    )
    .expect("spawn sh")
}

/// Waits for the group to have `n` live members; returns them with their fingerprints.
pub fn members(pgid: Pid, n: usize) -> Vec<(Pid, Fingerprint)> {
    assert!(
        wait_until(SETTLE, || group_members(pgid).len() == n),
        "group {pgid} never had {n} members: {:?}",
        group_members(pgid)
    );
    group_members(pgid)
        .into_iter()
        .map(|pid| (pid, fingerprint(pid).expect("fingerprint of a member")))
        .collect()
}

/// Asserts (bounded poll) that nothing of the group is left running.
pub fn assert_all_gone(pgid: Pid, procs: &[(Pid, Fingerprint)]) {
    assert!(
        wait_until(SETTLE, || !group_alive(pgid)),
        "group {pgid} still has {:?}",
        group_members(pgid)
    );
    for (pid, fp) in procs {
        // Gone, a zombie awaiting its reaper, or its pid already reused: dead in every case.
        assert!(
            wait_until(SETTLE, || matches!(liveness(*pid, fp), Liveness::Dead(_))),
            "member {pid} survived: {:?}",
            liveness(*pid, fp)
        );
    }
}

/// A group whose shell ignores SIGTERM (with two sleeps) is ended by SIGKILL after the kill
/// timeout, every member gone. `spawn` starts the group (with or without the fallback forced).
pub fn sigterm_ignored_gets_sigkill(spawn: fn(&str) -> ChildGuard) {
    let leader = spawn(r#"trap "" TERM; sleep 300 & sleep 300 & wait"#);
    let pid = leader.pid();
    let fp = fingerprint(pid).unwrap();
    let procs = members(pid, 3);

    let kill_timeout = Duration::from_millis(300);
    let started = Instant::now();
    let ended = terminate(&PidfdSignaller, pid, &fp, kill_timeout).unwrap();

    assert_eq!(ended, Ended::Sigkill);
    assert!(started.elapsed() >= kill_timeout);
    assert_all_gone(pid, &procs);
}
