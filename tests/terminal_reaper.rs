//! The terminal-worker reaper's invariants, with real processes and a real SQLite board
//! (reimplements the upstream `test_kanban_terminal_worker_reaper.py`):
//!
//! - a worker alive long after its run completed is ended by a dispatch pass that spawns nothing;
//! - a recycled fingerprint and a legacy row (no fingerprint) are never signalled; an exited
//!   worker's evidence is cleared as gone;
//! - a just-closed run is left alone until its grace has passed;
//! - one failing row does not abort the sweep, and is retried later;
//! - a stale `expected_run` is refused.

#[allow(dead_code)]
mod common;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::board::{
    FailingFor, GRACE, KILL_TIMEOUT, LEASE_MS, RecordingSignaller, SETTLE, assert_evidence_cleared,
    assert_evidence_kept, assert_no_reaper_event, completed_with_worker, events_of,
    exits_within_settle, group_leader, kinds, run, sleeper, still_running, temp_board,
};
use common::lifecycle::{seen, wait_pid_file};
use common::proc_guard::{ChildGuard, wait_until};
use runwarden::board::{
    self, BoardError, Claim, DispatchOptions, NewTask, TaskStatus, now_millis,
    reap_terminal_workers,
};
use runwarden::process::{
    DeadReason, Fingerprint, Liveness, PidFd, PidfdSignaller, ProcessError, Sent, Signal,
    Signaller, fingerprint, group_alive, group_members, liveness, read_stat,
};

const GRACE_MS: i64 = GRACE.as_millis() as i64;

/// One terminal-reaper sweep at `now` with the tests' grace and kill timeout.
fn sweep(board: &mut board::Board, signaller: &dyn Signaller, now: i64) -> Vec<i64> {
    reap_terminal_workers(board, signaller, now, GRACE, KILL_TIMEOUT).expect("the sweep runs")
}

#[test]
fn worker_alive_after_completion_is_reaped_by_a_dispatch_pass() {
    let mut tb = temp_board();
    let (mut worker, fp) = sleeper(120);
    let pid = worker.pid();
    let ended_at = now_millis();
    let (task, run_id) = completed_with_worker(&mut tb.board, "finished", pid, Some(&fp), ended_at);

    // The evidence the running-only sweeps lose lives on the closed run row.
    let closed = run(&mut tb.board, run_id);
    assert_eq!(closed.ended_at, Some(ended_at));
    assert_evidence_kept(&closed, pid, Some(&fp));

    // A ready task the dry run could have claimed, so "spawns nothing" says something.
    let waiting = tb
        .board
        .write(|tx| tx.create_task(&NewTask::titled("waiting").for_assignee("coder"), ended_at))
        .expect("create a ready task")
        .id;
    let spawns = Cell::new(0u32);
    let mut spawn = |_: &Claim| -> Result<(i32, Option<Fingerprint>), String> {
        spawns.set(spawns.get() + 1);
        Err("spawning is disabled in this test".into())
    };
    let signaller = PidfdSignaller;
    let report = board::dispatch_once(
        &mut tb.board,
        DispatchOptions {
            now: ended_at + 600_000,
            claimer: "test-dispatcher",
            dry_run: true,
            max_spawn: 0,
            max_in_progress: 8,
            assignee_caps: BTreeMap::from([("coder".to_string(), 2)]),
            lease: Duration::from_millis(LEASE_MS as u64),
            default_max_retries: 2,
            grace: GRACE,
            kill_timeout: KILL_TIMEOUT,
            signaller: &signaller,
            spawn: &mut spawn,
        },
    )
    .expect("dispatch_once");

    assert_eq!(report.reaped_terminal_workers, vec![task]);
    assert!(
        report.claimed.is_empty() && report.spawn_failed.is_empty(),
        "{report:?}"
    );
    assert_eq!(spawns.get(), 0, "a dry run spawns nothing");
    let waiting = tb.board.read(|tx| tx.get_task(waiting)).expect("read");
    assert_eq!(waiting.status, TaskStatus::Ready, "nor claims: {waiting:?}");
    assert!(
        exits_within_settle(&mut worker),
        "worker {pid} still running {SETTLE:?} after the reaper ended it"
    );
    let status = worker.try_wait().unwrap().expect("reaped above");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(Signal::SIGTERM as i32),
        "ended by SIGTERM: {status:?}"
    );

    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    let reaped = events_of(&mut tb.board, task, "terminal_worker_reaped");
    assert_eq!(reaped.len(), 1, "{:?}", kinds(&mut tb.board, task));
    assert_eq!(reaped[0].run_id, Some(run_id));
    assert_eq!(reaped[0].payload["pid"], pid);
    assert_eq!(reaped[0].payload["start_ticks"], fp.start_ticks);
    assert_eq!(reaped[0].payload["ended_by"], "sigterm");

    // Cleared evidence is not rescanned: a second pass has nothing to do.
    let again = sweep(
        &mut tb.board,
        &RecordingSignaller::default(),
        ended_at + 700_000,
    );
    assert_eq!(again, Vec::<i64>::new());
}

