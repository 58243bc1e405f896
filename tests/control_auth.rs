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
    common::copy_executable(Path::new(bin()), &path);
    chmod(&path, 0o755);
    (dir, path)
}

/// `runwarden status --socket SOCKET` run as `nobody`.
fn status_as_nobody(binary: &Path, socket: &Path) -> std::process::Output {
    as_nobody(binary, socket, &["status", "--json"])
}

/// `runwarden ARGS --socket SOCKET` run as `nobody`.
fn as_nobody(binary: &Path, socket: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(binary);
    scrub_env(&mut cmd);
    cmd.args(args)
        .arg("--socket")
        .arg(socket)
        .uid(NOBODY)
        .gid(NOBODY);
    run(cmd)
}

/// `wait` exits 1 for a task that failed, and only for that: a supervisor it could not ask
/// (refused by the file system or by peer credentials) is 3, as one not running is.
fn assert_wait_unanswered(binary: &Path, socket: &Path) {
    let (code, err) = failed(&as_nobody(
        binary,
        socket,
        &["wait", "1", "--timeout", "5s"],
    ));
    assert_eq!(code, 3, "{err}");
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
    assert_wait_unanswered(&binary, &d.socket);

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
    assert_wait_unanswered(&binary, &d.socket);
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

#[test]
fn a_traversable_data_dir_still_hides_logs_and_work_dirs_from_other_users() {
    // allowed_uids makes the data dir traversable (0711) for the socket; what is inside stays
    // the supervisor's: logs 0700 (files 0600), work 0711 with each task's directory 0700.
    let d = Daemon::start(
        "",
        &format!(
            "[control]\nallowed_uids = [{NOBODY}]\n\n[assignees.w]\n\
             command = [\"sh\", \"-c\", \"echo SECRET-LINE; echo x > note; exec sleep 30\"]\n"
        ),
    );
    chmod(d.dir.path(), 0o755);
    // The first task's directory as an older build left it: open to all, with a file in it.
    let old = d.data_dir.join("work").join("1");
    std::fs::create_dir_all(&old).unwrap();
    chmod(&old, 0o755);
    std::fs::write(old.join("old-note"), "old").unwrap();
    let id = d
        .client()
        .add_task(&NewTask::titled("t").for_assignee("w"))
        .unwrap()
        .id;
    assert_eq!(id, 1);
    let log = d.data_dir.join("logs").join(format!("{id}.log"));
    let work = d.data_dir.join("work").join(id.to_string());
    assert!(wait_until(SETTLE, || std::fs::read_to_string(&log)
        .is_ok_and(|s| s.contains("SECRET-LINE"))
        && work.join("note").exists()));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(
        [
            mode(&d.data_dir),
            mode(&d.data_dir.join("logs")),
            mode(&log),
            mode(&d.data_dir.join("work")),
            mode(&work),
        ],
        [0o711, 0o700, 0o600, 0o711, 0o700]
    );
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(format!(
            "cat {} {}/note {}/old-note; ls {} {}",
            log.display(),
            work.display(),
            work.display(),
            d.data_dir.join("logs").display(),
            work.display()
        ))
        .uid(NOBODY)
        .gid(NOBODY);
    let out = run(cmd);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && stdout.trim().is_empty(),
        "uid {NOBODY} read the supervisor's files: {stdout}"
    );

    // An operator it serves (allowed_uids) reads the log through the socket instead.
    let (_bin_dir, binary) = binary_for_nobody();
    let mut cmd = Command::new(&binary);
    scrub_env(&mut cmd);
    cmd.args(["logs", &id.to_string(), "--socket"])
        .arg(&d.socket)
        .uid(NOBODY)
        .gid(NOBODY);
    let out = ok(&run(cmd));
    assert_eq!(out, "SECRET-LINE\n");
}

/// A process of `nobody` holding `n` connections to `socket` open (connected, silent) until it
/// is dropped, which kills it by its pid and reaps it.
struct HeldConnections {
    pid: libc::pid_t,
}

