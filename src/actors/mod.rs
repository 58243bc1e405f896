//! The actor runtime: one file per actor, messages beside their handlers.
//!
//! - [`store::StoreActor`]: the only writer; group commit; publishes committed events.
//! - [`dispatcher::DispatcherActor`]: claims within the caps, starts a worker per run.
//! - [`worker::WorkerActor`]: one per live run; owns the child, its pidfd and fingerprint.
//! - [`reaper::ReaperActor`]: ends workers whose run is closed, after the grace.
//!
//! `outcome` (what an exit means) and `spawn` (starting a child) are the workers' helpers;
//! `proc_thread` runs `/proc` scans, which can block for as long as a hung mount, off the
//! runtime's blocking pool.

pub mod dispatcher;
pub mod hooks;
pub mod outcome;
pub mod proc_thread;
pub mod reaper;
pub mod spawn;
pub mod store;
pub mod worker;

use crate::config::Scheduling;
use crate::process::sched::{self, Batched};

/// Puts the calling thread (one of the supervisor's own: `thread` names it in the log) under
/// `scheduling`. Keep the result for as long as the thread serves: dropping it puts the
/// thread back. Failing is logged, not fatal: the policy is about CPU, not correctness.
pub(crate) fn schedule_this_thread(scheduling: Scheduling, thread: &str) -> Option<Batched> {
    match scheduling {
        Scheduling::Normal => None,
        Scheduling::Batch => sched::batch_this_thread()
            .inspect_err(|e| {
                tracing::warn!(thread, error = %e, "cannot put the thread under SCHED_BATCH");
            })
            .ok()
            .flatten(),
    }
}

/// Starts a thread of the supervisor's own named `name`, under `scheduling`. Created by a
/// batched thread (the actor thread), it first takes back the policy its creator had before,
/// so that it is judged by that policy, not the inherited one.
pub(crate) fn spawn_thread<T: Send + 'static>(
    name: String,
    scheduling: Scheduling,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<T>> {
    let inherits_batch = sched::batched_here();
    std::thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            if inherits_batch {
                sched::undo_inherited_batch();
            }
            let _policy = schedule_this_thread(scheduling, &name);
            f()
        })
}
