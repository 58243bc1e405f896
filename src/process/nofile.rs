//! The supervisor's descriptor limit, raised; its workers', as it was.
//!
//! A supervisor holds a pidfd per live worker, a descriptor per control connection and per
//! follow stream, the board's files: under the usual soft limit of 1024 a few hundred workers
//! and connections exhaust it (spawns, accepts and board opens then fail with EMFILE), although
//! the hard limit (what the administrator allows) is far higher. `runwarden serve` raises its
//! soft limit to the hard one at start. Its workers get the soft limit it was started with:
//! some programs misbehave with a huge one (`select` past 1024, a close loop over every
//! possible descriptor), and a worker's limits are the assignee's `rlimits` to set, not a side
//! effect of the supervisor's needs.

use std::io;
use std::sync::OnceLock;

/// The soft and hard limit this process had before [`raise`], once it has raised it.
static BEFORE: OnceLock<libc::rlimit> = OnceLock::new();

/// What [`raise`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    pub from: u64,
    pub to: u64,
}

/// Raises this process's soft descriptor limit to its hard limit (at most the kernel's
/// `fs.nr_open`, which a limit may not exceed), remembering the one before for the workers
/// ([`for_workers`]). `None` when there was nothing to raise. Once per process.
pub fn raise() -> io::Result<Option<Raised>> {
    let lim = current()?;
    let ceiling = nr_open().map_or(lim.rlim_max, |nr_open| lim.rlim_max.min(nr_open));
    if lim.rlim_cur >= ceiling || BEFORE.get().is_some() {
        return Ok(None);
    }
    let raised = libc::rlimit {
        rlim_cur: ceiling,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: setrlimit reads the struct it is given.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let _ = BEFORE.set(lim);
    Ok(Some(Raised {
        from: lim.rlim_cur,
        to: ceiling,
    }))
}

/// The descriptor limit a worker is to start with: the one this process had before [`raise`]
/// (`None` if it never raised it: the worker inherits this process's own).
pub fn for_workers() -> Option<libc::rlimit> {
    BEFORE.get().copied()
}

/// This process's soft descriptor limit now (`None` if it cannot be read).
pub fn soft_limit() -> Option<u64> {
    current().ok().map(|lim| lim.rlim_cur)
}

/// The system's most descriptors a process may be allowed (`fs.nr_open`), if readable: no
/// descriptor limit may exceed it.
pub fn nr_open() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// This process's descriptor limits.
fn current() -> io::Result<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(lim)
}

/// Descriptors a supervisor may hold at once, roughly: a pidfd per live worker (and a log
/// file while one starts), a connection per control client (and a log file it follows), and
/// 64 for the board, the lock and the rest. A lower limit is not refused (most of it is
/// rarely all in use), only said.
pub fn needed(max_in_progress: u32, max_connections: u32) -> u64 {
    2 * u64::from(max_in_progress) + 2 * u64::from(max_connections) + 64
}