#[test]
fn recycled_fingerprint_and_legacy_row_are_never_signalled() {
    let mut tb = temp_board();
    let (mut stranger, stranger_fp) = sleeper(120);
    let (mut legacy, legacy_fp) = sleeper(120);
    let ended_at = now_millis();

    // PID reuse: the recorded fingerprint names a process that started at another time.
    let recycled_fp = Fingerprint {
        start_ticks: stranger_fp.start_ticks + 1,
        ..stranger_fp.clone()
    };
    let (recycled_task, recycled_run) = completed_with_worker(
        &mut tb.board,
        "recycled",
        stranger.pid(),
        Some(&recycled_fp),
        ended_at,
    );
    // A row from before fingerprints were recorded.
    let (legacy_task, legacy_run) =
        completed_with_worker(&mut tb.board, "legacy", legacy.pid(), None, ended_at);

    let signaller = RecordingSignaller::default();
    let reaped = sweep(&mut tb.board, &signaller, ended_at + 600_000);

    assert_eq!(reaped, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![], "nothing may be signalled");
    assert!(still_running(&mut stranger), "the stranger was ended");
    assert!(still_running(&mut legacy), "the legacy worker was ended");
    assert_eq!(liveness(stranger.pid(), &stranger_fp), Liveness::Alive);
    assert_eq!(liveness(legacy.pid(), &legacy_fp), Liveness::Alive);

    // Stale evidence is dropped (so it is not rescanned) and the reason recorded.
    assert_evidence_cleared(&run(&mut tb.board, recycled_run), stranger.pid());
    let recycled = events_of(&mut tb.board, recycled_task, "terminal_worker_pid_recycled");
    assert_eq!(
        recycled.len(),
        1,
        "{:?}",
        kinds(&mut tb.board, recycled_task)
    );
    assert_eq!(recycled[0].run_id, Some(recycled_run));
    assert_eq!(recycled[0].payload["pid"], stranger.pid());
    assert_eq!(recycled[0].payload["start_ticks"], recycled_fp.start_ticks);

    // The legacy row is left exactly as it was: never signalled, never cleared, no event.
    let legacy_row = run(&mut tb.board, legacy_run);
    assert_evidence_kept(&legacy_row, legacy.pid(), None);
    assert_eq!(legacy_row.spawned_pid, Some(i64::from(legacy.pid())));
    assert_no_reaper_event(
        &mut tb.board,
        legacy_task,
        "no reaper event on a legacy row",
    );

    // Still true on the next sweep.
    let again = sweep(&mut tb.board, &signaller, ended_at + 700_000);
    assert_eq!(again, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![]);
    assert!(still_running(&mut stranger) && still_running(&mut legacy));
    assert_evidence_kept(&run(&mut tb.board, legacy_run), legacy.pid(), None);
}

#[test]
fn exited_worker_is_cleared_as_gone_without_a_signal() {
    let mut tb = temp_board();
    let (mut worker, fp) = sleeper(120);
    let pid = worker.pid();
    let ended_at = now_millis();
    let (task, run_id) = completed_with_worker(&mut tb.board, "exited", pid, Some(&fp), ended_at);

    // The worker exits on its own and is reaped: its pid names nothing (or, should the kernel
    // hand it out at once, another process: either way not ours).
    worker.pidfd().signal(Signal::SIGKILL).unwrap();
    worker.wait().unwrap();
    assert!(matches!(liveness(pid, &fp), Liveness::Dead(_)));

    let signaller = RecordingSignaller::default();
    let reaped = sweep(&mut tb.board, &signaller, ended_at + 600_000);

    assert_eq!(reaped, Vec::<i64>::new(), "nothing was ended by the reaper");
    assert_eq!(signaller.sent(), vec![]);
    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    let gone = events_of(&mut tb.board, task, "terminal_worker_gone");
    assert_eq!(gone.len(), 1, "{:?}", kinds(&mut tb.board, task));
    assert_eq!(gone[0].payload["pid"], pid);
    assert_eq!(
        gone[0].payload["reason"],
        DeadReason::NoSuchProcess.as_str()
    );
}

