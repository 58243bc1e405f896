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

use common::lifecycle::Seen;
use common::lifecycle::{GatedEscapee, View, open_gate, start_gated_escapee, stop_serve};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir};
use runwarden::board::Run;
use runwarden::process::{Signal, read_stat};

#[test]
fn a_dead_workers_escapee_found_at_the_next_start_is_ended_and_recorded() {
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
        310,
        "tick = \"200ms\"",
        "[reaper]\nkill_timeout = \"1s\"\n\n[retries]\nmax_retries = 0",
    );
    let _pin = escapee.pin();
    // Killed: nothing ends or records anything on its way out. The worker is ours then
    // (re-parented): it exits, and is reaped here, unsupervised.
    kill_serve_then_let_the_worker_exit(&mut serve, &run, &gates, &escapee);

    let config = td.path().join("config.toml");
    let mut serve = Serve::start(&config, "serve2");
    serve.wait_ready(&td.lock_path(), &td.db_path());
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
    let status = stop_serve(&mut serve, Signal::SIGTERM, SETTLE);
    assert!(
        status.is_some_and(|s| s.success()),
        "serve exited {status:?}: {}",
        serve.stderr()
    );
}

/// Kills `serve`, then lets the worker of `run` exit here (re-parented to the test, reaped by
/// it), leaving `escapee` running: the worker died while no supervisor ran.
fn kill_serve_then_let_the_worker_exit(
    serve: &mut Serve,
    run: &Run,
    gates: &std::path::Path,
    escapee: &Seen,
) {
    serve.signal(Signal::SIGKILL);
    assert!(serve.wait_exit(SETTLE).is_some(), "serve survived SIGKILL");
    let leader = run.spawned_pid.expect("spawned pid") as i32;
    let me = std::process::id() as i32;
    assert!(
        wait_until(SETTLE, || read_stat(leader).is_ok_and(|s| s.ppid == me)),
        "the worker was not re-parented to the test"
    );
    open_gate(gates, run.task_id);
    let reaped = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(leader), None);
    assert!(reaped.is_ok(), "the worker was not reaped here: {reaped:?}");
    assert!(escapee.alive(), "{escapee:?} ended with its worker");
}

#[test]
fn a_closed_runs_dead_worker_escapee_is_ended_by_the_reaper_and_recorded() {
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
        311,
        "tick = \"200ms\"",
        "[reaper]\ngrace = \"300ms\"\nkill_timeout = \"1s\"",
    );
    let _pin = escapee.pin();
    kill_serve_then_let_the_worker_exit(&mut serve, &run, &gates, &escapee);
    // Its report had landed: the run is closed, its evidence kept for the reaper.
    db.write(|tx| tx.complete_task(task, Some(run.id), None, runwarden::board::now_millis()));

    let config = td.path().join("config.toml");
    let mut serve = Serve::start(&config, "serve2");
    serve.wait_ready(&td.lock_path(), &td.db_path());
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
    let status = stop_serve(&mut serve, Signal::SIGTERM, SETTLE);
    assert!(
        status.is_some_and(|s| s.success()),
        "serve exited {status:?}: {}",
        serve.stderr()
    );
}
