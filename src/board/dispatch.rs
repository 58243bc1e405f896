//! One synchronous dispatch pass, usable without the actor runtime (tests, offline tools).
//!
//! The running supervisor splits these phases across its actors; this function runs them in
//! order on one board: terminal reaping, promotion, then claiming (and spawning through a
//! caller-supplied function) within the caps.

use std::collections::BTreeMap;
use std::time::Duration;

use super::reaper::reap_terminal_workers;
use super::types::{Claim, Millis, RunId, TaskId};
use super::{Board, Result};
use crate::process::{Fingerprint, Signaller};

/// Spawns the worker of a claimed run; returns its pid and fingerprint.
pub type SpawnFn<'a> =
    dyn FnMut(&Claim) -> std::result::Result<(i32, Option<Fingerprint>), String> + 'a;

/// Parameters of [`dispatch_once`].
pub struct DispatchOptions<'a> {
    pub now: Millis,
    /// Who claims (recorded on the run).
    pub claimer: &'a str,
    /// Claim and spawn nothing; only sweep.
    pub dry_run: bool,
    /// Most runs to start in this pass.
    pub max_spawn: u32,
    /// Global cap on live workers (slot-holding runs: see `Tx::slot_holders_by_assignee`).
    pub max_in_progress: u32,
    /// Per-assignee caps; tasks of an assignee not listed here are not claimed.
    pub assignee_caps: BTreeMap<String, u32>,
    pub lease: Duration,
    /// Retries allowed for a task that sets none (a spawn failure counts as one).
    pub default_max_retries: i64,
    pub grace: Duration,
    pub kill_timeout: Duration,
    pub signaller: &'a dyn Signaller,
    pub spawn: &'a mut SpawnFn<'a>,
}

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// Tasks whose terminal worker was ended.
    pub reaped_terminal_workers: Vec<TaskId>,
    /// Tasks promoted from `todo` to `ready`.
    pub promoted: Vec<TaskId>,
    /// Runs opened (and spawned) in this pass.
    pub claimed: Vec<(TaskId, RunId)>,
    /// Runs whose spawn failed (closed `spawn_failed`).
    pub spawn_failed: Vec<(TaskId, RunId)>,
}

/// Runs one pass over the board. See the module doc.
pub fn dispatch_once(board: &mut Board, opts: DispatchOptions<'_>) -> Result<DispatchReport> {
    let mut report = DispatchReport {
        reaped_terminal_workers: reap_terminal_workers(
            board,
            opts.signaller,
            opts.now,
            opts.grace,
            opts.kill_timeout,
        )?,
        ..DispatchReport::default()
    };
    report.promoted = board.write(|tx| tx.promote_ready(opts.now))?;
    if opts.dry_run || opts.max_spawn == 0 {
        return Ok(report);
    }
    let now = opts.now;
    let rules = ClaimRules {
        caps: opts.assignee_caps.clone(),
        max_in_progress: opts.max_in_progress,
        claimer: opts.claimer.to_string(),
        lease_ms: opts.lease.as_millis() as i64,
    };
    let claimed = board.write(|tx| tx.claim_ready(now, &rules, opts.max_spawn))?;
    for (claim, _) in claimed {
        let task_id = claim.task_id;
        match (opts.spawn)(&claim) {
            Ok((pid, fp)) => {
                board.write(|tx| tx.set_worker(claim.run_id, pid, fp.as_ref(), None, now))?;
                report.claimed.push((task_id, claim.run_id));
            }
            Err(error) => {
                board.write(|tx| {
                    tx.settle_spawn(claim.run_id)?;
                    if !tx.get_run(claim.run_id)?.is_open() {
                        // Closed meanwhile (another writer): nothing to fail, the rest goes on.
                        return Ok(());
                    }
                    tx.fail_run(
                        claim.run_id,
                        &super::Failure {
                            outcome: super::RunOutcome::SpawnFailed,
                            exit_code: None,
                            exit_signal: None,
                            error,
                            default_max_retries: opts.default_max_retries,
                            backoff_ms: 0,
                            counts: true,
                            give_up_now: false,
                        },
                        now,
                    )?;
                    Ok(())
                })?;
                report.spawn_failed.push((task_id, claim.run_id));
            }
        }
    }
    Ok(report)
}

