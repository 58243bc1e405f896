//! The children this process spawned and will wait for itself, process-wide.
//!
//! As a subreaper the supervisor must reap the zombies of orphans re-parented to it, and must
//! never reap a child that its owner will wait for (a worker leader reaped through its pidfd,
//! a hook's `Child`): that would steal the exit status. Several supervisors may run in one
//! process (embedding, tests), so the set is global, not per supervisor.
//!
//! Two locks: a gate that spawners share from before the fork until the new pid is registered
//! (many spawns run at once; a vfork-style start holds its caller until the child has exec'd)
//! and that the orphan reaper takes exclusively from its check to its `waitpid`; and the set
//! itself, only ever held for a lookup or an update. A child that exits at once can therefore
//! never be reaped as an orphan before its owner registered it, and an owner's `unregister`
//! never waits for somebody else's fork.

use std::collections::HashSet;
use std::sync::atomic::{AtomicI32, Ordering};
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

/// Taken before a spawn; see the module doc.
pub fn spawning() -> SpawnGuard {
    SpawnGuard(gate().read().unwrap_or_else(|p| p.into_inner()))
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

/// Pids of children started by [`super::clone_exec`] and not yet registered: the kernel
/// writes each into its slot (`CLONE_PARENT_SETTID`) before the child first runs, and the slot
/// is cleared once the pid is registered (or the start failed). Lets a walk over recent pids
/// tell a spawn in flight from a stranger without reading the process (see
/// `descendants::only_ours_since`). 0: free; -1: claimed, pid not yet written.
static IN_FLIGHT: [AtomicI32; 8] = [const { AtomicI32::new(0) }; 8];

/// A claimed `IN_FLIGHT` slot (see [`in_flight`]); freed on drop.
pub struct InFlight(&'static AtomicI32);

impl InFlight {
    /// Where the kernel is to write the child's pid.
    pub fn slot(&self) -> *mut i32 {
        self.0.as_ptr()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// Claims a slot for a start about to be made; `None` when all are taken (that start's child
/// is then a stranger to the walk until registered, which only makes the walk give up).
pub fn in_flight() -> Option<InFlight> {
    IN_FLIGHT.iter().find_map(|slot| {
        slot.compare_exchange(0, -1, Ordering::AcqRel, Ordering::Relaxed)
            .ok()
            .map(|_| InFlight(slot))
    })
}

/// True if `pid` is a child being started (written to an in-flight slot: [`in_flight`]).
pub fn is_in_flight(pid: Pid) -> bool {
    pid > 0
        && IN_FLIGHT
            .iter()
            .any(|slot| slot.load(Ordering::Acquire) == pid)
}

/// Marks `pid` as a child whose owner will reap it.
pub fn register(pid: Pid) {
    set().insert(pid);
}

/// The owner has reaped `pid` (or given up on it).
pub fn unregister(pid: Pid) {
    set().remove(&pid);
}

/// True if some owner will reap `pid`.
pub fn is_registered(pid: Pid) -> bool {
    set().contains(&pid)
}
