//! Ending workers' process groups with real processes: SIGTERM suffices, SIGKILL is needed, a
//! recycled fingerprint is never signalled, a reaped leader's group is still reachable, and
//! escaped descendants are adopted and reaped.

#[allow(dead_code)]
mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use common::groups::{self, SETTLE, assert_all_gone, members, spawn_group};
use common::proc_guard::{ChildGuard, wait_until};
use runwarden::process::{
    DeadReason, Ended, Fingerprint, Liveness, Pid, PidFd, PidfdSignaller, ProcessError, Sent,
    Signal, Signaller, become_subreaper, fingerprint, group_members, liveness, read_stat,
    reap_orphans, terminate, terminate_group,
};

#[test]
fn sigterm_ends_the_leader_and_both_sleeps() {
    let leader = spawn_group("sleep 300 & sleep 300 & wait");
    let pid = leader.pid();
    let fp = fingerprint(pid).unwrap();
    let procs = members(pid, 3);
    let sleeps: Vec<Pid> = procs
        .iter()
        .map(|(p, _)| *p)
        .filter(|&p| p != pid)
        .collect();
    assert_eq!(sleeps.len(), 2);

    let ended = terminate(&PidfdSignaller, pid, &fp, SETTLE).unwrap();

    assert_eq!(ended, Ended::Sigterm);
    assert_all_gone(pid, &procs);
    // Our unreaped child: a zombie until the guard reaps it.
    assert_eq!(liveness(pid, &fp), Liveness::Dead(DeadReason::Zombie));
}

#[test]
fn a_group_that_ignores_sigterm_gets_sigkill() {
    groups::sigterm_ignored_gets_sigkill(spawn_group);
}

#[test]
fn a_recycled_fingerprint_is_never_signalled() {
    let leader = spawn_group("sleep 300 & wait");
    let pid = leader.pid();
    let fp = fingerprint(pid).unwrap();
    members(pid, 2);
    let stranger = Fingerprint {
        start_ticks: fp.start_ticks - 1,
        ..fp.clone()
    };

    let ended = terminate(&PidfdSignaller, pid, &stranger, Duration::from_millis(100)).unwrap();

    assert_eq!(ended, Ended::NotOurs(Liveness::Dead(DeadReason::Recycled)));
    assert_eq!(
        PidfdSignaller
            .send(pid, &stranger, Signal::SIGKILL)
            .unwrap(),
        Sent::NotOurs(Liveness::Dead(DeadReason::Recycled))
    );
    // Give a stray signal the time to land before checking nothing was hit.
    assert!(
        !leader
            .pidfd()
            .wait_exit(Duration::from_millis(200))
            .unwrap()
    );
    assert_eq!(liveness(pid, &fp), Liveness::Alive);
    assert_eq!(group_members(pid).len(), 2);
}

#[test]
fn terminate_group_reaches_members_after_the_leader_was_reaped() {
    let mut leader = spawn_group("sleep 300 & sleep 300 & exit 0");
    let pid = leader.pid();
    // Opened while the leader is our unreaped child: it names it, and later its group.
    let pidfd = PidFd::open(pid).unwrap();
    assert!(leader.wait().unwrap().success());
    assert!(read_stat(pid).is_err_and(|e| e.is_no_such_process()));
    let procs = members(pid, 2);

    let ended = terminate_group(&pidfd, SETTLE).unwrap();

    assert_eq!(ended, Ended::Sigterm);
    assert_all_gone(pid, &procs);
    // Nothing left: once the members' zombies are reaped (by init, or by us if a parallel test
    // made this process a subreaper) the group signal finds no one, which is fine.
    let member_pids: Vec<Pid> = procs.iter().map(|(p, _)| *p).collect();
    assert!(wait_until(SETTLE, || {
        reap_orphans(&|p| !member_pids.contains(&p));
        pidfd
            .signal_group(Signal::SIGTERM)
            .is_err_and(|e| e.is_no_such_process())
    }));
    assert_eq!(terminate_group(&pidfd, SETTLE).unwrap(), Ended::Sigterm);
}

