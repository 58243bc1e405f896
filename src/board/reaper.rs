//! The terminal-worker reaper: ends workers that outlive their own run.
//!
//! `complete_task` clears nothing the reaper needs: the closed run row keeps the worker's pid
//! and spawn fingerprint. A worker that reported "done" and then hung is therefore still
//! reachable, and this sweep ends it once the run has been closed for `grace` — never a
//! recycled pid (fingerprint mismatch), never a legacy row without a fingerprint.

use std::time::Duration;

use rusqlite::params;
use serde_json::json;

use super::types::{Millis, RunId, RunOutcome, TaskId};
use super::{Board, Result, Tx};
use crate::process::descendants::CarriersEnded;
use crate::process::{self, Begun, DeadReason, Ended, Fingerprint, Liveness, Signaller};

/// A closed run that still holds worker evidence and whose grace has passed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReapCandidate {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub pid: i32,
    pub fingerprint: Fingerprint,
    pub ended_at: Millis,
    /// The run's token, to find descendants that escaped the worker's group.
    pub token: Option<String>,
    /// How the run closed, when known: a worker that closed its own run (`completed`,
    /// `blocked`) had a grace; one closed by force is wanted gone at once.
    pub outcome: Option<RunOutcome>,
}

impl ReapCandidate {
    /// Whether its worker closed the run itself (reported `completed` or `blocked`), so that
    /// ending it now is a terminal reap after its grace, not the end of a forced close.
    pub fn closed_by_its_worker(&self) -> bool {
        self.outcome.is_some_and(RunOutcome::closed_by_its_worker)
    }
}

/// One reap: the verdict on the recorded leader, and what of its tree outside its group
/// (descendants carrying the run's token) was ended with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reap {
    pub verdict: ReapVerdict,
    /// `None` when they were not looked for (no token, or an `Unknown` verdict).
    pub escapees: Option<CarriersEnded>,
}

/// What happened to one candidate; the evidence is cleared for every verdict but `Unknown`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReapVerdict {
    /// Alive and ours: its group was ended.
    Reaped(Ended),
    /// Already gone (or a zombie, or from another boot): nothing to signal.
    Gone(DeadReason),
    /// The pid now belongs to another process: never signalled.
    Recycled,
    /// Could not tell: left alone, re-checked on a later sweep.
    Unknown(String),
}

