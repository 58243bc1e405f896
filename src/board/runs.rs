//! Run transitions: claim, worker evidence, heartbeat, and every way a run closes.

use rand::RngCore;
use rusqlite::{OptionalExtension, params};
use serde_json::json;

use super::types::{
    Claim, ClosedRun, Failure, LogStart, Millis, Run, RunId, RunOutcome, TaskId, TaskStatus,
};
use super::{BoardError, Result, Tx, changed_one};
use crate::process::Fingerprint;

/// What `fail_run` did to the task.
#[derive(Debug, Clone, PartialEq)]
pub struct FailResult {
    pub closed: ClosedRun,
    /// `ready` (retry scheduled) or `blocked` (gave up).
    pub status: TaskStatus,
    pub consecutive_failures: i64,
    /// When the retry may be claimed (`ready` only).
    pub not_before: Millis,
}

/// How a worker process ended, as recorded on its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitInfo {
    pub code: Option<i32>,
    pub signal: Option<i32>,
}

/// A run, as [`Tx::record_worker_exit`] left it: what its caller decides on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordedExit {
    pub task_id: TaskId,
    /// When the run was closed; `None` while it is open.
    pub ended_at: Option<Millis>,
}

impl RecordedExit {
    /// True while the run is open (the exit did not close it; its caller decides).
    pub fn is_open(&self) -> bool {
        self.ended_at.is_none()
    }
}

/// A run's secret: 128 random bits as 32 lowercase hex digits.
pub(super) fn new_token() -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut bytes = [0u8; 16];
    rand::thread_rng().fill_bytes(&mut bytes);
    let mut token = String::with_capacity(32);
    for b in bytes {
        token.push(HEX[usize::from(b >> 4)] as char);
        token.push(HEX[usize::from(b & 0xf)] as char);
    }
    token
}

