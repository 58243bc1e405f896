//! A worker of a previous incarnation is not the new supervisor's child, yet its exit is judged
//! by its real status whenever the kernel still tells it — a clean exit of a plain command
//! completes its task across a restart instead of counting as a crash:
//!
//! - adopted, then exits 0 and is reaped at once by its new parent (as systemd or tini would):
//!   the status comes through the pidfd (`PIDFD_INFO_EXIT`, Linux 6.15) → `completed`;
//! - adopted, then exits 3 and stays a zombie (a parent that reaps late): the status comes from
//!   `/proc/<pid>/stat` → `crashed`, "exited with code 3";
//! - exits 0 while no supervisor runs and stays a zombie: the next supervisor's reconcile reads
//!   it → `completed`;
//! - exits 6 while no supervisor runs and stays a zombie: the next supervisor's reconcile reads
//!   it → `crashed`, "exited with code 6";
//! - exits 5 while no supervisor runs and is reaped at once: nothing tells its status any more
//!   → `crashed`, "exited while unsupervised".
//!
//! Each crash quotes its own run's output only, as it would in the supervisor that started it:
//! where that output starts in the task's log (shared with earlier attempts) is kept on the
//! run row with the worker's evidence.
//!
//! The workers' new parent is this test process (a child subreaper, standing in for init), so
//! when each is reaped is up to the test. One test in this file: it makes the process a
//! subreaper.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::fs;

use common::lifecycle::{Db, View, wait_for_gate};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir, WorkerGuard, worker_identity};
use runwarden::board::{NewTask, RunOutcome, TaskId, now_millis};
use runwarden::process::{Signal, read_stat};

/// Reaps our child `pid` (blocking), as init would.
fn reap(pid: i32) -> nix::Result<nix::sys::wait::WaitStatus> {
    nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None)
}