impl Tx<'_> {
    /// Closed runs still holding worker evidence whose task is archived: their workers are due
    /// at once, whatever their grace (archiving puts the task away, a hung worker with it).
    /// Through the `runs_evidence` partial index, as [`Self::terminal_reap_candidates`].
    pub fn archived_runs_with_evidence(&self) -> Result<std::collections::HashSet<RunId>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT r.id FROM task_runs r JOIN tasks t ON t.id = r.task_id \
             WHERE r.ended_at IS NOT NULL AND r.worker_pid IS NOT NULL \
               AND t.status = 'archived'",
        )?;
        let ids = stmt.query_map([], |r| r.get(0))?;
        Ok(ids.collect::<rusqlite::Result<_>>()?)
    }

    /// Closed runs with worker evidence whose worker is due: a run its worker closed itself
    /// (`completed`, `blocked`) after `grace`, a run closed by force (archived, reclaimed,
    /// timed out, stale, crashed) at once. Rows without a complete fingerprint (legacy) are
    /// never selected. Uses the `runs_evidence` partial index, so the cost follows the rows
    /// still holding evidence, not the history. A row that cannot be decoded is logged and
    /// skipped, never allowed to stop the sweep.
    pub fn terminal_reap_candidates(
        &self,
        now: Millis,
        grace_ms: i64,
    ) -> Result<Vec<ReapCandidate>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT id, task_id, worker_pid, worker_boot_id, worker_start_ticks, ended_at, token, \
                    outcome, worker_pidfs_ino \
             FROM task_runs \
             WHERE ended_at IS NOT NULL AND worker_pid IS NOT NULL AND ended_at <= ?1 \
               AND ended_at <= ?1 - CASE WHEN outcome IN ('completed', 'blocked') THEN ?2 ELSE 0 END \
               AND worker_boot_id IS NOT NULL AND worker_start_ticks IS NOT NULL \
             ORDER BY ended_at",
        )?;
        let rows = stmt.query_map(params![now, grace_ms], |r| {
            Ok(ReapCandidate {
                run_id: r.get(0)?,
                task_id: r.get(1)?,
                pid: r.get(2)?,
                fingerprint: Fingerprint {
                    boot_id: r.get(3)?,
                    start_ticks: u64::try_from(r.get::<_, i64>(4)?).map_err(|e| {
                        rusqlite::Error::FromSqlConversionFailure(
                            4,
                            rusqlite::types::Type::Integer,
                            e.into(),
                        )
                    })?,
                    pidfs_ino: r
                        .get::<_, Option<i64>>(8)?
                        .map(super::types::ino_from_column),
                },
                ended_at: r.get(5)?,
                token: r.get(6)?,
                // An outcome this build does not know is only "not known" here.
                outcome: r.get::<_, Option<String>>(7)?.and_then(|o| o.parse().ok()),
            })
        })?;
        Ok(rows
            .filter_map(|row| match row {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "terminal reaper: skipping an undecodable run row");
                    None
                }
            })
            .collect())
    }

    /// Writes the outcome of one reap decision: clears the evidence (compare-and-swap on the
    /// values read) and appends the event that says why. `Unknown` writes nothing. A leader
    /// already gone whose escaped descendants were ended has that said too, as for any
    /// worker whose tree outlived it (`worker_group_ended`, after the leader's event).
    pub fn record_reap(&self, c: &ReapCandidate, reap: &Reap, now: Millis) -> Result<bool> {
        let verdict = &reap.verdict;
        let base = json!({
            "pid": c.pid,
            "boot_id": c.fingerprint.boot_id,
            "start_ticks": c.fingerprint.start_ticks,
            "ended_at": c.ended_at,
        });
        let with = |key: &str, value: &str| {
            let mut p = base.clone();
            p[key] = json!(value);
            p
        };
        let (kind, payload) = match verdict {
            ReapVerdict::Reaped(how) => ("terminal_worker_reaped", with("ended_by", how.as_str())),
            ReapVerdict::Gone(reason) => ("terminal_worker_gone", with("reason", reason.as_str())),
            ReapVerdict::Recycled => ("terminal_worker_pid_recycled", base.clone()),
            ReapVerdict::Unknown(_) => return Ok(false),
        };
        let cleared =
            self.clear_worker_evidence(c.run_id, c.pid, Some(&c.fingerprint), kind, payload, now)?;
        if cleared
            && let Some(ended) = reap.escapees
            && ended.count > 0
            && !matches!(verdict, ReapVerdict::Reaped(_))
        {
            let how = if ended.sigkill { "sigkill" } else { "sigterm" };
            self.append_event(
                Some(c.task_id),
                Some(c.run_id),
                "worker_group_ended",
                json!({ "pid": c.pid, "ended_by": how }),
                now,
            )?;
        }
        Ok(cleared)
    }
}

impl Tx<'_> {
    /// Records what the tick's sweep for strays ended (`stray_descendants_ended`): processes
    /// that carried a finished run's token and turned up re-parented to the supervisor after
    /// its worker's tree had been ended. Every process the supervisor signals is on the
    /// record. Nothing is written for a run no longer on the board (pruned meanwhile).
    pub fn record_strays_ended(
        &self,
        run_id: RunId,
        pids: &[process::Pid],
        sigkill: bool,
        now: Millis,
    ) -> Result<()> {
        let task_id = match self.get_run(run_id) {
            Ok(run) => run.task_id,
            Err(super::BoardError::NotFound { .. }) => return Ok(()),
            Err(e) => return Err(e),
        };
        let how = if sigkill { "sigkill" } else { "sigterm" };
        self.append_event(
            Some(task_id),
            Some(run_id),
            "stray_descendants_ended",
            json!({ "pids": pids, "ended_by": how }),
            now,
        )?;
        Ok(())
    }
}

