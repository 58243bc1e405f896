//! ReaperActor: ends workers whose run no longer wants them, after the right grace.
//!
//! Event-driven: each `RunClosed` schedules one actix timer at exactly `ended_at + grace` (no
//! polling); the worker's own exit cancels it. When the timer fires, our own child is ended by
//! its WorkerActor (which holds the pidfd); a worker of a previous incarnation is ended through
//! `process` under the fingerprint rules. A periodic sweep over the board (start-up and every
//! tick) catches runs closed while no supervisor was listening.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use actix::prelude::*;

use super::dispatcher::OwnedWorkers;
use super::store::Store;
use super::worker::{Terminate, TerminateReason, WorkerActor};
use crate::board::{self, Millis, ReapCandidate, ReapVerdict, RunId, TaskId, now_millis};
use crate::process::{self, Fingerprint, PidfdSignaller};

/// Most runs a single sweep hands to the blocking pool at once.
const SWEEP_BATCH: usize = 64;

/// A run closed while its worker may still be alive.
#[derive(Message, Clone)]
#[rtype(result = "()")]
pub struct RunClosed {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub pid: i32,
    /// `None` only for a legacy row (a worker recorded by a build that still started workers
    /// it could not fingerprint): ended only through a WorkerActor's pidfd, never by pid.
    pub fingerprint: Option<Fingerprint>,
    pub ended_at: Millis,
    /// How long after `ended_at` the worker is ended (zero for forced closes).
    pub grace: Duration,
    /// Our own WorkerActor, when this incarnation spawned the worker.
    pub worker: Option<Addr<WorkerActor>>,
}

/// The worker of `run_id` exited by itself: cancel its scheduled kill.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WorkerGone {
    pub run_id: RunId,
}

/// Task `task_id` was archived: a worker still running for one of its closed runs (within
/// its grace, after its report) is ended now, not at the end of the grace. Archiving is how an
/// operator puts a task away, hung worker included.
#[derive(Message)]
#[rtype(result = "()")]
pub struct TaskArchived {
    pub task_id: TaskId,
}

/// The dispatcher, to ask which closed runs still have a WorkerActor (see `sweep`).
#[derive(Message)]
#[rtype(result = "()")]
pub struct DispatcherIs(pub Recipient<OwnedWorkers>);

/// A `terminate` stop: end now every worker still alive for a closed run (within its grace)
/// that no WorkerActor of ours holds — a previous incarnation's, which only this actor
/// watches. Our own actors' workers are the dispatcher's to end (`StopDispatching`). Answers
/// once they are ended, or after the time one kill sequence may take.
/// Answers how many such runs it left alone because a reap of theirs was already under way (a
/// sweep's probe, say, which may leave a worker within its grace running): ask again once
/// that is over.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct EndLeftovers;

/// Run the board sweep now (also on every tick); answers with the number of runs examined.
#[derive(Message)]
#[rtype(result = "usize")]
pub struct SweepNow;

struct Pending {
    timer: SpawnHandle,
    /// What the timer will act on, should it be brought forward (see [`TaskArchived`]).
    closed: RunClosed,
}

/// The actor.
pub struct ReaperActor {
    store: Store,
    grace: Duration,
    kill_timeout: Duration,
    tick: Duration,
    pending: HashMap<RunId, Pending>,
    owned: HashMap<RunId, Addr<WorkerActor>>,
    /// Runs being reaped right now (a sweep must not start a second kill of the same worker).
    in_flight: HashSet<RunId>,
    /// Runs whose own WorkerActor was told to end its worker, and when. The sweep leaves them
    /// to it: a second, external kill sequence of the same worker would race the first (a
    /// worker ignoring SIGTERM got two SIGTERM → SIGKILL rounds) and `terminal_worker_reaped`
    /// would be recorded twice. Only once the kill should long be over (`give_up_after`) may
    /// the sweep try again by fingerprint. Cleared when the worker is gone.
    ending: HashMap<RunId, Instant>,
    /// When this incarnation started. Only runs closed before it can be a previous
    /// incarnation's unwatched worker; a later close is this incarnation's own (its worker
    /// watched by a WorkerActor, its RunClosed maybe still on its way, or lost to a lagging
    /// event feed), which the sweep asks the dispatcher about ([`OwnedWorkers`]).
    started_at: Millis,
    /// Where to ask that; set once the dispatcher has started ([`DispatcherIs`]).
    dispatcher: Option<Recipient<OwnedWorkers>>,
}

