//! An operator's command (or a worker's report) against a supervisor that does not answer
//! (here: stopped with SIGSTOP) gives up after `RUNWARDEN_TIMEOUT` with exit 124 and one line
//! saying so, instead of hanging a script for ever; `events --follow` is not cut off by a quiet stretch longer
//! than that timeout, and goes on once the supervisor answers again. A `RUNWARDEN_TIMEOUT` (or
//! `RUNWARDEN_CONNECT_WAIT`) that is not a duration is refused (exit 2), not silently replaced
//! by the default.

#[allow(dead_code)]
mod common;

use std::time::{Duration, Instant};

use common::control_daemon::{Daemon, command, ok, run, stream_of};
use common::proc_guard::wait_until;
use runwarden::process::Signal;

/// Sends SIGCONT to the stopped supervisor when dropped, so a failing test never leaves it
/// stopped (its own guard could not end it then: SIGKILL works, but its stop would wait).
struct Resume(i32);

impl Drop for Resume {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0), Signal::SIGCONT);
    }
}

#[test]
fn an_unanswering_supervisor_times_out_operator_commands_but_not_followers() {
    let mut d = Daemon::start("", "[assignees.w]\ncommand = [\"true\"]\n");
    let socket = d.socket.to_str().unwrap().to_string();
    let with_timeout = |args: &[&str]| {
        let mut cmd = command();
        cmd.env("RUNWARDEN_TIMEOUT", "1s")
            .arg("--socket")
            .arg(&socket)
            .args(args);
        cmd
    };
    let (_follower, lines) = stream_of(with_timeout(&["events", "--follow", "--json"]));
    let sees_created = |id: &str| {
        let mut seen = false;
        wait_until(Duration::from_secs(10), || {
            while let Ok(line) = lines.try_recv() {
                seen |= line.contains("\"kind\":\"created\"")
                    && line.contains(&format!("\"task_id\":{id}"));
            }
            seen
        });
        seen
    };
    // The follower is following before the pause.
    let before = ok(&run(with_timeout(&["add", "before the pause", "-a", "w"])))
        .trim()
        .to_string();
    assert!(sees_created(&before), "the follower never followed");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(d.pid()), Signal::SIGSTOP).unwrap();
    let resume = Resume(d.pid());
    let started = Instant::now();
    let out = run(with_timeout(&["status"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(
        stderr.contains("no answer from the supervisor within 1s")
            && stderr.contains("may still be carried out"),
        "{stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    // A worker's report, which rides out a supervisor that is not listening, gives up the
    // same way on one that accepted it and does not answer: it must not hang the worker.
    let mut heartbeat = with_timeout(&["heartbeat"]);
    heartbeat
        .env("RUNWARDEN_TASK_ID", &before)
        .env("RUNWARDEN_RUN_ID", "1")
        .env("RUNWARDEN_RUN_TOKEN", "not-a-real-token");
    let out = run(heartbeat);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "a worker's report: {stderr}");
    assert!(
        stderr.contains("no answer from the supervisor within 1s"),
        "{stderr}"
    );

    // The follower has been waiting longer than the timeout by now, and waits on.
    drop(resume);
    let added = run(with_timeout(&["add", "after the pause", "-a", "w"]));
    let id = ok(&added).trim().to_string();
    assert!(
        sees_created(&id),
        "the follower stopped following during the pause"
    );
    d.assert_healthy();
}

#[test]
fn a_timeout_that_is_not_a_duration_is_refused() {
    let mut d = Daemon::start("", "");
    let socket = d.socket.to_str().unwrap().to_string();
    // Exit 2, naming the variable.
    let refused = |var: &str, cmd: std::process::Command| {
        let out = run(cmd);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(2), "{var}: {stderr}");
        assert!(
            stderr.contains(var) && stderr.contains("not a duration"),
            "{var}: {stderr}"
        );
    };
    for bad in ["5", "soon", "-1s"] {
        let mut cmd = command();
        cmd.env("RUNWARDEN_TIMEOUT", bad)
            .args(["--socket", &socket, "status"]);
        refused("RUNWARDEN_TIMEOUT", cmd);
    }
    for good in ["0s", "0", "2m", " 30s "] {
        let mut cmd = command();
        cmd.env("RUNWARDEN_TIMEOUT", good)
            .args(["--socket", &socket, "status"]);
        ok(&run(cmd));
    }
    // A worker's reconnect wait likewise: refused at once, not the 60 s default in silence.
    let mut cmd = command();
    cmd.env("RUNWARDEN_CONNECT_WAIT", "a while")
        .env("RUNWARDEN_TASK_ID", "1")
        .env("RUNWARDEN_RUN_ID", "1")
        .env("RUNWARDEN_RUN_TOKEN", "t")
        .args(["--socket", &socket, "heartbeat"]);
    refused("RUNWARDEN_CONNECT_WAIT", cmd);
    // And the followers' (`wait`, `events --follow`): at their start, not at the restart it
    // was meant for.
    let task = ok(&d.cli(&["add", "never settles"])).trim().to_string();
    for args in [vec!["wait", task.as_str()], vec!["events", "--follow"]] {
        let mut cmd = command();
        cmd.env("RUNWARDEN_CONNECT_WAIT", "a while")
            .args(["--socket", &socket])
            .args(&args);
        refused("RUNWARDEN_CONNECT_WAIT", cmd);
    }
    d.assert_healthy();
}
