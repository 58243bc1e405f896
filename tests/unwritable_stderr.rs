//! A stderr that cannot be written — a log file on a full disk (`/dev/full` here), a pipe
//! whose reader went away — costs log lines, nothing else: `serve` keeps supervising (a task
//! runs to done) and stops cleanly (exit 0), and a CLI command's exit code is still its
//! outcome's (1 for a failure), not a panic's 101.

#[allow(dead_code)]
mod common;

use std::fs::{self, OpenOptions};
use std::process::{Command, Stdio};

use common::proc_guard::ChildGuard;
use common::runtime::{SETTLE, Serve, TestDir, add_to_board, poll_board, runs_of, task_event};
use runwarden::board::{RunOutcome, TaskStatus};
use runwarden::process::Signal;

fn dev_full() -> Stdio {
    OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("open /dev/full")
        .into()
}

/// A pipe's write end whose read end is already closed: every write fails with EPIPE.
fn widowed_pipe() -> Stdio {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    writer.into()
}

/// Runs one task to done under a `serve` logging at debug into `stderr`, then stops it.
fn supervises_with_stderr(stderr: Stdio) {
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"",
        "[assignees.w]\ncommand = [\"sh\", \"-c\", \"echo to the log\"]\n",
    );
    let mut serve =
        Serve::start_with_stderr(&config, "serve", &[("RUNWARDEN_LOG", "debug")], stderr);
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let task = add_to_board(&td.db_path(), "w");
    poll_board(&td.db_path(), "the task to be done", |b| {
        let done = b.read(|tx| tx.get_task(task)).expect("task").status == TaskStatus::Done;
        done.then_some(())
    });
    let mut board = runwarden::board::Board::open(&td.db_path()).expect("open the board");
    let run = runs_of(&mut board, task).remove(0);
    assert_eq!(run.outcome, Some(RunOutcome::Completed), "{run:?}");
    assert!(task_event(&mut board, task, "worker_spawned").is_some());
    let log = fs::read_to_string(td.data_dir().join("logs").join(format!("{task}.log")))
        .expect("the worker's log");
    assert_eq!(log, "to the log\n");
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn serve_with_its_stderr_on_a_full_disk_supervises_and_stops_cleanly() {
    supervises_with_stderr(dev_full());
}

#[test]
fn serve_whose_log_reader_went_away_supervises_and_stops_cleanly() {
    supervises_with_stderr(widowed_pipe());
}

#[test]
fn a_failing_command_with_an_unwritable_stderr_exits_1_not_in_a_panic() {
    let td = TestDir::new();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_runwarden"));
    common::control_daemon::scrub_env(&mut cmd);
    cmd.arg("--socket")
        .arg(td.path().join("no-supervisor.sock"))
        .arg("status")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(dev_full());
    let mut child = ChildGuard::spawn(&mut cmd).expect("spawn runwarden status");
    assert!(
        child.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "runwarden status did not exit"
    );
    let status = child.0.wait().expect("wait");
    assert_eq!(status.code(), Some(1), "{status}");
}
