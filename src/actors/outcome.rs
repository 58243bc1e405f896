//! What a worker's end means for its run: the exit policy, and the store ops that record an
//! exit, a spawn failure or a timeout atomically (record + close + decide retry in one
//! transaction).

use std::path::PathBuf;
use std::time::Duration;

use rand::Rng;
use serde_json::json;

use super::dispatcher::{ClaimParams, claim_ready};
use super::spawn::{LogStart, SpawnError};
use super::store::{Store, StoreError};
use super::worker::TerminateReason;
use crate::board::{self, Claim, ExitInfo, Failure, Millis, RunId, RunOutcome, Task, TaskId, Tx};
use crate::config::{AssigneeConfig, Config, OnExitZero};
use crate::process::ExitStatus;
use crate::process::Fingerprint;

/// How many bytes of the log's end go into a crashed run's `error`.
pub(crate) const LOG_TAIL_BYTES: u64 = 400;

/// Per-assignee rules for interpreting a worker's end.
#[derive(Debug, Clone)]
pub struct ExitPolicy {
    pub on_exit_zero: OnExitZero,
    pub retry_exit_codes: Vec<i32>,
    pub fail_exit_codes: Vec<i32>,
    pub retry_cooldown: Duration,
    pub max_retries: u32,
    pub backoff: Duration,
    pub backoff_max: Duration,
}

impl ExitPolicy {
    /// The policy of an assignee no longer in the config (its runs still fail by the rules).
    pub fn defaults(config: &Config) -> Self {
        ExitPolicy {
            on_exit_zero: OnExitZero::Complete,
            retry_exit_codes: Vec::new(),
            fail_exit_codes: Vec::new(),
            retry_cooldown: Duration::ZERO,
            max_retries: config.retries.max_retries,
            backoff: config.retries.backoff,
            backoff_max: config.retries.backoff_max,
        }
    }

    /// The policy for `assignee` under `config`.
    pub fn new(config: &Config, assignee: &AssigneeConfig) -> Self {
        ExitPolicy {
            on_exit_zero: assignee.on_exit_zero,
            retry_exit_codes: assignee.retry_exit_codes.clone(),
            fail_exit_codes: assignee.fail_exit_codes.clone(),
            retry_cooldown: assignee.retry_cooldown,
            max_retries: assignee.max_retries.unwrap_or(config.retries.max_retries),
            backoff: config.retries.backoff,
            backoff_max: config.retries.backoff_max,
        }
    }

    /// Exponential backoff with ±20 % jitter (so failed tasks do not retry in lock-step),
    /// never over `backoff_max`: at the cap it is drawn from the 20 % under it, rather than
    /// clamped to it (which put half of the capped retries on the very same delay).
    /// `failures` is the count including this failure.
    pub fn backoff_ms(&self, failures: i64) -> i64 {
        let exp = failures.clamp(1, 30) - 1;
        let max = self.backoff_max.as_millis() as f64;
        let capped = (self.backoff.as_millis() as f64 * 2f64.powi(exp as i32)).min(max);
        let (low, high) = (capped * 0.8, (capped * 1.2).min(max));
        rand::thread_rng().gen_range(low..=high).max(0.0) as i64
    }

    /// The record of a start that failed for a shortage ([`SpawnError::shortage`]): requeued
    /// without counting, after a backoff that grows with the shortage's streak as a failure's
    /// does with its count (up to `backoff_max`, at least [`SHORTAGE_BACKOFF`]): a long
    /// shortage does not claim and requeue every ready task each second.
    fn shortage(&self, error: &SpawnError) -> Failure {
        Failure {
            outcome: RunOutcome::SpawnFailed,
            exit_code: None,
            exit_signal: None,
            error: format!(
                "{} (the supervisor is short of resources: not counted as a failure)",
                error.message
            ),
            default_max_retries: i64::from(self.max_retries),
            backoff_ms: self
                .backoff_ms(i64::from(error.streak.max(1)))
                .max(SHORTAGE_BACKOFF.as_millis() as i64),
            counts: false,
            give_up_now: false,
        }
    }

