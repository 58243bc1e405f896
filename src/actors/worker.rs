//! WorkerActor: one per live run. Owns the child process, its pidfd, its fingerprint and its
//! log file; watches for the child's exit without blocking any thread; ends the child's whole
//! process group when asked. Any failure here stops this actor only: the run is closed as
//! `spawn_failed` or `crashed` and the rest of the supervisor goes on.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix::prelude::*;
use tokio::io::unix::AsyncFd;

use super::dispatcher::{ClaimParams, Claimed, DispatcherActor, WorkerFinished};
use super::outcome::{self, ExitPolicy};
use super::spawn::{self, SpawnSpec, Spawner};
use super::store::Store;
use crate::board::{self, RunId, TaskId};
use crate::process::{self, ExitStatus, Fingerprint, PidFd, descendants};

/// Why a worker is being ended; decides what its exit records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminateReason {
    /// Its run closed (completed / blocked) and the grace passed: the terminal reaper.
    TerminalReap,
    /// Its run was closed by force (archived, reclaimed, timed out, stale).
    RunClosed,
    /// The supervisor is shutting down with `shutdown = "terminate"`.
    Shutdown,
}

/// End this worker's process group: SIGTERM, then SIGKILL after `kill_after`.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Terminate {
    pub kill_after: Duration,
    pub reason: TerminateReason,
}

/// The child exited (its pidfd became readable).
#[derive(Message)]
#[rtype(result = "()")]
struct LeaderExited;

/// Extra attempts at recording an exit the store refused for a reason that is not expected to
/// pass (a full disk or a busy board is waited out for as long as it lasts).
const EXIT_RECORD_RETRIES: u32 = 5;
/// Longest pause between two attempts at recording an exit.
const EXIT_RECORD_PAUSE_MAX: Duration = Duration::from_secs(10);

/// Up to this age a leader's escaped descendants are looked for among the pids handed out
/// since its own (see `descendants::carrier_among_recent`); an older one's exit scans /proc.
/// Far below the time the pid numbering takes to come round (with the smallest usual pid_max,
/// 32 768, that would take over 130 000 forks a second).
const RECENT_PROBE_MAX_AGE: Duration = Duration::from_millis(250);

/// How long an exit waits for its tree probe before it is recorded as if the tree outlived the
/// leader (the run keeps its evidence; the tree is ended, and the evidence cleared, later). A
/// probe answers in about a millisecond; one that does not is stuck on a process that cannot
/// be read — one in the middle of an exec that closes a file on a hung FUSE or NFS mount makes
/// an open of its `/proc/<pid>/environ` (and `kcmp`) wait until the mount answers.
const EXIT_PROBE_WAIT: Duration = Duration::from_secs(5);

/// Test hook: a stall (in milliseconds) every exit probe takes first, as one stuck on an
/// unreadable process would. Zero: none.
static PROBE_STALL_MS: AtomicU64 = AtomicU64::new(0);

/// Test hook: makes every worker-exit tree probe of this process stall for `stall` before it
/// looks (see [`EXIT_PROBE_WAIT`]). Process-wide: for a test binary of its own.
#[doc(hidden)]
pub fn stall_exit_probes(stall: Duration) {
    PROBE_STALL_MS.store(stall.as_millis() as u64, Ordering::SeqCst);
}

/// Exits settled without the probe (see `record_exit`), process-wide.
static QUICK_SETTLES: AtomicU64 = AtomicU64::new(0);

/// How many worker exits this process has settled without the probe: for tests, which must
/// see that the quick path is taken, not only that its answers are right.
#[doc(hidden)]
pub fn quick_settles() -> u64 {
    QUICK_SETTLES.load(Ordering::Relaxed)
}

/// Whether an exited leader's tree outlives it: members left in its group, or descendants
/// that escaped it carrying the run's token (among the pids handed out since a `young`
/// leader's, else anywhere in /proc). Blocking: reads other processes' /proc files.
fn tree_outlives_leader(pidfd: &PidFd, token: &str, young: bool) -> bool {
    let stall = PROBE_STALL_MS.load(Ordering::SeqCst);
    if stall > 0 {
        std::thread::sleep(Duration::from_millis(stall));
    }
    pidfd.group_exists().unwrap_or(true)
        || young
            .then(|| descendants::carrier_among_recent(pidfd.pid(), token))
            .flatten()
            // A look that cannot be complete counts as "outlives": the evidence is kept.
            .unwrap_or_else(|| descendants::token_carried(token).unwrap_or(true))
}

