//! `store`: durable event appends per second through the StoreActor (group commit) against one
//! transaction per append on a plain `Board`, both at `synchronous = FULL`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use runwarden::actors::store::{Flush, StoreActor};
use runwarden::board::{self, Board, OpenOptions, Tx};
use runwarden::config::Scheduling;
use serde_json::json;

use crate::Opts;
use crate::util::{Summary, mean, p50_p99};

const TARGET: f64 = 50_000.0;

const FULL: OpenOptions = OpenOptions {
    synchronous_full: true,
    read_only: false,
};

/// A gap this long between two consecutive ops on the writer thread is taken as a commit
/// boundary (ops of one batch run back to back, a few µs apart; a commit costs an fsync).
const COMMIT_GAP_NS: u64 = 150_000;

/// Writer-thread op clock for the commit-count heuristic.
static LAST_OP_NS: AtomicU64 = AtomicU64::new(0);
static LAST_OP_NOW: AtomicU64 = AtomicU64::new(0);
static BOUNDARIES: AtomicU64 = AtomicU64::new(0);

fn mono_ns() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Called inside each op on the writer thread: counts likely commit boundaries.
fn note_op(now: board::Millis) {
    let t = mono_ns();
    let prev = LAST_OP_NS.swap(t, Ordering::Relaxed);
    let prev_now = LAST_OP_NOW.swap(now as u64, Ordering::Relaxed);
    if t.saturating_sub(prev) > COMMIT_GAP_NS || prev_now != now as u64 {
        BOUNDARIES.fetch_add(1, Ordering::Relaxed);
    }
}

/// One boxed op of a `write_batch`.
type BatchOp<'a> = Box<dyn Fn(&Tx<'_>) -> board::Result<i64> + 'a>;

fn append(tx: &Tx<'_>, i: usize, now: board::Millis) -> board::Result<i64> {
    tx.append_event(None, None, "bench", json!({ "i": i }), now)
}

struct GroupRun {
    elapsed: Duration,
    errors: usize,
    commits: u64,
}

/// What each op does on the writer thread.
#[derive(Clone, Copy)]
enum Op {
    Append,
    /// Nothing: measures the actor, channel, transaction and reply path alone.
    Null,
}

