//! A start that fails because the supervisor itself is short of something — here, file
//! descriptors (EMFILE) — is no failure of the task's: the run closes `spawn_failed` saying so,
//! the task is requeued without counting it, and runs once the shortage is over. (Counted, a
//! supervisor briefly out of descriptors used up every ready task's retries and left them all
//! blocked.) The supervisor runs in this test's own process (nextest gives each test one), whose
//! descriptors the test uses up and gives back.

#[allow(dead_code)]
mod common;

use common::descriptors::use_up_descriptors;

use common::lifecycle::{View, add, sh_assignee, task_for};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{RunOutcome, TaskStatus};

#[test]
fn a_start_without_descriptors_is_retried_without_counting_a_failure() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // One counted failure would block the task at once.
    config.retries.max_retries = 0;
    config.assignees.insert("w".into(), sh_assignee("exit 0"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    // A first task through, so whatever the supervisor opens once (log dir, read connections)
    // is open before the descriptors run out.
    let warm = add(&sup, task_for("warm-up", "w"));
    sup.wait_status(warm, TaskStatus::Done, SETTLE);

    let held = use_up_descriptors();
    let task = add(&sup, task_for("short", "w"));
    let failed = wait_until(SETTLE, || {
        sup.runs(task)
            .first()
            .is_some_and(|r| r.outcome == Some(RunOutcome::SpawnFailed))
    });
    drop(held);
    let history = sup.history(task);
    assert!(
        failed,
        "the start never failed for want of descriptors: {history}"
    );
    let run = &sup.runs(task)[0];
    let error = run.error.clone().unwrap_or_default();
    assert!(
        error.contains("not counted as a failure"),
        "the run does not say why: {error}\n{history}"
    );

    let done = sup.wait_status(task, TaskStatus::Done, SETTLE);
    let history = sup.history(task);
    assert_eq!(done.status, TaskStatus::Done, "{history}");
    assert_eq!(done.consecutive_failures, 0, "{history}");
    assert!(
        sup.events(task).iter().all(|e| e.kind != "gave_up"),
        "{history}"
    );
    sup.shutdown();
}
