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
