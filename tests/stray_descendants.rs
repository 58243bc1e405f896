//! The tick's sweep for strays: a process that carries a finished run's token and turns up
//! re-parented to the supervisor after its worker's tree was ended (here started by the test
//! in the supervising process, standing in for an escapee no look at the worker's exit
//! caught) is ended, and the end is on the record (`stray_descendants_ended`, with its pid
//! and how it ended). One beside it that names the same run with a token the board does not
//! hold is never signalled.

#[allow(dead_code)]
mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::lifecycle::{Db, View, add, sh_assignee, task_for};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{RunId, TaskStatus};

/// Starts `sleep 307` as an orphan of this process carrying `RUNWARDEN_RUN_TOKEN=<token>` and
/// `RUNWARDEN_RUN_ID=<run>`; returns it pinned (SIGKILLed when the test ends, whatever
/// happens). Pinned while its `sh` parent still waits on its stdin, so the sweep cannot end
/// it before it is pinned; the `sh` is registered as owned, so the supervisor's orphan reaper
/// leaves its exit status to us.
fn orphan_carrying(token: &str, run: RunId) -> common::runtime::WorkerGuard {
    use std::io::{BufRead, BufReader};
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        "setsid sleep 307 </dev/null >/dev/null 2>&1 & echo $!; read _; exit 0",
    ])
    .env("RUNWARDEN_RUN_TOKEN", token)
    .env("RUNWARDEN_RUN_ID", run.to_string())
    .stdin(Stdio::piped())
    .stdout(Stdio::piped());
    let owned = runwarden::process::owned::spawning();
    let mut sh = common::proc_guard::ChildGuard::spawn(&mut cmd).expect("spawn sh");
    owned.register(sh.pid());
    drop(owned);
    let mut line = String::new();
    BufReader::new(sh.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the orphan's pid");
    let pid = line.trim().parse().expect("a pid");
    let orphan = common::lifecycle::seen(pid).pin().expect("the orphan runs");
    drop(sh.0.stdin.take()); // `read` ends: the sh exits, its child is orphaned to us.
    assert!(
        sh.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "sh did not exit"
    );
    let status = sh.0.wait().expect("wait for sh");
    runwarden::process::owned::unregister(sh.pid());
    assert!(status.success(), "sh: {status}");
    orphan
}

#[test]
fn a_stray_of_a_finished_run_is_ended_and_recorded_and_a_stranger_is_left_alone() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.assignees.insert("w".into(), sh_assignee("exit 0"));
    let sup = Supervisor::start(config).expect("start");
    let task = add(&sup, task_for("finished", "w"));
    let done = sup.wait_for(task, SETTLE).expect("the task ends");
    assert_eq!(done.status, TaskStatus::Done, "{done:?}");
    let mut db = Db::new(td.db_path());
    let run = db.runs(task).remove(0);

    let stranger = orphan_carrying("a-token-this-board-never-issued", run.id);
    let stray = orphan_carrying(&run.token, run.id);
    let ended = db.wait_event(task, "stray_descendants_ended", SETTLE);
    assert_eq!(ended.run_id, Some(run.id), "{ended:?}");
    assert_eq!(
        ended.payload["pids"],
        serde_json::json!([stray.pid]),
        "{ended:?}"
    );
    assert_eq!(ended.payload["ended_by"], "sigterm", "{ended:?}");
    assert!(stray.wait_dead(SETTLE).is_some(), "the stray still runs");
    assert!(
        stranger.alive(),
        "a process whose token the board never issued was signalled"
    );
    // Ended once and recorded once: later rounds of the sweep (every 50 ms) find nothing more.
    let again = wait_until(Duration::from_millis(500), || {
        db.events_of(task, "stray_descendants_ended").len() > 1
    });
    assert!(
        !again,
        "{:?}",
        db.events_of(task, "stray_descendants_ended")
    );
    sup.shutdown();
}
