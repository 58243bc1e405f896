//! The exit of a worker that ran moments ago is settled at once when nothing can have escaped
//! it (its group is empty and every pid handed out since its own is another worker of ours, a
//! thread of ours, or names nothing), and by the probe for escaped descendants otherwise. A
//! young worker that leaves a `setsid` escapee behind is never settled the quick way: its run
//! keeps its evidence, the escapee is ended with the tree, and only then is the evidence
//! cleared (`worker_group_ended`).

#[allow(dead_code)]
mod common;

use common::lifecycle::{Db, View, add, procs_of_run, sh_assignee, task_for};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{RunOutcome, TaskStatus};

#[test]
fn a_young_worker_that_leaves_an_escapee_keeps_its_evidence_until_the_escapee_is_ended() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // Exits within milliseconds of its start (well under the 250 ms below which an exit may
    // be settled without the probe), once its escapee has left its group (the escapee opens
    // the FIFO after its setsid; the leader waits for that): the group is empty at the exit,
    // so the walk over recent pids is what must see the escapee.
    config.assignees.insert(
        "w".into(),
        sh_assignee("mkfifo f; setsid sh -c ': > f; exec sleep 309' & read _ < f; exit 0"),
    );
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("escape", "w"));
    let done = sup.wait_for(task, SETTLE).expect("the task ends");
    assert_eq!(done.status, TaskStatus::Done, "{done:?}");

    let mut db = Db::new(td.db_path());
    let run = db.runs(task).remove(0);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    // The exit saw the tree alive: the tree end (not the tick's sweep for strays) ended the
    // escapee and cleared the run's evidence.
    db.wait_event(task, "worker_group_ended", SETTLE);
    assert_eq!(db.run(run.id).worker_pid, None, "evidence cleared");
    assert!(
        wait_until(SETTLE, || procs_of_run(&run.token).is_empty()),
        "the escapee outlived its run: {:?}",
        procs_of_run(&run.token)
    );
    sup.shutdown();
}

#[test]
fn quick_workers_without_descendants_are_settled_without_the_probe() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.assignees.insert("w".into(), sh_assignee("exit 0"));
    let quick_before = runwarden::actors::worker::quick_settles();
    let sup = Supervisor::start(config).expect("start");
    let tasks: Vec<_> = (0..20)
        .map(|i| add(&sup, task_for(&format!("quick {i}"), "w")))
        .collect();
    let mut db = Db::new(td.db_path());
    for task in tasks {
        let done = sup.wait_for(task, SETTLE).expect("the task ends");
        assert_eq!(done.status, TaskStatus::Done, "{done:?}");
        let run = db.runs(task).remove(0);
        assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
        assert!(
            wait_until(SETTLE, || db.run(run.id).worker_pid.is_none()),
            "the exit left the run's evidence: {:?}",
            db.run(run.id)
        );
    }
    // Under load an exit may come past the 250 ms or meet a stranger's pid and take the
    // probe; not all twenty.
    assert!(
        runwarden::actors::worker::quick_settles() > quick_before,
        "no exit was settled without the probe"
    );
    sup.shutdown();
}
