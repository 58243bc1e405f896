//! One task never has two workers. Two ways that could happen, each driven with real
//! processes:
//!
//! - a run is released (reclaimed) and its leader dies at once, but a member of its group
//!   ignores SIGTERM: the task must not be claimed again until that member is dead too;
//! - a supervisor died between starting a worker and recording it: the next one ends what
//!   carries the run's token (never adopting it: which carrier is the worker cannot be proven)
//!   before the task runs again;
//! - a run is reclaimed while its worker is still being started (the spawn is under way, no
//!   pid recorded yet): the task waits until that worker has been started, ended and reaped;
//! - a supervisor died after such a reclaim, before the start settled: the next one finds the
//!   late worker by its token and ends it, or finds none and frees the task.
//! - a claim of the running supervisor's own whose start is late: held while anything carries
//!   its token (its own actor is starting that worker), never ended by the reconcile.

#[allow(dead_code)]
mod common;

use std::os::unix::process::CommandExt;
use std::process::Command;
use std::time::{Duration, Instant};

use common::lifecycle::{View, add, procs_of_run, sh_assignee, task_for, wait_run_count, write};
use common::proc_guard::{ChildGuard, wait_until};
use common::runtime::{SETTLE, TestDir, WorkerGuard, lib_config};
use runwarden::Supervisor;
use runwarden::board::{Board, NewTask, RunOutcome, TaskId, TaskStatus, now_millis};

#[test]
fn a_released_task_waits_until_its_previous_group_is_gone() {
    let td = TestDir::new();
    let kill_timeout = Duration::from_millis(1500);
    let mut config = lib_config(&td);
    config.reaper.kill_timeout = kill_timeout;
    // The leader dies of SIGTERM at once; the inner sh (and its sleep) ignore SIGTERM and live
    // until the SIGKILL, `kill_timeout` later.
    config.assignees.insert(
        "w".into(),
        sh_assignee("sh -c 'trap \"\" TERM; sleep 300' & exec sleep 1000"),
    );
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("stubborn", "w"));
    sup.wait_event(task, "worker_spawned", SETTLE);
    let first = sup.runs(task)[0].clone();
    // leader (sleep 1000), the TERM-ignoring sh and its sleep
    let procs = wait_run_count(&first.token, 3, SETTLE);

    write(&sup, move |tx, now| tx.reclaim_task(task, "test", now)).expect("reclaim");
    let released = Instant::now();
    // Until the whole first group is gone, no second run may start.
    let mut first_group_gone = None;
    assert!(
        wait_until(SETTLE, || {
            let alive = procs.iter().any(|p| p.alive());
            let runs = sup.runs(task);
            assert!(
                !(alive && runs.len() > 1),
                "a second run started while the first group lived: {:?} alive, runs {runs:?}",
                procs_of_run(&first.token)
            );
            if !alive && first_group_gone.is_none() {
                first_group_gone = Some(Instant::now());
            }
            first_group_gone.is_some()
        }),
        "the first group was never ended: {:?}",
        procs_of_run(&first.token)
    );
    assert!(
        first_group_gone.unwrap() - released + Duration::from_millis(200) >= kill_timeout,
        "the SIGTERM-ignoring member died before the kill timeout: the scenario did not happen"
    );
    // And then the task does run again.
    assert!(
        wait_until(SETTLE, || sup.runs(task).len() == 2),
        "the task was never claimed again: {}",
        sup.history(task)
    );
    let runs = sup.runs(task);
    assert_eq!(runs[0].outcome, Some(RunOutcome::Reclaimed));
    write(&sup, move |tx, now| tx.archive_task(task, now)).expect("archive");
    sup.shutdown();
}

