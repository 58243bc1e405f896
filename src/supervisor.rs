//! Starting and stopping the whole runtime: lock, board, actors, (control socket), signals.
//!
//! Two entry points share one boot sequence: [`run`] drives a supervisor on the calling
//! thread until a shutdown future resolves (what `runwarden serve` does), and
//! [`Supervisor::start`] runs one on a thread of its own and hands back a
//! [`SupervisorHandle`] (embedding, tests).

use std::future::Future;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::actors::dispatcher::{DispatcherActor, LiveWorkers, StopDispatching};
use crate::actors::hooks::{
    DropQueued, HookActor, HooksStop, release_hook_token, take_over_hook_token,
};
use crate::actors::reaper::{EndLeftovers, ReaperActor, SweepNow};
use crate::actors::spawn::Spawner;
use crate::actors::store::{Flush, Store, StoreActor, StoreError};
use crate::board::{self, Created, NewTask, OpenOptions, RunId, Task, TaskDetail, TaskId};
use crate::config::{Config, ShutdownMode, Synchronous};
use crate::control::ControlServer;
use crate::lock::{LockError, LockFile};
use crate::process;

/// Why the supervisor could not start or an embedded call failed.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error(transparent)]
    Lock(#[from] LockError),
    /// The data dir (or a directory in it) cannot be made or read: named with its key, as a
    /// bad value would be, though it is the machine's answer (exit 1), not the config's.
    #[error("[supervisor] data_dir: cannot create {path}: {source}")]
    Dir {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Board(#[from] board::BoardError),
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// A task named an assignee the config does not have.
    #[error("{0}")]
    UnknownAssignee(String),
    #[error("{0}")]
    Runtime(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
}

/// The running actors and the resources they share.
#[derive(Clone)]
pub struct Services {
    pub config: Arc<Config>,
    pub store: Store,
    pub dispatcher: Addr<DispatcherActor>,
    pub reaper: Addr<ReaperActor>,
    /// When this supervisor started: for its uptime (monotonic)…
    pub started_at: Instant,
    /// …and as a wall-clock time (taken once, so every `status` says the same).
    pub started_at_ms: crate::board::Millis,
    /// True once the first reconcile has decided about the previous incarnation's runs.
    pub(crate) first_reconcile: tokio::sync::watch::Receiver<bool>,
}

impl Services {
    /// Live workers of this incarnation: (run, task, pid).
    pub async fn live_workers(&self) -> Vec<(RunId, TaskId, Option<i32>)> {
        self.dispatcher.send(LiveWorkers).await.unwrap_or_default()
    }

    /// Runs the terminal-reaper sweep now.
    pub async fn reap_now(&self) {
        let _ = self.reaper.send(SweepNow).await;
    }
}

struct Booted {
    services: Services,
    control: ControlServer,
    hooks: HooksStop,
    /// The hook runner, when there are hooks: told at the stop to drop what is queued.
    hook_actor: Option<Addr<HookActor>>,
    /// This incarnation's hook token, released once it has stopped cleanly.
    hook_token: Arc<str>,
    /// Released last, after the hook token: a successor cannot start in between.
    lock: Option<LockFile>,
    /// Held until the supervisor has stopped (see [`process::Subreaper`]).
    subreaper: Option<process::Subreaper>,
}

/// An assignee that runs as another user needs a supervisor that may switch to it (root):
/// refused at start as the config mistake it is, naming the key, not found out by every spawn
/// failing.
fn can_switch_users(config: &Config) -> Result<(), SupervisorError> {
    let (euid, egid) = (
        nix::unistd::geteuid().as_raw(),
        nix::unistd::getegid().as_raw(),
    );
    if euid == 0 {
        return Ok(());
    }
    for (name, a) in &config.assignees {
        // The key to name: the one written (a name or number), else the id set in code.
        let (key, who) = if let Some(uid) = a.uid.filter(|&u| u != euid) {
            let key = if a.user.is_some() { "user" } else { "uid" };
            (key, format!("uid {uid}"))
        } else if let Some(gid) = a.gid.filter(|&g| g != egid) {
            // A gid that came with `user` (its primary group) is named by `user`.
            let key = match (&a.group, &a.user) {
                (Some(_), _) => "group",
                (None, Some(_)) => "user",
                (None, None) => "gid",
            };
            (key, format!("gid {gid}"))
        } else {
            continue;
        };
        return Err(SupervisorError::Config(config.invalid(format!(
            "[assignees.{name}] {key}: runs the worker as {who}; switching to another user or \
             group needs root (this supervisor runs as uid {euid}, gid {egid})"
        ))));
    }
    Ok(())
}

/// Boots inside a running actix system.
fn boot(mut config: Config) -> Result<Booted, SupervisorError> {
    // A loaded config was checked at load; one built in code (embedding) is checked here.
    config.validate()?;
    if process::sigchld::children_reaped_by_kernel().unwrap_or(false) {
        return Err(SupervisorError::Runtime(
            "SIGCHLD is ignored in this process (SIG_IGN or SA_NOCLDWAIT): the kernel would reap every worker at once and its exit status would be lost; give SIGCHLD its default action before starting a supervisor".into(),
        ));
    }
    can_switch_users(&config)?;
    config.check_rlimits()?;
    crate::control::server::check_socket_path(&config.socket_path())
        .map_err(|e| socket_error(&config, e))?;
    // Removed again, if still empty, should the start fail before it takes the lock (see
    // `Created`); kept from then on, whatever happens: whoever holds the lock may be using them.
    let (data_dir_is_ours, created) = crate::data_dir::create_dirs(&config)?;
    // After create_dirs: a working directory inside the data dir may be one of ours.
    config.check_working_dirs()?;
    for (name, a) in &config.assignees {
        if let Some(why) = crate::actors::spawn::program_missing(a) {
            tracing::warn!(
                "[assignees.{name}] command: {why}; its runs fail to start (spawn_failed) until it is there"
            );
        }
    }
    let lock = LockFile::acquire(&config.lock_path());
    created.keep();
    let lock = lock.map_err(|e| match e {
        // The machine's answer about the data dir (a read-only file system, say): named with
        // its key, as `create_dirs` names what it cannot make.
        LockError::Io { .. } => SupervisorError::Runtime(format!("[supervisor] data_dir: {e}")),
        held => held.into(),
    })?;
    // Modes only once the lock is ours: a start that a running supervisor's lock refuses must
    // not change what that supervisor's users and workers need.
    crate::data_dir::set_modes(&config, data_dir_is_ours)?;
    // Bound before any actor runs (a live socket refuses the start); served once they are up.
    let socket = ControlServer::bind(&config).map_err(|e| socket_error(&config, e))?;
    // Orphaned descendants of workers re-parent to us instead of init, so they can be found
    // and ended with their worker, and their zombies collected.
    let subreaper = if !config.supervisor.subreaper {
        tracing::info!("subreaper disabled by config: escaped descendants re-parent to init");
        None
    } else {
        process::become_subreaper()
            .inspect_err(|e| {
                tracing::warn!(error = %e, "cannot become a child subreaper; escaped descendants may leak");
            })
            .ok()
    };
    let copy = crate::copy_check::disown_a_copys_workers(&config)?;
    let config = Arc::new(config);
    let store = StoreActor::start_on(
        config.db_path(),
        OpenOptions {
            synchronous_full: config.supervisor.synchronous == Synchronous::Full,
            read_only: false,
        },
        config.supervisor.scheduling,
    )?;
    let reaper = ReaperActor::new(
        store.clone(),
        config.reaper.grace,
        config.reaper.kill_timeout,
        config.supervisor.tick,
    )
    .start();
    let spawner = Spawner::for_this_machine(config.supervisor.scheduling)
        .map_err(|e| SupervisorError::Runtime(format!("cannot start the spawner threads: {e}")))?;
    // Hooks first: subscribed to the store's events before anything can commit one.
    let hooks = HooksStop::default();
    // Whatever a killed previous incarnation's hooks left running is ended, hooks or not now.
    let hook_token = take_over_hook_token(
        &config.supervisor.data_dir,
        config.reaper.kill_timeout,
        copy,
    );
    let hook_actor = (!config.hooks.is_empty()).then(|| {
        HookActor::new(
            config.hooks.clone(),
            hook_token.clone(),
            config.socket_path(),
            store.clone(),
            hooks.clone(),
        )
        .start()
    });
    let dispatcher = DispatcherActor::new(config.clone(), store.clone(), reaper.clone(), spawner);
    let reconciled_once = dispatcher.first_reconcile_done();
    let dispatcher = dispatcher.start();
    tracing::info!(
        data_dir = %config.supervisor.data_dir.display(),
        pid = std::process::id(),
        "supervisor started"
    );
    let services = Services {
        config,
        store,
        dispatcher,
        reaper,
        started_at: Instant::now(),
        started_at_ms: crate::board::now_millis(),
        first_reconcile: reconciled_once,
    };
    let control = socket
        .serve(services.clone())
        .map_err(|e| SupervisorError::Runtime(e.to_string()))?;
    Ok(Booted {
        services,
        control,
        hooks,
        hook_actor,
        hook_token,
        lock: Some(lock),
        subreaper,
    })
}

/// The start's error for the control socket's `e`.
fn socket_error(config: &Config, e: crate::control::server::ControlError) -> SupervisorError {
    match e {
        crate::control::server::ControlError::AlreadyServing(_) => {
            SupervisorError::Runtime(e.to_string())
        }
        // Something in the socket's place, or a directory it cannot be made in: named with
        // the key that put it there.
        _ => {
            let key = if config.supervisor.socket.is_some() {
                "[supervisor] socket"
            } else {
                "[supervisor] data_dir"
            };
            SupervisorError::Runtime(format!("{key}: {e}"))
        }
    }
}

/// How long a `terminate` stop asks the reaper again about closed runs whose reap was under way.
const LEFTOVERS_BUSY_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Graceful stop: stop claiming (ending workers if configured), flush the store.
async fn stop(services: &Services) {
    let terminate = services.config.supervisor.shutdown == ShutdownMode::Terminate;
    let _ = services
        .dispatcher
        .send(StopDispatching { terminate })
        .await;
    if terminate {
        // A previous incarnation's worker still within its grace is no dispatcher's. One whose
        // run a sweep is probing right now (a /proc read) is asked about again once that is
        // over, for a little while.
        let deadline = tokio::time::Instant::now() + LEFTOVERS_BUSY_WAIT;
        while let Ok(busy) = services.reaper.send(EndLeftovers).await
            && busy > 0
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let _ = services.store.addr.send(Flush).await;
    tracing::info!("supervisor stopped");
}

/// How long a blocking thread of the actor thread's runtime (the store's reads, file work,
/// hooks) waits idle before it ends.
const BLOCKING_KEEP_ALIVE: std::time::Duration = std::time::Duration::from_secs(2);

/// Runs a supervisor on the calling thread until `shutdown` resolves, then stops gracefully.
/// `ready` is called once the supervisor is up (with its services). It blocks its thread: call
/// it from a thread of its own (a `spawn_blocking` one will do), never from async code running
/// on a runtime — actix panics starting a runtime inside another. [`Supervisor::start`] runs
/// it on a thread of its own. Under `supervisor.scheduling = "batch"` (the default) the
/// calling thread runs under `SCHED_BATCH` until `run` returns, if it was under the normal
/// policy (see [`crate::process::sched`]); `ready` and `shutdown` run on it, so a process they
/// start inherits that policy.
pub fn run<F, Fut>(config: Config, ready: F, shutdown: Fut) -> Result<(), SupervisorError>
where
    F: FnOnce(&Services) + 'static,
    Fut: Future<Output = ()> + 'static,
{
    // The calling thread becomes the actor thread; it is put back as it was on return.
    let policy = crate::actors::schedule_this_thread(config.supervisor.scheduling, "actor");
    let data_dir = config.supervisor.data_dir.clone();
    let batch = policy.is_some();
    let system = System::with_tokio_rt(move || {
        // actix's own runtime (a current-thread one, with IO and time), but: a blocking
        // thread idle for 2 s ends (tokio's 10 s would never come: the supervisor's own reads,
        // a few a second, wake the idle threads in turn, so a burst's threads — one per
        // concurrent read — stayed for good); and under batch scheduling the blocking threads
        // (hooks start there) would inherit SCHED_BATCH from this thread.
        let mut rt = tokio::runtime::Builder::new_current_thread();
        rt.enable_io()
            .enable_time()
            .thread_keep_alive(BLOCKING_KEEP_ALIVE);
        if batch {
            rt.on_thread_start(process::sched::undo_inherited_batch);
        }
        rt.build().expect("the actor thread's tokio runtime")
    });
    let result = system.block_on(async move {
        // Poll `shutdown` once BEFORE booting. A future that installs its signal handlers on
        // its first poll (as `serve`'s does) then has them in place for the whole boot: a
        // SIGTERM that arrives while booting becomes a clean stop right after it, instead of
        // the default action (death by signal mid-boot: no graceful stop, the lock file left
        // behind). Seen with a SIGTERM sent as soon as the board existed.
        let mut shutdown = std::pin::pin!(shutdown);
        let already = futures::FutureExt::now_or_never(shutdown.as_mut()).is_some();
        let booted = boot(config)?;
        ready(&booted.services);
        // Until the caller's signal, or a client's `shutdown` request over the socket.
        if !already {
            let requested = booted.control.shutdown_requested();
            futures::future::select(shutdown, std::pin::pin!(requested)).await;
        }
        // Stop serving first (in-flight replies are sent), then stop the actors. Running hooks
        // are ended too: the runtime's end waits for them, and a hook's timeout may be long.
        booted.control.stop().await;
        booted.hooks.stop();
        stop(&booted.services).await;
        // What waits in the hooks' queue (the stop's own events included) is dropped, and said.
        if let Some(hooks) = &booted.hook_actor {
            let _ = hooks.send(DropQueued).await;
        }
        if booted.subreaper.is_some() {
            // Descendants adopted while the process was a subreaper and ended with their runs
            // just now (or not yet collected by a tick) would be the host's zombies for good
            // once it is not one: collected first. Not waited for long: /proc can hang.
            let reap = crate::actors::proc_thread::run("the last orphan reap", || {
                process::reap_orphans(&process::owned::is_registered)
            });
            let _ = actix_rt::time::timeout(Duration::from_secs(1), reap).await;
        }
        let mut booted = booted;
        let kept = (booted.hook_token.clone(), booted.lock.take());
        drop(booted);
        Ok(kept)
    });
    System::current().stop();
    // The runtime's end waits for the hooks' threads: every hook of this incarnation has been
    // ended now, and the next one has nothing to end by this token. The lock goes last: a
    // successor takes over the token file only once this one is done with it.
    let _ = system.run();
    let result = result.map(|(token, lock)| {
        release_hook_token(&data_dir, &token);
        drop(lock);
    });
    drop(policy);
    result
}

/// An in-process supervisor, for embedding.
pub struct Supervisor;

impl Supervisor {
    /// Starts a supervisor for `config` on a thread of its own. Fails if it cannot start
    /// (lock held, board unreadable, …).
    pub fn start(config: Config) -> Result<SupervisorHandle, SupervisorError> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let ready_err = ready_tx.clone();
        let thread = thread::Builder::new()
            .name("runwarden-supervisor".into())
            .spawn(move || {
                let res = run(
                    config,
                    move |s| {
                        // Handed over once the first reconcile has adopted the previous
                        // incarnation's workers (within the bound the socket waits): a report
                        // made through the handle lands on an adopted run, never ahead of it.
                        let s = s.clone();
                        let mut first = s.first_reconcile.clone();
                        actix_rt::spawn(async move {
                            let _ = tokio::time::timeout(
                                crate::control::server::first_reconcile_wait(),
                                first.wait_for(|done| *done),
                            )
                            .await;
                            let _ = ready_tx.send(Ok(s));
                        });
                    },
                    async move {
                        let _ = stop_rx.await;
                    },
                );
                if let Err(e) = res {
                    let _ = ready_err.send(Err(e));
                }
            })
            .map_err(|e| {
                SupervisorError::Runtime(format!("cannot start supervisor thread: {e}"))
            })?;
        match ready_rx.recv() {
            Ok(Ok(services)) => Ok(SupervisorHandle {
                services,
                stop: Some(stop_tx),
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(SupervisorError::Runtime(
                    "supervisor thread died while starting".into(),
                ))
            }
        }
    }
}

/// A running in-process supervisor. Dropping it shuts the supervisor down.
pub struct SupervisorHandle {
    services: Services,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl SupervisorHandle {
    /// The running services (store, actors, config).
    pub fn services(&self) -> &Services {
        &self.services
    }

    /// Adds a task; it is dispatched at once if an assignee slot is free.
    pub fn add_task(&self, new: NewTask) -> Result<Created, SupervisorError> {
        // Names first, as the socket checks them: an unknown assignee's refusal quotes it.
        new.check_names()
            .map_err(|e| SupervisorError::Board(board::BoardError::Invalid(e)))?;
        self.services
            .config
            .check_assignee(new.assignee.as_deref())
            .map_err(SupervisorError::UnknownAssignee)?;
        block_on(
            self.services
                .store
                .with_tx(move |tx, now| tx.create_task(&new, now)),
        )
        .map_err(Into::into)
    }

    /// A task with its runs, last 200 events and comments, as bounded as a `show_task` reply
    /// (the oldest left out and counted in `omitted_*`).
    pub fn task(&self, id: TaskId) -> Result<TaskDetail, SupervisorError> {
        Ok(self.services.store.read_blocking(move |tx| {
            tx.task_detail(id, 200, crate::control::protocol::MAX_REPLY_TEXT_BYTES)
        })?)
    }

    /// Waits until the task is `done`, `blocked` or `archived` (or `timeout` passes).
    pub fn wait_for(&self, id: TaskId, timeout: Duration) -> Result<Task, SupervisorError> {
        let deadline = crate::deadline_after(timeout);
        loop {
            // Whether it had stopped before the read: a task it settled on its way out is
            // still reported settled.
            let stopped = self.thread.as_ref().is_none_or(|t| t.is_finished());
            let task = self
                .services
                .store
                .read_blocking(move |tx| tx.get_task(id))?;
            if matches!(
                task.status,
                board::TaskStatus::Done | board::TaskStatus::Blocked | board::TaskStatus::Archived
            ) {
                return Ok(task);
            }
            // A supervisor that has stopped (shut down over its socket, say) will not settle
            // it: said at once, as add_task and complete do, not after the whole timeout.
            if stopped {
                return Err(SupervisorError::Store(StoreError::stopped()));
            }
            if Instant::now() >= deadline {
                return Err(SupervisorError::Timeout(timeout));
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Marks a task done from the library (what a worker would report over the socket).
    pub fn complete(&self, id: TaskId, result: Option<String>) -> Result<(), SupervisorError> {
        block_on(self.services.store.with_tx(move |tx, now| {
            tx.complete_task(id, None, result.as_deref(), now)
                .map(|_| ())
        }))
        .map_err(Into::into)
    }

    /// Stops the supervisor gracefully and waits for it.
    pub fn shutdown(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for SupervisorHandle {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Drives a future from a thread outside the actor system (actix addresses are thread-safe).
fn block_on<F: Future>(f: F) -> F::Output {
    futures::executor::block_on(f)
}
