//! One task never has two workers. Two ways that could happen, each driven with real
//! processes:
//!
//! - a run is released (reclaimed) and its leader dies at once, but a member of its group
//!   ignores SIGTERM: the task must not be claimed again until that member is dead too;
//! - a supervisor died between starting a worker and recording it: the next one finds the
//!   worker by its run token and adopts it instead of starting a second one.

#[allow(dead_code)]
mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::lifecycle::{View, add, procs_of_run, sh_assignee, task_for, wait_run_count, write};
use common::proc_guard::{ChildGuard, wait_until};
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{Board, NewTask, RunOutcome, TaskStatus, now_millis};

#[test]
fn a_released_task_waits_until_its_previous_group_is_gone() {
    let td = TestDir::new();
    let kill_timeout = Duration::from_millis(1500);
    let mut config = lib_config(&td);
    config.reaper.kill_timeout = kill_timeout;
    // The leader dies of SIGTERM at once; the inner sh (and its sleep) ignore SIGTERM and live
    // until the SIGKILL, `kill_timeout` later.
    config.assignees.insert(
        "w".into(),
        sh_assignee("sh -c 'trap \"\" TERM; sleep 300' & exec sleep 1000"),
    );
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("stubborn", "w"));
    sup.wait_event(task, "worker_spawned", SETTLE);
    let first = sup.runs(task)[0].clone();
    // leader (sleep 1000), the TERM-ignoring sh and its sleep
    let procs = wait_run_count(&first.token, 3, SETTLE);

    write(&sup, move |tx, now| tx.reclaim_task(task, "test", now)).expect("reclaim");
    let released = Instant::now();
    // Until the whole first group is gone, no second run may start.
    let mut first_group_gone = None;
    assert!(
        wait_until(SETTLE, || {
            let alive = procs.iter().any(|p| p.alive());
            let runs = sup.runs(task);
            assert!(
                !(alive && runs.len() > 1),
                "a second run started while the first group lived: {:?} alive, runs {runs:?}",
                procs_of_run(&first.token)
            );
            if !alive && first_group_gone.is_none() {
                first_group_gone = Some(Instant::now());
            }
            first_group_gone.is_some()
        }),
        "the first group was never ended: {:?}",
        procs_of_run(&first.token)
    );
    assert!(
        first_group_gone.unwrap() - released + Duration::from_millis(200) >= kill_timeout,
        "the SIGTERM-ignoring member died before the kill timeout: the scenario did not happen"
    );
    // And then the task does run again.
    assert!(
        wait_until(SETTLE, || sup.runs(task).len() == 2),
        "the task was never claimed again: {}",
        sup.history(task)
    );
    let runs = sup.runs(task);
    assert_eq!(runs[0].outcome, Some(RunOutcome::Reclaimed));
    write(&sup, move |tx, now| tx.archive_task(task, now)).expect("archive");
    sup.shutdown();
}

#[test]
fn a_worker_started_but_never_recorded_is_found_by_its_token_and_adopted() {
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    // A previous incarnation claimed the run and started its worker, then died before the
    // worker's pid reached the board: forge exactly that.
    let mut board = Board::open(&td.db_path()).expect("open the board");
    let now = now_millis();
    let claim = board
        .write(|tx| {
            let id = tx
                .create_task(&NewTask::titled("orphaned").for_assignee("w"), now)?
                .id;
            tx.claim_task(id, "runwarden:dead:00000000", now, 60_000)
        })
        .expect("claim");
    drop(board);
    let mut cmd = Command::new("sleep");
    cmd.arg("300")
        .process_group(0)
        .env("RUNWARDEN_RUN_TOKEN", &claim.token);
    let worker = ChildGuard::spawn(&mut cmd).expect("start the unrecorded worker");

    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), sh_assignee("sleep 300"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let found = sup.wait_event(claim.task_id, "worker_found", SETTLE);
    assert_eq!(found.payload["pid"].as_i64(), Some(i64::from(worker.pid())));
    sup.wait_event(claim.task_id, "worker_adopted", SETTLE);
    let runs = sup.runs(claim.task_id);
    assert_eq!(
        runs.len(),
        1,
        "no second run: {}",
        sup.history(claim.task_id)
    );
    assert_eq!(runs[0].spawned_pid, Some(i64::from(worker.pid())));
    assert_eq!(sup.get_task(claim.task_id).status, TaskStatus::Running);

    // Adopted means supervised: archiving the task ends that worker.
    write(&sup, move |tx, now| tx.archive_task(claim.task_id, now)).expect("archive");
    assert!(
        worker.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "the adopted worker was not ended"
    );
    sup.shutdown();
}
