//! The board's transitions on a real SQLite file: each checks the state it expects
//! (compare-and-swap on status and current run), refuses the rest with the right error, and
//! appends its event in the same transaction.

#[allow(dead_code)]
mod common;

use common::board::{LEASE_MS, TempBoard, events_of, kinds, run, temp_board};
use runwarden::board::{
    Board, BoardError, Claim, Failure, LogStart, NewTask, RunOutcome, SCHEMA_VERSION, TaskId,
    TaskStatus,
};
use runwarden::process::Fingerprint;

const T: i64 = 1_700_000_000_000;

fn create(tb: &mut TempBoard, new: NewTask, now: i64) -> TaskId {
    let created = tb.board.write(|tx| tx.create_task(&new, now)).unwrap();
    assert!(!created.existed);
    created.id
}

fn ready(tb: &mut TempBoard, title: &str) -> TaskId {
    create(tb, NewTask::titled(title).for_assignee("coder"), T)
}

fn claim(tb: &mut TempBoard, task: TaskId, now: i64) -> Claim {
    tb.board
        .write(|tx| tx.claim_task(task, "claimer", now, LEASE_MS))
        .unwrap()
}

fn status(tb: &mut TempBoard, task: TaskId) -> TaskStatus {
    tb.board.read(|tx| tx.task_status(task)).unwrap()
}

fn fake_fp() -> Fingerprint {
    Fingerprint {
        boot_id: "00000000-0000-0000-0000-000000000000".into(),
        start_ticks: 4242,
        pidfs_ino: None,
    }
}

fn failure(error: &str, backoff_ms: i64) -> Failure {
    Failure {
        outcome: RunOutcome::Crashed,
        exit_code: Some(1),
        exit_signal: None,
        error: error.into(),
        default_max_retries: 5,
        backoff_ms,
        counts: true,
        give_up_now: false,
    }
}

#[track_caller]
fn assert_conflict<T: std::fmt::Debug>(result: Result<T, BoardError>) -> String {
    match result {
        Err(BoardError::Conflict(msg)) => msg,
        other => panic!("expected Conflict, got {other:?}"),
    }
}

#[test]
fn create_ready_todo_and_idempotency_key() {
    let mut tb = temp_board();
    let parent = ready(&mut tb, "parent");
    assert_eq!(status(&mut tb, parent), TaskStatus::Ready);
    assert_eq!(kinds(&mut tb.board, parent), ["created"]);

    let child = create(
        &mut tb,
        NewTask {
            parents: vec![parent],
            ..NewTask::titled("child").for_assignee("coder")
        },
        T,
    );
    assert_eq!(status(&mut tb, child), TaskStatus::Todo);
    assert_eq!(
        events_of(&mut tb.board, child, "created")[0].payload["parents"],
        serde_json::json!([parent])
    );

    // A task with an idempotency key; the same key again returns it and writes nothing.
    let keyed = NewTask {
        idempotency_key: Some("nightly-2024-01-01".into()),
        ..NewTask::titled("nightly").for_assignee("coder")
    };
    let first = tb.board.write(|tx| tx.create_task(&keyed, T)).unwrap();
    assert!(!first.existed);
    let events_before = tb.board.read(|tx| tx.last_event_id()).unwrap();
    let again = tb.board.write(|tx| tx.create_task(&keyed, T + 1)).unwrap();
    assert_eq!((again.id, again.existed), (first.id, true));
    assert_eq!(
        tb.board.read(|tx| tx.last_event_id()).unwrap(),
        events_before,
        "an existing key appends no event"
    );

    // Still open while running; once done, the key names a new task.
    let c = claim(&mut tb, first.id, T + 2);
    let running = tb.board.write(|tx| tx.create_task(&keyed, T + 3)).unwrap();
    assert_eq!((running.id, running.existed), (first.id, true));
    tb.board
        .write(|tx| tx.complete_task(first.id, Some(c.run_id), Some("ok"), T + 4))
        .unwrap();
    let fresh = tb.board.write(|tx| tx.create_task(&keyed, T + 5)).unwrap();
    assert!(!fresh.existed);
    assert_ne!(fresh.id, first.id);
    assert_eq!(status(&mut tb, fresh.id), TaskStatus::Ready);

    // An empty title and an unknown parent are refused.
    assert!(matches!(
        tb.board
            .write(|tx| tx.create_task(&NewTask::titled("  "), T)),
        Err(BoardError::Invalid(_))
    ));
    assert!(matches!(
        tb.board.write(|tx| tx.create_task(
            &NewTask {
                parents: vec![9999],
                ..NewTask::titled("orphan")
            },
            T
        )),
        Err(BoardError::NotFound { id: 9999, .. })
    ));
}