/// The assignees (of `caps`) with fewer slot-holding runs than their cap: the only ones whose ready
/// tasks a pass should look at (see [`super::Tx::ready_candidates_for`]).
pub fn assignees_with_room(
    open_by_assignee: &BTreeMap<String, u32>,
    caps: &BTreeMap<String, u32>,
) -> Vec<String> {
    caps.iter()
        .filter(|(name, cap)| open_by_assignee.get(*name).copied().unwrap_or(0) < **cap)
        .map(|(name, _)| name.clone())
        .collect()
}

/// Picks which candidates to claim: in the given (priority) order, skipping assignees that are
/// unknown or at their cap, stopping at the global cap or `max_spawn`.
pub fn plan_claims(
    candidates: &[super::Task],
    open_by_assignee: &BTreeMap<String, u32>,
    max_in_progress: u32,
    caps: &BTreeMap<String, u32>,
    max_spawn: u32,
) -> Result<Vec<TaskId>> {
    let mut open: BTreeMap<String, u32> = open_by_assignee.clone();
    let mut total: u32 = open.values().sum();
    let mut out = Vec::new();
    for task in candidates {
        if total >= max_in_progress || out.len() as u32 >= max_spawn {
            break;
        }
        let Some(assignee) = task.assignee.as_deref() else {
            continue;
        };
        let Some(&cap) = caps.get(assignee) else {
            continue;
        };
        let used = open.entry(assignee.to_string()).or_insert(0);
        if *used >= cap {
            continue;
        }
        *used += 1;
        total += 1;
        out.push(task.id);
    }
    Ok(out)
}

/// What a claim must respect: the caps, and who claims for how long.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRules {
    /// Per-assignee caps; tasks of an assignee not listed here are not claimed.
    pub caps: BTreeMap<String, u32>,
    /// Global cap on live workers (slot-holding runs: see `Tx::slot_holders_by_assignee`).
    pub max_in_progress: u32,
    /// Who claims (recorded on the run).
    pub claimer: String,
    /// The claim's lease.
    pub lease_ms: i64,
}

impl super::Tx<'_> {
    /// Claims ready tasks — priority first, then age — within the global and per-assignee caps,
    /// at most `max_claims`. The one claiming routine: dispatch passes, claims on close, and
    /// [`dispatch_once`] all use it.
    pub fn claim_ready(
        &self,
        now: super::Millis,
        rules: &ClaimRules,
        max_claims: u32,
    ) -> Result<Vec<(Claim, super::Task)>> {
        let open = self.slot_holders_by_assignee()?;
        // Only assignees with a free slot: a full assignee's long backlog must not fill the
        // candidate list and starve the others (head-of-line blocking).
        let with_room = assignees_with_room(&open, &rules.caps);
        // Read no more rows than can be claimed: per assignee with room, at most its free slots
        // (and the global free slots), merged back in claim order.
        let free = rules
            .max_in_progress
            .saturating_sub(open.values().sum::<u32>())
            .min(max_claims);
        if free == 0 {
            return Ok(Vec::new());
        }
        let mut candidates = Vec::new();
        for name in &with_room {
            let room = rules.caps[name].saturating_sub(open.get(name).copied().unwrap_or(0));
            candidates.extend(self.ready_candidates_for(
                now,
                std::slice::from_ref(name),
                room.min(free),
            )?);
        }
        candidates.sort_by_key(|t| (std::cmp::Reverse(t.priority), t.created_at, t.id));
        let plan = plan_claims(&candidates, &open, rules.max_in_progress, &rules.caps, free)?;
        let mut claimed = Vec::new();
        for task in candidates.into_iter().filter(|t| plan.contains(&t.id)) {
            // No savepoint per claim (each costs a copy of every page it touches): a claim is
            // refused by its checks, before it writes anything. One that failed after writing
            // (an I/O error) fails the whole pass instead, undone by its caller: a savepoint, or
            // the batch's second attempt (see `Board::write_batch`).
            let before = self.conn.total_changes();
            match self.claim_candidate_to_spawn(&task, &rules.claimer, now, rules.lease_ms) {
                Ok(claim) => claimed.push((claim, task)),
                // (An error that rolled the whole transaction back leaves autocommit on.)
                Err(e) if self.conn.total_changes() != before || self.conn.is_autocommit() => {
                    return Err(e);
                }
                Err(e) => {
                    tracing::debug!(task_id = task.id, error = %e, "claim refused");
                    // A task whose parent reopened is demoted here, after the refused claim
                    // (which wrote nothing), so it leaves `ready` for good.
                    if self.demote_if_waiting(task.id, now)? {
                        tracing::info!(task_id = task.id, "a parent reopened; demoted to todo");
                    }
                }
            }
        }
        Ok(claimed)
    }
}
