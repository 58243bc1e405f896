//! DispatcherActor: claims ready tasks within the caps and starts one WorkerActor per run.
//!
//! Event-driven: every committed board event that can free a slot or make a task claimable
//! (a task added, a run closed, a worker exited, a dependency done, …) triggers a pass at
//! once; the periodic tick only backs that up and runs the time-based chores. Passes never
//! overlap: a trigger during a pass schedules exactly one more.

mod reconcile;
#[doc(hidden)]
pub use reconcile::delay_reconciles;
mod retention;

/// See [`delay_run_closed`].
static RUN_CLOSED_DELAY_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Test hook: every `RunClosed` this process's dispatchers hand the reaper arrives `delay`
/// late (as behind a busy actor thread). Process-wide: for a test binary of its own.
#[doc(hidden)]
pub fn delay_run_closed(delay: Duration) {
    RUN_CLOSED_DELAY_MS.store(
        delay.as_millis() as u64,
        std::sync::atomic::Ordering::SeqCst,
    );
}

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;

use super::outcome::ExitPolicy;
use super::reaper::{ReaperActor, RunClosed, WorkerGone};
use super::spawn::{self, SpawnSpec, Spawner};
use super::store::Store;
use super::worker::{Terminate, TerminateReason, WorkerActor};
use crate::board::{self, Claim, Event, RunId, RunOutcome, Task, TaskId, now_millis};
use crate::config::Config;
use crate::process::{self, Fingerprint};

/// Board events that never change what can be claimed.
const QUIET_KINDS: &[&str] = &[
    "heartbeat",
    "worker_spawned",
    "commented",
    "claimed",
    "worker_exited",
    "pruned",
];

/// Whether `on_event` does anything for an event of `kind`: a quiet kind is only looked at
/// when it is a worker's exit (which marks the run's later events as the exit's own).
fn reacts_to(kind: &str) -> bool {
    kind == "worker_exited" || !QUIET_KINDS.contains(&kind)
}

/// How often the tick re-runs the promotion safety net (see `tick`).
const PROMOTE_SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Kinds the transaction recording a worker's exit appends after `worker_exited`.
/// (`terminal_worker_reaped` is left out: the reaper also writes it, in a transaction of its
/// own.)
const EXIT_TX_KINDS: &[&str] = &["run_closed", "completed", "retry_scheduled", "gave_up"];

/// Run a dispatch pass now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Kick;

/// A committed board event (from the store's feed).
#[derive(Message)]
#[rtype(result = "()")]
struct BoardEvent(Arc<Event>);

/// The worker of a run has a pid.
#[derive(Message)]
#[rtype(result = "()")]
pub struct WorkerSpawned {
    pub run_id: RunId,
    pub pid: i32,
}

/// The worker actor of a run has finished (its process exited and the exit is recorded, or
/// it never started).
#[derive(Message)]
#[rtype(result = "()")]
pub struct WorkerFinished {
    pub run_id: RunId,
    pub task_id: TaskId,
    /// The transaction that recorded the exit also claimed whatever the freed slot allows
    /// (claim-on-close ran without error): no pass is needed for this worker's end.
    pub refilled: bool,
}

/// A worker's evidence landed on a run that had already closed (archived between claim and
/// spawn, or a report faster than the commit): its `run_closed` event carried no pid, so the
/// reaper must hear of it now.
#[derive(Message)]
#[rtype(result = "()")]
pub struct EvidenceAfterClose {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub pid: i32,
    /// `None` when it could not be read at spawn (the reaper then ends it through its actor).
    pub fingerprint: Option<Fingerprint>,
    pub outcome: RunOutcome,
    pub ended_at: board::Millis,
}

/// A worker's leader has exited and the store refused to record it (a full disk): it will be
/// recorded when it can. Meanwhile the run is not judged stale — the worker is gone, its
/// silence is no staleness, and its exit will close the run.
#[derive(Message)]
#[rtype(result = "()")]
pub struct ExitPending {
    pub run_id: RunId,
}

impl Handler<ExitPending> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, m: ExitPending, _: &mut Self::Context) {
        if let Some(w) = self.workers.get_mut(&m.run_id) {
            w.exit_pending = true;
        }
    }
}

impl Handler<EvidenceAfterClose> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, m: EvidenceAfterClose, _: &mut Self::Context) {
        self.notify_reaper(
            m.run_id,
            m.task_id,
            m.pid,
            m.fingerprint,
            Some(m.outcome),
            m.ended_at,
        );
    }
}

/// A run's time limit: the task's own when it sets one (0 meaning none, as `"0s"` does in the
/// config), else its assignee's (also for a negative value, which means nothing).
fn effective_max_runtime(task_ms: Option<i64>, assignee: Option<Duration>) -> Option<Duration> {
    match task_ms {
        Some(ms) if ms > 0 => Some(Duration::from_millis(ms as u64)),
        Some(0) => None,
        _ => assignee.filter(|d| !d.is_zero()),
    }
}

