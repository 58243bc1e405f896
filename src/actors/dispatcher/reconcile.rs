//! Reconciling open runs no WorkerActor of this incarnation owns: adoption of a previous
//! incarnation's live workers, closing the runs of dead ones, settling claims whose worker was
//! never recorded (open, or closed while their worker's start was under way), holding (never
//! signalling) runs whose liveness cannot be proven — plus the
//! lease refresh and stale detection of our own runs. Runs at start-up and on every tick;
//! every /proc probe happens on the blocking pool.

use actix::prelude::*;

use super::super::outcome;
use super::{DispatcherActor, WorkerActor};
use crate::board::{self, RunId, RunOutcome, Task, now_millis};
use crate::process;

/// How long a claim of this incarnation without a WorkerActor yet is taken as still starting.
const JUST_CLAIMED_MS: i64 = 30_000;

/// See [`delay_reconciles`].
static RECONCILE_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: every reconcile of this process waits `delay` before it reads the open runs (as
/// a slow board or /proc would make it). Process-wide: for a test binary of its own.
#[doc(hidden)]
pub fn delay_reconciles(delay: std::time::Duration) {
    RECONCILE_DELAY_MS.store(
        delay.as_millis() as u64,
        std::sync::atomic::Ordering::SeqCst,
    );
}

/// What reconcile learned about an open run's worker (computed off the actor thread).
enum Probe {
    /// A live WorkerActor of ours owns it, or ours just claimed it.
    Ours,
    /// Its recorded worker is alive and verified through this pidfd.
    Verified(process::PidFd, process::Fingerprint),
    /// Its recorded worker is dead, recycled, unreadable, or has no fingerprint.
    NotVerified(process::Liveness),
    /// Its recorded worker exited while no supervisor watched, and is still a zombie (its new
    /// parent has not reaped it yet) whose exit status could be read.
    Exited(process::ExitStatus),
    /// No worker was ever recorded: started or not, nothing on the board says which process
    /// it would be.
    Unstarted,
}

impl Probe {
    /// Probes the worker of a run no actor of ours owns. Blocking (/proc).
    fn of(run: &board::Run) -> Probe {
        match (
            run.worker_pid.and_then(|p| i32::try_from(p).ok()),
            run.fingerprint(),
        ) {
            (Some(pid), Some(fp)) => match process::open_verified(pid, &fp) {
                Ok(process::Verified::Ours(pidfd)) => Probe::Verified(pidfd, fp),
                Ok(process::Verified::NotOurs(
                    l @ process::Liveness::Dead(process::DeadReason::Zombie),
                )) => match process::exit_status::of_zombie(pid, &fp) {
                    Some(status) => Probe::Exited(status),
                    None => Probe::NotVerified(l),
                },
                Ok(process::Verified::NotOurs(l)) => Probe::NotVerified(l),
                Err(e) => Probe::NotVerified(process::Liveness::Unknown(e.to_string())),
            },
            (Some(_), None) => Probe::NotVerified(process::Liveness::Unknown(
                "no fingerprint recorded (legacy row)".into(),
            )),
            (None, _) if run.spawned_pid.is_some() => {
                Probe::NotVerified(process::Liveness::Dead(process::DeadReason::NoSuchProcess))
            }
            (None, _) => Probe::Unstarted,
        }
    }
}

/// What the supervisors before this one had heard from an adopted run's worker: the silence
/// the last of them recorded ([`board::Run::silence_ms`]), and the heartbeat it followed,
/// both as found at the adoption.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct HeardBefore {
    pub silence_ms: i64,
    pub beat_at: Option<board::Millis>,
}

impl HeardBefore {
    fn of(run: &board::Run) -> Self {
        HeardBefore {
            silence_ms: run.silence_ms.max(0),
            beat_at: run.heartbeat_at,
        }
    }
}

