//! HookActor: runs the `[[hooks]]` commands on the board events they name.
//!
//! Each matching committed event starts the hook's command with the event as JSON on stdin and
//! `RUNWARDEN_EVENT_*` in its environment. A hook is itself supervised: a process-group leader,
//! ended (group, SIGTERM then SIGKILL) when it exceeds its `timeout`; what it leaves running
//! in its group when it exits is given the rest of that time, then ended the same way. Its
//! failure is logged, never fatal, and never blocks the supervisor: hooks run on the blocking
//! pool, at most `MAX_RUNNING` at once (further events wait in this actor's queue). Hooks run
//! at most once per event: when the supervisor stops, running hooks are ended (within
//! `HOOK_KILL_TIMEOUT`, whatever their timeout) and queued ones are dropped, counted in the log.
//!
//! A supervisor that is killed cannot end its hooks, and nothing on the board records them. So
//! each incarnation marks its hooks' processes with a token of its own
//! (`RUNWARDEN_HOOK_TOKEN`, kept in `<data_dir>/hooks.token`), and the next one, as it starts,
//! ends whatever still carries the previous token ([`take_over_hook_token`]).

use std::collections::VecDeque;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use actix::prelude::*;

use super::store::{EventFeed, Store};
use crate::board::Event;
use crate::config::HookConfig;
use crate::process::{self, PidFd};

/// Hooks running at once; more are queued.
const MAX_RUNNING: usize = 4;
/// Hook runs waiting for a slot before new ones are dropped (with a warning).
const MAX_QUEUED: usize = 10_000;
/// SIGTERM → this long → SIGKILL for a hook over its timeout.
const HOOK_KILL_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a running hook's thread looks whether the supervisor is stopping.
const STOP_POLL: Duration = Duration::from_millis(100);

#[derive(Message)]
#[rtype(result = "()")]
struct HookEvent(Arc<Event>);

#[derive(Message)]
#[rtype(result = "()")]
struct HookDone;

/// The actor.
pub struct HookActor {
    hooks: Vec<HookConfig>,
    /// This incarnation's hook token, in every hook's environment.
    token: Arc<str>,
    /// This supervisor's control socket (`RUNWARDEN_SOCKET` for the hooks' `runwarden`).
    socket: Arc<Path>,
    /// Subscribed when the actor is made, forwarded once it runs (see `new`).
    feed: Option<EventFeed>,
    queue: VecDeque<(HookConfig, Arc<Event>)>,
    running: usize,
    stopping: HooksStop,
}

/// Set when the supervisor stops: running hooks are ended, no more are started.
#[derive(Clone, Default)]
pub struct HooksStop(Arc<AtomicBool>);

impl HooksStop {
    /// Ends the running hooks (each within 2 s, `HOOK_KILL_TIMEOUT`) and starts no more.
    pub fn stop(&self) {
        self.0.store(true, Ordering::Release);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

impl HookActor {
    /// A hook runner for `hooks` fed by `store`'s events; `stopping` ends it. It subscribes
    /// here, not when it first runs: the dispatcher may claim (and the store commit) before
    /// this actor is first polled, and a hook on `claimed` would miss that claim.
    pub fn new(
        hooks: Vec<HookConfig>,
        token: Arc<str>,
        socket: PathBuf,
        store: Store,
        stopping: HooksStop,
    ) -> Self {
        HookActor {
            hooks,
            token,
            socket: socket.into(),
            feed: Some(store.subscribe()),
            queue: VecDeque::new(),
            running: 0,
            stopping,
        }
    }

    fn drain(&mut self, ctx: &mut Context<Self>) {
        if self.stopping.is_set() {
            if !self.queue.is_empty() {
                tracing::warn!(
                    dropped = self.queue.len(),
                    "supervisor stopping: queued hook runs dropped"
                );
                self.queue.clear();
            }
            return;
        }
        while self.running < MAX_RUNNING {
            let Some((hook, ev)) = self.queue.pop_front() else {
                return;
            };
            self.running += 1;
            let me = ctx.address();
            let stopping = self.stopping.clone();
            let (token, socket) = (self.token.clone(), self.socket.clone());
            actix_rt::task::spawn_blocking(move || {
                if let Err(e) = run_hook(&hook, &ev, &token, &socket, &stopping) {
                    tracing::warn!(command = ?hook.command, event = %ev.kind, error = %e, "hook failed");
                }
                me.do_send(HookDone);
            });
        }
    }
}

impl Actor for HookActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        let me = ctx.address();
        let Some(feed) = self.feed.take() else {
            return;
        };
        feed.forward(
            move |ev| {
                me.do_send(HookEvent(ev));
                me.connected()
            },
            |missed_commits| {
                tracing::warn!(
                    missed_commits,
                    "hooks lagged behind the event feed; the events of those commits ran no hooks"
                )
            },
        );
    }
}