/// A supervisor died between starting a worker and recording it, and the worker then failed
/// (exit 3) while no supervisor watched, leaving a descendant that escaped its group (setsid)
/// and will exit 0. That descendant carries the run's token and leads a group of its own, just
/// as the worker did: adopting it would let its exit 0 close the run `completed`. Nothing found
/// by token is adopted: it is ended, the run released, and the task runs again.
#[test]
fn a_worker_started_but_never_recorded_is_ended_never_adopted() {
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    // A previous incarnation claimed the run and started its worker, then died before the
    // worker's pid reached the board: forge exactly that.
    let mut board = Board::open(&td.db_path()).expect("open the board");
    let now = now_millis();
    let claim = board
        .write(|tx| {
            let id = tx
                .create_task(&NewTask::titled("orphaned").for_assignee("w"), now)?
                .id;
            tx.claim_task(id, "runwarden:dead:00000000", now, 60_000)
        })
        .expect("claim");
    drop(board);
    let escapee_pid = td.path().join("escapee.pid");
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "setsid sh -c 'sleep 30; exit 0' & echo $! > {}; exit 3",
            escapee_pid.display()
        ))
        .process_group(0)
        .env("RUNWARDEN_RUN_TOKEN", &claim.token);
    let mut worker = ChildGuard::spawn(&mut cmd).expect("start the unrecorded worker");
    let status = worker.0.wait().expect("wait for the worker");
    assert_eq!(
        status.code(),
        Some(3),
        "the worker failed while unsupervised"
    );
    let pid: i32 = std::fs::read_to_string(&escapee_pid)
        .expect("the escapee's pid")
        .trim()
        .parse()
        .expect("a pid");
    let fp = runwarden::process::fingerprint(pid).expect("the escapee's fingerprint");
    let escapee = WorkerGuard::pin(pid, &fp);

    let mut config = lib_config(&td);
    // Its next run fails as well: the task can only end `done` by a run wrongly completed.
    config.assignees.insert("w".into(), sh_assignee("exit 3"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let found = sup.wait_event(claim.task_id, "worker_found", SETTLE);
    // The escapee and its `sleep`.
    assert_eq!(found.payload["ended"].as_u64(), Some(2), "{found:?}");
    assert!(
        escapee.wait_dead(SETTLE).is_some(),
        "the escapee carrying the run's token was not ended"
    );
    assert!(
        wait_until(SETTLE, || {
            sup.runs(claim.task_id)
                .get(1)
                .is_some_and(|r| r.outcome.is_some())
        }),
        "the second run never ended: {}",
        sup.history(claim.task_id)
    );
    let runs = sup.runs(claim.task_id);
    let history = sup.history(claim.task_id);
    assert_eq!(runs[0].outcome, Some(RunOutcome::Reclaimed), "{history}");
    assert_eq!(runs[0].worker_pid, None, "nothing adopted: {history}");
    assert_eq!(runs[1].outcome, Some(RunOutcome::Crashed), "{history}");
    assert!(
        sup.events(claim.task_id)
            .iter()
            .all(|e| e.kind != "worker_adopted"),
        "{history}"
    );
    assert_ne!(
        sup.get_task(claim.task_id).status,
        TaskStatus::Done,
        "{history}"
    );
    sup.shutdown();
}

/// A log file that is a FIFO: the spawner's open of it blocks until the test opens the read
/// end, which holds a worker's start "under way" exactly as long as the test wants.
fn fifo_log(td: &TestDir, task: TaskId) -> std::path::PathBuf {
    let logs = td.data_dir().join("logs");
    std::fs::create_dir_all(&logs).expect("logs dir");
    let path = logs.join(format!("{task}.log"));
    nix::unistd::mkfifo(&path, nix::sys::stat::Mode::from_bits_truncate(0o600)).expect("mkfifo");
    path
}

#[test]
fn a_run_reclaimed_while_its_worker_starts_holds_its_task_until_that_worker_is_gone() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // Room for a second worker: what holds the task back is its own earlier run, not a cap.
    let mut w = sh_assignee("exec sleep 300");
    w.max_in_progress = 2;
    config.assignees.insert("w".into(), w);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    // The task waits on an unassigned parent (never run) until its log is in place.
    let gate = add(&sup, NewTask::titled("gate"));
    let task = add(
        &sup,
        NewTask {
            parents: vec![gate],
            ..task_for("slow start", "w")
        },
    );
    let log = fifo_log(&td, task);
    write(&sup, move |tx, now| tx.complete_task(gate, None, None, now)).expect("open the gate");
    let first = sup.wait_event(task, "claimed", SETTLE);
    // Its spawn is now blocked opening the log; reclaim the run under it.
    assert!(
        sup.events_of(task, "worker_spawned").is_empty(),
        "the worker started although its log had no reader"
    );
    write(&sup, move |tx, now| tx.reclaim_task(task, "test", now)).expect("reclaim");
    // While that start is under way the task is not claimed again (20 ticks).
    sup.assert_stays(
        task,
        TaskStatus::Ready,
        &["claimed", "worker_spawned"],
        Duration::from_secs(1),
    );

    // Let the start finish: the late worker is ended (its run is closed), and only then does
    // a second run start.
    let reader = std::fs::File::open(&log).expect("open the log's read end");
    let drain = std::thread::spawn(move || {
        let mut reader = reader;
        let _ = std::io::copy(&mut reader, &mut std::io::sink());
    });
    let runs = sup.wait_events(task, "claimed", 2, SETTLE);
    let first_run = first.run_id.expect("run id");
    let events = sup.events(task);
    let history = sup.history(task);
    let position = |kind: &str, run: i64| {
        events
            .iter()
            .position(|e| e.kind == kind && e.run_id == Some(run))
            .unwrap_or_else(|| panic!("no {kind} for run {run}: {history}"))
    };
    let late_spawn = position("worker_spawned", first_run);
    let late_exit = position("worker_exited", first_run);
    let second_claim = position("claimed", runs[1].run_id.expect("run id"));
    assert!(
        late_spawn < late_exit && late_exit < second_claim,
        "the second run was claimed before the first run's late worker was gone: {history}"
    );
    sup.wait_event(task, "worker_spawned", SETTLE);
    sup.shutdown();
    drain.join().expect("drain thread");
}

