//! Sweeps cost O(rows still holding evidence / open runs), not O(history): the design requires a
//! board with a million closed runs to tick as fast as an empty one. Timing is not asserted (no
//! timed assertions in tests); the query plan is. On a board with 20 000 closed runs, the
//! terminal reaper's candidate query must search the `runs_evidence` partial index, the open
//! runs query the `runs_open` one and the caps' count the `runs_holding` one, never scan
//! `task_runs`.
//!
//! The board exposes no EXPLAIN, so the plans are read through a second connection to the same
//! file, for copies of the board's SQL. The copies are checked against the source text
//! (`include_str!`) so a change to a query fails here instead of silently testing a stale copy.

#[allow(dead_code)]
mod common;

use common::board::{LEASE_MS, temp_board};
use runwarden::board::{Board, NewTask, RunId, TaskId};
use runwarden::process::Fingerprint;

/// Closed runs without worker evidence (the history).
const HISTORY: usize = 20_000;
/// Operations per write transaction while building the history.
const PER_TX: usize = 2_000;

const REAPER_SRC: &str = include_str!("../src/board/reaper.rs");
const READS_SRC: &str = include_str!("../src/board/reads.rs");

/// `Tx::terminal_reap_candidates` (src/board/reaper.rs).
const TERMINAL_REAP_CANDIDATES: &str = "SELECT id, task_id, worker_pid, worker_boot_id, \
     worker_start_ticks, ended_at, token, outcome FROM task_runs \
     WHERE ended_at IS NOT NULL AND worker_pid IS NOT NULL AND ended_at <= ?1 \
     AND ended_at <= ?1 - CASE WHEN outcome IN ('completed', 'blocked') THEN ?2 ELSE 0 END \
     AND worker_boot_id IS NOT NULL AND worker_start_ticks IS NOT NULL ORDER BY ended_at";
/// `Tx::open_runs` (src/board/reads.rs), with the column list it formats in.
const OPEN_RUNS: &str = "SELECT id, task_id, attempt, assignee, token, claimer, outcome, \
     started_at, ended_at, lease_expires_at, heartbeat_at, spawned_pid, worker_pid, \
     worker_boot_id, worker_start_ticks, exit_code, exit_signal, error, summary \
     FROM task_runs WHERE ended_at IS NULL ORDER BY id";
/// `Tx::slot_holders_by_assignee` (src/board/reads.rs): what the caps count on every pass.
const SLOT_HOLDERS: &str = "SELECT coalesce(assignee, '') FROM task_runs INDEXED BY runs_holding \
     WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1";

/// Fragments of the board's source that the copies above must still match.
const SOURCE_FRAGMENTS: &[(&str, &str)] = &[
    (
        REAPER_SRC,
        "WHERE ended_at IS NOT NULL AND worker_pid IS NOT NULL AND ended_at <= ?1",
    ),
    (
        REAPER_SRC,
        "AND worker_boot_id IS NOT NULL AND worker_start_ticks IS NOT NULL",
    ),
    (REAPER_SRC, "ORDER BY ended_at\""),
    (
        REAPER_SRC,
        "AND ended_at <= ?1 - CASE WHEN outcome IN ('completed', 'blocked') THEN ?2 ELSE 0 END",
    ),
    (
        READS_SRC,
        "\"SELECT {RUN_COLS} FROM task_runs WHERE ended_at IS NULL ORDER BY id\"",
    ),
    (
        READS_SRC,
        "\"SELECT coalesce(assignee, '') FROM task_runs INDEXED BY runs_holding \\",
    ),
    (
        READS_SRC,
        "WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1\"",
    ),
];

fn fp(ticks: u64) -> Fingerprint {
    Fingerprint {
        boot_id: "11111111-2222-3333-4444-555555555555".into(),
        start_ticks: ticks,
        pidfs_ino: None,
    }
}

/// Creates, claims and closes `n` tasks in transactions of `PER_TX`; every `with_exit`-th run
/// had a worker whose exit was recorded (evidence cleared), the rest never had one.
fn build_history(board: &mut Board, n: usize, now: i64) {
    for chunk in 0..n.div_ceil(PER_TX) {
        let count = PER_TX.min(n - chunk * PER_TX);
        board
            .write(|tx| {
                for i in 0..count {
                    let task = tx
                        .create_task(&NewTask::titled("history").for_assignee("coder"), now)?
                        .id;
                    let claim = tx.claim_task(task, "history", now, LEASE_MS)?;
                    if i % 10 == 0 {
                        tx.set_worker(
                            claim.run_id,
                            1000 + i as i32,
                            Some(&fp(i as u64)),
                            None,
                            now,
                        )?;
                        tx.record_worker_exit(
                            claim.run_id,
                            runwarden::board::ExitInfo {
                                code: Some(0),
                                signal: None,
                            },
                            false,
                            now,
                        )?;
                    }
                    tx.complete_task(task, Some(claim.run_id), Some("ok"), now + 1)?;
                }
                Ok(())
            })
            .expect("build history");
    }
}

/// `EXPLAIN QUERY PLAN` of `sql`, one `detail` line per step.
fn plan(conn: &rusqlite::Connection, sql: &str) -> Vec<String> {
    let mut stmt = conn
        .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
        .unwrap_or_else(|e| panic!("cannot explain {sql}: {e}"));
    let n = stmt.parameter_count();
    let params: Vec<i64> = vec![0; n];
    let rows = stmt
        .query_map(rusqlite::params_from_iter(params), |r| {
            r.get::<_, String>(3)
        })
        .unwrap();
    rows.collect::<rusqlite::Result<_>>().unwrap()
}