/// How long a run's worker has been silent while a supervisor listened, for `stale_after`:
/// since its last heartbeat (else its start), not counting the time no supervisor ran before
/// this one (a worker's beats wait to reconnect then). For a worker adopted with no beat since,
/// that is what the supervisors before heard (`heard`) and the time since this one started;
/// without the former a supervisor restarted more often than `stale_after` would never find a
/// hung worker stale. A beat since the adoption counts from itself, whatever the wall clock
/// did meanwhile.
fn silent_for(
    run: &board::Run,
    watching_since: board::Millis,
    heard: Option<&HeardBefore>,
    now: board::Millis,
) -> i64 {
    let last = run.heartbeat_at.unwrap_or(run.started_at);
    match heard {
        Some(h) if run.heartbeat_at == h.beat_at && last < watching_since => {
            h.silence_ms + (now - watching_since)
        }
        _ => now - last,
    }
}

#[test]
fn silence_counts_only_while_a_supervisor_listened() {
    let run = |started_at, heartbeat_at| board::Run {
        id: 1,
        task_id: 1,
        attempt: 1,
        assignee: None,
        token: String::new(),
        claimer: String::new(),
        outcome: None,
        started_at,
        ended_at: None,
        lease_expires_at: 0,
        heartbeat_at,
        spawned_pid: None,
        worker_pid: None,
        worker_boot_id: None,
        worker_start_ticks: None,
        worker_pidfs_ino: None,
        exit_code: None,
        exit_signal: None,
        error: None,
        summary: None,
        log_start: None,
        silence_ms: 0,
    };
    let heard = |silence_ms, beat_at| HeardBefore {
        silence_ms,
        beat_at,
    };
    // Claimed by this incarnation (started at 4 000): since its start, or its last beat.
    assert_eq!(silent_for(&run(5_000, None), 4_000, None, 9_000), 4_000);
    assert_eq!(
        silent_for(&run(5_000, Some(8_000)), 4_000, None, 9_000),
        1_000
    );
    // Adopted with 1 500 heard before: that, and the time since this one started.
    let adopted = heard(1_500, None);
    assert_eq!(
        silent_for(&run(1_000, None), 4_000, Some(&adopted), 5_000),
        2_500
    );
    // A beat since counts from itself...
    assert_eq!(
        silent_for(&run(1_000, Some(4_500)), 4_000, Some(&adopted), 5_000),
        500
    );
    // ...also when the wall clock was set back before it (its time is before this start).
    assert_eq!(
        silent_for(&run(1_000, Some(3_700)), 4_000, Some(&adopted), 4_350),
        650
    );
    // Adopted after an earlier beat, none since: what was heard, and the time since.
    let after_beat = heard(700, Some(2_000));
    assert_eq!(
        silent_for(&run(1_000, Some(2_000)), 4_000, Some(&after_beat), 5_000),
        1_700
    );
}