#[test]
fn fresh_terminal_run_is_left_alone_until_its_grace_has_passed() {
    let mut tb = temp_board();
    let (mut worker, fp) = sleeper(120);
    let pid = worker.pid();
    let ended_at = now_millis();
    let (task, run_id) = completed_with_worker(&mut tb.board, "fresh", pid, Some(&fp), ended_at);
    let signaller = RecordingSignaller::default();

    // Just closed: the worker may still be finishing its last turn.
    let first = sweep(&mut tb.board, &signaller, ended_at);
    assert_eq!(first, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![]);
    assert!(still_running(&mut worker));
    assert_evidence_kept(&run(&mut tb.board, run_id), pid, Some(&fp));

    // One millisecond short of the grace: still left alone.
    let almost = sweep(&mut tb.board, &signaller, ended_at + GRACE_MS - 1);
    assert_eq!(almost, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![]);
    assert!(still_running(&mut worker));
    assert_evidence_kept(&run(&mut tb.board, run_id), pid, Some(&fp));

    // Grace passed: ended, through exactly one SIGTERM to the recorded pid.
    let second = sweep(&mut tb.board, &signaller, ended_at + GRACE_MS);
    assert_eq!(second, vec![task]);
    assert_eq!(signaller.sent(), vec![(pid, Signal::SIGTERM)]);
    assert!(
        exits_within_settle(&mut worker),
        "worker {pid} survived the reaper"
    );
    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    assert_eq!(
        events_of(&mut tb.board, task, "terminal_worker_reaped").len(),
        1
    );
}

#[test]
fn one_failing_row_does_not_abort_the_sweep() {
    let mut tb = temp_board();
    let (mut broken, broken_fp) = sleeper(120);
    let (mut healthy, healthy_fp) = sleeper(120);
    let ended_at = now_millis();
    // The broken row closed first, so the sweep (oldest first) meets the failure first.
    let (broken_task, broken_run) = completed_with_worker(
        &mut tb.board,
        "broken",
        broken.pid(),
        Some(&broken_fp),
        ended_at,
    );
    let (healthy_task, healthy_run) = completed_with_worker(
        &mut tb.board,
        "healthy",
        healthy.pid(),
        Some(&healthy_fp),
        ended_at + 1,
    );

    let signaller = FailingFor::new(broken.pid());
    let reaped = sweep(&mut tb.board, &signaller, ended_at + 600_000);

    assert_eq!(reaped, vec![healthy_task]);
    assert_eq!(
        signaller.inner.sent(),
        vec![(healthy.pid(), Signal::SIGTERM)]
    );
    assert!(
        exits_within_settle(&mut healthy),
        "the healthy worker survived"
    );
    assert_evidence_cleared(&run(&mut tb.board, healthy_run), healthy.pid());
    // The failed row keeps its evidence and gets no verdict event: it is retried later.
    assert!(still_running(&mut broken));
    assert_evidence_kept(
        &run(&mut tb.board, broken_run),
        broken.pid(),
        Some(&broken_fp),
    );
    assert_no_reaper_event(&mut tb.board, broken_task, "the failing row is kept");

    // A later sweep with a working signaller ends it.
    let retried = sweep(&mut tb.board, &PidfdSignaller, ended_at + 660_000);
    assert_eq!(retried, vec![broken_task]);
    assert!(
        exits_within_settle(&mut broken),
        "the retried worker survived"
    );
    assert_evidence_cleared(&run(&mut tb.board, broken_run), broken.pid());
}

