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

/// A data dir as the board records it: its device and inode (`dev:ino`), and its path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Home {
    pub id: String,
    pub path: String,
}

/// What served the board before ([`Before::of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Before {
    /// Nothing recorded: a board no supervisor of this schema has served (an older build's,
    /// the original or a copy: the caller looks at the workers themselves).
    Unrecorded,
    /// This data dir, or one of another boot (whose workers are gone with it). The same path
    /// with another inode is this data dir recreated (restored, copied back into place).
    Here,
    /// Another directory at another path, in this boot: the board is a copy of that one's —
    /// or that one was moved here (its caller tells them apart).
    Elsewhere(Home),
}

impl Before {
    /// What served the board before the supervisor of `home` in boot `boot_id`, from what
    /// the board recorded ([`Tx::recorded_home`]).
    pub fn of(recorded: Option<(String, Home)>, boot_id: &str, home: &Home) -> Before {
        match recorded {
            None => Before::Unrecorded,
            Some((boot, other))
                if boot == boot_id && other.id != home.id && other.path != home.path =>
            {
                Before::Elsewhere(other)
            }
            Some(_) => Before::Here,
        }
    }
}

impl Tx<'_> {
    /// The data dir (and boot) that served the board last, if one recorded itself.
    pub fn recorded_home(&self) -> Result<Option<(String, Home)>> {
        Ok(self
            .conn
            .prepare_cached("SELECT boot_id, data_dir, path FROM board_home WHERE id = 1")?
            .query_row([], |r| {
                Ok((
                    r.get(0)?,
                    Home {
                        id: r.get(1)?,
                        path: r.get(2)?,
                    },
                ))
            })
            .optional()?)
    }

    /// Records that the supervisor of the data dir `home` serves the board from now on, in
    /// boot `boot_id`.
    pub fn record_home(&self, boot_id: &str, home: &Home, now: Millis) -> Result<()> {
        self.conn
            .prepare_cached(
                "INSERT INTO board_home (id, boot_id, data_dir, path, at) VALUES (1, ?1, ?2, ?3, ?4) \
                 ON CONFLICT (id) DO UPDATE SET boot_id = ?1, data_dir = ?2, path = ?3, at = ?4",
            )?
            .execute(params![boot_id, home.id, home.path, now])?;
        Ok(())
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
