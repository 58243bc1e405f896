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

/// The worker of the test below: an escapee in a session of its own which, on SIGTERM, starts
/// a clean-up child (a carrier of the run's token too, forked after any scan could see it),
/// waits until that child has set its own SIGTERM trap, and exits; then the worker exits 1.
/// The clean-up child forks nothing once it is ready: a process born after the end's last scan
/// is SIGKILLed, as designed, which would make the count below a matter of timing.
const ESCAPEE_WITH_CLEANUP: &str = r#"
setsid sh -c '
  trap "sh -c \"trap \\\"echo TERM >> cleanup; exit 0\\\" TERM; sleep 300 & : > cleanup-ready; wait\" &
        while [ ! -e cleanup-ready ]; do sleep 0.02; done; exit 0" TERM
  : > escaped
  while :; do sleep 0.05 & wait $!; done' &
while [ ! -e escaped ]; do sleep 0.02; done
exit 1
"#;

#[test]
fn a_descendant_forked_while_the_tree_is_ended_gets_its_sigterm_too() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.reaper.kill_timeout = Duration::from_secs(3);
    config.retries.max_retries = 0;
    let script = td.path().join("escapee.sh");
    fs::write(&script, ESCAPEE_WITH_CLEANUP).unwrap();
    config.assignees.insert(
        "w".into(),
        AssigneeConfig::new(["sh", script.to_str().unwrap()]),
    );
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("escapes", "w"));
    let mut db = Db::new(td.db_path());
    let ended = db.wait_event(task, "worker_group_ended", Duration::from_secs(10));
    sup.shutdown();
    // The clean-up child was not there for the first SIGTERM; it got one of its own (and
    // handled it) rather than a SIGKILL at once.
    let cleanup = fs::read_to_string(work(&td, task).join("cleanup")).unwrap_or_default();
    assert_eq!(cleanup.trim(), "TERM", "{}", db.history(task));
    assert_eq!(
        ended.payload["ended_by"],
        "sigterm",
        "every part ended on SIGTERM: {}",
        db.history(task)
    );
}
