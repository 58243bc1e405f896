//! A restarted supervisor takes over the previous incarnation's workers before it answers any
//! of them: reports that were waiting for it (retried while no supervisor was up) land on
//! adopted runs, so every run's history says who watched its worker to the end.
//!
//! The first reconcile of the second incarnation is slowed down (the library's test hook, as a
//! slow board or /proc would), while every worker retries `runwarden complete` every 100 ms:
//! a socket served at once would close every run by its report before the reconcile read the
//! open runs, and no worker would be adopted; a socket that waited for its 5 s bound instead
//! of the reconcile's signal (pushed out of reach here) would answer nobody in time.
//! Process-wide hooks: this file is its own test binary.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::lifecycle::{
    Db, View, add, complete_loop, open_gate, path_with_runwarden, sh_assignee, task_for,
    wait_for_gate,
};
use common::proc_guard::ChildGuard;
use common::runtime::{SETTLE, TestDir, WorkerGuard, lib_config, worker_identity};
use runwarden::Supervisor;
use runwarden::board::{EventId, TaskDetail, TaskId, TaskStatus, now_millis};
use runwarden::config::ShutdownMode;

const TASKS: usize = 4;
/// Many report retries long.
const RECONCILE_DELAY: Duration = Duration::from_millis(1500);

/// The id of the one event of `kind` in `d` (`history` says what was there otherwise).
fn only_event(d: &TaskDetail, kind: &str, history: &str) -> EventId {
    let ids: Vec<_> = d
        .events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.id)
        .collect();
    assert_eq!(ids.len(), 1, "one {kind} event\n{history}");
    ids[0]
}

#[test]
fn reports_waiting_for_a_restarted_supervisor_land_after_it_adopted_their_workers() {
    let td = TestDir::new();
    let gates = td.path().join("gates");
    let mut config = lib_config(&td);
    let mut w = sh_assignee(&format!("{}; {}", wait_for_gate(60), complete_loop("ok")));
    w.env.insert("GATE_DIR".into(), gates.display().to_string());
    w.max_in_progress = TASKS as u32;
    config.assignees.insert("w".into(), w);

    // The first incarnation starts every worker, then stops and leaves them running.
    let mut first = config.clone();
    first.supervisor.shutdown = ShutdownMode::Leave;
    let mut sup = Supervisor::start(first).expect("start the first incarnation");
    let tasks: Vec<TaskId> = (0..TASKS)
        .map(|i| add(&sup, task_for(&format!("task {i}"), "w")))
        .collect();
    let workers: BTreeMap<TaskId, WorkerGuard> = tasks
        .iter()
        .map(|&task| {
            let spawned = sup.wait_event(task, "worker_spawned", SETTLE);
            let (pid, fp) = worker_identity(&spawned).expect("worker identity");
            (task, WorkerGuard::pin(pid, &fp))
        })
        .collect();
    sup.shutdown();
    for (task, w) in &workers {
        assert!(
            w.alive(),
            "task {task}: worker {} died with its supervisor",
            w.pid
        );
    }

    // Every worker now retries its report until a supervisor answers.
    for &task in &tasks {
        open_gate(&gates, task);
    }
    runwarden::actors::dispatcher::delay_reconciles(RECONCILE_DELAY);
    // The socket's own bound (5 s) out of reach: the gate must open on the reconcile's signal.
    runwarden::control::server::set_first_reconcile_wait(Duration::from_secs(600));
    let started = Instant::now();
    let mut sup = Supervisor::start(config).expect("start the second incarnation");
    for &task in &tasks {
        sup.wait_status(task, TaskStatus::Done, SETTLE + RECONCILE_DELAY);
    }
    for &task in &tasks {
        let d = sup.detail(task);
        let history = sup.history(task);
        let id_of = |kind: &str| only_event(&d, kind, &history);
        let (adopted, completed) = (id_of("worker_adopted"), id_of("completed"));
        assert!(
            adopted < completed,
            "the report landed before the adoption\n{history}"
        );
        assert_eq!(d.runs.len(), 1, "one run\n{history}");
        assert_eq!(d.task.result.as_deref(), Some("ok"), "{history}");
    }
    // The reports did wait for the slowed reconcile (else the hook slowed nothing).
    assert!(
        started.elapsed() >= RECONCILE_DELAY,
        "done after {:?}, before the reconcile could have run",
        started.elapsed()
    );

    // Each worker exits after its report was answered.
    let gone = common::proc_guard::wait_until(SETTLE, || workers.values().all(|w| !w.alive()));
    assert!(gone, "workers left after their reports");
    sup.shutdown();
}

