//! Queries: tasks, runs, details, counts and the dispatcher's candidate list.

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};

use super::rows::{self, RUN_COLS, TASK_COLS};
use super::types::{Comment, Millis, Run, RunId, Task, TaskDetail, TaskFilter, TaskId, TaskStatus};
use super::{BoardError, Result, Tx};

/// A task is not claimable while an earlier run of it still holds worker evidence, or still
/// has its worker's start under way: that worker (reclaimed, timed out, archived then
/// unarchived, reclaimed before its spawn landed…) may be alive, and a second worker for the
/// same task must never start beside it.
pub(super) const NO_LIVE_PREVIOUS_WORKER: &str = "AND NOT EXISTS (SELECT 1 FROM task_runs r \
     WHERE r.task_id = tasks.id AND (r.worker_pid IS NOT NULL OR r.spawn_pending = 1))";

/// Most tasks `list_tasks` returns without an explicit limit.
pub const DEFAULT_LIST_LIMIT: u32 = 1000;
/// Most tasks `list_tasks` returns at all: a larger `limit` is clamped to it (as an `events`
/// page is), so one request cannot make the supervisor build an unbounded reply.
pub const MAX_LIST_LIMIT: u32 = 10_000;
/// What a run or comment costs a bounded reply beside its free text (ids, times, field names),
/// so that many tiny rows are bounded too.
const ROW_OVERHEAD: usize = 128;

