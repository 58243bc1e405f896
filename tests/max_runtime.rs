//! Max runtime, end to end with real workers: a run that exceeds it is closed `timed_out` and
//! its worker's whole group is ended — SIGTERM, and SIGKILL after `kill_timeout` for a worker
//! that ignores SIGTERM. A task's own `max_runtime` overrides its assignee's, both ways.

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::{View, add, sh_assignee, task_for, wait_all_dead, wait_run_count};
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{NewTask, RunOutcome, TaskId, TaskStatus};

/// The worker leader and two background sleeps: one process group of three.
const GROUP_OF_THREE: &str = "sleep 300 & sleep 300 & wait";

/// Checks the timed-out run of `task` (its only run): closed `timed_out` no earlier than
/// `limit` after it started (and not much later), before its worker exited; returns the
/// delay between the close and the worker's exit, and the signal that ended it.
fn timed_out_run(sup: &mut impl View, task: TaskId, limit: Duration) -> (i64, i64) {
    let runs = sup.runs(task);
    assert_eq!(runs.len(), 1, "{}", sup.history(task));
    let run = &runs[0];
    assert_eq!(
        run.outcome,
        Some(RunOutcome::TimedOut),
        "{}",
        sup.history(task)
    );
    let error = run.error.as_deref().unwrap_or_default();
    assert!(error.contains("exceeded max runtime"), "{error}");
    let ran = run.ended_at.unwrap() - run.started_at;
    let limit_ms = limit.as_millis() as i64;
    assert!(
        (limit_ms..limit_ms + 1_500).contains(&ran),
        "closed {ran} ms after the start; max runtime {limit_ms} ms"
    );
    let closed = sup.wait_event(task, "run_closed", SETTLE);
    let exited = sup.wait_event(task, "worker_exited", SETTLE);
    assert!(
        closed.id < exited.id,
        "the run closes before its worker is ended"
    );
    let signal = exited.payload["signal"].as_i64().unwrap_or_else(|| {
        panic!(
            "the worker was ended by a signal: {exited:?}\n{}",
            sup.history(task)
        )
    });
    assert_eq!(sup.run(run.id).exit_signal, Some(signal));
    (exited.at - closed.at, signal)
}

#[test]
fn an_overrun_worker_group_is_terminated_and_its_run_closes_timed_out() {
    let td = TestDir::new();
    let limit = Duration::from_millis(600);
    let kill_timeout = Duration::from_secs(3);
    let mut config = lib_config(&td);
    config.retries.max_retries = 0;
    config.reaper.kill_timeout = kill_timeout;
    let mut w = sh_assignee(GROUP_OF_THREE);
    w.max_runtime = Some(limit);
    config.assignees.insert("w".into(), w);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("too slow", "w"));
    sup.wait_event(task, "worker_spawned", SETTLE);
    let token = sup.runs(task)[0].token.clone();
    let procs = wait_run_count(&token, 3, SETTLE);

    let blocked = sup.wait_status(task, TaskStatus::Blocked, SETTLE);
    let (kill_delay, signal) = timed_out_run(&mut sup, task, limit);
    assert_eq!(signal, libc::SIGTERM as i64, "SIGTERM sufficed");
    assert!(
        kill_delay < kill_timeout.as_millis() as i64,
        "ended {kill_delay} ms after the close"
    );
    assert!(wait_all_dead(&procs, SETTLE), "survivors: {procs:?}");
    assert!(
        blocked
            .block_reason
            .unwrap_or_default()
            .contains("exceeded max runtime")
    );
    sup.shutdown();
}

#[test]
fn a_worker_ignoring_sigterm_is_killed_after_the_kill_timeout() {
    let td = TestDir::new();
    let limit = Duration::from_millis(500);
    let kill_timeout = Duration::from_millis(800);
    let mut config = lib_config(&td);
    config.retries.max_retries = 0;
    config.reaper.kill_timeout = kill_timeout;
    // The ignored disposition is inherited by the sleeps: the whole group ignores SIGTERM.
    let mut w = sh_assignee(&format!("trap '' TERM; {GROUP_OF_THREE}"));
    w.max_runtime = Some(limit);
    config.assignees.insert("w".into(), w);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("deaf", "w"));
    sup.wait_event(task, "worker_spawned", SETTLE);
    let token = sup.runs(task)[0].token.clone();
    let procs = wait_run_count(&token, 3, SETTLE);

    sup.wait_status(task, TaskStatus::Blocked, SETTLE);
    let (kill_delay, signal) = timed_out_run(&mut sup, task, limit);
    assert_eq!(
        signal,
        libc::SIGKILL as i64,
        "SIGKILL after the kill timeout"
    );
    // Event times are in ms and the close precedes the SIGTERM slightly: allow 50 ms.
    assert!(
        kill_delay >= kill_timeout.as_millis() as i64 - 50,
        "SIGKILL came {kill_delay} ms after the close, kill_timeout {kill_timeout:?}"
    );
    assert!(wait_all_dead(&procs, SETTLE), "survivors: {procs:?}");
    sup.shutdown();
}

#[test]
fn a_tasks_max_runtime_overrides_its_assignees() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.retries.max_retries = 0;
    let mut long = sh_assignee("sleep 300");
    long.max_runtime = Some(Duration::from_secs(60));
    config.assignees.insert("long".into(), long);
    let mut short = sh_assignee("sleep 1.5");
    short.max_runtime = Some(Duration::from_millis(500));
    short.max_in_progress = 2;
    config.assignees.insert("short".into(), short);
    let mut sup = Supervisor::start(config).expect("start the supervisor");

    // Shorter than the assignee's 60 s: timed out at 500 ms.
    let tightened = add(
        &sup,
        NewTask {
            max_runtime_ms: Some(500),
            ..task_for("task limit 500 ms", "long")
        },
    );
    // Longer than the assignee's 500 ms: its 1.5 s of work completes.
    let loosened = add(
        &sup,
        NewTask {
            max_runtime_ms: Some(5_000),
            ..task_for("task limit 5 s", "short")
        },
    );
    // Control: the assignee's 500 ms applies without a task limit.
    let default = add(&sup, task_for("assignee limit 500 ms", "short"));

    sup.wait_status(tightened, TaskStatus::Blocked, SETTLE);
    timed_out_run(&mut sup, tightened, Duration::from_millis(500));
    sup.wait_status(default, TaskStatus::Blocked, SETTLE);
    timed_out_run(&mut sup, default, Duration::from_millis(500));
    sup.wait_status(loosened, TaskStatus::Done, SETTLE);
    let runs = sup.runs(loosened);
    assert_eq!(runs.len(), 1, "{}", sup.history(loosened));
    assert_eq!(runs[0].outcome, Some(RunOutcome::Completed));
    assert_eq!(runs[0].exit_code, Some(0));
    assert!(runs[0].ended_at.unwrap() - runs[0].started_at >= 1_500);
    sup.shutdown();
}
