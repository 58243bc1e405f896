//! Row ↔ struct mapping, in one place so column lists and field order cannot drift apart.

use rusqlite::Row;

use super::types::{Comment, Event, LogStart, Run, Task};

pub(super) const TASK_COLS: &str = "id, title, body, assignee, status, priority, created_at, \
    updated_at, started_at, completed_at, current_run_id, idempotency_key, max_runtime_ms, \
    max_retries, consecutive_failures, not_before, result, block_reason";

pub(super) const RUN_COLS: &str = "id, task_id, attempt, assignee, token, claimer, outcome, \
    started_at, ended_at, lease_expires_at, heartbeat_at, spawned_pid, worker_pid, \
    worker_boot_id, worker_start_ticks, exit_code, exit_signal, error, summary, log_offset, \
    log_generation, silence_ms, worker_pidfs_ino";

pub(super) const EVENT_COLS: &str = "id, task_id, run_id, kind, payload, at";

/// Maps a stored enum spelling back, as a conversion error rather than a panic on bad data.
fn parse_col<T: std::str::FromStr<Err = String>>(row: &Row<'_>, idx: usize) -> rusqlite::Result<T> {
    let text: String = row.get(idx)?;
    text.parse().map_err(|e: String| {
        rusqlite::Error::FromSqlConversionFailure(idx, rusqlite::types::Type::Text, e.into())
    })
}

pub(super) fn task(row: &Row<'_>) -> rusqlite::Result<Task> {
    Ok(Task {
        id: row.get(0)?,
        title: row.get(1)?,
        body: row.get(2)?,
        assignee: row.get(3)?,
        status: parse_col(row, 4)?,
        priority: row.get(5)?,
        created_at: row.get(6)?,
        updated_at: row.get(7)?,
        started_at: row.get(8)?,
        completed_at: row.get(9)?,
        current_run_id: row.get(10)?,
        idempotency_key: row.get(11)?,
        max_runtime_ms: row.get(12)?,
        max_retries: row.get(13)?,
        consecutive_failures: row.get(14)?,
        not_before: row.get(15)?,
        result: row.get(16)?,
        block_reason: row.get(17)?,
    })
}

pub(super) fn run(row: &Row<'_>) -> rusqlite::Result<Run> {
    let outcome: Option<String> = row.get(6)?;
    let log_offset: Option<i64> = row.get(19)?;
    Ok(Run {
        id: row.get(0)?,
        task_id: row.get(1)?,
        attempt: row.get(2)?,
        assignee: row.get(3)?,
        token: row.get(4)?,
        claimer: row.get(5)?,
        outcome: match outcome {
            None => None,
            Some(_) => Some(parse_col(row, 6)?),
        },
        started_at: row.get(7)?,
        ended_at: row.get(8)?,
        lease_expires_at: row.get(9)?,
        heartbeat_at: row.get(10)?,
        spawned_pid: row.get(11)?,
        worker_pid: row.get(12)?,
        worker_boot_id: row.get(13)?,
        worker_start_ticks: row.get(14)?,
        exit_code: row.get(15)?,
        exit_signal: row.get(16)?,
        error: row.get(17)?,
        summary: row.get(18)?,
        log_start: match log_offset {
            None => None,
            Some(offset) => Some(LogStart {
                offset: u64::try_from(offset).unwrap_or(0),
                generation: row.get(20)?,
            }),
        },
        silence_ms: row.get(21)?,
        worker_pidfs_ino: row.get(22)?,
    })
}

pub(super) fn event(row: &Row<'_>) -> rusqlite::Result<Event> {
    let payload: String = row.get(4)?;
    Ok(Event {
        id: row.get(0)?,
        task_id: row.get(1)?,
        run_id: row.get(2)?,
        kind: row.get(3)?,
        // A payload is always written by us as JSON; anything else is kept as a string.
        payload: serde_json::from_str(&payload).unwrap_or(serde_json::Value::String(payload)),
        at: row.get(5)?,
    })
}

pub(super) fn comment(row: &Row<'_>) -> rusqlite::Result<Comment> {
    Ok(Comment {
        id: row.get(0)?,
        task_id: row.get(1)?,
        author: row.get(2)?,
        body: row.get(3)?,
        at: row.get(4)?,
    })
}

/// Collects mapped rows until they hold more than `max_bytes` (as `size` measures each), always
/// at least one; `true` when it stopped early. What bounds one reply or page, however big the
/// rows are, without reading the rows past the bound.
pub(super) fn take_within<T>(
    rows: impl Iterator<Item = rusqlite::Result<T>>,
    max_bytes: usize,
    size: impl Fn(&T) -> usize,
) -> rusqlite::Result<(Vec<T>, bool)> {
    let (mut taken, mut bytes) = (Vec::new(), 0usize);
    for row in rows {
        let row = row?;
        let n = size(&row);
        if !taken.is_empty() && bytes.saturating_add(n) > max_bytes {
            return Ok((taken, true));
        }
        bytes += n;
        taken.push(row);
    }
    Ok((taken, false))
}

/// [`take_within`] over rows read newest first: the newest that fit, oldest first, and how many
/// of `total()` rows (called only when something was left out) were left out.
pub(super) fn newest_within<T>(
    rows: impl Iterator<Item = rusqlite::Result<T>>,
    max_bytes: usize,
    size: impl Fn(&T) -> usize,
    total: impl FnOnce() -> rusqlite::Result<u64>,
) -> rusqlite::Result<(Vec<T>, u64)> {
    let (mut taken, cut) = take_within(rows, max_bytes, size)?;
    let omitted = if cut {
        total()?.saturating_sub(taken.len() as u64)
    } else {
        0
    };
    taken.reverse();
    Ok((taken, omitted))
}
