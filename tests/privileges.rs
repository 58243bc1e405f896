//! Worker privileges with the real `runwarden serve` (running as root): `user = "nobody"` runs
//! the worker as uid/gid 65534 without root's supplementary groups, `umask = "077"` applies to
//! what it creates, `rlimits = { nofile = 64 }` applies (`ulimit -n` prints 64), and an unknown
//! user — or one a supervisor that is not root cannot switch to — is a configuration error when
//! `serve` starts (exit 2, naming `user`), not a failure at every spawn.

#[allow(dead_code)]
mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

use common::lifecycle::{Db, View};
use common::runtime::{SETTLE, Serve, TestDir};
use runwarden::board::{NewTask, TaskId, TaskStatus, now_millis};
use runwarden::process::Signal;

const NOBODY: u32 = 65534;

/// Runs one task of assignee `w` (configured by `assignee_keys`, command `sh -c script`) under
/// `runwarden serve` until it is done; returns its log and its working directory.
fn run_one(td: &TestDir, assignee_keys: &str, script: &str) -> (String, PathBuf) {
    run_one_with(td, "", assignee_keys, script)
}

/// [`run_one`] with `supervisor_keys` added to `[supervisor]`.
fn run_one_with(
    td: &TestDir,
    supervisor_keys: &str,
    assignee_keys: &str,
    script: &str,
) -> (String, PathBuf) {
    let config = td.write_config(
        &format!("tick = \"100ms\"\n{supervisor_keys}"),
        &format!("[assignees.w]\ncommand = [\"sh\", \"-c\", {script:?}]\n{assignee_keys}\n"),
    );
    fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let task: TaskId = db.write(|tx| {
        Ok(tx
            .create_task(
                &NewTask::titled("privileged").for_assignee("w"),
                now_millis(),
            )?
            .id)
    });
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let done = {
        let mut found = None;
        common::proc_guard::wait_until(SETTLE, || {
            let t = db.get_task(task);
            // A spawn failure ends the wait at once (its retry would only fail again).
            let spawn_failed = db
                .events_of(task, "run_closed")
                .iter()
                .any(|e| e.payload["outcome"] == "spawn_failed");
            let end = spawn_failed || matches!(t.status, TaskStatus::Done | TaskStatus::Blocked);
            found = end.then_some(t);
            end
        });
        found
    };
    let log_path = td.data_dir().join("logs").join(format!("{task}.log"));
    let log = fs::read_to_string(&log_path).unwrap_or_default();
    let done = done.unwrap_or_else(|| {
        panic!(
            "task not finished\n{}\n{}",
            db.history(task),
            serve.stderr()
        )
    });
    assert_eq!(
        done.status,
        TaskStatus::Done,
        "log: {log}\n{}\n{}",
        db.history(task),
        serve.stderr()
    );
    serve.stop_cleanly(Signal::SIGTERM);
    (log, td.data_dir().join("work").join(task.to_string()))
}

fn lines(log: &str) -> Vec<&str> {
    log.lines().map(str::trim).collect()
}

#[test]
fn user_nobody_runs_the_worker_as_uid_65534() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root to drop privileges"
    );
    let td = TestDir::new();
    // A working directory nobody can use, on a path nobody can traverse (the tempdir is 0700).
    fs::set_permissions(td.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let cwd = td.path().join("shared");
    fs::create_dir(&cwd).unwrap();
    fs::set_permissions(&cwd, fs::Permissions::from_mode(0o777)).unwrap();
    let (log, _) = run_one(
        &td,
        &format!("user = \"nobody\"\ncwd = {:?}", cwd.display().to_string()),
        "id -u; id -g; id -G; echo mine > by-worker",
    );
    assert_eq!(
        lines(&log),
        ["65534", "65534", "65534"],
        "uid, gid, groups: {log}"
    );
    let meta = fs::metadata(cwd.join("by-worker")).expect("the worker wrote its file");
    assert_eq!((meta.uid(), meta.gid()), (NOBODY, NOBODY));
}

/// The default working directory (`<data_dir>/work/<task>`, handed to the worker's user) must
/// be reachable by that user: a supervisor that keeps its data dir private (0700) must still
/// let its workers traverse it.
#[test]
fn user_nobody_works_in_its_default_working_directory() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root to drop privileges"
    );
    let td = TestDir::new();
    fs::set_permissions(td.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let (log, cwd) = run_one(
        &td,
        "user = \"nobody\"",
        "id -u; pwd; echo mine > by-worker",
    );
    assert_eq!(lines(&log), ["65534", cwd.to_str().unwrap()], "{log}");
    let meta = fs::metadata(cwd.join("by-worker")).expect("the worker wrote its file");
    assert_eq!(meta.uid(), NOBODY);
}

/// A data dir left 0700 by an earlier start, with the socket now elsewhere: a worker of
/// another user must still reach its `work/<id>` through it (traversal, nothing more).
#[test]
fn user_nobody_reaches_its_work_dir_when_the_socket_is_elsewhere() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root to drop privileges"
    );
    let td = TestDir::new();
    fs::set_permissions(td.path(), fs::Permissions::from_mode(0o755)).unwrap();
    fs::create_dir_all(td.data_dir()).unwrap();
    fs::set_permissions(td.data_dir(), fs::Permissions::from_mode(0o700)).unwrap();
    let sockets = td.path().join("sockets");
    let (log, cwd) = run_one_with(
        &td,
        &format!("socket = {:?}", sockets.join("s.sock")),
        "user = \"nobody\"",
        "id -u; pwd",
    );
    assert_eq!(lines(&log), ["65534", cwd.to_str().unwrap()], "{log}");
    let mode = fs::metadata(td.data_dir()).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        mode, 0o711,
        "traversable by the worker's user, nothing more"
    );
}

