//! A worker's exit is recorded even when the probe for its escaped descendants never answers
//! (it reads other processes' environments in /proc; one stuck in an exec on a hung FUSE or
//! NFS mount makes that read wait until the mount answers): after a bounded wait the run
//! closes as if its tree had outlived the leader — evidence kept — and the tree is ended and
//! the evidence cleared afterwards, and the supervisor's shutdown does not wait for the stuck
//! probe. The stall is the library's test hook (process-wide: this file is its own test
//! binary); it stalls the exit's probe only, not the tree end after it (with a real hung mount
//! that waits for the mount too). A real hung mount was used to reproduce the hang once, by
//! hand.

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::{Db, View, add, task_for};
use common::runtime::{TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{RunOutcome, TaskStatus};
use runwarden::config::AssigneeConfig;

/// Longer than the exit's wait for its probe (5 s) plus the time the test allows for the
/// task to finish: without that wait the task could not be done in time.
const STALL: Duration = Duration::from_secs(12);
/// Allowed from the add to the task's `done`: the probe's 5 s wait and some room.
const DONE_WITHIN: Duration = Duration::from_secs(10);

#[test]
fn an_exit_whose_probe_never_answers_is_recorded_and_its_evidence_cleared_later() {
    let start = std::time::Instant::now();
    runwarden::actors::worker::stall_exit_probes(STALL);
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config
        .assignees
        // Older at its exit than the age below which an exit can be settled without the
        // probe (250 ms, counted from when its actor got it): its exit takes the (stalled)
        // probe.
        .insert("w".into(), AssigneeConfig::new(["sleep", "1"]));
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("t", "w"));
    let done = sup.wait_for(task, DONE_WITHIN).expect("the task ends");
    assert_eq!(done.status, TaskStatus::Done, "{done:?}");

    let mut db = Db::new(td.db_path());
    let run = db.runs(task).remove(0);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    // The tree is then ended (there is nothing left of it) and the evidence cleared.
    db.wait_event(task, "worker_group_ended", Duration::from_secs(10));
    let run = db.run(run.id);
    assert_eq!(run.worker_pid, None, "evidence cleared: {run:?}");
    runwarden::actors::worker::stall_exit_probes(Duration::ZERO);
    // The stalled probe runs on a thread of its own, not the runtime's blocking pool: the
    // supervisor's end does not wait for it (the probe stalls until ~STALL after the exit).
    sup.shutdown();
    assert!(
        start.elapsed() < STALL,
        "the shutdown waited for the stuck probe ({:?} after the start)",
        start.elapsed()
    );
    assert!(
        runwarden::actors::proc_thread::running() >= 1,
        "the probe must still be stalled here, or the check above proves nothing"
    );
}