impl ReaperActor {
    /// A reaper with the configured grace, kill timeout and sweep period.
    pub fn new(store: Store, grace: Duration, kill_timeout: Duration, tick: Duration) -> Self {
        ReaperActor {
            store,
            grace,
            kill_timeout,
            tick,
            pending: HashMap::new(),
            owned: HashMap::new(),
            in_flight: HashSet::new(),
            ending: HashMap::new(),
            started_at: now_millis(),
            dispatcher: None,
        }
    }

    /// How long a WorkerActor's own kill of its worker is left alone by the sweep: longer than
    /// that kill can take (SIGTERM, kill_timeout, SIGKILL, the wait for the group to be gone),
    /// or the sweep would start a second kill and record the reap twice.
    fn give_up_after(&self) -> Duration {
        self.kill_timeout + crate::process::AFTER_SIGKILL + 2 * self.tick + Duration::from_secs(1)
    }

    /// True while `run_id`'s worker is being ended by its own WorkerActor (see `ending`).
    fn left_to_its_worker(&self, run_id: RunId) -> bool {
        self.ending
            .get(&run_id)
            .is_some_and(|since| since.elapsed() < self.give_up_after())
    }

    /// Tells our own WorkerActor to end its worker, and remembers that it is doing so.
    fn terminate_owned(
        &mut self,
        run_id: RunId,
        worker: &Addr<WorkerActor>,
        reason: TerminateReason,
    ) {
        worker.do_send(Terminate {
            kill_after: self.kill_timeout,
            reason,
        });
        self.ending.entry(run_id).or_insert_with(Instant::now);
    }

    fn fire(&mut self, msg: RunClosed, ctx: &mut Context<Self>) {
        self.pending.remove(&msg.run_id);
        // Kept in `owned` until the worker is gone (WorkerGone): while its actor lives, a later
        // sweep asks it again rather than start an external kill of the same worker beside it.
        if let Some(worker) = self.owned.get(&msg.run_id).cloned()
            && worker.connected()
        {
            let reason = if msg.grace.is_zero() {
                TerminateReason::RunClosed
            } else {
                TerminateReason::TerminalReap
            };
            self.terminate_owned(msg.run_id, &worker, reason);
            return;
        }
        let Some(fingerprint) = msg.fingerprint else {
            // Its actor is gone and there is no fingerprint: nothing proves who has the pid now.
            tracing::info!(
                run_id = msg.run_id,
                pid = msg.pid,
                "reaper: a worker without a fingerprint is never signalled by pid"
            );
            return;
        };
        self.reap_external(
            ReapCandidate {
                run_id: msg.run_id,
                task_id: msg.task_id,
                pid: msg.pid,
                fingerprint,
                ended_at: msg.ended_at,
                // The event feed carries no tokens; reap_external reads it from the run.
                token: None,
                // Not needed past here: the grace this timer kept already said it.
                outcome: None,
            },
            false,
            ctx,
        );
    }

    /// Ends a worker we do not own (previous incarnation) under the fingerprint rules, off the
    /// actor thread, then records the verdict. `early`: its grace has not passed yet, so only
    /// a leader proven dead is acted on (its leftovers ended, its evidence cleared, its slot
    /// freed); a live one is left for its due time.
    fn reap_external(&mut self, c: ReapCandidate, early: bool, ctx: &mut Context<Self>) {
        self.reap_external_then(c, early, ctx);
    }

    /// [`Self::reap_external`], with what resolves once the reap is over (`None` if one of
    /// that run was under way already). The run stays `in_flight` until then, whoever waits.
    fn reap_external_then(
        &mut self,
        c: ReapCandidate,
        early: bool,
        ctx: &mut Context<Self>,
    ) -> Option<tokio::sync::oneshot::Receiver<()>> {
        if !self.in_flight.insert(c.run_id) {
            return None;
        }
        let run_id = c.run_id;
        let (done, over) = tokio::sync::oneshot::channel();
        reap_and_record(self.store.clone(), c, early, self.kill_timeout)
            .into_actor(self)
            .map(move |res, act, _| {
                act.in_flight.remove(&run_id);
                log_reap(run_id, res);
                let _ = done.send(());
            })
            .spawn(ctx);
        Some(over)
    }