impl Tx<'_> {
    /// Claims a ready task: opens a run (with a fresh token and a lease) and marks the task
    /// running. A task whose parent reopened since it became ready is refused (`Conflict`); the
    /// caller then demotes it with [`Tx::demote_if_waiting`]. Every refusal happens before the
    /// first write (the claim passes rely on it: they run claims without savepoints).
    pub fn claim_task(
        &self,
        task_id: TaskId,
        claimer: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Claim> {
        self.claim(task_id, claimer, now, lease_ms, false)
    }

    /// [`Tx::claim_task`] for a claimer that is about to start the run's worker: the run is
    /// marked `spawn_pending` until [`Tx::set_worker`] records the worker or
    /// [`Tx::settle_spawn`] says none will run. Closed in between (reclaimed, archived), it
    /// still holds its task and its slot, so no second worker can start beside the one on its
    /// way.
    pub fn claim_task_to_spawn(
        &self,
        task_id: TaskId,
        claimer: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Claim> {
        self.claim(task_id, claimer, now, lease_ms, true)
    }

    fn claim(
        &self,
        task_id: TaskId,
        claimer: &str,
        now: Millis,
        lease_ms: i64,
        spawn_pending: bool,
    ) -> Result<Claim> {
        let (status, assignee) = self.task_status_and_assignee(task_id)?;
        self.claim_read(
            task_id,
            status,
            assignee.as_deref(),
            claimer,
            now,
            lease_ms,
            spawn_pending,
        )
    }

    /// [`Tx::claim_task_to_spawn`] of a task whose status and assignee were read in this
    /// transaction (a dispatch pass's candidates): one read less per claim.
    pub(super) fn claim_candidate_to_spawn(
        &self,
        task: &super::Task,
        claimer: &str,
        now: Millis,
        lease_ms: i64,
    ) -> Result<Claim> {
        let assignee = task.assignee.as_deref();
        self.claim_read(task.id, task.status, assignee, claimer, now, lease_ms, true)
    }

    /// The claim of a task whose `status` and `assignee` are as read in this transaction.
    #[allow(clippy::too_many_arguments)]
    fn claim_read(
        &self,
        task_id: TaskId,
        status: TaskStatus,
        assignee: Option<&str>,
        claimer: &str,
        now: Millis,
        lease_ms: i64,
        spawn_pending: bool,
    ) -> Result<Claim> {
        if status != TaskStatus::Ready {
            return Err(BoardError::Conflict(format!(
                "task {task_id} is {status}, not ready"
            )));
        }
        if !self.parents_satisfied(task_id)? {
            // The refusal is an `Err`, and callers roll an `Err`'s writes back (a savepoint, or
            // the whole transaction): a demotion written here would never persist. Refuse
            // without writing; the caller demotes with `demote_if_waiting` outside the failed
            // claim (the dispatch passes do).
            return Err(BoardError::Conflict(format!(
                "task {task_id} has an unfinished parent; it must be demoted to todo"
            )));
        }
        // One read for both: earlier runs, and those of them whose worker may be alive (its
        // evidence is held, or its start is under way).
        let (runs, holders): (i64, i64) = self
            .conn
            .prepare_cached(
                "SELECT count(*), coalesce(sum(worker_pid IS NOT NULL OR spawn_pending = 1), 0) \
                 FROM task_runs WHERE task_id = ?1",
            )?
            .query_row([task_id], |r| Ok((r.get(0)?, r.get(1)?)))?;
        if holders > 0 {
            // See reads::NO_LIVE_PREVIOUS_WORKER: never two workers for one task.
            return Err(BoardError::Conflict(format!(
                "task {task_id}: the worker of an earlier run may still be alive"
            )));
        }
        let attempt = runs + 1;
        let token = new_token();
        self.conn
            .prepare_cached(
                "INSERT INTO task_runs (task_id, attempt, assignee, token, claimer, started_at, \
                 lease_expires_at, spawn_pending) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                task_id,
                attempt,
                assignee,
                token,
                claimer,
                now,
                now + lease_ms,
                spawn_pending
            ])?;
        let run_id = self.conn.last_insert_rowid();
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE tasks SET status = 'running', current_run_id = ?2, \
                 started_at = coalesce(started_at, ?3), updated_at = ?3 \
                 WHERE id = ?1 AND status = 'ready'",
            )?
            .execute(params![task_id, run_id, now])?;
        changed_one(changed, task_id)?;
        self.append_event(
            Some(task_id),
            Some(run_id),
            "claimed",
            json!({ "attempt": attempt, "assignee": assignee, "claimer": claimer }),
            now,
        )?;
        Ok(Claim {
            task_id,
            run_id,
            attempt,
            token,
        })
    }

    /// Demotes a `ready` task whose parents are no longer all finished (a parent reopened since
    /// it was promoted) back to `todo`, with a `demoted` event. True if it did. Called by the
    /// dispatch passes after `claim_task` refused such a task, outside the refused claim's
    /// rollback, so the demotion persists and the task is not offered again on every pass.
    pub fn demote_if_waiting(&self, task_id: TaskId, now: Millis) -> Result<bool> {
        if self.task_status(task_id)? != TaskStatus::Ready || self.parents_satisfied(task_id)? {
            return Ok(false);
        }
        if !self.set_status(task_id, TaskStatus::Ready, TaskStatus::Todo, now)? {
            return Ok(false);
        }
        self.append_event(
            Some(task_id),
            None,
            "demoted",
            json!({ "reason": "parent_reopened" }),
            now,
        )?;
        Ok(true)
    }

    /// Records the spawned worker's pid and fingerprint on its run. Works on a run that already
    /// closed too (a fast worker may report before this lands): the evidence is what lets the
    /// reaper end a worker that outlives its run. A `None` fingerprint records a pid that will
    /// never be signalled. `log`: where the run's output starts in its task's log, for a
    /// later incarnation that adopts the worker. Returns the run's outcome and close time if
    /// it is already closed.
    pub fn set_worker(
        &self,
        run_id: RunId,
        pid: i32,
        fp: Option<&Fingerprint>,
        log: Option<&LogStart>,
        now: Millis,
    ) -> Result<Option<(RunOutcome, Millis)>> {
        match self.set_worker_if_unset(run_id, pid, fp, log, now)? {
            // A run closed before its evidence landed (archived between claim and spawn, or a
            // fast report): the caller must still end this worker, now or after the grace.
            Some(closed) => Ok(closed),
            None => {
                self.get_run(run_id)?;
                Err(BoardError::Conflict(format!(
                    "run {run_id} already has a worker"
                )))
            }
        }
    }

    /// [`Tx::set_worker`] for a run that may already hold its evidence (recorded by whoever
    /// got there first): `None` when it did, or when there is no such run.
    pub fn set_worker_if_unset(
        &self,
        run_id: RunId,
        pid: i32,
        fp: Option<&Fingerprint>,
        log: Option<&LogStart>,
        now: Millis,
    ) -> Result<Option<Option<(RunOutcome, Millis)>>> {
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE task_runs SET spawned_pid = ?2, worker_pid = ?2, worker_boot_id = ?3, \
                 worker_start_ticks = ?4, spawn_pending = 0, log_offset = ?5, log_generation = ?6, \
                 worker_pidfs_ino = ?7 \
                 WHERE id = ?1 AND spawned_pid IS NULL",
            )?
            .execute(params![
                run_id,
                pid,
                fp.map(|f| f.boot_id.as_str()),
                fp.map(|f| f.start_ticks as i64),
                log.map(|l| i64::try_from(l.offset).unwrap_or(i64::MAX)),
                log.and_then(|l| l.generation.as_deref()),
                fp.and_then(|f| f.pidfs_ino)
                    .map(super::types::ino_to_column),
            ])?;
        let updated = if changed == 0 {
            None
        } else {
            self.conn
                .prepare_cached("SELECT task_id, outcome, ended_at FROM task_runs WHERE id = ?1")?
                .query_row([run_id], |r| {
                    Ok((
                        r.get::<_, TaskId>(0)?,
                        r.get::<_, Option<String>>(1)?,
                        r.get::<_, Option<Millis>>(2)?,
                    ))
                })
                .optional()?
        };
        let Some((task_id, outcome, ended_at)) = updated else {
            return Ok(None);
        };
        self.append_event(
            Some(task_id),
            Some(run_id),
            "worker_spawned",
            json!({
                "pid": pid,
                "boot_id": fp.map(|f| &f.boot_id),
                "start_ticks": fp.map(|f| f.start_ticks),
                "pidfs_ino": fp.and_then(|f| f.pidfs_ino),
            }),
            now,
        )?;
        let outcome = outcome
            .map(|o| o.parse::<RunOutcome>())
            .transpose()
            .map_err(BoardError::Invalid)?;
        Ok(Some(outcome.zip(ended_at)))
    }

    /// Says that the worker of a run claimed with [`Tx::claim_task_to_spawn`] will never run
    /// (its spawn failed, or it was never attempted and nothing carries the run's token): the
    /// run stops holding its task and its slot. True if it was pending.
    pub fn settle_spawn(&self, run_id: RunId) -> Result<bool> {
        Ok(self
            .conn
            .prepare_cached(
                "UPDATE task_runs SET spawn_pending = 0 WHERE id = ?1 AND spawn_pending = 1",
            )?
            .execute([run_id])?
            == 1)
    }

    /// Checks that `token` is `run_id`'s token and that the run is still its task's current
    /// run. A worker holding a token of an older, reclaimed run gets `StaleRun`.
    pub fn authorize_run(&self, task_id: TaskId, run_id: RunId, token: &str) -> Result<Run> {
        let run = self.get_run(run_id)?;
        if run.task_id != task_id || !constant_time_eq(run.token.as_bytes(), token.as_bytes()) {
            return Err(BoardError::Unauthorized(format!(
                "the token is not valid for run {run_id} of task {task_id}"
            )));
        }
        let task = self.get_task(task_id)?;
        if task.current_run_id != Some(run_id) || run.ended_at.is_some() {
            return Err(self.stale(task_id, run_id, task.current_run_id));
        }
        Ok(run)
    }

    fn stale(&self, task: TaskId, expected: RunId, current: Option<RunId>) -> BoardError {
        BoardError::StaleRun {
            task,
            expected,
            current: current.map_or_else(|| "none".to_string(), |c| c.to_string()),
        }
    }

    /// Refreshes a live run's heartbeat and extends its lease to `now + lease_ms`.
    pub fn heartbeat(
        &self,
        run_id: RunId,
        note: Option<&str>,
        now: Millis,
        lease_ms: i64,
    ) -> Result<()> {
        let run = self.get_run(run_id)?;
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE task_runs SET heartbeat_at = ?2, lease_expires_at = max(lease_expires_at, ?3), \
                 silence_ms = 0 WHERE id = ?1 AND ended_at IS NULL",
            )?
            .execute(params![run_id, now, now + lease_ms])?;
        if changed != 1 {
            return Err(self.stale(run.task_id, run_id, None));
        }
        self.append_event(
            Some(run.task_id),
            Some(run_id),
            "heartbeat",
            json!({ "note": note }),
            now,
        )?;
        Ok(())
    }

    /// Extends a live run's lease without a heartbeat (the supervisor vouching for its own
    /// live child), recording `silence_ms`: how long the supervisors watching it have heard
    /// nothing from its worker (see [`Run::silence_ms`]). Returns false if the run is no
    /// longer open.
    pub fn extend_lease(
        &self,
        run_id: RunId,
        now: Millis,
        lease_ms: i64,
        silence_ms: i64,
    ) -> Result<bool> {
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE task_runs SET lease_expires_at = max(lease_expires_at, ?2), silence_ms = ?3 \
                 WHERE id = ?1 AND ended_at IS NULL",
            )?
            .execute(params![run_id, now + lease_ms, silence_ms.max(0)])?;
        Ok(changed == 1)
    }

    /// The task's current run, checked against `expected` (a worker's view of which run it is).
    fn current_run_checked(
        &self,
        task_id: TaskId,
        expected: Option<RunId>,
    ) -> Result<(TaskStatus, Option<RunId>)> {
        let (status, current) = self.task_state(task_id)?;
        if let Some(exp) = expected
            && current != Some(exp)
        {
            return Err(self.stale(task_id, exp, current));
        }
        let run = if status == TaskStatus::Running {
            current
        } else {
            None
        };
        Ok((status, run))
    }

    /// Marks a task done. Its open run (if any) closes `completed` and KEEPS its worker pid and
    /// fingerprint: a worker that reports and then hangs must stay reachable by the reaper.
    /// With `expected_run`, refuses (`StaleRun`) unless that run is still the current one.
    pub fn complete_task(
        &self,
        task_id: TaskId,
        expected_run: Option<RunId>,
        result: Option<&str>,
        now: Millis,
    ) -> Result<Option<ClosedRun>> {
        let (status, run) = self.current_run_checked(task_id, expected_run)?;
        if matches!(status, TaskStatus::Done | TaskStatus::Archived) {
            return Err(BoardError::Conflict(format!(
                "task {task_id} is already {status}"
            )));
        }
        let closed = match run {
            Some(run_id) => {
                Some(self.close_run(run_id, RunOutcome::Completed, now, result, None)?)
            }
            None => None,
        };
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE tasks SET status = 'done', result = ?2, completed_at = ?3, updated_at = ?3, \
                 current_run_id = NULL, consecutive_failures = 0, block_reason = NULL \
                 WHERE id = ?1 AND status = ?4",
            )?
            .execute(params![task_id, result, now, status.as_str()])?;
        changed_one(changed, task_id)?;
        self.append_event(
            Some(task_id),
            run,
            "completed",
            json!({ "result": result, "from": status }),
            now,
        )?;
        self.promote_children(task_id, now)?;
        Ok(closed)
    }

    /// Blocks a task (worker or operator). Its open run closes `blocked`, keeping its evidence.
    pub fn block_task(
        &self,
        task_id: TaskId,
        expected_run: Option<RunId>,
        reason: &str,
        now: Millis,
    ) -> Result<Option<ClosedRun>> {
        let (status, run) = self.current_run_checked(task_id, expected_run)?;
        if matches!(
            status,
            TaskStatus::Done | TaskStatus::Archived | TaskStatus::Blocked
        ) {
            return Err(BoardError::Conflict(format!(
                "task {task_id} is already {status}"
            )));
        }
        let closed = match run {
            Some(run_id) => {
                Some(self.close_run(run_id, RunOutcome::Blocked, now, None, Some(reason))?)
            }
            None => None,
        };
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE tasks SET status = 'blocked', block_reason = ?2, updated_at = ?3, \
                 current_run_id = NULL WHERE id = ?1 AND status = ?4",
            )?
            .execute(params![task_id, reason, now, status.as_str()])?;
        changed_one(changed, task_id)?;
        self.append_event(
            Some(task_id),
            run,
            "blocked",
            json!({ "reason": reason }),
            now,
        )?;
        Ok(closed)
    }

    /// Releases a running task back to `ready`; its run closes `reclaimed` (evidence kept, so
    /// the worker is ended by the caller or the reaper).
    pub fn reclaim_task(&self, task_id: TaskId, reason: &str, now: Millis) -> Result<ClosedRun> {
        let (status, run) = self.current_run_checked(task_id, None)?;
        let Some(run_id) = run else {
            return Err(BoardError::Conflict(format!(
                "task {task_id} is {status}, not running"
            )));
        };
        let closed = self.close_run(run_id, RunOutcome::Reclaimed, now, None, Some(reason))?;
        let next = if self.parents_satisfied(task_id)? {
            TaskStatus::Ready
        } else {
            TaskStatus::Todo
        };
        self.conn
            .prepare_cached(
                "UPDATE tasks SET status = ?2, current_run_id = NULL, updated_at = ?3 \
                 WHERE id = ?1 AND status = 'running'",
            )?
            .execute(params![task_id, next.as_str(), now])?;
        self.append_event(
            Some(task_id),
            Some(run_id),
            "reclaimed",
            json!({ "reason": reason, "status": next }),
            now,
        )?;
        Ok(closed)
    }

    /// Closes a failed run (crash, timeout, spawn failure, stale) and decides the task's fate:
    /// back to `ready` after a backoff, or `blocked` with a `gave_up` event once the retries
    /// are used up.
    pub fn fail_run(&self, run_id: RunId, failure: &Failure, now: Millis) -> Result<FailResult> {
        let run = self.get_run(run_id)?;
        let task = self.get_task(run.task_id)?;
        if task.current_run_id != Some(run_id) || run.ended_at.is_some() {
            return Err(self.stale(run.task_id, run_id, task.current_run_id));
        }
        let closed = self.close_run(run_id, failure.outcome, now, None, Some(&failure.error))?;
        self.conn
            .prepare_cached("UPDATE task_runs SET exit_code = coalesce(?2, exit_code), exit_signal = coalesce(?3, exit_signal) WHERE id = ?1")?
            .execute(params![run_id, failure.exit_code, failure.exit_signal])?;
        let failures = task.consecutive_failures + i64::from(failure.counts);
        let max_retries = task.max_retries.unwrap_or(failure.default_max_retries);
        let give_up = failure.give_up_now || failures > max_retries;
        let (status, not_before) = if give_up {
            (TaskStatus::Blocked, 0)
        } else if self.parents_satisfied(task.id)? {
            (TaskStatus::Ready, now + failure.backoff_ms)
        } else {
            (TaskStatus::Todo, now + failure.backoff_ms)
        };
        self.conn
            .prepare_cached(
                "UPDATE tasks SET status = ?2, current_run_id = NULL, consecutive_failures = ?3, \
                 not_before = ?4, block_reason = ?5, updated_at = ?6 WHERE id = ?1 AND status = 'running'",
            )?
            .execute(params![
                task.id,
                status.as_str(),
                failures,
                not_before,
                give_up.then_some(failure.error.as_str()),
                now
            ])?;
        if give_up {
            self.append_event(
                Some(task.id),
                Some(run_id),
                "gave_up",
                json!({
                    "last_error": failure.error,
                    "failures": failures,
                    "max_retries": max_retries,
                    "outcome": failure.outcome,
                    // Why now: an exit code in `fail_exit_codes` ends the retries whatever
                    // their count says.
                    "reason": if failure.give_up_now { "fail_exit_code" } else { "retries_exhausted" },
                }),
                now,
            )?;
        } else {
            self.append_event(
                Some(task.id),
                Some(run_id),
                "retry_scheduled",
                json!({ "not_before": not_before, "failures": failures, "counted": failure.counts, "outcome": failure.outcome, "status": status }),
                now,
            )?;
        }
        Ok(FailResult {
            closed,
            status,
            consecutive_failures: failures,
            not_before,
        })
    }

    /// Records how the worker process of a run ended (it was our child and we reaped it): its
    /// exit code or signal, and clears the worker evidence, since that pid is now provably gone.
    ///
    /// With `group_alive`, the leader is gone but members of its group (or its escaped
    /// descendants) may still run: the evidence is kept — so the task cannot be claimed again
    /// beside them — and is cleared by `clear_worker_evidence` once the tree is ended.
    pub fn record_worker_exit(
        &self,
        run_id: RunId,
        exit: ExitInfo,
        group_alive: bool,
        now: Millis,
    ) -> Result<RecordedExit> {
        // A plain UPDATE, then the row by its key: `RETURNING` costs an ephemeral table per
        // execution, more than the second lookup (measured).
        let sql = if group_alive {
            "UPDATE task_runs SET exit_code = ?2, exit_signal = ?3 WHERE id = ?1"
        } else {
            "UPDATE task_runs SET exit_code = ?2, exit_signal = ?3, worker_pid = NULL, \
             worker_boot_id = NULL, worker_start_ticks = NULL, worker_pidfs_ino = NULL WHERE id = ?1"
        };
        self.conn
            .prepare_cached(sql)?
            .execute(params![run_id, exit.code, exit.signal])?;
        // Two columns, not the whole row (its strings cost more than the UPDATE; once per
        // lifecycle).
        let sql = "SELECT task_id, ended_at FROM task_runs WHERE id = ?1";
        let run = self.run_fields(run_id, sql, |r| {
            Ok(RecordedExit {
                task_id: r.get(0)?,
                ended_at: r.get(1)?,
            })
        })?;
        self.append_event(
            Some(run.task_id),
            Some(run_id),
            "worker_exited",
            json!({ "code": exit.code, "signal": exit.signal, "run_open": run.is_open() }),
            now,
        )?;
        Ok(run)
    }

    /// Closes an open run with `outcome` and appends `run_closed` carrying the worker evidence.
    pub(super) fn close_run(
        &self,
        run_id: RunId,
        outcome: RunOutcome,
        now: Millis,
        summary: Option<&str>,
        error: Option<&str>,
    ) -> Result<ClosedRun> {
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE task_runs SET outcome = ?2, ended_at = ?3, summary = ?4, error = ?5 \
                 WHERE id = ?1 AND ended_at IS NULL",
            )?
            .execute(params![run_id, outcome.as_str(), now, summary, error])?;
        // Only what the closing needs (the whole row, strings and all, cost as much as the
        // UPDATE itself, once per lifecycle).
        let sql = "SELECT task_id, worker_pid, worker_boot_id, worker_start_ticks, worker_pidfs_ino \
                   FROM task_runs WHERE id = ?1";
        let (task_id, pid, boot_id, start_ticks, pidfs_ino) =
            self.run_fields(run_id, sql, |r| {
                Ok((
                    r.get::<_, TaskId>(0)?,
                    r.get::<_, Option<i64>>(1)?,
                    r.get::<_, Option<String>>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                    r.get::<_, Option<i64>>(4)?,
                ))
            })?;
        if changed == 0 {
            return Err(BoardError::Conflict(format!(
                "run {run_id} is already closed"
            )));
        }
        let closed = ClosedRun {
            task_id,
            run_id,
            outcome,
            ended_at: now,
            pid: pid.and_then(|p| i32::try_from(p).ok()),
            fingerprint: super::types::fingerprint_of(boot_id, start_ticks, pidfs_ino),
        };
        self.append_event(
            Some(task_id),
            Some(run_id),
            "run_closed",
            json!({
                "outcome": outcome,
                "pid": closed.pid,
                "boot_id": closed.fingerprint.as_ref().map(|f| &f.boot_id),
                "start_ticks": closed.fingerprint.as_ref().map(|f| f.start_ticks),
                "pidfs_ino": closed.fingerprint.as_ref().and_then(|f| f.pidfs_ino),
                "error": error,
            }),
            now,
        )?;
        Ok(closed)
    }

    /// Clears a run's worker evidence if it still holds exactly `pid` + `fp` (compare-and-swap
    /// on the values read, so a concurrent change is never overwritten), appending `kind`.
    pub fn clear_worker_evidence(
        &self,
        run_id: RunId,
        pid: i32,
        fp: Option<&Fingerprint>,
        kind: &str,
        payload: serde_json::Value,
        now: Millis,
    ) -> Result<bool> {
        let run = self.get_run(run_id)?;
        // `IS` compares NULLs too: a legacy worker without a fingerprint is cleared by the
        // owner that watched it exit.
        let changed = self
            .conn
            .prepare_cached(
                "UPDATE task_runs SET worker_pid = NULL, worker_boot_id = NULL, worker_start_ticks = NULL, \
                 worker_pidfs_ino = NULL WHERE id = ?1 AND worker_pid = ?2 AND worker_boot_id IS ?3 AND worker_start_ticks IS ?4",
            )?
            .execute(params![
                run_id,
                pid,
                fp.map(|f| f.boot_id.as_str()),
                fp.map(|f| f.start_ticks as i64)
            ])?;
        if changed == 1 {
            self.append_event(Some(run.task_id), Some(run_id), kind, payload, now)?;
        }
        Ok(changed == 1)
    }
}

/// Token comparison whose time does not depend on where the first difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