impl Handler<HookEvent> for HookActor {
    type Result = ();
    fn handle(&mut self, msg: HookEvent, ctx: &mut Self::Context) {
        for hook in self.hooks.iter().filter(|h| fires_on(h, &msg.0)) {
            if self.queue.len() >= MAX_QUEUED {
                tracing::warn!(event = %msg.0.kind, "hook queue full; hook dropped");
                continue;
            }
            self.queue.push_back((hook.clone(), msg.0.clone()));
        }
        self.drain(ctx);
    }
}

/// The supervisor is stopping ([`HooksStop`] is set): drop what is queued, saying how much.
/// Without it the count was said only if another event or a hook's end came along before the
/// process exited, which at a stop they rarely do.
#[derive(Message)]
#[rtype(result = "()")]
pub struct DropQueued;

impl Handler<DropQueued> for HookActor {
    type Result = ();
    fn handle(&mut self, _: DropQueued, ctx: &mut Self::Context) {
        self.drain(ctx);
    }
}

impl Handler<HookDone> for HookActor {
    type Result = ();
    fn handle(&mut self, _: HookDone, ctx: &mut Self::Context) {
        self.running -= 1;
        self.drain(ctx);
    }
}

/// Run outcomes a hook may name in `on` as if they were event kinds: no event has these kinds
/// (a crash is recorded as `run_closed` with `"outcome": "crashed"`), yet `on = ["crashed"]` is
/// the natural way to ask for one, and the config's own example. Outcomes that are also event
/// kinds (`completed`, `blocked`, `reclaimed`, `archived`) keep meaning the event, so such a
/// hook does not fire twice.
pub(crate) const OUTCOME_ALIASES: [&str; 4] = ["crashed", "spawn_failed", "timed_out", "stale"];

/// True if `hook` fires on `ev`: it names the event's kind, `*`, or (for `run_closed`) the run's
/// outcome from [`OUTCOME_ALIASES`].
fn fires_on(hook: &HookConfig, ev: &Event) -> bool {
    let outcome = (ev.kind == "run_closed")
        .then(|| ev.payload.get("outcome").and_then(|o| o.as_str()))
        .flatten()
        .filter(|o| OUTCOME_ALIASES.contains(o));
    hook.on
        .iter()
        .any(|k| k == "*" || *k == ev.kind || Some(k.as_str()) == outcome)
}

/// A worker's own variables, which a hook never inherits from the supervisor.
const RUN_VARS: [&str; 4] = [
    "RUNWARDEN_RUN_TOKEN",
    "RUNWARDEN_RUN_ID",
    "RUNWARDEN_TASK_ID",
    "RUNWARDEN_TASK_TITLE",
];

