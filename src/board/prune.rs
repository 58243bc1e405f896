//! The retention sweep: finished tasks past their keep time leave the board with everything
//! that hangs off them.

use rusqlite::{OptionalExtension, params};
use serde_json::json;

use super::types::{Millis, TaskId};
use super::{Result, Tx};

/// Done or archived, untouched since before the cutoff, and no run of it open, holding worker
/// evidence or with its worker's start under way: a worker that may be alive keeps its task
/// (and the reaper its row).
///
/// Never the newest task, nor the task of the newest run or of the newest comment: their ids
/// are `max(id) + 1` (no AUTOINCREMENT), so deleting the highest row would hand its id to the
/// next one — a new task 7 after the `pruned` event named the old 7, its log and work
/// directory removed under it. They go once something newer exists.
///
/// Named index: without statistics the planner prefers `tasks_status` and sorts every finished
/// task on each tick; `tasks_finished` reads them in age order and stops at the limit.
const CANDIDATES: &str = "SELECT id FROM tasks INDEXED BY tasks_finished \
     WHERE status IN ('done', 'archived') AND updated_at < ?1 \
     AND NOT EXISTS (SELECT 1 FROM task_runs r WHERE r.task_id = tasks.id \
                     AND (r.ended_at IS NULL OR r.worker_pid IS NOT NULL \
                          OR r.spawn_pending = 1)) \
     AND id < (SELECT max(id) FROM tasks) \
     AND id IS NOT (SELECT task_id FROM task_runs ORDER BY id DESC LIMIT 1) \
     AND id IS NOT (SELECT task_id FROM task_comments ORDER BY id DESC LIMIT 1) \
     ORDER BY updated_at, id LIMIT ?2";

/// Rows a task's deletion removes besides its own.
const HISTORY_ROWS: &str = "SELECT (SELECT count(*) FROM task_events WHERE task_id = ?1) \
     + (SELECT count(*) FROM task_runs WHERE task_id = ?1) \
     + (SELECT count(*) FROM task_comments WHERE task_id = ?1)";

impl Tx<'_> {
    /// Deletes up to `limit` finished tasks last changed before `before`, oldest first, with
    /// their runs, events, comments and links — no more tasks than keep those rows within
    /// `max_rows` (but at least one), so one sweep is one short transaction; returns their ids
    /// (their log files and work directories are the caller's to remove). Records one `pruned`
    /// event naming them, written *before* the deletions: event ids are `max(id) + 1`, so the
    /// log's newest event must never be deleted, or an id a follower has seen would be handed
    /// out again. Earlier `pruned` events older than `before` are deleted with them.
    pub fn prune_finished(
        &self,
        before: Millis,
        limit: u32,
        max_rows: u64,
        now: Millis,
    ) -> Result<Vec<TaskId>> {
        let candidates: Vec<TaskId> = self
            .conn
            .prepare_cached(CANDIDATES)?
            .query_map(params![before, limit], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        let mut history = self.conn.prepare_cached(HISTORY_ROWS)?;
        let (mut ids, mut rows) = (Vec::new(), 0u64);
        for id in candidates {
            let n: u64 = history.query_row([id], |r| r.get(0))?;
            if !ids.is_empty() && rows + n > max_rows {
                break;
            }
            rows += n;
            ids.push(id);
        }
        if ids.is_empty() {
            return Ok(ids);
        }
        let event = self.append_event(
            None,
            None,
            "pruned",
            json!({ "tasks": ids, "before": before }),
            now,
        )?;
        // Earlier sweeps' own events go as the tasks they named went: once older than the
        // cutoff (else one row per sweep would stay for ever, and retention would not bound
        // the board). Never this one: it is the newest event (see above), and `last_pruned`
        // reads it.
        self.conn
            .prepare_cached(
                "DELETE FROM task_events WHERE task_id IS NULL AND kind = 'pruned' \
                 AND at < ?1 AND id < ?2",
            )?
            .execute(params![before, event])?;
        for sql in [
            "DELETE FROM task_events WHERE task_id = ?1",
            "DELETE FROM task_comments WHERE task_id = ?1",
            // A child waiting on other parents is unaffected: a finished parent no longer holds
            // it back, linked or not.
            "DELETE FROM task_links WHERE parent_id = ?1",
            "DELETE FROM task_links WHERE child_id = ?1",
            "DELETE FROM task_runs WHERE task_id = ?1",
            "DELETE FROM tasks WHERE id = ?1",
        ] {
            let mut stmt = self.conn.prepare_cached(sql)?;
            for id in &ids {
                stmt.execute([id])?;
            }
        }
        Ok(ids)
    }

    /// The tasks the newest `pruned` event names: the sweep whose file removal a crash may
    /// have cut short (sweeps run one after another, each removing its files before the next
    /// starts). Through `events_task`: `pruned` events are among the few without a task.
    pub fn last_pruned(&self) -> Result<Vec<TaskId>> {
        let payload: Option<String> = self
            .conn
            .prepare_cached(
                "SELECT payload FROM task_events WHERE task_id IS NULL AND kind = 'pruned' \
                 ORDER BY id DESC LIMIT 1",
            )?
            .query_row([], |r| r.get(0))
            .optional()?;
        let ids = payload
            .and_then(|p| serde_json::from_str::<serde_json::Value>(&p).ok())
            .and_then(|p| {
                p.get("tasks")?
                    .as_array()?
                    .iter()
                    .map(|v| v.as_i64())
                    .collect::<Option<Vec<TaskId>>>()
            })
            .unwrap_or_default();
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sweep runs on every tick: it must read finished tasks through their own index, in
    /// age order, not scan every task.
    #[test]
    fn candidates_are_read_through_the_finished_index() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("board.db");
        drop(crate::board::Board::open(&path).unwrap());
        let conn = rusqlite::Connection::open(&path).unwrap();
        let plan: Vec<String> = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {CANDIDATES}"))
            .unwrap()
            .query_map(params![0, 1], |r| r.get(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        let plan = plan.join(" | ");
        assert!(plan.contains("USING INDEX tasks_finished"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "sorts: {plan}");
    }
}
