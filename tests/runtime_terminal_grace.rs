//! A worker that reports completion and then hangs is ended `grace` after the close — not
//! before — with its whole process group, and a `terminal_worker_reaped` event says so. Once by
//! the running supervisor's timer (library), once by the start-up sweep of the next `serve`
//! after the close happened while no supervisor was listening. A `shutdown = "terminate"`
//! within the grace ends it sooner, recorded as the same terminal reap.

#[allow(dead_code)]
mod common;

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::proc_guard::wait_until;
use common::runtime::{
    SETTLE, Serve, TestDir, WorkerGuard, lib_config, poll_board, runs_of, task_event, wait_event,
    wait_worker, worker_identity,
};
use runwarden::Supervisor;
use runwarden::board::{Board, Event, NewTask, RunOutcome, TaskStatus, now_millis};
use runwarden::process::{
    Fingerprint, Pid, Signal, become_subreaper, fingerprint, group_members, read_stat,
};

/// The worker: a shell (the group leader) with a child, both sleeping for five minutes.
const HANG: &str = "sleep 300 & sleep 300";
/// Slack for rounding only: the kill is due at `ended_at + grace`, and `ended_at` is the wall
/// clock in whole milliseconds, up to 1 ms before the instant the run really closed. (The
/// close is timed from before the call that closes it, so no delay can make a kill look early.)
const TOLERANCE: Duration = Duration::from_millis(5);

/// The two tests must not overlap: the library one makes this process a subreaper that reaps
/// zombie children it does not own, which would steal the exit status of the other's `serve`.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits until the group led by `leader` has the shell and both sleeps; pins each of them.
fn pin_group(leader: Pid) -> Vec<WorkerGuard> {
    assert!(
        wait_until(SETTLE, || group_members(leader).len() == 3),
        "worker group {leader} never had 3 live members: {:?}",
        group_members(leader)
    );
    group_members(leader)
        .into_iter()
        .map(|pid| {
            let fp: Fingerprint = fingerprint(pid).expect("fingerprint of a group member");
            WorkerGuard::pin(pid, &fp)
        })
        .collect()
}

/// Polls all `members` every ~10 ms until every one is dead (or `timeout`); returns the
/// instant each was first seen dead.
fn deaths(members: &[WorkerGuard], timeout: Duration) -> Vec<Option<Instant>> {
    let mut seen: Vec<Option<Instant>> = vec![None; members.len()];
    wait_until(timeout, || {
        let now = Instant::now();
        for (m, s) in members.iter().zip(seen.iter_mut()) {
            if s.is_none() && !m.alive() {
                *s = Some(now);
            }
        }
        seen.iter().all(Option::is_some)
    });
    seen
}

/// A supervisor on `config` with the assignee `hang` ([`HANG`]), and one task of it added.
fn start_with_a_hanging_worker(
    mut config: runwarden::config::Config,
) -> (runwarden::SupervisorHandle, runwarden::board::TaskId) {
    config.assignees.insert(
        "hang".into(),
        runwarden::config::AssigneeConfig::new(["sh", "-c", HANG]),
    );
    let sup = Supervisor::start(config).expect("start the supervisor");
    let id = sup
        .add_task(NewTask::titled("report, then hang").for_assignee("hang"))
        .expect("add task")
        .id;
    (sup, id)
}

fn assert_reaped_event(ev: &Event, pid: Pid, fp: &Fingerprint) {
    let p = &ev.payload;
    assert_eq!(p["pid"].as_i64(), Some(i64::from(pid)), "{ev:?}");
    assert_eq!(p["boot_id"].as_str(), Some(fp.boot_id.as_str()), "{ev:?}");
    assert_eq!(p["start_ticks"].as_u64(), Some(fp.start_ticks), "{ev:?}");
    assert!(
        matches!(p["ended_by"].as_str(), Some("sigterm" | "sigkill")),
        "{ev:?}"
    );
}