impl Tx<'_> {
    /// One task.
    pub fn get_task(&self, id: TaskId) -> Result<Task> {
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = SQL.get_or_init(|| format!("SELECT {TASK_COLS} FROM tasks WHERE id = ?1"));
        self.task_fields(id, sql, rows::task)
    }

    /// One task's status (cheaper than `get_task`).
    pub fn task_status(&self, id: TaskId) -> Result<TaskStatus> {
        let text: String =
            self.task_fields(id, "SELECT status FROM tasks WHERE id = ?1", |r| r.get(0))?;
        parse_status(text)
    }

    /// One task's status and current run (cheaper than `get_task`).
    pub fn task_state(&self, id: TaskId) -> Result<(TaskStatus, Option<RunId>)> {
        let sql = "SELECT status, current_run_id FROM tasks WHERE id = ?1";
        let (text, current) = self.task_fields(id, sql, |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok((parse_status(text)?, current))
    }

    /// One task's status and assignee (what a claim needs; cheaper than `get_task`).
    pub fn task_status_and_assignee(&self, id: TaskId) -> Result<(TaskStatus, Option<String>)> {
        let sql = "SELECT status, assignee FROM tasks WHERE id = ?1";
        let (text, assignee) = self.task_fields(id, sql, |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok((parse_status(text)?, assignee))
    }

    /// A few columns of one task (`sql` selects them by `id = ?1`); `NotFound` if none.
    fn task_fields<T>(
        &self,
        id: TaskId,
        sql: &str,
        row: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<T> {
        self.row_by_id("task", id, sql, row)
    }

    /// One run.
    pub fn get_run(&self, id: RunId) -> Result<Run> {
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = SQL.get_or_init(|| format!("SELECT {RUN_COLS} FROM task_runs WHERE id = ?1"));
        self.run_fields(id, sql, rows::run)
    }

    /// A few columns of one run (`sql` selects them by `id = ?1`); `NotFound` if none.
    pub(super) fn run_fields<T>(
        &self,
        id: RunId,
        sql: &str,
        row: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<T> {
        self.row_by_id("run", id, sql, row)
    }

    /// The row of `sql` (which selects one `what` by `id = ?1`); `NotFound` if none.
    fn row_by_id<T>(
        &self,
        what: &'static str,
        id: i64,
        sql: &str,
        row: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
    ) -> Result<T> {
        self.conn
            .prepare_cached(sql)?
            .query_row([id], row)
            .optional()?
            .ok_or_else(|| BoardError::not_found(what, id))
    }

    /// Every run of a task, oldest first.
    pub fn runs_for_task(&self, task_id: TaskId) -> Result<Vec<Run>> {
        let sql = format!("SELECT {RUN_COLS} FROM task_runs WHERE task_id = ?1 ORDER BY id");
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map([task_id], rows::run)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Runs whose worker's start is still marked under way (see
    /// [`Tx::claim_task_to_spawn`]), open or closed, oldest first.
    pub fn spawn_pending_runs(&self) -> Result<Vec<Run>> {
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = SQL.get_or_init(|| {
            format!(
                "SELECT {RUN_COLS} FROM task_runs INDEXED BY runs_holding \
                 WHERE (ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1) \
                 AND spawn_pending = 1 ORDER BY id"
            )
        });
        let mut stmt = self.conn.prepare_cached(sql)?;
        let rows = stmt.query_map([], rows::run)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Every open run (uses the `runs_open` partial index: O(live runs)).
    pub fn open_runs(&self) -> Result<Vec<Run>> {
        let sql = format!("SELECT {RUN_COLS} FROM task_runs WHERE ended_at IS NULL ORDER BY id");
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map([], rows::run)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Tasks matching `filter`, newest first; at most `filter.limit` (default 1000), and never
    /// more than 10 000.
    pub fn list_tasks(&self, filter: &TaskFilter) -> Result<Vec<Task>> {
        Ok(self.list_tasks_within(filter, usize::MAX)?.0)
    }

    /// [`Tx::list_tasks`], stopping once the tasks read hold more than `max_bytes` of text
    /// (titles, bodies, results); `true` when it stopped early. At least one task is returned:
    /// a bound on what one reply may hold, however big the tasks are.
    pub fn list_tasks_within(
        &self,
        filter: &TaskFilter,
        max_bytes: usize,
    ) -> Result<(Vec<Task>, bool)> {
        let sql = format!(
            "SELECT {TASK_COLS} FROM tasks WHERE (?1 IS NULL OR status = ?1) \
             AND (?2 IS NULL OR assignee = ?2) ORDER BY id DESC LIMIT ?3"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(
            params![
                filter.status.map(|s| s.as_str()),
                filter.assignee,
                filter
                    .limit
                    .unwrap_or(DEFAULT_LIST_LIMIT)
                    .min(MAX_LIST_LIMIT)
            ],
            rows::task,
        )?;
        Ok(rows::take_within(rows, max_bytes, |t: &Task| {
            t.title.len()
                + t.body.len()
                + t.result.as_ref().map_or(0, String::len)
                + t.block_reason.as_ref().map_or(0, String::len)
                + t.idempotency_key.as_ref().map_or(0, String::len)
                + t.assignee.as_ref().map_or(0, String::len)
        })?)
    }

    /// A task with its links, runs, last `event_limit` events and comments, the runs, events
    /// and comments within about `max_bytes` of their text (a third each, at least one of each
    /// kind). What does not fit is the oldest, and the reply counts it (`omitted_*`): a task
    /// retried for months, or commented on by a chatty tool, still makes a bounded reply.
    pub fn task_detail(
        &self,
        id: TaskId,
        event_limit: u32,
        max_bytes: usize,
    ) -> Result<TaskDetail> {
        let task = self.get_task(id)?;
        let ids = |sql: &str| -> Result<Vec<TaskId>> {
            let mut stmt = self.conn.prepare_cached(sql)?;
            let rows = stmt.query_map([id], |r| r.get(0))?;
            Ok(rows.collect::<rusqlite::Result<_>>()?)
        };
        let parents =
            ids("SELECT parent_id FROM task_links WHERE child_id = ?1 ORDER BY parent_id")?;
        let children =
            ids("SELECT child_id FROM task_links WHERE parent_id = ?1 ORDER BY child_id")?;
        let share = max_bytes / 3;
        let count = |sql: &str| -> rusqlite::Result<u64> {
            self.conn.prepare_cached(sql)?.query_row([id], |r| r.get(0))
        };

        static RUNS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = RUNS.get_or_init(|| {
            format!("SELECT {RUN_COLS} FROM task_runs WHERE task_id = ?1 ORDER BY id DESC")
        });
        let mut stmt = self.conn.prepare_cached(sql)?;
        let (runs, omitted_runs) = rows::newest_within(
            stmt.query_map([id], rows::run)?,
            share,
            |r: &Run| {
                ROW_OVERHEAD
                    + r.error.as_ref().map_or(0, String::len)
                    + r.summary.as_ref().map_or(0, String::len)
            },
            || count("SELECT count(*) FROM task_runs WHERE task_id = ?1"),
        )?;

        let mut stmt = self.conn.prepare_cached(
            "SELECT id, task_id, author, body, at FROM task_comments WHERE task_id = ?1 \
             ORDER BY id DESC",
        )?;
        let (comments, omitted_comments) = rows::newest_within(
            stmt.query_map([id], rows::comment)?,
            share,
            |c: &Comment| ROW_OVERHEAD + c.author.len() + c.body.len(),
            || count("SELECT count(*) FROM task_comments WHERE task_id = ?1"),
        )?;

        let (events, omitted_events) = self.recent_task_events_within(id, event_limit, share)?;
        Ok(TaskDetail {
            runs,
            events,
            task,
            parents,
            children,
            comments,
            omitted_runs,
            omitted_comments,
            omitted_events,
        })
    }

    /// Number of tasks per status (every status present, zero included).
    pub fn status_counts(&self) -> Result<BTreeMap<String, i64>> {
        let mut counts: BTreeMap<String, i64> = TaskStatus::ALL
            .iter()
            .map(|s| (s.as_str().to_string(), 0))
            .collect();
        let mut stmt = self
            .conn
            .prepare_cached("SELECT status, count(*) FROM tasks GROUP BY status")?;
        for row in stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))? {
            let (status, n) = row?;
            counts.insert(status, n);
        }
        Ok(counts)
    }

    /// Tasks waiting to be claimed (`todo` or `ready`), counted by assignee; unassigned ones
    /// are left out. For telling operators about tasks no configured assignee will ever run.
    pub fn waiting_by_assignee(&self) -> Result<BTreeMap<String, i64>> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT assignee, count(*) FROM tasks WHERE status IN ('todo', 'ready') \
             AND assignee IS NOT NULL GROUP BY assignee",
        )?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Runs holding a worker slot, per assignee: what the caps count, since `max_in_progress`
    /// bounds live workers. Open runs (a previous incarnation's too), and closed runs whose
    /// worker may still be alive (it reported and has not exited yet, it is being ended) or is
    /// still being started. Not a closed run whose worker was recorded without a fingerprint
    /// (a legacy row: a start that cannot fingerprint its child now fails): nothing can ever
    /// prove that one gone, and it must not take a slot for good. (A run's
    /// evidence is cleared as a whole, so `worker_start_ticks` is set exactly while it holds a
    /// fingerprinted worker.)
    pub fn slot_holders_by_assignee(&self) -> Result<BTreeMap<String, u32>> {
        // Counted here rather than with GROUP BY: there are few such runs, and SQLite would
        // build a sorter for every call (one per claim).
        let mut stmt = self.conn.prepare_cached(
            "SELECT coalesce(assignee, '') FROM task_runs INDEXED BY runs_holding \
             WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1",
        )?;
        let mut out = BTreeMap::new();
        let mut rows = stmt.query([])?;
        while let Some(row) = rows.next()? {
            *out.entry(row.get::<_, String>(0)?).or_insert(0u32) += 1;
        }
        Ok(out)
    }

    /// Ready tasks claimable at `now`, in claim order (priority, then age), at most `limit`.
    /// Sorts every ready task (no index holds them in claim order since schema v6): for tests
    /// and tools, not the dispatch path ([`Tx::ready_candidates_for`]).
    pub fn ready_candidates(&self, now: Millis, limit: u32) -> Result<Vec<Task>> {
        let sql = format!(
            "SELECT {TASK_COLS} FROM tasks INDEXED BY tasks_status \
             WHERE status = 'ready' AND not_before <= ?1 \
             {NO_LIVE_PREVIOUS_WORKER} ORDER BY priority DESC, created_at, id LIMIT ?2"
        );
        let mut stmt = self.conn.prepare_cached(&sql)?;
        let rows = stmt.query_map(params![now, limit], rows::task)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Like [`Tx::ready_candidates`], but only tasks of `assignees` (the ones with a free slot,
    /// see [`super::assignees_with_room`]). Without this filter a full assignee's backlog
    /// longer than `limit` fills every candidate slot and hides the ready tasks of assignees
    /// that could run them now (head-of-line blocking).
    pub fn ready_candidates_for(
        &self,
        now: Millis,
        assignees: &[String],
        limit: u32,
    ) -> Result<Vec<Task>> {
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = SQL.get_or_init(|| {
            format!(
                "SELECT {TASK_COLS} FROM tasks INDEXED BY tasks_ready_assignee \
                 WHERE status = 'ready' AND assignee = ?3 AND not_before <= ?1 \
                 {NO_LIVE_PREVIOUS_WORKER} ORDER BY priority DESC, created_at, id LIMIT ?2"
            )
        });
        let mut stmt = self.conn.prepare_cached(sql)?;
        let mut out = Vec::new();
        // One range scan per assignee (stopping at LIMIT), merged back into claim order.
        for name in assignees {
            let rows = stmt.query_map(params![now, limit, name], rows::task)?;
            for row in rows {
                out.push(row?);
            }
        }
        out.sort_by_key(|t| (std::cmp::Reverse(t.priority), t.created_at, t.id));
        out.truncate(limit as usize);
        Ok(out)
    }

    /// The earliest `not_before` among ready tasks still backing off, if any (so the dispatcher
    /// can wake exactly then instead of polling).
    pub fn next_backoff_expiry(&self, now: Millis) -> Result<Option<Millis>> {
        Ok(self
            .conn
            .prepare_cached(
                "SELECT min(not_before) FROM tasks WHERE status = 'ready' AND not_before > ?1",
            )?
            .query_row([now], |r| r.get(0))?)
    }
}

fn parse_status(text: String) -> Result<TaskStatus> {
    text.parse().map_err(BoardError::Invalid)
}