    /// The failure record for a run ending as `outcome`, given the task's failures so far.
    fn failure(
        &self,
        outcome: RunOutcome,
        exit: Option<ExitInfo>,
        error: String,
        prior_failures: i64,
    ) -> Failure {
        let code = exit.and_then(|e| e.code);
        let requeue = code.is_some_and(|c| self.retry_exit_codes.contains(&c));
        let give_up_now = code.is_some_and(|c| self.fail_exit_codes.contains(&c));
        let backoff_ms = if requeue {
            self.retry_cooldown.as_millis() as i64
        } else {
            self.backoff_ms(prior_failures + 1)
        };
        Failure {
            outcome,
            exit_code: code,
            exit_signal: exit.and_then(|e| e.signal),
            error,
            default_max_retries: i64::from(self.max_retries),
            backoff_ms,
            counts: !requeue,
            give_up_now,
        }
    }
}

/// Closes `run_id` as failed under `policy` (reads the task's failure count in the same tx):
/// the one place a failure's retry and backoff are decided (a start that failed for a
/// shortage, no failure of the task's, has `ExitPolicy::shortage`).
pub fn fail(
    tx: &Tx<'_>,
    run_id: RunId,
    policy: &ExitPolicy,
    outcome: RunOutcome,
    exit: Option<ExitInfo>,
    error: String,
    now: Millis,
) -> board::Result<()> {
    let run = tx.get_run(run_id)?;
    let task = tx.get_task(run.task_id)?;
    let failure = policy.failure(outcome, exit, error, task.consecutive_failures);
    tx.fail_run(run_id, &failure, now)?;
    Ok(())
}

/// Records a spawn failure: no worker will run (the run stops holding its task), and the run,
/// if still open, closes `spawn_failed` with the retry rules applied — unless the start failed
/// for want of something the supervisor is short of ([`SpawnError::shortage`]): then the task
/// is no more to blame than for a reclaim, and the run is requeued without counting a failure,
/// after a backoff that grows with the shortage's streak (at least [`SHORTAGE_BACKOFF`], so a
/// supervisor out of descriptors does not claim and fail the same tasks in a loop).
pub async fn record_spawn_failure(
    store: &Store,
    run_id: RunId,
    policy: ExitPolicy,
    error: SpawnError,
) -> Result<(), StoreError> {
    store
        .with_tx(move |tx, now| {
            tx.settle_spawn(run_id)?;
            if !tx.get_run(run_id)?.is_open() {
                // Closed while its spawn was under way (reclaimed, archived): nothing to fail.
                return Ok(());
            }
            if error.shortage {
                tx.fail_run(run_id, &policy.shortage(&error), now)?;
                return Ok(());
            }
            fail(
                tx,
                run_id,
                &policy,
                RunOutcome::SpawnFailed,
                None,
                error.message.clone(),
                now,
            )
        })
        .await
}

/// The least a start that failed for a shortage waits before its task is tried again.
pub const SHORTAGE_BACKOFF: Duration = Duration::from_secs(1);

/// Records a max-runtime overrun: the run closes `timed_out` (if still open) before the kill.
/// True if this closed the run (only then is the worker ended at once).
pub async fn record_timeout(
    store: &Store,
    run_id: RunId,
    policy: ExitPolicy,
    error: String,
) -> Result<bool, StoreError> {
    store
        .with_tx(move |tx, now| {
            let run = tx.get_run(run_id)?;
            if !run.is_open() {
                // Closed already (the worker reported just in time): its worker now belongs to
                // the grace rules, not to the timeout.
                return Ok(false);
            }
            fail(
                tx,
                run_id,
                &policy,
                RunOutcome::TimedOut,
                None,
                error.clone(),
                now,
            )
            .map(|_| true)
        })
        .await
}