#[cfg(test)]
#[test]
fn a_tasks_max_runtime_overrides_its_assignees_and_zero_means_none() {
    let hour = Some(Duration::from_secs(3600));
    assert_eq!(effective_max_runtime(None, hour), hour);
    assert_eq!(effective_max_runtime(None, None), None);
    assert_eq!(
        effective_max_runtime(Some(1500), hour),
        Some(Duration::from_millis(1500))
    );
    assert_eq!(effective_max_runtime(Some(0), hour), None);
    assert_eq!(effective_max_runtime(Some(-5), hour), hour);
}

/// Live workers of this incarnation: (run, task, pid).
#[derive(Message)]
#[rtype(result = "Vec<(RunId, TaskId, Option<i32>)>")]
pub struct LiveWorkers;

/// Which of `runs` have a live WorkerActor of this incarnation, with its address: the reaper's
/// sweep asks before it takes a run closed during this incarnation for one nobody watches.
/// Ownership, not timing: a `RunClosed` still on its way, or lost to a lagging event feed,
/// never makes the sweep start a second kill of a worker its own actor holds.
#[derive(Message)]
#[rtype(result = "Vec<(RunId, Addr<WorkerActor>)>")]
pub struct OwnedWorkers(pub Vec<RunId>);

/// Stop claiming. With `terminate`, also end every live worker (their runs are released
/// first, so the tasks go back to `ready` without counting a failure) and answer once they
/// have all exited or `kill_timeout` + 2 s have passed. Without, answer once no worker's actor
/// has an exit or evidence still to record (see [`super::worker::Unsettled`]), within the same
/// bound.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StopDispatching {
    pub terminate: bool,
}

/// What a claim needs to respect the caps; shared with the workers so that a worker's exit
/// can claim the next task in the same transaction that closes its run ("claim on close":
/// a freed slot is refilled without another commit and another hop through the dispatcher).
#[derive(Debug, Clone)]
pub struct ClaimParams {
    pub rules: board::ClaimRules,
    /// False once shutdown began: nothing is claimed any more.
    pub accepting: Arc<std::sync::atomic::AtomicBool>,
}

/// Claims ready tasks within the caps, unless shutdown began.
pub fn claim_ready(
    tx: &board::Tx<'_>,
    now: board::Millis,
    p: &ClaimParams,
) -> board::Result<Vec<(Claim, Task)>> {
    if !p.accepting.load(std::sync::atomic::Ordering::Acquire) {
        return Ok(Vec::new());
    }
    tx.claim_ready(now, &p.rules, u32::MAX)
}

/// Runs claimed elsewhere (by a worker's exit): start their workers.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Claimed(pub Vec<(Claim, Task)>);

struct Worker {
    addr: Addr<WorkerActor>,
    task_id: TaskId,
    pid: Option<i32>,
    /// Its `worker_exited` event was seen: the events that follow for its run come from the
    /// exit's own transaction, which claims for the freed slot itself (claim-on-close).
    exit_seen: bool,
    /// The run's token: descendants carrying it belong to this live run.
    token: String,
    /// Its leader's exit waits to be recorded ([`ExitPending`]).
    exit_pending: bool,
}

/// The actor.
pub struct DispatcherActor {
    config: Arc<Config>,
    store: Store,
    reaper: Addr<ReaperActor>,
    /// Starts new workers' processes (handed to each WorkerActor).
    spawner: Spawner,
    claimer: String,
    workers: HashMap<RunId, Worker>,
    caps: BTreeMap<String, u32>,
    in_pass: bool,
    again: bool,
    accepting: bool,
    /// `accepting`, shared with the workers' claim-on-close.
    accepting_flag: Arc<std::sync::atomic::AtomicBool>,
    /// Open runs of a previous incarnation whose worker's liveness is Unknown (or that have no
    /// fingerprint): held, never signalled, re-checked every tick. Value: deferral recorded.
    held: HashMap<RunId, bool>,
    /// Runs of a previous incarnation whose closing or release has been sent to the store.
    closing: std::collections::HashSet<RunId>,
    reconciling: bool,
    last_lease_refresh: Option<std::time::Instant>,
    /// When this incarnation started (board time). Staleness is judged only over time it was
    /// there to hear heartbeats: a worker it adopts has not been silent while no supervisor ran
    /// (its heartbeat was waiting to reconnect), and gets a full `stale_after` from here.
    watching_since: board::Millis,
    /// For each open run this incarnation adopted: what the supervisors before it had heard
    /// from its worker, for `stale_after` ([`reconcile::HeardBefore`]). Kept past its
    /// WorkerActor, so that adopting the same worker again never counts this incarnation's
    /// own listening twice.
    heard_before: HashMap<RunId, reconcile::HeardBefore>,
    /// True while a tick's blocking chores (stray-orphan scan, zombie reaping, log rotation)
    /// run on the blocking pool. A tick that finds them still running skips them: with a short
    /// tick or a slow /proc, rounds would otherwise pile up on the pool faster than they
    /// finish, each one scanning /proc again, until the supervisor starves (seen with a 5 ms
    /// tick on 2 loaded cores: 100+ blocking threads, workers' exits recorded seconds late,
    /// dispatching stalled).
    chores_running: Arc<std::sync::atomic::AtomicBool>,
    retention: retention::Retention,
    last_promote_sweep: Option<std::time::Instant>,
    /// When the tick's chores last gave the allocator's free memory back (see `trim_heap`).
    last_heap_trim: Option<std::time::Instant>,
    /// True once the first reconcile has decided about every run of a previous incarnation
    /// (adopted, held, or closing) — including the runs whose worker was never recorded, which
    /// it settles (what carries their token ended, the run released). The control socket accepts, and
    /// `Supervisor::start` returns, only after that; a `terminate` stop waits for it, or the
    /// workers it adopts after would be left running.
    reconciled_once: tokio::sync::watch::Sender<bool>,
    /// Unrecorded runs whose settling (carriers ended, run released) is still under way.
    first_followups: usize,
    /// How many of those have been written so far: a reconcile that read the board before one
    /// was does not complete the first reconcile (see `reconcile`).
    followups_settled: u64,
}

