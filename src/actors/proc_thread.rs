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

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Each thread started here and not yet finished, by a serial number: what it is for, and
/// from when on it counts as stuck.
static STARTED: Mutex<BTreeMap<u64, Started>> = Mutex::new(BTreeMap::new());
static SERIAL: AtomicU64 = AtomicU64::new(0);

/// A thread still running this long after it was expected to be done points at a process
/// stuck on a hung file system: a scan takes milliseconds, and a tree end waits out its
/// `kill_timeout` (its expected time, [`run_for`]) and a few seconds more. Many threads at
/// once do not: every worker of a `terminate` stop ends its tree on one.
const STUCK_AFTER: Duration = Duration::from_secs(120);

#[derive(Clone, Copy)]
struct Started {
    what: &'static str,
    at: Instant,
    /// `at` + the work's expected time + [`STUCK_AFTER`].
    stuck_at: Instant,
}

/// Said at most this often while threads are stuck.
const SAY_EVERY: Duration = Duration::from_secs(60);
static LAST_SAID: Mutex<Option<Instant>> = Mutex::new(None);

/// Logs the threads that have overrun their expected time by [`STUCK_AFTER`], at most every
/// [`SAY_EVERY`]. Called as each thread starts and on the dispatcher's tick (a supervisor
/// that starts no new thread still says so).
pub(crate) fn say_if_stuck(now: Instant) {
    let stuck = stuck_at(now);
    let Some(&(oldest, what)) = stuck.iter().max_by_key(|(age, _)| *age) else {
        return;
    };
    let mut last = LAST_SAID.lock().unwrap_or_else(|p| p.into_inner());
    if last.is_some_and(|t| now.duration_since(t) < SAY_EVERY) {
        return;
    }
    *last = Some(now);
    tracing::warn!(
        stuck = stuck.len(),
        oldest_secs = oldest.as_secs(),
        oldest = what,
        "threads reading /proc have not finished (a process stuck on a hung file system?)"
    );
}

/// The threads stuck at `now` (see [`say_if_stuck`]): age and purpose.
fn stuck_at(now: Instant) -> Vec<(Duration, &'static str)> {
    STARTED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .filter(|t| now >= t.stuck_at)
        .map(|t| (now.saturating_duration_since(t.at), t.what))
        .collect()
}

/// Runs `f` on a new thread named `runwarden-proc`; resolves to its result, or `None` when the
/// thread could not be started or `f` panicked (logged, naming `what`).
pub fn run<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> impl Future<Output = Option<T>> {
    run_for(what, Duration::ZERO, f)
}

/// [`run`] for work that is expected to take up to `expected` (a tree end waits out its
/// `kill_timeout`): it is called stuck only 2 minutes past that.
pub fn run_for<T: Send + 'static>(
    what: &'static str,
    expected: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> impl Future<Output = Option<T>> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let now = Instant::now();
    say_if_stuck(now);
    let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
    let stuck_at = now
        .checked_add(expected.saturating_add(STUCK_AFTER))
        .unwrap_or(now + STUCK_AFTER);
    STARTED.lock().unwrap_or_else(|p| p.into_inner()).insert(
        serial,
        Started {
            what,
            at: now,
            stuck_at,
        },
    );
    let started = std::thread::Builder::new()
        .name("runwarden-proc".into())
        .spawn(move || {
            // Counted down however `f` ends.
            struct Done(u64);
            impl Drop for Done {
                fn drop(&mut self) {
                    forget(self.0);
                }
            }
            let _done = Done(serial);
            let _ = tx.send(f());
        });
    if let Err(e) = &started {
        forget(serial);
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

/// Counts a thread out, however it ended.
fn forget(serial: u64) {
    STARTED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&serial);
}

/// [`run_for`], nobody waiting for the end.
pub fn spawn_for(what: &'static str, expected: Duration, f: impl FnOnce() + Send + 'static) {
    // The thread starts in `run_for` itself; its answer is not wanted.
    drop(run_for(what, expected, f));
}

/// How many of these threads run now (for tests and diagnostics).
pub fn running() -> usize {
    STARTED.lock().unwrap_or_else(|p| p.into_inner()).len()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many threads at once are not "stuck"; one that has run for long is (work expected to
    /// take long, only that much later), and once it ends it is not any more.
    #[test]
    fn a_thread_is_stuck_by_its_age_not_by_how_many_run() {
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let before = Instant::now();
        let held = run("held", move || {
            let _ = wait.recv();
        });
        let quick: Vec<_> = (0..20).map(|_| run("quick", || ())).collect();
        assert!(
            !stuck_at(Instant::now()).iter().any(|&(_, w)| w == "held"),
            "a thread is not stuck at its start"
        );
        let later = before + STUCK_AFTER + Duration::from_secs(1);
        assert!(stuck_at(later).iter().any(|&(_, w)| w == "held"));
        // Work expected to take long is stuck only that long later.
        let (go_long, wait_long) = std::sync::mpsc::channel::<()>();
        let long = run_for("long", Duration::from_secs(600), move || {
            let _ = wait_long.recv();
        });
        assert!(!stuck_at(later).iter().any(|&(_, w)| w == "long"));
        let much_later = before + Duration::from_secs(600) + STUCK_AFTER + Duration::from_secs(1);
        assert!(stuck_at(much_later).iter().any(|&(_, w)| w == "long"));
        go_long.send(()).unwrap();
        go.send(()).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            held.await.expect("answered");
            long.await.expect("answered");
            for q in quick {
                q.await.expect("answered");
            }
        });
        // Counted out as each thread ends, just after it answered.
        let deadline = Instant::now() + Duration::from_secs(10);
        while stuck_at(later)
            .iter()
            .any(|&(_, w)| w == "held" || w == "quick" || w == "long")
        {
            assert!(
                Instant::now() < deadline,
                "finished threads are counted out"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