#[test]
fn stale_expected_run_is_refused() {
    let mut tb = temp_board();
    let t = now_millis();
    let (task, old_run, new_run) = tb
        .board
        .write(|tx| {
            let task = tx
                .create_task(&NewTask::titled("reclaimed").for_assignee("coder"), t)?
                .id;
            let old = tx.claim_task(task, "first", t, LEASE_MS)?;
            tx.reclaim_task(task, "lease expired", t + 1)?;
            let new = tx.claim_task(task, "second", t + 2, LEASE_MS)?;
            Ok((task, old.run_id, new.run_id))
        })
        .unwrap();
    assert_ne!(old_run, new_run);

    // The first worker reports late, with the run it was started for.
    let err = tb
        .board
        .write(|tx| tx.complete_task(task, Some(old_run), Some("late"), t + 3))
        .unwrap_err();
    match &err {
        BoardError::StaleRun {
            task: t_id,
            expected,
            current,
        } => {
            assert_eq!(*t_id, task);
            assert_eq!(*expected, old_run);
            assert_eq!(*current, new_run.to_string());
        }
        other => panic!("expected StaleRun, got {other:?}"),
    }
    assert_eq!(err.code(), "stale_run");

    let (status, current, run_open, completed_events) = tb
        .board
        .read(|tx| {
            let task_row = tx.get_task(task)?;
            let run_row = tx.get_run(new_run)?;
            let events = tx.task_events_since(task, 0, 1000)?;
            Ok((
                task_row.status,
                task_row.current_run_id,
                run_row.is_open(),
                events.iter().filter(|e| e.kind == "completed").count(),
            ))
        })
        .unwrap();
    assert_eq!(status, TaskStatus::Running);
    assert_eq!(current, Some(new_run));
    assert!(run_open, "the new run is untouched");
    assert_eq!(completed_events, 0);

    // The current run can still complete.
    tb.board
        .write(|tx| tx.complete_task(task, Some(new_run), Some("ok"), t + 4))
        .unwrap();
    assert_eq!(
        tb.board.read(|tx| tx.task_status(task)).unwrap(),
        TaskStatus::Done
    );
}

#[test]
fn reaper_ends_the_workers_whole_process_group() {
    let mut tb = temp_board();
    let (mut leader, fp) = group_leader("sleep 120 & sleep 120 & wait");
    let pgid = leader.pid();
    assert!(
        wait_until(SETTLE, || group_members(pgid).len() == 3),
        "group {pgid} never had its 3 members: {:?}",
        group_members(pgid)
    );
    let ended_at = now_millis();
    let (task, run_id) = completed_with_worker(&mut tb.board, "group", pgid, Some(&fp), ended_at);

    let signaller = RecordingSignaller::default();
    let reaped = sweep(&mut tb.board, &signaller, ended_at + 600_000);

    assert_eq!(reaped, vec![task]);
    assert_eq!(signaller.sent(), vec![(pgid, Signal::SIGTERM)]);
    assert!(exits_within_settle(&mut leader), "the leader survived");
    assert!(
        wait_until(SETTLE, || !group_alive(pgid)),
        "members of group {pgid} survived the reaper: {:?}",
        group_members(pgid)
    );
    assert_evidence_cleared(&run(&mut tb.board, run_id), pgid);
}

#[test]
fn worker_ignoring_sigterm_is_killed_after_the_kill_timeout() {
    let mut tb = temp_board();
    let (mut worker, fp) = group_leader("trap '' TERM; exec sleep 120");
    let pid = worker.pid();
    // The trap is in place once the shell has exec'd sleep (the ignored disposition survives
    // exec); signalling earlier would kill the shell with SIGTERM.
    assert!(
        wait_until(SETTLE, || read_stat(pid).is_ok_and(|s| s.comm == "sleep")),
        "the worker never exec'd sleep"
    );
    let ended_at = now_millis();
    let (task, run_id) = completed_with_worker(&mut tb.board, "stubborn", pid, Some(&fp), ended_at);

    let signaller = RecordingSignaller::default();
    let reaped = reap_terminal_workers(
        &mut tb.board,
        &signaller,
        ended_at + 600_000,
        GRACE,
        Duration::from_millis(200),
    )
    .unwrap();

    assert_eq!(reaped, vec![task]);
    assert_eq!(
        signaller.sent(),
        vec![(pid, Signal::SIGTERM), (pid, Signal::SIGKILL)]
    );
    assert!(
        exits_within_settle(&mut worker),
        "the worker survived SIGKILL"
    );
    let status = worker.try_wait().unwrap().expect("reaped above");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(Signal::SIGKILL as i32)
    );
    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    let reaped_ev = events_of(&mut tb.board, task, "terminal_worker_reaped");
    assert_eq!(reaped_ev.len(), 1);
    assert_eq!(reaped_ev[0].payload["ended_by"], "sigkill");
}