/// [`tree_outlives_leader`] on a thread of its own ([`super::proc_thread`]), answered within
/// [`EXIT_PROBE_WAIT`]: `None` when it was not (or the probe died). A stuck probe keeps its
/// thread until the process it reads can be read again (so does the tree end that follows);
/// nothing queues behind it, and the number of probes is not capped, since a cap would make
/// healthy exits wait for stuck ones.
async fn probe_tree(pidfd: Arc<PidFd>, token: String, young: bool) -> Option<bool> {
    let probe = super::proc_thread::run("exit probe", move || {
        tree_outlives_leader(&pidfd, &token, young)
    });
    tokio::time::timeout(EXIT_PROBE_WAIT, probe).await.ok()?
}

/// Borrowed view of the pidfd for tokio's reactor.
struct Watch(Arc<PidFd>);

impl AsRawFd for Watch {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// The actor. Created by the dispatcher for a claimed run.
pub struct WorkerActor {
    spec: SpawnSpec,
    /// Starts the child (None for a worker adopted from a previous incarnation).
    spawner: Option<Spawner>,
    policy: ExitPolicy,
    max_runtime: Option<Duration>,
    kill_timeout: Duration,
    store: Store,
    dispatcher: Addr<DispatcherActor>,
    pidfd: Option<Arc<PidFd>>,
    fingerprint: Option<Fingerprint>,
    terminating: Option<TerminateReason>,
    finished: bool,
    /// Set for a worker of a previous incarnation taken over at start-up: it is not our
    /// child, so its exit status cannot be read, and its runtime started at the run's start.
    adopted_started_at: Option<board::Millis>,
    /// The exit has been handed to the store (a late `set_worker` failure is then expected).
    exit_recorded: bool,
    /// The run row holds this worker's pid and fingerprint (the spawn's `set_worker`
    /// committed, or an adopted worker's row had them): its exit need not write them again.
    evidence_on_row: bool,
    /// Claim the next task in the transaction that records this worker's exit.
    claim_on_close: Option<ClaimParams>,
    /// That claim ran (without error) and nothing changed after it: see WorkerFinished.
    refilled: bool,
    /// Our child's pid is out of the owned-children registry (see `release_pid`).
    pid_released: bool,
    /// A tree-end (terminate_tree) is running; further Terminates are redundant.
    tree_ending: bool,
    /// The last Terminate's tree-end failed: the next Terminate (its retry, or one from the
    /// reaper) is taken although `terminating` is set.
    kill_failed: bool,
    /// The max runtime was overrun and the timeout could not be recorded (see
    /// `outcome::ExitContext::timed_out`): its error, for the exit to record.
    timeout_unrecorded: Option<String>,
    /// Clear the run's evidence once the running tree-end finishes.
    clear_when_ended: bool,
    /// When our child was started (None for an adopted worker).
    spawned_at: Option<std::time::Instant>,
    /// Where our child's output starts in the task's log (the whole log for an adopted one).
    log_start: spawn::LogStart,
    /// The exit is recorded; the actor finishes once no tree-end is running (the reaper and
    /// the dispatcher keep treating the run as owned until then).
    exit_done: bool,
    /// The spawn's evidence (pid + fingerprint) is on its way to the store.
    evidence_pending: bool,
}

impl WorkerActor {
    /// A worker for one claimed run; the process starts when the actor starts.
    pub fn new(
        spec: SpawnSpec,
        spawner: Spawner,
        policy: ExitPolicy,
        max_runtime: Option<Duration>,
        kill_timeout: Duration,
        store: Store,
        dispatcher: Addr<DispatcherActor>,
    ) -> Self {
        WorkerActor {
            spawner: Some(spawner),
            ..WorkerActor::base(spec, policy, max_runtime, kill_timeout, store, dispatcher)
        }
    }