impl DispatcherActor {
    /// A dispatcher over `store` for `config`.
    pub fn new(
        config: Arc<Config>,
        store: Store,
        reaper: Addr<ReaperActor>,
        spawner: Spawner,
    ) -> Self {
        let caps = config
            .assignees
            .iter()
            .map(|(name, a)| (name.clone(), a.max_in_progress))
            .collect();
        DispatcherActor {
            // Unique per incarnation even if a later one gets the same pid.
            claimer: format!(
                "runwarden:{}:{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ),
            config,
            store,
            reaper,
            spawner,
            workers: HashMap::new(),
            caps,
            in_pass: false,
            again: false,
            watching_since: board::now_millis(),
            heard_before: HashMap::new(),
            accepting: true,
            accepting_flag: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            held: HashMap::new(),
            closing: Default::default(),
            reconciling: false,
            last_lease_refresh: None,
            chores_running: Arc::default(),
            retention: retention::Retention::default(),
            last_promote_sweep: None,
            last_heap_trim: None,
            reconciled_once: tokio::sync::watch::Sender::new(false),
            first_followups: 0,
            followups_settled: 0,
        }
    }

    /// Turns true once the first reconcile has decided about every run of a previous
    /// incarnation (see the field `reconciled_once`).
    pub fn first_reconcile_done(&self) -> tokio::sync::watch::Receiver<bool> {
        self.reconciled_once.subscribe()
    }

    fn claim_params(&self) -> ClaimParams {
        ClaimParams {
            rules: board::ClaimRules {
                caps: self.caps.clone(),
                max_in_progress: self.config.supervisor.max_in_progress,
                claimer: self.claimer.clone(),
                lease_ms: self.config.leases.claim_ttl.as_millis() as i64,
            },
            accepting: self.accepting_flag.clone(),
        }
    }

    fn pass(&mut self, ctx: &mut Context<Self>) {
        if !self.accepting {
            return;
        }
        if self.in_pass {
            self.again = true;
            return;
        }
        self.in_pass = true;
        let params = self.claim_params();
        let store = self.store.clone();
        async move {
            store
                .with_tx(move |tx, now| claim_ready(tx, now, &params))
                .await
        }
        .into_actor(self)
        .map(|res, act, ctx| {
            act.in_pass = false;
            match res {
                Ok(claimed) => act.start_claimed(claimed, ctx),
                Err(e) => tracing::warn!(error = %e, "dispatch pass failed"),
            }
            if std::mem::take(&mut act.again) {
                act.pass(ctx);
            }
        })
        .spawn(ctx);
    }

    /// Starts the workers of freshly claimed runs — unless shutdown began meanwhile (a pass or
    /// an exit's claim committed just before it): then the tasks go back, no failure counted.
    fn start_claimed(&mut self, claimed: Vec<(Claim, Task)>, ctx: &mut Context<Self>) {
        if self.accepting {
            for (claim, task) in claimed {
                if self.closing.contains(&claim.run_id) {
                    // Its reply came so late (a commit stalled past JUST_CLAIMED_MS) that
                    // reconcile took the run for an abandoned claim and is settling it: no
                    // worker is started for it now, so none can be ended by its token or run
                    // beside a second one.
                    tracing::warn!(
                        run_id = claim.run_id,
                        "claim reply too late; left to reconcile"
                    );
                    continue;
                }
                self.start_worker(claim, task, ctx);
            }
            return;
        }
        if claimed.is_empty() {
            return;
        }
        let store = self.store.clone();
        actix_rt::spawn(async move {
            let _ = store
                .with_tx(move |tx, now| {
                    for (claim, _) in &claimed {
                        let _ = tx.nested(|tx| {
                            tx.reclaim_task(claim.task_id, "supervisor shutdown", now)
                        });
                        // Never started, whatever became of the run meanwhile (archived,
                        // completed by force): it holds neither its task nor a slot.
                        tx.settle_spawn(claim.run_id)?;
                    }
                    Ok(())
                })
                .await;
        });
    }

    fn start_worker(&mut self, claim: Claim, task: Task, ctx: &mut Context<Self>) {
        let token = claim.token.clone();
        let Some((spec, policy, max_runtime)) = self.worker_setup(&task, claim.run_id, claim.token)
        else {
            return;
        };
        let worker = WorkerActor::new(
            spec,
            self.spawner.clone(),
            policy,
            max_runtime,
            self.config.reaper.kill_timeout,
            self.store.clone(),
            ctx.address(),
        );
        self.run_worker(worker, claim.run_id, task.id, None, token);
    }

    /// Starts `worker` (with claim-on-close) and keeps its address under `run_id`.
    fn run_worker(
        &mut self,
        worker: WorkerActor,
        run_id: RunId,
        task_id: TaskId,
        pid: Option<i32>,
        token: String,
    ) {
        let addr = worker.with_claim_on_close(self.claim_params()).start();
        self.workers.insert(
            run_id,
            Worker {
                addr,
                task_id,
                pid,
                exit_seen: false,
                token,
                exit_pending: false,
            },
        );
    }

    /// The exit policy for `task`'s assignee (the config's defaults if it is gone).
    fn policy_for(&self, task: &Task) -> ExitPolicy {
        task.assignee
            .as_deref()
            .and_then(|a| self.config.assignee(a))
            .map(|a| ExitPolicy::new(&self.config, a))
            .unwrap_or_else(|| ExitPolicy::defaults(&self.config))
    }

    /// Spawn spec, exit policy and max runtime of a run of `task` under the current config.
    fn worker_setup(
        &self,
        task: &Task,
        run_id: RunId,
        token: String,
    ) -> Option<(SpawnSpec, ExitPolicy, Option<Duration>)> {
        let name = task.assignee.clone().unwrap_or_default();
        let Some(assignee) = self.config.assignee(&name) else {
            // plan_claims only plans known assignees; a config change across a restart can.
            tracing::error!(task_id = task.id, assignee = %name, "dispatch: run of a task with no such assignee");
            return None;
        };
        Some(self.setup_with(task, run_id, token, Some(assignee)))
    }

    /// [`Self::worker_setup`] for a live worker of a previous incarnation. Its assignee may have
    /// left the config since: the worker is then still adopted — watched, ended at its task's
    /// max runtime or when its run closes — under the default exit policy, rather than left
    /// running unsupervised.
    fn adoption_setup(
        &self,
        task: &Task,
        run_id: RunId,
        token: String,
    ) -> (SpawnSpec, ExitPolicy, Option<Duration>) {
        let name = task.assignee.as_deref().unwrap_or_default();
        let assignee = self.config.assignee(name);
        if assignee.is_none() {
            tracing::warn!(task_id = task.id, assignee = %name, "reconcile: adopting a worker whose assignee is no longer configured (default exit policy, the task's own max runtime)");
        }
        self.setup_with(task, run_id, token, assignee)
    }

    fn setup_with(
        &self,
        task: &Task,
        run_id: RunId,
        token: String,
        assignee: Option<&crate::config::AssigneeConfig>,
    ) -> (SpawnSpec, ExitPolicy, Option<Duration>) {
        let config = &self.config;
        let spec = SpawnSpec {
            run_id,
            task_id: task.id,
            token,
            title: task.title.clone(),
            argv: assignee.map(|a| a.command.clone()).unwrap_or_default(),
            env: assignee.map(|a| a.env.clone()).unwrap_or_default(),
            own_cwd: assignee.is_none_or(|a| a.cwd.is_none()),
            cwd: assignee
                .and_then(|a| a.cwd.clone())
                .unwrap_or_else(|| config.work_dir().join(task.id.to_string())),
            socket: config.socket_path(),
            log_path: config.logs_dir().join(format!("{}.log", task.id)),
            log_max_bytes: config.supervisor.log_max_bytes,
            uid: assignee.and_then(|a| a.uid),
            gid: assignee.and_then(|a| a.gid),
            umask: assignee.and_then(|a| a.umask),
            rlimits: assignee.map(|a| a.rlimits.clone()).unwrap_or_default(),
        };
        let max_runtime =
            effective_max_runtime(task.max_runtime_ms, assignee.and_then(|a| a.max_runtime));
        let policy = assignee
            .map(|a| ExitPolicy::new(config, a))
            .unwrap_or_else(|| ExitPolicy::defaults(config));
        (spec, policy, max_runtime)
    }

    fn on_event(&mut self, ev: &Event, ctx: &mut Context<Self>) {
        if ev.kind == "run_closed"
            && let Some(run_id) = ev.run_id
        {
            self.on_run_closed(run_id, ev);
        }
        // A finished task archived: a worker of its still running after its report (within
        // its grace) is put away with it. (A running task's archive closed its run by force:
        // its worker is ended through that close.)
        if ev.kind == "archived"
            && ev.payload.get("from").and_then(|v| v.as_str()) != Some("running")
            && let Some(task_id) = ev.task_id
        {
            self.reaper
                .do_send(crate::actors::reaper::TaskArchived { task_id });
        }
        if ev.kind == "retry_scheduled"
            && let Some(at) = ev.payload.get("not_before").and_then(|v| v.as_i64())
        {
            // Wake exactly when the backoff ends instead of waiting for a tick.
            let delay = Duration::from_millis(at.saturating_sub(now_millis()).max(0) as u64);
            ctx.run_later(delay, |act, ctx| act.pass(ctx));
        }
        if let Some(w) = ev.run_id.and_then(|r| self.workers.get_mut(&r)) {
            if ev.kind == "worker_exited" {
                w.exit_seen = true;
            }
            if w.exit_seen && EXIT_TX_KINDS.contains(&ev.kind.as_str()) {
                // Written by the exit's own transaction, which ran claim-on-close after them;
                // should that have failed, WorkerFinished says so and a pass follows.
                return;
            }
        }
        if !QUIET_KINDS.contains(&ev.kind.as_str()) {
            self.pass(ctx);
        }
    }

    fn on_run_closed(&mut self, run_id: RunId, ev: &Event) {
        let p = &ev.payload;
        let Some(pid) = p
            .get("pid")
            .and_then(|v| v.as_i64())
            .and_then(|v| i32::try_from(v).ok())
        else {
            return; // No live-worker evidence (already exited): nothing to end.
        };
        let fingerprint = match (
            p.get("boot_id").and_then(|v| v.as_str()),
            p.get("start_ticks").and_then(|v| v.as_u64()),
        ) {
            (Some(boot_id), Some(ticks)) => Some(Fingerprint {
                boot_id: boot_id.to_string(),
                start_ticks: ticks,
                pidfs_ino: p.get("pidfs_ino").and_then(|v| v.as_u64()),
            }),
            // No fingerprint (a legacy row; a start that cannot fingerprint its child fails
            // now): never signalled by pid — but a WorkerActor of ours holds its pidfd.
            _ if self.workers.contains_key(&run_id) => None,
            _ => return,
        };
        let outcome: Option<RunOutcome> = p
            .get("outcome")
            .and_then(|v| v.as_str())
            .and_then(|s| s.parse().ok());
        self.notify_reaper(
            run_id,
            ev.task_id.unwrap_or_default(),
            pid,
            fingerprint,
            outcome,
            ev.at,
        );
    }

    /// Hands a closed run whose worker may be alive to the reaper, with the right grace: a
    /// worker that closed its own run gets the grace to finish (persist, exit); a run closed by
    /// force (archived, reclaimed, timed out, stale) wants its worker gone now.
    fn notify_reaper(
        &mut self,
        run_id: RunId,
        task_id: TaskId,
        pid: i32,
        fingerprint: Option<Fingerprint>,
        outcome: Option<RunOutcome>,
        ended_at: board::Millis,
    ) {
        let grace = if outcome.is_some_and(RunOutcome::closed_by_its_worker) {
            self.config.reaper.grace
        } else {
            Duration::ZERO
        };
        let closed = RunClosed {
            run_id,
            task_id,
            pid,
            fingerprint,
            ended_at,
            grace,
            worker: self.workers.get(&run_id).map(|w| w.addr.clone()),
        };
        let delay = RUN_CLOSED_DELAY_MS.load(std::sync::atomic::Ordering::SeqCst);
        if delay == 0 {
            self.reaper.do_send(closed);
        } else {
            let reaper = self.reaper.clone();
            actix_rt::spawn(async move {
                tokio::time::sleep(Duration::from_millis(delay)).await;
                reaper.do_send(closed);
            });
        }
    }

    fn tick(&mut self, ctx: &mut Context<Self>) {
        if !self.accepting {
            // Stopping: the control socket is closed, so a worker's heartbeat cannot land, and
            // no run may be closed stale, or for its lease, for that. The tick's sweeps are the
            // next incarnation's. (A worker's own `max_runtime` timer still ends it: the
            // limit does not depend on what the worker can report.)
            return;
        }
        self.pass(ctx);
        self.reconcile(ctx);
        crate::actors::proc_thread::say_if_stuck(std::time::Instant::now());
        // Safety net for promotions: transitions promote children themselves, but a board
        // changed behind our back (an older build, a hand edit) must not strand a child in
        // `todo`. O(todo rows) in a write transaction (86 ms with 50 000 waiting children), so
        // at start and then once a minute, not on every tick.
        if self
            .last_promote_sweep
            .is_none_or(|t| t.elapsed() >= PROMOTE_SWEEP_EVERY)
        {
            self.last_promote_sweep = Some(std::time::Instant::now());
            let store = self.store.clone();
            actix_rt::spawn(async move {
                if let Err(e) = store.with_tx(|tx, now| tx.promote_ready(now)).await {
                    tracing::warn!(error = %e, "promotion sweep failed");
                }
            });
        }
        self.retention.sweep(&self.config, &self.store);
        // Zombies of descendants re-parented to us (we are a subreaper) are collected here;
        // our own workers' leaders are reaped by their actors, never here.
        let logs: Vec<_> = self
            .workers
            .values()
            .map(|w| self.config.logs_dir().join(format!("{}.log", w.task_id)))
            .collect();
        let max_log = self.config.supervisor.log_max_bytes;
        let live_tokens: std::collections::HashSet<String> =
            self.workers.values().map(|w| w.token.clone()).collect();
        let kill = self.config.reaper.kill_timeout;
        if self
            .chores_running
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return; // The previous round is still running: skip this one (see the field).
        }
        let running = ClearOnDrop(self.chores_running.clone());
        let trim = self
            .last_heap_trim
            .is_none_or(|t| t.elapsed() >= HEAP_TRIM_EVERY);
        if trim {
            self.last_heap_trim = Some(std::time::Instant::now());
        }
        // Without the subreaper role no orphan is ours, and the host's own children must be
        // left to the host.
        let subreaper = self.config.supervisor.subreaper;
        let store = self.store.clone();
        // Off the runtime's blocking pool: the scan can wait on a process stuck on a hung
        // mount (see proc_thread); the round's flag keeps it to one at a time.
        // Strays found are ended as trees are (kill_timeout); the commit may wait on a full disk.
        let expected = kill.saturating_add(crate::process::AFTER_SIGKILL);
        crate::actors::proc_thread::spawn_for("tick chores", expected, move || {
            let _running = running;
            if subreaper {
                // One /proc scan per tick serves both sweeps below.
                let children = process::own_children();
                // Escaped descendants of finished runs (setsid, double fork), re-parented to us.
                // Only runs this board can vouch for: the run exists here with that very token
                // and is closed. An orphan carrying an unknown token belongs to another
                // supervisor sharing this process (embedding, tests); one of an open run is a
                // worker of a previous incarnation awaiting adoption. Neither is ours to end.
                let is_stray = |run_id: RunId, token: &str| {
                    !live_tokens.contains(token)
                        && store
                            .read_blocking(|tx| tx.get_run(run_id))
                            .is_ok_and(|run| run.token == token && !run.is_open())
                };
                let ended = process::descendants::end_stray_orphans(&children, &is_stray, kill);
                record_strays(&store, &ended);
                // Never a child some owner will reap itself (worker leaders, hooks): process-wide,
                // since several supervisors may share this process.
                let reaped = process::reap_orphans_among(&children, &process::owned::is_registered);
                if !reaped.is_empty() {
                    tracing::debug!(?reaped, "reaped orphaned descendants");
                }
            }
            for log in logs {
                spawn::rotate_if_needed(&log, max_log);
            }
            if trim {
                trim_heap();
            }
        });
    }
}