/// Delivers for real and records which path each signal took.
#[derive(Default)]
struct Recording(Mutex<Vec<(&'static str, Signal)>>);

impl Signaller for Recording {
    fn send(&self, pid: Pid, expected: &Fingerprint, sig: Signal) -> Result<Sent, ProcessError> {
        self.0.lock().unwrap().push(("send", sig));
        PidfdSignaller.send(pid, expected, sig)
    }
    fn send_group(&self, leader: &PidFd, sig: Signal) -> Result<Sent, ProcessError> {
        self.0.lock().unwrap().push(("send_group", sig));
        PidfdSignaller.send_group(leader, sig)
    }
}

#[test]
fn terminate_kills_members_left_behind_by_a_leader_reaped_mid_way() {
    // The shell dies of SIGTERM, its children ignore it; the leader's owner (a WorkerActor in
    // the supervisor) reaps it at once, so by the kill timeout its pid names nothing.
    let leader =
        spawn_group(r#"(trap "" TERM; exec sleep 300) & (trap "" TERM; exec sleep 300) & wait"#);
    let pid = leader.pid();
    let fp = fingerprint(pid).unwrap();
    let procs = members(pid, 3);
    let owner_fd = PidFd::open(pid).unwrap();
    let owner = std::thread::spawn(move || {
        owner_fd.wait_exit(SETTLE).unwrap() && owner_fd.try_reap().unwrap().is_some()
    });
    // The trap must be in place in both subshells before SIGTERM is sent.
    assert!(wait_until(SETTLE, || {
        procs
            .iter()
            .filter(|(p, _)| *p != pid)
            .all(|(p, _)| read_stat(*p).is_ok_and(|s| s.comm == "sleep"))
    }));

    let rec = Recording::default();
    let ended = terminate(&rec, pid, &fp, Duration::from_millis(500)).unwrap();

    assert!(owner.join().unwrap(), "the owner did not reap the leader");
    assert_eq!(ended, Ended::Sigkill);
    assert_eq!(
        *rec.0.lock().unwrap(),
        [
            ("send", Signal::SIGTERM),
            ("send", Signal::SIGKILL),
            ("send_group", Signal::SIGKILL)
        ]
    );
    assert_all_gone(pid, &procs);
}

#[test]
fn a_leader_that_left_its_group_is_ended_with_the_members_it_left_behind() {
    // The leader makes its own group, starts a member in it (its environment cleared: no
    // token finds it), then moves itself to the test's group and becomes `sleep 302`. The
    // group its pid names lives on with the member: it is ended with the leader, as a previous
    // supervisor's worker found by pid and fingerprint would be.
    let sleep = std::ffi::CString::new("/bin/sleep").unwrap();
    let argv = [sleep.clone(), std::ffi::CString::new("301").unwrap()];
    let argv_ptrs: Vec<*const libc::c_char> = argv
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let test_group = unsafe { libc::getpgrp() };
    let (argv_addr, envp_addr) = (argv_ptrs.as_ptr() as usize, envp.as_ptr() as usize);
    let mut cmd = Command::new("/bin/sleep");
    cmd.arg("302").stdin(Stdio::null());
    // SAFETY: between fork and exec only async-signal-safe calls (setpgid, fork, execve,
    // _exit) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            match libc::fork() {
                0 => {
                    libc::execve(
                        (*(argv_addr as *const *const libc::c_char)) as *const libc::c_char,
                        argv_addr as *const *const libc::c_char,
                        envp_addr as *const *const libc::c_char,
                    );
                    libc::_exit(127);
                }
                -1 => return Err(std::io::Error::last_os_error()),
                _ => {}
            }
            if libc::setpgid(0, test_group) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let leader = ChildGuard::spawn(&mut cmd).expect("spawn the leader");
    let pid = leader.pid();
    let member = members(pid, 1).remove(0);
    let _member_guard = common::runtime::WorkerGuard::adopt(member.0, &member.1);
    assert!(
        wait_until(SETTLE, || read_stat(member.0)
            .is_ok_and(|s| s.comm == "sleep")),
        "the member never became sleep"
    );
    assert_eq!(
        read_stat(pid).unwrap().pgrp,
        test_group,
        "the leader left its group"
    );
    let fp = fingerprint(pid).unwrap();

    let ended = terminate(&PidfdSignaller, pid, &fp, SETTLE).unwrap();

    assert_eq!(ended, Ended::Sigterm);
    assert_all_gone(pid, &[member]);
    assert!(matches!(liveness(pid, &fp), Liveness::Dead(_)));
}

#[test]
fn an_escaped_descendant_is_adopted_and_reaped() {
    let _subreaper = become_subreaper().unwrap();
    let me = std::process::id() as Pid;
    // The descendant leaves the worker's group and session, out of reach of a group signal.
    let mut leader = ChildGuard::spawn(
        Command::new("sh")
            .args(["-c", "setsid sleep 1 & echo $!"])
            .stdout(Stdio::piped())
            .process_group(0),
    )
    .unwrap();
    let mut line = String::new();
    BufReader::new(leader.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let escaped: Pid = line.trim().parse().unwrap();
    // Pin it while its parent still waits to be reaped, so the cleanup below is exact.
    let escaped_fd = PidFd::open(escaped).unwrap();
    let _cleanup = scopeguard(move || {
        let _ = escaped_fd.signal(Signal::SIGKILL);
    });
    assert!(leader.wait().unwrap().success());

    // Re-parented to us, not to init; then it exits and only we can reap it.
    assert!(wait_until(SETTLE, || read_stat(escaped)
        .is_ok_and(|s| s.ppid == me && s.pgrp == escaped)));
    assert!(wait_until(SETTLE, || read_stat(escaped).is_ok_and(|s| s.is_zombie())));
    // Other tests in this binary run in parallel: spare every child but this one.
    assert_eq!(reap_orphans(&|pid| pid != escaped), [escaped]);
    assert!(read_stat(escaped).is_err_and(|e| e.is_no_such_process()));
}

/// Runs `f` on drop, so cleanup happens even when an assertion fails.
fn scopeguard(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// The live processes that carry `token` (a complete scan of /proc, or the test fails).
fn carriers_alive(token: &str) -> Vec<(Pid, Fingerprint)> {
    runwarden::process::descendants::find_by_token(token)
        .expect("a complete scan of /proc")
        .into_iter()
        .filter(|(p, fp)| liveness(*p, fp) == Liveness::Alive)
        .collect()
}

#[test]
fn end_token_carriers_ends_a_tree_with_a_setsid_escapee() {
    use runwarden::process::descendants::{end_token_carriers, pidfds_by_token};

    let token = format!("{:032x}", rand::random::<u128>());
    let leader = ChildGuard::spawn(
        Command::new("sh")
            .args(["-c", r#"setsid sh -c "sleep 300" & sleep 300"#])
            .env("RUNWARDEN_RUN_TOKEN", &token)
            .stdin(Stdio::null())
            .process_group(0),
    )
    .unwrap();
    let pid = leader.pid();
    // Whatever happens, every carrier is SIGKILLed through its own verified pidfd.
    let cleanup_token = token.clone();
    let _cleanup = scopeguard(move || {
        for fd in pidfds_by_token(&cleanup_token).unwrap_or_default() {
            let _ = fd.signal(Signal::SIGKILL);
        }
    });
    // Both sleeps are up: one in the leader's group, one in a session of its own.
    assert!(
        wait_until(SETTLE, || {
            let stats: Vec<_> = carriers_alive(&token)
                .iter()
                .filter_map(|(p, _)| read_stat(*p).ok())
                .filter(|s| s.comm == "sleep")
                .collect();
            stats.iter().any(|s| s.pgrp == pid)
                && stats
                    .iter()
                    .any(|s| s.session != read_stat(pid).unwrap().session)
        }),
        "the tree never came up: {:?}",
        carriers_alive(&token)
    );
    let carriers = carriers_alive(&token);
    assert!(carriers.len() >= 3, "{carriers:?}");

    let signalled = end_token_carriers(&token, SETTLE)
        .expect("every carrier ended")
        .count;

    assert!(signalled >= carriers.len(), "{signalled} < {carriers:?}");
    for (p, fp) in &carriers {
        assert!(
            wait_until(SETTLE, || matches!(liveness(*p, fp), Liveness::Dead(_))),
            "carrier {p} survived: {:?}",
            liveness(*p, fp)
        );
    }
    assert!(
        carriers_alive(&token).is_empty(),
        "{:?}",
        carriers_alive(&token)
    );
    // Reap the escapee's zombie if a parallel test made us its subreaper.
    let pids: Vec<Pid> = carriers.iter().map(|(p, _)| *p).collect();
    reap_orphans(&|p| !pids.contains(&p) || p == pid);
}

#[test]
fn end_token_carriers_with_an_empty_or_unknown_token_signals_nothing() {
    use runwarden::process::descendants::end_token_carriers;
    assert_eq!(
        end_token_carriers("", Duration::from_millis(10))
            .unwrap()
            .count,
        0
    );
    let token = format!("{:032x}", rand::random::<u128>());
    assert_eq!(end_token_carriers(&token, Duration::MAX).unwrap().count, 0);
}

#[test]
fn end_token_carriers_outlasts_a_carrier_that_keeps_forking_away_from_its_pid() {
    use runwarden::process::descendants::{end_token_carriers, pidfds_by_token};

    // Each hop (~0.2 ms) forks the next and exits at once, TERM ignored: a look finds a pid
    // that has hopped on by the time it is signalled. The shell allows 900 nested calls: then
    // it starts over in a fresh shell, five times (about a second of hopping), and settles as
    // a sleep, so the test ends whatever the code does. "Ended" must not come while it hops.
    let token = format!("{:032x}", rand::random::<u128>());
    let hop = r#"trap "" TERM; hop() { n=$((n+1)); if [ $n -gt 900 ]; then h=$((h+1)); [ $h -gt 5 ] && exec sleep 300; export h; exec sh -c "$S"; fi; ( hop ) & exit 0; }; n=0; hop"#;
    let leader = ChildGuard::spawn(
        Command::new("sh")
            .args(["-c", r#"exec sh -c "$S""#])
            .env("S", hop)
            .env("h", "0")
            .env("RUNWARDEN_RUN_TOKEN", &token)
            .stdin(Stdio::null())
            .process_group(0),
    )
    .unwrap();
    let cleanup_token = token.clone();
    let _cleanup = scopeguard(move || {
        // Until the hopper has settled (its hops are over in about a second).
        wait_until(SETTLE, || {
            let found = pidfds_by_token(&cleanup_token).unwrap_or_default();
            for fd in &found {
                let _ = fd.signal(Signal::SIGKILL);
            }
            found.is_empty()
        });
    });
    assert!(
        wait_until(SETTLE, || carriers_alive(&token)
            .iter()
            .any(|(p, _)| *p != leader.pid())),
        "the hopper never started hopping"
    );

    let ended = end_token_carriers(&token, Duration::from_millis(50));

    let left = carriers_alive(&token);
    assert!(
        ended.is_ok() && left.is_empty(),
        "ended {ended:?} with carriers left: {left:?}"
    );
}

/// A host busy starting processes (four threads spawning `true` without pause) while a run's
/// carriers are ended: the pids handed out during the last look are many, and all of them are
/// looked at — the end succeeds, and the carrier is gone.
#[test]
fn end_token_carriers_succeeds_on_a_host_busy_starting_processes() {
    use runwarden::process::descendants::end_token_carriers;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let token = format!("{:032x}", rand::random::<u128>());
    let carrier = ChildGuard::spawn(
        Command::new("sleep")
            .arg("300")
            .env("RUNWARDEN_RUN_TOKEN", &token)
            .stdin(Stdio::null())
            .process_group(0),
    )
    .unwrap();
    let busy = Arc::new(AtomicBool::new(true));
    let spawners: Vec<_> = (0..4)
        .map(|_| {
            let busy = busy.clone();
            std::thread::spawn(move || {
                let mut started = 0u32;
                while busy.load(Ordering::Relaxed) {
                    if let Ok(mut child) = ChildGuard::spawn(
                        Command::new("true")
                            .stdin(Stdio::null())
                            .stdout(Stdio::null()),
                    ) {
                        let _ = child.0.wait();
                        started += 1;
                    }
                }
                started
            })
        })
        .collect();
    let ended = end_token_carriers(&token, Duration::from_millis(200));
    busy.store(false, Ordering::Relaxed);
    let started: u32 = spawners.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(started > 0, "the host was not busy");
    assert!(
        ended.as_ref().is_ok_and(|e| e.count == 1),
        "{ended:?} ({started} processes started meanwhile)"
    );
    assert!(
        carrier.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "the carrier outlived its end"
    );
}

/// A look for a run's token at a carrier that keeps forking away from its pid (each
/// generation forks the next, which moves to a session of its own, and exits): a scan of
/// `/proc` alone almost never finds it — each generation has moved on by the time the scan
/// reads it — so the look also walks the pids handed out while it ran, and finds it every time.
#[test]
fn token_carried_sees_a_carrier_that_keeps_forking_away_from_its_pid() {
    use runwarden::process::descendants::{pidfds_by_token, token_carried};
    let token = format!("{:032x}", rand::random::<u128>());
    let mut starter = ChildGuard::spawn(
        Command::new("perl")
            .args([
                "-MPOSIX",
                "-e",
                "for (1..60000) { my $p = fork(); die unless defined $p; exit 0 if $p; POSIX::setsid() }",
            ])
            .env("RUNWARDEN_RUN_TOKEN", &token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .expect("perl (Debian's essential perl-base)");
    let cleanup_token = token.clone();
    // A scan alone misses such a chain: killed until a look that also walks the pids handed
    // out meanwhile finds none.
    let _cleanup = scopeguard(move || {
        wait_until(SETTLE, || {
            for fd in pidfds_by_token(&cleanup_token).unwrap_or_default() {
                let _ = fd.signal(Signal::SIGKILL);
            }
            token_carried(&cleanup_token) == Some(false)
        });
    });
    assert!(starter.wait().expect("the chain's first process").success());
    for look in 0..20 {
        assert_eq!(
            token_carried(&token),
            Some(true),
            "look {look} missed the hopping carrier"
        );
    }
}
