//! `replay`: the board work of N task lifecycles on one thread, with no supervisor, no
//! processes and no other thread — the same transitions the actors run (add, claim, spawn
//! evidence, exit + completion + claim for the freed slot) in group commits of the size the
//! lifecycle bench sees. What it measures is SQLite and the board alone, so it is steady where
//! the lifecycle rounds are noisy, and deterministic under callgrind:
//!
//! ```text
//! valgrind --tool=callgrind target/release/examples/bench replay --n 2000 --rounds 1
//! ```
//!
//! It has no target; it is the board's share of a lifecycle, for comparing changes.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use runwarden::board::{
    BatchOp, Board, Claim, ClaimRules, ExitInfo, LogStart, NewTask, OpenOptions, Task, TaskFilter,
    TaskStatus, Tx,
};
use runwarden::process::Fingerprint;

use crate::Opts;
use crate::util::{Summary, median};

/// Runs whose spawn evidence (then whose exits) share a group commit; the lifecycle bench
/// sees 3 ops per lifecycle in about 0.5–0.6 commits, i.e. 5–6 ops per commit.
const BATCH: usize = 4;
/// Adds per commit (the lifecycle bench adds its tasks in one burst).
const ADD_BATCH: usize = 100;

/// Runs `opts.rounds` replays of `opts.tasks` lifecycles; prints µs per lifecycle.
pub fn run(opts: &Opts, dir: &Path, summary: &mut Summary) -> Result<(), String> {
    let n = opts.tasks;
    println!(
        "\n== replay: the board work of N={n} lifecycles on one thread, P={} slots, {} rounds ==",
        opts.parallel, opts.rounds
    );
    let (mut per, mut list_us, mut events_us) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        let path = dir.join(format!("replay-{round}.db"));
        let (elapsed, commits) = replay(&path, n, opts.parallel, opts.sync_full)?;
        let us = elapsed * 1e6 / n as f64;
        let (list, events) = reads(&path)?;
        println!(
            "round {round}: {us:6.1} µs per lifecycle ({commits} commits, {:.2} per lifecycle) | \
             then list_tasks(1000) {list:.0} µs, events_since(0, 10000) {events:.0} µs",
            commits as f64 / n as f64
        );
        per.push(us);
        list_us.push(list);
        events_us.push(events);
    }
    summary.line(format!(
        "replay: N={n} P={} rounds={} board work per lifecycle median={:.1}us (one thread, no supervisor) | reads after: list_tasks(1000)={:.0}us events_since(10000)={:.0}us",
        opts.parallel,
        opts.rounds,
        median(&per),
        median(&list_us),
        median(&events_us),
    ));
    Ok(())
}

