//! An adopted worker's escaped descendants are ended with it. A worker left running by
//! `shutdown = "leave"` is re-parented to init (here: this test process, standing in for an
//! init that reaps at once, like systemd or tini), and so is its `setsid` escapee — not to the
//! next supervisor, whose stray sweep only sees its own children. When the adopted worker
//! exits with its group empty, its exit must still find the escapee by the run's token, end
//! it, and only then clear the run's evidence.
//!
//! One test in this file: it makes the test process a child subreaper.

#[allow(dead_code)]
mod common;

use common::lifecycle::{GatedEscapee, View, open_gate, start_gated_escapee};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir};
use runwarden::board::TaskStatus;
use runwarden::process::{Signal, read_stat};

#[test]
fn an_adopted_workers_escapee_is_ended_when_the_worker_exits() {
    let td = TestDir::new();
    let _subreaper = runwarden::process::become_subreaper().expect("become a subreaper");
    let GatedEscapee {
        mut serve,
        mut db,
        task,
        run,
        escapee,
        gates,
    } = start_gated_escapee(
        &td,
        308,
        "tick = \"200ms\"\nshutdown = \"leave\"",
        "[reaper]\ngrace = \"1s\"\nkill_timeout = \"1s\"",
    );
    let _pin = escapee.pin();
    serve.stop_cleanly(Signal::SIGTERM);

    // The worker is ours now: reap it the moment it exits, as init would.
    let leader = run.spawned_pid.expect("spawned pid") as i32;
    let me = std::process::id() as i32;
    assert!(
        wait_until(SETTLE, || read_stat(leader).is_ok_and(|s| s.ppid == me)),
        "the worker was not re-parented to the test"
    );
    let reaper = std::thread::spawn(move || {
        nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(leader), None)
    });

    let config = td.path().join("config.toml");
    let mut serve = Serve::start(&config, "serve2");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    db.wait_event(task, "worker_adopted", SETTLE);
    assert!(
        escapee.alive(),
        "{escapee:?} ended before its worker exited"
    );
    open_gate(&gates, task);
    db.wait_status(task, TaskStatus::Done, SETTLE);
    let reaped = reaper.join().expect("reaper thread");
    assert!(reaped.is_ok(), "the worker was not reaped here: {reaped:?}");

    let ended = db.wait_event(task, "worker_group_ended", SETTLE);
    assert_eq!(ended.run_id, Some(run.id));
    assert!(
        !escapee.alive(),
        "{escapee:?} outlived its adopted worker\n{}",
        db.history(task)
    );
    assert_eq!(db.run(run.id).worker_pid, None, "evidence cleared");
    serve.stop_cleanly(Signal::SIGTERM);
}
