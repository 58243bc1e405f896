//! Retries of crashed runs, end to end with real workers:
//!
//! - a crash returns the task to `ready` after an exponential backoff with jitter
//!   (`not_before − ended_at` within ±20 % of `backoff × 2^(n−1)`), counting
//!   `consecutive_failures`; the retry is not claimed before `not_before`;
//! - at `max_retries` (the task's, else the assignee's, else the config's) the task is
//!   `blocked` with a `gave_up` event carrying the last error, and is not retried until
//!   `unblock`;
//! - each crash quotes its own run's output (the log is shared by the attempts);
//! - a success resets the count;
//! - `retry_exit_codes` requeue without counting, after `retry_cooldown`; `fail_exit_codes`
//!   block at once.

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::{View, add, sh_assignee, task_for, write};
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{Event, NewTask, RunOutcome, TaskId, TaskStatus};
use runwarden::config::AssigneeConfig;

/// A worker that counts its runs per task in `$COUNT_DIR/<task>`, succeeds (exit 0) from run
/// `$SUCCEED_AT` on, and before that fails with `$FAIL_CODE` after a line on stderr.
const COUNTING_WORKER: &str = r#"f="$COUNT_DIR/$RUNWARDEN_TASK_ID"
n=$(cat "$f" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "$f"
if [ "$n" -ge "$SUCCEED_AT" ]; then exit 0; fi
echo "boom in run $RUNWARDEN_RUN_ID" >&2
exit "$FAIL_CODE""#;

fn counting(td: &TestDir, succeed_at: u32, fail_code: i32) -> AssigneeConfig {
    let dir = td.path().join("counts");
    std::fs::create_dir_all(&dir).unwrap();
    let mut a = sh_assignee(COUNTING_WORKER);
    a.env.insert("COUNT_DIR".into(), dir.display().to_string());
    a.env.insert("SUCCEED_AT".into(), succeed_at.to_string());
    a.env.insert("FAIL_CODE".into(), fail_code.to_string());
    a
}

/// Checks each `retry_scheduled` event of `task`: `failures` counts 1, 2, …; the delay is
/// `backoff × 2^(n−1)` within the ±20 % jitter band; the next claim waited for `not_before`.
fn assert_backoffs(sup: &mut impl View, task: TaskId, backoff: Duration) {
    let events = sup.events(task);
    let retries: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind == "retry_scheduled")
        .collect();
    assert!(!retries.is_empty(), "{}", sup.history(task));
    for (i, ev) in retries.iter().enumerate() {
        let n = i as u32 + 1;
        assert_eq!(ev.payload["failures"], n, "{ev:?}");
        assert_eq!(ev.payload["counted"], true, "{ev:?}");
        let not_before = ev.payload["not_before"].as_i64().expect("not_before");
        let delay = not_before - ev.at;
        let base = backoff.as_millis() as f64 * 2f64.powi(i as i32);
        let (lo, hi) = ((base * 0.8).floor() as i64 - 1, (base * 1.2).ceil() as i64);
        assert!(
            (lo..=hi).contains(&delay),
            "retry {n}: not_before − ended_at = {delay} ms, expected {lo}..={hi} ms"
        );
        // The run's close and the retry decision are one transaction: ended_at is ev.at.
        let run = sup.run(ev.run_id.expect("run of the retry"));
        assert_eq!(run.ended_at, Some(ev.at));
        let next_claim = events
            .iter()
            .find(|e| e.kind == "claimed" && e.id > ev.id)
            .unwrap_or_else(|| panic!("no claim after retry {n}\n{}", sup.history(task)));
        assert!(
            next_claim.at >= not_before,
            "claimed at {} before not_before {not_before}",
            next_claim.at
        );
    }
}