#[test]
fn claim_only_from_ready() {
    let mut tb = temp_board();
    let parent = ready(&mut tb, "parent");
    let child = create(
        &mut tb,
        NewTask {
            parents: vec![parent],
            ..NewTask::titled("child").for_assignee("coder")
        },
        T,
    );
    // todo: refused, nothing written.
    let msg = assert_conflict(tb.board.write(|tx| tx.claim_task(child, "c", T, LEASE_MS)));
    assert!(msg.contains("todo"), "{msg}");
    assert_eq!(status(&mut tb, child), TaskStatus::Todo);

    let c = claim(&mut tb, parent, T + 1);
    assert_eq!((c.task_id, c.attempt), (parent, 1));
    assert_eq!(c.token.len(), 32, "a 128-bit hex token");
    let task = tb.board.read(|tx| tx.get_task(parent)).unwrap();
    assert_eq!(task.status, TaskStatus::Running);
    assert_eq!(task.current_run_id, Some(c.run_id));
    assert_eq!(task.started_at, Some(T + 1));
    let r = run(&mut tb.board, c.run_id);
    assert!(r.is_open());
    assert_eq!(r.lease_expires_at, T + 1 + LEASE_MS);
    assert_eq!(r.assignee.as_deref(), Some("coder"));
    let claimed = events_of(&mut tb.board, parent, "claimed");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].run_id, Some(c.run_id));

    // A second claim of the running task is refused; there is still exactly one run.
    let msg = assert_conflict(
        tb.board
            .write(|tx| tx.claim_task(parent, "other", T + 2, LEASE_MS)),
    );
    assert!(msg.contains("running"), "{msg}");
    let runs = tb.board.read(|tx| tx.runs_for_task(parent)).unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(tb.board.read(|tx| tx.open_runs()).unwrap().len(), 1);

    // A missing task is NotFound.
    assert!(matches!(
        tb.board.write(|tx| tx.claim_task(4242, "c", T, LEASE_MS)),
        Err(BoardError::NotFound { id: 4242, .. })
    ));
}

