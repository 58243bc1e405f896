//! `[retention] finished`: a task `done` or `archived` longer ago than that leaves the board —
//! its row, runs, events, comments, links — and its log files and default work directory leave
//! the disk, in bounded batches on the tick, with a `pruned` event naming the tasks. Nothing
//! else is touched: unfinished tasks, recent ones, and any task a run of which still holds
//! worker evidence (its worker may be alive: the reaper needs the row). Event ids stay strictly
//! increasing across a prune. `0s` (the default) keeps everything.

#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::board::{LEASE_MS, TempBoard, completed_with_worker, sleeper, temp_board};
use common::lifecycle::{View, add, complete_loop, sh_assignee, task_for};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::board::{BoardError, Event, Millis, NewTask, TaskId, TaskStatus};
use runwarden::config::AssigneeConfig;
use runwarden::{Supervisor, SupervisorError, SupervisorHandle};

const T: Millis = 1_700_000_000_000;

fn create(tb: &mut TempBoard, title: &str, at: Millis) -> TaskId {
    tb.board
        .write(|tx| {
            Ok(tx
                .create_task(&NewTask::titled(title).for_assignee("coder"), at)?
                .id)
        })
        .unwrap()
}

/// A task claimed and completed at `at` with no worker recorded (nothing left to end).
fn done_at(tb: &mut TempBoard, title: &str, at: Millis) -> TaskId {
    let id = create(tb, title, at - 10);
    tb.board
        .write(|tx| {
            let claim = tx.claim_task(id, "test", at - 5, LEASE_MS)?;
            tx.complete_task(id, Some(claim.run_id), Some("ok"), at)?;
            Ok(())
        })
        .unwrap();
    id
}

fn exists(tb: &mut TempBoard, id: TaskId) -> bool {
    match tb.board.read(|tx| tx.get_task(id)) {
        Ok(_) => true,
        Err(BoardError::NotFound { .. }) => false,
        Err(e) => panic!("get_task {id}: {e}"),
    }
}

fn all_events(tb: &mut TempBoard) -> Vec<Event> {
    tb.board
        .read(|tx| tx.events_since_within(None, 0, 10_000, usize::MAX))
        .unwrap()
        .0
}

/// The tasks the `pruned` events name, in order.
fn pruned_ids(events: &[Event]) -> Vec<TaskId> {
    events
        .iter()
        .filter(|e| e.kind == "pruned")
        .flat_map(|e| e.payload["tasks"].as_array().expect("tasks").clone())
        .map(|v| v.as_i64().expect("a task id"))
        .collect()
}

