//! `wait` and `events --follow` ride out a supervisor restart: they reach the new supervisor
//! and go on — `wait` from the tasks' statuses as they are then, `events --follow` after the
//! last event it printed, none missed or printed twice; also when the supervisor they first
//! reach is already stopping (it closes during the hello). One that cannot reach a supervisor
//! again within `RUNWARDEN_CONNECT_WAIT` exits 3, a code of its own (1 is `wait`'s "a task
//! ended blocked or archived").

#[allow(dead_code)]
mod common;

use std::fs;
use std::process::{Command, Stdio};

use common::control_daemon::{Daemon, command, exit_code, ok, spawn_connected, stream_of};
use common::proc_guard::{ChildGuard, wait_until};
use common::runtime::SETTLE;

/// `runwarden ARGS` against the daemon's socket, riding out a restart for up to 30 s
/// (`RUNWARDEN_CONNECT_WAIT`).
fn cli_for(d: &Daemon, args: &[&str]) -> Command {
    let mut cmd = command();
    cmd.env("RUNWARDEN_CONNECT_WAIT", "30s")
        .arg("--socket")
        .arg(&d.socket)
        .args(args);
    cmd
}

/// `runwarden ARGS` against the daemon's socket (`RUNWARDEN_CONNECT_WAIT` = `wait`), stderr
/// into `stderr`, stdout discarded; returned once it has connected.
fn connected_cli(d: &Daemon, args: &[&str], stderr: &std::path::Path, wait: &str) -> ChildGuard {
    let mut cmd = cli_for(d, args);
    cmd.env("RUNWARDEN_CONNECT_WAIT", wait)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(stderr).unwrap());
    spawn_connected(&mut cmd)
}

/// Asserts that `child` exits with `code`, showing what it said on `stderr` if not.
fn assert_exits(child: &mut ChildGuard, code: i32, stderr: &std::path::Path) {
    assert_eq!(
        exit_code(child),
        Some(code),
        "{}",
        fs::read_to_string(stderr).unwrap_or_default()
    );
}

