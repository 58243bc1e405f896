//! The caps hold end to end: 50 tasks across two assignees with caps 2 and 3 (global cap 5),
//! run by a supervisor started through the library. Checked twice, independently: from the
//! real worker processes (each appends `start`/`end` lines with its pid to a shared file, with
//! O_APPEND) and from the board (the overlap of `[worker_spawned, worker_exited]` per assignee,
//! in commit order). Every task ends `done`, and every run has its pid and fingerprint recorded.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::fs;
use std::time::Instant;

use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config, worker_identity};
use runwarden::Supervisor;
use runwarden::board::{NewTask, RunOutcome, TaskId, TaskStatus};
use runwarden::config::AssigneeConfig;
use runwarden::process::boot_id;

const TASKS: usize = 50;
const CAPS: [(&str, u32); 2] = [("a", 2), ("b", 3)];
const GLOBAL_CAP: u32 = 5;

/// Max number of intervals open at once, given `+1`/`-1` steps in order.
fn max_open(steps: impl IntoIterator<Item = i32>) -> i32 {
    let (mut open, mut max) = (0, 0);
    for s in steps {
        open += s;
        assert!(open >= 0, "an interval ended before it started");
        max = max.max(open);
    }
    max
}

#[test]
fn fifty_tasks_never_exceed_the_per_assignee_caps() {
    let td = TestDir::new();
    let trace = td.path().join("trace.log");
    let mut config = lib_config(&td);
    config.supervisor.max_in_progress = GLOBAL_CAP;
    for (name, cap) in CAPS {
        // The first `cap` workers of an assignee wait (up to 3 s) until `cap` have started, so
        // the cap is provably reached however slowly the machine spawns; later ones find the
        // count reached at once. A cap that is never reached shows as `max < cap` below.
        let script = format!(
            "echo start {name} $$ >> \"$TRACE\"; i=0; \
             while [ \"$(grep -c '^start {name} ' \"$TRACE\")\" -lt {cap} ] && [ $i -lt 300 ]; \
             do sleep 0.01; i=$((i+1)); done; \
             sleep 0.05; echo end {name} $$ >> \"$TRACE\""
        );
        let mut assignee = AssigneeConfig::new(["sh", "-c", script.as_str()]);
        assignee.max_in_progress = cap;
        assignee
            .env
            .insert("TRACE".into(), trace.display().to_string());
        config.assignees.insert(name.into(), assignee);
    }
    let sup = Supervisor::start(config).expect("start the supervisor");

    let started = Instant::now();
    let tasks: Vec<(TaskId, &str)> = (0..TASKS)
        .map(|i| {
            let who = CAPS[i % 2].0;
            let id = sup
                .add_task(NewTask::titled(format!("task {i}")).for_assignee(who))
                .expect("add task")
                .id;
            (id, who)
        })
        .collect();
    let deadline = Instant::now() + 3 * SETTLE;
    for &(id, _) in &tasks {
        let left = deadline.saturating_duration_since(Instant::now());
        let task = sup.wait_for(id, left).expect("every task finishes");
        assert_eq!(task.status, TaskStatus::Done, "task {id}: {task:?}");
    }
    eprintln!("{TASKS} tasks done in {:?}", started.elapsed());

    // --- The real processes: the trace file, in the order the lines were appended. ---
    let text = fs::read_to_string(&trace).expect("read the trace file");
    let lines: Vec<(&str, &str, i32)> = text
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "malformed trace line {l:?}");
            (f[0], f[1], f[2].parse().expect("pid in trace"))
        })
        .collect();
    assert_eq!(
        lines.len(),
        2 * TASKS,
        "one start and one end per task:\n{text}"
    );
    let step = |kind: &str| if kind == "start" { 1 } else { -1 };
    let global = max_open(lines.iter().map(|(k, _, _)| step(k)));
    assert!(
        global <= GLOBAL_CAP as i32,
        "{global} workers alive at once (global cap {GLOBAL_CAP})"
    );
    let mut trace_pids: BTreeMap<&str, Vec<i64>> = BTreeMap::new();
    for (name, cap) in CAPS {
        let mine: Vec<_> = lines.iter().filter(|(_, who, _)| *who == name).collect();
        assert_eq!(mine.len(), TASKS, "assignee {name}: {mine:?}");
        let max = max_open(mine.iter().map(|(k, _, _)| step(k)));
        assert!(
            max <= cap as i32,
            "assignee {name}: {max} workers alive at once, cap {cap}"
        );
        // Not vacuous: the cap is reached (the first workers wait for it).
        assert_eq!(
            max, cap as i32,
            "assignee {name} never reached its cap {cap}"
        );
        let mut pids: Vec<i64> = mine
            .iter()
            .filter(|(k, _, _)| *k == "start")
            .map(|(_, _, pid)| i64::from(*pid))
            .collect();
        pids.sort_unstable();
        trace_pids.insert(name, pids);
    }

    // --- The board: runs, and the spawn/exit events in commit (id) order. ---
    let boot = boot_id().expect("boot id");
    let mut assignee_of_run = BTreeMap::new();
    let mut run_pids: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for &(id, who) in &tasks {
        let detail = sup.task(id).expect("task detail");
        assert_eq!(
            detail.runs.len(),
            1,
            "task {id} ran once: {:?}",
            detail.runs
        );
        let run = &detail.runs[0];
        assert_eq!(run.assignee.as_deref(), Some(who));
        assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
        assert_eq!(run.exit_code, Some(0), "{run:?}");
        let pid = run
            .spawned_pid
            .unwrap_or_else(|| panic!("run without spawned_pid: {run:?}"));
        let spawned: Vec<_> = detail
            .events
            .iter()
            .filter(|e| e.kind == "worker_spawned")
            .collect();
        assert_eq!(spawned.len(), 1, "task {id}: {:?}", detail.events);
        let (ev_pid, fp) = worker_identity(spawned[0]).unwrap_or_else(|| {
            panic!("worker_spawned without pid + fingerprint: {:?}", spawned[0])
        });
        assert_eq!(i64::from(ev_pid), pid, "event and run agree on the pid");
        assert_eq!(fp.boot_id, boot, "fingerprint taken in this boot");
        assert!(fp.start_ticks > 0, "start ticks recorded: {fp:?}");
        // This kernel (Linux ≥ 6.9) has pidfs: the worker's pidfd inode is part of it.
        assert!(fp.pidfs_ino.is_some(), "pidfs inode recorded: {fp:?}");
        assignee_of_run.insert(run.id, who);
        run_pids.entry(who.to_string()).or_default().push(pid);
    }
    for (name, _) in CAPS {
        let pids = run_pids.get_mut(name).expect("runs of the assignee");
        pids.sort_unstable();
        assert_eq!(
            Some(&*pids),
            trace_pids.get(name),
            "assignee {name}: the pids the board recorded are the processes that ran"
        );
    }

    let events = sup
        .services()
        .store
        .read_blocking(|tx| tx.events_since(0, 1_000_000))
        .expect("read events");
    for (name, cap) in CAPS {
        let steps = events.iter().filter_map(|e| {
            let run = e.run_id?;
            if assignee_of_run.get(&run) != Some(&name) {
                return None;
            }
            match e.kind.as_str() {
                "worker_spawned" => Some(1),
                "worker_exited" => Some(-1),
                _ => None,
            }
        });
        let max = max_open(steps);
        assert!(
            max <= cap as i32,
            "assignee {name}: {max} runs overlapped on the board, cap {cap}"
        );
        assert!(max >= 1, "assignee {name}: no spawn/exit events");
    }
    let spawned = events.iter().filter(|e| e.kind == "worker_spawned").count();
    let exited = events.iter().filter(|e| e.kind == "worker_exited").count();
    assert_eq!((spawned, exited), (TASKS, TASKS));

    // Actor addresses are thread-safe: ask the dispatcher from the test thread. A worker's
    // actor tells the dispatcher it has finished after its exit's commit (whose events were
    // read above), so the last ones may still be on its way out: a bounded wait.
    let mut live = Vec::new();
    let gone = wait_until(SETTLE, || {
        live = futures::executor::block_on(sup.services().live_workers());
        live.is_empty()
    });
    assert!(gone, "live workers left: {live:?}");
    sup.shutdown();
}