/// True if a step of the plan reads the whole `task_runs` table.
fn scans_table(steps: &[String]) -> bool {
    steps
        .iter()
        .any(|s| s.starts_with("SCAN task_runs") && !s.contains("INDEX"))
}

#[track_caller]
fn assert_uses_index(conn: &rusqlite::Connection, sql: &str, index: &str) {
    let steps = plan(conn, sql);
    println!("{index}: {steps:?}");
    assert!(
        steps
            .iter()
            .any(|s| s.contains(&format!("USING INDEX {index}"))
                || s.contains(&format!("USING COVERING INDEX {index}"))),
        "{sql}\n does not use {index}: {steps:?}"
    );
    assert!(
        !scans_table(&steps),
        "{sql}\n scans the whole task_runs table: {steps:?}"
    );
}

#[test]
fn sweep_queries_use_the_partial_indexes_not_the_history() {
    for (src, fragment) in SOURCE_FRAGMENTS {
        assert!(
            src.contains(fragment),
            "the board's SQL changed; update this test's copy (missing: {fragment})"
        );
    }

    let mut tb = temp_board();
    let now = 1_700_000_000_000;
    build_history(&mut tb.board, HISTORY, now);

    // Three closed runs that still hold evidence, one legacy row (pid without fingerprint, never
    // a candidate), one open run with a worker.
    let mut live: Vec<(TaskId, RunId)> = Vec::new();
    let (legacy_run, open_run) = tb
        .board
        .write(|tx| {
            for i in 0..3 {
                let task = tx
                    .create_task(&NewTask::titled("evidence").for_assignee("coder"), now)?
                    .id;
                let claim = tx.claim_task(task, "c", now, LEASE_MS)?;
                tx.set_worker(claim.run_id, 50_000 + i, Some(&fp(7 + i as u64)), None, now)?;
                tx.complete_task(task, Some(claim.run_id), None, now + 10 + i64::from(i))?;
                live.push((task, claim.run_id));
            }
            let legacy = tx
                .create_task(&NewTask::titled("legacy").for_assignee("coder"), now)?
                .id;
            let claim = tx.claim_task(legacy, "c", now, LEASE_MS)?;
            tx.set_worker(claim.run_id, 60_000, None, None, now)?;
            tx.complete_task(legacy, Some(claim.run_id), None, now)?;
            let open = tx
                .create_task(&NewTask::titled("open").for_assignee("coder"), now)?
                .id;
            let open_claim = tx.claim_task(open, "c", now, LEASE_MS)?;
            tx.set_worker(open_claim.run_id, 60_001, Some(&fp(99)), None, now)?;
            Ok((claim.run_id, open_claim.run_id))
        })
        .unwrap();

    let (candidates, open, by_assignee) = tb
        .board
        .read(|tx| {
            Ok((
                tx.terminal_reap_candidates(now + 1_000_000, 120_000)?,
                tx.open_runs()?,
                tx.slot_holders_by_assignee()?,
            ))
        })
        .unwrap();
    let got: Vec<(TaskId, RunId)> = candidates.iter().map(|c| (c.task_id, c.run_id)).collect();
    assert_eq!(
        got, live,
        "exactly the three runs with evidence, oldest first"
    );
    assert!(candidates.iter().all(|c| c.run_id != legacy_run));
    assert_eq!(
        open.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![open_run]
    );
    // The caps count live workers: the open run, and the three closed runs whose worker may
    // still be alive — not the legacy one (no fingerprint: it could never be proven gone and
    // would hold the slot for good), none of the history.
    assert_eq!(by_assignee.get("coder"), Some(&4));
    // None of them is a candidate before its grace has passed.
    assert!(
        tb.board
            .read(|tx| tx.terminal_reap_candidates(now, 120_000))
            .unwrap()
            .is_empty()
    );

    let conn = rusqlite::Connection::open(&tb.path).unwrap();
    let total: i64 = conn
        .query_row("SELECT count(*) FROM task_runs", [], |r| r.get(0))
        .unwrap();
    assert_eq!(total, HISTORY as i64 + 5);
    assert_uses_index(&conn, TERMINAL_REAP_CANDIDATES, "runs_evidence");
    assert_uses_index(&conn, OPEN_RUNS, "runs_open");
    assert_uses_index(&conn, SLOT_HOLDERS, "runs_holding");
    // The check can fail: without the index's predicate the same question scans the history.
    let unindexed = plan(
        &conn,
        "SELECT id FROM task_runs WHERE ended_at <= ?1 AND worker_boot_id IS NOT NULL",
    );
    assert!(scans_table(&unindexed), "{unindexed:?}");

    // The same plans once statistics exist (a maintenance `ANALYZE` must not flip them).
    conn.execute_batch("ANALYZE").unwrap();
    drop(conn);
    let conn = rusqlite::Connection::open(&tb.path).unwrap();
    assert_uses_index(&conn, TERMINAL_REAP_CANDIDATES, "runs_evidence");
    assert_uses_index(&conn, OPEN_RUNS, "runs_open");
    assert_uses_index(&conn, SLOT_HOLDERS, "runs_holding");
}