#[test]
fn the_sweep_deletes_only_old_finished_tasks_without_live_evidence() {
    let mut tb = temp_board();
    let old = done_at(&mut tb, "old, done", T);
    let archived = create(&mut tb, "old, archived", T - 50);
    tb.board.write(|tx| tx.archive_task(archived, T)).unwrap();
    let recent = done_at(&mut tb, "recent, done", T + 60_000);
    // Done long ago, but its worker (a real process) may still be alive: kept.
    let (worker, fp) = sleeper(60);
    let (held, _) = completed_with_worker(&mut tb.board, "held", worker.pid(), Some(&fp), T);
    let ready = create(&mut tb, "ready", T - 100);
    let running = create(&mut tb, "running", T - 100);
    tb.board
        .write(|tx| tx.claim_task(running, "test", T - 90, LEASE_MS))
        .unwrap();
    let blocked = create(&mut tb, "blocked", T - 100);
    tb.board
        .write(|tx| tx.block_task(blocked, None, "needs a human", T - 90))
        .unwrap();
    // A child waiting on the old task and on an unfinished one stays waiting on the latter.
    let child = create(&mut tb, "child", T - 100);
    tb.board
        .write(|tx| {
            tx.link(old, child, T - 80)?;
            tx.link(ready, child, T - 80)
        })
        .unwrap();
    tb.board
        .write(|tx| tx.comment(old, "op", "a note", T - 1))
        .unwrap();
    // (The newest comment is not on a task the sweep deletes; see the test below for why.)
    tb.board
        .write(|tx| tx.comment(ready, "op", "later note", T))
        .unwrap();
    let newest_before = all_events(&mut tb).last().unwrap().id;

    // One at a time (by count, then by rows: each has a few events), oldest first.
    let cutoff = T + 1;
    let first = tb
        .board
        .write(|tx| tx.prune_finished(cutoff, 1, u64::MAX, T + 100_000))
        .unwrap();
    assert_eq!(first.len(), 1, "{first:?}");
    let second = tb
        .board
        .write(|tx| tx.prune_finished(cutoff, 100, 1, T + 100_001))
        .unwrap();
    assert_eq!(
        second.len(),
        1,
        "a row budget below one task's still takes one"
    );
    let rest: Vec<_> = second;
    let mut pruned: Vec<_> = first.iter().chain(&rest).copied().collect();
    pruned.sort();
    assert_eq!(pruned, vec![old, archived]);
    // A further sweep finds nothing and writes nothing.
    let again = tb
        .board
        .write(|tx| tx.prune_finished(cutoff, 100, u64::MAX, T + 100_002))
        .unwrap();
    assert!(again.is_empty(), "{again:?}");

    for id in [old, archived] {
        assert!(!exists(&mut tb, id), "task {id} still on the board");
        let runs = tb.board.read(|tx| tx.runs_for_task(id)).unwrap();
        assert!(runs.is_empty(), "runs of {id} left: {runs:?}");
    }
    for id in [recent, held, ready, running, blocked, child] {
        assert!(exists(&mut tb, id), "task {id} was deleted");
    }
    let events = all_events(&mut tb);
    assert!(
        !events
            .iter()
            .any(|e| e.task_id == Some(old) || e.task_id == Some(archived)),
        "events of pruned tasks left"
    );
    let pruned_events: Vec<_> = events.iter().filter(|e| e.kind == "pruned").collect();
    assert_eq!(
        pruned_events.len(),
        2,
        "one per sweep that deleted something"
    );
    assert_eq!(
        pruned_ids(&events),
        first.iter().chain(&rest).copied().collect::<Vec<_>>()
    );
    assert!(pruned_events.iter().all(|e| e.task_id.is_none()));
    // Ids only grow: the pruned events come after every event seen before.
    assert!(pruned_events[0].id > newest_before);
    tb.board
        .write(|tx| tx.comment(recent, "op", "later", T + 100_003))
        .unwrap();
    assert!(all_events(&mut tb).last().unwrap().id > pruned_events[1].id);

    // The child lost only the finished parent; it still waits for `ready`.
    let detail = tb
        .board
        .read(|tx| tx.task_detail(child, 10, usize::MAX))
        .unwrap();
    assert_eq!(detail.parents, vec![ready]);
    assert_eq!(detail.task.status, TaskStatus::Todo);
    drop(worker);
}

fn gone(sup: &SupervisorHandle, id: TaskId) -> bool {
    match sup.task(id) {
        Ok(_) => false,
        Err(SupervisorError::Store(e)) if e.code == "not_found" => true,
        Err(e) => panic!("task {id}: {e}"),
    }
}

fn files(td: &TestDir, id: TaskId) -> [PathBuf; 3] {
    let logs = td.data_dir().join("logs");
    [
        logs.join(format!("{id}.log")),
        logs.join(format!("{id}.log.1")),
        td.data_dir().join("work").join(id.to_string()),
    ]
}