    /// Everything but the spawner (which an adopted worker has no use for).
    fn base(
        spec: SpawnSpec,
        policy: ExitPolicy,
        max_runtime: Option<Duration>,
        kill_timeout: Duration,
        store: Store,
        dispatcher: Addr<DispatcherActor>,
    ) -> Self {
        WorkerActor {
            spec,
            spawner: None,
            policy,
            max_runtime,
            kill_timeout,
            store,
            dispatcher,
            pidfd: None,
            fingerprint: None,
            terminating: None,
            finished: false,
            adopted_started_at: None,
            exit_recorded: false,
            evidence_on_row: false,
            claim_on_close: None,
            refilled: false,
            pid_released: false,
            tree_ending: false,
            kill_failed: false,
            timeout_unrecorded: None,
            clear_when_ended: false,
            spawned_at: None,
            log_start: spawn::LogStart::default(),
            exit_done: false,
            evidence_pending: false,
        }
    }

    /// Takes over the live worker of a previous incarnation: `pidfd` was opened and verified
    /// against the run's fingerprint by the caller; `log_start` is where its output starts
    /// (as recorded with its evidence; the default, the whole log, when not).
    #[allow(clippy::too_many_arguments)]
    pub fn adopt(
        spec: SpawnSpec,
        pidfd: PidFd,
        fingerprint: Fingerprint,
        log_start: spawn::LogStart,
        run_started_at: board::Millis,
        policy: ExitPolicy,
        max_runtime: Option<Duration>,
        kill_timeout: Duration,
        store: Store,
        dispatcher: Addr<DispatcherActor>,
    ) -> Self {
        let mut w = WorkerActor::base(spec, policy, max_runtime, kill_timeout, store, dispatcher);
        w.pidfd = Some(Arc::new(pidfd));
        w.fingerprint = Some(fingerprint);
        w.log_start = log_start;
        w.adopted_started_at = Some(run_started_at);
        w.evidence_on_row = true;
        w
    }

    fn start_adopted(&mut self, started_at: board::Millis, ctx: &mut Context<Self>) {
        let pid = self.pidfd.as_ref().map(|p| p.pid()).unwrap_or_default();
        tracing::info!(
            run_id = self.run_id(),
            task_id = self.task_id(),
            pid,
            "worker adopted from a previous incarnation"
        );
        self.dispatcher.do_send(super::dispatcher::WorkerSpawned {
            run_id: self.run_id(),
            pid,
        });
        if let Some(limit) = self.max_runtime {
            let elapsed =
                Duration::from_millis(board::now_millis().saturating_sub(started_at).max(0) as u64);
            ctx.run_later(limit.saturating_sub(elapsed), move |act, ctx| {
                act.timed_out(limit, ctx)
            });
        }
        self.watch(ctx);
    }

    /// Lets this worker's exit refill its slot (see [`ClaimParams`]).
    pub fn with_claim_on_close(mut self, params: ClaimParams) -> Self {
        self.claim_on_close = Some(params);
        self
    }

    fn run_id(&self) -> RunId {
        self.spec.run_id
    }

    fn task_id(&self) -> TaskId {
        self.spec.task_id
    }

    /// Reports the end of this run to the dispatcher (once) and stops the actor.
    fn finish(&mut self, ctx: &mut Context<Self>) {
        if !self.finished {
            self.finished = true;
            self.dispatcher.do_send(WorkerFinished {
                run_id: self.run_id(),
                task_id: self.task_id(),
                refilled: self.refilled,
            });
        }
        ctx.stop();
    }

    fn spawn_failed(&mut self, error: spawn::SpawnError, ctx: &mut Context<Self>) {
        let shortage = error.shortage;
        tracing::warn!(run_id = self.run_id(), task_id = self.task_id(), %error, shortage, "worker: spawn failed");
        let store = self.store.clone();
        let (run_id, policy) = (self.run_id(), self.policy.clone());
        async move { outcome::record_spawn_failure(&store, run_id, policy, error).await }
            .into_actor(self)
            .map(|res, act, ctx| {
                if let Err(e) = res {
                    tracing::error!(run_id = act.run_id(), error = %e, "worker: cannot record spawn failure");
                }
                act.finish(ctx);
            })
            .wait(ctx);
    }

    /// Takes our child's pid out of the owned-children registry — once: after its reaping the
    /// pid may already name another worker, whose registration must stay.
    fn release_pid(&mut self, pidfd: &PidFd) {
        if !std::mem::replace(&mut self.pid_released, true) {
            process::owned::unregister(pidfd.pid());
        }
    }