#[test]
fn an_adopted_or_unsupervised_workers_exit_status_is_used_when_the_kernel_tells_it() {
    let td = TestDir::new();
    let gates = td.path().join("gates");
    fs::create_dir_all(&gates).unwrap();
    // The gate file holds the code to exit with.
    let worker = format!(
        "echo \"output of run $RUNWARDEN_RUN_ID\"; {}; exit \"$(cat \"$GATE_DIR/$RUNWARDEN_TASK_ID\")\"",
        wait_for_gate(60)
    );
    let config = td.write_config(
        "tick = \"100ms\"\nshutdown = \"leave\"",
        &format!(
            "[reaper]\ngrace = \"300ms\"\nkill_timeout = \"1s\"\n\n\
             [retries]\nmax_retries = 0\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\nmax_in_progress = 5\n\
             env = {{ GATE_DIR = {gates:?} }}\n"
        ),
    );
    let gate = |task: TaskId, code: i32| fs::write(gates.join(task.to_string()), code.to_string());
    let _subreaper = runwarden::process::become_subreaper().expect("become a subreaper");
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let [
        reaped_clean,
        zombie_crash,
        offline_zombie,
        offline_crash,
        offline_reaped,
    ]: [TaskId; 5] = db.write(|tx| {
        let now = now_millis();
        let mut ids = Vec::new();
        for title in [
            "reaped clean",
            "zombie crash",
            "offline zombie",
            "offline crash",
            "offline reaped",
        ] {
            ids.push(
                tx.create_task(&NewTask::titled(title).for_assignee("w"), now)?
                    .id,
            );
        }
        Ok(ids.try_into().unwrap())
    });

    // Output of earlier attempts in the crashing tasks' logs (the log is the task's).
    let logs = td.data_dir().join("logs");
    fs::create_dir_all(&logs).unwrap();
    for task in [zombie_crash, offline_crash, offline_reaped] {
        fs::write(
            logs.join(format!("{task}.log")),
            "EARLIER ATTEMPT'S OUTPUT\n",
        )
        .unwrap();
    }

    let mut first = Serve::start(&config, "serve1");
    first.wait_ready(&td.lock_path(), &td.db_path());
    let mut pids = BTreeMap::new();
    let mut pins = Vec::new();
    for task in [
        reaped_clean,
        zombie_crash,
        offline_zombie,
        offline_crash,
        offline_reaped,
    ] {
        let (pid, fp) = worker_identity(&db.wait_event(task, "worker_spawned", SETTLE))
            .expect("worker identity");
        pins.push(WorkerGuard::pin(pid, &fp));
        pids.insert(task, pid);
    }
    first.stop_cleanly(Signal::SIGTERM);
    let me = std::process::id() as i32;
    for (task, &pid) in &pids {
        assert!(
            wait_until(SETTLE, || read_stat(pid).is_ok_and(|s| s.ppid == me)),
            "task {task}: worker {pid} was not re-parented to the test"
        );
    }

    // Three exit while no supervisor runs: two stay zombies, one is reaped at once.
    gate(offline_zombie, 0).unwrap();
    gate(offline_crash, 6).unwrap();
    gate(offline_reaped, 5).unwrap();
    assert!(reap(pids[&offline_reaped]).is_ok());
    for task in [offline_zombie, offline_crash] {
        assert!(
            wait_until(SETTLE, || read_stat(pids[&task])
                .is_ok_and(|s| s.is_zombie())),
            "task {task}: the offline worker did not exit"
        );
    }

    let mut second = Serve::start(&config, "serve2");
    second.wait_ready(&td.lock_path(), &td.db_path());
    for task in [reaped_clean, zombie_crash] {
        db.wait_event(task, "worker_adopted", SETTLE);
    }
    // One adopted worker is reaped the moment it exits (a thread blocked in waitpid), the
    // other is left a zombie.
    let clean_pid = pids[&reaped_clean];
    let reaper = std::thread::spawn(move || reap(clean_pid));
    gate(reaped_clean, 0).unwrap();
    gate(zombie_crash, 3).unwrap();

    let closed = |db: &mut Db, task: TaskId| {
        assert!(
            wait_until(SETTLE, || db
                .runs(task)
                .iter()
                .all(|r| r.ended_at.is_some())),
            "task {task}: run not closed\n{}",
            db.history(task)
        );
        let runs = db.runs(task);
        assert_eq!(runs.len(), 1, "one run\n{}", db.history(task));
        (runs[0].clone(), db.history(task))
    };
    let (run, history) = closed(&mut db, reaped_clean);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{history}");
    assert_eq!(run.exit_code, Some(0), "{history}");
    assert!(
        reaper.join().unwrap().is_ok(),
        "reaped here, not by the supervisor"
    );

    // A crash's error quotes this run's output, not the earlier attempt's before it.
    let own_output_only = |run: &runwarden::board::Run, history: &str| {
        let error = run.error.clone().unwrap_or_default();
        assert!(
            error.contains(&format!("log tail: output of run {}", run.id)),
            "{error}\n{history}"
        );
        assert!(!error.contains("EARLIER"), "{error}\n{history}");
        error
    };
    let (run, history) = closed(&mut db, zombie_crash);
    assert_eq!(run.outcome, Some(RunOutcome::Crashed), "{history}");
    assert_eq!(run.exit_code, Some(3), "{history}");
    let error = own_output_only(&run, &history);
    assert!(error.contains("exited with code 3"), "{error}\n{history}");

    let (run, history) = closed(&mut db, offline_crash);
    assert_eq!(run.outcome, Some(RunOutcome::Crashed), "{history}");
    assert_eq!(run.exit_code, Some(6), "{history}");
    let error = own_output_only(&run, &history);
    assert!(error.contains("exited with code 6"), "{error}\n{history}");

    let (run, history) = closed(&mut db, offline_zombie);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{history}");
    assert_eq!(run.exit_code, Some(0), "{history}");

    let (run, history) = closed(&mut db, offline_reaped);
    assert_eq!(run.outcome, Some(RunOutcome::Crashed), "{history}");
    let error = own_output_only(&run, &history);
    assert!(
        error.contains("exited while unsupervised"),
        "{error}\n{history}"
    );

    for task in [zombie_crash, offline_zombie, offline_crash] {
        assert!(
            reap(pids[&task]).is_ok(),
            "task {task}: zombie not ours to reap"
        );
    }
    second.stop_cleanly(Signal::SIGTERM);
}