impl DispatcherActor {
    /// Brings every open run that no WorkerActor of ours owns to a defined state: adopt a live
    /// worker of a previous incarnation, close a dead one's run, release a run whose worker was
    /// never recorded, hold (never signal) one whose liveness cannot be proven. Also refreshes
    /// our own workers' leases and ends stale ones. Runs at start-up and on every tick.
    pub(super) fn reconcile(&mut self, ctx: &mut Context<Self>) {
        if self.reconciling {
            return;
        }
        self.reconciling = true;
        let settled_before = self.followups_settled;
        let store = self.store.clone();
        // Probing liveness reads /proc (and, for an unstarted run, scans every process's
        // environment): that happens here, on the blocking pool, never on the actor thread.
        let ours: std::collections::HashSet<RunId> = self.workers.keys().copied().collect();
        let claimer = self.claimer.clone();
        let delay = RECONCILE_DELAY_MS.load(std::sync::atomic::Ordering::SeqCst);
        async move {
            if delay > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
            }
            store
                .read(move |tx| {
                    // Open runs, and closed ones whose worker's start was never settled (closed
                    // while it was under way, and the incarnation that started it died).
                    let mut runs = tx.open_runs()?;
                    runs.extend(
                        tx.spawn_pending_runs()?
                            .into_iter()
                            .filter(|r| !r.is_open()),
                    );
                    let now = now_millis();
                    let mut out = Vec::with_capacity(runs.len());
                    for run in runs {
                        let task = tx.get_task(run.task_id)?;
                        let just_claimed =
                            run.claimer == claimer && now - run.started_at < JUST_CLAIMED_MS;
                        let probe = if ours.contains(&run.id) || just_claimed {
                            Probe::Ours
                        } else {
                            Probe::of(&run)
                        };
                        out.push((run, task, probe));
                    }
                    Ok(out)
                })
                .await
        }
        .into_actor(self)
        .map(move |res, act, ctx| {
            act.reconciling = false;
            match res {
                Ok(runs) => act.reconcile_runs(runs, ctx),
                Err(e) => tracing::warn!(error = %e, "reconcile: cannot read open runs"),
            }
            if act.first_followups == 0 && !*act.reconciled_once.borrow() {
                if act.followups_settled != settled_before {
                    // An unstarted run was settled while this reconcile read the board (its own
                    // call to reconcile came while this one ran, and was dropped): the next
                    // one sees it settled, and only then is the first reconcile done.
                    act.reconcile(ctx);
                    return;
                }
                act.reconciled_once.send_replace(true);
            }
        })
        .spawn(ctx);
    }

    fn reconcile_runs(&mut self, runs: Vec<(board::Run, Task, Probe)>, ctx: &mut Context<Self>) {
        let now = now_millis();
        let ttl = self.config.leases.claim_ttl;
        let stale_after = self.config.leases.stale_after;
        let mut ours = Vec::new();
        let mut stale = Vec::new();
        self.held
            .retain(|run_id, _| runs.iter().any(|(r, _, _)| r.id == *run_id));
        self.closing
            .retain(|run_id| runs.iter().any(|(r, _, _)| r.id == *run_id));
        self.heard_before
            .retain(|run_id, _| runs.iter().any(|(r, _, _)| r.id == *run_id));
        for (run, task, probe) in runs {
            // Ours: a live WorkerActor, or a claim of this incarnation young enough that its
            // actor may not have started yet (the claim's reply is still on its way). Anything
            // else of ours without an actor (its exit could not be recorded) is reconciled like
            // a foreign run.
            if self.workers.contains_key(&run.id) || matches!(probe, Probe::Ours) {
                if !run.is_open() {
                    continue; // Closed, its start still ours to settle.
                }
                let exit_pending = self.workers.get(&run.id).is_some_and(|w| w.exit_pending);
                let heard = self.heard_before.get(&run.id).copied();
                let silent = silent_for(&run, self.watching_since, heard.as_ref(), now);
                if !stale_after.is_zero()
                    && !exit_pending
                    && silent > stale_after.as_millis() as i64
                {
                    // A stale run is a failure of its task like any other: its assignee's
                    // max_retries and backoff apply (not the global default, not zero).
                    stale.push((run.id, self.policy_for(&task), heard));
                }
                ours.push((run.id, heard));
                continue;
            }
            self.take_over(run, task, probe, now, ctx);
        }
        // Our own live children vouch for their leases (a heartbeat extends them too), and the
        // silence heard from them is recorded: often enough that what a supervisor killed
        // before its next refresh heard and the next one cannot count is a third of
        // `stale_after` at most.
        let every = if stale_after.is_zero() {
            ttl / 3
        } else {
            ttl.min(stale_after) / 3
        };
        let due = self.last_lease_refresh.is_none_or(|t| t.elapsed() >= every);
        if (due && !ours.is_empty()) || !stale.is_empty() {
            self.last_lease_refresh = Some(std::time::Instant::now());
            let (store, lease_ms) = (self.store.clone(), ttl.as_millis() as i64);
            let stale_ms = stale_after.as_millis() as i64;
            let since = self.watching_since;
            let error = format!(
                "no heartbeat for {}",
                humantime::format_duration(stale_after)
            );
            actix_rt::spawn(async move {
                let res = store
                    .with_tx(move |tx, now| {
                        for &(run_id, heard) in &ours {
                            // With the silence heard so far, for the next incarnation.
                            let run = match tx.get_run(run_id) {
                                Ok(run) => run,
                                Err(board::BoardError::NotFound { .. }) => continue,
                                Err(e) => return Err(e),
                            };
                            let silence = silent_for(&run, since, heard.as_ref(), now);
                            tx.extend_lease(run_id, now, lease_ms, silence)?;
                        }
                        for (run_id, policy, heard) in &stale {
                            let (run_id, heard) = (*run_id, *heard);
                            // Judged on a snapshot read before this transaction: a heartbeat
                            // committed since then wins (the worker is not stale after all).
                            let still_stale = tx.get_run(run_id).is_ok_and(|run| {
                                silent_for(&run, since, heard.as_ref(), now) > stale_ms
                            });
                            if !still_stale {
                                continue;
                            }
                            // Closing the run is what ends the worker (run_closed → reaper, no grace).
                            let _ = tx.nested(|tx| {
                                outcome::fail(
                                    tx,
                                    run_id,
                                    policy,
                                    RunOutcome::Stale,
                                    None,
                                    error.clone(),
                                    now,
                                )
                            });
                        }
                        Ok(())
                    })
                    .await;
                if let Err(e) = res {
                    tracing::warn!(error = %e, "lease refresh failed");
                }
            });
        }
    }

    /// One open run of a previous incarnation (see [`Self::reconcile`]).
    fn take_over(
        &mut self,
        run: board::Run,
        task: Task,
        probe: Probe,
        now: board::Millis,
        ctx: &mut Context<Self>,
    ) {
        let run_id = run.id;
        if self.closing.contains(&run_id) {
            return;
        }
        let lease_expired = run.lease_expires_at <= now;
        let mut exited = None;
        let verdict = match probe {
            Probe::Ours => return,
            Probe::Verified(pidfd, fp) => Ok((pidfd, fp)),
            Probe::NotVerified(l) => Err(l),
            Probe::Exited(status) => {
                exited = Some(status);
                Err(process::Liveness::Dead(process::DeadReason::Zombie))
            }
            Probe::Unstarted => {
                self.closing.insert(run_id);
                // The first reconcile's signal waits for this run to be settled (see
                // `reconciled_once`), so a report of its worker is answered after it.
                self.first_followups += 1;
                let kill = self.config.reaper.kill_timeout;
                let token = run.token.clone();
                // A claim of this incarnation's own (its reply late past JUST_CLAIMED_MS): what
                // carries its token is a worker its own WorkerActor is starting right now, or
                // one a Handoff kills; never ended from here. Held while any is there.
                let our_claim = run.claimer == self.claimer;
                async move {
                    if our_claim {
                        let found = actix_rt::task::spawn_blocking(move || {
                            process::descendants::find_by_token(&token)
                        })
                        .await;
                        return match found {
                            Ok(Ok(carriers)) if carriers.is_empty() => {
                                Some(process::descendants::CarriersEnded {
                                    count: 0,
                                    sigkill: false,
                                })
                            }
                            _ => None,
                        };
                    }
                    // Whatever carries the run's token was started for it — but which carrier
                    // is the worker cannot be proven: once the worker has exited, a descendant
                    // that escaped its group (setsid) looks just like it, and adopting that
                    // would let its exit stand for the worker's (a worker that failed while no
                    // supervisor watched, closed `completed` by its escapee's exit 0). So
                    // nothing found is adopted: every carrier is ended, the run released and
                    // its task run again. One still there after SIGKILL keeps the run as it is
                    // (the next tick retries).
                    actix_rt::task::spawn_blocking(move || {
                        process::descendants::end_token_carriers(&token, kill)
                    })
                    .await
                    .ok()
                    .and_then(|r| r.ok())
                }
                .into_actor(self)
                .then(move |ended, act, _| {
                    // Checked again on the actor thread just before the write: a claim of ours
                    // whose reply came late (a commit stalled past JUST_CLAIMED_MS) may have got
                    // its WorkerActor meanwhile, and then its start is that actor's to settle —
                    // settling it here could let a second worker start beside it.
                    let theirs = act.workers.contains_key(&run_id);
                    let store = act.store.clone();
                    async move {
                        if theirs {
                            return true; // Its actor's to settle: nothing held here.
                        }
                        let Some(ended) = ended else {
                            tracing::warn!(run_id, "reconcile: what carries an unstarted run's token is still there (a claim of ours starting late) or could not be ended; held, tried again on the tick");
                            return false;
                        };
                        let r = store
                            .with_tx(move |tx, now| {
                                if ended.count > 0 {
                                    tx.append_event(Some(run.task_id), Some(run_id), "worker_found", serde_json::json!({ "by": "run token", "ended": ended.count, "sigkill": ended.sigkill }), now)?;
                                }
                                // `reclaim_task` closes the task's current run: only while that
                                // is still this one (the snapshot may be old).
                                if tx.get_task(run.task_id)?.current_run_id == Some(run_id) {
                                    let why = if ended.count > 0 {
                                        "claimed by an earlier supervisor, which died before recording its worker: what carried the run's token was ended (an unrecorded worker is never adopted)"
                                    } else {
                                        "claimed by an earlier supervisor, and no worker of that run is running (never started, or ended before its pid could be recorded)"
                                    };
                                    tx.reclaim_task(run.task_id, why, now)?;
                                }
                                tx.settle_spawn(run_id).map(|_| ())
                            })
                            .await;
                        match r {
                            Ok(()) => true,
                            Err(e) => {
                                tracing::warn!(run_id, error = %e, "reconcile: cannot settle an unstarted run");
                                false
                            }
                        }
                    }
                    .into_actor(act)
                })
                // Settled: the next reconcile looks at the run afresh. A settled start writes no
                // event of its own, so the task and slot it freed get a pass now. Not settled
                // (its carriers could not all be ended, the write failed): the run is held, as
                // one whose liveness is unknown — the first reconcile is done with it, and the
                // next tick tries again (not at once: a failing scan must not loop).
                .map(move |settled, act, ctx| {
                    act.closing.remove(&run_id);
                    act.first_followups -= 1;
                    let first_pending = act.first_followups == 0 && !*act.reconciled_once.borrow();
                    if !settled {
                        if first_pending {
                            act.reconciled_once.send_replace(true);
                        }
                        return;
                    }
                    act.followups_settled += 1;
                    if first_pending {
                        // The first reconcile is done once this settle is in (not a tick later).
                        act.reconcile(ctx);
                    }
                    act.pass(ctx);
                })
                .spawn(ctx);
                return;
            }
        };
        match verdict {
            Ok((pidfd, fp)) => {
                self.held.remove(&run_id);
                let (spec, policy, max_runtime) =
                    self.adoption_setup(&task, run_id, run.token.clone());
                let worker = WorkerActor::adopt(
                    spec,
                    pidfd,
                    fp,
                    run.log_start.clone().unwrap_or_default(),
                    run.started_at,
                    policy,
                    max_runtime,
                    self.config.reaper.kill_timeout,
                    self.store.clone(),
                    ctx.address(),
                );
                let pid = run.worker_pid.map(|p| p as i32);
                self.run_worker(worker, run_id, task.id, pid, run.token.clone());
                // What the supervisors before this one heard, as the last recorded it; kept from
                // a first adoption if this one adopts the worker again (it recorded its own
                // listening on the row since).
                let heard = *self
                    .heard_before
                    .entry(run_id)
                    .or_insert_with(|| HeardBefore::of(&run));
                let store = self.store.clone();
                let lease_ms = self.config.leases.claim_ttl.as_millis() as i64;
                let since = self.watching_since;
                actix_rt::spawn(async move {
                    let _ = store
                        .with_tx(move |tx, now| {
                            tx.append_event(
                                Some(task.id),
                                Some(run_id),
                                "worker_adopted",
                                serde_json::json!({ "pid": run.worker_pid }),
                                now,
                            )?;
                            // As read now: a heartbeat may have landed since the snapshot.
                            let silence =
                                silent_for(&tx.get_run(run_id)?, since, Some(&heard), now);
                            tx.extend_lease(run_id, now, lease_ms, silence)
                        })
                        .await;
                });
            }
            Err(process::Liveness::Dead(reason)) => {
                self.held.remove(&run_id);
                self.closing.insert(run_id);
                let policy = self.policy_for(&task);
                let assignee = task
                    .assignee
                    .as_deref()
                    .and_then(|a| self.config.assignee(a));
                let log_path = self
                    .setup_with(&task, run_id, run.token.clone(), assignee)
                    .0
                    .log_path;
                // As recorded with its evidence (else the whole log's tail).
                let log_start = run.log_start.clone().unwrap_or_default();
                // Its exit status known (a zombie's): closed by the rules of any exit.
                let known = exited.map(|status| outcome::ExitContext {
                    run_id,
                    task_id: task.id,
                    exit: outcome::exit_info(Some(status)),
                    pid: run
                        .worker_pid
                        .and_then(|p| i32::try_from(p).ok())
                        .unwrap_or_default(),
                    fingerprint: run.fingerprint(),
                    terminated: None,
                    adopted: true,
                    evidence_on_row: true,
                    group_alive: false,
                    log_path: log_path.clone(),
                    log_start: log_start.clone(),
                    policy: policy.clone(),
                    claim_next: None,
                    timed_out: None,
                });
                let store = self.store.clone();
                let (token, kill) = (run.token.clone(), self.config.reaper.kill_timeout);
                let (task_id, pid) = (task.id, run.worker_pid);
                async move {
                    // The leader is gone, but what it left (group members, setsid escapees) may
                    // live on: what carries the run's token is ended before the task can run
                    // again. One still there after SIGKILL leaves the run open (the next tick
                    // retries). A member that cleared its environment cannot be proven the
                    // run's once the leader is reaped (nothing pins its group then) and is not
                    // signalled (docs/lifecycle.md).
                    let ended = actix_rt::task::spawn_blocking(move || {
                        process::descendants::end_token_carriers(&token, kill)
                    })
                    .await;
                    let Ok(Ok(ended)) = ended else {
                        tracing::warn!(run_id, "reconcile: a dead worker's descendants outlived SIGKILL; run left open");
                        return;
                    };
                    // What it left was ended: said as for a worker of ours whose tree outlived
                    // it, before the run is closed.
                    if ended.count > 0 {
                        let how = if ended.sigkill { "sigkill" } else { "sigterm" };
                        let noted = store
                            .with_tx(move |tx, now| {
                                tx.append_event(
                                    Some(task_id),
                                    Some(run_id),
                                    "worker_group_ended",
                                    serde_json::json!({ "pid": pid, "ended_by": how }),
                                    now,
                                )
                            })
                            .await;
                        if let Err(e) = noted {
                            tracing::warn!(run_id, error = %e, "reconcile: cannot record the end of a dead worker's descendants");
                        }
                    }
                    if let Some(cx) = known {
                        if let Err(e) = outcome::record_exit(&store, cx).await {
                            tracing::warn!(run_id, error = %e, "reconcile: cannot close dead worker's run");
                        }
                        return;
                    }
                    // Its output is quoted as any crash's is (a file read: off the actor thread).
                    let tail = actix_rt::task::spawn_blocking(move || {
                        log_start.tail(&log_path, outcome::LOG_TAIL_BYTES)
                    })
                    .await
                    .unwrap_or_default();
                    let r = store
                        .with_tx(move |tx, now| {
                            tx.record_worker_exit(run_id, outcome::exit_info(None), false, now)?;
                            let error = outcome::with_tail(
                                format!("worker exited while unsupervised ({})", reason.as_str()),
                                &tail,
                            );
                            outcome::fail(
                                tx,
                                run_id,
                                &policy,
                                RunOutcome::Crashed,
                                None,
                                error,
                                now,
                            )
                        })
                        .await;
                    if let Err(e) = r {
                        tracing::warn!(run_id, error = %e, "reconcile: cannot close dead worker's run");
                    }
                }
                .into_actor(self)
                // Closed or not, the next reconcile looks again (a failed close is retried).
                .map(move |_, act, _| {
                    act.closing.remove(&run_id);
                })
                .spawn(ctx);
            }
            Err(l) => {
                // Unknown: never signalled, never released by time alone; re-checked each tick.
                let recorded = self.held.entry(run_id).or_insert(false);
                if lease_expired && !*recorded {
                    *recorded = true;
                    let why = format!("{l:?}");
                    tracing::warn!(run_id, %why, "lease expired but the worker's liveness is unknown; release deferred");
                    let store = self.store.clone();
                    actix_rt::spawn(async move {
                        let _ = store
                            .with_tx(move |tx, now| {
                                tx.append_event(
                                    Some(run.task_id),
                                    Some(run_id),
                                    "reclaim_deferred",
                                    serde_json::json!({ "why": why, "pid": run.worker_pid }),
                                    now,
                                )
                            })
                            .await;
                    });
                }
            }
        }
    }
}