/// The leader exited (a zombie its parent has not reaped yet) but its children live on in its
/// group: the worker is not gone, and the reaper must end the group through the leader's pidfd
/// (which `process::open_verified` allows for exactly this case) rather than clear the
/// evidence as gone and leave the descendants running forever.
#[test]
fn zombie_leader_with_live_members_is_reaped_not_forgotten() {
    let mut tb = temp_board();
    let (mut leader, fp) = group_leader("sleep 120 & exit 0");
    let pgid = leader.pid();
    assert!(
        wait_until(SETTLE, || {
            read_stat(pgid).is_ok_and(|s| s.is_zombie()) && group_alive(pgid)
        }),
        "never saw a zombie leader {pgid} with a live group: {:?}",
        read_stat(pgid)
    );
    let members = group_members(pgid);
    assert_eq!(members.len(), 1, "{members:?}");
    let ended_at = now_millis();
    let (task, run_id) =
        completed_with_worker(&mut tb.board, "zombie leader", pgid, Some(&fp), ended_at);

    let signaller = RecordingSignaller::default();
    let reaped = sweep(&mut tb.board, &signaller, ended_at + 600_000);

    let group_left = wait_until(SETTLE, || !group_alive(pgid));
    let kinds_now = kinds(&mut tb.board, task);
    assert!(
        group_left,
        "the worker's group {pgid} was left running ({:?}); sweep returned {reaped:?}, \
         signals {:?}, events {kinds_now:?}",
        group_members(pgid),
        signaller.sent()
    );
    assert_eq!(reaped, vec![task]);
    assert_eq!(signaller.sent(), vec![(pgid, Signal::SIGTERM)]);
    assert_evidence_cleared(&run(&mut tb.board, run_id), pgid);
    assert_eq!(
        events_of(&mut tb.board, task, "terminal_worker_reaped").len(),
        1
    );
    assert!(exits_within_settle(&mut leader));
}

/// A leftover tree (a previous incarnation's worker, now the sweep's) whose leader ignores
/// SIGTERM and whose escapee (`setsid`, found by the run's token) does not: the escapee gets its
/// SIGTERM with the group's, while the leader still runs, not once the group is gone a whole
/// `kill_timeout` later; and it gets one.
#[test]
fn a_leftover_trees_escapee_gets_its_sigterm_with_the_group() {
    let mut tb = temp_board();
    let dir = tb.dir.path().to_path_buf();
    let (task, run_id, token) = claimed(&mut tb);
    // The escapee starts before the leader ignores SIGTERM (a disposition ignored on entry
    // cannot be trapped by sh). On SIGTERM it writes the leader's state, and leaves.
    let script = r#"L=$$; export L
setsid sh -c 'trap "grep ^State: /proc/$L/status >> term; exit 0" TERM; echo $$ > esc.tmp; mv esc.tmp esc; while :; do sleep 0.05 & wait $!; done' &
trap '' TERM; while :; do sleep 0.05; done"#;
    let mut leader = run_leader("sh", "-c", script, &dir, &token);
    let pid = leader.pid();
    let fp = fingerprint(pid).expect("the leader's fingerprint");
    let escapee = seen(wait_pid_file(&dir.join("esc"), SETTLE));
    let _pin = escapee.pin();
    assert!(
        wait_until(SETTLE, || ignores_sigterm(pid)),
        "the leader never ignored SIGTERM"
    );
    let reaped = close_and_sweep(&mut tb, task, run_id, pid, &fp, Duration::from_secs(2));

    assert_eq!(reaped, vec![task]);
    let term = std::fs::read_to_string(dir.join("term")).unwrap_or_default();
    let states: Vec<&str> = term.lines().collect();
    assert_eq!(
        states.len(),
        1,
        "the escapee got one SIGTERM while the leader's /proc entry was there: {term:?}"
    );
    assert!(
        !states[0].contains("zombie"),
        "the escapee got its SIGTERM only once the leader was dead: {term:?}"
    );
    assert!(!escapee.alive(), "{escapee:?} outlived the reap");
    assert!(exits_within_settle(&mut leader), "the leader survived");
    let status = leader.try_wait().unwrap().expect("reaped above");
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(Signal::SIGKILL as i32),
        "the leader ignores SIGTERM"
    );
    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    let reaped_ev = events_of(&mut tb.board, task, "terminal_worker_reaped");
    assert_eq!(reaped_ev.len(), 1);
    assert_eq!(reaped_ev[0].payload["ended_by"], "sigkill");
}

