//! Blocking work that reads other processes' `/proc` files, each on a thread of its own.
//!
//! Such a read can wait as long as a hung FUSE or NFS mount does: a process in the middle of
//! an exec that closes a file there holds its `/proc/<pid>/environ` (and `kcmp`) until the
//! mount answers, and a scan of `/proc` for a run's token meets every process. On tokio's
//! blocking pool each stuck scan would hold a pool thread; past the pool's 512 every
//! `spawn_blocking` caller (the store's reads for the control socket among them) would queue
//! behind them, and the runtime's end — a supervisor's shutdown — waits for every pool thread.
//! A thread of its own costs a stuck scan its stack and nothing else: nobody queues behind it,
//! and the process exits without it.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Threads started here and not yet finished.
static RUNNING: AtomicUsize = AtomicUsize::new(0);

/// From this many running at once, each new one is logged: scans that do not finish point
/// at a process stuck on a hung file system.
const MANY: usize = 16;

/// Runs `f` on a new thread named `runwarden-proc`; resolves to its result, or `None` when the
/// thread could not be started or `f` panicked (logged, naming `what`).
pub fn run<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> impl Future<Output = Option<T>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let running = RUNNING.fetch_add(1, Ordering::Relaxed) + 1;
    if running >= MANY {
        tracing::warn!(
            running,
            what,
            "threads reading /proc are piling up (a process stuck on a hung file system?)"
        );
    }
    let started = std::thread::Builder::new()
        .name("runwarden-proc".into())
        .spawn(move || {
            // Counted down however `f` ends.
            struct Done;
            impl Drop for Done {
                fn drop(&mut self) {
                    RUNNING.fetch_sub(1, Ordering::Relaxed);
                }
            }
            let _done = Done;
            let _ = tx.send(f());
        });
    if let Err(e) = &started {
        RUNNING.fetch_sub(1, Ordering::Relaxed);
        tracing::error!(what, error = %e, "cannot start a thread for /proc work");
    }
    async move {
        started.ok()?;
        match rx.await {
            Ok(out) => Some(out),
            Err(_) => {
                tracing::error!(what, "a /proc thread ended without an answer (panicked)");
                None
            }
        }
    }
}

/// [`run`], nobody waiting for the end.
pub fn spawn(what: &'static str, f: impl FnOnce() + Send + 'static) {
    // The thread starts in `run` itself; its answer is not wanted.
    drop(run(what, f));
}

/// How many of these threads run now (for tests and diagnostics).
pub fn running() -> usize {
    RUNNING.load(Ordering::Relaxed)
}
