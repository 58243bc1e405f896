//! The children this process spawned and will wait for itself, process-wide.
//!
//! As a subreaper the supervisor must reap the zombies of orphans re-parented to it, and must
//! never reap a child that its owner will wait for (a worker leader reaped through its pidfd,
//! a hook's `Child`): that would steal the exit status. Several supervisors may run in one
//! process (embedding, tests), so the set is global, not per supervisor.

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

use super::Pid;

fn set() -> &'static Mutex<HashSet<Pid>> {
    static OWNED: OnceLock<Mutex<HashSet<Pid>>> = OnceLock::new();
    OWNED.get_or_init(Default::default)
}

/// Holds the registry locked. A spawner holds it from before the fork until it has
/// registered the new pid, and the orphan reaper holds it from its check to its `waitpid`, so
/// a child that exits at once can never be reaped as an orphan in between.
pub fn lock() -> std::sync::MutexGuard<'static, HashSet<Pid>> {
    set().lock().unwrap_or_else(|p| p.into_inner())
}

/// Marks `pid` as a child whose owner will reap it.
pub fn register(pid: Pid) {
    set().lock().unwrap_or_else(|p| p.into_inner()).insert(pid);
}

/// The owner has reaped `pid` (or given up on it).
pub fn unregister(pid: Pid) {
    set().lock().unwrap_or_else(|p| p.into_inner()).remove(&pid);
}

/// True if some owner will reap `pid`.
pub fn is_registered(pid: Pid) -> bool {
    set()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&pid)
}
