//! Helpers for the runtime tests: a data dir whose workers are always ended (by pid, through a
//! pidfd verified against the fingerprint the board recorded), a guarded `runwarden serve`
//! child, worker guards, and board / `/proc` probes. Every wait is a bounded poll.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use runwarden::board::{Board, Event, OpenOptions, Run, TaskId};
use runwarden::process::{
    self, Fingerprint, Liveness, Pid, PidFd, ProcStat, Signal, Verified, open_verified, read_stat,
};
use tempfile::TempDir;

use super::proc_guard::{ChildGuard, wait_until};

/// Generous bound for anything to happen; every wait polls and returns as soon as it can.
pub const SETTLE: Duration = Duration::from_secs(10);

/// A temporary data dir. On drop — after the test, passed or failed — every worker any
/// supervisor recorded in its board (`worker_spawned` events: pid + fingerprint) that is still
/// that same process is SIGKILLed with its group, through a pidfd verified against the
/// fingerprint; only then is the directory removed.
pub struct TestDir {
    pub dir: TempDir,
}

impl TestDir {
    pub fn new() -> Self {
        TestDir {
            dir: tempfile::tempdir().expect("create a temporary directory"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// `<dir>/data`: the supervisor's data dir.
    pub fn data_dir(&self) -> PathBuf {
        self.path().join("data")
    }

    pub fn db_path(&self) -> PathBuf {
        self.data_dir().join("board.db")
    }

    pub fn lock_path(&self) -> PathBuf {
        self.data_dir().join("supervisor.lock")
    }

    pub fn socket_path(&self) -> PathBuf {
        self.data_dir().join("control.sock")
    }

    /// Writes `config.toml` in the dir: `[supervisor] data_dir = <data dir>` followed by
    /// `supervisor_keys` (more `[supervisor]` lines), then `rest` (other tables).
    pub fn write_config(&self, supervisor_keys: &str, rest: &str) -> PathBuf {
        let path = self.path().join("config.toml");
        let text = format!(
            "[supervisor]\ndata_dir = {:?}\n{supervisor_keys}\n\n{rest}\n",
            self.data_dir().display().to_string()
        );
        fs::write(&path, text).expect("write config.toml");
        path
    }
}

impl Default for TestDir {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        kill_recorded_workers(&self.db_path());
    }
}

/// Opens the board at `db` without writing to it (read-only connection).
pub fn open_ro(db: &Path) -> Board {
    Board::open_with(
        db,
        OpenOptions {
            synchronous_full: true,
            read_only: true,
        },
    )
    .unwrap_or_else(|e| panic!("open {} read-only: {e}", db.display()))
}

/// Every event of the board, oldest first.
pub fn all_events(board: &mut Board) -> Vec<Event> {
    board
        .read(|tx| tx.events_since(0, 1_000_000))
        .expect("events_since")
}

/// (pid, fingerprint) of every `worker_spawned` event that carries a full fingerprint.
pub fn spawned_workers(events: &[Event]) -> Vec<(Pid, Fingerprint)> {
    events
        .iter()
        .filter(|e| e.kind == "worker_spawned")
        .filter_map(worker_identity)
        .collect()
}

/// The pid and fingerprint a `worker_spawned` event records.
pub fn worker_identity(ev: &Event) -> Option<(Pid, Fingerprint)> {
    let p = &ev.payload;
    Some((
        Pid::try_from(p.get("pid")?.as_i64()?).ok()?,
        Fingerprint {
            boot_id: p.get("boot_id")?.as_str()?.to_string(),
            start_ticks: p.get("start_ticks")?.as_u64()?,
            pidfs_ino: p.get("pidfs_ino").and_then(|v| v.as_u64()),
        },
    ))
}

/// Waits for the first event of `kind` on task `id` under the library supervisor `sup` (fails
/// the test after [`SETTLE`]).
pub fn wait_event(sup: &runwarden::SupervisorHandle, id: TaskId, kind: &str) -> Event {
    let mut found = None;
    assert!(
        wait_until(SETTLE, || {
            found = sup
                .task(id)
                .expect("task detail")
                .events
                .into_iter()
                .find(|e| e.kind == kind);
            found.is_some()
        }),
        "no {kind} event on task {id}: {:?}",
        sup.task(id)
    );
    found.unwrap()
}

/// Waits for task `id`'s first worker under the library supervisor `sup`: its pid and
/// fingerprint.
pub fn wait_worker(sup: &runwarden::SupervisorHandle, id: TaskId) -> (Pid, Fingerprint) {
    let ev = wait_event(sup, id, "worker_spawned");
    worker_identity(&ev).unwrap_or_else(|| panic!("no pid and fingerprint in {ev:?}"))
}

/// Adds a task for `who` straight into the board file at `db` (a running `serve` picks it up
/// on its tick).
pub fn add_to_board(db: &Path, who: &str) -> TaskId {
    let mut board = Board::open(db).expect("open the board");
    board
        .write(|tx| {
            tx.create_task(
                &runwarden::board::NewTask::titled(who).for_assignee(who),
                runwarden::board::now_millis(),
            )
        })
        .expect("create task")
        .id
}

/// Waits for task `id`'s first worker as recorded in the board file at `db`.
pub fn wait_worker_in_board(db: &Path, id: TaskId) -> (Pid, Fingerprint) {
    poll_board(db, "the worker to be spawned", |b| {
        task_event(b, id, "worker_spawned").and_then(|e| worker_identity(&e))
    })
}

/// SIGKILLs (group and process) every recorded worker still provably alive. Best effort: a
/// board that cannot be read has no workers to find.
pub fn kill_recorded_workers(db: &Path) {
    if !db.exists() {
        return;
    }
    let Ok(mut board) = Board::open_with(
        db,
        OpenOptions {
            synchronous_full: false,
            read_only: true,
        },
    )
    .or_else(|_| Board::open(db)) else {
        return;
    };
    let Ok(events) = board.read(|tx| tx.events_since(0, 1_000_000)) else {
        return;
    };
    for (pid, fp) in spawned_workers(&events) {
        drop(WorkerGuard::adopt(pid, &fp));
    }
}

/// A worker process the test did not spawn itself (the supervisor did), pinned by a pidfd
/// that was verified against its fingerprint. On drop its group and itself are SIGKILLed
/// through that pidfd — never a recycled pid — and it is reaped if it is our child (it is
/// when this process is a subreaper and the worker was re-parented to it).
pub struct WorkerGuard {
    pub pid: Pid,
    pub fingerprint: Fingerprint,
    pidfd: PidFd,
}

impl WorkerGuard {
    /// Pins `pid` if it is still the process `fp` names (alive, or a zombie leader of a live
    /// group); `None` if it is provably gone or cannot be verified.
    pub fn adopt(pid: Pid, fp: &Fingerprint) -> Option<WorkerGuard> {
        match open_verified(pid, fp) {
            Ok(Verified::Ours(pidfd)) => Some(WorkerGuard {
                pid,
                fingerprint: fp.clone(),
                pidfd,
            }),
            _ => None,
        }
    }

    /// Like [`WorkerGuard::adopt`], but a worker that cannot be pinned fails the test.
    pub fn pin(pid: Pid, fp: &Fingerprint) -> WorkerGuard {
        Self::adopt(pid, fp).unwrap_or_else(|| {
            panic!(
                "worker {pid} cannot be pinned: {:?}",
                process::liveness(pid, fp)
            )
        })
    }

    pub fn pidfd(&self) -> &PidFd {
        &self.pidfd
    }

    /// True while the process runs (not a zombie, not gone, not recycled).
    pub fn alive(&self) -> bool {
        matches!(
            process::liveness(self.pid, &self.fingerprint),
            Liveness::Alive
        )
    }

    /// Waits up to `timeout` for the process to be dead; returns the instant death was seen.
    pub fn wait_dead(&self, timeout: Duration) -> Option<Instant> {
        let mut seen = None;
        wait_until(timeout, || {
            if !self.alive() {
                seen = Some(Instant::now());
            }
            seen.is_some()
        });
        seen
    }
}

impl Drop for WorkerGuard {
    fn drop(&mut self) {
        let _ = self.pidfd.signal_group(Signal::SIGKILL);
        let _ = self.pidfd.signal(Signal::SIGKILL);
        // Reaps it if it is our child (re-parented to us); anything else answers ECHILD.
        if self
            .pidfd
            .wait_exit(Duration::from_secs(2))
            .unwrap_or(false)
        {
            let _ = self.pidfd.try_reap();
        }
    }
}

/// True while `pid` is the process `fp` names and it runs.
pub fn alive(pid: Pid, fp: &Fingerprint) -> bool {
    matches!(process::liveness(pid, fp), Liveness::Alive)
}

/// Every readable `/proc/<pid>/stat`.
pub fn all_stats() -> Vec<ProcStat> {
    let Ok(dir) = fs::read_dir("/proc") else {
        panic!("cannot list /proc");
    };
    dir.filter_map(|e| {
        let pid: Pid = e.ok()?.file_name().to_str()?.parse().ok()?;
        read_stat(pid).ok()
    })
    .collect()
}

/// The processes whose parent is `ppid`.
pub fn children_of(ppid: Pid) -> Vec<ProcStat> {
    all_stats().into_iter().filter(|s| s.ppid == ppid).collect()
}

/// A `runwarden serve` child (the real binary), in its own process group, with stdout and
/// stderr going to files (never a pipe nobody drains). Killed by pid on drop.
pub struct Serve {
    pub child: ChildGuard,
    pub stderr_path: PathBuf,
    /// Its control socket, when its config loads (see [`Serve::wait_ready`]).
    pub socket: Option<PathBuf>,
}

impl Serve {
    /// Starts `runwarden serve --config <config>`; logs at `RUNWARDEN_LOG=info`.
    pub fn start(config: &Path, log_name: &str) -> Serve {
        Serve::start_with_env(config, log_name, &[])
    }

    /// [`Serve::start`] with `env` added to the supervisor's environment.
    pub fn start_with_env(config: &Path, log_name: &str, env: &[(&str, &str)]) -> Serve {
        let dir = config.parent().expect("config has a parent dir");
        let stderr_path = dir.join(format!("{log_name}.stderr"));
        let stderr = fs::File::create(&stderr_path).expect("create stderr file");
        Serve::start_with_stderr(config, log_name, env, stderr.into())
    }

    /// [`Serve::start_with_env`] with its stderr given ([`Serve::stderr`] then reads nothing).
    pub fn start_with_stderr(
        config: &Path,
        log_name: &str,
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Serve {
        Serve::start_prepared(config, log_name, env, stderr, |_| {})
    }

    /// [`Serve::start`] with `prepare` applied to its command last (a `pre_exec`, say).
    pub fn start_with(config: &Path, log_name: &str, prepare: impl FnOnce(&mut Command)) -> Serve {
        let dir = config.parent().expect("config has a parent dir");
        let stderr =
            fs::File::create(dir.join(format!("{log_name}.stderr"))).expect("create stderr file");
        Serve::start_prepared(config, log_name, &[], stderr.into(), prepare)
    }

    fn start_prepared(
        config: &Path,
        log_name: &str,
        env: &[(&str, &str)],
        stderr: Stdio,
        prepare: impl FnOnce(&mut Command),
    ) -> Serve {
        let dir = config.parent().expect("config has a parent dir");
        let stderr_path = dir.join(format!("{log_name}.stderr"));
        let stdout_path = dir.join(format!("{log_name}.stdout"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_runwarden"));
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .current_dir(dir)
            .env("RUNWARDEN_LOG", "info")
            .stdin(Stdio::null())
            .stdout(fs::File::create(&stdout_path).expect("create stdout file"))
            .stderr(stderr)
            .process_group(0);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("RUNWARDEN_") && key != "RUNWARDEN_LOG" {
                cmd.env_remove(&key);
            }
        }
        cmd.envs(env.iter().copied());
        prepare(&mut cmd);
        // Registered as owned, for good: an in-process supervisor of another test in this
        // binary makes the process a subreaper that reaps the zombies of children it does not
        // own, and would take this one's exit status from under `wait_exit`.
        let owned = process::owned::spawning();
        let child = ChildGuard::spawn(&mut cmd).expect("spawn runwarden serve");
        owned.register(child.pid());
        drop(owned);
        let socket = runwarden::config::Config::load(config)
            .ok()
            .map(|c| c.socket_path());
        Serve {
            child,
            stderr_path,
            socket,
        }
    }

    pub fn pid(&self) -> Pid {
        self.child.pid()
    }

    /// What it wrote to stderr so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// Waits until the supervisor holds its lock (the lock file names its pid), its board is
    /// created and migrated (so another connection can open it) and its socket takes
    /// connections (a client's then waits to be served; the socket is bound just after the
    /// lock is taken, so a client right after the lock alone could find none, or the stale one
    /// of a killed predecessor); fails the test (with its stderr) if it exits or does not get
    /// there in time.
    pub fn wait_ready(&mut self, lock: &Path, db: &Path) {
        let me = self.pid().to_string();
        let socket = self.socket.clone();
        let ready = wait_until(SETTLE, || {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("serve exited early ({status}); stderr:\n{}", self.stderr());
            }
            fs::read_to_string(lock).is_ok_and(|s| s.trim() == me)
                && board_migrated(db)
                && socket
                    .as_ref()
                    .is_none_or(|s| std::os::unix::net::UnixStream::connect(s).is_ok())
        });
        assert!(
            ready,
            "serve (pid {me}) not ready in {SETTLE:?}; stderr:\n{}",
            self.stderr()
        );
    }

    /// Sends `sig` to the supervisor process only (its workers lead groups of their own).
    pub fn signal(&self, sig: Signal) {
        self.child.pidfd().signal(sig).expect("signal serve");
    }

    /// Waits up to `timeout` for it to exit; its status, or `None` if it is still running.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let mut status = None;
        wait_until(timeout, || {
            status = self.child.try_wait().expect("try_wait serve");
            status.is_some()
        });
        status
    }

    /// Sends `sig` and asserts a clean exit (status 0) within [`SETTLE`].
    pub fn stop_cleanly(&mut self, sig: Signal) {
        self.signal(sig);
        let status = self.wait_exit(SETTLE);
        let stderr = self.stderr();
        let status =
            status.unwrap_or_else(|| panic!("serve did not exit after {sig}; stderr:\n{stderr}"));
        assert!(
            status.success(),
            "serve exited {status} after {sig}; stderr:\n{stderr}"
        );
    }
}

/// True once the board at `db` exists with its schema (migrations commit atomically, so a
/// readable `task_events` means the whole schema is there).
pub fn board_migrated(db: &Path) -> bool {
    db.exists()
        && Board::open_with(
            db,
            OpenOptions {
                synchronous_full: true,
                read_only: true,
            },
        )
        .and_then(|mut b| b.read(|tx| tx.last_event_id()))
        .is_ok()
}

/// Polls the board at `db` (read-only) until `find` returns something.
pub fn poll_board<T>(db: &Path, what: &str, mut find: impl FnMut(&mut Board) -> Option<T>) -> T {
    let mut found = None;
    let mut board: Option<Board> = None;
    wait_until(SETTLE, || {
        if board.is_none() && db.exists() {
            board = Board::open_with(
                db,
                OpenOptions {
                    synchronous_full: true,
                    read_only: true,
                },
            )
            .ok();
        }
        if let Some(b) = board.as_mut() {
            found = find(b);
        }
        found.is_some()
    });
    found.unwrap_or_else(|| panic!("timed out after {SETTLE:?} waiting for {what}"))
}

/// The first event of `kind` on `task`, if any.
pub fn task_event(board: &mut Board, task: TaskId, kind: &str) -> Option<Event> {
    board
        .read(|tx| tx.task_events_since(task, 0, 10_000))
        .ok()?
        .into_iter()
        .find(|e| e.kind == kind)
}

/// Every run of `task`, oldest first.
pub fn runs_of(board: &mut Board, task: TaskId) -> Vec<Run> {
    board
        .read(|tx| tx.runs_for_task(task))
        .expect("runs_for_task")
}

/// A library config on `td`'s data dir with short timings: 50 ms tick, 300 ms grace, 1 s kill
/// timeout, 50 ms retry backoff, and `shutdown = "terminate"` (so a failing test's workers
/// are ended when its supervisor is dropped). No assignees.
pub fn lib_config(td: &TestDir) -> runwarden::config::Config {
    use runwarden::config::{Config, ShutdownMode};
    let mut config = Config::with_data_dir(td.data_dir());
    config.supervisor.tick = Duration::from_millis(50);
    config.supervisor.shutdown = ShutdownMode::Terminate;
    config.reaper.grace = Duration::from_millis(300);
    config.reaper.kill_timeout = Duration::from_secs(1);
    config.retries.backoff = Duration::from_millis(50);
    config.retries.backoff_max = Duration::from_millis(500);
    config
}
