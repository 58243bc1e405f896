//! A supervisor killed with SIGKILL loses nothing and duplicates nothing. The real
//! `runwarden serve` starts 20 workers that wait for their gate and then report with
//! `runwarden complete` (retrying until a supervisor answers); it is SIGKILLed while they all
//! run, they live on, half of them report while no supervisor is up, and a second `serve`
//! adopts them:
//!
//! - every task ends `done` exactly once (one `completed` event per task);
//! - no task ever had two runs open or two workers: one claim, one spawn, one run per task,
//!   and the run that completed is the one the second incarnation adopted;
//! - no worker is left at the end (every recorded pid is dead, by fingerprint);
//! - the board passes `PRAGMA integrity_check`.

#[allow(dead_code)]
mod common;

use common::lifecycle::{
    Db, View, complete_loop, open_gate, spawned_identity, stop_serve, wait_for_gate,
};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir, WorkerGuard};
use runwarden::board::{NewTask, RunOutcome, TaskId, TaskStatus, now_millis};
use runwarden::process::Signal;
use std::collections::BTreeMap;
use std::time::Duration;

const TASKS: usize = 20;

#[test]
fn sigkilled_supervisor_restarts_and_every_task_completes_exactly_once() {
    let td = TestDir::new();
    let gates = td.path().join("gates");
    let worker = format!("{}; {}", wait_for_gate(60), complete_loop("ok"));
    let config = td.write_config(
        "tick = \"100ms\"\nmax_in_progress = 32",
        &format!(
            "[reaper]\ngrace = \"1s\"\nkill_timeout = \"1s\"\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\nmax_in_progress = 32\n\
             env = {{ GATE_DIR = {gates:?} }}\n"
        ),
    );
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let tasks: Vec<TaskId> = db.write(|tx| {
        let now = now_millis();
        (0..TASKS)
            .map(|i| {
                Ok(tx
                    .create_task(&NewTask::titled(format!("task {i}")).for_assignee("w"), now)?
                    .id)
            })
            .collect()
    });

    let mut first = Serve::start(&config, "serve1");
    first.wait_ready(&td.lock_path(), &td.db_path());
    let mut spawned = Vec::new();
    let all = wait_until(SETTLE, || {
        spawned = db
            .all_events()
            .into_iter()
            .filter(|e| e.kind == "worker_spawned")
            .collect();
        spawned.len() == TASKS
    });
    assert!(
        all,
        "{} of {TASKS} workers spawned; stderr:\n{}",
        spawned.len(),
        first.stderr()
    );
    // Pinned by fingerprint: ended by pid on drop, whatever happens below.
    let workers: BTreeMap<TaskId, WorkerGuard> = spawned
        .iter()
        .map(|e| {
            let (pid, fp) = spawned_identity(e);
            (e.task_id.unwrap(), WorkerGuard::pin(pid, &fp))
        })
        .collect();
    assert_eq!(workers.len(), TASKS, "one worker per task");

    stop_serve(&mut first, Signal::SIGKILL, SETTLE);
    // Still waiting for their gates: the SIGKILL took the supervisor alone.
    for (task, w) in &workers {
        assert!(
            w.alive(),
            "task {task}: worker {} died with the supervisor",
            w.pid
        );
    }

    // Half report while no supervisor is up (they retry), half once the second one is.
    let (early, late) = tasks.split_at(TASKS / 2);
    for &task in early {
        open_gate(&gates, task);
    }
    let mut second = Serve::start(&config, "serve2");
    second.wait_ready(&td.lock_path(), &td.db_path());
    for &task in late {
        open_gate(&gates, task);
    }
    for &task in &tasks {
        db.wait_status(task, TaskStatus::Done, 3 * SETTLE);
    }

    for &task in &tasks {
        let d = db.detail(task);
        let history = db.history(task);
        let count = |kind: &str| d.events.iter().filter(|e| e.kind == kind).count();
        assert_eq!(count("completed"), 1, "done exactly once\n{history}");
        assert_eq!(count("claimed"), 1, "claimed once\n{history}");
        assert_eq!(count("worker_spawned"), 1, "one worker\n{history}");
        assert_eq!(d.runs.len(), 1, "one run\n{history}");
        let run = &d.runs[0];
        assert_eq!(run.outcome, Some(RunOutcome::Completed), "{history}");
        assert_eq!(
            d.task.result.as_deref(),
            Some("ok"),
            "reported by the worker\n{history}"
        );
        let adopted: Vec<_> = d
            .events
            .iter()
            .filter(|e| e.kind == "worker_adopted")
            .collect();
        assert_eq!(
            adopted.len(),
            1,
            "adopted once by the second incarnation\n{history}"
        );
        assert_eq!(adopted[0].run_id, Some(run.id), "{history}");
        let completed = d.events.iter().find(|e| e.kind == "completed").unwrap();
        assert_eq!(
            completed.run_id,
            Some(run.id),
            "the adopted run completed\n{history}"
        );
        assert_eq!(run.spawned_pid, Some(i64::from(workers[&task].pid)));
        // At most one open run at any time (claimed +1, run_closed −1, in commit order).
        let mut open = 0;
        for e in &d.events {
            match e.kind.as_str() {
                "claimed" => open += 1,
                "run_closed" => open -= 1,
                _ => {}
            }
            assert!(
                (0..=1).contains(&open),
                "{open} runs open at event {}\n{history}",
                e.id
            );
        }
    }

    // No worker left: each exits after reporting, or the reaper ends it after the grace.
    let gone = wait_until(SETTLE, || workers.values().all(|w| !w.alive()));
    let left: Vec<_> = workers
        .values()
        .filter(|w| w.alive())
        .map(|w| w.pid)
        .collect();
    assert!(gone, "workers left: {left:?}\n{}", second.stderr());
    let open = db.read(|tx| tx.open_runs());
    assert!(open.is_empty(), "open runs left: {open:?}");

    second.stop_cleanly(Signal::SIGTERM);
    drop(db);
    assert_eq!(Db::new(td.db_path()).integrity_check(), "ok");
}

