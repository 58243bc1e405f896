//! A worker that is ended gets one SIGTERM, however it is ended (its task archived, its
//! `max_runtime` passed, its run closed and the reaper's grace over), and SIGKILL only after
//! `kill_timeout`: many programs take a second SIGTERM as "stop now, skip the clean-up", which
//! would defeat the grace. And the event that says how a tree was ended says SIGKILL when an
//! escaped part of it (out of the worker's group) needed it, not only when the group did.

#[allow(dead_code)]
mod common;

use std::fs;
use std::path::Path;
use std::time::Duration;

use common::lifecycle::{Db, View, add, task_for, write};
use common::proc_guard::wait_until;
use common::runtime::{TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::TaskId;
use runwarden::config::AssigneeConfig;

/// Writes a line to `terms` (in its work dir) for each SIGTERM it gets and goes on, until
/// SIGKILL. `ready` says the trap is set.
const COUNTER: &str =
    "trap 'echo TERM >> terms' TERM; : > ready; while :; do sleep 0.05 & wait $!; done";

/// The worker's work dir (the default: `<data_dir>/work/<task>`).
fn work(td: &TestDir, task: TaskId) -> std::path::PathBuf {
    td.data_dir().join("work").join(task.to_string())
}

fn terms(dir: &Path) -> usize {
    fs::read_to_string(dir.join("terms"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn a_worker_ended_any_way_gets_one_sigterm_then_sigkill() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.reaper.kill_timeout = Duration::from_millis(700);
    // No retry: one would run in the same work dir and add to the same count.
    config.retries.max_retries = 0;
    let mut counter = AssigneeConfig::new(["sh", "-c", COUNTER]);
    counter.max_in_progress = 3;
    config.assignees.insert("w".into(), counter);
    let sup = Supervisor::start(config).expect("start");

    let archived = add(&sup, task_for("archived", "w"));
    let mut timed = task_for("timed out", "w");
    timed.max_runtime_ms = Some(1500);
    let timed = add(&sup, timed);
    let completed = add(&sup, task_for("completed, then hung", "w"));
    let all = [archived, timed, completed];
    assert!(
        wait_until(Duration::from_secs(10), || all.iter().all(|&t| work(
            &td, t
        )
        .join("ready")
        .exists())),
        "the workers never set their traps"
    );
    write(&sup, move |tx, now| tx.archive_task(archived, now)).expect("archive");
    sup.complete(completed, None).expect("complete");

    let mut db = Db::new(td.db_path());
    for task in all {
        // Its worker is gone once its run's evidence is cleared.
        let cleared = wait_until(Duration::from_secs(10), || {
            db.runs(task)
                .first()
                .is_some_and(|r| r.outcome.is_some() && r.worker_pid.is_none())
        });
        assert!(cleared, "task {task}: {}", db.history(task));
        let run = db.runs(task).remove(0);
        assert_eq!(
            (run.exit_code, run.exit_signal),
            (None, Some(9)),
            "task {task}: it ignores SIGTERM, so SIGKILL ended it: {run:?}"
        );
        assert_eq!(
            terms(&work(&td, task)),
            1,
            "task {task}: one SIGTERM before the SIGKILL\n{}",
            db.history(task)
        );
    }
    sup.shutdown();
}

#[test]
fn an_escaped_descendant_that_needed_sigkill_is_reported_so() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.reaper.kill_timeout = Duration::from_millis(300);
    config.retries.max_retries = 0;
    // The worker leaves a descendant in a session (and group) of its own, which ignores
    // SIGTERM, and exits: the group is gone, the escapee is not.
    config.assignees.insert(
        "w".into(),
        AssigneeConfig::new([
            "sh",
            "-c",
            "setsid sh -c \"trap '' TERM; : > escaped; exec sleep 300\" & \
             while [ ! -e escaped ]; do sleep 0.02; done; exit 1",
        ]),
    );
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("escapes", "w"));
    let mut db = Db::new(td.db_path());
    let ended = db.wait_event(task, "worker_group_ended", Duration::from_secs(10));
    sup.shutdown();
    assert_eq!(
        ended.payload["ended_by"],
        "sigkill",
        "the escapee ignored SIGTERM: {}",
        db.history(task)
    );
}
