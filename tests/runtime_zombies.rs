//! The supervisor is a child subreaper and reaps every zombie it inherits, and only those:
//! orphaned descendants of workers re-parent to the real `serve` process and are reaped by it,
//! while the workers' own exit statuses are never stolen by that reaping.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir, children_of, runs_of};
use runwarden::board::{Board, NewTask, RunOutcome, TaskId, TaskStatus, now_millis};
use runwarden::process::{Pid, Signal, read_stat};

fn add_tasks(db: &Path, who: &str, n: usize) -> Vec<TaskId> {
    let mut board = Board::open(db).expect("open the board");
    board
        .write(|tx| {
            (0..n)
                .map(|i| {
                    let new = NewTask::titled(format!("{who} {i}")).for_assignee(who);
                    tx.create_task(&new, now_millis()).map(|c| c.id)
                })
                .collect()
        })
        .expect("create tasks")
}

/// Waits until every task is finished (`done` or `blocked`: with `max_retries = 0` a run that
/// failed blocks its task at once); fails with the stragglers otherwise.
fn wait_all_finished(db: &Path, ids: &[TaskId], serve: &Serve) -> Board {
    let finished = |s: TaskStatus| matches!(s, TaskStatus::Done | TaskStatus::Blocked);
    let mut board = Board::open(db).expect("open the board");
    let all = wait_until(3 * SETTLE, || {
        ids.iter().all(|&id| {
            board
                .read(|tx| tx.get_task(id))
                .is_ok_and(|t| finished(t.status))
        })
    });
    if !all {
        let stuck: Vec<_> = ids
            .iter()
            .filter_map(|&id| board.read(|tx| tx.get_task(id)).ok())
            .filter(|t| !finished(t.status))
            .collect();
        panic!("tasks not finished: {stuck:?}\nstderr:\n{}", serve.stderr());
    }
    board
}

/// Zombie children of `ppid`.
fn zombies_of(ppid: Pid) -> Vec<Pid> {
    children_of(ppid)
        .into_iter()
        .filter(|s| s.is_zombie())
        .map(|s| s.pid)
        .collect()
}

#[test]
fn orphaned_descendants_re_parent_to_serve_and_their_zombies_are_reaped() {
    const TASKS: usize = 3;
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"",
        "[assignees.forker]\n\
         command = [\"sh\", \"-c\", \"(sleep 5 &) ; sleep 1\"]\n\
         max_in_progress = 3\n\
         max_retries = 0\n",
    );
    let db = td.db_path();
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &db);
    let sup = serve.pid();
    let ids = add_tasks(&db, "forker", TASKS);

    // Each worker's inner `sleep 5` loses its parent (the subshell) at once and is
    // re-parented to the supervisor, the nearest subreaper. Watch them appear: they live at
    // least the second their worker does (then they are ended with its group, leaving zombies
    // for serve to reap).
    let mut orphans: BTreeMap<Pid, u64> = BTreeMap::new();
    let seen_all = wait_until(SETTLE, || {
        for s in children_of(sup) {
            if s.comm == "sleep" && !s.is_zombie() {
                orphans.entry(s.pid).or_insert(s.start_ticks);
            }
        }
        orphans.len() == TASKS
    });
    assert!(
        seen_all,
        "expected {TASKS} orphaned sleeps re-parented to serve (pid {sup}), saw {orphans:?}"
    );

    let mut board = wait_all_finished(&db, &ids, &serve);
    for &id in &ids {
        let runs = runs_of(&mut board, id);
        assert_eq!(runs.len(), 1, "{runs:?}");
        assert_eq!(
            runs[0].outcome,
            Some(RunOutcome::Completed),
            "{:?}",
            runs[0]
        );
        assert_eq!(runs[0].exit_code, Some(0), "{:?}", runs[0]);
    }

    // Only the supervisor can reap its own children: an orphan that vanishes from /proc was
    // reaped by it (a pid reused meanwhile shows another start time).
    let reaped = wait_until(SETTLE, || {
        orphans
            .iter()
            .all(|(&pid, &ticks)| read_stat(pid).map_or(true, |s| s.start_ticks != ticks))
    });
    let left: Vec<_> = orphans.keys().map(|&p| read_stat(p).ok()).collect();
    assert!(reaped, "orphans not reaped by serve: {left:?}");
    assert!(
        wait_until(SETTLE, || zombies_of(sup).is_empty()),
        "zombie children of serve (pid {sup}) remain: {:?}",
        zombies_of(sup)
    );
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn reaping_orphans_never_steals_a_workers_exit_status() {
    // Many short workers that each leave an orphan behind, with a very fast tick so the orphan
    // reaper scans for zombies all the time while workers are exiting.
    const TASKS: usize = 100;
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"5ms\"\nmax_in_progress = 8\nsynchronous = \"normal\"",
        "[assignees.quick]\n\
         command = [\"sh\", \"-c\", \"(sleep 0.05 &) ; exit 0\"]\n\
         max_in_progress = 8\n\
         max_retries = 0\n",
    );
    let db = td.db_path();
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &db);
    let sup = serve.pid();
    let started = Instant::now();
    let ids = add_tasks(&db, "quick", TASKS);

    let mut board = wait_all_finished(&db, &ids, &serve);
    eprintln!("{TASKS} tasks done in {:?}", started.elapsed());
    for &id in &ids {
        let runs = runs_of(&mut board, id);
        assert_eq!(runs.len(), 1, "task {id}: {runs:?}");
        let run = &runs[0];
        assert_eq!(
            (run.exit_code, run.exit_signal),
            (Some(0), None),
            "the worker's own exit status was recorded: {run:?}"
        );
        assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    }
    assert!(
        wait_until(SETTLE, || zombies_of(sup).is_empty()),
        "zombie children of serve (pid {sup}) remain: {:?}",
        zombies_of(sup)
    );
    serve.stop_cleanly(Signal::SIGTERM);
}
