//! The retention sweep's actor side: on each tick, finished tasks past `[retention] finished`
//! are deleted from the board (through the store, a bounded batch at a time), then their log
//! files and default work directories are removed off the actor thread.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::ClearOnDrop;
use crate::actors::spawn;
use crate::actors::store::Store;
use crate::board::TaskId;
use crate::config::Config;

/// Most tasks, and most rows of their history, one sweep deletes: one store transaction stays
/// short (milliseconds, every other write waits behind it) even when a long backlog is first
/// let go; the next tick takes the next batch.
const BATCH: u32 = 200;
const BATCH_ROWS: u64 = 20_000;

/// One sweep at a time (a slow disk must not let sweeps pile up behind each other).
#[derive(Debug, Default)]
pub(super) struct Retention {
    running: Arc<AtomicBool>,
    /// The files of the last sweep before this incarnation have been seen to.
    recovered: AtomicBool,
}

impl Retention {
    /// Starts a sweep deleting what finished more than `[retention] finished` ago, unless
    /// that is zero (keep for ever) or the previous sweep is still running.
    pub(super) fn sweep(&self, config: &Config, store: &Store) {
        if !self.recovered.swap(true, Ordering::AcqRel) {
            recover(config, store);
        }
        let keep = config.retention.finished;
        if keep.is_zero() || self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let (logs, work) = (config.logs_dir(), config.work_dir());
        let running = ClearOnDrop(self.running.clone());
        let store = store.clone();
        let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
        actix_rt::spawn(async move {
            let pruned = store
                .with_tx(move |tx, now| {
                    tx.prune_finished(now.saturating_sub(keep_ms), BATCH, BATCH_ROWS, now)
                })
                .await;
            match pruned {
                Ok(ids) if ids.is_empty() => {}
                Ok(ids) => {
                    tracing::info!(tasks = ids.len(), "retention: deleted finished tasks");
                    // The rows are gone (committed); the files follow, off the actor thread.
                    let _ = actix_rt::task::spawn_blocking(move || {
                        let _running = running;
                        remove_files(&ids, &logs, &work);
                    })
                    .await;
                }
                Err(e) => tracing::warn!(error = %e, "retention sweep failed"),
            }
        });
    }
}

/// Rows are deleted (committed) before their files: a supervisor stopped in between (killed,
/// the machine down) leaves that sweep's files behind for good — ids are never handed out
/// twice, so nothing would ever come back for them. The first tick of the next incarnation
/// removes the files of the newest `pruned` event again (what is already gone is fine).
fn recover(config: &Config, store: &Store) {
    let (logs, work) = (config.logs_dir(), config.work_dir());
    let store = store.clone();
    actix_rt::spawn(async move {
        match store.read(|tx| tx.last_pruned()).await {
            Ok(ids) if ids.is_empty() => {}
            Ok(ids) => {
                let _ =
                    actix_rt::task::spawn_blocking(move || remove_files(&ids, &logs, &work)).await;
            }
            Err(e) => tracing::warn!(error = %e, "retention: cannot read the last sweep"),
        }
    });
}

/// Removes the log files (current and rotated) and the default work directory of each task.
/// A configured `cwd` is the user's and is never touched. What is already gone is fine; any
/// other failure is logged and left (the rows are deleted either way).
fn remove_files(ids: &[TaskId], logs: &Path, work: &Path) {
    for id in ids {
        let log = logs.join(format!("{id}.log"));
        for file in [spawn::backup_path(&log), spawn::rotation_path(&log), log] {
            if let Err(e) = std::fs::remove_file(&file)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %file.display(), error = %e, "retention: cannot remove log");
            }
        }
        let dir = work.join(id.to_string());
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(path = %dir.display(), error = %e, "retention: cannot remove work dir");
        }
    }
}
