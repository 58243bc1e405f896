//! The append-only event log.

use rusqlite::{OptionalExtension, params};

use super::rows::{self, EVENT_COLS};
use super::types::{Event, EventId, Millis, RunId, TaskId};
use super::{Result, Tx};

impl Tx<'_> {
    /// Appends one event; called by every transition inside its own transaction.
    pub fn append_event(
        &self,
        task_id: Option<TaskId>,
        run_id: Option<RunId>,
        kind: &str,
        payload: serde_json::Value,
        now: Millis,
    ) -> Result<EventId> {
        self.conn
            .prepare_cached(
                "INSERT INTO task_events (task_id, run_id, kind, payload, at) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![task_id, run_id, kind, payload_text(&payload), now])?;
        let id = self.conn.last_insert_rowid();
        if let Some(appended) = self.appended {
            appended.borrow_mut().push(Event {
                id,
                task_id,
                run_id,
                kind: kind.to_string(),
                payload,
                at: now,
            });
        }
        Ok(id)
    }

    /// Events with id greater than `after`, oldest first, at most `limit`.
    pub fn events_since(&self, after: EventId, limit: u32) -> Result<Vec<Event>> {
        Ok(self.events_since_within(None, after, limit, usize::MAX)?.0)
    }

    /// Events of one task with id greater than `after`, oldest first, at most `limit`.
    pub fn task_events_since(
        &self,
        task_id: TaskId,
        after: EventId,
        limit: u32,
    ) -> Result<Vec<Event>> {
        Ok(self
            .events_since_within(Some(task_id), after, limit, usize::MAX)?
            .0)
    }

    /// Events (of `task_id`, or all) with id greater than `after`, oldest first, at most
    /// `limit`, stopping once their payloads hold more than about `max_bytes` of text (at
    /// least one event); `true` when it stopped early. Bounds what one page may hold, however
    /// big the results and titles the events carry are.
    pub fn events_since_within(
        &self,
        task_id: Option<TaskId>,
        after: EventId,
        limit: u32,
        max_bytes: usize,
    ) -> Result<(Vec<Event>, bool)> {
        // Two statements, not one with `?1 IS NULL OR task_id = ?1`: a task's events must be
        // read through its index, which that form would keep the planner from using.
        static ALL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        static ONE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let mut stmt;
        let rows = match task_id {
            None => {
                let sql = ALL.get_or_init(|| {
                    format!(
                        "SELECT {EVENT_COLS} FROM task_events WHERE id > ?1 ORDER BY id LIMIT ?2"
                    )
                });
                stmt = self.conn.prepare_cached(sql)?;
                stmt.query_map(params![after, limit], rows::event)?
            }
            Some(task) => {
                let sql = ONE.get_or_init(|| {
                    format!(
                        "SELECT {EVENT_COLS} FROM task_events WHERE task_id = ?1 AND id > ?2 \
                         ORDER BY id LIMIT ?3"
                    )
                });
                stmt = self.conn.prepare_cached(sql)?;
                stmt.query_map(params![task, after, limit], rows::event)?
            }
        };
        Ok(rows::take_within(rows, max_bytes, event_size)?)
    }

    /// The last `limit` events of a task, oldest first, within about `max_bytes` of payload
    /// text; and how many of those last `limit` were left out (the oldest) to stay within it.
    pub fn recent_task_events_within(
        &self,
        task_id: TaskId,
        limit: u32,
        max_bytes: usize,
    ) -> Result<(Vec<Event>, u64)> {
        static SQL: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        let sql = SQL.get_or_init(|| {
            format!(
                "SELECT {EVENT_COLS} FROM task_events WHERE task_id = ?1 ORDER BY id DESC LIMIT ?2"
            )
        });
        let mut stmt = self.conn.prepare_cached(sql)?;
        Ok(rows::newest_within(
            stmt.query_map(params![task_id, limit], rows::event)?,
            max_bytes,
            event_size,
            // Of the last `limit` asked for: counted, not read (payloads are parsed per row).
            || {
                self.conn
                    .prepare_cached("SELECT min(count(*), ?2) FROM task_events WHERE task_id = ?1")?
                    .query_row(params![task_id, limit], |r| r.get(0))
            },
        )?)
    }

    /// The id of the newest event (0 on an empty log).
    pub fn last_event_id(&self) -> Result<EventId> {
        Ok(self
            .conn
            .query_row("SELECT max(id) FROM task_events", [], |r| {
                r.get::<_, Option<i64>>(0)
            })
            .optional()?
            .flatten()
            .unwrap_or(0))
    }
}

/// The stored form of a payload: compact JSON. (`serde_json::to_string` writes straight into
/// a `Vec`; `Display` goes through `fmt::Write` and costs several times as much per event.)
fn payload_text(payload: &serde_json::Value) -> String {
    serde_json::to_string(payload).unwrap_or_else(|_| payload.to_string())
}

/// What an event costs a bounded page: its kind and payload text.
fn event_size(ev: &Event) -> usize {
    text_size(&ev.payload) + ev.kind.len()
}

/// About how much text a payload holds (its strings and keys, plus a little per value): what a
/// page bound is measured in, without serializing it again.
fn text_size(v: &serde_json::Value) -> usize {
    use serde_json::Value;
    match v {
        Value::String(s) => s.len() + 2,
        Value::Array(items) => items.iter().map(text_size).sum::<usize>() + 2,
        Value::Object(map) => {
            map.iter()
                .map(|(k, v)| k.len() + 3 + text_size(v))
                .sum::<usize>()
                + 2
        }
        _ => 8,
    }
}