    fn on_exit(&mut self, ctx: &mut Context<Self>) {
        let Some(pidfd) = self.pidfd.clone() else {
            return self.finish(ctx);
        };
        let status = match pidfd.try_reap() {
            _ if self.adopted_started_at.is_some() => return self.on_adopted_exit(pidfd, ctx),
            Ok(Some(s)) => {
                self.release_pid(&pidfd);
                s
            }
            Ok(None) => {
                // Readable but not yet reapable cannot happen for our own child; watch again.
                tracing::debug!(
                    run_id = self.run_id(),
                    "worker: pidfd readable before exit; re-arming"
                );
                return self.watch(ctx);
            }
            Err(e) => {
                // Someone else reaped it (it should not happen: see process::owned); the
                // status is lost, which the run records as "exit status unknown".
                tracing::error!(run_id = self.run_id(), error = %e, "worker: cannot reap child");
                self.release_pid(&pidfd);
                return self.record_exit(pidfd, None, ctx);
            }
        };
        tracing::info!(
            run_id = self.run_id(),
            pid = pidfd.pid(),
            ?status,
            "worker exited"
        );
        self.record_exit(pidfd, Some(status), ctx);
    }

    /// The exit of a worker adopted from a previous incarnation: not our child, so its parent
    /// (init, or a subreaper) reaps it, but the kernel may still tell its status
    /// (`process::exit_status`; it reads `/proc`, so off this thread: on a thread of its own,
    /// not the blocking pool, where stuck probes could hold it up, and answered within
    /// [`EXIT_PROBE_WAIT`]). Unknown otherwise.
    fn on_adopted_exit(&mut self, pidfd: Arc<PidFd>, ctx: &mut Context<Self>) {
        let (probe, fp, run_id) = (pidfd.clone(), self.fingerprint.clone(), self.run_id());
        async move {
            let read = super::proc_thread::run("adopted exit status", move || {
                fp.and_then(|fp| process::exit_status::of_exited_stranger(&probe, &fp))
            });
            tokio::time::timeout(EXIT_PROBE_WAIT, read)
                .await
                .ok()
                .flatten()
                .flatten()
        }
        .into_actor(self)
        .map(move |status, act, ctx| {
            tracing::info!(run_id, pid = pidfd.pid(), ?status, "adopted worker exited");
            act.record_exit(pidfd, status, ctx)
        })
        .wait(ctx);
    }

    /// Records the leader's exit once it is known whether its tree outlives it: members left in
    /// its group, or descendants that escaped the group (`setsid`) and still carry the run's
    /// token. While either runs the run keeps its evidence — its task cannot be claimed again
    /// beside them — and the tree is ended before the evidence is cleared.
    fn record_exit(
        &mut self,
        pidfd: Arc<PidFd>,
        status: Option<ExitStatus>,
        ctx: &mut Context<Self>,
    ) {
        self.exit_recorded = true;
        if self.tree_ending {
            // Its tree is being ended (a Terminate): that end, not a probe, says when the tree
            // is gone — it clears the evidence once it has proven so. A probe now could miss
            // a descendant that keeps forking away from its pid, and let the task be claimed
            // again beside it.
            return self.record_exit_probed(pidfd, status, true, ctx);
        }
        // Members left in the group: one syscall (signal 0 through the pidfd) — a /proc scan
        // on kernels before 6.9. Escapees of a young worker of ours are among the few pids
        // handed out since its start; any other — an older worker, one adopted from a previous
        // incarnation (whose escapees went to init, not to us) — takes a scan of /proc for the
        // token. All of it may read other processes' /proc files, which can block (a process
        // stuck on a hung file system): never on this thread, and never waited for long.
        let young = self
            .spawned_at
            .is_some_and(|t| t.elapsed() < RECENT_PROBE_MAX_AGE);
        // Most exits of a short-lived worker are settled here, without the probe's hop to a
        // thread of its own: its group is empty and every pid handed out since its own is ours
        // or names nothing, by syscalls that never wait on another process.
        if young
            && self.adopted_started_at.is_none()
            && pidfd.group_exists_now() == Some(false)
            && descendants::only_ours_since(pidfd.pid())
        {
            QUICK_SETTLES.fetch_add(1, Ordering::Relaxed);
            return self.record_exit_probed(pidfd, status, false, ctx);
        }
        let (token, probe_fd, run_id) = (self.spec.token.clone(), pidfd.clone(), self.run_id());
        async move {
            match probe_tree(probe_fd, token, young).await {
                Some(alive) => alive,
                None => {
                    // Nothing proven: keep the evidence and end the tree (off this thread; it
                    // clears the evidence once it is done).
                    tracing::warn!(run_id, "worker: no answer from the probe for the exited worker's descendants (a process stuck on a hung file system?); its run keeps its worker evidence until they are known gone");
                    true
                }
            }
        }
        .into_actor(self)
        .map(move |tree_alive, act, ctx| act.record_exit_probed(pidfd, status, tree_alive, ctx))
        .wait(ctx);
    }

