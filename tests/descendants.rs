//! Descendants of a worker, including one that escaped its process group and session with
//! `setsid`, are ended with it once its run's grace has passed — with the real
//! `runwarden serve` (a child subreaper, so the escapee re-parents to it) and a worker that
//! reports over the control socket with `runwarden complete`:
//!
//! ```sh
//! sleep 300 & setsid sh -c "sleep 301 &" ; runwarden complete --result ok; sleep 302
//! ```
//!
//! The three sleeps are found through `/proc` (they carry the run's `RUNWARDEN_RUN_TOKEN`) and
//! pinned by fingerprint before the grace ends; afterwards each is dead (or its pid recycled,
//! which the fingerprint tells apart).

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::{Db, View, now, open_gate, wait_for_gate, wait_run_procs};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir};
use runwarden::board::{NewTask, Run, RunOutcome, TaskId, TaskStatus, now_millis};
use runwarden::process::{Signal, read_stat};

const WORKER: &str =
    r#"sleep 300 & setsid sh -c "sleep 301 &" ; runwarden complete --result ok; sleep 302"#;

/// Starts `serve` with reaper `grace`, assignee `w` running `sh -c worker` (plus the assignee
/// keys in `extra`), and one task for it; returns once its worker is spawned.
fn start_one(td: &TestDir, grace: &str, worker: &str, extra: &str) -> (Serve, Db, TaskId, Run) {
    start_ticking(td, "100ms", grace, worker, extra)
}

/// [`start_one`] with the supervisor's `tick`.
fn start_ticking(
    td: &TestDir,
    tick: &str,
    grace: &str,
    worker: &str,
    extra: &str,
) -> (Serve, Db, TaskId, Run) {
    let config = td.write_config(
        &format!("tick = {tick:?}"),
        &format!(
            "[reaper]\ngrace = {grace:?}\nkill_timeout = \"1s\"\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\n{extra}"
        ),
    );
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let task = db.write(|tx| {
        Ok(tx
            .create_task(&NewTask::titled("w").for_assignee("w"), now_millis())?
            .id)
    });
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    db.wait_event(task, "worker_spawned", SETTLE);
    let run = db.runs(task)[0].clone();
    (serve, db, task, run)
}

