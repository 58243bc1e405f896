//! Helpers for the run-lifecycle tests (dependencies, retries, max_runtime, leases,
//! descendants, restart, privileges, hooks): one way to read a board whether it belongs to an
//! in-process supervisor or to a `runwarden serve` child, bounded waits on task states and
//! events that fail with the task's whole history, `/proc` probes for a run's processes, and a
//! `serve` wrapper that survives sharing a test binary with in-process supervisors.
//!
//! Every wait is a bounded poll; every process a test meets is pinned by a pidfd verified
//! against its fingerprint before anything is asserted about it, so a recycled pid can never be
//! mistaken for (or killed as) one of ours.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use runwarden::SupervisorHandle;
use runwarden::board::{
    self, Board, Event, Millis, NewTask, OpenOptions, Run, RunId, Task, TaskDetail, TaskId,
    TaskStatus, Tx,
};
use runwarden::config::AssigneeConfig;
use runwarden::process::{self, Fingerprint, Liveness, Pid, Signal};

use super::proc_guard::wait_until;
use super::runtime::{Serve, WorkerGuard};

/// The `runwarden` binary under test.
pub const RUNWARDEN: &str = env!("CARGO_BIN_EXE_runwarden");

/// Most a worker's `runwarden complete` loop retries (0.1 s apart): ~30 s.
pub const COMPLETE_TRIES: u32 = 300;

/// `$PATH` with the directory of the `runwarden` under test first, so a worker's
/// `runwarden complete` is this build (an embedded supervisor does not add it by itself).
pub fn path_with_runwarden() -> String {
    let dir = Path::new(RUNWARDEN)
        .parent()
        .expect("binary has a directory");
    match std::env::var("PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => format!("{}:/usr/local/bin:/usr/bin:/bin", dir.display()),
    }
}

/// An assignee running `sh -c script` (cap 1), with `runwarden` on its PATH.
pub fn sh_assignee(script: &str) -> AssigneeConfig {
    let mut a = AssigneeConfig::new(["sh", "-c", script]);
    a.env.insert("PATH".into(), path_with_runwarden());
    a
}

/// A shell fragment that reports completion over the control socket, retrying until the
/// supervisor answers (it may be restarting) for at most ~30 s; exits 1 if it never does.
pub fn complete_loop(result: &str) -> String {
    format!(
        "n=0; until runwarden complete --result {result}; do n=$((n+1)); \
         if [ $n -ge {COMPLETE_TRIES} ]; then echo 'runwarden complete never succeeded' >&2; exit 1; fi; \
         sleep 0.1; done"
    )
}

/// A shell fragment that blocks until the file `$GATE_DIR/<task id>` exists (the test opens a
/// task's gate by creating it), polling every 20 ms; at most `limit_s` seconds, then exits 9.
pub fn wait_for_gate(limit_s: u32) -> String {
    let tries = limit_s * 50;
    format!(
        "n=0; while [ ! -e \"$GATE_DIR/$RUNWARDEN_TASK_ID\" ]; do n=$((n+1)); \
         if [ $n -ge {tries} ]; then exit 9; fi; sleep 0.02; done"
    )
}

/// Opens the gate of `task` (see [`wait_for_gate`]).
pub fn open_gate(gate_dir: &Path, task: TaskId) {
    fs::create_dir_all(gate_dir).expect("create the gate dir");
    fs::write(gate_dir.join(task.to_string()), b"go").expect("open a gate");
}

// ---------------------------------------------------------------------------------------------
// Reading a board
// ---------------------------------------------------------------------------------------------

