//! Crashing workers, with real processes under a library supervisor: an exit code and a
//! SIGKILL each close the run `crashed` with what happened; a crash does not disturb the other
//! live workers; retries follow `max_retries` and the backoff.

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::runtime::{SETTLE, TestDir, WorkerGuard, lib_config, wait_worker};
use runwarden::board::{Event, NewTask, Run, RunOutcome, TaskId, TaskStatus};
use runwarden::config::AssigneeConfig;
use runwarden::process::Signal;
use runwarden::{Supervisor, SupervisorHandle};

fn assignee(script: &str, max_retries: u32) -> AssigneeConfig {
    let mut a = AssigneeConfig::new(["sh", "-c", script]);
    a.max_retries = Some(max_retries);
    a
}

fn add(sup: &SupervisorHandle, title: &str, who: &str) -> TaskId {
    sup.add_task(NewTask::titled(title).for_assignee(who))
        .expect("add task")
        .id
}

fn finish(sup: &SupervisorHandle, id: TaskId) -> (TaskStatus, Vec<Run>, Vec<Event>) {
    let task = sup.wait_for(id, SETTLE).expect("task finishes");
    let detail = sup.task(id).expect("task detail");
    (task.status, detail.runs, detail.events)
}

fn kinds(events: &[Event]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

#[test]
fn an_exit_code_crashes_the_run_and_leaves_other_workers_alone() {
    let td = TestDir::new();
    let gate = td.path().join("go");
    let mut config = lib_config(&td);
    config.assignees.insert(
        "crash".into(),
        assignee("echo about to fail >&2; exit 3", 0),
    );
    // A long-ish worker of another assignee: runs until the test opens the gate.
    let mut long = assignee(
        "while [ ! -e \"$GATE\" ]; do sleep 0.02; done; echo finished",
        0,
    );
    long.env.insert("GATE".into(), gate.display().to_string());
    config.assignees.insert("long".into(), long);
    let sup = Supervisor::start(config).expect("start the supervisor");

    let long_id = add(&sup, "long", "long");
    let (long_pid, long_fp) = wait_worker(&sup, long_id);
    let long_worker = WorkerGuard::pin(long_pid, &long_fp);

    let crash_id = add(&sup, "crash", "crash");
    let (status, runs, events) = finish(&sup, crash_id);
    assert_eq!(
        status,
        TaskStatus::Blocked,
        "max_retries 0: gives up at once"
    );
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = &runs[0];
    assert_eq!(run.outcome, Some(RunOutcome::Crashed), "{run:?}");
    assert_eq!(run.exit_code, Some(3), "{run:?}");
    assert_eq!(run.exit_signal, None, "{run:?}");
    let error = run.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("code 3"),
        "the error names the exit code: {error:?}"
    );
    assert!(
        error.contains("about to fail"),
        "and carries the log's tail: {error:?}"
    );
    assert!(run.spawned_pid.is_some(), "{run:?}");
    assert_eq!(
        run.worker_pid, None,
        "evidence cleared once reaped: {run:?}"
    );
    let gave_up: Vec<_> = events.iter().filter(|e| e.kind == "gave_up").collect();
    assert_eq!(gave_up.len(), 1, "{:?}", kinds(&events));
    assert!(
        !kinds(&events).contains(&"retry_scheduled"),
        "{:?}",
        kinds(&events)
    );

    // The other worker never noticed.
    assert!(
        long_worker.alive(),
        "the long worker was disturbed by the crash"
    );
    let long_task = sup.task(long_id).expect("task detail").task;
    assert_eq!(long_task.status, TaskStatus::Running, "{long_task:?}");
    std::fs::write(&gate, b"").expect("open the gate");
    let (status, runs, _) = finish(&sup, long_id);
    assert_eq!(status, TaskStatus::Done);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert_eq!(
        runs[0].outcome,
        Some(RunOutcome::Completed),
        "{:?}",
        runs[0]
    );
    assert_eq!(runs[0].exit_code, Some(0), "{:?}", runs[0]);
    sup.shutdown();
}

#[test]
fn a_worker_killed_by_sigkill_crashes_its_run_with_signal_9() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // No shell: the worker is `sleep` itself.
    let mut victim = AssigneeConfig::new(["sleep", "300"]);
    victim.max_retries = Some(0);
    config.assignees.insert("victim".into(), victim);
    let sup = Supervisor::start(config).expect("start the supervisor");

    let id = add(&sup, "victim", "victim");
    let (pid, fp) = wait_worker(&sup, id);
    // The pid as the run row has it.
    let row_pid = sup.task(id).expect("task detail").runs[0].worker_pid;
    assert_eq!(row_pid, Some(i64::from(pid)));
    let worker = WorkerGuard::pin(pid, &fp);
    worker
        .pidfd()
        .signal(Signal::SIGKILL)
        .expect("SIGKILL the worker");

    let (status, runs, events) = finish(&sup, id);
    assert_eq!(status, TaskStatus::Blocked);
    assert_eq!(runs.len(), 1, "{runs:?}");
    let run = &runs[0];
    assert_eq!(run.outcome, Some(RunOutcome::Crashed), "{run:?}");
    assert_eq!(run.exit_signal, Some(9), "{run:?}");
    assert_eq!(run.exit_code, None, "{run:?}");
    let error = run.error.as_deref().unwrap_or_default();
    assert!(
        error.contains("SIGKILL"),
        "the error names the signal: {error:?}"
    );
    assert!(kinds(&events).contains(&"gave_up"), "{:?}", kinds(&events));
    sup.shutdown();
}

#[test]
fn a_crash_is_retried_once_with_max_retries_1() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    let backoff = Duration::from_millis(100);
    config.retries.backoff = backoff;
    config
        .assignees
        .insert("flaky".into(), assignee("exit 3", 1));
    let sup = Supervisor::start(config).expect("start the supervisor");

    let id = add(&sup, "flaky", "flaky");
    let (status, runs, events) = finish(&sup, id);
    assert_eq!(status, TaskStatus::Blocked, "{:?}", kinds(&events));
    assert_eq!(runs.len(), 2, "one run and one retry: {runs:?}");
    for (attempt, run) in runs.iter().enumerate() {
        assert_eq!(run.attempt, attempt as i64 + 1, "{run:?}");
        assert_eq!(run.outcome, Some(RunOutcome::Crashed), "{run:?}");
        assert_eq!(run.exit_code, Some(3), "{run:?}");
    }
    let retry: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "retry_scheduled")
        .collect();
    assert_eq!(retry.len(), 1, "{:?}", kinds(&events));
    let gave_up: Vec<_> = events.iter().filter(|e| e.kind == "gave_up").collect();
    assert_eq!(gave_up.len(), 1, "{:?}", kinds(&events));
    assert_eq!(gave_up[0].run_id, Some(runs[1].id), "gave up on the retry");
    // The retry waited for its backoff (±20 % jitter).
    let not_before = retry[0].payload["not_before"].as_i64().expect("not_before");
    let first_end = runs[0].ended_at.expect("first run closed");
    assert!(
        not_before - first_end >= (backoff.as_millis() as i64) * 8 / 10,
        "backoff {backoff:?} applied: {not_before} - {first_end}"
    );
    assert!(
        runs[1].started_at >= not_before,
        "the retry started at {} before its not_before {not_before}",
        runs[1].started_at
    );
    let task = sup.task(id).expect("task detail").task;
    assert_eq!(task.consecutive_failures, 2, "{task:?}");
    sup.shutdown();
}