/// The caps count live workers, not open runs: a worker that reported completion and has not
/// exited yet keeps its slot — under its assignee's cap and under the global one — until the
/// grace ends it. Checked from the board's commit order: the next task's `claimed` comes after
/// the hung worker's `worker_exited`.
#[test]
fn a_worker_that_reported_and_lingers_keeps_its_slot_until_it_is_gone() {
    use common::lifecycle::{View, add, complete_loop, sh_assignee, task_for};
    use std::time::Duration;

    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.supervisor.max_in_progress = 2;
    config.reaper.grace = Duration::from_millis(800);
    // `a` reports and then lingers (cap 1); `b` (cap 5) runs quick tasks.
    let mut a = sh_assignee(&format!("{}; exec sleep 300", complete_loop("ok")));
    a.max_in_progress = 1;
    config.assignees.insert("a".into(), a);
    let mut b = sh_assignee(&format!("{}; exec sleep 300", complete_loop("ok")));
    b.max_in_progress = 5;
    config.assignees.insert("b".into(), b);
    let mut sup = Supervisor::start(config).expect("start the supervisor");

    // Assignee cap: a1 holds `a`'s only slot until its worker is gone, so a2 waits.
    let a1 = add(&sup, task_for("a1", "a"));
    let a2 = add(&sup, task_for("a2", "a"));
    // Global cap (2): a1's lingering worker and b1's hold both slots, so b2 waits too.
    let b1 = add(&sup, task_for("b1", "b"));
    let b2 = add(&sup, task_for("b2", "b"));
    for t in [a1, a2, b1, b2] {
        sup.wait_status(t, TaskStatus::Done, SETTLE);
        sup.wait_event(t, "worker_exited", SETTLE);
    }
    let events = sup.all_events();
    let at = |task: TaskId, kind: &str| {
        events
            .iter()
            .position(|e| e.task_id == Some(task) && e.kind == kind)
            .unwrap_or_else(|| panic!("task {task} has no {kind}"))
    };
    // Both lingering workers reported (closing their runs) before anything else was claimed:
    // the old rule (open runs) would have claimed a2 and b2 right then.
    assert!(at(a1, "completed") < at(a2, "claimed"));
    assert!(
        at(a1, "worker_exited") < at(a2, "claimed"),
        "a2 was claimed while a1's worker was alive (assignee cap 1)"
    );
    let first_gone = at(a1, "worker_exited").min(at(b1, "worker_exited"));
    assert!(
        first_gone < at(b2, "claimed"),
        "b2 was claimed while a1's and b1's workers were both alive (global cap 2)"
    );
    sup.shutdown();
}