/// Something whose board can be read in a consistent snapshot.
pub trait View {
    /// Runs `f` in one read transaction; a failure fails the test.
    fn read<T>(&mut self, f: impl FnOnce(&Tx<'_>) -> board::Result<T>) -> T;

    fn get_task(&mut self, id: TaskId) -> Task {
        self.read(|tx| tx.get_task(id))
    }

    fn detail(&mut self, id: TaskId) -> TaskDetail {
        self.read(|tx| tx.task_detail(id, 10_000, usize::MAX))
    }

    fn runs(&mut self, id: TaskId) -> Vec<Run> {
        self.read(|tx| tx.runs_for_task(id))
    }

    fn run(&mut self, id: RunId) -> Run {
        self.read(|tx| tx.get_run(id))
    }

    /// Every event of task `id`, oldest first.
    fn events(&mut self, id: TaskId) -> Vec<Event> {
        self.read(|tx| tx.task_events_since(id, 0, 100_000))
    }

    /// The events of `kind` of task `id`, oldest first.
    fn events_of(&mut self, id: TaskId, kind: &str) -> Vec<Event> {
        self.events(id)
            .into_iter()
            .filter(|e| e.kind == kind)
            .collect()
    }

    /// Every event of the board, oldest first.
    fn all_events(&mut self) -> Vec<Event> {
        self.read(|tx| tx.events_since(0, 1_000_000))
    }

    /// A one-screen history of task `id` for failure messages.
    fn history(&mut self, id: TaskId) -> String {
        let d = self.detail(id);
        let mut s = format!("task {id}: {:?}\n", d.task);
        for r in &d.runs {
            s.push_str(&format!("  run {r:?}\n"));
        }
        for e in &d.events {
            s.push_str(&format!(
                "  event {} {} run={:?} at={} {}\n",
                e.id, e.kind, e.run_id, e.at, e.payload
            ));
        }
        s
    }

    /// Waits until task `id` has status `status`; fails with its history otherwise.
    fn wait_status(&mut self, id: TaskId, status: TaskStatus, timeout: Duration) -> Task {
        let mut found = None;
        wait_until(timeout, || {
            let t = self.get_task(id);
            let ok = t.status == status;
            found = ok.then_some(t);
            ok
        });
        found.unwrap_or_else(|| {
            panic!(
                "task {id} not {status} within {timeout:?}\n{}",
                self.history(id)
            )
        })
    }

    /// Waits until task `id` has at least `n` events of `kind`; returns them (oldest first).
    fn wait_events(&mut self, id: TaskId, kind: &str, n: usize, timeout: Duration) -> Vec<Event> {
        let mut found = Vec::new();
        wait_until(timeout, || {
            found = self.events_of(id, kind);
            found.len() >= n
        });
        if found.len() < n {
            panic!(
                "task {id}: {} `{kind}` event(s) within {timeout:?}, expected {n}\n{}",
                found.len(),
                self.history(id)
            );
        }
        found
    }

    /// Waits for the first `kind` event of task `id`.
    fn wait_event(&mut self, id: TaskId, kind: &str, timeout: Duration) -> Event {
        self.wait_events(id, kind, 1, timeout).remove(0)
    }

    /// Asserts that for `window` task `id` keeps status `status` and gains no event of the
    /// `kinds` listed. Asserting that something does NOT happen needs an observation window;
    /// it is polled, so a violation fails at once.
    fn assert_stays(&mut self, id: TaskId, status: TaskStatus, kinds: &[&str], window: Duration) {
        let before: Vec<usize> = kinds.iter().map(|k| self.events_of(id, k).len()).collect();
        let deadline = Instant::now() + window;
        while Instant::now() < deadline {
            let t = self.get_task(id);
            assert_eq!(
                t.status,
                status,
                "task {id} left {status}\n{}",
                self.history(id)
            );
            for (k, n) in kinds.iter().zip(&before) {
                let now = self.events_of(id, k).len();
                assert_eq!(now, *n, "task {id} got a `{k}` event\n{}", self.history(id));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl View for SupervisorHandle {
    fn read<T>(&mut self, f: impl FnOnce(&Tx<'_>) -> board::Result<T>) -> T {
        self.services()
            .store
            .read_blocking(f)
            .expect("read the board")
    }
}

/// A board file read through a read-only connection of its own (a `serve` child's board).
pub struct Db {
    pub path: PathBuf,
    board: Option<Board>,
}

impl Db {
    pub fn new(path: impl Into<PathBuf>) -> Db {
        Db {
            path: path.into(),
            board: None,
        }
    }

    /// Writes through a short-lived read-write connection (tasks set up while no supervisor
    /// runs, or a forged legacy row). Not used while a supervisor would miss the change.
    pub fn write<T>(&self, f: impl FnOnce(&Tx<'_>) -> board::Result<T>) -> T {
        let mut b = Board::open(&self.path).expect("open the board read-write");
        b.write(f).expect("write the board")
    }

    /// Runs a raw statement (forging states no transition produces).
    pub fn execute_raw(&self, sql: &str, params: impl rusqlite::Params) -> usize {
        let b = Board::open(&self.path).expect("open the board read-write");
        b.execute_raw(sql, params).expect("raw statement")
    }

    /// `PRAGMA integrity_check` on a fresh connection.
    pub fn integrity_check(&self) -> String {
        let b = Board::open_with(
            &self.path,
            OpenOptions {
                synchronous_full: true,
                read_only: true,
            },
        )
        .expect("open the board");
        b.integrity_check().expect("integrity_check")
    }
}

impl View for Db {
    fn read<T>(&mut self, f: impl FnOnce(&Tx<'_>) -> board::Result<T>) -> T {
        if self.board.is_none() {
            let opened = Board::open_with(
                &self.path,
                OpenOptions {
                    synchronous_full: true,
                    read_only: true,
                },
            );
            self.board =
                Some(opened.unwrap_or_else(|e| panic!("open {}: {e}", self.path.display())));
        }
        self.board
            .as_mut()
            .unwrap()
            .read(f)
            .expect("read the board")
    }
}

// ---------------------------------------------------------------------------------------------
// Writing through an in-process supervisor's store (what the control server does)
// ---------------------------------------------------------------------------------------------

/// Runs `f` in the running supervisor's writer transaction and waits until it is durable;
/// its events reach the dispatcher, reaper and hooks exactly like a control request's.
pub fn write<T: Send + 'static>(
    sup: &SupervisorHandle,
    f: impl Fn(&Tx<'_>, Millis) -> board::Result<T> + Send + 'static,
) -> Result<T, runwarden::actors::store::StoreError> {
    futures::executor::block_on(sup.services().store.with_tx(f))
}

/// Adds a task through the running supervisor.
pub fn add(sup: &SupervisorHandle, new: NewTask) -> TaskId {
    sup.add_task(new).expect("add a task").id
}

/// A task for `assignee`.
pub fn task_for(title: &str, assignee: &str) -> NewTask {
    NewTask::titled(title).for_assignee(assignee)
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// A process seen under a run: pid, fingerprint (taken while it ran) and command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub pid: Pid,
    pub fingerprint: Fingerprint,
    pub cmdline: String,
}

impl Seen {
    /// True while this very process (same fingerprint) runs.
    pub fn alive(&self) -> bool {
        matches!(
            process::liveness(self.pid, &self.fingerprint),
            Liveness::Alive
        )
    }

    /// Pins it (pidfd verified against the fingerprint) so it is SIGKILLed on drop.
    pub fn pin(&self) -> Option<WorkerGuard> {
        WorkerGuard::adopt(self.pid, &self.fingerprint)
    }
}

/// `/proc/<pid>/cmdline` with NULs as spaces ("" if unreadable).
pub fn cmdline(pid: Pid) -> String {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split('\0')
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Every live process (not us) whose environment carries `RUNWARDEN_RUN_TOKEN=<token>`: the
/// run's worker and all its descendants, whatever group or session they moved to.
pub fn procs_of_run(token: &str) -> Vec<Seen> {
    process::descendants::find_by_token(token)
        .expect("a complete scan of /proc")
        .into_iter()
        .filter(|(pid, fp)| matches!(process::liveness(*pid, fp), Liveness::Alive))
        .map(|(pid, fingerprint)| Seen {
            pid,
            fingerprint,
            cmdline: cmdline(pid),
        })
        .collect()
}

/// Waits until the run's processes include one per `cmdlines` entry (exact command line);
/// returns them in that order. Fails listing what was seen.
pub fn wait_run_procs(token: &str, cmdlines: &[&str], timeout: Duration) -> Vec<Seen> {
    let mut seen = Vec::new();
    let ok = wait_until(timeout, || {
        seen = procs_of_run(token);
        cmdlines
            .iter()
            .all(|c| seen.iter().any(|s| s.cmdline == *c))
    });
    assert!(
        ok,
        "run processes {cmdlines:?} not all seen within {timeout:?}; seen: {seen:?}"
    );
    cmdlines
        .iter()
        .map(|c| seen.iter().find(|s| s.cmdline == *c).cloned().unwrap())
        .collect()
}

/// Waits until none of `procs` runs any more (each dead, a zombie, or its pid recycled).
pub fn wait_all_dead(procs: &[Seen], timeout: Duration) -> bool {
    wait_until(timeout, || procs.iter().all(|p| !p.alive()))
}

/// The pid and fingerprint a `worker_spawned` event records.
pub fn spawned_identity(ev: &Event) -> (Pid, Fingerprint) {
    super::runtime::worker_identity(ev)
        .unwrap_or_else(|| panic!("worker_spawned without pid + fingerprint: {ev:?}"))
}

/// Reads a pid written by a script into `path` (atomically, via rename), waiting for it.
pub fn wait_pid_file(path: &Path, timeout: Duration) -> Pid {
    let mut pid = None;
    wait_until(timeout, || {
        pid = fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse().ok());
        pid.is_some()
    });
    pid.unwrap_or_else(|| panic!("no pid in {} within {timeout:?}", path.display()))
}

/// The fingerprint of a live pid, pinned; fails if it is already gone.
pub fn seen(pid: Pid) -> Seen {
    let fingerprint = process::fingerprint(pid)
        .unwrap_or_else(|e| panic!("process {pid} is gone before it could be fingerprinted: {e}"));
    Seen {
        pid,
        fingerprint,
        cmdline: cmdline(pid),
    }
}

// ---------------------------------------------------------------------------------------------
// serve
// ---------------------------------------------------------------------------------------------

/// Stops a `serve` child with `sig` and waits for it to be gone. Its exit status when this
/// process could still read it (an in-process supervisor elsewhere in the test binary is a
/// subreaper that may reap the zombie first; then the status is lost, not the stop).
pub fn stop_serve(
    serve: &mut Serve,
    sig: Signal,
    timeout: Duration,
) -> Option<std::process::ExitStatus> {
    serve.signal(sig);
    let exited = serve.child.pidfd().wait_exit(timeout).unwrap_or(false);
    assert!(
        exited,
        "serve did not exit within {timeout:?} after {sig}; stderr:\n{}",
        serve.stderr()
    );
    // Err: reaped by another subreaper sweep in this process; the status is lost, not the stop.
    serve.child.try_wait().unwrap_or_default()
}

/// Serializes the tests of one binary that must not overlap (a `serve` whose orphaned workers
/// would re-parent to this process while an in-process supervisor's orphan sweep runs here).
pub fn serial(lock: &'static Mutex<()>) -> MutexGuard<'static, ()> {
    lock.lock().unwrap_or_else(|p| p.into_inner())
}

/// Milliseconds since the epoch now (the board's clock).
pub fn now() -> Millis {
    board::now_millis()
}

/// Waits until exactly `n` live processes carry the run's token (the worker and its
/// descendants); returns them.
pub fn wait_run_count(token: &str, n: usize, timeout: Duration) -> Vec<Seen> {
    let mut seen = Vec::new();
    let ok = wait_until(timeout, || {
        seen = procs_of_run(token);
        seen.len() == n
    });
    assert!(
        ok,
        "expected {n} processes of the run within {timeout:?}; seen: {seen:?}"
    );
    seen
}

/// What a `runwarden` CLI invocation did.
#[derive(Debug)]
pub struct CliOutput {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl CliOutput {
    /// Fails the test (with both outputs) unless the command exited 0.
    pub fn ok(self) -> CliOutput {
        assert!(self.status.success(), "runwarden CLI failed: {self:?}");
        self
    }
}

/// Runs `runwarden --socket <socket> <args…>` as an operator would (no RUNWARDEN_* from this
/// process's environment), waiting at most `timeout`; output goes to files, never to a pipe
/// nobody drains. The child is registered as owned for its lifetime, so an in-process
/// supervisor's orphan reaper (this process is a subreaper while one runs) never reaps it
/// and steals its exit status; it is killed by pid through its guard if it overruns.
pub fn runwarden_cli(socket: &Path, args: &[&str], timeout: Duration) -> CliOutput {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};
    let out = tempfile::tempdir().expect("a directory for the CLI's output");
    let (stdout_path, stderr_path) = (out.path().join("stdout"), out.path().join("stderr"));
    let mut cmd = Command::new(RUNWARDEN);
    cmd.arg("--socket")
        .arg(socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(fs::File::create(&stdout_path).unwrap())
        .stderr(fs::File::create(&stderr_path).unwrap())
        .process_group(0);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("RUNWARDEN_") {
            cmd.env_remove(&key);
        }
    }
    let owned = process::owned::spawning();
    let mut child = super::proc_guard::ChildGuard::spawn(&mut cmd).expect("spawn runwarden");
    owned.register(child.pid());
    drop(owned);
    let exited = child.pidfd().wait_exit(timeout).unwrap_or(false);
    let status = exited.then(|| child.wait().expect("wait for runwarden"));
    process::owned::unregister(child.pid());
    let read = |p: &Path| fs::read_to_string(p).unwrap_or_default();
    let (stdout, stderr) = (read(&stdout_path), read(&stderr_path));
    let status = status.unwrap_or_else(|| {
        panic!(
            "runwarden {args:?} did not exit within {timeout:?}; stdout: {stdout}; stderr: {stderr}"
        )
    });
    CliOutput {
        status,
        stdout,
        stderr,
    }
}

// ---------------------------------------------------------------------------------------------
// A worker that leaves an escapee behind
// ---------------------------------------------------------------------------------------------

/// A `serve` whose one task's worker starts a `setsid sleep <secs>` escapee (a carrier of the
/// run's token outside the worker's group) and then waits for its gate, exiting 0 once it is
/// opened ([`open_gate`] with `gates`, `task`).
pub struct GatedEscapee {
    pub serve: Serve,
    pub db: Db,
    pub task: TaskId,
    pub run: Run,
    /// The escapee, seen running (pin it to keep it from being mistaken after it ends).
    pub escapee: Seen,
    pub gates: PathBuf,
}

/// Starts [`GatedEscapee`] on a fresh board in `td`: `supervisor_keys` go under
/// `[supervisor]` (tick, shutdown…), `sections` after the `[assignees.w]` table's
/// predecessors (`[reaper]`, `[retries]`…).
pub fn start_gated_escapee(
    td: &super::runtime::TestDir,
    secs: u32,
    supervisor_keys: &str,
    sections: &str,
) -> GatedEscapee {
    let gates = td.path().join("gates");
    let worker = format!("setsid sleep {secs} & {}; exit 0", wait_for_gate(60));
    let config = td.write_config(
        supervisor_keys,
        &format!(
            "{sections}\n\n[assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\n\
             env = {{ GATE_DIR = {gates:?} }}\n"
        ),
    );
    fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let task = db.write(|tx| {
        Ok(tx
            .create_task(&NewTask::titled("w").for_assignee("w"), board::now_millis())?
            .id)
    });
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    db.wait_event(task, "worker_spawned", super::runtime::SETTLE);
    let run = db.runs(task)[0].clone();
    let escapee = wait_run_procs(
        &run.token,
        &[&format!("sleep {secs}")],
        super::runtime::SETTLE,
    )
    .remove(0);
    GatedEscapee {
        serve,
        db,
        task,
        run,
        escapee,
        gates,
    }
}