/// `n` appends from `callers` concurrent callers, each awaiting one append at a time, through
/// a StoreActor on `path` inside its own actix system.
fn group_commit(path: PathBuf, n: usize, callers: usize, op: Op) -> Result<GroupRun, String> {
    BOUNDARIES.store(0, Ordering::Relaxed);
    LAST_OP_NS.store(0, Ordering::Relaxed);
    let system = actix::System::new();
    let res = system.block_on(async move {
        let store =
            StoreActor::start_on(path, FULL, Scheduling::default()).map_err(|e| e.to_string())?;
        let next = Arc::new(AtomicUsize::new(0));
        let errors = Arc::new(AtomicUsize::new(0));
        let t0 = Instant::now();
        // Each caller is a task of its own on the runtime, not one of many futures polled by a
        // `join_all`: with 100 000 callers (the burst) that combinator's re-polling under
        // tokio's cooperative budget took 80 % of the run and made it vary tenfold.
        let tasks: Vec<_> = (0..callers.min(n))
            .map(|_| {
                let (store, next, errors) = (store.clone(), next.clone(), errors.clone());
                actix_rt::spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        let r = store
                            .with_tx(move |tx, now| {
                                note_op(now);
                                match op {
                                    Op::Append => append(tx, i, now),
                                    Op::Null => Ok(0),
                                }
                            })
                            .await;
                        if r.is_err() {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.map_err(|e| format!("a caller task failed: {e}"))?;
        }
        let elapsed = t0.elapsed();
        let _ = store.addr.send(Flush).await;
        Ok::<_, String>(GroupRun {
            elapsed,
            errors: errors.load(Ordering::Relaxed),
            commits: BOUNDARIES.load(Ordering::Relaxed),
        })
    });
    actix::System::current().stop();
    let _ = system.run();
    res
}

/// `n` appends on a plain board through `write_batch` in batches of `batch` (no actor): the
/// SQLite ceiling of group commit.
fn plain_batches(path: &Path, n: usize, batch: usize) -> Result<Duration, String> {
    let mut b = Board::open_with(path, FULL).map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let mut i = 0;
    while i < n {
        let k = batch.min(n - i);
        let now = board::now_millis();
        let ops: Vec<BatchOp<'_>> = (i..i + k)
            .map(|j| Box::new(move |tx: &Tx<'_>| append(tx, j, now)) as BatchOp<'_>)
            .collect();
        for r in b.write_batch(ops).map_err(|e| e.to_string())?.results {
            r.map_err(|e| e.to_string())?;
        }
        i += k;
    }
    Ok(t0.elapsed())
}

pub fn run(opts: &Opts, base: &Path, summary: &mut Summary) -> Result<(), String> {
    let dir = base.join("store");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let n = opts.events;
    println!("\n== store: {n} durable appends, synchronous=FULL, group commit vs one tx each ==");

    let g = group_commit(dir.join("callers.db"), n, opts.callers, Op::Append)?;
    let rate = n as f64 / g.elapsed.as_secs_f64();
    println!(
        "group commit, {} callers: {n} appends in {:.3}s = {rate:.0}/s, errors {}, ≈{} commits (≈{:.1} ops/commit, heuristic)",
        opts.callers,
        g.elapsed.as_secs_f64(),
        g.errors,
        g.commits,
        n as f64 / g.commits.max(1) as f64
    );

    let b = group_commit(dir.join("burst.db"), n, n, Op::Append)?;
    let burst_rate = n as f64 / b.elapsed.as_secs_f64();
    println!(
        "group commit, burst (all {n} in flight): {:.3}s = {burst_rate:.0}/s, errors {}, ≈{} commits (≈{:.1} ops/commit)",
        b.elapsed.as_secs_f64(),
        b.errors,
        b.commits,
        n as f64 / b.commits.max(1) as f64
    );

    // Baseline: one transaction (one fsync) per append.
    let cap = opts.baseline_cap.min(n).max(1);
    let mut single = Board::open_with(&dir.join("single.db"), FULL).map_err(|e| e.to_string())?;
    let mut lat_ms = Vec::with_capacity(cap);
    let t0 = Instant::now();
    for i in 0..cap {
        let t = Instant::now();
        single
            .write(|tx| append(tx, i, board::now_millis()))
            .map_err(|e| e.to_string())?;
        lat_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let base_elapsed = t0.elapsed();
    let base_rate = cap as f64 / base_elapsed.as_secs_f64();
    println!(
        "baseline, one tx per append: {cap} appends in {:.3}s = {base_rate:.0}/s (extrapolated to {n}: {:.1}s); commit ms {}",
        base_elapsed.as_secs_f64(),
        n as f64 / base_rate,
        p50_p99(&lat_ms)
    );

    // Little's law: C callers each waiting for a durable reply cannot exceed C per commit.
    let commit_mean_s = mean(&lat_ms) / 1e3;
    let bound = opts.callers as f64 / commit_mean_s;
    println!(
        "bound: {} callers / {:.2} ms per commit = {bound:.0}/s at most (callers needed for {TARGET:.0}/s: ≈{:.0})",
        opts.callers,
        commit_mean_s * 1e3,
        TARGET * commit_mean_s
    );

    // Where the group-commit time goes.
    let k = n.min(20_000);
    let nn = n.min(50_000);
    let null = group_commit(dir.join("null.db"), nn, nn, Op::Null)?;
    let null_rate = nn as f64 / null.elapsed.as_secs_f64();
    println!(
        "profile: burst of {nn} no-op ops through the StoreActor (actor + channel + transaction + reply): {null_rate:.0}/s = {:.1} µs/op, ≈{} commits",
        1e6 / null_rate,
        null.commits
    );
    let mut ceilings = Vec::new();
    for batch in [opts.callers.min(1024), 1024] {
        let d = plain_batches(&dir.join(format!("plain-{batch}.db")), k, batch)?;
        let r = k as f64 / d.as_secs_f64();
        println!("profile: plain Board::write_batch, {batch} ops/commit, no actor: {r:.0}/s");
        ceilings.push((batch, r));
    }
    let commit_ms = mean(&lat_ms);

    // A failed write is no throughput: any error fails the verdict.
    let v_callers = summary.verdict(rate >= TARGET && g.errors == 0);
    let v_burst = summary.verdict(burst_rate >= TARGET && b.errors == 0);
    summary.line(format!(
        "store: N={n} sync=FULL group_commit[{} callers]={rate:.0}/s (~{:.1} ops/commit; Little bound {bound:.0}/s) {v_callers} | \
         group_commit[burst]={burst_rate:.0}/s {v_burst} | baseline_one_tx={base_rate:.0}/s ({cap} writes, commit mean {commit_ms:.2}ms) | \
         speedup={:.1}x (burst {:.1}x) | target>={TARGET:.0}/s",
        opts.callers,
        n as f64 / g.commits.max(1) as f64,
        rate / base_rate,
        burst_rate / base_rate,
    ));
    summary.line(format!(
        "store.profile: plain write_batch {} | no-op ops via actor {null_rate:.0}/s ({:.1}us/op)",
        ceilings
            .iter()
            .map(|(b, r)| format!("{b}/commit={r:.0}/s"))
            .collect::<Vec<_>>()
            .join(" "),
        1e6 / null_rate
    ));
    Ok(())
}