/// After a restart, a run that closed while no supervisor was listening holds its slot only
/// while its worker may be alive. While it is alive and within its grace (an hour here), it
/// is neither signalled nor does the next task start; once it dies, the slot is freed at once,
/// without waiting for the grace that would be its due time.
#[test]
fn a_previous_incarnations_worker_holds_its_slot_until_it_dies_not_until_its_grace() {
    use common::board::{completed_with_worker, sleeper};
    use common::lifecycle::{View, add, sh_assignee, task_for};
    use runwarden::board::{Board, now_millis};
    use std::time::Duration;

    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    // The previous incarnation: a worker reported (run closed, evidence kept) and was still
    // running when that supervisor went away.
    let (mut worker, fp) = sleeper(300);
    let pid = worker.pid();
    let mut board = Board::open(&td.db_path()).expect("open the board");
    let (done, _) =
        completed_with_worker(&mut board, "reported", pid, Some(&fp), now_millis() - 1_000);
    drop(board);

    let mut config = lib_config(&td);
    config.reaper.grace = Duration::from_secs(3600);
    let mut a = sh_assignee("exit 0");
    a.max_in_progress = 1;
    config.assignees.insert("coder".into(), a);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let next = add(&sup, task_for("next", "coder"));
    // Twenty sweeps: the live worker keeps the only slot and is left alone.
    sup.assert_stays(
        next,
        TaskStatus::Ready,
        &["claimed"],
        Duration::from_secs(1),
    );
    assert!(
        worker
            .try_wait()
            .expect("the old worker's status")
            .is_none(),
        "a live worker within its grace was ended"
    );
    assert!(sup.events_of(done, "terminal_worker_reaped").is_empty());

    worker.kill().expect("kill the old worker");
    // (The in-process supervisor is a subreaper that may collect this zombie first.)
    let _ = worker.wait();
    sup.wait_status(next, TaskStatus::Done, SETTLE);
    let gone = sup.wait_event(done, "terminal_worker_gone", SETTLE);
    let claimed = sup.wait_event(next, "claimed", SETTLE);
    assert!(
        gone.id < claimed.id,
        "the next task ran while the old worker still held the only slot"
    );
    sup.shutdown();
}
