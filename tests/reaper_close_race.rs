//! A run closed by force (its task archived) while the reaper's sweep happens to read the
//! board before the run's `RunClosed` reaches the reaper: the worker is still ended once, by
//! its own actor — not also by the sweep as a worker nobody watches, which sent it a second
//! SIGTERM and recorded its end twice. The `RunClosed` is held back through the library's test
//! hook (process-wide: this file is its own test binary), as a busy actor thread or a lagging
//! event feed would — for 2 s, longer than any fixed wait the sweep could give it (an earlier
//! version left such runs alone for 2 ticks + 1 s, then took them for unwatched ones).

#[allow(dead_code)]
mod common;

use std::fs;
use std::time::Duration;

use common::lifecycle::{Db, View, add, task_for, write};
use common::proc_guard::wait_until;
use common::runtime::{TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::config::AssigneeConfig;

/// Counts its SIGTERMs (a line each) and goes on until SIGKILL; `ready` once its trap is set.
const COUNTER: &str =
    "trap 'echo TERM >> terms' TERM; : > ready; while :; do sleep 0.05 & wait $!; done";

#[test]
fn a_sweep_that_reads_a_forced_close_first_leaves_the_worker_to_its_actor() {
    // Many sweeps (every 50 ms tick) read the closed run before its RunClosed arrives.
    runwarden::actors::dispatcher::delay_run_closed(Duration::from_secs(2));
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.reaper.kill_timeout = Duration::from_millis(1500);
    config.retries.max_retries = 0;
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["sh", "-c", COUNTER]));
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("archived while running", "w"));
    let work = td.data_dir().join("work").join(task.to_string());
    assert!(
        wait_until(Duration::from_secs(10), || work.join("ready").exists()),
        "the worker never set its trap"
    );
    write(&sup, move |tx, now| tx.archive_task(task, now)).expect("archive");

    let mut db = Db::new(td.db_path());
    let cleared = wait_until(Duration::from_secs(10), || {
        db.runs(task)
            .first()
            .is_some_and(|r| r.outcome.is_some() && r.worker_pid.is_none())
    });
    runwarden::actors::dispatcher::delay_run_closed(Duration::ZERO);
    sup.shutdown();
    assert!(cleared, "{}", db.history(task));
    let terms = fs::read_to_string(work.join("terms")).unwrap_or_default();
    assert_eq!(
        terms.lines().count(),
        1,
        "one SIGTERM, from one end of the worker\n{}",
        db.history(task)
    );
    // The end of a forced close, as when its RunClosed is on time: not a terminal reap (that
    // is for a worker that outlived its own report's grace), and its group's end once at most.
    let reaped = db.events_of(task, "terminal_worker_reaped").len();
    assert_eq!(
        reaped,
        0,
        "a forced close's end taken for a reap\n{}",
        db.history(task)
    );
    let n = db.events_of(task, "worker_group_ended").len();
    assert!(
        n <= 1,
        "worker_group_ended recorded {n} times\n{}",
        db.history(task)
    );
}