/// How often the tick's chores give the allocator's free memory back.
const HEAP_TRIM_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Gives the memory the allocator holds free back to the system (glibc's `malloc_trim`). Reads
/// run on the runtime's blocking threads, each with an allocator arena of its own; a burst of
/// large replies (many clients paging through the event log at once) leaves every arena at its
/// peak, and glibc returns little of it by itself: the supervisor's resident size would only
/// ever grow with its busiest moment (measured: 10 → 130 MB after four bursts of 100 clients,
/// 3 MB of it in use). A few milliseconds every 10 s.
fn trim_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointer and is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Puts what the sweep for strays ended on the record, one event per run, as for every
/// process the supervisor signals (a board that refuses the write, e.g. a full disk, loses the
/// event: the end is still logged). Waits for the commit: this runs on the chore thread, never
/// an actor's.
fn record_strays(store: &Store, ended: &[process::descendants::EndedStray]) {
    if ended.is_empty() {
        return;
    }
    tracing::info!(?ended, "ended descendants that outlived their run");
    let mut by_run: std::collections::BTreeMap<RunId, (Vec<process::Pid>, bool)> =
        std::collections::BTreeMap::new();
    for e in ended {
        let (pids, sigkill) = by_run.entry(e.run_id).or_default();
        pids.push(e.pid);
        *sigkill |= e.sigkill;
    }
    let recorded = futures::executor::block_on(store.with_tx(move |tx, now| {
        for (&run_id, (pids, sigkill)) in &by_run {
            tx.record_strays_ended(run_id, pids, *sigkill, now)?;
        }
        Ok(())
    }));
    if let Err(e) = recorded {
        tracing::warn!(error = %e, "cannot record the descendants ended as strays");
    }
}

/// Clears a "round running" flag (the tick's chores, a retention sweep) when the round ends,
/// even by a panic.
struct ClearOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::Release);
    }
}