/// A worker whose start was never recorded (its supervisor died between the start and the
/// record) is not adopted — which token carrier is the worker cannot be proven — so its report
/// must not land either: the reconcile ends it (`worker_found`) and releases its run before the
/// socket answers anyone, and the task runs again.
#[test]
fn a_worker_found_by_its_token_is_ended_before_its_report_lands() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), sh_assignee("exec sleep 300"));
    std::fs::create_dir_all(td.data_dir()).unwrap();

    // A claim of a supervisor that died before recording its worker, and that worker: a group
    // leader carrying the run's token, retrying its report until a supervisor answers.
    let db = Db::new(td.db_path());
    let (task, claim) = db.write(|tx| {
        let now = now_millis();
        let task = tx.create_task(&task_for("found", "w"), now)?.id;
        Ok((
            task,
            tx.claim_task_to_spawn(task, "runwarden:1:dead", now, 600_000)?,
        ))
    });
    let worker = ChildGuard::spawn(
        Command::new("sh")
            .arg("-c")
            .arg(complete_loop("ok"))
            .env("PATH", path_with_runwarden())
            .env("RUNWARDEN_SOCKET", td.socket_path())
            .env("RUNWARDEN_TASK_ID", task.to_string())
            .env("RUNWARDEN_RUN_ID", claim.run_id.to_string())
            .env("RUNWARDEN_RUN_TOKEN", &claim.token)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0),
    )
    .expect("spawn the unrecorded worker");

    runwarden::actors::dispatcher::delay_reconciles(RECONCILE_DELAY);
    runwarden::control::server::set_first_reconcile_wait(Duration::from_secs(600));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    sup.wait_event(task, "worker_spawned", SETTLE + 3 * RECONCILE_DELAY);
    assert!(
        worker.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "the unrecorded worker was not ended"
    );

    let d = sup.detail(task);
    let history = sup.history(task);
    only_event(&d, "worker_found", &history);
    assert!(
        d.events
            .iter()
            .all(|e| e.kind != "completed" && e.kind != "worker_adopted"),
        "its report landed, or it was adopted\n{history}"
    );
    assert_eq!(
        d.runs[0].outcome,
        Some(runwarden::board::RunOutcome::Reclaimed),
        "{history}"
    );
    assert_eq!(d.runs[0].worker_pid, None, "nothing adopted\n{history}");
    assert_eq!(d.task.consecutive_failures, 0, "not a failure\n{history}");
    sup.shutdown();
}

/// The same through the library: `Supervisor::start` hands over its handle once the first
/// reconcile has adopted the previous incarnation's workers (or after the socket's 5 s), so a
/// `complete` made at once through it lands on an adopted run.
#[test]
fn a_report_through_a_fresh_handle_lands_after_the_adoption() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), sh_assignee("exec sleep 300"));
    let mut first = config.clone();
    first.supervisor.shutdown = ShutdownMode::Leave;
    let mut sup = Supervisor::start(first).expect("start the first incarnation");
    let task = add(&sup, task_for("slow", "w"));
    let spawned = sup.wait_event(task, "worker_spawned", SETTLE);
    let (pid, fp) = worker_identity(&spawned).expect("worker identity");
    let worker = WorkerGuard::pin(pid, &fp);
    sup.shutdown();

    runwarden::actors::dispatcher::delay_reconciles(RECONCILE_DELAY);
    let mut sup = Supervisor::start(config).expect("start the second incarnation");
    sup.complete(task, Some("ok".into())).expect("complete");
    let d = sup.detail(task);
    let history = sup.history(task);
    let (adopted, completed) = (
        only_event(&d, "worker_adopted", &history),
        only_event(&d, "completed", &history),
    );
    assert!(
        adopted < completed,
        "the report landed before the adoption\n{history}"
    );
    // Its grace over, the adopted worker is ended.
    assert!(
        worker.wait_dead(SETTLE).is_some(),
        "the worker outlived its run's grace\n{history}"
    );
    sup.shutdown();
}