#[test]
fn a_start_a_dead_supervisor_left_unsettled_is_settled_by_the_next() {
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    // A previous incarnation claimed two runs to start their workers; both were reclaimed
    // while the starts were under way, and it died before either start settled. One worker
    // did start (it carries its run's token); the other never did.
    let mut board = Board::open(&td.db_path()).expect("open the board");
    let now = now_millis();
    let pending = |board: &mut Board, title: &str| {
        board
            .write(|tx| {
                let id = tx
                    .create_task(&NewTask::titled(title).for_assignee("w"), now)?
                    .id;
                let claim = tx.claim_task_to_spawn(id, "runwarden:dead:00000000", now, 60_000)?;
                tx.reclaim_task(id, "operator", now)?;
                Ok(claim)
            })
            .expect("claim and reclaim")
    };
    let never = pending(&mut board, "never started");
    let late = pending(&mut board, "started late");
    drop(board);
    let mut cmd = Command::new("sleep");
    cmd.arg("300")
        .process_group(0)
        .env("RUNWARDEN_RUN_TOKEN", &late.token);
    let worker = ChildGuard::spawn(&mut cmd).expect("start the late worker");

    let mut config = lib_config(&td);
    let mut w = sh_assignee("exit 0");
    w.max_in_progress = 4;
    config.assignees.insert("w".into(), w);
    let mut sup = Supervisor::start(config).expect("start the supervisor");

    // Nothing carries the first run's token: the start is settled and the task runs.
    assert_eq!(
        sup.wait_status(never.task_id, TaskStatus::Done, SETTLE)
            .status,
        TaskStatus::Done
    );
    // The late worker is found by its token and ended (never recorded: which carrier is the
    // worker cannot be proven); only then does its task run again.
    let found = sup.wait_event(late.task_id, "worker_found", SETTLE);
    assert_eq!(found.payload["ended"].as_u64(), Some(1), "{found:?}");
    assert!(
        worker.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "the late worker was not ended"
    );
    sup.wait_status(late.task_id, TaskStatus::Done, SETTLE);
    let events = sup.events(late.task_id);
    let history = sup.history(late.task_id);
    let at = |kind: &str| {
        events
            .iter()
            .position(|e| e.kind == kind)
            .unwrap_or_else(|| panic!("no {kind}: {history}"))
    };
    assert!(
        at("worker_found") < at("worker_spawned"),
        "the task ran again before its late worker was ended: {history}"
    );
    let runs = sup.runs(late.task_id);
    assert_eq!(runs.len(), 2, "{history}");
    assert_eq!(runs[0].worker_pid, None, "nothing adopted: {history}");
    sup.shutdown();
}

/// A claim of this very supervisor whose start is late (its claim's reply delayed past 30 s,
/// forged here): what carries its token is a worker its own WorkerActor is starting, never a
/// previous incarnation's unrecorded one — the reconcile holds the run while it is there,
/// never ends it, and releases the run only once nothing carries the token.
#[test]
fn a_late_claim_of_our_own_is_held_never_its_carriers_ended() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.assignees.insert("w".into(), sh_assignee("exit 0"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let warm = add(&sup, task_for("warm-up", "w"));
    sup.wait_status(warm, TaskStatus::Done, SETTLE);
    let ours = sup.runs(warm)[0].claimer.clone();

    let long_ago = now_millis() - 60_000;
    let claim = write(&sup, move |tx, _| {
        let id = tx
            .create_task(
                &NewTask::titled("late start").for_assignee("nobody"),
                long_ago,
            )?
            .id;
        tx.claim_task_to_spawn(id, &ours, long_ago, 600_000)
    })
    .expect("forge a late claim of ours");
    let mut cmd = Command::new("sleep");
    cmd.arg("300")
        .process_group(0)
        .env("RUNWARDEN_RUN_TOKEN", &claim.token);
    let carrier = ChildGuard::spawn(&mut cmd).expect("start the late worker");

    // Twenty ticks and more: never ended, the run held.
    let ended = carrier
        .pidfd()
        .wait_exit(Duration::from_secs(2))
        .unwrap_or(true);
    assert!(!ended, "the reconcile ended a worker of its own claim");
    let history = sup.history(claim.task_id);
    assert!(sup.runs(claim.task_id)[0].outcome.is_none(), "{history}");

    // Gone: the run is released, nothing left to hold it.
    drop(carrier);
    let released = wait_until(SETTLE, || {
        sup.runs(claim.task_id)[0].outcome == Some(RunOutcome::Reclaimed)
    });
    assert!(released, "{}", sup.history(claim.task_id));
    sup.shutdown();
}
