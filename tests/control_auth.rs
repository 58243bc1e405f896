//! Who may use the control socket, and who may act on a run.
//!
//! - Another uid (`nobody`) is stopped by the file system first (the socket is 0600 in a 0700
//!   directory: `connect` fails with EACCES); with those modes loosened it reaches the server,
//!   whose `SO_PEERCRED` check answers `unauthorized` and closes. A uid in `allowed_uids` is
//!   served.
//! - A worker's token acts on its own run only: never on another task's run, and never again
//!   after its run was reclaimed (`stale_run`).

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::control_daemon::{Daemon, SETTLE, bin, command, failed, ok, run, scrub_env};
use common::proc_guard::wait_until;
use runwarden::board::{NewTask, TaskStatus};
use runwarden::control::protocol::{Block, Complete, Heartbeat};

const NOBODY: u32 = 65534;

fn chmod(path: &Path, mode: u32) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// A copy of the binary that `nobody` can execute wherever the build directory is.
fn binary_for_nobody() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o755);
    let path = dir.path().join("runwarden");
    std::fs::copy(bin(), &path).unwrap();
    chmod(&path, 0o755);
    (dir, path)
}

/// `runwarden status --socket SOCKET` run as `nobody`.
fn status_as_nobody(binary: &Path, socket: &Path) -> std::process::Output {
    let mut cmd = Command::new(binary);
    scrub_env(&mut cmd);
    cmd.args(["status", "--json", "--socket"])
        .arg(socket)
        .uid(NOBODY)
        .gid(NOBODY);
    run(cmd)
}

#[test]
fn another_uid_is_refused_by_the_file_system_then_by_peer_credentials() {
    let (_bin_dir, binary) = binary_for_nobody();
    let mut d = Daemon::start("", "");
    // The temp dir itself is 0700; open it so only the socket's own directory decides.
    chmod(d.dir.path(), 0o755);

    // Layer 1, the file system: 0700 directory, 0600 socket. The kernel refuses the connect.
    let (code, err) = failed(&status_as_nobody(&binary, &d.socket));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("permission denied"),
        "refused by the file system: {err}"
    );
    assert!(
        !d.stderr_text().contains("refused a peer uid"),
        "the server never saw it"
    );

    // Layer 2, SO_PEERCRED: with the modes loosened the connection reaches the server, which
    // answers `unauthorized` (one line) and closes.
    chmod(&d.data_dir, 0o711);
    chmod(&d.socket, 0o666);
    let (code, err) = failed(&status_as_nobody(&binary, &d.socket));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("uid 65534 may not use this socket") && err.contains("unauthorized"),
        "{err}"
    );
    assert!(
        wait_until(SETTLE, || d.stderr_text().contains("refused a peer uid")),
        "the refusal is logged"
    );
    // Root (the test) is still served.
    d.client().status().unwrap();
    d.assert_healthy();
}

#[test]
fn a_uid_in_allowed_uids_is_served() {
    let (_bin_dir, binary) = binary_for_nobody();
    let d = Daemon::start("", &format!("[control]\nallowed_uids = [{NOBODY}]\n"));
    // With allowed_uids the supervisor itself opens the way (directory 0711, socket 0666)
    // and relies on the peer-uid check; only the test's own temp dir needs opening.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!((mode(&d.data_dir), mode(&d.socket)), (0o711, 0o666));
    chmod(d.dir.path(), 0o755);
    let out = status_as_nobody(&binary, &d.socket);
    let status: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(status["pid"], d.pid());
}

/// A worker that saves its environment (atomically) in its working directory, then waits.
const HOLDER: &str = r#"
[assignees.hold]
command = ["sh", "-c", "env | grep ^RUNWARDEN_ > env.tmp && mv env.tmp env && exec sleep 60"]
max_in_progress = 4
"#;