/// True once `pid`'s status shows SIGTERM ignored (SigIgn, bit 15).
fn ignores_sigterm(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("SigIgn:"))
                .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        })
        .is_some_and(|mask| mask & (1 << (libc::SIGTERM - 1)) != 0)
}

/// A leader that left its group for one its own (token-carrying) child leads: the reaper's
/// signaller gives it its SIGTERM where it is, and the child's group is then not signalled as
/// a whole, which would give the leader a second one. Each gets one.
#[test]
fn a_leader_in_a_group_its_child_leads_gets_one_sigterm() {
    let mut tb = temp_board();
    let dir = tb.dir.path().to_path_buf();
    let (task, run_id, token) = claimed(&mut tb);
    // Each counts its SIGTERMs and ignores them; `ready` once its trap is set.
    let counter = |name: &str| {
        format!(
            "trap 'echo TERM >> {name}.terms' TERM; : > {name}.ready; while :; do sleep 0.05 & wait $!; done"
        )
    };
    let script = format!(
        r#"my $c = fork // die;
if (!$c) {{ setpgrp(0, 0) or die; exec "sh", "-c", q({child}) or die }}
select(undef, undef, undef, 0.01) until -e "child.ready";
setpgrp(0, $c) or die "join: $!";
exec "sh", "-c", q({leader}) or die"#,
        child = counter("child"),
        leader = counter("leader"),
    );
    let mut leader = run_leader("perl", "-e", &script, &dir, &token);
    let pid = leader.pid();
    let fp = fingerprint(pid).expect("the leader's fingerprint");
    assert!(
        wait_until(SETTLE, || dir.join("leader.ready").exists()),
        "the leader never set its trap"
    );
    let child_group = read_stat(pid).expect("the leader's stat").pgrp;
    assert_ne!(
        child_group, pid,
        "the leader never moved to its child's group"
    );
    let child = seen(child_group);
    let _pin = child.pin();
    let reaped = close_and_sweep(&mut tb, task, run_id, pid, &fp, Duration::from_millis(700));

    assert_eq!(reaped, vec![task]);
    assert!(exits_within_settle(&mut leader), "the leader survived");
    assert!(!child.alive(), "{child:?} outlived the reap");
    for name in ["leader", "child"] {
        let terms = std::fs::read_to_string(dir.join(format!("{name}.terms"))).unwrap_or_default();
        assert_eq!(terms.lines().count(), 1, "the {name}'s SIGTERMs: {terms:?}");
    }
}

/// Passes SIGTERM on and refuses SIGKILL (a broken kill path).
struct KillRefused(RecordingSignaller);

impl Signaller for KillRefused {
    fn send(&self, pid: i32, expected: &Fingerprint, sig: Signal) -> Result<Sent, ProcessError> {
        if sig == Signal::SIGKILL {
            return Err(ProcessError::Io {
                pid,
                what: "pidfd_send_signal (injected failure)",
                source: std::io::Error::other("boom"),
            });
        }
        self.0.send(pid, expected, sig)
    }

    fn send_group(&self, leader: &PidFd, sig: Signal) -> Result<Sent, ProcessError> {
        self.send(leader.pid(), &fingerprint(leader.pid())?, sig)
    }
}