#[test]
fn a_crash_backs_off_exponentially_then_gives_up_until_unblocked() {
    let td = TestDir::new();
    let backoff = Duration::from_millis(400);
    let mut config = lib_config(&td);
    config.retries.max_retries = 2;
    config.retries.backoff = backoff;
    config.retries.backoff_max = Duration::from_secs(10);
    config.assignees.insert("w".into(), counting(&td, 4, 3));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("flaky", "w"));

    // Runs 1 and 2 fail and are retried; run 3 fails with no retry left.
    let blocked = sup.wait_status(task, TaskStatus::Blocked, 3 * SETTLE);
    let runs = sup.runs(task);
    assert_eq!(runs.len(), 3, "{}", sup.history(task));
    for (i, r) in runs.iter().enumerate() {
        assert_eq!(r.outcome, Some(RunOutcome::Crashed), "{r:?}");
        assert_eq!(r.exit_code, Some(3), "{r:?}");
        // Each error quotes its own run's output, never an earlier attempt's (the log file is
        // the task's, shared by its attempts).
        let error = r.error.as_deref().unwrap_or_default();
        assert!(error.contains(&format!("boom in run {}", r.id)), "{r:?}");
        for earlier in &runs[..i] {
            assert!(
                !error.contains(&format!("boom in run {}", earlier.id)),
                "run {} quotes run {}: {error}",
                r.id,
                earlier.id
            );
        }
    }
    assert_eq!(blocked.consecutive_failures, 3);
    assert_backoffs(&mut sup, task, backoff);
    let gave_up = sup.events_of(task, "gave_up");
    assert_eq!(gave_up.len(), 1, "{}", sup.history(task));
    assert_eq!(gave_up[0].payload["reason"], "retries_exhausted");
    let last_error = gave_up[0].payload["last_error"]
        .as_str()
        .expect("last_error")
        .to_string();
    assert!(last_error.contains("exited with code 3"), "{last_error}");
    assert!(
        last_error.contains(&format!("boom in run {}", runs[2].id)),
        "the last error is the last run's (with its log tail): {last_error}"
    );
    assert_eq!(gave_up[0].payload["failures"], 3);
    assert_eq!(gave_up[0].payload["max_retries"], 2);
    assert_eq!(gave_up[0].run_id, Some(runs[2].id));
    assert_eq!(blocked.block_reason.as_deref(), Some(last_error.as_str()));

    // Blocked means blocked: no retry however long it waits (the last backoff was ~0.8 s).
    sup.assert_stays(
        task,
        TaskStatus::Blocked,
        &["claimed"],
        Duration::from_millis(1500),
    );

    // An operator's unblock: ready again, count reset, and this time it succeeds.
    let next = write(&sup, move |tx, now| tx.unblock_task(task, now)).expect("unblock");
    assert_eq!(next, TaskStatus::Ready);
    let done = sup.wait_status(task, TaskStatus::Done, SETTLE);
    assert_eq!(done.consecutive_failures, 0);
    assert_eq!(sup.runs(task).len(), 4);
    sup.shutdown();
}

#[test]
fn a_success_resets_the_failure_count() {
    let td = TestDir::new();
    let backoff = Duration::from_millis(100);
    let mut config = lib_config(&td);
    config.retries.max_retries = 2;
    config.retries.backoff = backoff;
    config.retries.backoff_max = Duration::from_secs(10);
    config.assignees.insert("w".into(), counting(&td, 3, 1));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("succeeds on the third try", "w"));

    let done = sup.wait_status(task, TaskStatus::Done, SETTLE);
    assert_eq!(done.consecutive_failures, 0, "{}", sup.history(task));
    let outcomes: Vec<_> = sup.runs(task).iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        [
            Some(RunOutcome::Crashed),
            Some(RunOutcome::Crashed),
            Some(RunOutcome::Completed)
        ]
    );
    assert_backoffs(&mut sup, task, backoff);
    assert!(sup.events_of(task, "gave_up").is_empty());
    sup.shutdown();
}