    /// [`Self::record_exit`] with `tree_alive` known.
    fn record_exit_probed(
        &mut self,
        pidfd: Arc<PidFd>,
        status: Option<ExitStatus>,
        tree_alive: bool,
        ctx: &mut Context<Self>,
    ) {
        let exit = outcome::exit_info(status);
        // The leader is gone; anything left of its tree is a leak nobody will clean up: the run
        // keeps its evidence until the tree has been ended off this thread and the evidence
        // cleared.
        if tree_alive {
            self.end_tree(pidfd.clone(), true, ctx);
        }
        let store = self.store.clone();
        let (dispatcher, run_id) = (self.dispatcher.clone(), self.run_id());
        let ctx_in = outcome::ExitContext {
            run_id: self.run_id(),
            task_id: self.task_id(),
            exit,
            pid: pidfd.pid(),
            fingerprint: self.fingerprint.clone(),
            terminated: self.terminating,
            adopted: self.adopted_started_at.is_some(),
            evidence_on_row: self.evidence_on_row,
            group_alive: tree_alive,
            log_path: self.spec.log_path.clone(),
            log_start: self.log_start.clone(),
            policy: self.policy.clone(),
            claim_next: self.claim_on_close.clone(),
            timed_out: self.timeout_unrecorded.clone(),
        };
        async move {
            // A refused commit is retried: an unrecorded exit would leave the run open with
            // nobody watching it, and its status (known only here) lost — a clean exit would
            // then count as a crash. A full disk or a busy board is waited out for as long as
            // it lasts (this actor keeps the run's slot meanwhile); anything else is tried a
            // few times. A store that is stopping ends the attempts (the next supervisor's
            // reconcile closes the run).
            let mut attempt = 0u32;
            loop {
                match outcome::record_exit(&store, ctx_in.clone()).await {
                    Err(e)
                        if matches!(e.code, "disk_full" | "busy")
                            || (e.code != "unavailable" && attempt < EXIT_RECORD_RETRIES) =>
                    {
                        attempt += 1;
                        if attempt == 1 {
                            dispatcher.do_send(super::dispatcher::ExitPending { run_id });
                        }
                        // Said at the first refusal, then about once a minute.
                        if attempt == 1 || attempt.is_multiple_of(6) {
                            tracing::warn!(run_id = ctx_in.run_id, error = %e, attempt, "worker: exit not recorded; retrying");
                        }
                        let pause = Duration::from_secs(u64::from(attempt)).min(EXIT_RECORD_PAUSE_MAX);
                        tokio::time::sleep(pause).await;
                    }
                    other => return other,
                }
            }
        }
        .into_actor(self)
        .map(move |res, act, ctx| {
            match res {
                Ok(refill) => {
                    // A group left behind is ended (and its evidence cleared) after this
                    // transaction, which may free the task for its retry: a pass must follow.
                    act.refilled = refill.ran && !tree_alive;
                    if !refill.claims.is_empty() {
                        act.dispatcher.do_send(Claimed(refill.claims));
                    }
                }
                Err(e) => tracing::error!(run_id = act.run_id(), error = %e, "worker: cannot record exit; the next supervisor's reconcile will close the run"),
            }
            act.exit_done = true;
            if !act.tree_ending {
                act.finish(ctx);
            }
        })
        .wait(ctx);
    }