impl HeldConnections {
    fn open(socket: &Path, n: usize) -> HeldConnections {
        use std::os::unix::ffi::OsStrExt;
        // Everything the child needs is prepared here: between fork and its end it only makes
        // raw system calls (this test process has threads; nothing else is safe there).
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let path = socket.as_os_str().as_bytes();
        assert!(path.len() < addr.sun_path.len(), "socket path too long");
        for (dst, &src) in addr.sun_path.iter_mut().zip(path) {
            *dst = src as libc::c_char;
        }
        let len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
        let mut ready = [0 as libc::c_int; 2];
        assert_eq!(unsafe { libc::pipe(ready.as_mut_ptr()) }, 0);
        // SAFETY: the child calls only async-signal-safe functions and never returns.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            unsafe {
                libc::close(ready[0]);
                let nobody = NOBODY as libc::uid_t;
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setgid(nobody) != 0
                    || libc::setuid(nobody) != 0
                {
                    libc::_exit(2);
                }
                let mut connected: u8 = 0;
                for _ in 0..n {
                    let fd = libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0);
                    if fd >= 0
                        && libc::connect(fd, &addr as *const _ as *const libc::sockaddr, len) == 0
                    {
                        connected += 1;
                    }
                }
                libc::write(ready[1], &connected as *const u8 as *const libc::c_void, 1);
                loop {
                    libc::pause();
                }
            }
        }
        let held = HeldConnections { pid };
        unsafe { libc::close(ready[1]) };
        let mut connected = 0u8;
        let got =
            unsafe { libc::read(ready[0], &mut connected as *mut u8 as *mut libc::c_void, 1) };
        unsafe { libc::close(ready[0]) };
        assert_eq!(
            (got, connected as usize),
            (1, n),
            "nobody could not open its connections"
        );
        held
    }
}

impl Drop for HeldConnections {
    fn drop(&mut self) {
        unsafe {
            libc::kill(self.pid, libc::SIGKILL);
            libc::waitpid(self.pid, std::ptr::null_mut(), 0);
        }
    }
}

#[test]
fn the_assignees_users_cannot_take_the_operators_connection_slots() {
    let (_bin_dir, binary) = binary_for_nobody();
    // `nobody` is an assignee's user: served as a worker only, and only within seven of the
    // eight slots (an eighth is kept for operators).
    let d = Daemon::start(
        "",
        "[control]\nmax_connections = 8\nidle_timeout = \"1m\"\n\n\
         [assignees.other]\ncommand = [\"true\"]\nuser = \"nobody\"\n",
    );
    chmod(d.dir.path(), 0o755);
    let hog = HeldConnections::open(&d.socket, 7);
    // The server counts a connection once it has accepted it.
    let mut refused = String::new();
    assert!(
        wait_until(SETTLE, || {
            let out = status_as_nobody(&binary, &d.socket);
            refused = String::from_utf8_lossy(&out.stderr).into_owned();
            !out.status.success()
        }),
        "an eighth connection of nobody was served"
    );
    assert!(
        refused.contains("too_many_connections") && refused.contains("kept for operators"),
        "{refused}"
    );
    // The operator is still served.
    let status: serde_json::Value =
        serde_json::from_str(&ok(&d.cli(&["status", "--json"]))).unwrap();
    assert_eq!(status["pid"], d.pid());
    // Once they are closed, nobody's connections are taken again (and then its request is
    // judged by its role: a worker's user may not ask for the status).
    drop(hog);
    assert!(
        wait_until(SETTLE, || {
            let out = status_as_nobody(&binary, &d.socket);
            refused = String::from_utf8_lossy(&out.stderr).into_owned();
            !refused.contains("too_many_connections")
        }),
        "the worker slots were not freed: {refused}"
    );
    assert!(refused.contains("unauthorized"), "{refused}");
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

#[test]
fn a_data_dir_others_may_write_in_is_refused_unless_it_can_be_made_private() {
    // The supervisor runs as `nobody` on a data dir it owns, whose `logs/` someone else (root)
    // prepared writable for everyone: it cannot make it private, and another user could put a
    // link in a log's place there. It refuses to start, saying which directory and why.
    let (_bin_dir, binary) = binary_for_nobody();
    let dir = tempfile::tempdir().unwrap();
    chmod(dir.path(), 0o755);
    let data = dir.path().join("data");
    std::fs::create_dir_all(data.join("logs")).unwrap();
    std::os::unix::fs::chown(&data, Some(NOBODY), Some(NOBODY)).unwrap();
    chmod(&data.join("logs"), 0o1777);
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "[supervisor]\ndata_dir = {:?}\n\n[assignees.w]\ncommand = [\"true\"]\n",
            data.display().to_string()
        ),
    )
    .unwrap();
    let mut cmd = Command::new(&binary);
    scrub_env(&mut cmd);
    cmd.arg("--config")
        .arg(&config)
        .arg("serve")
        .uid(NOBODY)
        .gid(NOBODY);
    let (code, err) = failed(&run(cmd));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&data.join("logs").display().to_string())
            && err.contains("writable by others"),
        "{err}"
    );
    // Once root has made it the supervisor's, it starts.
    std::os::unix::fs::chown(data.join("logs"), Some(NOBODY), Some(NOBODY)).unwrap();
    let mut cmd = Command::new(&binary);
    scrub_env(&mut cmd);
    cmd.arg("--config")
        .arg(&config)
        .arg("serve")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .uid(NOBODY)
        .gid(NOBODY);
    let mut serve = common::proc_guard::ChildGuard::spawn(&mut cmd).unwrap();
    let socket = runwarden::config::Config::load(&config)
        .unwrap()
        .socket_path();
    assert!(
        wait_until(SETTLE, || runwarden::control::client::Client::connect(
            &socket
        )
        .is_ok_and(|mut c| c.hello().is_ok() && c.shutdown().is_ok())),
        "serve did not start: {:?}",
        serve.try_wait()
    );
    assert!(
        wait_until(SETTLE, || serve.try_wait().ok().flatten().is_some()),
        "serve did not stop"
    );
    let mode = std::fs::metadata(data.join("logs"))
        .unwrap()
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o700);
}