    fn sweep(&mut self, ctx: &mut Context<Self>) {
        let grace_ms = self.grace.as_millis() as i64;
        let store = self.store.clone();
        let dispatcher = self.dispatcher.clone();
        let started_at = self.started_at;
        async move {
            // Reads: the read-only connection, not a write transaction on every tick. The
            // second one adds the runs still within their grace.
            let (due, all, archived) = store
                .read(move |tx| {
                    let now = board::now_millis();
                    let due = tx.terminal_reap_candidates(now, grace_ms)?;
                    let all =
                        tx.terminal_reap_candidates(now.saturating_add(grace_ms), grace_ms)?;
                    let archived = tx.archived_runs_with_evidence()?;
                    Ok((due, all, archived))
                })
                .await?;
            // Which runs still have their worker's actor: those closed during this incarnation,
            // and any other (a wall clock set back makes a close of ours look older).
            let ours: Vec<RunId> = all.iter().map(|c| c.run_id).collect();
            let owners = match dispatcher {
                _ if ours.is_empty() => Some(Vec::new()),
                // Before the dispatcher starts (the start-up sweep) nothing can be ours yet.
                None if all.iter().all(|c| c.ended_at < started_at) => Some(Vec::new()),
                // Unknown (no dispatcher yet, or it is stopping): those runs wait a sweep.
                None => None,
                Some(d) => d.send(OwnedWorkers(ours)).await.ok(),
            };
            Ok::<_, super::store::StoreError>((due, all, archived, owners))
        }
        .into_actor(self)
        .map(move |res, act, ctx| match res {
            Ok((due, all, archived, owners)) => {
                // A stopped worker actor's entry is only a leftover (its WorkerGone raced).
                act.owned.retain(|_, w| w.connected());
                let owners_known = owners.is_some();
                for (run_id, w) in owners.into_iter().flatten() {
                    if w.connected() {
                        act.owned.entry(run_id).or_insert(w);
                    }
                }
                // A run no longer a candidate has had its evidence cleared: nothing to wait for.
                act.ending
                    .retain(|run_id, _| all.iter().any(|c| c.run_id == *run_id));
                // A closed run of an archived task is due at once, whatever its grace; one
                // whose timer still waits has it brought forward here too, so a missed
                // `TaskArchived` (a lagging feed) costs a tick, not the rest of the grace. Only
                // then: a run due by the wall clock alone (it jumped forward) keeps its timer.
                let due_ids: HashSet<RunId> = due
                    .iter()
                    .map(|c| c.run_id)
                    .chain(archived.iter().copied())
                    .collect();
                for &run_id in &archived {
                    act.fire_now(run_id, ctx);
                }
                // Due ones first: probes of runs within their grace never crowd them out.
                let (due, early): (Vec<_>, Vec<_>) = all
                    .into_iter()
                    .filter(|c| {
                        !act.pending.contains_key(&c.run_id)
                            && !act.in_flight.contains(&c.run_id)
                            && !act.left_to_its_worker(c.run_id)
                    })
                    .partition(|c| due_ids.contains(&c.run_id));
                // Early only for runs closed before this incarnation started: nothing else
                // watches their workers. A due run closed since goes to its own WorkerActor
                // when it has one (asked above); whether it has is unknown only while there
                // is no dispatcher to ask, and then it waits for a later sweep.
                let due = due
                    .into_iter()
                    .filter(|c| c.ended_at < started_at || owners_known);
                let early = early.into_iter().filter(|c| c.ended_at < started_at);
                let todo: Vec<_> = due.into_iter().chain(early).take(SWEEP_BATCH).collect();
                for c in todo {
                    let early = !due_ids.contains(&c.run_id);
                    match act.owned.get(&c.run_id).cloned() {
                        // A run closed before we started (by the wall clock) that an actor of
                        // ours owns all the same: never ended before its grace. Its actor
                        // records its exit anyway.
                        Some(w) if early && w.connected() => {}
                        // As its RunClosed's timer would: a forced close (its RunClosed late
                        // or lost) is that close's end, a report's after its grace a reap.
                        Some(w) if w.connected() => {
                            let reason = if c.closed_by_its_worker() {
                                TerminateReason::TerminalReap
                            } else {
                                TerminateReason::RunClosed
                            };
                            act.terminate_owned(c.run_id, &w, reason)
                        }
                        // A previous incarnation's worker within its grace: nothing records its
                        // exit but this sweep, and until then it holds its slot.
                        _ => act.reap_external(c, early, ctx),
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reaper: sweep failed"),
        })
        .spawn(ctx);
    }
}

impl Actor for ReaperActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Start-up sweep: runs closed while no supervisor was listening.
        self.sweep(ctx);
        ctx.run_interval(self.tick, |act, ctx| act.sweep(ctx));
    }
}

impl Handler<RunClosed> for ReaperActor {
    type Result = ();
    fn handle(&mut self, msg: RunClosed, ctx: &mut Self::Context) {
        if let Some(old) = self.pending.remove(&msg.run_id) {
            ctx.cancel_future(old.timer);
        }
        if let Some(w) = &msg.worker {
            self.owned.insert(msg.run_id, w.clone());
        }
        let due = msg.ended_at + msg.grace.as_millis() as i64;
        let delay = Duration::from_millis(due.saturating_sub(now_millis()).max(0) as u64);
        let (run_id, closed) = (msg.run_id, msg.clone());
        let timer = ctx.run_later(delay, move |act, ctx| act.fire(msg, ctx));
        self.pending.insert(run_id, Pending { timer, closed });
    }
}

impl Handler<DispatcherIs> for ReaperActor {
    type Result = ();
    fn handle(&mut self, msg: DispatcherIs, _: &mut Self::Context) {
        self.dispatcher = Some(msg.0);
    }
}

impl Handler<WorkerGone> for ReaperActor {
    type Result = ();
    fn handle(&mut self, msg: WorkerGone, ctx: &mut Self::Context) {
        self.owned.remove(&msg.run_id);
        self.ending.remove(&msg.run_id);
        if let Some(p) = self.pending.remove(&msg.run_id) {
            ctx.cancel_future(p.timer);
        }
    }
}

impl Handler<TaskArchived> for ReaperActor {
    type Result = ();
    fn handle(&mut self, msg: TaskArchived, ctx: &mut Self::Context) {
        let store = self.store.clone();
        let task_id = msg.task_id;
        async move { store.read(move |tx| tx.runs_for_task(task_id)).await }
            .into_actor(self)
            .map(move |runs, act, ctx| {
                let runs = match runs {
                    Ok(runs) => runs,
                    Err(e) => {
                        // The grace still ends it, and the sweep catches it after that.
                        tracing::warn!(task_id, error = %e, "reaper: cannot read an archived task's runs; its lingering worker waits for its grace");
                        return;
                    }
                };
                for run in runs.into_iter().filter(|r| !r.is_open() && r.worker_pid.is_some()) {
                    act.end_now(run, ctx);
                }
            })
            .spawn(ctx);
    }
}

impl ReaperActor {
    /// Fires `run_id`'s scheduled kill now, if one waits; false if none does.
    fn fire_now(&mut self, run_id: RunId, ctx: &mut Context<Self>) -> bool {
        let Some(p) = self.pending.remove(&run_id) else {
            return false;
        };
        ctx.cancel_future(p.timer);
        self.fire(p.closed, ctx);
        true
    }

