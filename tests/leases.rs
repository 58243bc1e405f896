//! Leases, liveness and stale runs, end to end with real workers and real restarts:
//!
//! - the supervisor refreshes the claim of its own live child (lease_expires_at moves forward,
//!   never lapses), and a worker's `runwarden heartbeat` refreshes it too;
//! - after a restart with a tiny claim_ttl, an expired claim whose worker is provably alive is
//!   adopted, never released: the run stays open with its one worker;
//! - a run whose worker died while no supervisor ran is closed `crashed` ("exited while
//!   unsupervised") under the retry rules;
//! - a run whose worker cannot be proven alive or dead (legacy row: no fingerprint) is held —
//!   never signalled, never released — and `reclaim_deferred` is recorded once its lease expired;
//! - `stale_after`: a worker without a heartbeat for that long is ended and its run closed
//!   `stale`, under its assignee's retry rules — counted only while a supervisor listens: a
//!   heartbeating worker adopted after a restart longer than `stale_after` is not stale, and a
//!   silent one is found stale across restarts each shorter than `stale_after`;
//! - `runwarden archive` / `runwarden reclaim` of a running task close its run, then end its
//!   worker's whole group.

#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::lifecycle::{
    Db, View, add, now, runwarden_cli, sh_assignee, task_for, wait_all_dead, wait_run_count,
};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, WorkerGuard, lib_config, worker_identity};
use runwarden::Supervisor;
use runwarden::board::{RunOutcome, TaskId, TaskStatus};
use runwarden::config::{Config, ShutdownMode};

/// A worker that runs until killed, and leaves a mark in `$MARK_DIR/<task>` if it ever gets a
/// SIGTERM (its own, or its sleep's through the group): proof of "never signalled".
const MARKING_WORKER: &str = r#"trap 'echo TERM >> "$MARK_DIR/$RUNWARDEN_TASK_ID"; exit 143' TERM
while :; do sleep 0.05; done"#;

/// A config with `MARKING_WORKER` as assignee `w` (marks under `<td>/marks`).
fn marking_config(td: &TestDir) -> Config {
    let marks = td.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    let mut config = lib_config(td);
    let mut w = sh_assignee(MARKING_WORKER);
    w.env.insert("MARK_DIR".into(), marks.display().to_string());
    config.assignees.insert("w".into(), w);
    config
}

fn marked(td: &TestDir, task: TaskId) -> bool {
    td.path().join("marks").join(task.to_string()).exists()
}

/// Runs a first incarnation that spawns one worker for a new task, then stops it with
/// `shutdown = "leave"`; returns the task and the worker, pinned (killed on drop).
fn leave_one_worker(td: &TestDir, config: &Config) -> (TaskId, WorkerGuard) {
    let mut first = config.clone();
    first.supervisor.shutdown = ShutdownMode::Leave;
    let mut sup = Supervisor::start(first).expect("start the first incarnation");
    let task = add(&sup, task_for("outlives its supervisor", "w"));
    let spawned = sup.wait_event(task, "worker_spawned", SETTLE);
    let (pid, fp) = worker_identity(&spawned).expect("worker identity");
    let worker = WorkerGuard::pin(pid, &fp);
    sup.shutdown();
    assert!(
        worker.alive(),
        "shutdown = \"leave\" left the worker running"
    );
    assert!(!marked(td, task));
    (task, worker)
}

/// [`leave_one_worker`] with a worker that never heartbeats, under `stale_after`, no retries,
/// and every incarnation leaving it running; returns that config too.
fn leave_a_silent_worker(td: &TestDir, stale_after: Duration) -> (Config, TaskId, WorkerGuard) {
    let mut config = lib_config(td);
    config.leases.stale_after = stale_after;
    config.supervisor.shutdown = ShutdownMode::Leave;
    config.retries.max_retries = 0;
    config
        .assignees
        .insert("w".into(), sh_assignee("sleep 300 & wait"));
    let (task, worker) = leave_one_worker(td, &config);
    (config, task, worker)
}

/// Waits (bounded) until the task's open run's lease has expired.
fn wait_lease_expired(db: &mut Db, task: TaskId) {
    let lease = db.runs(task)[0].lease_expires_at;
    assert!(
        wait_until(SETTLE, || now() > lease + 50),
        "the lease never expired"
    );
}