/// The two big reads on the replayed board (its 6 N events), best of 10 each, in µs: what a
/// change to the page layout costs readers.
fn reads(path: &Path) -> Result<(f64, f64), String> {
    let err = |e: runwarden::board::BoardError| e.to_string();
    let mut b = Board::open(path).map_err(err)?;
    let filter = TaskFilter {
        limit: Some(1000),
        ..TaskFilter::default()
    };
    let (mut list, mut events) = (f64::MAX, f64::MAX);
    for _ in 0..10 {
        let t = Instant::now();
        b.read(|tx| tx.list_tasks(&filter)).map_err(err)?;
        list = list.min(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        b.read(|tx| tx.events_since(0, 10_000)).map_err(err)?;
        events = events.min(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok((list, events))
}

/// One replay on a fresh board; returns (seconds, commits).
fn replay(path: &Path, n: usize, slots: usize, sync_full: bool) -> Result<(f64, usize), String> {
    let err = |e: runwarden::board::BoardError| e.to_string();
    let mut b = Board::open_with(
        path,
        OpenOptions {
            synchronous_full: sync_full,
            read_only: false,
        },
    )
    .map_err(err)?;
    let rules = ClaimRules {
        caps: BTreeMap::from([("true".to_string(), slots as u32)]),
        max_in_progress: slots as u32,
        claimer: "replay".into(),
        lease_ms: 60_000,
    };
    let fp = Fingerprint {
        boot_id: "0123456789abcdef0123456789abcdef".into(),
        start_ticks: 12_345,
        // As a worker's on a kernel with pidfs: one more column written per spawn.
        pidfs_ino: Some(7_000_000),
    };
    let mut now = 1_700_000_000_000i64;
    let mut commits = 0;
    let t0 = Instant::now();

    let mut created = 0;
    while created < n {
        let k = ADD_BATCH.min(n - created);
        let ops: Vec<BatchOp<'_, ()>> = (created..created + k)
            .map(|i| -> BatchOp<'_, ()> {
                Box::new(move |tx: &Tx<'_>| {
                    let new = NewTask::titled(format!("bench {i}")).for_assignee("true");
                    tx.create_task(&new, now).map(|_| ())
                })
            })
            .collect();
        all_ok(b.write_batch(ops).map_err(err)?.results)?;
        created += k;
        commits += 1;
    }
    let first: BatchOp<'_, Vec<(Claim, Task)>> =
        Box::new(|tx: &Tx<'_>| tx.claim_ready(now, &rules, u32::MAX));
    let mut live: Vec<Claim> = all_ok(b.write_batch(vec![first]).map_err(err)?.results)?
        .into_iter()
        .flatten()
        .map(|(c, _)| c)
        .collect();
    commits += 1;

    let mut pid = 1000;
    let mut done = 0;
    while !live.is_empty() {
        now += 5;
        let cur: Vec<Claim> = live.drain(..live.len().min(BATCH)).collect();
        // Spawn evidence for a group of runs, one commit...
        let ops: Vec<BatchOp<'_, ()>> = cur
            .iter()
            .map(|c| -> BatchOp<'_, ()> {
                pid += 1;
                let (run, p, fp) = (c.run_id, pid, fp.clone());
                Box::new(move |tx: &Tx<'_>| {
                    tx.set_worker(run, p, Some(&fp), Some(&LogStart::default()), now)
                        .map(|_| ())
                })
            })
            .collect();
        all_ok(b.write_batch(ops).map_err(err)?.results)?;
        // ...then their exits, each closing its run and claiming for its freed slot.
        now += 1;
        let rules = &rules;
        let ops: Vec<BatchOp<'_, Vec<Claim>>> = cur
            .iter()
            .map(|c| -> BatchOp<'_, Vec<Claim>> {
                let (run, task, fp) = (c.run_id, c.task_id, fp.clone());
                Box::new(move |tx: &Tx<'_>| {
                    tx.set_worker_if_unset(run, 0, Some(&fp), Some(&LogStart::default()), now)?;
                    let exit = ExitInfo {
                        code: Some(0),
                        signal: None,
                    };
                    let r = tx.record_worker_exit(run, exit, false, now)?;
                    if r.is_open() {
                        tx.complete_task(task, Some(run), None, now)?;
                    }
                    let claimed = tx.nested(|tx| tx.claim_ready(now, rules, u32::MAX))?;
                    Ok(claimed.into_iter().map(|(c, _)| c).collect())
                })
            })
            .collect();
        for claimed in all_ok(b.write_batch(ops).map_err(err)?.results)? {
            live.extend(claimed);
            done += 1;
        }
        commits += 2;
    }
    let elapsed = t0.elapsed().as_secs_f64();
    let finished = b
        .read(|tx| tx.status_counts())
        .map_err(err)?
        .get(TaskStatus::Done.as_str())
        .copied()
        .unwrap_or(0);
    if done != n || finished as usize != n {
        return Err(format!(
            "replay finished {done} lifecycles ({finished} tasks done) of {n}"
        ));
    }
    Ok((elapsed, commits))
}

fn all_ok<T>(results: Vec<runwarden::board::Result<T>>) -> Result<Vec<T>, String> {
    results
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|e| format!("a replayed transition failed: {e}"))
}