/// Runs one hook to completion (or kills it at its timeout, or when the supervisor stops).
/// Blocking.
fn run_hook(
    hook: &HookConfig,
    ev: &Event,
    token: &str,
    socket: &Path,
    stopping: &HooksStop,
) -> Result<(), String> {
    let (program, args) = hook.command.split_first().ok_or("empty hook command")?;
    let mut cmd = Command::new(program);
    // Not a run's variables the supervisor inherited (one started inside a worker has that
    // worker's token: a hook's `runwarden complete` would report for that run). Its socket
    // is this supervisor's. The operator's settings (RUNWARDEN_CONFIG, RUNWARDEN_TIMEOUT…)
    // stay.
    for key in RUN_VARS {
        cmd.env_remove(key);
    }
    cmd.args(args)
        .env("RUNWARDEN_SOCKET", socket)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .env(process::descendants::HOOK_TOKEN_VAR, token)
        .env("RUNWARDEN_EVENT_ID", ev.id.to_string())
        .env("RUNWARDEN_EVENT_KIND", &ev.kind)
        .env("RUNWARDEN_EVENT_AT", ev.at.to_string())
        .env(
            "RUNWARDEN_EVENT_TASK_ID",
            ev.task_id.map(|t| t.to_string()).unwrap_or_default(),
        )
        .env(
            "RUNWARDEN_EVENT_RUN_ID",
            ev.run_id.map(|r| r.to_string()).unwrap_or_default(),
        );
    // A session (and group) of its own, as a worker's: no controlling terminal, and no other
    // hook or worker can move into its group.
    // And the descriptor limit the supervisor was started with, as a worker (best effort).
    let nofile = process::nofile::for_workers();
    // SAFETY: between fork and exec; setsid and setrlimit are async-signal-safe and allocate
    // nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(lim) = &nofile {
                libc::setrlimit(libc::RLIMIT_NOFILE, lim);
            }
            Ok(())
        });
    }
    let owned = process::owned::spawning();
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    let pid = child.id() as i32;
    owned.register(pid);
    drop(owned);
    let pidfd = PidFd::open(pid).map_err(|e| e.to_string());
    if let Some(mut stdin) = child.stdin.take() {
        let mut json = serde_json::to_string(ev).unwrap_or_default();
        json.push('\n');
        // Written from its own thread, so the timeout below covers a hook that never reads its
        // stdin while the event is larger than the pipe buffer: the write would block forever.
        // Detached: it ends once the hook has read everything, or the pipe breaks (EPIPE,
        // ignored) because the hook exited or was killed, its whole group with it.
        let spawned = std::thread::Builder::new()
            .name("hook-stdin".into())
            .spawn(move || {
                let _ = stdin.write_all(json.as_bytes());
            });
        if let Err(e) = spawned {
            tracing::warn!(command = ?hook.command, error = %e, "cannot start the hook's stdin writer; its stdin is closed");
        }
    }
    let deadline = crate::deadline_after(hook.timeout);
    let timed_out = match &pidfd {
        Ok(fd) => !wait_leader(fd, deadline, stopping),
        Err(e) => {
            // No pidfd (e.g. out of descriptors): the timeout still holds. The hook is our
            // child, not yet reaped, so its pid (and its group's id) cannot name anyone else
            // until we wait for it: a plain killpg is safe here.
            tracing::warn!(command = ?hook.command, error = %e, "no pidfd for a hook; polling it");
            let mut exited = false;
            while !exited && Instant::now() < deadline && !stopping.is_set() {
                exited = exited_unreaped(pid);
                if !exited {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
            }
            // Exited or not, the leader is unreaped: what it left in its group gets the rest of
            // the time, as with a pidfd, then SIGKILL (no grace without a pidfd to wait on).
            if !exited || !group_done(pid, deadline, stopping) {
                // SAFETY: killpg only sends a signal.
                unsafe { libc::killpg(pid, libc::SIGKILL) };
            }
            !exited
        }
    };
    if let Ok(fd) = &pidfd {
        // The leader is still our unreaped child, so its pidfd pins its group: what the hook
        // left running there (`notify &`) gets the rest of the hook's time, then is ended.
        if timed_out || !group_done(pid, deadline, stopping) {
            let _ = process::terminate_group(fd, HOOK_KILL_TIMEOUT);
        }
    }
    let status = child.wait().map_err(|e| e.to_string());
    process::owned::unregister(pid);
    if timed_out && stopping.is_set() {
        return Err("ended: the supervisor is stopping".into());
    }
    if timed_out {
        return Err(format!(
            "timed out after {}",
            humantime::format_duration(hook.timeout)
        ));
    }
    match status? {
        s if s.success() => Ok(()),
        s => Err(format!("exited with {s}")),
    }
}