#[test]
fn the_supervisor_refreshes_the_lease_of_its_own_live_child() {
    let td = TestDir::new();
    let ttl = Duration::from_millis(900);
    let mut config = marking_config(&td);
    config.leases.claim_ttl = ttl;
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("long", "w"));
    sup.wait_event(task, "worker_spawned", SETTLE);
    let run = sup.runs(task)[0].id;
    let first = sup.run(run).lease_expires_at;

    // Three lease lifetimes: the claim never lapses while the child lives.
    let mut leases = vec![first];
    let deadline = Instant::now() + 3 * ttl;
    while Instant::now() < deadline {
        let r = sup.run(run);
        let t = now();
        assert!(r.is_open(), "{}", sup.history(task));
        assert!(
            r.lease_expires_at > t,
            "lease lapsed: expires {} at {t}",
            r.lease_expires_at
        );
        if *leases.last().unwrap() != r.lease_expires_at {
            assert!(
                r.lease_expires_at > *leases.last().unwrap(),
                "a lease moved backwards"
            );
            leases.push(r.lease_expires_at);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        leases.len() >= 4,
        "the lease moved only {} times: {leases:?}",
        leases.len() - 1
    );
    assert!(
        sup.run(run).heartbeat_at.is_none(),
        "refreshed without any heartbeat"
    );
    assert_eq!(sup.runs(task).len(), 1);
    assert!(!marked(&td, task));
    sup.shutdown();
}