/// The leader and its group are the signaller's: when it refuses their SIGKILL, nothing else
/// kills them behind its back (and off the record). The run keeps its evidence, and the next
/// sweep ends them and says so. The escapee outside the group is ended with the first sweep.
#[test]
fn a_refused_sigkill_leaves_the_leader_and_its_group_to_the_next_sweep() {
    let mut tb = temp_board();
    let dir = tb.dir.path().to_path_buf();
    let (task, run_id, token) = claimed(&mut tb);
    let script = r#"setsid sh -c 'trap "" TERM; echo $$ > esc.tmp; mv esc.tmp esc; while :; do sleep 0.05; done' &
trap '' TERM; sleep 120 & : > ready; while :; do sleep 0.05; done"#;
    let mut leader = run_leader("sh", "-c", script, &dir, &token);
    let pid = leader.pid();
    let fp = fingerprint(pid).expect("the leader's fingerprint");
    let escapee = seen(wait_pid_file(&dir.join("esc"), SETTLE));
    let _pin = escapee.pin();
    assert!(
        wait_until(SETTLE, || dir.join("ready").exists()),
        "the leader never got going"
    );
    let member = *group_members(pid)
        .iter()
        .find(|&&m| cmdline_is(m, "sleep 120"))
        .expect("the group's sleep 120");
    let ended_at = now_millis();
    close_with_worker(&mut tb, task, run_id, pid, &fp, ended_at);

    let refusing = KillRefused(RecordingSignaller::default());
    let reaped = reap_terminal_workers(
        &mut tb.board,
        &refusing,
        ended_at + 600_000,
        GRACE,
        Duration::from_millis(500),
    )
    .unwrap();

    assert_eq!(reaped, Vec::<i64>::new(), "the end failed");
    assert_eq!(refusing.0.sent(), vec![(pid, Signal::SIGTERM)]);
    assert!(
        still_running(&mut leader),
        "the leader was killed off the signaller"
    );
    assert!(
        matches!(
            liveness(member, &fingerprint(member).unwrap()),
            Liveness::Alive
        ),
        "the group's member was killed off the signaller"
    );
    assert!(
        wait_until(SETTLE, || !escapee.alive()),
        "{escapee:?} outside the group outlived the sweep"
    );
    assert_evidence_kept(&run(&mut tb.board, run_id), pid, Some(&fp));

    let reaped = reap_terminal_workers(
        &mut tb.board,
        &PidfdSignaller,
        ended_at + 600_000,
        GRACE,
        Duration::from_millis(500),
    )
    .unwrap();
    assert_eq!(reaped, vec![task]);
    assert!(exits_within_settle(&mut leader), "the leader survived");
    assert!(
        wait_until(SETTLE, || !group_alive(pid)),
        "the group survived"
    );
    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    let reaped_ev = events_of(&mut tb.board, task, "terminal_worker_reaped");
    assert_eq!(reaped_ev.len(), 1);
    assert_eq!(reaped_ev[0].payload["ended_by"], "sigkill");
}

/// A task for `coder`, claimed a second ago: its id, its run's and the run's token.
fn claimed(tb: &mut common::board::TempBoard) -> (i64, i64, String) {
    let started = now_millis() - 1000;
    let Claim {
        task_id,
        run_id,
        token,
        ..
    } = tb
        .board
        .write(|tx| {
            let task = tx
                .create_task(&NewTask::titled("tree").for_assignee("coder"), started)?
                .id;
            tx.claim_task(task, "test-claimer", started, LEASE_MS)
        })
        .expect("create and claim");
    (task_id, run_id, token)
}

/// [`close_with_worker`] now, then one sweep with the real signaller long after the grace,
/// with `kill_timeout`: the tasks whose worker it ended.
fn close_and_sweep(
    tb: &mut common::board::TempBoard,
    task: i64,
    run_id: i64,
    pid: i32,
    fp: &Fingerprint,
    kill_timeout: Duration,
) -> Vec<i64> {
    let ended_at = now_millis();
    close_with_worker(tb, task, run_id, pid, fp, ended_at);
    reap_terminal_workers(
        &mut tb.board,
        &PidfdSignaller,
        ended_at + 600_000,
        GRACE,
        kill_timeout,
    )
    .unwrap()
}

/// Records `pid` as the run's worker and closes the run (completed) at `ended_at`.
fn close_with_worker(
    tb: &mut common::board::TempBoard,
    task: i64,
    run_id: i64,
    pid: i32,
    fp: &Fingerprint,
    ended_at: i64,
) {
    tb.board
        .write(|tx| {
            tx.set_worker(run_id, pid, Some(fp), None, ended_at - 500)?;
            tx.complete_task(task, Some(run_id), Some("done"), ended_at)
        })
        .expect("record the worker and complete");
}

/// `program flag script` in `dir`, leading a process group of its own, with the run's token.
fn run_leader(
    program: &str,
    flag: &str,
    script: &str,
    dir: &std::path::Path,
    token: &str,
) -> ChildGuard {
    ChildGuard::spawn(
        Command::new(program)
            .args([flag, script])
            .current_dir(dir)
            .env("RUNWARDEN_RUN_TOKEN", token)
            .stdin(Stdio::null())
            .process_group(0),
    )
    .expect("spawn the leader")
}

fn cmdline_is(pid: i32, want: &str) -> bool {
    common::lifecycle::cmdline(pid) == want
}