impl Actor for DispatcherActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let (me, lagging) = (ctx.address(), ctx.address());
        self.store.forward_events(
            move |ev| {
                // Most of a lifecycle's events need nothing of the dispatcher: they are not
                // queued on its mailbox at all.
                if reacts_to(&ev.kind) {
                    me.do_send(BoardEvent(ev));
                }
                me.connected()
            },
            // Lagging only loses wake-ups, which the next pass covers.
            move |missed_commits| {
                tracing::debug!(missed_commits, "dispatcher lagged behind the event feed");
                lagging.do_send(Kick);
            },
        );
        self.reaper.do_send(crate::actors::reaper::DispatcherIs(
            ctx.address().recipient(),
        ));
        ctx.run_interval(self.config.supervisor.tick, |act, ctx| act.tick(ctx));
        self.reconcile(ctx);
        self.pass(ctx);
        self.warn_of_unconfigured_assignees(ctx);
    }
}

impl DispatcherActor {
    /// Tasks left waiting for an assignee the config no longer has never run (nothing claims
    /// them): said once at start, as `status` says it on request.
    fn warn_of_unconfigured_assignees(&self, ctx: &mut Context<Self>) {
        let (store, config) = (self.store.clone(), self.config.clone());
        ctx.spawn(
            async move {
                match store.read(|tx| tx.waiting_by_assignee()).await {
                    Ok(waiting) => {
                        for (name, tasks) in config.unconfigured(waiting) {
                            tracing::warn!(assignee = %name, tasks, "tasks wait for an assignee the config does not have: they run once it is configured again (or archive them)");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "cannot count waiting tasks by assignee"),
                }
            }
            .into_actor(self),
        );
    }
}

impl Handler<Kick> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, _: Kick, ctx: &mut Self::Context) {
        self.pass(ctx);
    }
}