#[test]
fn complete_keeps_worker_evidence() {
    let mut tb = temp_board();
    let task = ready(&mut tb, "worker");
    let c = claim(&mut tb, task, T);
    let fp = fake_fp();
    let log = LogStart {
        offset: 4096,
        generation: Some("12-34.5".into()),
    };
    tb.board
        .write(|tx| tx.set_worker(c.run_id, 31337, Some(&fp), Some(&log), T + 1))
        .unwrap();
    // A worker is recorded once per run.
    assert_conflict(
        tb.board
            .write(|tx| tx.set_worker(c.run_id, 31338, Some(&fp), None, T + 1)),
    );
    // Where its output starts in the log is kept with it (for a supervisor that adopts it).
    assert_eq!(run(&mut tb.board, c.run_id).log_start, Some(log));

    let closed = tb
        .board
        .write(|tx| tx.complete_task(task, Some(c.run_id), Some("42"), T + 10))
        .unwrap()
        .expect("the open run is closed");
    assert_eq!(closed.run_id, c.run_id);
    assert_eq!(closed.outcome, RunOutcome::Completed);
    assert_eq!(closed.ended_at, T + 10);
    assert_eq!(closed.pid, Some(31337));
    assert_eq!(closed.fingerprint.as_ref(), Some(&fp));

    let r = run(&mut tb.board, c.run_id);
    assert_eq!(r.outcome, Some(RunOutcome::Completed));
    assert_eq!(r.ended_at, Some(T + 10));
    assert_eq!(r.summary.as_deref(), Some("42"));
    assert_eq!(r.worker_pid, Some(31337));
    assert_eq!(r.spawned_pid, Some(31337));
    assert_eq!(r.fingerprint(), Some(fp.clone()));

    let t = tb.board.read(|tx| tx.get_task(task)).unwrap();
    assert_eq!(t.status, TaskStatus::Done);
    assert_eq!(t.result.as_deref(), Some("42"));
    assert_eq!(t.completed_at, Some(T + 10));
    assert_eq!(t.current_run_id, None);

    let closed_ev = events_of(&mut tb.board, task, "run_closed");
    assert_eq!(closed_ev.len(), 1);
    assert_eq!(closed_ev[0].payload["pid"], 31337);
    assert_eq!(closed_ev[0].payload["start_ticks"], fp.start_ticks);
    assert_eq!(closed_ev[0].payload["outcome"], "completed");
    assert_eq!(
        kinds(&mut tb.board, task),
        [
            "created",
            "claimed",
            "worker_spawned",
            "run_closed",
            "completed"
        ]
    );

    // Done is final: completing again is refused, with or without the run.
    assert_conflict(
        tb.board
            .write(|tx| tx.complete_task(task, None, Some("again"), T + 11)),
    );
    assert!(matches!(
        tb.board
            .write(|tx| tx.complete_task(task, Some(c.run_id), None, T + 11)),
        Err(BoardError::StaleRun { .. })
    ));
}

#[test]
fn block_and_unblock() {
    let mut tb = temp_board();
    let task = ready(&mut tb, "blocky");
    let c = claim(&mut tb, task, T);
    tb.board
        .write(|tx| tx.set_worker(c.run_id, 4000, Some(&fake_fp()), None, T))
        .unwrap();
    let closed = tb
        .board
        .write(|tx| tx.block_task(task, Some(c.run_id), "needs a human", T + 1))
        .unwrap()
        .expect("the open run is closed");
    assert_eq!(closed.outcome, RunOutcome::Blocked);
    assert_eq!(closed.pid, Some(4000), "evidence kept for the reaper");
    let r = run(&mut tb.board, c.run_id);
    assert_eq!(r.outcome, Some(RunOutcome::Blocked));
    assert_eq!(r.error.as_deref(), Some("needs a human"));
    assert_eq!(r.worker_pid, Some(4000));
    let t = tb.board.read(|tx| tx.get_task(task)).unwrap();
    assert_eq!(t.status, TaskStatus::Blocked);
    assert_eq!(t.block_reason.as_deref(), Some("needs a human"));
    assert_eq!(t.current_run_id, None);
    assert_eq!(
        events_of(&mut tb.board, task, "blocked")[0].payload["reason"],
        "needs a human"
    );

    // Blocked twice, or claimed while blocked: refused.
    assert_conflict(
        tb.board
            .write(|tx| tx.block_task(task, None, "again", T + 2)),
    );
    assert_conflict(
        tb.board
            .write(|tx| tx.claim_task(task, "c", T + 2, LEASE_MS)),
    );

    assert_eq!(
        tb.board.write(|tx| tx.unblock_task(task, T + 3)).unwrap(),
        TaskStatus::Ready
    );
    let t = tb.board.read(|tx| tx.get_task(task)).unwrap();
    assert_eq!(t.status, TaskStatus::Ready);
    assert_eq!(t.block_reason, None);
    assert_eq!(t.consecutive_failures, 0);
    assert_eq!(events_of(&mut tb.board, task, "unblocked").len(), 1);
    // Unblocking a task that is not blocked is refused.
    assert_conflict(tb.board.write(|tx| tx.unblock_task(task, T + 4)));

    // A ready task (no run) can be blocked by an operator, and unblocks to todo while a
    // parent is unfinished.
    let parent = ready(&mut tb, "parent");
    let child = create(
        &mut tb,
        NewTask {
            parents: vec![parent],
            ..NewTask::titled("child")
        },
        T,
    );
    assert_eq!(
        tb.board
            .write(|tx| tx.block_task(child, None, "hold", T + 5))
            .unwrap(),
        None
    );
    assert_eq!(
        tb.board.write(|tx| tx.unblock_task(child, T + 6)).unwrap(),
        TaskStatus::Todo
    );
}