#[test]
fn a_finished_runs_descendants_are_all_ended_after_the_grace() {
    let td = TestDir::new();
    // Long enough for the test to see the run close and start watching well before it ends.
    let grace = Duration::from_millis(3000);
    let (mut serve, mut db, task, run) = start_one(&td, "3000ms", WORKER, "");
    let worker_pid = run.spawned_pid.expect("spawned pid") as i32;
    let sleeps = wait_run_procs(&run.token, &["sleep 300", "sleep 301", "sleep 302"], SETTLE);
    let seen_at = now();
    // Pinned: whatever happens below, they are SIGKILLed by pid through a verified pidfd.
    let _pins: Vec<_> = sleeps.iter().filter_map(|s| s.pin()).collect();

    // The scenario is what it says: 301 left the worker's group and session and was
    // re-parented to the supervisor; 300 and 302 stayed in the worker's group.
    let stat = |pid| read_stat(pid).expect("stat of a live sleep");
    let escaped = stat(sleeps[1].pid);
    assert_ne!(
        escaped.pgrp, worker_pid,
        "sleep 301 left the group: {escaped:?}"
    );
    assert_ne!(
        escaped.session,
        stat(worker_pid).session,
        "and the session: {escaped:?}"
    );
    assert_eq!(
        escaped.ppid,
        serve.pid(),
        "re-parented to the subreaper: {escaped:?}"
    );
    for s in [&sleeps[0], &sleeps[2]] {
        assert_eq!(stat(s.pid).pgrp, worker_pid, "{s:?} in the worker's group");
    }

    let done = db.wait_status(task, TaskStatus::Done, SETTLE);
    assert_eq!(
        done.result.as_deref(),
        Some("ok"),
        "reported by `runwarden complete`"
    );
    let run = db.run(run.id);
    assert_eq!(
        run.outcome,
        Some(RunOutcome::Completed),
        "{}",
        db.history(task)
    );
    let ended_at = run.ended_at.unwrap();
    let due = ended_at + grace.as_millis() as i64;
    assert!(
        seen_at < due,
        "the sleeps were recorded before the grace ended"
    );
    // The grace is honoured: all three still run shortly before it ends. The watch below
    // must start well before then, or an early kill would pass unseen: too late is a failure.
    let watch_from = now();
    assert!(
        watch_from < due - 300,
        "the test reached the grace check at {watch_from}, too close to its end at {due} to tell an early kill: the scenario did not run"
    );
    assert!(
        sleeps.iter().all(|s| s.alive()),
        "ended before the grace: {sleeps:?}"
    );

    // After the grace: each of the three is dead, first seen dead no earlier than the grace
    // (watched from before it ended, so an early death shows as an early time).
    let mut dead_at = vec![None; sleeps.len()];
    let all_dead = wait_until(grace + 2 * SETTLE, || {
        for (s, at) in sleeps.iter().zip(dead_at.iter_mut()) {
            if at.is_none() && !s.alive() {
                *at = Some(now());
            }
        }
        dead_at.iter().all(Option::is_some)
    });
    let alive: Vec<_> = sleeps.iter().filter(|s| s.alive()).collect();
    assert!(
        all_dead,
        "still alive after the grace: {alive:?}\n{}",
        serve.stderr()
    );
    for (s, at) in sleeps.iter().zip(&dead_at) {
        let at = at.unwrap();
        assert!(
            at >= due - 50,
            "{s:?} died at {at}, before the grace ended at {due}"
        );
    }
    let reaped = db.wait_event(task, "terminal_worker_reaped", SETTLE);
    assert_eq!(reaped.run_id, Some(run.id));

    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn an_escapee_of_a_worker_that_exited_by_itself_is_ended_with_its_run() {
    let td = TestDir::new();
    let (mut serve, mut db, task, run) = start_one(
        &td,
        "1m",
        "setsid sh -c 'sleep 303 &'; sleep 0.5; exit 0",
        "",
    );
    let escapee = wait_run_procs(&run.token, &["sleep 303"], SETTLE).remove(0);
    let _pin = escapee.pin();
    assert_eq!(
        read_stat(escapee.pid).expect("stat").ppid,
        serve.pid(),
        "re-parented to serve"
    );

    // The worker exits 0 on its own: the run completes, and the escapee carrying its token is
    // ended by the next tick (no grace: nothing of the run is left to finish).
    db.wait_status(task, TaskStatus::Done, SETTLE);
    let ended_at = db.run(run.id).ended_at.unwrap();
    assert!(
        wait_until(SETTLE, || !escapee.alive()),
        "the escapee outlived its run: {escapee:?}\n{}",
        serve.stderr()
    );
    assert!(
        now() - ended_at < 5_000,
        "ended long after its run ({} ms)",
        now() - ended_at
    );
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn what_a_reporting_worker_leaves_in_its_group_is_ended_when_it_exits_not_after_the_grace() {
    let td = TestDir::new();
    // Reports, leaves a member in its group, and exits once the test has seen it (its gate).
    let gates = td.path().join("gates");
    let worker = format!(
        "sleep 304 & runwarden complete --result ok && {}; exit 0",
        wait_for_gate(60)
    );
    let (mut serve, mut db, task, run) = start_one(
        &td,
        "1m",
        &worker,
        &format!("env = {{ GATE_DIR = {gates:?} }}\n"),
    );
    let worker_pid = run.spawned_pid.expect("spawned pid") as i32;
    let member = wait_run_procs(&run.token, &["sleep 304"], SETTLE).remove(0);
    let _pin = member.pin();
    assert_eq!(
        read_stat(member.pid).expect("stat").pgrp,
        worker_pid,
        "in the worker's group"
    );

    // Closed by the report (the grace would be a minute); the leader's exit ends the member.
    db.wait_status(task, TaskStatus::Done, SETTLE);
    assert!(member.alive(), "{member:?} ended before its leader exited");
    open_gate(&gates, task);
    let ended = db.wait_event(task, "worker_group_ended", SETTLE);
    assert!(!member.alive(), "{member:?} outlived its leader");
    let run = db.run(run.id);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    assert!(
        ended.at - run.ended_at.unwrap() < 30_000,
        "ended {} ms after the close, as if it had waited for the grace",
        ended.at - run.ended_at.unwrap()
    );
    assert_eq!(run.worker_pid, None, "evidence cleared: {run:?}");
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_retry_never_starts_beside_an_escapee_of_the_crashed_run() {
    let td = TestDir::new();
    let marks = td.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    // The first attempt leaves an escapee and crashes with a retry code; the retry (no
    // cooldown, a tick far away: only the exit's own transaction could start it at once) runs
    // until it is ended.
    let worker = format!(
        "if mkdir {m:?}/first 2>/dev/null; then setsid sleep 306 & sleep 0.3; exit 3; \
         else exec sleep 307; fi",
        m = marks.display().to_string()
    );
    let (mut serve, mut db, task, first) = start_ticking(
        &td,
        "3s",
        "2m",
        &worker,
        "retry_exit_codes = [3]\nretry_cooldown = \"0s\"\n",
    );
    let escapee = wait_run_procs(&first.token, &["sleep 306"], SETTLE).remove(0);
    let _pin = escapee.pin();

    // The crash keeps the run's evidence until the escapee is ended; only then is the task
    // claimed again.
    let mut retry = None;
    assert!(
        wait_until(SETTLE, || {
            retry = db
                .runs(task)
                .get(1)
                .filter(|r| r.spawned_pid.is_some())
                .cloned();
            retry.is_some()
        }),
        "no retry\n{}",
        db.history(task)
    );
    let retry = retry.unwrap();
    let second = wait_run_procs(&retry.token, &["sleep 307"], SETTLE).remove(0);
    let _pin2 = second.pin();
    assert!(
        !escapee.alive(),
        "run {} started {} while run {}'s escapee {escapee:?} still ran\n{}",
        retry.id,
        second.pid,
        first.id,
        db.history(task)
    );
    let first = db.run(first.id);
    assert_eq!(first.outcome, Some(RunOutcome::Crashed), "{first:?}");
    assert_eq!(first.worker_pid, None, "evidence cleared: {first:?}");
    let ended = db.wait_event(task, "worker_group_ended", SETTLE);
    assert_eq!(ended.run_id, Some(first.id));
    serve.stop_cleanly(Signal::SIGTERM);
}
