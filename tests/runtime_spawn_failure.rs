//! A worker whose program does not exist: the run closes `spawn_failed` with an error naming
//! the program, and the supervisor stays up — a following task of another assignee completes.

#[allow(dead_code)]
mod common;

use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{NewTask, RunOutcome, TaskStatus};
use runwarden::config::AssigneeConfig;

/// Not on PATH, and no such absolute path either.
const MISSING: &str = "runwarden-test-no-such-program";
const MISSING_ABS: &str = "/nonexistent/runwarden-test-no-such-program";

#[test]
fn a_missing_program_fails_the_spawn_and_the_supervisor_goes_on() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    for (name, program) in [("ghost", MISSING), ("ghost_abs", MISSING_ABS)] {
        let mut a = AssigneeConfig::new([program, "--flag"]);
        a.max_retries = Some(0);
        config.assignees.insert(name.into(), a);
    }
    config
        .assignees
        .insert("ok".into(), AssigneeConfig::new(["sh", "-c", "exit 0"]));
    let sup = Supervisor::start(config).expect("start the supervisor");

    for (who, program) in [("ghost", MISSING), ("ghost_abs", MISSING_ABS)] {
        let id = sup
            .add_task(NewTask::titled(who).for_assignee(who))
            .expect("add task")
            .id;
        let task = sup.wait_for(id, SETTLE).expect("the task finishes");
        let detail = sup.task(id).expect("task detail");
        assert_eq!(task.status, TaskStatus::Blocked, "{detail:?}");
        assert_eq!(detail.runs.len(), 1, "{:?}", detail.runs);
        let run = &detail.runs[0];
        assert_eq!(run.outcome, Some(RunOutcome::SpawnFailed), "{run:?}");
        let error = run.error.as_deref().unwrap_or_default();
        assert!(
            error.contains(program),
            "the error names the program {program:?}: {error:?}"
        );
        assert!(
            error.contains("No such file or directory"),
            "and says why: {error:?}"
        );
        assert_eq!(error.lines().count(), 1, "one line: {error:?}");
        assert_eq!(run.spawned_pid, None, "nothing was started: {run:?}");
        assert_eq!(run.exit_code, None, "{run:?}");
        let kinds: Vec<&str> = detail.events.iter().map(|e| e.kind.as_str()).collect();
        assert!(kinds.contains(&"gave_up"), "{kinds:?}");
        assert!(!kinds.contains(&"worker_spawned"), "{kinds:?}");
        assert_eq!(
            task.block_reason.as_deref(),
            Some(error),
            "the block reason is the spawn error"
        );
    }

    // Still dispatching: a task of another assignee runs and completes.
    let id = sup
        .add_task(NewTask::titled("after").for_assignee("ok"))
        .expect("add task")
        .id;
    let task = sup.wait_for(id, SETTLE).expect("the task finishes");
    assert_eq!(task.status, TaskStatus::Done, "{:?}", sup.task(id));
    let run = &sup.task(id).expect("task detail").runs[0];
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    assert_eq!(run.exit_code, Some(0), "{run:?}");
    assert!(run.spawned_pid.is_some(), "{run:?}");
    sup.shutdown();
}
