//! Archiving a finished task ends a worker of it still running after its report at once, not
//! at the end of the reaper's grace: archiving is how an operator puts a task away, hung
//! worker included (`reclaim` refuses a done task). Our own worker (its kill scheduled for the
//! grace's end, brought forward), and a previous supervisor's (ended under the fingerprint
//! rules). The run keeps its outcome: it completed.

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::{Db, View, runwarden_cli, serial, write};
use common::proc_guard::wait_until;
use common::runtime::{
    Serve, TestDir, WorkerGuard, add_to_board, lib_config, wait_worker, wait_worker_in_board,
};
use runwarden::Supervisor;
use runwarden::board::{NewTask, RunOutcome, TaskId, TaskStatus};
use runwarden::config::{AssigneeConfig, Config, ShutdownMode};
use runwarden::process::Signal;

/// The two tests must not overlap: the library one makes this process a subreaper, and the
/// other's worker, left running by its first `serve`, must be nobody's child (re-parented to
/// init), as after a real restart.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Far longer than the test waits for the worker to be ended.
const GRACE: Duration = Duration::from_secs(120);
/// How long the worker may take to be ended once its task is archived.
const ENDED_WITHIN: Duration = Duration::from_secs(10);

fn config(td: &TestDir) -> Config {
    let mut config = lib_config(td);
    config.reaper.grace = GRACE;
    config.supervisor.shutdown = ShutdownMode::Leave;
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["sleep", "300"]));
    config
}

fn archive(sup: &runwarden::SupervisorHandle, task: TaskId) {
    write(sup, move |tx, now| tx.archive_task(task, now)).expect("archive");
}

/// The task archived, its run still completed, and the end recorded as the reaper's (what a
/// hook on `terminal_worker_reaped` waits for).
fn assert_completed_and_archived(db: &mut Db, task: TaskId) {
    assert_eq!(db.get_task(task).status, TaskStatus::Archived);
    let run = db.runs(task).remove(0);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    db.wait_event(task, "terminal_worker_reaped", ENDED_WITHIN);
}

#[test]
fn archiving_a_done_task_ends_its_lingering_worker_now() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    let sup = Supervisor::start(config(&td)).expect("start");
    let task = sup
        .add_task(NewTask::titled("t").for_assignee("w"))
        .expect("add")
        .id;
    let (pid, fp) = wait_worker(&sup, task);
    let worker = WorkerGuard::pin(pid, &fp);
    sup.complete(task, None).expect("complete");
    let mut db = Db::new(td.db_path());
    db.wait_event(task, "run_closed", ENDED_WITHIN);
    assert!(worker.alive(), "within its grace, the worker runs on");

    archive(&sup, task);
    assert!(
        wait_until(ENDED_WITHIN, || !worker.alive()),
        "the archived task's worker still runs\n{}",
        db.history(task)
    );
    assert_completed_and_archived(&mut db, task);
    sup.shutdown();
}

#[test]
fn archiving_ends_a_previous_supervisors_lingering_worker_too() {
    // Real processes: the worker outlives the first `serve` (a `leave` stop) and is then
    // nobody's child, as after any restart.
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"",
        "[reaper]\ngrace = \"120s\"\n\n[assignees.w]\ncommand = [\"sleep\", \"300\"]\n",
    );
    {
        std::fs::create_dir_all(td.data_dir()).unwrap();
        let mut first = Serve::start(&config, "first");
        first.wait_ready(&td.lock_path(), &td.db_path());
        let task = add_to_board(&td.db_path(), "w");
        let (pid, fp) = wait_worker_in_board(&td.db_path(), task);
        let worker = WorkerGuard::pin(pid, &fp);
        let socket = td.socket_path();
        runwarden_cli(
            &socket,
            &["complete", &task.to_string(), "--force"],
            ENDED_WITHIN,
        )
        .ok();
        Db::new(td.db_path()).wait_event(task, "run_closed", ENDED_WITHIN);
        first.stop_cleanly(Signal::SIGTERM);
        assert!(worker.alive(), "left running by the stop");

        let mut second = Serve::start(&config, "second");
        second.wait_ready(&td.lock_path(), &td.db_path());
        runwarden_cli(&socket, &["archive", &task.to_string()], ENDED_WITHIN).ok();
        let mut db = Db::new(td.db_path());
        assert!(
            wait_until(ENDED_WITHIN, || !worker.alive()),
            "the archived task's worker still runs\n{}",
            db.history(task)
        );
        // Recorded before the stop (a stop in the middle of a reap leaves it to the next
        // supervisor, which finds the worker gone).
        assert_completed_and_archived(&mut db, task);
        second.stop_cleanly(Signal::SIGTERM);
    }
}