    /// Ends the worker of closed run `run` (its evidence still on the row) now: through the
    /// kill scheduled for it, brought forward; else through its own WorkerActor; else, a
    /// previous incarnation's, under the fingerprint rules as the sweep would.
    fn end_now(&mut self, run: board::Run, ctx: &mut Context<Self>) {
        // As if its grace were over: a terminal reap (its `terminal_worker_reaped` event).
        if self.fire_now(run.id, ctx) {
            return;
        }
        if let Some(worker) = self.owned.get(&run.id).cloned()
            && worker.connected()
        {
            if !self.left_to_its_worker(run.id) {
                self.terminate_owned(run.id, &worker, TerminateReason::TerminalReap);
            }
            return;
        }
        let (Some(pid), Some(fingerprint)) = (
            run.worker_pid.and_then(|p| i32::try_from(p).ok()),
            run.fingerprint(),
        ) else {
            return; // No fingerprint: never signalled by pid.
        };
        self.reap_external(
            ReapCandidate {
                run_id: run.id,
                task_id: run.task_id,
                pid,
                fingerprint,
                ended_at: run.ended_at.unwrap_or(run.started_at),
                token: Some(run.token),
                outcome: run.outcome,
            },
            false,
            ctx,
        );
    }
}

impl Handler<EndLeftovers> for ReaperActor {
    type Result = ResponseActFuture<Self, usize>;
    fn handle(&mut self, _: EndLeftovers, _: &mut Self::Context) -> Self::Result {
        let grace_ms = self.grace.as_millis() as i64;
        let store = self.store.clone();
        let dispatcher = self.dispatcher.clone();
        let kill = self.kill_timeout;
        // A reap ends the leader's group, then what escaped it: two kill sequences at most.
        let bound = 2 * (kill + crate::process::AFTER_SIGKILL) + Duration::from_secs(2);
        let read = async move {
            let all = store
                .read(move |tx| {
                    let until = board::now_millis().saturating_add(grace_ms);
                    tx.terminal_reap_candidates(until, grace_ms)
                })
                .await?;
            // Asked, not assumed from `owned`: a RunClosed may still be on its way.
            let ids: Vec<RunId> = all.iter().map(|c| c.run_id).collect();
            let owners = match dispatcher {
                Some(d) if !ids.is_empty() => d.send(OwnedWorkers(ids)).await.unwrap_or_default(),
                _ => Vec::new(),
            };
            Ok::<_, super::store::StoreError>((all, owners))
        };
        Box::pin(read.into_actor(self).then(move |res, act, ctx| {
            let (all, owners) = match res {
                Ok(found) => found,
                Err(e) => {
                    tracing::warn!(error = %e, "reaper: cannot read the closed runs at stop; their workers are left to their grace");
                    return futures::future::Either::Left(fut::ready(0));
                }
            };
            let owned: HashSet<RunId> = owners
                .iter()
                .filter(|(_, w)| w.connected())
                .map(|(r, _)| *r)
                .chain(
                    act.owned
                        .iter()
                        .filter(|(_, w)| w.connected())
                        .map(|(r, _)| *r),
                )
                .collect();
            let mut reaps = Vec::new();
            let mut busy = 0;
            for c in all {
                if owned.contains(&c.run_id) || act.left_to_its_worker(c.run_id) {
                    continue;
                }
                if act.in_flight.contains(&c.run_id) {
                    busy += 1;
                    continue;
                }
                if let Some(p) = act.pending.remove(&c.run_id) {
                    ctx.cancel_future(p.timer);
                }
                if let Some(over) = act.reap_external_then(c, false, ctx) {
                    reaps.push(over);
                }
            }
            if !reaps.is_empty() {
                tracing::info!(runs = reaps.len(), "reaper: ending the workers of closed runs at stop");
            }
            let all_reaped = async move {
                if tokio::time::timeout(bound, futures::future::join_all(reaps))
                    .await
                    .is_err()
                {
                    tracing::warn!(
                        "reaper: the workers of closed runs were not all ended within the stop's bound"
                    );
                }
                busy
            };
            futures::future::Either::Right(all_reaped.into_actor(act))
        }))
    }
}

impl Handler<SweepNow> for ReaperActor {
    type Result = usize;
    fn handle(&mut self, _: SweepNow, ctx: &mut Self::Context) -> usize {
        self.sweep(ctx);
        self.pending.len()
    }
}

/// The external reap of `c` (see [`ReaperActor::reap_external`]): its token read if the
/// candidate has none, `board::reap_one` on a blocking thread, the verdict recorded.
async fn reap_and_record(
    store: Store,
    mut c: ReapCandidate,
    early: bool,
    kill: Duration,
) -> Result<ReapVerdict, String> {
    if c.token.is_none() {
        // The event feed carries no tokens; the run's row does. Without it, descendants that
        // escaped the group (found by their token) would be missed for good: the evidence is
        // cleared after this reap, so no sweep comes back to the run. Not readable now:
        // skipped, and the sweep (whose candidates carry it) retries.
        let run_id = c.run_id;
        let run = store
            .read(move |tx| tx.get_run(run_id))
            .await
            .map_err(|e| e.to_string())?;
        c.token = Some(run.token);
    }
    let cand = c.clone();
    let reap = actix_rt::task::spawn_blocking(move || {
        if early
            && !matches!(
                process::liveness(cand.pid, &cand.fingerprint),
                process::Liveness::Dead(_)
            )
        {
            let why = "within its grace and not proven dead".into();
            return Ok(board::Reap {
                verdict: ReapVerdict::Unknown(why),
                escapees: None,
            });
        }
        board::reap_one(&cand, &PidfdSignaller, kill)
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    let verdict = reap.verdict.clone();
    if let ReapVerdict::Unknown(why) = &verdict {
        tracing::debug!(run_id = c.run_id, pid = c.pid, %why, "reaper: liveness unknown; kept for a later sweep");
        return Ok(verdict);
    }
    store
        .with_tx(move |tx, now| tx.record_reap(&c, &reap, now))
        .await
        .map_err(|e| e.to_string())?;
    Ok(verdict)
}

fn log_reap(run_id: RunId, res: Result<ReapVerdict, String>) {
    match res {
        Ok(ReapVerdict::Reaped(how)) => {
            tracing::info!(
                run_id,
                ended_by = how.as_str(),
                "reaper: terminal worker ended"
            )
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(run_id, error = %e, "reaper: skipping run"),
    }
}