#[test]
fn heartbeats_refresh_the_lease_and_keep_a_worker_from_going_stale() {
    let td = TestDir::new();
    let ttl = Duration::from_secs(60);
    let mut config = lib_config(&td);
    config.leases.claim_ttl = ttl;
    config.leases.stale_after = Duration::from_millis(1500);
    config.retries.max_retries = 0;
    // 12 beats 300 ms apart: 3.6 s of work, 2.4× stale_after; a gap between beats is 300 ms
    // plus the start of a `runwarden heartbeat` process, far under 1.5 s even on a slow machine.
    config.assignees.insert(
        "w".into(),
        sh_assignee(
            "for i in $(seq 1 12); do runwarden heartbeat --note \"beat $i\" || exit 7; sleep 0.3; done",
        ),
    );
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("beating", "w"));
    sup.wait_event(task, "heartbeat", SETTLE);
    // Refreshed by the heartbeat: the lease is `heartbeat_at + claim_ttl` of the latest beat
    // (the supervisor's own refresh ran once at the first tick and is due again in 20 s).
    let run = sup.runs(task)[0].id;
    let r = sup.run(run);
    let beat = r.heartbeat_at.expect("heartbeat_at recorded");
    assert!(r.lease_expires_at >= beat + ttl.as_millis() as i64, "{r:?}");

    let done = sup.wait_status(task, TaskStatus::Done, SETTLE);
    assert_eq!(done.status, TaskStatus::Done, "{}", sup.history(task));
    let beats = sup.events_of(task, "heartbeat");
    let notes: Vec<&str> = beats
        .iter()
        .map(|e| e.payload["note"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(
        notes,
        (1..=12).map(|i| format!("beat {i}")).collect::<Vec<_>>(),
        "{}",
        sup.history(task)
    );
    let runs = sup.runs(task);
    assert_eq!(runs.len(), 1, "never closed stale: {}", sup.history(task));
    assert_eq!(runs[0].outcome, Some(RunOutcome::Completed));
    let last_beat = beats.last().unwrap().at;
    assert_eq!(runs[0].heartbeat_at, Some(last_beat));
    sup.shutdown();
}

#[test]
fn a_heartbeating_worker_is_not_stale_for_the_time_no_supervisor_listened() {
    let td = TestDir::new();
    // Over the 2 s a waiting beat backs off to between its attempts: it lands within that of
    // the restart. (lib_config's tick is short: the new supervisor looks for stale runs at once.)
    let stale_after = Duration::from_secs(3);
    let mut config = lib_config(&td);
    config.leases.stale_after = stale_after;
    config.retries.max_retries = 0;
    // Beats for ~4 s of running; a beat sent while no supervisor runs waits to reconnect.
    config.assignees.insert(
        "w".into(),
        sh_assignee("for i in $(seq 1 12); do runwarden heartbeat || exit 7; sleep 0.3; done"),
    );
    let (task, worker) = leave_one_worker(&td, &config);
    // Down longer than stale_after since the last beat it heard (or its start).
    let mut db = Db::new(td.db_path());
    let run = db.runs(task)[0].clone();
    let last = run.heartbeat_at.unwrap_or(run.started_at);
    assert!(
        wait_until(SETTLE, || now()
            > last + stale_after.as_millis() as i64 + 300),
        "time does not pass"
    );
    assert!(
        worker.alive(),
        "the worker runs on while no supervisor does"
    );

    // With a shorter claim_ttl than the first (leases are refreshed every third of it): how
    // long the first listened is not inferred from the lease.
    let mut second = config.clone();
    second.leases.claim_ttl = Duration::from_secs(60);
    let mut sup = Supervisor::start(second).expect("start the second incarnation");
    let done = sup.wait_status(task, TaskStatus::Done, SETTLE);
    assert_eq!(done.status, TaskStatus::Done, "{}", sup.history(task));
    let runs = sup.runs(task);
    assert_eq!(runs.len(), 1, "never closed stale: {}", sup.history(task));
    assert_eq!(runs[0].outcome, Some(RunOutcome::Completed));
    sup.shutdown();
}

#[test]
fn a_silent_worker_is_stale_across_restarts_each_shorter_than_stale_after() {
    let td = TestDir::new();
    // Each incarnation listens 700 ms, under stale_after; their silence adds up (each records
    // what it heard every third of stale_after, 500 ms).
    let stale_after = Duration::from_millis(1500);
    let listen = Duration::from_millis(700);
    let (config, task, worker) = leave_a_silent_worker(&td, stale_after);

    let mut db = Db::new(td.db_path());
    let mut incarnations = 1;
    let stale = loop {
        let mut sup = Supervisor::start(config.clone()).expect("start another incarnation");
        incarnations += 1;
        if wait_until(listen, || db.runs(task)[0].outcome.is_some()) {
            sup.wait_status(task, TaskStatus::Blocked, SETTLE);
            let ended = wait_until(SETTLE, || !worker.alive());
            sup.shutdown();
            assert!(
                ended,
                "the stale worker was not ended\n{}",
                db.history(task)
            );
            break db.runs(task)[0].clone();
        }
        sup.shutdown();
        assert!(
            incarnations < 8,
            "never closed stale after {incarnations} incarnations of {listen:?} each\n{}",
            db.history(task)
        );
    };
    assert_eq!(
        stale.outcome,
        Some(RunOutcome::Stale),
        "{}",
        db.history(task)
    );
    // At least stale_after of silence was heard: three incarnations or more.
    assert!(
        incarnations >= 3,
        "closed stale in incarnation {incarnations}"
    );
}

#[test]
fn a_silent_worker_is_not_stale_for_an_outage_before_a_brief_restart() {
    let td = TestDir::new();
    // A long outage (longer than stale_after), then an incarnation that adopts the worker and
    // stops at once (a crash loop): the next one must not count the outage as heard silence.
    let stale_after = Duration::from_millis(1500);
    let (config, task, worker) = leave_a_silent_worker(&td, stale_after);
    let mut db = Db::new(td.db_path());
    let started = db.runs(task)[0].started_at;
    assert!(
        wait_until(SETTLE, || now()
            > started + 2 * stale_after.as_millis() as i64),
        "time does not pass"
    );
    let mut brief = Supervisor::start(config.clone()).expect("start the brief incarnation");
    brief.wait_event(task, "worker_adopted", SETTLE);
    brief.shutdown();

    // Heard so far: two brief incarnations, well under stale_after.
    let sup = Supervisor::start(config).expect("start the third incarnation");
    let listen = Duration::from_millis(800);
    let closed = wait_until(listen, || db.runs(task)[0].outcome.is_some());
    sup.shutdown();
    assert!(
        !closed,
        "closed stale for time no supervisor ran\n{}",
        db.history(task)
    );
    assert!(worker.alive(), "the worker was ended");
}

#[test]
fn an_adopted_worker_whose_claim_expired_is_never_released() {
    let td = TestDir::new();
    let ttl = Duration::from_millis(300);
    let mut config = marking_config(&td);
    config.leases.claim_ttl = ttl;
    let (task, worker) = leave_one_worker(&td, &config);
    let mut db = Db::new(td.db_path());
    wait_lease_expired(&mut db, task);

    let mut sup = Supervisor::start(config).expect("start the second incarnation");
    sup.wait_event(task, "worker_adopted", SETTLE);
    // Five lease lifetimes after adoption: still the same open run and the same one worker.
    sup.assert_stays(
        task,
        TaskStatus::Running,
        &[
            "run_closed",
            "reclaimed",
            "claimed",
            "worker_spawned",
            "reclaim_deferred",
        ],
        5 * ttl,
    );
    let runs = sup.runs(task);
    assert_eq!(runs.len(), 1, "{}", sup.history(task));
    assert!(runs[0].is_open());
    assert!(
        runs[0].lease_expires_at > now(),
        "the adopted run's lease is refreshed: {:?}",
        runs[0]
    );
    assert!(worker.alive(), "the adopted worker runs on");
    assert!(!marked(&td, task), "the adopted worker was never signalled");
    let live = futures::executor::block_on(sup.services().live_workers());
    assert_eq!(live.len(), 1, "one worker only: {live:?}");
    assert_eq!(live[0].2, Some(worker.pid));
    sup.shutdown();
}

#[test]
fn a_run_whose_worker_died_unsupervised_is_closed_crashed() {
    let td = TestDir::new();
    let mut config = marking_config(&td);
    config.retries.max_retries = 2;
    let (task, worker) = leave_one_worker(&td, &config);
    let old_pid = worker.pid;
    // Dies while no supervisor runs (SIGKILL; reaped here, where it was re-parented).
    drop(worker);

    let mut sup = Supervisor::start(config).expect("start the second incarnation");
    let retry = sup.wait_event(task, "retry_scheduled", SETTLE);
    assert_eq!(
        retry.payload["failures"], 1,
        "counted per the retry rules: {retry:?}"
    );
    let first = sup.runs(task)[0].clone();
    assert_eq!(
        first.outcome,
        Some(RunOutcome::Crashed),
        "{}",
        sup.history(task)
    );
    let error = first.error.clone().unwrap_or_default();
    assert!(error.contains("exited while unsupervised"), "{error}");
    assert_eq!(
        first.worker_pid, None,
        "its evidence is cleared: the pid is provably gone"
    );
    assert!(sup.events_of(task, "worker_adopted").is_empty());
    // Retried: a new run with a new worker.
    let spawned = sup.wait_events(task, "worker_spawned", 2, SETTLE);
    let (new_pid, _) = worker_identity(&spawned[1]).unwrap();
    assert_ne!(spawned[1].run_id, Some(first.id));
    assert!(
        new_pid != old_pid
            || spawned[1].payload["start_ticks"] != spawned[0].payload["start_ticks"]
    );
    sup.shutdown();
}

#[test]
fn a_run_without_a_fingerprint_is_held_never_signalled_nor_released() {
    let td = TestDir::new();
    let ttl = Duration::from_millis(1000);
    let mut config = marking_config(&td);
    config.leases.claim_ttl = ttl;
    let (task, worker) = leave_one_worker(&td, &config);
    let mut db = Db::new(td.db_path());
    let run = db.runs(task)[0].id;
    // A legacy row, forged while no supervisor runs: the pid without its spawn fingerprint.
    let n = db.execute_raw(
        "UPDATE task_runs SET worker_boot_id = NULL, worker_start_ticks = NULL WHERE id = ?1",
        [run],
    );
    assert_eq!(n, 1);
    let lease = db.run(run).lease_expires_at;

    // Started while the lease still runs: the deferral is recorded only once it has expired.
    let mut sup = Supervisor::start(config).expect("start the second incarnation");
    let started = now();
    assert!(
        started < lease - 200,
        "too slow: the lease expired before the second incarnation started"
    );
    let deferred = sup.wait_event(task, "reclaim_deferred", SETTLE);
    assert!(
        deferred.at >= lease,
        "deferral recorded at {} before the lease expired at {lease}",
        deferred.at
    );
    assert_eq!(deferred.run_id, Some(run));
    assert_eq!(deferred.payload["pid"], worker.pid);
    // Many ticks (50 ms) over several lease lifetimes: held as it is, recorded once.
    sup.assert_stays(
        task,
        TaskStatus::Running,
        &[
            "run_closed",
            "reclaimed",
            "claimed",
            "worker_adopted",
            "reclaim_deferred",
            "worker_exited",
        ],
        Duration::from_millis(1500),
    );
    let r = sup.run(run);
    assert!(r.is_open(), "never released: {r:?}");
    assert_eq!(r.lease_expires_at, lease, "not vouched for either");
    assert!(worker.alive(), "never killed");
    assert!(!marked(&td, task), "never signalled");
    assert!(futures::executor::block_on(sup.services().live_workers()).is_empty());
    sup.shutdown();
}

#[test]
fn a_worker_without_heartbeats_is_ended_and_its_run_closed_stale() {
    let td = TestDir::new();
    let stale_after = Duration::from_millis(600);
    let mut config = lib_config(&td);
    config.leases.stale_after = stale_after;
    // The config allows retries, the assignee none: a stale run follows its assignee's rules.
    config.retries.max_retries = 2;
    let mut w = sh_assignee("sleep 300 & sleep 300 & wait");
    w.max_retries = Some(0);
    config.assignees.insert("w".into(), w);
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let task = add(&sup, task_for("silent", "w"));
    sup.wait_event(task, "worker_spawned", SETTLE);
    let token = sup.runs(task)[0].token.clone();
    let procs = wait_run_count(&token, 3, SETTLE);

    let blocked = sup.wait_status(task, TaskStatus::Blocked, SETTLE);
    let run = sup.runs(task)[0].clone();
    assert_eq!(
        run.outcome,
        Some(RunOutcome::Stale),
        "{}",
        sup.history(task)
    );
    let error = run.error.clone().unwrap_or_default();
    assert!(error.contains("no heartbeat for 600ms"), "{error}");
    let silent_for = run.ended_at.unwrap() - run.started_at;
    assert!(
        (600..2_000).contains(&silent_for),
        "closed stale {silent_for} ms after the start (stale_after 600 ms)"
    );
    assert_eq!(
        sup.events_of(task, "gave_up").len(),
        1,
        "{}",
        sup.history(task)
    );
    assert_eq!(blocked.consecutive_failures, 1);
    let closed = sup.wait_event(task, "run_closed", SETTLE);
    let exited = sup.wait_event(task, "worker_exited", SETTLE);
    assert!(closed.id < exited.id);
    assert!(wait_all_dead(&procs, SETTLE), "survivors: {procs:?}");
    sup.shutdown();
}

#[test]
fn archive_and_reclaim_close_the_run_then_end_the_worker_group() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    let mut w = sh_assignee("sleep 300 & sleep 300 & wait");
    w.max_in_progress = 2;
    config.assignees.insert("w".into(), w);
    let socket = config.socket_path();
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let archived = add(&sup, task_for("to archive", "w"));
    let reclaimed = add(&sup, task_for("to reclaim", "w"));
    let mut groups = Vec::new();
    for task in [archived, reclaimed] {
        sup.wait_event(task, "worker_spawned", SETTLE);
        let token = sup.runs(task)[0].token.clone();
        groups.push(wait_run_count(&token, 3, SETTLE));
    }

    cli(&socket, &["archive", &archived.to_string()]);
    cli(
        &socket,
        &[
            "reclaim",
            &reclaimed.to_string(),
            "--reason",
            "operator says so",
        ],
    );

    for (task, group, outcome) in [
        (archived, &groups[0], RunOutcome::Archived),
        (reclaimed, &groups[1], RunOutcome::Reclaimed),
    ] {
        assert!(
            wait_all_dead(group, SETTLE),
            "task {task}: survivors {group:?}"
        );
        let first = sup.runs(task)[0].clone();
        assert_eq!(first.outcome, Some(outcome), "{}", sup.history(task));
        let closed = sup.events_of(task, "run_closed");
        let exited = sup.wait_events(task, "worker_exited", 1, SETTLE);
        assert_eq!(closed[0].run_id, Some(first.id));
        assert_eq!(exited[0].run_id, Some(first.id));
        assert!(
            closed[0].id < exited[0].id,
            "the run closes first: {}",
            sup.history(task)
        );
        assert!(
            exited[0].payload["signal"].is_i64(),
            "ended by a signal: {:?}",
            exited[0]
        );
    }
    assert_eq!(sup.get_task(archived).status, TaskStatus::Archived);
    assert_eq!(sup.runs(archived).len(), 1);
    assert_eq!(
        sup.runs(reclaimed)[0].error.as_deref(),
        Some("operator says so")
    );
    // The reclaimed task goes back to ready and runs again, with a new worker.
    let spawned = sup.wait_events(reclaimed, "worker_spawned", 2, SETTLE);
    let (_, fp) = worker_identity(&spawned[1]).unwrap();
    assert!(
        // Boot id and start time: a process found by a scan has no pidfs inode to compare.
        groups[1]
            .iter()
            .all(|p| (&p.fingerprint.boot_id, p.fingerprint.start_ticks)
                != (&fp.boot_id, fp.start_ticks)),
        "the new run's worker is a new process: {fp:?} in {:?}",
        groups[1]
    );
    sup.shutdown();
}

fn cli(socket: &Path, args: &[&str]) {
    runwarden_cli(socket, args, SETTLE).ok();
}
