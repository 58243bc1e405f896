//! Helpers for the board integration tests: a board in a temporary directory, real sleepers
//! that are always ended through their guard, and signallers that record or fail on purpose.

use std::io;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use runwarden::board::{Board, Event, Millis, NewTask, Run, RunId, TaskId};
use runwarden::process::{
    Fingerprint, Pid, PidFd, PidfdSignaller, ProcessError, Sent, Signal, Signaller, fingerprint,
};
use tempfile::TempDir;

use super::proc_guard::{ChildGuard, wait_until};

/// Generous bound for the kernel to catch up; every wait polls, none sleeps blindly.
pub const SETTLE: Duration = Duration::from_secs(10);
/// The reaper's grace in these tests (the default of `[reaper] grace`).
pub const GRACE: Duration = Duration::from_secs(120);
/// SIGTERM → SIGKILL delay given to the reaper; `sleep` dies of SIGTERM long before.
pub const KILL_TIMEOUT: Duration = Duration::from_secs(10);
/// Lease given to every claim.
pub const LEASE_MS: i64 = 15 * 60 * 1000;

/// A board in its own temporary directory (removed on drop, after the board is closed).
pub struct TempBoard {
    // Field order matters: the connection closes before the directory is removed.
    pub board: Board,
    pub path: PathBuf,
    pub dir: TempDir,
}

/// Opens a fresh board file in a new temporary directory.
pub fn temp_board() -> TempBoard {
    let dir = tempfile::tempdir().expect("create a temporary directory");
    let path = dir.path().join("board.db");
    let board = Board::open(&path).expect("open a fresh board");
    TempBoard { board, path, dir }
}

/// Spawns `sleep <secs>` as the leader of its own process group, guarded (ended by pid through
/// a pidfd on drop), with its real fingerprint.
pub fn sleeper(secs: u32) -> (ChildGuard, Fingerprint) {
    let guard = ChildGuard::spawn(
        Command::new("sleep")
            .arg(secs.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0),
    )
    .expect("spawn sleep");
    let fp = fingerprint(guard.pid()).expect("fingerprint of a fresh sleeper");
    (guard, fp)
}

/// Spawns `sh -c script` as the leader of its own process group, guarded like [`sleeper`], with
/// the leader's real fingerprint (taken at once: a start time survives exec and exit).
pub fn group_leader(script: &str) -> (ChildGuard, Fingerprint) {
    let guard = ChildGuard::spawn(
        Command::new("sh")
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0),
    )
    .expect("spawn sh");
    let fp = fingerprint(guard.pid()).expect("fingerprint of a fresh group leader");
    (guard, fp)
}

/// True once the child has exited (reaped by this call), waiting at most [`SETTLE`].
pub fn exits_within_settle(child: &mut ChildGuard) -> bool {
    wait_until(SETTLE, || matches!(child.try_wait(), Ok(Some(_))))
}

/// True while the child has not exited (it is not reaped by this call unless it exited).
pub fn still_running(child: &mut ChildGuard) -> bool {
    matches!(child.try_wait(), Ok(None))
}

/// Creates a task for `coder`, claims it at `ended_at - 1000`, records `pid` (with `fp`, or none
/// for a legacy row) as its worker, and completes it through its run at `ended_at`.
pub fn completed_with_worker(
    board: &mut Board,
    title: &str,
    pid: Pid,
    fp: Option<&Fingerprint>,
    ended_at: Millis,
) -> (TaskId, RunId) {
    let started = ended_at - 1000;
    board
        .write(|tx| {
            let task = tx
                .create_task(&NewTask::titled(title).for_assignee("coder"), started)?
                .id;
            let claim = tx.claim_task(task, "test-claimer", started, LEASE_MS)?;
            tx.set_worker(claim.run_id, pid, fp, None, started)?;
            let closed = tx.complete_task(task, Some(claim.run_id), Some("done"), ended_at)?;
            let closed = closed.expect("completing a running task closes its run");
            assert_eq!(closed.pid, Some(pid), "the closed run keeps the worker pid");
            assert_eq!(closed.fingerprint.as_ref(), fp, "and its fingerprint");
            Ok((task, claim.run_id))
        })
        .expect("create, claim, set_worker, complete")
}

/// One run, read in its own snapshot.
pub fn run(board: &mut Board, run_id: RunId) -> Run {
    board.read(|tx| tx.get_run(run_id)).expect("get_run")
}