impl Handler<BoardEvent> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, msg: BoardEvent, ctx: &mut Self::Context) {
        self.on_event(&msg.0, ctx);
    }
}

impl Handler<Claimed> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, msg: Claimed, ctx: &mut Self::Context) {
        self.start_claimed(msg.0, ctx);
    }
}

impl Handler<WorkerSpawned> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, msg: WorkerSpawned, _: &mut Self::Context) {
        if let Some(w) = self.workers.get_mut(&msg.run_id) {
            w.pid = Some(msg.pid);
        }
    }
}

impl Handler<WorkerFinished> for DispatcherActor {
    type Result = ();
    fn handle(&mut self, msg: WorkerFinished, ctx: &mut Self::Context) {
        self.workers.remove(&msg.run_id);
        self.reaper.do_send(WorkerGone { run_id: msg.run_id });
        if !msg.refilled {
            self.pass(ctx);
        }
    }
}

impl Handler<OwnedWorkers> for DispatcherActor {
    type Result = MessageResult<OwnedWorkers>;
    fn handle(&mut self, msg: OwnedWorkers, _: &mut Self::Context) -> Self::Result {
        MessageResult(
            msg.0
                .into_iter()
                .filter_map(|r| self.workers.get(&r).map(|w| (r, w.addr.clone())))
                .collect(),
        )
    }
}