    /// Ends the worker's whole tree (group + token-carrying descendants) on a thread of its own
    /// ([`super::proc_thread`]): blocking waits never run on an actor thread. With
    /// `then_clear`, the run's evidence is cleared once the tree is gone (the leader exited
    /// before its group did). Only one
    /// tree-end runs at a time; the actor stays alive (and owned) until it is done, so nobody
    /// else starts a second kill or clears the evidence early.
    fn end_tree(&mut self, pidfd: Arc<PidFd>, then_clear: bool, ctx: &mut Context<Self>) {
        self.clear_when_ended |= then_clear;
        if self.tree_ending {
            return;
        }
        self.tree_ending = true;
        // The signal the worker waits for goes out now, from this thread, when that is one
        // syscall: the thread below (the /proc scan for escaped descendants, the wait,
        // SIGKILL) may start late when many trees end at once. It is not sent again there.
        let signalled = pidfd.signal_group_at_once(process::Signal::SIGTERM);
        let (run_id, token, kill) = (self.run_id(), self.spec.token.clone(), self.kill_timeout);
        let pid = pidfd.pid();
        async move {
            let expected = kill.saturating_add(process::AFTER_SIGKILL);
            let end = super::proc_thread::run_for("tree end", expected, move || {
                descendants::terminate_tree(&pidfd, &token, kill, signalled)
            });
            match end.await {
                Some(Ok(how)) => Some(how.as_str()),
                Some(Err(e)) => {
                    tracing::warn!(run_id, error = %e, "worker: terminate failed; evidence kept for the reaper");
                    None
                }
                None => None,
            }
        }
        .into_actor(self)
        .then(move |how, act, ctx| {
            if how.is_none()
                && let Some(reason) = act.terminating
                && !act.exit_done
            {
                // Not ended, and the run still wants it gone: try again later (nobody else
                // would for a run still open, e.g. a timeout that could not be recorded). A
                // Terminate from elsewhere meanwhile is taken, not dropped as one in progress;
                // the reason stays, so an exit meanwhile still records why it was ended.
                act.kill_failed = true;
                let retry = act.kill_timeout.max(Duration::from_secs(1));
                ctx.run_later(retry, move |act, ctx| {
                    ctx.notify(Terminate {
                        kill_after: act.kill_timeout,
                        reason,
                    })
                });
            }
            let clear = act.clear_when_ended && how.is_some();
            let (store, fp) = (act.store.clone(), act.fingerprint.clone());
            async move {
                if !clear {
                    return;
                }
                let payload = serde_json::json!({ "pid": pid, "ended_by": how });
                let cleared = store
                    .with_tx(move |tx, now| {
                        tx.clear_worker_evidence(run_id, pid, fp.as_ref(), "worker_group_ended", payload.clone(), now)
                    })
                    .await;
                if let Err(e) = cleared {
                    tracing::warn!(run_id, error = %e, "worker: cannot clear evidence after ending the group");
                }
            }
            .into_actor(act)
        })
        .map(|_, act, ctx| {
            act.tree_ending = false;
            if act.exit_done {
                act.finish(ctx);
            }
        })
        .spawn(ctx);
    }

    fn watch(&mut self, ctx: &mut Context<Self>) {
        let Some(pidfd) = self.pidfd.clone() else {
            return;
        };
        // SAFETY: `Watch` holds an Arc of the PidFd, so the fd stays open and the same for the
        // whole life of the AsyncFd.
        let registered =
            unsafe { AsyncFd::register_with_interest(Watch(pidfd), tokio::io::Interest::READABLE) };
        let watch = match registered {
            Ok(w) => w,
            Err(e) => {
                // Without a reactor registration fall back to a blocking wait on the pool.
                tracing::warn!(run_id = self.run_id(), error = %e, "worker: cannot watch pidfd; waiting on a thread");
                let fd = self.pidfd.clone().expect("pidfd");
                let addr = ctx.address();
                actix_rt::task::spawn_blocking(move || {
                    while !fd.wait_exit(Duration::from_secs(3600)).unwrap_or(true) {}
                    addr.do_send(LeaderExited);
                });
                return;
            }
        };
        let addr = ctx.address();
        ctx.spawn(
            async move {
                let _ = watch.readable().await;
                addr.do_send(LeaderExited);
            }
            .into_actor(self),
        );
    }

