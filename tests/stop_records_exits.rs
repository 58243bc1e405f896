//! A `shutdown = "leave"` stop records the exit of a worker that exited as the supervisor
//! stopped: what its actor saw is committed before the store closes, not left for the next
//! supervisor to find "exited while unsupervised" and count as a failure. The exit is caught
//! in the middle of its recording by the library's test hook that stalls the probe every exit
//! of an older worker takes (process-wide: this file is its own test binary); a black-box
//! audit saw the same loss with exits that merely raced a SIGTERM.

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::{Db, View, add, task_for};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config, wait_worker};
use runwarden::Supervisor;
use runwarden::board::{RunOutcome, TaskStatus};
use runwarden::config::{AssigneeConfig, ShutdownMode};
use runwarden::process::{Liveness, liveness};

/// The stall hook is process-wide: the tests of this file take turns.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn an_exit_being_recorded_when_a_leave_stop_begins_is_recorded() {
    let _serial = common::lifecycle::serial(&SERIAL);
    // Long enough that the stop begins while the exit is held up, well under the exit's own
    // 5 s wait for its probe and the stop's bound (kill_timeout + 2 s = 3 s).
    runwarden::actors::worker::stall_exit_probes(Duration::from_millis(1500));
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.supervisor.shutdown = ShutdownMode::Leave;
    // Older at its exit than the 250 ms under which an exit is settled without the probe.
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["sleep", "0.4"]));
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("exits as the supervisor stops", "w"));
    let (pid, fp) = wait_worker(&sup, task);
    assert!(
        wait_until(SETTLE, || !matches!(liveness(pid, &fp), Liveness::Alive)),
        "the worker never exited"
    );
    // The exit is now held in its probe: stop.
    sup.shutdown();
    runwarden::actors::worker::stall_exit_probes(Duration::ZERO);

    let mut db = Db::new(td.db_path());
    let run = db.runs(task).remove(0);
    assert_eq!(
        run.outcome,
        Some(RunOutcome::Completed),
        "the exit seen before the stop was recorded: {run:?}"
    );
    assert_eq!(run.exit_code, Some(0), "{run:?}");
    assert_eq!(db.get_task(task).status, TaskStatus::Done);
}

/// While a `leave` stop waits for such an exit, the control socket is already closed, so a
/// live worker's heartbeats cannot land: no run is closed stale for that, and its worker is
/// left running for the next incarnation, as a `leave` stop promises.
#[test]
fn a_leave_stop_closes_no_run_stale_while_it_waits() {
    let _serial = common::lifecycle::serial(&SERIAL);
    // The stop's wait (within kill_timeout + 2 s = 5 s) lasts the stall, twice `stale_after`.
    runwarden::actors::worker::stall_exit_probes(Duration::from_secs(4));
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.supervisor.shutdown = ShutdownMode::Leave;
    config.leases.stale_after = Duration::from_secs(2);
    config.reaper.kill_timeout = Duration::from_secs(3);
    config
        .assignees
        .insert("exits".into(), AssigneeConfig::new(["sleep", "0.4"]));
    config.assignees.insert(
        "beats".into(),
        common::lifecycle::sh_assignee("while true; do runwarden heartbeat; sleep 0.2; done"),
    );
    let sup = Supervisor::start(config).expect("start");
    let beats = add(&sup, task_for("heartbeats", "beats"));
    let (beat_pid, beat_fp) = wait_worker(&sup, beats);
    let beater = common::runtime::WorkerGuard::pin(beat_pid, &beat_fp);
    common::runtime::wait_event(&sup, beats, "heartbeat");
    let exits = add(&sup, task_for("exits as the supervisor stops", "exits"));
    let (pid, fp) = wait_worker(&sup, exits);
    assert!(
        wait_until(SETTLE, || !matches!(liveness(pid, &fp), Liveness::Alive)),
        "the worker never exited"
    );
    // Not stale before the stop (heartbeats every 0.2 s), or the test proves nothing.
    let mut db = Db::new(td.db_path());
    assert_eq!(db.runs(beats)[0].outcome, None, "closed before the stop");
    sup.shutdown();
    runwarden::actors::worker::stall_exit_probes(Duration::ZERO);

    assert!(beater.alive(), "a leave stop ended a live worker");
    let run = db.runs(beats).remove(0);
    assert_eq!(
        run.outcome, None,
        "left open for the next incarnation: {run:?}"
    );
    assert_eq!(
        db.runs(exits).remove(0).outcome,
        Some(RunOutcome::Completed)
    );
}
