//! The group-termination scenarios of `process_group.rs`, run with the per-member fallback that
//! kernels without `PIDFD_SIGNAL_PROCESS_GROUP` (Linux < 6.9) use. Every test in this binary
//! forces the fallback (it is process-wide), so none of them runs with the flag.

#[allow(dead_code)]
mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::groups::{self, SETTLE, assert_all_gone, members};
use common::proc_guard::{ChildGuard, wait_until};
use runwarden::process::{
    DeadReason, Ended, Liveness, Pid, PidFd, PidfdSignaller, Signal, fingerprint,
    force_group_signal_fallback, liveness, read_stat, reap_orphans, terminate, terminate_group,
};

/// Spawns `sh -c script` as the leader of its own process group, with the fallback forced.
fn spawn_group(script: &str) -> ChildGuard {
    force_group_signal_fallback(true);
    groups::spawn_group(script)
}

#[test]
fn fallback_sigterm_ends_the_leader_and_both_sleeps() {
    let leader = spawn_group("sleep 300 & sleep 300 & wait");
    let pid = leader.pid();
    let fp = fingerprint(pid).unwrap();
    let procs = members(pid, 3);
    assert!(leader.pidfd().group_exists().unwrap());

    let ended = terminate(&PidfdSignaller, pid, &fp, SETTLE).unwrap();

    assert_eq!(ended, Ended::Sigterm);
    assert_all_gone(pid, &procs);
    assert_eq!(liveness(pid, &fp), Liveness::Dead(DeadReason::Zombie));
    // The unreaped zombie leader is still a member, as with the flag.
    assert!(leader.pidfd().group_exists().unwrap());
}

#[test]
fn fallback_group_that_ignores_sigterm_gets_sigkill() {
    groups::sigterm_ignored_gets_sigkill(spawn_group);
}

#[test]
fn fallback_reaches_members_after_the_leader_was_reaped() {
    let mut leader = spawn_group("sleep 300 & sleep 300 & exit 0");
    let pid = leader.pid();
    let pidfd = PidFd::open(pid).unwrap();
    assert!(leader.wait().unwrap().success());
    assert!(read_stat(pid).is_err_and(|e| e.is_no_such_process()));
    let procs = members(pid, 2);
    assert!(pidfd.group_exists().unwrap());

    let ended = terminate_group(&pidfd, SETTLE).unwrap();

    assert_eq!(ended, Ended::Sigterm);
    assert_all_gone(pid, &procs);
    let member_pids: Vec<Pid> = procs.iter().map(|(p, _)| *p).collect();
    assert!(wait_until(SETTLE, || {
        reap_orphans(&|p| !member_pids.contains(&p));
        pidfd
            .signal_group(Signal::SIGTERM)
            .is_err_and(|e| e.is_no_such_process())
    }));
    assert!(!pidfd.group_exists().unwrap());
    assert_eq!(terminate_group(&pidfd, SETTLE).unwrap(), Ended::Sigterm);
}

#[test]
fn fallback_kills_members_left_behind_by_a_leader_reaped_mid_way() {
    let leader =
        spawn_group(r#"(trap "" TERM; exec sleep 300) & (trap "" TERM; exec sleep 300) & wait"#);
    let pid = leader.pid();
    let fp = fingerprint(pid).unwrap();
    let procs = members(pid, 3);
    let owner_fd = PidFd::open(pid).unwrap();
    let owner = std::thread::spawn(move || {
        owner_fd.wait_exit(SETTLE).unwrap() && owner_fd.try_reap().unwrap().is_some()
    });
    assert!(wait_until(SETTLE, || {
        procs
            .iter()
            .filter(|(p, _)| *p != pid)
            .all(|(p, _)| read_stat(*p).is_ok_and(|s| s.comm == "sleep"))
    }));

    let ended = terminate(&PidfdSignaller, pid, &fp, Duration::from_millis(500)).unwrap();

    assert!(owner.join().unwrap(), "the owner did not reap the leader");
    assert_eq!(ended, Ended::Sigkill);
    assert_all_gone(pid, &procs);
}

#[test]
fn fallback_finds_no_group_for_a_process_that_leads_none() {
    force_group_signal_fallback(true);
    // Spawned into our own group: no group is led by it, as the flag would say (ESRCH).
    let child = ChildGuard::spawn(Command::new("sleep").arg("300").stdin(Stdio::null())).unwrap();
    let pidfd = PidFd::open(child.pid()).unwrap();
    assert!(!pidfd.group_exists().unwrap());
    assert!(
        pidfd
            .signal_group(Signal::SIGKILL)
            .unwrap_err()
            .is_no_such_process()
    );
    assert!(!pidfd.wait_exit(Duration::from_millis(100)).unwrap());
    // terminate_group still ends it, alone.
    assert_eq!(terminate_group(&pidfd, SETTLE).unwrap(), Ended::Sigterm);
}