#[test]
fn a_worker_hanging_after_completion_is_ended_grace_after_the_close() {
    let _serial = serial();
    let td = TestDir::new();
    let mut config = lib_config(&td);
    let grace = config.reaper.grace;
    // A long tick: the periodic sweep (at start-up, then every 5 s) cannot be what ends the
    // worker in time; the timer the close scheduled must.
    let tick = Duration::from_secs(5);
    config.supervisor.tick = tick;
    let (sup, id) = start_with_a_hanging_worker(config);

    let (pid, fp) = wait_worker(&sup, id);
    let members = pin_group(pid);

    // Taken before the call: the run closes inside it, so no slow reply can make a kill at the
    // grace look early.
    let closed = Instant::now();
    sup.complete(id, Some("ok".into())).expect("complete");
    let seen = deaths(&members, grace + SETTLE);

    for (m, s) in members.iter().zip(&seen) {
        let died = s.unwrap_or_else(|| panic!("group member {} still alive", m.pid));
        let after = died - closed;
        assert!(
            after + TOLERANCE >= grace,
            "member {} was killed {after:?} after the close, before the grace {grace:?}",
            m.pid
        );
        assert!(
            after < grace + tick / 2,
            "member {} died {after:?} after the close: not by the close's timer",
            m.pid
        );
    }

    let reaped = wait_event(&sup, id, "terminal_worker_reaped");
    assert_reaped_event(&reaped, pid, &fp);

    // The leader's exit is recorded at once; the evidence is cleared once the rest of its
    // group is confirmed ended (a moment later, off the actor thread).
    let mut detail = sup.task(id).expect("task detail");
    assert!(
        wait_until(SETTLE, || {
            detail = sup.task(id).expect("task detail");
            detail.runs.first().is_some_and(|r| r.worker_pid.is_none())
        }),
        "evidence never cleared: {:?}",
        detail.runs
    );
    assert_eq!(detail.task.status, TaskStatus::Done);
    assert_eq!(detail.task.result.as_deref(), Some("ok"));
    assert_eq!(detail.runs.len(), 1, "{:?}", detail.runs);
    let run = &detail.runs[0];
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    let ended_at = run.ended_at.expect("closed run");
    // The board's own clock agrees: the kill was recorded no earlier than the grace.
    assert!(
        reaped.at - ended_at >= grace.as_millis() as i64,
        "reaped at {} but the run closed at {ended_at} (grace {grace:?})",
        reaped.at
    );
    // Evidence cleared (the worker is provably gone), history kept.
    assert_eq!(run.worker_pid, None, "{run:?}");
    assert_eq!(run.spawned_pid, Some(i64::from(pid)), "{run:?}");
    sup.shutdown();
}

