//! A worker that exits while no supervisor runs (its supervisor was killed) leaves a `setsid`
//! escapee behind. The next supervisor finds the run's leader dead, ends what still carries
//! the run's token and records that (`worker_group_ended`, as for a tree that outlived a
//! worker of its own):
//! - for an open run, its reconcile, before it closes the run;
//! - for a run closed meanwhile (the worker's report landed, then the supervisor died), its
//!   terminal reaper, beside the leader's own `terminal_worker_gone`.
//!
//! The tests make the test process a child subreaper, standing in for an init that reaps at
//! once.

#[allow(dead_code)]
mod common;

use common::lifecycle::{Db, GatedEscapee, Seen, View, open_gate, start_gated_escapee};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir, WorkerGuard};
use runwarden::board::{Run, TaskId};
use runwarden::process::{Signal, read_stat};

#[test]
fn a_dead_workers_escapee_found_at_the_next_start_is_ended_and_recorded() {
    let td = TestDir::new();
    let _subreaper = runwarden::process::become_subreaper().expect("become a subreaper");
    let Died {
        mut db,
        task,
        run,
        escapee,
        _pin,
    } = escapee_of_a_worker_that_died_unsupervised(
        &td,
        310,
        "[reaper]\nkill_timeout = \"1s\"\n\n[retries]\nmax_retries = 0",
    );

    let mut serve = serve_again(&td);
    let ended = db.wait_event(task, "worker_group_ended", SETTLE);
    assert_eq!(ended.run_id, Some(run.id));
    assert_eq!(ended.payload["ended_by"], "sigterm", "{ended:?}");
    assert!(
        wait_until(SETTLE, || !escapee.alive()),
        "{escapee:?} outlived its dead worker\n{}",
        db.history(task)
    );
    let closed = db.wait_event(task, "run_closed", SETTLE);
    assert!(
        closed.id > ended.id,
        "the run is closed after its descendants are ended\n{}",
        db.history(task)
    );
    assert_eq!(db.run(run.id).worker_pid, None, "evidence cleared");
    serve.stop_cleanly(Signal::SIGTERM);
}

/// A worker that leaves a `setsid` escapee (`secs` long) and dies while no supervisor runs:
/// its `serve` (configured with `sections`) is killed, then the worker exits here (re-parented
/// to the test, reaped by it), leaving the escapee running. The escapee is pinned (ended when
/// the guard goes) in case the test fails first.
fn escapee_of_a_worker_that_died_unsupervised(td: &TestDir, secs: u32, sections: &str) -> Died {
    let mut g = start_gated_escapee(td, secs, "tick = \"200ms\"", sections);
    let pin = g.escapee.pin();
    // Killed: nothing ends or records anything on its way out.
    g.serve.signal(Signal::SIGKILL);
    assert!(
        g.serve.wait_exit(SETTLE).is_some(),
        "serve survived SIGKILL"
    );
    let leader = g.run.spawned_pid.expect("spawned pid") as i32;
    let me = std::process::id() as i32;
    assert!(
        wait_until(SETTLE, || read_stat(leader).is_ok_and(|s| s.ppid == me)),
        "the worker was not re-parented to the test"
    );
    open_gate(&g.gates, g.task);
    let reaped = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(leader), None);
    assert!(reaped.is_ok(), "the worker was not reaped here: {reaped:?}");
    assert!(g.escapee.alive(), "{:?} ended with its worker", g.escapee);
    let GatedEscapee {
        db,
        task,
        run,
        escapee,
        ..
    } = g;
    Died {
        db,
        task,
        run,
        escapee,
        _pin: pin,
    }
}

/// What [`escapee_of_a_worker_that_died_unsupervised`] leaves.
struct Died {
    db: Db,
    task: TaskId,
    run: Run,
    escapee: Seen,
    _pin: Option<WorkerGuard>,
}

/// The next `serve` on `td`'s config, ready.
fn serve_again(td: &TestDir) -> Serve {
    let mut serve = Serve::start(&td.path().join("config.toml"), "serve2");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    serve
}

#[test]
fn a_closed_runs_dead_worker_escapee_is_ended_by_the_reaper_and_recorded() {
    let td = TestDir::new();
    let _subreaper = runwarden::process::become_subreaper().expect("become a subreaper");
    let Died {
        mut db,
        task,
        run,
        escapee,
        _pin,
    } = escapee_of_a_worker_that_died_unsupervised(
        &td,
        311,
        "[reaper]\ngrace = \"300ms\"\nkill_timeout = \"1s\"",
    );
    // Its report had landed: the run is closed, its evidence kept for the reaper.
    db.write(|tx| tx.complete_task(task, Some(run.id), None, runwarden::board::now_millis()));

    let mut serve = serve_again(&td);
    let gone = db.wait_event(task, "terminal_worker_gone", SETTLE);
    let ended = db.wait_event(task, "worker_group_ended", SETTLE);
    assert_eq!(ended.run_id, Some(run.id));
    assert_eq!(ended.payload["ended_by"], "sigterm", "{ended:?}");
    assert!(gone.id < ended.id, "{}", db.history(task));
    assert!(
        wait_until(SETTLE, || !escapee.alive()),
        "{escapee:?} outlived its dead worker\n{}",
        db.history(task)
    );
    assert_eq!(db.run(run.id).worker_pid, None, "evidence cleared");
    serve.stop_cleanly(Signal::SIGTERM);
}