#[test]
fn a_running_supervisor_deletes_finished_tasks_and_their_files_after_the_keep_time() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.retention.finished = Duration::from_secs(2);
    // The writer's log outgrows the smallest rotation size while it runs, so the tick rotates
    // it and the task has a backup log too; it also leaves a file in its work directory.
    config.supervisor.log_max_bytes = 1024;
    config.assignees.insert(
        "writer".into(),
        AssigneeConfig::new([
            "sh",
            "-c",
            "head -c 1500 /dev/zero | tr '\\0' A; echo; mkdir -p sub && echo x > sub/file; \
             sleep 0.5",
        ]),
    );
    // Reports completion, then hangs: its run is done but its worker lives until the grace
    // (long here) ends it, and until then the task must stay.
    config.reaper.grace = Duration::from_secs(5);
    let mut hang = sh_assignee(&format!("{}; sleep 300", complete_loop("ok")));
    hang.max_in_progress = 1;
    config.assignees.insert("hang".into(), hang);
    let mut fails = AssigneeConfig::new(["sh", "-c", "exit 2"]);
    fails.fail_exit_codes = vec![2];
    config.assignees.insert("fails".into(), fails);
    let mut sup = Supervisor::start(config).expect("start the supervisor");

    let done = add(&sup, task_for("retention", "writer"));
    assert_eq!(
        sup.wait_for(done, SETTLE).expect("finishes").status,
        TaskStatus::Done
    );
    let [log, backup, work] = files(&td, done);
    assert!(
        log.exists() && backup.exists() && work.join("sub/file").exists(),
        "the task's files were never all there (rotated log: {})",
        backup.exists()
    );
    let again = add(&sup, task_for("retention", "writer"));
    sup.wait_for(again, SETTLE).expect("finishes");
    let hung = add(&sup, task_for("retention", "hang"));
    assert_eq!(
        sup.wait_for(hung, SETTLE).expect("reports").status,
        TaskStatus::Done
    );
    let blocked = add(&sup, task_for("retention", "fails"));
    assert_eq!(
        sup.wait_for(blocked, SETTLE).expect("gives up").status,
        TaskStatus::Blocked
    );

    assert!(
        wait_until(SETTLE, || gone(&sup, done) && gone(&sup, again)),
        "finished tasks still on the board"
    );
    assert!(
        wait_until(SETTLE, || files(&td, done)
            .iter()
            .chain(&files(&td, again))
            .all(|f| !f.exists())),
        "files left: {:?}",
        files(&td, done)
            .iter()
            .chain(&files(&td, again))
            .filter(|f| f.exists())
            .collect::<Vec<_>>()
    );
    // Its worker is still within the grace: the hung task is kept, and so is the blocked one.
    let run = sup.task(hung).expect("hung task still there").runs[0].clone();
    assert!(
        run.worker_pid.is_some(),
        "the hung worker was already ended; the test's grace is too short for this machine"
    );
    assert!(!gone(&sup, blocked));
    assert!(files(&td, blocked)[0].exists(), "the blocked task's log");

    // Once the grace ends the worker, its task goes too.
    assert!(
        wait_until(SETTLE, || gone(&sup, hung)),
        "the hung task was never deleted after its worker was ended"
    );
    // The newest `pruned` event names it; the earlier ones named the others, and go once they
    // are older than the keep time themselves.
    let named = pruned_ids(&sup.all_events());
    assert_eq!(named.last(), Some(&hung), "{named:?}");
    assert!(
        named.iter().all(|id| [done, again, hung].contains(id)),
        "{named:?}"
    );
    assert!(!gone(&sup, blocked), "an unfinished task is never deleted");
    sup.shutdown();
}

/// Ids are `max(id) + 1`: deleting the newest task, or the task of the newest run or comment,
/// would hand its id to the next one. Those wait until something newer exists.
#[test]
fn the_newest_ids_are_never_deleted_so_never_reused() {
    let mut tb = temp_board();
    let only = done_at(&mut tb, "the newest task", T);
    let swept = |tb: &mut TempBoard, at| {
        tb.board
            .write(|tx| tx.prune_finished(T + 1_000, 100, u64::MAX, at))
            .unwrap()
    };
    assert!(swept(&mut tb, T + 2_000).is_empty(), "the newest task went");

    // A newer task without runs: `only` still owns the newest run.
    let newer = create(&mut tb, "newer", T + 10);
    assert!(
        swept(&mut tb, T + 2_001).is_empty(),
        "the newest run's task went"
    );
    // A run of the newer task, but `only` holds the newest comment.
    tb.board
        .write(|tx| tx.comment(only, "op", "note", T + 11))
        .unwrap();
    tb.board
        .write(|tx| tx.claim_task(newer, "test", T + 12, LEASE_MS))
        .unwrap();
    assert!(
        swept(&mut tb, T + 2_002).is_empty(),
        "the newest comment's task went"
    );
    tb.board
        .write(|tx| tx.comment(newer, "op", "note", T + 13))
        .unwrap();
    assert_eq!(swept(&mut tb, T + 2_003), vec![only]);

    // Whatever comes next gets ids above everything ever handed out.
    let next = create(&mut tb, "next", T + 20);
    assert!(next > newer && newer > only, "{only} {newer} {next}");
}