/// Everything known when a worker's leader has exited and been reaped.
#[derive(Debug, Clone)]
pub struct ExitContext {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub exit: ExitInfo,
    pub pid: i32,
    pub fingerprint: Option<Fingerprint>,
    pub terminated: Option<TerminateReason>,
    /// A previous incarnation's worker (not our child: its status is not ours to read).
    pub adopted: bool,
    /// The run row already holds the pid and fingerprint (their commit has been answered), so
    /// the exit's transaction skips writing them (a no-op update, once per lifecycle).
    pub evidence_on_row: bool,
    /// The leader's group (or descendants) still run: keep the evidence until they are ended.
    pub group_alive: bool,
    pub log_path: PathBuf,
    /// Where this run's output starts in the log (the default when not known: an adopted
    /// worker's).
    pub log_start: LogStart,
    pub policy: ExitPolicy,
    /// Claim the next ready task(s) for the freed slot in the same transaction.
    pub claim_next: Option<ClaimParams>,
    /// The worker overran its max runtime and was ended for it, but the timeout could not be
    /// recorded then (a full disk): its error, so the exit closes the run `timed_out`, as the
    /// timeout would have, not `crashed` by the signal that ended it.
    pub timed_out: Option<String>,
}

/// The board's record of how a worker ended (`None`: not known).
pub fn exit_info(status: Option<ExitStatus>) -> ExitInfo {
    match status {
        Some(ExitStatus::Code(c)) => ExitInfo {
            code: Some(c),
            signal: None,
        },
        Some(ExitStatus::Signal(s)) => ExitInfo {
            code: None,
            signal: Some(s),
        },
        None => ExitInfo {
            code: None,
            signal: None,
        },
    }
}

/// What the exit's transaction claimed for the freed slot.
pub struct Refill {
    /// Claim-on-close ran to the end (it claimed what the caps allow: maybe nothing).
    pub ran: bool,
    pub claims: Vec<(Claim, Task)>,
}

/// Records a worker's exit in one transaction: the exit status (clearing the evidence: this
/// pid is provably gone), the terminal-reaper event if the reaper ended it, and — if the run
/// is still open — its closing: `completed` for a clean exit under `on_exit_zero =
/// "complete"`, `crashed` otherwise (with the code or signal and the log's tail).
/// Then, with `claim_next`, claims for the freed slot in the same transaction.
pub async fn record_exit(store: &Store, cx: ExitContext) -> Result<Refill, StoreError> {
    // Only a crash quotes the log; a clean exit (the common case) reads nothing.
    let crashed = cx.timed_out.is_some()
        || !(cx.exit.code == Some(0) && cx.policy.on_exit_zero == OnExitZero::Complete);
    let tail = if crashed {
        cx.log_start.tail(&cx.log_path, LOG_TAIL_BYTES)
    } else {
        String::new()
    };
    store
        .with_tx(move |tx, now| {
            close_after_exit(tx, &cx, &tail, now)?;
            // A nested step: a failed claim must not undo the recorded exit. (It costs no
            // savepoint unless it fails after writing: see `Tx::nested`.)
            let not_run = || Refill {
                ran: false,
                claims: Vec::new(),
            };
            match &cx.claim_next {
                Some(params) => Ok(match tx.nested(|tx| claim_ready(tx, now, params)) {
                    Ok(claims) => Refill { ran: true, claims },
                    Err(e) => {
                        // Said once: a void attempt is applied again, failing again.
                        if !tx.attempt_void() {
                            tracing::warn!(error = %e, "claim on close failed; the next pass claims");
                        }
                        not_run()
                    }
                }),
                None => Ok(not_run()),
            }
        })
        .await
}

