//! SIGCHLD ignored (`SIG_IGN`, or `SA_NOCLDWAIT`) makes the kernel reap every child at once:
//! no worker's exit status could be read, and every run would end as a crash. `serve`
//! inherits an ignored SIGCHLD from its launcher across exec and gives it its default action
//! back; a program that embeds a supervisor with it is refused at start, with a clear error.
//!
//! One test in this file: it changes the test process's own SIGCHLD action (process-wide).

#[allow(dead_code)]
mod common;

use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::lifecycle::runwarden_cli;
use common::runtime::{Serve, TestDir, lib_config, poll_board, runs_of};
use runwarden::Supervisor;
use runwarden::board::{RunOutcome, TaskStatus};
use runwarden::process::Signal;

/// Sets SIGCHLD's action in this process: ignored, or default with `flags`.
fn set_sigchld(ignored: bool, flags: libc::c_int) {
    // SAFETY: a zeroed sigaction with an empty mask and SIG_IGN or SIG_DFL is a valid action.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = if ignored {
            libc::SIG_IGN
        } else {
            libc::SIG_DFL
        };
        action.sa_flags = flags;
        libc::sigemptyset(&mut action.sa_mask);
        assert_eq!(
            libc::sigaction(libc::SIGCHLD, &action, std::ptr::null_mut()),
            0,
            "sigaction"
        );
    }
}

#[test]
fn an_ignored_sigchld_loses_no_exit_status() {
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"",
        "[assignees.w]\ncommand = [\"sh\", \"-c\", \"exit 0\"]\n",
    );
    // SAFETY: the closure only calls signal(2), which is async-signal-safe.
    let mut serve = Serve::start_with(&config, "serve", |cmd| unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGCHLD, libc::SIG_IGN);
            Ok(())
        });
    });
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let socket = td.socket_path();
    let added = runwarden_cli(
        &socket,
        &["add", "exits 0", "--assignee", "w"],
        Duration::from_secs(30),
    )
    .ok();
    let task: i64 = added.stdout.trim().parse().expect("add prints the id");
    let runs = poll_board(&td.db_path(), "the task to settle", |b| {
        let task = b.read(|tx| tx.get_task(task)).ok()?;
        (task.status != TaskStatus::Running && task.status != TaskStatus::Ready)
            .then(|| (task.status, runs_of(b, task.id)))
    });
    assert_eq!(runs.0, TaskStatus::Done, "{:?}\n{}", runs.1, serve.stderr());
    assert_eq!(runs.1.len(), 1, "{:?}", runs.1);
    assert_eq!(
        runs.1[0].outcome,
        Some(RunOutcome::Completed),
        "{:?}",
        runs.1
    );
    assert_eq!(runs.1[0].exit_code, Some(0), "{:?}", runs.1);
    serve.stop_cleanly(Signal::SIGTERM);

    // Embedded: refused, whichever way the kernel was told to reap.
    for (ignored, flags) in [(true, 0), (false, libc::SA_NOCLDWAIT)] {
        let other = TestDir::new();
        set_sigchld(ignored, flags);
        let started = Supervisor::start(lib_config(&other));
        set_sigchld(false, 0);
        let err = match started {
            Ok(sup) => {
                sup.shutdown();
                panic!("started with SIGCHLD ignored={ignored} flags={flags:#x}");
            }
            Err(e) => e.to_string(),
        };
        assert!(err.contains("SIGCHLD"), "says why: {err}");
        assert!(
            !other.lock_path().exists(),
            "a refused start left its lock behind"
        );
    }
}