#[test]
fn archive_of_a_running_task_closes_its_run() {
    let mut tb = temp_board();
    let task = ready(&mut tb, "archived");
    let c = claim(&mut tb, task, T);
    let fp = fake_fp();
    tb.board
        .write(|tx| tx.set_worker(c.run_id, 5000, Some(&fp), None, T))
        .unwrap();

    let closed = tb
        .board
        .write(|tx| tx.archive_task(task, T + 1))
        .unwrap()
        .expect("a running task's run is closed and returned");
    assert_eq!(closed.task_id, task);
    assert_eq!(closed.run_id, c.run_id);
    assert_eq!(closed.outcome, RunOutcome::Archived);
    assert_eq!(closed.ended_at, T + 1);
    assert_eq!(closed.pid, Some(5000));
    assert_eq!(closed.fingerprint, Some(fp));

    let r = run(&mut tb.board, c.run_id);
    assert_eq!(r.outcome, Some(RunOutcome::Archived));
    assert_eq!(r.worker_pid, Some(5000));
    let t = tb.board.read(|tx| tx.get_task(task)).unwrap();
    assert_eq!(t.status, TaskStatus::Archived);
    assert_eq!(t.current_run_id, None);
    assert!(tb.board.read(|tx| tx.open_runs()).unwrap().is_empty());
    let archived = events_of(&mut tb.board, task, "archived").remove(0);
    assert_eq!(archived.payload["from"], "running");
    assert_eq!(
        archived.run_id,
        Some(c.run_id),
        "it names the run it closed"
    );

    // Archived is final; the old run cannot act any more.
    assert_conflict(tb.board.write(|tx| tx.archive_task(task, T + 2)));
    assert!(matches!(
        tb.board
            .write(|tx| tx.complete_task(task, Some(c.run_id), None, T + 2)),
        Err(BoardError::StaleRun { .. })
    ));

    // Archiving a task without a run returns no evidence.
    let idle = ready(&mut tb, "idle");
    assert_eq!(
        tb.board.write(|tx| tx.archive_task(idle, T + 3)).unwrap(),
        None
    );
}