/// The part of [`record_exit`] that records the exit and closes the run.
fn close_after_exit(tx: &Tx<'_>, cx: &ExitContext, tail: &str, now: Millis) -> board::Result<()> {
    // If the exit overtook the spawn evidence's own commit, the evidence is written here, so
    // the history keeps the pid (the later set_worker is then refused as a duplicate).
    if !cx.evidence_on_row {
        tx.set_worker_if_unset(
            cx.run_id,
            cx.pid,
            cx.fingerprint.as_ref(),
            Some(&cx.log_start),
            now,
        )?;
    }
    let run = tx.record_worker_exit(cx.run_id, cx.exit, cx.group_alive, now)?;
    if cx.terminated == Some(TerminateReason::TerminalReap) {
        let ended_by = if cx.exit.signal == Some(libc::SIGKILL) {
            "sigkill"
        } else {
            "sigterm"
        };
        tx.append_event(
            Some(cx.task_id),
            Some(cx.run_id),
            "terminal_worker_reaped",
            json!({
                "pid": cx.pid,
                "boot_id": cx.fingerprint.as_ref().map(|f| &f.boot_id),
                "start_ticks": cx.fingerprint.as_ref().map(|f| f.start_ticks),
                "ended_at": run.ended_at,
                "ended_by": ended_by,
            }),
            now,
        )?;
    }
    if !run.is_open() {
        // Closed by the worker's own report (or by force): the exit changes nothing.
        return Ok(());
    }
    if let Some(error) = &cx.timed_out {
        if tx.task_state(cx.task_id)?.1 != Some(cx.run_id) {
            return Ok(());
        }
        let how = match (cx.exit.code, cx.exit.signal) {
            (Some(c), _) => format!("exited with code {c}"),
            (None, Some(s)) => format!("killed by signal {}", signal_name(s)),
            _ => "exited".to_string(),
        };
        let error = with_tail(format!("{error}; then {how}"), tail);
        return fail(
            tx,
            cx.run_id,
            &cx.policy,
            RunOutcome::TimedOut,
            Some(cx.exit),
            error,
            now,
        );
    }
    if cx.exit.code == Some(0) && cx.policy.on_exit_zero == OnExitZero::Complete {
        // `complete_task` checks that the run is still the task's current one before it
        // writes (no read of our own for that: this is once per lifecycle).
        return match tx.complete_task(cx.task_id, Some(cx.run_id), None, now) {
            Ok(_) | Err(board::BoardError::StaleRun { .. }) => Ok(()),
            Err(e) => Err(e),
        };
    }
    if tx.task_state(cx.task_id)?.1 != Some(cx.run_id) {
        // No longer the task's current run (closed by force): nothing to fail.
        return Ok(());
    }
    let error = match cx.exit.code {
        Some(0) => "exited 0 without reporting completion".to_string(),
        _ => {
            let what = match (cx.exit.code, cx.exit.signal) {
                (Some(c), _) => format!("exited with code {c}"),
                (None, Some(s)) => format!("killed by signal {}", signal_name(s)),
                // An adopted worker (not our child): its status went to its parent.
                _ if cx.adopted => {
                    "exited while unsupervised (adopted after a restart; exit status unknown)"
                        .to_string()
                }
                _ => "exited; its exit status was lost".to_string(),
            };
            with_tail(what, tail)
        }
    };
    fail(
        tx,
        cx.run_id,
        &cx.policy,
        RunOutcome::Crashed,
        Some(cx.exit),
        error,
        now,
    )?;
    Ok(())
}

/// `SIGKILL` for 9, etc.
pub fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("{sig}"))
}

/// A crash's error: what happened, then the run's last output, if it wrote any.
pub(crate) fn with_tail(what: String, tail: &str) -> String {
    if tail.is_empty() {
        what
    } else {
        format!("{what}; log tail: {tail}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(backoff_ms: u64, max_ms: u64) -> ExitPolicy {
        ExitPolicy {
            on_exit_zero: OnExitZero::Complete,
            retry_exit_codes: Vec::new(),
            fail_exit_codes: Vec::new(),
            retry_cooldown: Duration::ZERO,
            max_retries: 3,
            backoff: Duration::from_millis(backoff_ms),
            backoff_max: Duration::from_millis(max_ms),
        }
    }

    #[test]
    fn backoff_doubles_within_twenty_percent() {
        let p = policy(1000, 60_000);
        for (failures, base) in [(1, 1000.0), (2, 2000.0), (3, 4000.0)] {
            for _ in 0..200 {
                let d = p.backoff_ms(failures) as f64;
                assert!((0.8 * base..=1.2 * base).contains(&d), "{failures}: {d}");
            }
        }
    }

    #[test]
    fn backoff_at_the_cap_is_spread_under_it_not_piled_on_it() {
        let p = policy(1000, 1000);
        let delays: Vec<i64> = (0..400).map(|_| p.backoff_ms(5)).collect();
        assert!(
            delays.iter().all(|d| (800..=1000).contains(d)),
            "{delays:?}"
        );
        let on_cap = delays.iter().filter(|&&d| d == 1000).count();
        assert!(on_cap < 20, "{on_cap} of 400 retries on exactly the cap");
        let distinct: std::collections::HashSet<_> = delays.iter().collect();
        assert!(distinct.len() > 50, "{} distinct delays", distinct.len());
    }
}