/// The hook token file of a data dir.
fn token_path(data_dir: &Path) -> PathBuf {
    data_dir.join("hooks.token")
}

/// Takes over from the previous incarnation on `data_dir`: ends, on a thread of its own, what
/// its hooks left running (the processes carrying its hook token, which a supervisor that
/// stopped cleanly has released: [`release_hook_token`]), and records and returns a new token
/// for this incarnation's hooks.
/// Called with the data dir's lock held. A token that cannot be recorded is logged: hooks
/// still run, but a crash of this incarnation would leave what they run behind. `copy`: the
/// data dir is a copy of one in use (see `board::home`), whose token is that supervisor's
/// and its hooks' — replaced, and nothing carrying it is ended.
pub fn take_over_hook_token(data_dir: &Path, kill_timeout: Duration, copy: bool) -> Arc<str> {
    let path = token_path(data_dir);
    if let Ok(old) = std::fs::read_to_string(&path)
        && !copy
    {
        let old = old.trim().to_string();
        let ended = std::thread::Builder::new()
            .name("runwarden-hooks-left".into())
            .spawn(
                move || match process::descendants::end_hook_carriers(&old, kill_timeout) {
                    Ok(0) => {}
                    Ok(n) => tracing::warn!(
                        processes = n,
                        "ended what the previous supervisor's hooks left running"
                    ),
                    Err(e) => tracing::warn!(
                        error = %e,
                        "cannot end what the previous supervisor's hooks left running"
                    ),
                },
            );
        if let Err(e) = ended {
            tracing::warn!(error = %e, "cannot look for the previous supervisor's hooks");
        }
    }
    let token: Arc<str> = format!("{:032x}", rand::random::<u128>()).into();
    let written = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            // The data dir is ours, but a link in the file's place is never followed.
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|mut f| f.write_all(token.as_bytes()))
    };
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "cannot record the hook token; a crash would leave running hooks behind");
    }
    token
}

/// Forgets `token` once its incarnation has stopped cleanly and ended its hooks: what they
/// left running on purpose outside their groups (a `setsid` notifier) is not the next
/// supervisor's to end. Only while the file still holds this token (a successor may already
/// have written its own).
pub fn release_hook_token(data_dir: &Path, token: &str) {
    let path = token_path(data_dir);
    if std::fs::read_to_string(&path).is_ok_and(|t| t.trim() == token)
        && let Err(e) = std::fs::remove_file(&path)
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot remove the hook token");
    }
}

/// Waits for the hook's leader to exit until `deadline`; false if it did not (or the supervisor
/// is stopping), and the hook is to be ended.
fn wait_leader(fd: &PidFd, deadline: Instant, stopping: &HooksStop) -> bool {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match fd.wait_exit(left.min(STOP_POLL)) {
            Ok(true) => return true,
            Ok(false) if left.is_zero() || stopping.is_set() => return false,
            Ok(false) => {}
            // Cannot tell: treat as still running (it is ended, by its pinned group).
            Err(_) => return false,
        }
    }
}

/// Waits until no live process is left in the exited hook's group, until `deadline`; false if
/// some still are (or the supervisor is stopping). A /proc scan per look: hooks are few.
fn group_done(pgid: i32, deadline: Instant, stopping: &HooksStop) -> bool {
    loop {
        if !process::group_alive(pgid) {
            return true;
        }
        if Instant::now() >= deadline || stopping.is_set() {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// True once our child `pid` has exited, leaving it unreaped (WNOWAIT): its pid, and so its
/// group's id, stays ours to signal until `Child::wait`.
fn exited_unreaped(pid: i32) -> bool {
    // SAFETY: waitid fills `info`, a plain C struct we own.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
        )
    };
    // With WNOHANG, a child that has not exited leaves si_pid zero. An error (none should
    // come for our own child) counts as exited: the caller then ends the group and reaps.
    r != 0 || unsafe { info.si_pid() } != 0
}