#[test]
fn max_retries_comes_from_the_task_else_the_assignee_else_the_config() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.retries.max_retries = 3;
    config.retries.backoff = Duration::from_millis(20);
    config.retries.backoff_max = Duration::from_millis(100);
    let mut a = sh_assignee("exit 3");
    a.max_retries = Some(1);
    config.assignees.insert("a".into(), a);
    config.assignees.insert("b".into(), sh_assignee("exit 3"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let by_task = add(
        &sup,
        NewTask {
            max_retries: Some(0),
            ..task_for("task says 0", "a")
        },
    );
    let by_assignee = add(&sup, task_for("assignee says 1", "a"));
    let by_config = add(&sup, task_for("config says 3", "b"));

    for (task, max) in [(by_task, 0), (by_assignee, 1), (by_config, 3)] {
        sup.wait_status(task, TaskStatus::Blocked, SETTLE);
        assert_eq!(sup.runs(task).len(), max + 1, "{}", sup.history(task));
        let gave_up = sup.events_of(task, "gave_up");
        assert_eq!(gave_up.len(), 1, "{}", sup.history(task));
        assert_eq!(gave_up[0].payload["max_retries"], max as i64);
        assert_eq!(sup.events_of(task, "retry_scheduled").len(), max);
    }
    sup.shutdown();
}

#[test]
fn retry_exit_codes_requeue_without_counting_after_the_cooldown() {
    let td = TestDir::new();
    let cooldown = Duration::from_millis(300);
    let mut config = lib_config(&td);
    // A counted failure would give up at once: only an uncounted requeue can retry.
    config.retries.max_retries = 0;
    let mut a = counting(&td, 3, 75);
    a.retry_exit_codes = vec![75];
    a.retry_cooldown = cooldown;
    config.assignees.insert("w".into(), a);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("rate limited twice", "w"));

    let done = sup.wait_status(task, TaskStatus::Done, SETTLE);
    assert_eq!(done.consecutive_failures, 0);
    let runs = sup.runs(task);
    assert_eq!(runs.len(), 3, "{}", sup.history(task));
    for r in &runs[..2] {
        assert_eq!(
            (r.outcome, r.exit_code),
            (Some(RunOutcome::Crashed), Some(75)),
            "{r:?}"
        );
    }
    let events = sup.events(task);
    let retries: Vec<&Event> = events
        .iter()
        .filter(|e| e.kind == "retry_scheduled")
        .collect();
    assert_eq!(retries.len(), 2, "{}", sup.history(task));
    for ev in retries {
        assert_eq!(ev.payload["counted"], false, "{ev:?}");
        assert_eq!(ev.payload["failures"], 0, "{ev:?}");
        let not_before = ev.payload["not_before"].as_i64().unwrap();
        // The cooldown, exactly: no exponential growth, no jitter.
        assert_eq!(not_before - ev.at, cooldown.as_millis() as i64, "{ev:?}");
        let claim = events
            .iter()
            .find(|e| e.kind == "claimed" && e.id > ev.id)
            .unwrap();
        assert!(
            claim.at >= not_before,
            "claimed before the cooldown ended: {claim:?}"
        );
    }
    assert!(sup.events_of(task, "gave_up").is_empty());
    sup.shutdown();
}

#[test]
fn fail_exit_codes_block_at_once() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.retries.max_retries = 5;
    let mut a = sh_assignee("echo 'fatal: bad input' >&2; exit 42");
    a.fail_exit_codes = vec![42];
    config.assignees.insert("w".into(), a);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("hopeless", "w"));

    let blocked = sup.wait_status(task, TaskStatus::Blocked, SETTLE);
    assert_eq!(sup.runs(task).len(), 1, "{}", sup.history(task));
    assert!(sup.events_of(task, "retry_scheduled").is_empty());
    let gave_up = sup.events_of(task, "gave_up");
    assert_eq!(gave_up.len(), 1);
    // It says why it gave up at the first failure.
    assert_eq!(gave_up[0].payload["reason"], "fail_exit_code");
    let last_error = gave_up[0].payload["last_error"].as_str().unwrap();
    assert!(last_error.contains("exited with code 42"), "{last_error}");
    assert!(last_error.contains("fatal: bad input"), "{last_error}");
    assert_eq!(blocked.consecutive_failures, 1);
    sup.assert_stays(
        task,
        TaskStatus::Blocked,
        &["claimed"],
        Duration::from_millis(300),
    );
    sup.shutdown();
}