/// The RUNWARDEN_* environment a running task's worker got.
fn worker_env(d: &Daemon, task: i64) -> BTreeMap<String, String> {
    let path = d.data_dir.join("work").join(task.to_string()).join("env");
    assert!(
        wait_until(SETTLE, || path.exists()),
        "worker of task {task} never started"
    );
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn run_and_token(env: &BTreeMap<String, String>) -> (i64, String) {
    (
        env["RUNWARDEN_RUN_ID"].parse().unwrap(),
        env["RUNWARDEN_RUN_TOKEN"].clone(),
    )
}

/// `runwarden ARGS…` with exactly a worker's environment (no --socket, no config).
fn as_worker(env: &BTreeMap<String, String>, args: &[&str]) -> std::process::Output {
    let mut cmd = command();
    cmd.args(args).envs(env);
    run(cmd)
}

#[test]
fn a_token_acts_on_its_own_run_only_and_not_after_a_reclaim() {
    let d = Daemon::start("", HOLDER);
    let mut c = d.client();
    let a = c
        .add_task(&NewTask::titled("a").for_assignee("hold"))
        .unwrap()
        .id;
    let b = c
        .add_task(&NewTask::titled("b").for_assignee("hold"))
        .unwrap()
        .id;
    let env_a = worker_env(&d, a);
    let env_b = worker_env(&d, b);
    let (run_a, token_a) = run_and_token(&env_a);
    let (run_b, _) = run_and_token(&env_b);

    // A's token on B's task, with A's run or with B's run: refused.
    for run in [run_a, run_b] {
        let err = c
            .complete(Complete {
                task: b,
                run: Some(run),
                token: Some(token_a.clone()),
                ..Complete::default()
            })
            .unwrap_err();
        assert_eq!(err.code(), Some("unauthorized"), "{err}");
    }
    let err = c
        .heartbeat(Heartbeat {
            task: b,
            run: run_b,
            token: token_a.clone(),
            note: None,
        })
        .unwrap_err();
    assert_eq!(err.code(), Some("unauthorized"), "{err}");
    let err = c
        .block(Block {
            task: b,
            run: Some(run_b),
            token: Some(token_a.clone()),
            reason: "mine now".into(),
            force: false,
        })
        .unwrap_err();
    assert_eq!(err.code(), Some("unauthorized"), "{err}");

    // An operator (no token) may not close a run whose worker is alive…
    let err = c
        .complete(Complete {
            task: a,
            ..Complete::default()
        })
        .unwrap_err();
    assert_eq!(err.code(), Some("conflict"), "{err}");
    assert!(err.to_string().contains("alive"), "{err}");
    assert_eq!(
        c.show_task(b, None).unwrap().task.status,
        TaskStatus::Running
    );

    // …but the worker itself may, with nothing but its environment (no --socket, no config).
    ok(&as_worker(&env_a, &["heartbeat", "--note", "still here"]));
    let out = ok(&as_worker(&env_a, &["complete", "--result", "mine"]));
    assert!(out.contains("done"), "{out}");
    let detail = c.show_task(a, None).unwrap();
    assert_eq!(detail.task.status, TaskStatus::Done);
    assert_eq!(detail.task.result.as_deref(), Some("mine"));
    assert!(detail.runs[0].heartbeat_at.is_some());
    // Its run is closed: the same token is now stale.
    let (code, err) = failed(&as_worker(&env_a, &["heartbeat"]));
    assert_eq!(code, 1);
    assert!(err.contains("stale_run"), "{err}");

    // Reclaim B: its run closes, its worker is ended, the task runs again with a new run.
    c.reclaim(b, Some("test".into())).unwrap();
    let old_b = env_b.clone();
    assert!(wait_until(SETTLE, || {
        let d = c.show_task(b, None).unwrap();
        d.runs.len() == 2 && d.runs[1].spawned_pid.is_some()
    }));
    for args in [
        &["heartbeat"][..],
        &["complete", "--result", "late"],
        &["block", "too late"],
    ] {
        let (code, err) = failed(&as_worker(&old_b, args));
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains("stale_run"), "{args:?}: {err}");
    }
    assert_eq!(
        c.show_task(b, None).unwrap().task.status,
        TaskStatus::Running
    );
    // The operator may force it.
    let t = c
        .block(Block {
            task: b,
            reason: "enough".into(),
            force: true,
            ..Block::default()
        })
        .unwrap();
    assert_eq!(t.status, TaskStatus::Blocked);
}