impl Handler<LiveWorkers> for DispatcherActor {
    type Result = MessageResult<LiveWorkers>;
    fn handle(&mut self, _: LiveWorkers, _: &mut Self::Context) -> Self::Result {
        let mut v: Vec<_> = self
            .workers
            .iter()
            .map(|(r, w)| (*r, w.task_id, w.pid))
            .collect();
        v.sort();
        MessageResult(v)
    }
}

impl Handler<StopDispatching> for DispatcherActor {
    type Result = ResponseActFuture<Self, ()>;
    fn handle(&mut self, msg: StopDispatching, _: &mut Self::Context) -> Self::Result {
        self.accepting = false;
        self.accepting_flag
            .store(false, std::sync::atomic::Ordering::Release);
        let kill = self.config.reaper.kill_timeout;
        if !msg.terminate {
            let addrs = self.worker_addrs();
            return Box::pin(settle(addrs, stop_bound(kill)).into_actor(self));
        }
        // A stop right after the start (a SIGTERM during boot, an embedding program's
        // shutdown at once) comes before the first reconcile has adopted the previous
        // incarnation's workers: they are to be ended too. Waited for within a bound (a
        // reconcile held up by /proc must not hold the stop up for ever).
        let mut reconciled = self.reconciled_once.subscribe();
        Box::pin(
            async move {
                let first = reconciled.wait_for(|done| *done);
                if tokio::time::timeout(FIRST_RECONCILE_AT_STOP, first)
                    .await
                    .is_err()
                {
                    tracing::warn!(
                        "stopping before the first reconcile is done: workers of the previous incarnation it has not adopted yet are left running"
                    );
                }
            }
            .into_actor(self)
            .then(move |(), act, _| {
                let runs: Vec<(RunId, TaskId)> =
                    act.workers.iter().map(|(r, w)| (*r, w.task_id)).collect();
                let addrs = act.worker_addrs();
                release_and_end(act.store.clone(), runs, addrs, kill).into_actor(act)
            }),
        )
    }
}