    /// Starts the child on the supervisor's spawner threads (see [`Spawner`]): creating the
    /// work dir and log file, fork/exec, the pidfd and the /proc read block. The actor handles
    /// no other message (a Terminate included) until the child exists.
    fn start_child(&mut self, ctx: &mut Context<Self>) {
        let Some(spawner) = self.spawner.take() else {
            return self.spawn_failed("no spawner for a new worker".to_string().into(), ctx);
        };
        spawner
            .submit(self.spec.clone())
            .into_actor(self)
            .map(|res, act, ctx| match res {
                Ok(child) => act.on_spawned(child, ctx),
                Err(error) => act.spawn_failed(error, ctx),
            })
            .wait(ctx);
    }

    fn on_spawned(&mut self, child: spawn::Spawned, ctx: &mut Context<Self>) {
        let pid = child.pid;
        self.fingerprint = Some(child.fingerprint.clone());
        self.spawned_at = Some(std::time::Instant::now());
        self.log_start = child.log_start.clone();
        self.pidfd = Some(Arc::new(child.pidfd));
        tracing::info!(
            run_id = self.run_id(),
            task_id = self.task_id(),
            pid,
            "worker spawned"
        );
        // Evidence first: the pid + fingerprint are made durable right away, so whatever
        // follows — a crash of the supervisor included — the worker stays reachable. Not
        // awaited: the watch starts at once, the commit shares a group commit with the other
        // workers' writes, and an exit recorded before it lands writes the evidence itself
        // (outcome::record_exit), after which this op is refused as a duplicate.
        let store = self.store.clone();
        let (run_id, fp, log) = (
            self.run_id(),
            self.fingerprint.clone(),
            self.log_start.clone(),
        );
        self.evidence_pending = true;
        async move {
            store
                .with_tx(move |tx, now| tx.set_worker(run_id, pid, fp.as_ref(), Some(&log), now))
                .await
        }
        .into_actor(self)
        .map(move |res, act, ctx| {
            act.evidence_pending = false;
            act.on_evidence(pid, res, ctx)
        })
        .spawn(ctx);
        self.dispatcher.do_send(super::dispatcher::WorkerSpawned {
            run_id: self.run_id(),
            pid,
        });
        if let Some(limit) = self.max_runtime {
            ctx.run_later(limit, move |act, ctx| act.timed_out(limit, ctx));
        }
        self.watch(ctx);
    }

    /// What the spawn's evidence commit answered.
    fn on_evidence(
        &mut self,
        pid: process::Pid,
        res: Result<Option<(board::RunOutcome, board::Millis)>, super::store::StoreError>,
        ctx: &mut Context<Self>,
    ) {
        match res {
            Ok(None) => self.evidence_on_row = true,
            // The run closed before its evidence landed: archived or reclaimed between claim
            // and spawn (end it now), or a fast report (end it after the grace, if alive).
            // The reaper drives the end (one kill, one record), with the grace it is due —
            // through this actor, which owns the child.
            Ok(Some((outcome, ended_at))) => {
                self.evidence_on_row = true;
                self.dispatcher
                    .do_send(super::dispatcher::EvidenceAfterClose {
                        run_id: self.run_id(),
                        task_id: self.task_id(),
                        pid,
                        fingerprint: self.fingerprint.clone(),
                        outcome,
                        ended_at,
                    })
            }
            // The store is stopping (a `leave` stop past its wait): the worker is left running
            // as the stop promises; the next incarnation finds it by its run's token.
            Err(e) if e.code == "unavailable" => {
                tracing::info!(
                    run_id = self.run_id(),
                    "worker: its pid was not recorded before the stop; left to the next incarnation, which finds it by its run's token"
                );
            }
            Err(e) if !self.exit_recorded => {
                // Not recorded means not reachable after a restart: do not keep it running.
                tracing::error!(run_id = self.run_id(), error = %e, "worker: cannot record pid; ending it");
                ctx.notify(Terminate {
                    kill_after: self.kill_timeout,
                    reason: TerminateReason::RunClosed,
                });
            }
            Err(_) => {}
        }
    }

