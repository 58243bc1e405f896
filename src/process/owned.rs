//! The children this process spawned and will wait for itself, process-wide.
//!
//! As a subreaper the supervisor must reap the zombies of orphans re-parented to it, and must
//! never reap a child that its owner will wait for (a worker leader reaped through its pidfd,
//! a hook's `Child`): that would steal the exit status. Several supervisors may run in one
//! process (embedding, tests), so the set is global, not per supervisor.
//!
//! Two locks: a gate that spawners share from before the fork until the new pid is registered
//! (many spawns run at once; posix_spawn holds its caller until the child has exec'd) and that
//! the orphan reaper takes exclusively from its check to its `waitpid`; and the set itself,
//! only ever held for a lookup or an update. A child that exits at once can therefore never
//! be reaped as an orphan before its owner registered it, and an owner's `unregister` never
//! waits for somebody else's fork.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};

use super::Pid;

fn set() -> MutexGuard<'static, HashSet<Pid>> {
    static OWNED: OnceLock<Mutex<HashSet<Pid>>> = OnceLock::new();
    OWNED
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner())
}

fn gate() -> &'static RwLock<()> {
    static GATE: RwLock<()> = RwLock::new(());
    &GATE
}

/// Held by a spawner from before its fork until it has registered the new pid.
pub struct SpawnGuard(#[allow(dead_code)] RwLockReadGuard<'static, ()>);

impl SpawnGuard {
    /// Marks `pid` (the child just spawned under this guard) as one whose owner will reap it.
    pub fn register(&self, pid: Pid) {
        register(pid);
    }
}

impl Drop for SpawnGuard {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Spawns between their fork and the registration of their child (live [`SpawnGuard`]s).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Taken before a spawn; see the module doc.
pub fn spawning() -> SpawnGuard {
    IN_FLIGHT.fetch_add(1, Ordering::SeqCst);
    SpawnGuard(gate().read().unwrap_or_else(|p| p.into_inner()))
}

/// True while some spawn is between its fork and the registration of its child: a child of
/// ours that is neither registered nor dead may then be that child rather than an orphan.
pub fn spawns_in_flight() -> bool {
    IN_FLIGHT.load(Ordering::SeqCst) > 0
}

/// Notified at every registration: who waits for an unregistered child of ours to be
/// registered (see `descendants::recent_pids_all_ours`) creates its `notified()` future before
/// it looks, so no registration in between is missed.
pub fn registrations() -> &'static tokio::sync::Notify {
    static NOTIFY: tokio::sync::Notify = tokio::sync::Notify::const_new();
    &NOTIFY
}

/// Held by the orphan reaper: no spawn is between its fork and its registration meanwhile.
pub struct ReapGuard(#[allow(dead_code)] RwLockWriteGuard<'static, ()>);

impl ReapGuard {
    /// True if some owner will reap `pid`.
    pub fn is_registered(&self, pid: Pid) -> bool {
        is_registered(pid)
    }
}

/// Taken by the orphan reaper around each check-then-waitpid.
pub fn reaping() -> ReapGuard {
    ReapGuard(gate().write().unwrap_or_else(|p| p.into_inner()))
}

/// Marks `pid` as a child whose owner will reap it.
pub fn register(pid: Pid) {
    set().insert(pid);
    registrations().notify_waiters();
}

/// The owner has reaped `pid` (or given up on it).
pub fn unregister(pid: Pid) {
    set().remove(&pid);
}

/// True if some owner will reap `pid`.
pub fn is_registered(pid: Pid) -> bool {
    set().contains(&pid)
}

/// Whether our child `pid` has exited, without reaping it (`waitid` with `WNOWAIT`: it stays a
/// zombie, its pid and group id ours, until its owner waits for it). With `block`, waits for
/// the exit; else answers at once (false: still running). An error means it is not a child of
/// ours (`ECHILD`) or nothing could be told.
pub fn exited(pid: Pid, block: bool) -> std::io::Result<bool> {
    let mut flags = libc::WEXITED | libc::WNOWAIT;
    if !block {
        flags |= libc::WNOHANG;
    }
    // SAFETY: siginfo_t is plain data, zeroed first: with WNOHANG and no exit, waitid leaves
    // si_pid zero.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid fills `info`, which we own; WNOWAIT reaps nothing.
    if unsafe { libc::waitid(libc::P_PID, pid as libc::id_t, &mut info, flags) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: reading a siginfo that waitid filled in (or left zeroed).
    Ok(unsafe { info.si_pid() } != 0)
}