/// Decides and acts on one candidate: probes liveness, and ends the group only when the
/// process is provably the one recorded. Errors (signal failures) are returned to the caller,
/// which logs and skips the row.
pub fn reap_one(
    c: &ReapCandidate,
    signaller: &dyn Signaller,
    kill_timeout: Duration,
) -> std::result::Result<Reap, process::ProcessError> {
    // `begin_terminate` verifies identity itself (through a pidfd) and signals nothing that is
    // not provably the recorded process; a zombie leader with live group members is still ended.
    // Descendants that left the group (setsid) carry the run's token, and outlive a leader
    // already reaped by its parent.
    let token = c.token.as_deref();
    let (verdict, escapees) =
        match process::begin_terminate(signaller, c.pid, &c.fingerprint, kill_timeout)? {
            // The leader's SIGTERM is out: its escapees get theirs now, and one deadline for
            // the whole tree.
            Begun::Signalled(leader) => match token {
                Some(token) => {
                    let (ended, carriers) = process::descendants::finish_tree_end(leader, token)?;
                    (verdict_of(ended), Some(carriers))
                }
                None => (verdict_of(leader.finish()?), None),
            },
            Begun::NotOurs(l) => {
                let verdict = verdict_for(l);
                // Not for Unknown: nothing is decided about that run. One that survives
                // SIGKILL fails the row: its evidence stays, the next sweep retries.
                let escapees = match token {
                    Some(token) if !matches!(verdict, ReapVerdict::Unknown(_)) => Some(
                        process::descendants::end_token_carriers(token, kill_timeout)?,
                    ),
                    _ => None,
                };
                (verdict, escapees)
            }
        };
    Ok(Reap { verdict, escapees })
}

fn verdict_of(ended: Ended) -> ReapVerdict {
    match ended {
        Ended::NotOurs(l) => verdict_for(l),
        how => ReapVerdict::Reaped(how),
    }
}

fn verdict_for(l: Liveness) -> ReapVerdict {
    match l {
        Liveness::Alive => ReapVerdict::Unknown("alive but not verifiable through a pidfd".into()),
        Liveness::Dead(DeadReason::Recycled) => ReapVerdict::Recycled,
        Liveness::Dead(reason) => ReapVerdict::Gone(reason),
        Liveness::Unknown(why) => ReapVerdict::Unknown(why),
    }
}

/// The sweep: ends every worker that outlived its run by more than `grace`, and returns the
/// tasks whose worker it ended. One failing row is logged and skipped; the others go on.
/// Signalling happens outside any transaction (a kill may wait `kill_timeout`); each verdict
/// is then written in its own short transaction.
pub fn reap_terminal_workers(
    board: &mut Board,
    signaller: &dyn Signaller,
    now: Millis,
    grace: Duration,
    kill_timeout: Duration,
) -> Result<Vec<TaskId>> {
    let candidates = board.read(|tx| tx.terminal_reap_candidates(now, grace.as_millis() as i64))?;
    let mut reaped = Vec::new();
    for c in &candidates {
        let reap = match reap_one(c, signaller, kill_timeout) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(run_id = c.run_id, pid = c.pid, error = %e, "terminal reaper: skipping run");
                continue;
            }
        };
        if let ReapVerdict::Unknown(why) = &reap.verdict {
            tracing::debug!(run_id = c.run_id, pid = c.pid, %why, "terminal reaper: liveness unknown, kept");
            continue;
        }
        match board.write(|tx| tx.record_reap(c, &reap, now)) {
            Ok(_) if matches!(reap.verdict, ReapVerdict::Reaped(_)) => reaped.push(c.task_id),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(run_id = c.run_id, error = %e, "terminal reaper: cannot record verdict")
            }
        }
    }
    Ok(reaped)
}