    fn timed_out(&mut self, limit: Duration, ctx: &mut Context<Self>) {
        // Already being ended (a kill that failed does not count: the limit still closes the run).
        if self.terminating.is_some() && !self.kill_failed {
            return;
        }
        tracing::warn!(
            run_id = self.run_id(),
            ?limit,
            "worker: max runtime exceeded"
        );
        let store = self.store.clone();
        let (run_id, policy) = (self.run_id(), self.policy.clone());
        let error = format!(
            "exceeded max runtime of {}",
            humantime::format_duration(limit)
        );
        let unrecorded = error.clone();
        async move { outcome::record_timeout(&store, run_id, policy, error).await }
            .into_actor(self)
            .map(move |res, act, ctx| match res {
                Ok(true) => ctx.notify(Terminate {
                    kill_after: act.kill_timeout,
                    reason: TerminateReason::RunClosed,
                }),
                Ok(false) => {}
                // The store is stopping (shutdown): the run stays open for the next incarnation,
                // which enforces the limit; ending the worker now would defy `shutdown = "leave"`.
                Err(e) if e.code == "unavailable" => {
                    tracing::info!(run_id = act.run_id(), "worker: timeout during shutdown; left to the next incarnation");
                }
                // Not recorded: still end it (the limit is the limit); the exit closes the run,
                // as timed out.
                Err(e) => {
                    tracing::warn!(run_id = act.run_id(), error = %e, "worker: timeout not recorded; its exit will record it");
                    act.timeout_unrecorded = Some(unrecorded);
                    ctx.notify(Terminate {
                        kill_after: act.kill_timeout,
                        reason: TerminateReason::RunClosed,
                    });
                }
            })
            .wait(ctx);
    }
}

impl Actor for WorkerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        if let Some(started_at) = self.adopted_started_at {
            return self.start_adopted(started_at, ctx);
        }
        self.start_child(ctx);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        // A worker left running (shutdown = "leave") is nobody's to reap any more: let the
        // orphan reaper of a later supervisor in this process collect its zombie.
        if let Some(fd) = self.pidfd.clone()
            && self.adopted_started_at.is_none()
        {
            self.release_pid(&fd);
        }
        // A worker actor that stops before its child was reported finished (a bug, or the
        // system going down) still tells the dispatcher, so the slot is not lost.
        if !self.finished {
            self.dispatcher.do_send(WorkerFinished {
                run_id: self.run_id(),
                task_id: self.task_id(),
                refilled: false,
            });
        }
    }
}

impl Handler<LeaderExited> for WorkerActor {
    type Result = ();
    fn handle(&mut self, _: LeaderExited, ctx: &mut Self::Context) {
        self.on_exit(ctx);
    }
}

/// Whether this worker's actor is in the middle of something the board must hear of before
/// the store closes: its leader has exited and the exit is not recorded yet, its spawn's
/// evidence is not committed yet, or a tree end is running (the evidence is cleared after it).
/// Asked by a `shutdown = "leave"` stop before it closes the store, so that an exit the
/// supervisor saw is recorded, not left for the next one to find "exited while unsupervised".
/// An actor that is recording an exit answers once that is done: the record holds its
/// mailbox.
#[derive(Message)]
#[rtype(result = "bool")]
pub struct Unsettled;

impl Handler<Unsettled> for WorkerActor {
    type Result = bool;
    fn handle(&mut self, _: Unsettled, _: &mut Self::Context) -> bool {
        let exited_unrecorded = !self.exit_done
            && self
                .pidfd
                .as_ref()
                .is_some_and(|fd| fd.wait_exit(Duration::ZERO).unwrap_or(false));
        exited_unrecorded || self.evidence_pending || self.tree_ending
    }
}

impl Handler<Terminate> for WorkerActor {
    type Result = ();
    fn handle(&mut self, msg: Terminate, ctx: &mut Self::Context) {
        let Some(pidfd) = self.pidfd.clone() else {
            return;
        };
        if (self.terminating.is_some() && !self.kill_failed) || self.tree_ending || self.exit_done {
            return;
        }
        self.kill_failed = false;
        self.terminating = Some(msg.reason);
        tracing::info!(run_id = self.run_id(), pid = pidfd.pid(), reason = ?msg.reason, "worker: terminating group");
        self.kill_timeout = msg.kill_after;
        self.end_tree(pidfd, false, ctx);
    }
}