/// Every event of a task, oldest first.
pub fn events(board: &mut Board, task: TaskId) -> Vec<Event> {
    board
        .read(|tx| tx.task_events_since(task, 0, 10_000))
        .expect("task_events_since")
}

/// The events of `kind` of a task.
pub fn events_of(board: &mut Board, task: TaskId, kind: &str) -> Vec<Event> {
    events(board, task)
        .into_iter()
        .filter(|e| e.kind == kind)
        .collect()
}

/// The kinds of a task's events, oldest first.
pub fn kinds(board: &mut Board, task: TaskId) -> Vec<String> {
    events(board, task).into_iter().map(|e| e.kind).collect()
}

/// Asserts the task has no terminal-reaper event at all (its worker was never dealt with).
pub fn assert_no_reaper_event(board: &mut Board, task: TaskId, what: &str) {
    let kinds = kinds(board, task);
    assert!(
        !kinds.iter().any(|k| k.starts_with("terminal_worker")),
        "{what}: {kinds:?}"
    );
}

/// Asserts the run still holds its worker evidence: pid and (if given) fingerprint.
pub fn assert_evidence_kept(run: &Run, pid: Pid, fp: Option<&Fingerprint>) {
    assert_eq!(
        run.worker_pid,
        Some(i64::from(pid)),
        "worker_pid kept: {run:?}"
    );
    assert_eq!(run.fingerprint().as_ref(), fp, "fingerprint kept: {run:?}");
}

/// Asserts the run's worker evidence was cleared while its history (`spawned_pid`) was kept.
pub fn assert_evidence_cleared(run: &Run, spawned: Pid) {
    assert_eq!(run.worker_pid, None, "worker_pid cleared: {run:?}");
    assert_eq!(run.worker_boot_id, None, "worker_boot_id cleared: {run:?}");
    assert_eq!(
        run.worker_start_ticks, None,
        "worker_start_ticks cleared: {run:?}"
    );
    assert_eq!(
        run.spawned_pid,
        Some(i64::from(spawned)),
        "spawned_pid kept: {run:?}"
    );
}

/// The real signaller, recording every signal it is asked to send (before sending it).
#[derive(Default)]
pub struct RecordingSignaller {
    inner: PidfdSignaller,
    sent: Mutex<Vec<(Pid, Signal)>>,
}

impl RecordingSignaller {
    /// Every (pid, signal) asked for so far, in order.
    pub fn sent(&self) -> Vec<(Pid, Signal)> {
        self.sent.lock().unwrap().clone()
    }

    fn record(&self, pid: Pid, sig: Signal) {
        self.sent.lock().unwrap().push((pid, sig));
    }
}

impl Signaller for RecordingSignaller {
    fn send(&self, pid: Pid, expected: &Fingerprint, sig: Signal) -> Result<Sent, ProcessError> {
        self.record(pid, sig);
        self.inner.send(pid, expected, sig)
    }

    fn send_group(&self, leader: &PidFd, sig: Signal) -> Result<Sent, ProcessError> {
        self.record(leader.pid(), sig);
        self.inner.send_group(leader, sig)
    }
}

/// Fails every signal for one pid (as a broken kill path would) and delegates the rest to the
/// real signaller, recording what it delegated.
pub struct FailingFor {
    pub broken: Pid,
    pub inner: RecordingSignaller,
}

impl FailingFor {
    pub fn new(broken: Pid) -> Self {
        FailingFor {
            broken,
            inner: RecordingSignaller::default(),
        }
    }

    fn injected(pid: Pid) -> ProcessError {
        ProcessError::Io {
            pid,
            what: "pidfd_send_signal (injected failure)",
            source: io::Error::other("boom"),
        }
    }
}

impl Signaller for FailingFor {
    fn send(&self, pid: Pid, expected: &Fingerprint, sig: Signal) -> Result<Sent, ProcessError> {
        if pid == self.broken {
            return Err(Self::injected(pid));
        }
        self.inner.send(pid, expected, sig)
    }

    fn send_group(&self, leader: &PidFd, sig: Signal) -> Result<Sent, ProcessError> {
        if leader.pid() == self.broken {
            return Err(Self::injected(leader.pid()));
        }
        self.inner.send_group(leader, sig)
    }
}
