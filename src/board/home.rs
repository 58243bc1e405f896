//! Which data dir serves the board. A board copied into another data dir while its original
//! runs on the same machine (`sqlite3 .backup` served to read it, a new build tried on a copy)
//! holds the original's runs, with the pids, fingerprints and tokens of workers that are alive
//! and the original's own: a supervisor on the copy would adopt them, find them "silent" (they
//! report to the original's socket) and end them. So the board records the data dir (device
//! and inode) and boot of the supervisor serving it; one that starts on the same boot from
//! another data dir disowns every worker on it before anything looks at them.

use rusqlite::{OptionalExtension, params};
use serde_json::json;

use super::types::Millis;
use super::{Result, Tx};

impl Tx<'_> {
    /// Records that the supervisor of `data_dir` (its device and inode, `dev:ino`) serves the
    /// board from now on, in boot `boot_id`. Returns the data dir that served it before in the
    /// same boot when it was another one: the board is a copy (or was moved), and its workers
    /// may be another supervisor's ([`Tx::disown_workers`]).
    pub fn take_home(&self, boot_id: &str, data_dir: &str, now: Millis) -> Result<Option<String>> {
        let before: Option<(String, String)> = self
            .conn
            .prepare_cached("SELECT boot_id, data_dir FROM board_home WHERE id = 1")?
            .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?;
        self.conn
            .prepare_cached(
                "INSERT INTO board_home (id, boot_id, data_dir, at) VALUES (1, ?1, ?2, ?3) \
                 ON CONFLICT (id) DO UPDATE SET boot_id = ?1, data_dir = ?2, at = ?3",
            )?
            .execute(params![boot_id, data_dir, now])?;
        Ok(before.and_then(|(boot, dir)| (boot == boot_id && dir != data_dir).then_some(dir)))
    }

    /// Forgets every worker on the board, without a signal: each run with worker evidence, a
    /// start pending, or still open loses its worker's pid and fingerprint, and gets a new
    /// token — no process carries it, so nothing is ever found (and ended) by the old one. Its
    /// open runs then close as their worker's end was not seen (the reconcile at start). One
    /// `worker_disowned` event per run, naming the data dir that served the board before.
    /// Returns how many runs.
    pub fn disown_workers(&self, previous_data_dir: &str, now: Millis) -> Result<usize> {
        let runs: Vec<(i64, i64, Option<i64>)> = self
            .conn
            .prepare_cached(
                "SELECT id, task_id, worker_pid FROM task_runs \
                 WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1 \
                    OR worker_pid IS NOT NULL",
            )?
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?
            .collect::<rusqlite::Result<_>>()?;
        for &(run_id, task_id, pid) in &runs {
            self.conn
                .prepare_cached(
                    "UPDATE task_runs SET worker_pid = NULL, worker_boot_id = NULL, \
                     worker_start_ticks = NULL, worker_pidfs_ino = NULL, token = ?2 WHERE id = ?1",
                )?
                .execute(params![run_id, super::runs::new_token()])?;
            self.append_event(
                Some(task_id),
                Some(run_id),
                "worker_disowned",
                json!({ "pid": pid, "data_dir": previous_data_dir }),
                now,
            )?;
        }
        Ok(runs.len())
    }
}
