//! A copy of a board in use, served from another data dir on the same machine (a backup
//! opened to read it, a new build tried on a copy), must never take the original's live
//! workers for its own: it neither adopts nor signals them — not on archive, not at its
//! terminating stop — and the original goes on supervising them undisturbed. A supervisor
//! restarted on its own data dir still adopts its workers (tests/restart.rs).

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::runwarden_cli;
use common::runtime::{
    Serve, TestDir, WorkerGuard, poll_board, runs_of, task_event, wait_worker_in_board,
};
use runwarden::board::{Board, OpenOptions, TaskStatus};
use runwarden::process::Signal;

const CLI_WAIT: Duration = Duration::from_secs(30);

fn config(td: &TestDir, shutdown: &str) -> std::path::PathBuf {
    td.write_config(
        &format!("tick = \"100ms\"\nshutdown = \"{shutdown}\""),
        "[reaper]\ngrace = \"300ms\"\nkill_timeout = \"1s\"\n\n[leases]\nstale_after = \"1s\"\n\n\
         [assignees.w]\ncommand = [\"sleep\", \"300\"]\n",
    )
}

#[test]
fn a_copy_of_a_board_in_use_never_touches_the_originals_workers() {
    let original = TestDir::new();
    let mut live = Serve::start(&config(&original, "leave"), "live");
    live.wait_ready(&original.lock_path(), &original.db_path());
    let added = runwarden_cli(
        &original.socket_path(),
        &["add", "long job", "--assignee", "w"],
        CLI_WAIT,
    )
    .ok();
    let task: i64 = added.stdout.trim().parse().expect("add prints the id");
    let (pid, fp) = wait_worker_in_board(&original.db_path(), task);
    let worker = WorkerGuard::pin(pid, &fp);

    // A consistent copy of the live board (as `sqlite3 .backup` makes), served elsewhere.
    let copy = TestDir::new();
    std::fs::create_dir_all(copy.data_dir()).expect("the copy's data dir");
    let source = Board::open_with(
        &original.db_path(),
        OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .expect("open the live board");
    source
        .execute_raw(
            "VACUUM INTO ?1",
            [copy.db_path().to_str().expect("a UTF-8 path")],
        )
        .expect("copy the board");
    drop(source);
    let mut other = Serve::start(&config(&copy, "terminate"), "copy");
    other.wait_ready(&copy.lock_path(), &copy.db_path());

    // The copy's start has settled the run: adopted (what it must not do) or disowned.
    let seen = poll_board(&copy.db_path(), "the copy to settle the run", |b| {
        task_event(b, task, "worker_disowned").or_else(|| task_event(b, task, "worker_adopted"))
    });
    // Archived there, and that supervisor stopped with shutdown = "terminate".
    runwarden_cli(
        &copy.socket_path(),
        &["archive", &task.to_string()],
        CLI_WAIT,
    )
    .ok();
    poll_board(&copy.db_path(), "the archive on the copy", |b| {
        (b.read(|tx| tx.get_task(task)).ok()?.status == TaskStatus::Archived).then_some(())
    });
    other.stop_cleanly(Signal::SIGTERM);
    assert!(
        worker.alive(),
        "the copy ended the original's worker {pid}; its stderr:\n{}",
        other.stderr()
    );

    // The copy disowned it, without a signal, and closed its run there.
    assert_eq!(seen.kind, "worker_disowned", "{seen:?}");
    assert_eq!(seen.payload["pid"], pid, "{seen:?}");
    let mut board = common::runtime::open_ro(&copy.db_path());
    let runs = runs_of(&mut board, task);
    assert!(
        runs.iter().all(|r| !r.is_open() && r.worker_pid.is_none()),
        "the copy kept a worker on record: {runs:?}"
    );
    let token = &runs_of_original(&original, task)[0].token;
    assert!(
        runs.iter().all(|r| &r.token != token),
        "the copy kept the run's token: processes carrying it would be ended by it"
    );

    // The original still supervises it, as if nothing happened.
    let runs = runs_of_original(&original, task);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert!(runs[0].is_open(), "{runs:?}");
    assert_eq!(runs[0].worker_pid, Some(i64::from(pid)), "{runs:?}");
    live.stop_cleanly(Signal::SIGTERM);
    assert!(worker.alive(), "shutdown = \"leave\" leaves it running");
}

fn runs_of_original(td: &TestDir, task: i64) -> Vec<runwarden::board::Run> {
    let mut board = common::runtime::open_ro(&td.db_path());
    runs_of(&mut board, task)
}