/// A worker that reports while no supervisor is listening does not lose its report:
/// `runwarden complete` inside a worker retries until a supervisor answers again.
#[test]
fn a_worker_report_made_during_a_restart_lands_once_the_supervisor_is_back() {
    let td = TestDir::new();
    let gate_dir = td.path().join("gates");
    // Waits for its gate, then reports exactly once (no retry loop of its own).
    let worker = format!(
        "{}; runwarden complete --result ok",
        common::lifecycle::wait_for_gate(30)
    );
    let config = td.write_config(
        "tick = \"100ms\"",
        &format!(
            "[assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\n\
             env = {{ GATE_DIR = {:?} }}\n",
            gate_dir.display().to_string()
        ),
    );
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let task = db.write(|tx| {
        Ok(tx
            .create_task(
                &NewTask::titled("report late").for_assignee("w"),
                now_millis(),
            )?
            .id)
    });

    let mut first = Serve::start(&config, "serve1");
    first.wait_ready(&td.lock_path(), &td.db_path());
    let mut spawned = None;
    assert!(
        wait_until(SETTLE, || {
            spawned = db.events_of(task, "worker_spawned").into_iter().next();
            spawned.is_some()
        }),
        "the worker never started; stderr:\n{}",
        first.stderr()
    );
    let (pid, fp) = spawned_identity(&spawned.unwrap());
    let worker_guard = WorkerGuard::pin(pid, &fp);
    stop_serve(&mut first, Signal::SIGKILL, SETTLE);

    // The worker now reports into the void: its `runwarden complete` must wait, not fail.
    common::lifecycle::open_gate(&gate_dir, task);
    let run = db.runs(task)[0].clone();
    let reporter =
        common::lifecycle::wait_run_procs(&run.token, &["runwarden complete --result ok"], SETTLE);
    assert!(
        worker_guard.alive(),
        "the worker gave up while no supervisor ran"
    );
    assert_eq!(db.get_task(task).status, TaskStatus::Running);

    let mut second = Serve::start(&config, "serve2");
    second.wait_ready(&td.lock_path(), &td.db_path());
    db.wait_status(task, TaskStatus::Done, SETTLE);
    let d = db.detail(task);
    assert_eq!(
        d.task.result.as_deref(),
        Some("ok"),
        "the worker's own report"
    );
    assert_eq!(d.runs.len(), 1, "no second run");
    assert_eq!(d.runs[0].outcome, Some(RunOutcome::Completed));
    assert_eq!(d.events.iter().filter(|e| e.kind == "completed").count(), 1);
    assert!(
        common::lifecycle::wait_all_dead(&reporter, SETTLE),
        "the reporting CLI did not exit after its report landed"
    );
    stop_serve(&mut second, Signal::SIGTERM, SETTLE);
}

#[test]
fn a_worker_whose_assignee_left_the_config_is_still_adopted_and_ended_at_its_max_runtime() {
    let td = TestDir::new();
    let worker = "exec sleep 309";
    let config = td.write_config(
        "tick = \"100ms\"",
        &format!(
            "[reaper]\ngrace = \"1s\"\nkill_timeout = \"1s\"\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\n"
        ),
    );
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let mut new = NewTask::titled("t").for_assignee("w");
    new.max_runtime_ms = Some(3_000);
    let task = db.write(|tx| Ok(tx.create_task(&new, now_millis())?.id));
    let mut first = Serve::start(&config, "serve1");
    first.wait_ready(&td.lock_path(), &td.db_path());
    let spawned = db.wait_event(task, "worker_spawned", SETTLE);
    let (pid, fp) = spawned_identity(&spawned);
    let worker = WorkerGuard::pin(pid, &fp);
    stop_serve(&mut first, Signal::SIGKILL, SETTLE);
    assert!(worker.alive(), "the worker died with its supervisor");

    // The next incarnation's config no longer has the assignee.
    let config = td.write_config(
        "tick = \"100ms\"",
        "[reaper]\ngrace = \"1s\"\nkill_timeout = \"1s\"\n\n\
         [assignees.other]\ncommand = [\"true\"]\n",
    );
    let mut second = Serve::start(&config, "serve2");
    second.wait_ready(&td.lock_path(), &td.db_path());
    let adopted = db.wait_event(task, "worker_adopted", SETTLE);
    assert_eq!(adopted.run_id, spawned.run_id);
    // Supervised all the same: its task's max runtime ends it.
    let closed = db.wait_event(task, "run_closed", SETTLE);
    assert_eq!(closed.payload["outcome"], "timed_out", "{closed:?}");
    assert!(
        wait_until(SETTLE, || !worker.alive()),
        "the adopted worker outlived its max runtime\n{}",
        db.history(task)
    );
    second.stop_cleanly(Signal::SIGTERM);
}