#[test]
fn wait_and_follow_go_on_across_a_supervisor_restart() {
    let mut d = Daemon::start("", "");
    // No assignee: it stays ready until an operator completes it.
    let task = ok(&d.cli(&["add", "waited for"])).trim().to_string();
    let wait_err = d.dir.path().join("wait.stderr");
    let mut waiting = connected_cli(&d, &["wait", &task], &wait_err, "30s");
    let follow = cli_for(&d, &["events", "--follow", "--json"]);
    let (_follower, lines) = stream_of(follow);
    let mut seen: Vec<serde_json::Value> = Vec::new();
    let saw = |title: &str, seen: &mut Vec<serde_json::Value>| {
        wait_until(SETTLE, || {
            while let Ok(line) = lines.try_recv() {
                seen.push(serde_json::from_str(&line).expect("an event as JSON"));
            }
            seen.iter()
                .any(|ev| ev["kind"] == "created" && ev["payload"]["title"] == title)
        })
    };
    assert!(saw("waited for", &mut seen), "the follower never followed");

    d.restart();

    // Both are back on the new supervisor: the follower prints what happens now, and the wait
    // ends on the completion.
    ok(&d.cli(&["add", "after the restart"]));
    assert!(
        saw("after the restart", &mut seen),
        "the follower did not go on after the restart: {seen:?}"
    );
    ok(&d.cli(&["complete", &task, "--force"]));
    assert_exits(&mut waiting, 0, &wait_err);
    let said = fs::read_to_string(&wait_err).unwrap();
    assert!(said.contains("lost the supervisor"), "{said}");
    // Not one event twice, none out of order.
    let ids: Vec<i64> = seen.iter().map(|ev| ev["id"].as_i64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    d.assert_healthy();
}

#[test]
fn a_wait_whose_supervisor_does_not_come_back_exits_3() {
    let mut d = Daemon::start("", "");
    let task = ok(&d.cli(&["add", "never done"])).trim().to_string();
    let wait_err = d.dir.path().join("wait.stderr");
    let mut waiting = connected_cli(&d, &["wait", &task], &wait_err, "1s");
    d.stop();
    assert_exits(&mut waiting, 3, &wait_err);
    let said = fs::read_to_string(&wait_err).unwrap();
    assert!(
        said.contains("lost the supervisor") && said.contains("could not reach it again"),
        "{said}"
    );
    // A timeout that passes while it is reconnecting is still a timeout (124).
    let mut d = Daemon::start("", "");
    let task = ok(&d.cli(&["add", "never done"])).trim().to_string();
    let err = d.dir.path().join("wait2.stderr");
    let mut timed = connected_cli(&d, &["wait", &task, "--timeout", "1s"], &err, "30s");
    d.stop();
    assert_exits(&mut timed, 124, &err);
}

#[test]
fn wait_and_follow_whose_first_hello_meets_a_stopping_supervisor_ride_it_out() {
    let mut d = Daemon::start("", "");
    let task = ok(&d.cli(&["add", "waited for"])).trim().to_string();
    d.stop();
    // A supervisor on its way out: it accepts each connection, then closes it before the
    // hello is answered — until both clients have met it (they may come back meanwhile).
    // A stand-in on the socket path: the real one's window is too short to hit on purpose.
    let listener = std::os::unix::net::UnixListener::bind(&d.socket).expect("bind the socket");
    let (peer_tx, peers) = std::sync::mpsc::channel();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopping = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let (conn, _) = listener.accept().expect("accept a client");
                let cred =
                    nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::PeerCredentials);
                drop(conn);
                let _ = peer_tx.send(cred.map(|c| c.pid()).unwrap_or(0));
            }
            // The listener goes with the thread: nothing listens until the new supervisor.
        })
    };
    let follow = cli_for(&d, &["events", "--follow", "--json"]);
    let (mut follower, lines) = stream_of(follow);
    let wait_err = d.dir.path().join("wait.stderr");
    let mut wait = cli_for(&d, &["wait", &task]);
    wait.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&wait_err).unwrap());
    let mut waiting = ChildGuard::spawn(&mut wait).expect("spawn runwarden wait");
    let mut met = std::collections::HashSet::new();
    let both = wait_until(SETTLE, || {
        met.extend(peers.try_iter());
        met.contains(&follower.pid()) && met.contains(&waiting.pid())
    });
    assert!(
        both,
        "not both clients reached the stopping supervisor: {met:?}"
    );
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    // Wakes the accept so the thread sees `stop` (or a client's retry does).
    let _ = std::os::unix::net::UnixStream::connect(&d.socket);
    stopping.join().unwrap();
    fs::remove_file(&d.socket).expect("remove the stand-in's socket");

    d.restart();
    ok(&d.cli(&["add", "after the first hello"]));
    let mut seen: Vec<serde_json::Value> = Vec::new();
    let saw = wait_until(SETTLE, || {
        while let Ok(line) = lines.try_recv() {
            seen.push(serde_json::from_str(&line).expect("an event as JSON"));
        }
        seen.iter()
            .any(|ev| ev["kind"] == "created" && ev["payload"]["title"] == "after the first hello")
    });
    assert!(
        saw,
        "the follower gave up at its first hello (exit {:?}): {seen:?}",
        follower.try_wait().ok().flatten()
    );
    ok(&d.cli(&["complete", &task, "--force"]));
    assert_exits(&mut waiting, 0, &wait_err);
    d.assert_healthy();
}

/// A task `wait` saw done, pruned by retention while the supervisor restarted, finished as
/// seen: `wait` goes on for the others instead of calling it a task that does not exist.
#[test]
fn a_task_seen_done_and_pruned_across_a_restart_stays_done_for_wait() {
    let mut d = Daemon::start("", "[retention]\nfinished = \"1s\"\n");
    let first = ok(&d.cli(&["add", "done early"])).trim().to_string();
    let second = ok(&d.cli(&["add", "done later"])).trim().to_string();
    let wait_err = d.dir.path().join("wait.stderr");
    let mut waiting = connected_cli(&d, &["wait", &first, &second], &wait_err, "30s");
    // Done while `wait` follows (so it has seen it: retention may prune it a second later).
    ok(&d.cli(&["complete", &first, "--force"]));
    assert!(
        wait_until(SETTLE, || !d.cli(&["show", &first]).status.success()),
        "retention never pruned task {first}"
    );
    d.restart();
    ok(&d.cli(&["complete", &second, "--force"]));
    assert_exits(&mut waiting, 0, &wait_err);
    d.assert_healthy();
}