/// A second `serve` on the same data dir is refused by the lock — and, refused, changes
/// nothing: with a config that serves no other user, it must not narrow the running
/// supervisor's 0711 data dir to 0700 (its `allowed_uids` would lose the socket).
#[test]
fn a_start_refused_by_the_lock_leaves_the_running_supervisors_modes_alone() {
    let d = Daemon::start("", &format!("[control]\nallowed_uids = [{NOBODY}]\n"));
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d.data_dir), 0o711);
    let second = d.dir.path().join("second.toml");
    std::fs::write(
        &second,
        format!(
            "[supervisor]\ndata_dir = {:?}\n",
            d.data_dir.display().to_string()
        ),
    )
    .unwrap();
    let stderr = d.dir.path().join("second.stderr");
    let mut refused = Daemon::spawn_serve(&second, &stderr);
    assert!(
        refused.pidfd().wait_exit(SETTLE).unwrap_or(false),
        "the second serve kept running"
    );
    let status = refused.0.wait().expect("wait");
    let said = std::fs::read_to_string(&stderr).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(said.contains("lock"), "{said}");
    assert_eq!(
        mode(&d.data_dir),
        0o711,
        "the refused start changed the data dir"
    );
}

/// A socket in a directory of its own inside the data dir still gets the traversal
/// `allowed_uids` need, through the data dir too (a fresh data dir is 0700).
#[test]
fn a_socket_in_a_subdirectory_of_the_data_dir_is_reachable_for_allowed_uids() {
    let d = Daemon::start(
        "socket = \"data/sock/control.sock\"",
        &format!("[control]\nallowed_uids = [{NOBODY}]\n"),
    );
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(d.socket, d.data_dir.join("sock").join("control.sock"));
    assert_eq!(mode(&d.data_dir), 0o711, "the data dir");
    assert_eq!(
        mode(&d.data_dir.join("sock")),
        0o711,
        "the socket's directory"
    );
    assert_eq!(mode(&d.socket), 0o666);
}