/// A worker that runs as another user reports over the control socket (its user may connect,
/// for its own run only): heartbeat and complete work; an operator's op is refused.
#[test]
fn a_worker_running_as_nobody_reports_its_own_run_and_nothing_else() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root to drop privileges"
    );
    let td = TestDir::new();
    fs::set_permissions(td.path(), fs::Permissions::from_mode(0o755)).unwrap();
    // The CLI where nobody can run it, whatever the permissions of the build directory.
    let bin = td.path().join("bin");
    fs::create_dir(&bin).unwrap();
    common::copy_executable(
        std::path::Path::new(common::lifecycle::RUNWARDEN),
        &bin.join("runwarden"),
    );
    fs::set_permissions(&bin, fs::Permissions::from_mode(0o755)).unwrap();
    let path = format!("{}:/usr/bin:/bin", bin.display());
    let (log, _) = run_one(
        &td,
        &format!("user = \"nobody\"\nenv = {{ PATH = {path:?} }}"),
        "runwarden ls; echo \"ls exit $?\"; \
         runwarden heartbeat --note nobody && runwarden complete --result 'as nobody'",
    );
    assert!(
        log.contains("ls exit 1"),
        "an operator's op is refused: {log}"
    );
    assert!(
        log.contains("may only report on its own run"),
        "and says why: {log}"
    );
    let mut db = Db::new(td.db_path());
    let task = db.all_events()[0].task_id.expect("the task");
    assert_eq!(db.get_task(task).result.as_deref(), Some("as nobody"));
    let beats = db.events_of(task, "heartbeat");
    assert_eq!(beats.len(), 1, "{}", db.history(task));
    // Completed by the report (an exit 0 would have left no result), once.
    let completed = db.events_of(task, "completed");
    assert_eq!(completed.len(), 1, "{}", db.history(task));
    assert_eq!(completed[0].payload["result"], "as nobody");
}

#[test]
fn umask_077_applies_to_what_the_worker_creates() {
    let td = TestDir::new();
    let (log, cwd) = run_one(&td, "umask = \"077\"", "umask; touch file; mkdir dir");
    assert_eq!(lines(&log), ["0077"], "{log}");
    let mode = |name: &str| {
        fs::metadata(cwd.join(name))
            .expect(name)
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode("file"), 0o600, "a file it creates");
    assert_eq!(mode("dir"), 0o700, "a directory it creates");
}

#[test]
fn rlimits_nofile_64_applies() {
    let td = TestDir::new();
    let (log, _) = run_one(&td, "rlimits = { nofile = 64 }", "ulimit -n; ulimit -Hn");
    assert_eq!(lines(&log), ["64", "64"], "soft and hard: {log}");
}

#[test]
fn an_unknown_user_is_a_config_error_at_start() {
    let td = TestDir::new();
    let config = td.write_config(
        "",
        "[assignees.w]\ncommand = [\"true\"]\nuser = \"no-such-user-rw\"\n",
    );
    let mut serve = Serve::start(&config, "serve");
    let status = serve.wait_exit(SETTLE).unwrap_or_else(|| {
        panic!(
            "serve kept running with an unknown user; stderr:\n{}",
            serve.stderr()
        )
    });
    let stderr = serve.stderr();
    assert_eq!(
        status.code(),
        Some(2),
        "a configuration error exits 2: {stderr}"
    );
    assert!(stderr.contains("user"), "names the key: {stderr}");
    assert!(
        stderr.contains("no-such-user-rw"),
        "names the value: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!td.db_path().exists(), "refused before opening any board");
}

/// A supervisor that is not root cannot run a worker as another user: refused at start as the
/// config's mistake (exit 2), naming the assignee's `user` key, before any board is made.
#[test]
fn a_user_a_non_root_supervisor_cannot_switch_to_is_a_config_error_at_start() {
    use std::os::unix::process::CommandExt;
    let td = TestDir::new();
    // `nobody` reads the config and the binary's copy, and may create the data dir.
    fs::set_permissions(td.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let binary = td.path().join("runwarden");
    common::copy_executable(
        std::path::Path::new(env!("CARGO_BIN_EXE_runwarden")),
        &binary,
    );
    let config = td.write_config("", "[assignees.w]\ncommand = [\"true\"]\nuser = \"root\"\n");
    fs::set_permissions(&config, fs::Permissions::from_mode(0o644)).unwrap();
    let mut cmd = std::process::Command::new(&binary);
    common::control_daemon::scrub_env(&mut cmd);
    cmd.arg("serve")
        .arg("--config")
        .arg(&config)
        .uid(NOBODY)
        .gid(NOBODY); // std drops root's supplementary groups with the uid
    let out = common::control_daemon::run(cmd);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(2),
        "a configuration error exits 2: {stderr}"
    );
    assert!(
        stderr.contains("[assignees.w] user") && stderr.contains("needs root"),
        "names the key and why: {stderr}"
    );
    assert!(!td.data_dir().exists(), "refused before making a data dir");
}