/// How long a `terminate` stop waits for the first reconcile (see `StopDispatching`).
const FIRST_RECONCILE_AT_STOP: Duration = Duration::from_secs(10);

impl DispatcherActor {
    fn worker_addrs(&self) -> Vec<(RunId, Addr<WorkerActor>)> {
        self.workers
            .iter()
            .map(|(r, w)| (*r, w.addr.clone()))
            .collect()
    }
}

/// How long a stop waits for its workers' actors: `kill_timeout` and 2 s more, from now.
fn stop_bound(kill: Duration) -> tokio::time::Instant {
    tokio::time::Instant::from_std(crate::deadline_after(
        kill.saturating_add(Duration::from_secs(2)),
    ))
}

/// A `leave` stop: the workers are left running, but what their actors are in the middle of
/// — an exit seen and not recorded yet, a spawn's evidence, a tree end — is let finish while
/// the store still takes writes (the caller closes it next), until `deadline`: an exit the
/// supervisor saw must not be left for the next one to find "exited while unsupervised" and
/// count as a failure.
async fn settle(addrs: Vec<(RunId, Addr<WorkerActor>)>, deadline: tokio::time::Instant) {
    loop {
        let round =
            futures::future::join_all(addrs.iter().map(|(_, a)| a.send(super::worker::Unsettled)));
        let unsettled = match tokio::time::timeout_at(deadline, round).await {
            // A stopped actor (its exit recorded and done) answers nothing.
            Ok(answers) => answers.into_iter().any(|a| a.unwrap_or(false)),
            Err(_) => true,
        };
        if !unsettled || tokio::time::Instant::now() >= deadline {
            if unsettled {
                tracing::warn!(
                    "stopping with a worker's exit or evidence not yet recorded; the next supervisor's reconcile closes its run"
                );
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A `terminate` stop: the runs are released first (a worker ended by our shutdown is not the
/// task's failure), then every worker is ended, and the stop waits for their actors until
/// `kill_timeout` + 2 s after they were sent their SIGTERM.
async fn release_and_end(
    store: Store,
    runs: Vec<(RunId, TaskId)>,
    addrs: Vec<(RunId, Addr<WorkerActor>)>,
    kill: Duration,
) {
    // Release first: a worker ended by our shutdown is not the task's failure.
    // A worker whose run it closed itself (in its grace) outlived its run: its
    // end is recorded as the terminal reap it is, only sooner.
    // Each run on its own: one that cannot be read or released is said and
    // skipped, never a reason to release none (every worker would then be ended
    // with its run open, and counted a crash).
    let released = store
        .with_tx(move |tx, now| {
            let mut closed_by_worker = Vec::new();
            let mut failed = Vec::new();
            for &(run_id, task_id) in &runs {
                let one = tx.nested(|tx| {
                    let run = tx.get_run(run_id)?;
                    if run.outcome.is_some_and(|o| o.closed_by_its_worker()) {
                        return Ok(true);
                    }
                    if tx.get_task(task_id)?.current_run_id == Some(run_id) {
                        tx.reclaim_task(task_id, "supervisor shutdown", now)?;
                    }
                    Ok(false)
                });
                match one {
                    Ok(true) => closed_by_worker.push(run_id),
                    Ok(false) | Err(board::BoardError::NotFound { .. }) => {}
                    Err(e) => failed.push((run_id, e.to_string())),
                }
            }
            Ok((closed_by_worker, failed))
        })
        .await;
    let closed_by_worker = match released {
        Ok((closed_by_worker, failed)) => {
            for (run_id, error) in failed {
                tracing::warn!(run_id, %error, "shutdown: cannot release the run; its worker is ended with it open (the next start closes it)");
            }
            closed_by_worker
        }
        Err(e) => {
            tracing::warn!(error = %e, "shutdown: cannot release the runs; their workers are ended with them open (the next start closes them)");
            Vec::new()
        }
    };
    for (run_id, a) in &addrs {
        let reason = if closed_by_worker.contains(run_id) {
            TerminateReason::TerminalReap
        } else {
            TerminateReason::Shutdown
        };
        a.do_send(Terminate {
            kill_after: kill,
            reason,
        });
    }
    let deadline = stop_bound(kill);
    while addrs.iter().any(|(_, a)| a.connected()) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