/// A sweep's own `pruned` event goes as the tasks it named went, once older than the cutoff
/// of a later sweep: retention bounds the board, not one row per sweep for ever. The newest
/// `pruned` event (the one a restart reads) and every recent one stay.
#[test]
fn pruned_events_older_than_the_cutoff_leave_with_a_later_sweep() {
    let mut tb = temp_board();
    let keep = 10_000;
    let sweep = |tb: &mut TempBoard, at: Millis| {
        tb.board
            .write(|tx| tx.prune_finished(at - keep, 100, u64::MAX, at))
            .unwrap()
    };
    // Each sweep finds one old finished task (a newer one, with the newest run, exists: the
    // newest ids are never deleted).
    let mut swept = Vec::new();
    for round in 0..5 {
        let at = T + round * 4_000;
        let old = done_at(&mut tb, "old", at - 2 * keep);
        let newer = create(&mut tb, "newer", at - 1);
        tb.board
            .write(|tx| tx.claim_task(newer, "test", at - 1, LEASE_MS))
            .unwrap();
        assert_eq!(sweep(&mut tb, at), vec![old], "round {round}");
        swept.push((at, old));
    }
    let events = all_events(&mut tb);
    let pruned: Vec<&Event> = events.iter().filter(|e| e.kind == "pruned").collect();
    // The last sweep ran at T + 16 000 with its cutoff at T + 6 000: the events of the sweeps
    // at T and T + 4 000 are gone, those at T + 8 000, T + 12 000 and T + 16 000 stay.
    let at: Vec<Millis> = pruned.iter().map(|e| e.at).collect();
    assert_eq!(at, vec![T + 8_000, T + 12_000, T + 16_000], "{pruned:?}");
    assert_eq!(
        pruned_ids(&events),
        vec![swept[2].1, swept[3].1, swept[4].1]
    );
    assert_eq!(
        tb.board.read(|tx| tx.last_pruned()).unwrap(),
        vec![swept[4].1],
        "the newest sweep's tasks are still known to the next start"
    );
}

#[test]
fn without_a_keep_time_nothing_is_deleted() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["true"]));
    let sup = Supervisor::start(config).expect("start the supervisor");
    let id = add(&sup, task_for("retention", "w"));
    sup.wait_for(id, SETTLE).expect("finishes");
    // Twenty ticks later the task is still there.
    let ticks = wait_until(Duration::from_secs(1), || gone(&sup, id));
    assert!(!ticks, "a task was deleted with retention off");
    assert!(files(&td, id)[0].exists());
    sup.shutdown();
}

#[test]
fn files_a_sweep_left_behind_are_removed_at_the_next_start() {
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    // A sweep whose rows were committed when its supervisor stopped, before it removed the
    // files: the board no longer has the tasks, the disk still has their logs and work dirs.
    let mut board = runwarden::board::Board::open(&td.db_path()).unwrap();
    let (pruned, kept) = board
        .write(|tx| {
            let mut ids = Vec::new();
            for title in ["old", "older", "newest"] {
                let id = tx
                    .create_task(&NewTask::titled(title).for_assignee("w"), T - 100)?
                    .id;
                let claim = tx.claim_task(id, "test", T - 90, LEASE_MS)?;
                tx.complete_task(id, Some(claim.run_id), Some("ok"), T - 80)?;
                ids.push(id);
            }
            let pruned = tx.prune_finished(T, 200, 20_000, T)?;
            Ok((pruned, ids[2]))
        })
        .unwrap();
    drop(board);
    assert_eq!(pruned.len(), 2, "{pruned:?}");
    for id in pruned.iter().chain([&kept]) {
        let [log, backup, work] = files(&td, *id);
        std::fs::create_dir_all(work.join("sub")).unwrap();
        std::fs::create_dir_all(log.parent().unwrap()).unwrap();
        for f in [&log, &backup, &work.join("sub/file")] {
            std::fs::write(f, "x").unwrap();
        }
    }

    // Retention is off in this incarnation: the leftovers go all the same, nothing else does.
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["true"]));
    let sup = Supervisor::start(config).expect("start the supervisor");
    let left = |ids: &[TaskId]| -> Vec<PathBuf> {
        ids.iter()
            .flat_map(|id| files(&td, *id))
            .filter(|f| f.exists())
            .collect()
    };
    assert!(
        wait_until(SETTLE, || left(&pruned).is_empty()),
        "left behind: {:?}",
        left(&pruned)
    );
    assert_eq!(
        left(&[kept]).len(),
        3,
        "a task still on the board lost its files"
    );
    sup.shutdown();
}