#[test]
fn link_refuses_a_cycle_and_names_it() {
    let mut tb = temp_board();
    let a = ready(&mut tb, "a");
    let b = ready(&mut tb, "b");
    let c = ready(&mut tb, "c");

    tb.board.write(|tx| tx.link(a, b, T)).unwrap();
    // The ready child of an unfinished parent goes back to todo.
    assert_eq!(status(&mut tb, b), TaskStatus::Todo);
    assert_eq!(
        events_of(&mut tb.board, b, "linked")[0].payload["parent"],
        a
    );
    assert_eq!(events_of(&mut tb.board, b, "demoted").len(), 1);

    let two = tb.board.write(|tx| tx.link(b, a, T)).unwrap_err();
    match &two {
        BoardError::Invalid(msg) => assert!(
            msg.contains(&format!("{b} -> {a} -> {b}")),
            "cycle not named: {msg}"
        ),
        other => panic!("expected Invalid, got {other:?}"),
    }

    tb.board.write(|tx| tx.link(b, c, T)).unwrap();
    let three = tb.board.write(|tx| tx.link(c, a, T)).unwrap_err();
    match &three {
        BoardError::Invalid(msg) => assert!(
            msg.contains(&format!("{c} -> {a} -> {b} -> {c}")),
            "cycle not named: {msg}"
        ),
        other => panic!("expected Invalid, got {other:?}"),
    }
    assert!(matches!(
        tb.board.write(|tx| tx.link(a, a, T)),
        Err(BoardError::Invalid(_))
    ));

    // The refused links wrote nothing: a is still ready with no parent.
    let detail = tb
        .board
        .read(|tx| tx.task_detail(a, 100, usize::MAX))
        .unwrap();
    assert!(detail.parents.is_empty(), "{:?}", detail.parents);
    assert_eq!(detail.task.status, TaskStatus::Ready);
    assert!(events_of(&mut tb.board, a, "linked").is_empty());
    // Linking the same pair twice is a no-op.
    tb.board.write(|tx| tx.link(a, b, T)).unwrap();
    assert_eq!(events_of(&mut tb.board, b, "linked").len(), 1);

    // A finished task never runs again, a running one is not waiting: neither can be made to
    // wait.
    let done = ready(&mut tb, "done");
    let run = claim(&mut tb, done, T);
    tb.board
        .write(|tx| tx.complete_task(done, Some(run.run_id), None, T + 1))
        .unwrap();
    let archived = ready(&mut tb, "archived");
    tb.board.write(|tx| tx.archive_task(archived, T)).unwrap();
    // Nor can a running one: this run does not wait.
    let running = ready(&mut tb, "running");
    claim(&mut tb, running, T);
    for (child, what) in [(done, "done"), (archived, "archived"), (running, "running")] {
        match tb.board.write(|tx| tx.link(c, child, T)).unwrap_err() {
            BoardError::Invalid(msg) => {
                assert!(msg.contains(&format!("task {child} is {what}")), "{msg}")
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
        assert!(events_of(&mut tb.board, child, "linked").is_empty());
    }
    // Linking a pair again stays a no-op once the child runs; a new pair is refused.
    let waiting = ready(&mut tb, "waiting");
    tb.board.write(|tx| tx.link(done, waiting, T)).unwrap();
    claim(&mut tb, waiting, T);
    tb.board
        .write(|tx| tx.link(done, waiting, T))
        .expect("the same link again");
    assert!(tb.board.write(|tx| tx.link(c, waiting, T)).is_err());
    // A comment needs an author as much as a body.
    assert!(matches!(
        tb.board.write(|tx| tx.comment(c, " ", "looks good", T)),
        Err(BoardError::Invalid(msg)) if msg.contains("author")
    ));
}

#[test]
fn child_is_promoted_when_its_parent_completes() {
    let mut tb = temp_board();
    let p1 = ready(&mut tb, "p1");
    let p2 = ready(&mut tb, "p2");
    let child = create(
        &mut tb,
        NewTask {
            parents: vec![p1, p2],
            ..NewTask::titled("child").for_assignee("coder")
        },
        T,
    );
    assert_eq!(status(&mut tb, child), TaskStatus::Todo);

    let c1 = claim(&mut tb, p1, T);
    tb.board
        .write(|tx| tx.complete_task(p1, Some(c1.run_id), None, T + 1))
        .unwrap();
    assert_eq!(status(&mut tb, child), TaskStatus::Todo, "p2 is still open");

    // The second parent is archived rather than completed: that satisfies it too.
    tb.board.write(|tx| tx.archive_task(p2, T + 2)).unwrap();
    assert_eq!(status(&mut tb, child), TaskStatus::Ready);
    let promoted = events_of(&mut tb.board, child, "promoted");
    assert_eq!(promoted.len(), 1);
    assert_eq!(promoted[0].at, T + 2);

    // The sweep's safety net has nothing left to do.
    assert!(
        tb.board
            .write(|tx| tx.promote_ready(T + 3))
            .unwrap()
            .is_empty()
    );
}

#[test]
fn fail_run_retries_with_backoff_then_gives_up() {
    let mut tb = temp_board();
    let task = create(
        &mut tb,
        NewTask {
            max_retries: Some(2),
            ..NewTask::titled("flaky").for_assignee("coder")
        },
        T,
    );
    let mut now = T;
    for attempt in 1..=2 {
        let c = claim(&mut tb, task, now);
        assert_eq!(c.attempt, attempt);
        let result = tb
            .board
            .write(|tx| tx.fail_run(c.run_id, &failure("exit 1", 5_000), now + 1))
            .unwrap();
        assert_eq!(result.status, TaskStatus::Ready);
        assert_eq!(result.consecutive_failures, attempt);
        assert_eq!(result.not_before, now + 1 + 5_000);
        assert_eq!(result.closed.outcome, RunOutcome::Crashed);
        let r = run(&mut tb.board, c.run_id);
        assert_eq!(r.outcome, Some(RunOutcome::Crashed));
        assert_eq!(r.exit_code, Some(1));

        // Not claimable by the dispatcher before the backoff has passed.
        let before = tb
            .board
            .read(|tx| tx.ready_candidates(result.not_before - 1, 10))
            .unwrap();
        assert!(before.iter().all(|t| t.id != task));
        assert_eq!(
            tb.board.read(|tx| tx.next_backoff_expiry(now + 1)).unwrap(),
            Some(result.not_before)
        );
        let after = tb
            .board
            .read(|tx| tx.ready_candidates(result.not_before, 10))
            .unwrap();
        assert!(after.iter().any(|t| t.id == task));
        now = result.not_before;
    }
    let scheduled = events_of(&mut tb.board, task, "retry_scheduled");
    assert_eq!(scheduled.len(), 2);
    assert!(events_of(&mut tb.board, task, "gave_up").is_empty());

    // The third failure exceeds max_retries = 2.
    let c = claim(&mut tb, task, now);
    assert_eq!(c.attempt, 3);
    let result = tb
        .board
        .write(|tx| tx.fail_run(c.run_id, &failure("exit 1 again", 5_000), now + 1))
        .unwrap();
    assert_eq!(result.status, TaskStatus::Blocked);
    assert_eq!(result.consecutive_failures, 3);
    let t = tb.board.read(|tx| tx.get_task(task)).unwrap();
    assert_eq!(t.status, TaskStatus::Blocked);
    assert_eq!(t.block_reason.as_deref(), Some("exit 1 again"));
    assert_eq!(t.current_run_id, None);
    let gave_up = events_of(&mut tb.board, task, "gave_up");
    assert_eq!(gave_up.len(), 1);
    assert_eq!(gave_up[0].payload["failures"], 3);
    assert_eq!(gave_up[0].payload["max_retries"], 2);
    assert_eq!(gave_up[0].payload["last_error"], "exit 1 again");

    // A closed run cannot fail again.
    assert!(matches!(
        tb.board
            .write(|tx| tx.fail_run(c.run_id, &failure("late", 0), now + 2)),
        Err(BoardError::StaleRun { .. })
    ));
    // Unblocking resets the count.
    tb.board.write(|tx| tx.unblock_task(task, now + 3)).unwrap();
    assert_eq!(
        tb.board
            .read(|tx| tx.get_task(task))
            .unwrap()
            .consecutive_failures,
        0
    );
}

#[test]
fn uncounted_and_immediate_failures() {
    let mut tb = temp_board();
    let task = create(
        &mut tb,
        NewTask {
            max_retries: Some(0),
            ..NewTask::titled("rate limited").for_assignee("coder")
        },
        T,
    );
    // Not counted (a rate limit): requeued even with no retries left.
    let c = claim(&mut tb, task, T);
    let result = tb
        .board
        .write(|tx| {
            tx.fail_run(
                c.run_id,
                &Failure {
                    counts: false,
                    ..failure("429", 1_000)
                },
                T + 1,
            )
        })
        .unwrap();
    assert_eq!(
        (result.status, result.consecutive_failures),
        (TaskStatus::Ready, 0)
    );
    // give_up_now blocks at once.
    let c = claim(&mut tb, task, T + 2_000);
    let result = tb
        .board
        .write(|tx| {
            tx.fail_run(
                c.run_id,
                &Failure {
                    give_up_now: true,
                    ..failure("fatal", 1_000)
                },
                T + 2_001,
            )
        })
        .unwrap();
    assert_eq!(result.status, TaskStatus::Blocked);
    assert_eq!(events_of(&mut tb.board, task, "gave_up").len(), 1);
}

#[test]
fn authorize_run_checks_token_and_currency() {
    let mut tb = temp_board();
    let task = ready(&mut tb, "auth");
    let first = claim(&mut tb, task, T);

    let ok = tb
        .board
        .read(|tx| tx.authorize_run(task, first.run_id, &first.token))
        .unwrap();
    assert_eq!(ok.id, first.run_id);

    let wrong = tb
        .board
        .read(|tx| tx.authorize_run(task, first.run_id, "0123456789abcdef0123456789abcdef"));
    assert!(
        matches!(&wrong, Err(BoardError::Unauthorized(_))),
        "{wrong:?}"
    );
    assert_eq!(wrong.unwrap_err().code(), "unauthorized");
    // The right token for another task's id is refused too.
    let other = ready(&mut tb, "other");
    assert!(matches!(
        tb.board
            .read(|tx| tx.authorize_run(other, first.run_id, &first.token)),
        Err(BoardError::Unauthorized(_))
    ));

    // Reclaimed and claimed again: the first worker's (valid) token names a stale run.
    tb.board
        .write(|tx| tx.reclaim_task(task, "lease expired", T + 1))
        .unwrap();
    let second = claim(&mut tb, task, T + 2);
    let stale = tb
        .board
        .read(|tx| tx.authorize_run(task, first.run_id, &first.token));
    match stale {
        Err(BoardError::StaleRun {
            task: t,
            expected,
            current,
        }) => {
            assert_eq!((t, expected), (task, first.run_id));
            assert_eq!(current, second.run_id.to_string());
        }
        other => panic!("expected StaleRun, got {other:?}"),
    }
    // The tokens differ per run.
    assert_ne!(first.token, second.token);
    assert!(matches!(
        tb.board
            .read(|tx| tx.authorize_run(task, second.run_id, &first.token)),
        Err(BoardError::Unauthorized(_))
    ));
    tb.board
        .read(|tx| tx.authorize_run(task, second.run_id, &second.token))
        .unwrap();

    // Once the run closes, even its own token is stale.
    tb.board
        .write(|tx| tx.complete_task(task, Some(second.run_id), None, T + 3))
        .unwrap();
    assert!(matches!(
        tb.board
            .read(|tx| tx.authorize_run(task, second.run_id, &second.token)),
        Err(BoardError::StaleRun { .. })
    ));
}

#[test]
fn migrations_are_idempotent_and_a_newer_schema_is_refused() {
    let mut tb = temp_board();
    let task = ready(&mut tb, "survives reopen");
    let TempBoard { board, path, dir } = tb;
    drop(board);

    // Reopening migrates nothing and loses nothing.
    for _ in 0..2 {
        let mut board = Board::open(&path).expect("reopen");
        assert_eq!(board.integrity_check().unwrap(), "ok");
        assert_eq!(
            board.read(|tx| tx.get_task(task)).unwrap().title,
            "survives reopen"
        );
    }
    let conn = rusqlite::Connection::open(&path).unwrap();
    let version: u32 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    drop(conn);

    // A database written by a newer build is refused, not downgraded or clobbered.
    let board = Board::open(&path).unwrap();
    board
        .execute_raw(&format!("PRAGMA user_version = {}", 99), [])
        .unwrap();
    drop(board);
    match Board::open(&path) {
        Err(BoardError::SchemaTooNew { found, supported }) => {
            assert_eq!((found, supported), (99, SCHEMA_VERSION));
        }
        other => panic!("expected SchemaTooNew, got {other:?}"),
    }
    // Still 99: the refused open wrote nothing.
    let conn = rusqlite::Connection::open(&path).unwrap();
    let version: u32 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 99);
    drop(conn);
    drop(dir);
}

#[test]
fn task_detail_keeps_the_newest_runs_comments_and_events_within_its_bound() {
    let mut tb = temp_board();
    let task = ready(&mut tb, "retried");
    // Five runs, each reclaimed (the task is ready again), and five comments.
    let mut runs = Vec::new();
    let mut comments = Vec::new();
    for i in 0..5 {
        let now = T + 10 * i;
        runs.push(claim(&mut tb, task, now).run_id);
        tb.board
            .write(|tx| tx.reclaim_task(task, "operator", now + 1))
            .unwrap();
        comments.push(
            tb.board
                .write(|tx| tx.comment(task, "op", &"c".repeat(100), now + 2))
                .unwrap(),
        );
    }
    let all_events = events_of_all(&mut tb, task);

    // Unbounded: everything, oldest first, nothing omitted.
    let whole = tb
        .board
        .read(|tx| tx.task_detail(task, 10_000, usize::MAX))
        .unwrap();
    assert_eq!(whole.runs.iter().map(|r| r.id).collect::<Vec<_>>(), runs);
    assert_eq!(
        whole.comments.iter().map(|c| c.id).collect::<Vec<_>>(),
        comments
    );
    assert_eq!(whole.events.len(), all_events.len());
    assert_eq!(
        (
            whole.omitted_runs,
            whole.omitted_comments,
            whole.omitted_events
        ),
        (0, 0, 0)
    );

    // A bound of ~600 bytes a kind: fewer of each, the newest, oldest first, and the rest
    // counted. (Each run or comment costs 128 bytes beside its text.)
    let cut = tb
        .board
        .read(|tx| tx.task_detail(task, 10_000, 3 * 600))
        .unwrap();
    let shown_runs: Vec<_> = cut.runs.iter().map(|r| r.id).collect();
    assert!((1..5).contains(&shown_runs.len()), "{shown_runs:?}");
    assert_eq!(shown_runs, runs[5 - shown_runs.len()..]);
    assert_eq!(cut.omitted_runs as usize + shown_runs.len(), 5);
    let shown_comments: Vec<_> = cut.comments.iter().map(|c| c.id).collect();
    assert_eq!(shown_comments, comments[5 - 2..], "228 bytes each: two fit");
    assert_eq!(cut.omitted_comments, 3);
    assert!(
        !cut.events.is_empty() && cut.events.len() < all_events.len(),
        "{} of {} events",
        cut.events.len(),
        all_events.len()
    );
    assert_eq!(
        cut.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        all_events[all_events.len() - cut.events.len()..]
    );
    assert_eq!(
        cut.omitted_events as usize + cut.events.len(),
        all_events.len()
    );

    // A bound smaller than one row still shows the newest of each.
    let tiny = tb.board.read(|tx| tx.task_detail(task, 3, 1)).unwrap();
    assert_eq!(
        (tiny.runs.len(), tiny.comments.len(), tiny.events.len()),
        (1, 1, 1)
    );
    assert_eq!(tiny.runs[0].id, runs[4]);
    assert_eq!(
        (
            tiny.omitted_runs,
            tiny.omitted_comments,
            tiny.omitted_events
        ),
        (4, 4, 2),
        "of the 3 events asked for, 2 left out"
    );
}

fn events_of_all(tb: &mut TempBoard, task: TaskId) -> Vec<i64> {
    tb.board
        .read(|tx| tx.events_since_within(Some(task), 0, 10_000, usize::MAX))
        .unwrap()
        .0
        .into_iter()
        .map(|e| e.id)
        .collect()
}