/// A library config on `td` with `shutdown = mode`, a grace of `grace`, and an assignee `slow`
/// whose worker sleeps 300 s.
fn slow_config(
    td: &TestDir,
    mode: runwarden::config::ShutdownMode,
    grace: Option<Duration>,
) -> runwarden::config::Config {
    let mut c = common::runtime::lib_config(td);
    c.supervisor.shutdown = mode;
    if let Some(grace) = grace {
        c.reaper.grace = grace;
    }
    c.assignees.insert(
        "slow".into(),
        runwarden::config::AssigneeConfig::new(["sleep", "300"]),
    );
    c
}

/// A slow task added through `sup`, and its worker, pinned.
fn slow_task(sup: &runwarden::SupervisorHandle, title: &str) -> (TaskId, WorkerGuard) {
    let task = sup
        .add_task(NewTask::titled(title).for_assignee("slow"))
        .expect("add")
        .id;
    let (pid, fp) = common::runtime::wait_worker(sup, task);
    (task, WorkerGuard::pin(pid, &fp))
}

/// `shutdown = "terminate"` at once after a start (a SIGTERM during `serve`'s boot, a shutdown
/// future of an embedding program already resolved) still ends the previous incarnation's
/// workers: the stop waits for the first reconcile to adopt them, then releases their runs
/// (not a failure) and ends them. Before, the stop came first and the adopted worker was left
/// running.
#[test]
fn a_terminating_stop_right_after_the_start_ends_the_previous_incarnations_workers() {
    use runwarden::Supervisor;
    use runwarden::config::ShutdownMode;
    let td = TestDir::new();
    let config = |mode| slow_config(&td, mode, None);
    let first = Supervisor::start(config(ShutdownMode::Leave)).expect("first start");
    let (task, worker) = slow_task(&first, "slow");
    let pid = worker.pid;
    first.shutdown();
    assert!(worker.alive(), "shutdown = \"leave\" left it running");

    // Told to stop before it has even booted (as `serve` is by a SIGTERM during its boot):
    // it stops right after the boot, with the first reconcile just begun.
    runwarden::supervisor::run(config(ShutdownMode::Terminate), |_| {}, async {})
        .expect("second start");
    assert!(
        worker.wait_dead(SETTLE).is_some(),
        "the adopted worker {pid} outlived the terminating stop"
    );
    let mut db = Db::new(td.db_path());
    let found = db.get_task(task);
    assert_eq!(
        found.status,
        TaskStatus::Ready,
        "released: {}",
        db.history(task)
    );
    assert_eq!(
        found.consecutive_failures,
        0,
        "not a failure: {}",
        db.history(task)
    );
}

/// A previous incarnation's worker that reported "done" and still runs within its grace is no
/// dispatcher's (its run is closed, nothing adopts it); a `terminate` stop ends it all the same
/// rather than leaving it to a grace no supervisor will be there to end.
#[test]
fn a_terminating_stop_ends_a_previous_incarnations_worker_within_its_grace() {
    use runwarden::Supervisor;
    use runwarden::config::ShutdownMode;
    let td = TestDir::new();
    let config = |mode| slow_config(&td, mode, Some(Duration::from_secs(60)));
    let first = Supervisor::start(config(ShutdownMode::Leave)).expect("first start");
    let (task, worker) = slow_task(&first, "done, then hangs");
    let pid = worker.pid;
    first.complete(task, None).expect("complete");
    first.shutdown();
    assert!(worker.alive(), "within its 60 s grace, left running");

    runwarden::supervisor::run(config(ShutdownMode::Terminate), |_| {}, async {})
        .expect("second start");
    assert!(
        worker.wait_dead(SETTLE).is_some(),
        "the previous incarnation's worker {pid} outlived the terminating stop"
    );
    let mut db = Db::new(td.db_path());
    assert_eq!(
        db.get_task(task).status,
        TaskStatus::Done,
        "{}",
        db.history(task)
    );
    assert_eq!(
        db.events_of(task, "terminal_worker_reaped").len(),
        1,
        "{}",
        db.history(task)
    );
}