#[test]
fn the_startup_sweep_ends_a_worker_whose_run_closed_while_no_supervisor_listened() {
    let _serial = serial();
    // The worker outlives its supervisor; as a subreaper this test process becomes its parent
    // (and can reap it), which also shows the re-parenting really happened.
    let _subreaper = become_subreaper().expect("become a child subreaper");
    let me = std::process::id() as Pid;
    let grace = Duration::from_secs(1);
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"\nshutdown = \"leave\"",
        &format!(
            "[reaper]\ngrace = \"1s\"\nkill_timeout = \"1s\"\n\n\
             [assignees.hang]\ncommand = [\"sh\", \"-c\", {HANG:?}]\n"
        ),
    );
    let db = td.db_path();

    let mut first = Serve::start(&config, "serve1");
    first.wait_ready(&td.lock_path(), &db);
    // Add the task the way an offline tool would: straight into the board file.
    let mut board = Board::open(&db).expect("open the board");
    let id = board
        .write(|tx| tx.create_task(&NewTask::titled("hang").for_assignee("hang"), now_millis()))
        .expect("create task")
        .id;
    let (pid, fp) = poll_board(&db, "the worker to be spawned", |b| {
        task_event(b, id, "worker_spawned").and_then(|e| worker_identity(&e))
    });
    let members = pin_group(pid);

    // Complete it offline (as `runwarden complete` without a supervisor would), then stop
    // the supervisor at once: it leaves the worker running for the next incarnation.
    board
        .write(|tx| tx.complete_task(id, None, Some("ok"), now_millis()))
        .expect("complete the task in the board");
    let closed = Instant::now();
    first.stop_cleanly(Signal::SIGTERM);
    assert!(
        closed.elapsed() < grace,
        "the first supervisor took {:?} to stop, longer than the grace: the scenario did not run",
        closed.elapsed()
    );
    for m in &members {
        assert!(
            m.alive(),
            "worker process {} died with its supervisor",
            m.pid
        );
    }
    assert_eq!(
        read_stat(pid).expect("stat of the worker").ppid,
        me,
        "the orphaned worker was re-parented to this subreaper"
    );
    let run = runs_of(&mut board, id).pop().expect("the run");
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    assert_eq!(
        run.worker_pid,
        Some(i64::from(pid)),
        "evidence kept: {run:?}"
    );
    assert!(task_event(&mut board, id, "terminal_worker_reaped").is_none());

    // Past the grace (by the board's clock), a new supervisor's start-up sweep ends it.
    let due = run.ended_at.expect("closed") + grace.as_millis() as i64;
    assert!(wait_until(SETTLE, || now_millis() > due));
    let mut second = Serve::start(&config, "serve2");
    second.wait_ready(&td.lock_path(), &db);
    let seen = deaths(&members, SETTLE);
    for (m, s) in members.iter().zip(&seen) {
        assert!(
            s.is_some(),
            "worker process {} survived the start-up sweep; stderr:\n{}",
            m.pid,
            second.stderr()
        );
    }
    let reaped = poll_board(&db, "terminal_worker_reaped", |b| {
        task_event(b, id, "terminal_worker_reaped")
    });
    assert_reaped_event(&reaped, pid, &fp);
    let run = poll_board(&db, "the evidence to be cleared", |b| {
        runs_of(b, id).pop().filter(|r| r.worker_pid.is_none())
    });
    assert_eq!(run.worker_boot_id, None, "{run:?}");
    assert_eq!(run.worker_start_ticks, None, "{run:?}");
    assert_eq!(
        run.spawned_pid,
        Some(i64::from(pid)),
        "history kept: {run:?}"
    );
    second.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_hung_worker_ignoring_sigterm_is_killed_once_after_the_kill_timeout() {
    let _serial = serial();
    let td = TestDir::new();
    let mut config = lib_config(&td);
    let grace = config.reaper.grace;
    let kill_timeout = Duration::from_millis(700);
    config.reaper.kill_timeout = kill_timeout;
    // SIGTERM is ignored by the shell and (inherited across exec) by both sleeps.
    let script = format!("trap '' TERM; {HANG}");
    config.assignees.insert(
        "stubborn".into(),
        runwarden::config::AssigneeConfig::new(["sh", "-c", script.as_str()]),
    );
    let sup = Supervisor::start(config).expect("start the supervisor");
    let id = sup
        .add_task(NewTask::titled("report, then ignore SIGTERM").for_assignee("stubborn"))
        .expect("add task")
        .id;
    let mut spawned = None;
    assert!(wait_until(SETTLE, || {
        spawned = sup
            .task(id)
            .expect("task detail")
            .events
            .iter()
            .find(|e| e.kind == "worker_spawned")
            .and_then(worker_identity);
        spawned.is_some()
    }));
    let (pid, fp) = spawned.unwrap();
    let members = pin_group(pid);

    // Taken before the call: the run closes inside it, so no slow reply can make a kill at the
    // grace look early.
    let closed = Instant::now();
    sup.complete(id, Some("ok".into())).expect("complete");
    let seen = deaths(&members, grace + kill_timeout + SETTLE);
    for (m, s) in members.iter().zip(&seen) {
        let died = s.unwrap_or_else(|| panic!("group member {} still alive", m.pid));
        let after = died - closed;
        assert!(
            after + TOLERANCE >= grace + kill_timeout,
            "member {} died {after:?} after the close: before grace {grace:?} + kill timeout {kill_timeout:?}",
            m.pid
        );
    }
    // Recorded once, as a SIGKILL, however many sweeps ran while the kill was under way.
    let reaped = |sup: &runwarden::SupervisorHandle| -> Vec<Event> {
        sup.task(id)
            .expect("task detail")
            .events
            .into_iter()
            .filter(|e| e.kind == "terminal_worker_reaped")
            .collect()
    };
    assert!(wait_until(SETTLE, || !reaped(&sup).is_empty()));
    // Let a few more ticks (50 ms) pass: a second kill would be recorded by now.
    let settle_until = Instant::now() + Duration::from_millis(500);
    assert!(wait_until(SETTLE, || Instant::now() >= settle_until));
    let events = reaped(&sup);
    assert_eq!(events.len(), 1, "one terminal_worker_reaped: {events:?}");
    assert_reaped_event(&events[0], pid, &fp);
    assert_eq!(
        events[0].payload["ended_by"].as_str(),
        Some("sigkill"),
        "{:?}",
        events[0]
    );
    sup.shutdown();
}

/// With `shutdown = "terminate"`, a worker still in the grace after completing its run is
/// ended with the supervisor, and its end is recorded as the terminal reap it is
/// (`terminal_worker_reaped`); its task stays done, not released.
#[test]
fn a_terminate_shutdown_records_the_end_of_a_worker_in_its_grace_as_a_terminal_reap() {
    let _serial = serial();
    let td = TestDir::new();
    let mut config = lib_config(&td); // shutdown = "terminate"
    // A grace the test never waits out: only the shutdown can end the worker in time.
    config.reaper.grace = Duration::from_secs(300);
    let (sup, id) = start_with_a_hanging_worker(config);
    let (pid, fp) = wait_worker(&sup, id);
    let members = pin_group(pid);
    sup.complete(id, Some("ok".into())).expect("complete");
    wait_event(&sup, id, "run_closed");

    sup.shutdown();
    for m in &members {
        assert!(!m.alive(), "member {} survived the shutdown", m.pid);
    }
    let mut board = Board::open(&td.db_path()).expect("open the board");
    let reaped = task_event(&mut board, id, "terminal_worker_reaped")
        .expect("the end of the worker in its grace is recorded as a terminal reap");
    assert_reaped_event(&reaped, pid, &fp);
    let task = board.read(|tx| tx.get_task(id)).expect("task");
    assert_eq!(task.status, TaskStatus::Done, "{task:?}");
    assert!(task_event(&mut board, id, "reclaimed").is_none());
}
