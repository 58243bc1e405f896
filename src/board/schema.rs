//! Schema and versioned migrations (`PRAGMA user_version`).
//!
//! Each migration is applied once, in order, inside one transaction with the version bump, so a
//! crash half-way through a migration leaves the previous version intact.

use rusqlite::Connection;

use super::BoardError;

/// Migrations in order; index + 1 is the `user_version` they bring the database to.
const MIGRATIONS: &[&str] = &[
    // v1: the board.
    r#"
    CREATE TABLE tasks (
        id                   INTEGER PRIMARY KEY,
        title                TEXT    NOT NULL,
        body                 TEXT    NOT NULL DEFAULT '',
        assignee             TEXT,
        status               TEXT    NOT NULL,
        priority             INTEGER NOT NULL DEFAULT 0,
        created_at           INTEGER NOT NULL,
        updated_at           INTEGER NOT NULL,
        started_at           INTEGER,
        completed_at         INTEGER,
        current_run_id       INTEGER,
        idempotency_key      TEXT,
        max_runtime_ms       INTEGER,
        max_retries          INTEGER,
        consecutive_failures INTEGER NOT NULL DEFAULT 0,
        not_before           INTEGER NOT NULL DEFAULT 0,
        result               TEXT,
        block_reason         TEXT
    );
    -- An idempotency key names at most one open task; a finished one frees the key.
    CREATE UNIQUE INDEX tasks_idempotency ON tasks(idempotency_key)
        WHERE idempotency_key IS NOT NULL AND status NOT IN ('done', 'archived');
    -- The dispatcher's candidate scan touches only ready rows, already in claim order.
    CREATE INDEX tasks_ready ON tasks(priority DESC, created_at, id) WHERE status = 'ready';
    CREATE INDEX tasks_todo ON tasks(id) WHERE status = 'todo';
    CREATE INDEX tasks_status ON tasks(status, id);

    CREATE TABLE task_runs (
        id                 INTEGER PRIMARY KEY,
        task_id            INTEGER NOT NULL REFERENCES tasks(id),
        attempt            INTEGER NOT NULL,
        assignee           TEXT,
        token              TEXT    NOT NULL,
        claimer            TEXT    NOT NULL,
        outcome            TEXT,
        started_at         INTEGER NOT NULL,
        ended_at           INTEGER,
        lease_expires_at   INTEGER NOT NULL,
        heartbeat_at       INTEGER,
        spawned_pid        INTEGER,
        worker_pid         INTEGER,
        worker_boot_id     TEXT,
        worker_start_ticks INTEGER,
        exit_code          INTEGER,
        exit_signal        INTEGER,
        error              TEXT,
        summary            TEXT
    );
    CREATE INDEX runs_task ON task_runs(task_id, id);
    -- Open runs: caps, leases, adoption. O(live), whatever the history.
    CREATE INDEX runs_open ON task_runs(id) WHERE ended_at IS NULL;
    -- Closed runs that still hold worker evidence: the terminal reaper's whole work list.
    CREATE INDEX runs_evidence ON task_runs(ended_at)
        WHERE ended_at IS NOT NULL AND worker_pid IS NOT NULL;

    CREATE TABLE task_events (
        id      INTEGER PRIMARY KEY AUTOINCREMENT,
        task_id INTEGER,
        run_id  INTEGER,
        kind    TEXT    NOT NULL,
        payload TEXT    NOT NULL DEFAULT '{}',
        at      INTEGER NOT NULL
    );
    CREATE INDEX events_task ON task_events(task_id, id);

    CREATE TABLE task_links (
        parent_id INTEGER NOT NULL REFERENCES tasks(id),
        child_id  INTEGER NOT NULL REFERENCES tasks(id),
        PRIMARY KEY (parent_id, child_id)
    ) WITHOUT ROWID;
    CREATE INDEX links_child ON task_links(child_id, parent_id);

    CREATE TABLE task_comments (
        id      INTEGER PRIMARY KEY,
        task_id INTEGER NOT NULL REFERENCES tasks(id),
        author  TEXT    NOT NULL,
        body    TEXT    NOT NULL,
        at      INTEGER NOT NULL
    );
    CREATE INDEX comments_task ON task_comments(task_id, id);
    "#,
    // v2: the dispatcher reads candidates per assignee, in claim order, a few rows at a time;
    // this index makes that a range scan that stops at LIMIT instead of a sort of every ready
    // task.
    r#"
    CREATE INDEX tasks_ready_assignee ON tasks(assignee, priority DESC, created_at, id)
        WHERE status = 'ready';
    "#,
    // v3: event ids without AUTOINCREMENT, which cost every event a read and a write of
    // `sqlite_sequence` (about 5 % of the board's work per task lifecycle, callgrind). Ids stay
    // strictly increasing and are never reused because the log is append-only: a plain
    // INTEGER PRIMARY KEY takes max(id) + 1, and the newest event is never deleted. (Anything
    // that ever prunes events must keep the newest row, or `events --follow` cursors break.)
    // The rows are copied with their ids. Should the old counter be ahead of the newest row
    // (events deleted by hand), an `event_ids_reserved` event takes its value, so no id a
    // follower has seen is ever handed out again. The copy needs free space about the size of
    // the event log, once.
    r#"
    CREATE TABLE task_events_v3 (
        id      INTEGER PRIMARY KEY,
        task_id INTEGER,
        run_id  INTEGER,
        kind    TEXT    NOT NULL,
        payload TEXT    NOT NULL DEFAULT '{}',
        at      INTEGER NOT NULL
    );
    INSERT INTO task_events_v3 (id, task_id, run_id, kind, payload, at)
        SELECT id, task_id, run_id, kind, payload, at FROM task_events ORDER BY id;
    INSERT INTO task_events_v3 (id, kind, payload, at)
        SELECT seq, 'event_ids_reserved', json_object('through', seq),
               CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)
        FROM sqlite_sequence
        WHERE name = 'task_events' AND seq > (SELECT coalesce(max(id), 0) FROM task_events);
    DROP TABLE task_events;
    ALTER TABLE task_events_v3 RENAME TO task_events;
    CREATE INDEX events_task ON task_events(task_id, id);
    "#,
    // v4: the retention sweep finds finished tasks by age, oldest first, without reading
    // every finished task on each tick. And `spawn_pending`: set by a claim made to start a
    // worker, cleared once that start is settled (the worker recorded, or known never to run).
    // A run closed in between (reclaimed, archived) still has a worker on its way: it keeps
    // its task from being claimed again and holds its slot, like recorded worker evidence.
    r#"
    CREATE INDEX tasks_finished ON tasks(updated_at, id) WHERE status IN ('done', 'archived');
    ALTER TABLE task_runs ADD COLUMN spawn_pending INTEGER NOT NULL DEFAULT 0;
    -- The runs that hold a worker slot (the caps count them): open, or closed while their
    -- worker may be alive (and has a fingerprint, so it will be proven gone some day) or is
    -- still being started.
    -- (Pending runs are read through it too: no index of their own to maintain per claim.)
    CREATE INDEX runs_holding ON task_runs(assignee)
        WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1;
    "#,
    // v5: a board migrated by the first build of v4 has `runs_holding` on `worker_pid` (which
    // counted workers without a fingerprint, that nothing can prove gone, for good) and a
    // `runs_spawn_pending` index since folded into it; the queries name `runs_holding` as
    // defined above, and SQLite refuses a plan with the old one. Rebuilt to that definition
    // (on any other board this rebuilds the index v4 just made, once).
    // (`migrate` first adds the `spawn_pending` column to a board whose v4 predates it.)
    r#"
    DROP INDEX IF EXISTS runs_spawn_pending;
    DROP INDEX IF EXISTS runs_holding;
    CREATE INDEX runs_holding ON task_runs(assignee)
        WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1;
    "#,
    // v6: dispatch reads ready tasks per assignee (`tasks_ready_assignee`); the index of all
    // ready tasks in claim order served no query of the supervisor's and cost every create and
    // every claim an index write (and a page at each commit).
    r#"
    DROP INDEX IF EXISTS tasks_ready;
    "#,
    // v7: where a run's output starts in its task's log (shared by the task's attempts), kept
    // with the worker's evidence, so that a supervisor which adopts the worker after a restart
    // quotes only this run's output when it crashes, as the one that started it would.
    r#"
    ALTER TABLE task_runs ADD COLUMN log_offset INTEGER;
    ALTER TABLE task_runs ADD COLUMN log_generation TEXT;
    "#,
    // v8: the silence (no heartbeat, in ms) the supervisors watching a run had heard from its
    // worker when one of them last refreshed its lease; a heartbeat resets it. A supervisor
    // that adopts the worker after a restart goes on from there for `stale_after`, so the time
    // no supervisor ran is not counted and the time they listened is.
    r#"
    ALTER TABLE task_runs ADD COLUMN silence_ms INTEGER NOT NULL DEFAULT 0;
    "#,
    // v9: the worker's pidfs inode number, part of its fingerprint where the kernel has pidfs
    // (see process::Fingerprint): a process given the worker's pid within its clock tick has
    // the same start time, and another inode. Stored as its 64 bits, signed.
    r#"
    ALTER TABLE task_runs ADD COLUMN worker_pidfs_ino INTEGER;
    "#,
    // v10: the data dir whose supervisor serves the board (its device and inode) and the boot
    // it did so in: a board copied into another data dir on the same boot (a backup served to
    // read it, a build tried on a copy) must not take the original's live workers for its own
    // (see home.rs).
    r#"
    CREATE TABLE board_home (
        id       INTEGER PRIMARY KEY CHECK (id = 1),
        boot_id  TEXT NOT NULL,
        data_dir TEXT NOT NULL,
        path     TEXT NOT NULL,
        at       INTEGER NOT NULL
    );
    "#,
];

/// The schema version this build writes.
pub const SCHEMA_VERSION: u32 = MIGRATIONS.len() as u32;

/// Brings the database up to [`SCHEMA_VERSION`]; refuses a database written by a newer build.
pub(crate) fn migrate(conn: &mut Connection) -> Result<(), BoardError> {
    // Whether the board was empty when first seen: then every step is its creation.
    let mut fresh = None;
    loop {
        // The version is read inside the exclusive transaction: two processes opening a fresh
        // board at once must not both apply the same migration.
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Exclusive)?;
        let current: u32 = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
        if current > SCHEMA_VERSION {
            return Err(BoardError::SchemaTooNew {
                found: current,
                supported: SCHEMA_VERSION,
            });
        }
        let Some(sql) = MIGRATIONS.get(current as usize) else {
            return Ok(());
        };
        if !*fresh.get_or_insert(current == 0) {
            // A fresh board is created silently; an upgrade (which may copy a table) is said.
            tracing::info!(
                from = current,
                to = current + 1,
                "board: migrating the schema"
            );
        }
        if current == 4 && !has_column(&tx, "task_runs", "spawn_pending")? {
            // The very first v4 build only added `tasks_finished`.
            tx.execute_batch(
                "ALTER TABLE task_runs ADD COLUMN spawn_pending INTEGER NOT NULL DEFAULT 0",
            )?;
        }
        tx.execute_batch(sql)?;
        tx.pragma_update(None, "user_version", current + 1)?;
        tx.commit()?;
    }
}

fn has_column(conn: &Connection, table: &str, column: &str) -> Result<bool, BoardError> {
    let mut stmt = conn.prepare(&format!("PRAGMA table_info({table})"))?;
    let names = stmt.query_map([], |r| r.get::<_, String>(1))?;
    for name in names {
        if name? == column {
            return Ok(true);
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn events(conn: &Connection) -> Vec<(i64, String)> {
        let mut stmt = conn
            .prepare("SELECT id, kind FROM task_events ORDER BY id")
            .unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.collect::<rusqlite::Result<_>>().unwrap()
    }

    fn v2_board(dir: &std::path::Path) -> Connection {
        let conn = Connection::open(dir.join("board.db")).unwrap();
        for sql in &MIGRATIONS[..2] {
            conn.execute_batch(sql).unwrap();
        }
        conn.pragma_update(None, "user_version", 2).unwrap();
        for kind in ["created", "claimed", "completed"] {
            conn.execute(
                "INSERT INTO task_events (task_id, kind, at) VALUES (1, ?1, 0)",
                [kind],
            )
            .unwrap();
        }
        conn
    }

    fn next_event_id(conn: &Connection) -> i64 {
        conn.execute(
            "INSERT INTO task_events (task_id, kind, at) VALUES (1, 'next', 0)",
            [],
        )
        .unwrap();
        conn.last_insert_rowid()
    }

    /// How many indexes named `name` the board has (0 or 1).
    fn indexes_named(conn: &Connection, name: &str) -> i64 {
        conn.query_row(
            "SELECT count(*) FROM sqlite_master WHERE type = 'index' AND name = ?1",
            [name],
            |r| r.get(0),
        )
        .unwrap()
    }

    /// A v2 board (AUTOINCREMENT event ids) keeps every event and its id through v3, and the
    /// next event follows the newest one.
    #[test]
    fn v3_keeps_event_ids_and_continues_after_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = v2_board(dir.path());
        // An id gap (an import could leave one).
        conn.execute(
            "INSERT INTO task_events (id, task_id, kind, at) VALUES (10, 1, 'archived', 0)",
            [],
        )
        .unwrap();
        let before = events(&conn);

        migrate(&mut conn).unwrap();

        assert_eq!(events(&conn), before);
        let version: u32 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let counters: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_sequence WHERE name = 'task_events'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(counters, 0, "no AUTOINCREMENT counter is left");
        assert_eq!(next_event_id(&conn), 11);
        let sql: String = conn
            .query_row(
                "SELECT sql FROM sqlite_master WHERE name = 'task_events'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert!(!sql.contains("AUTOINCREMENT"), "{sql}");
        assert_eq!(indexes_named(&conn, "events_task"), 1);
        // v6: the index of all ready tasks is gone (a v2 board had it).
        assert_eq!(
            indexes_named(&conn, "tasks_ready"),
            0,
            "tasks_ready is dropped"
        );
        let check: String = conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(check, "ok");
    }

    /// Newest events deleted by hand on a v2 board: their ids stay used (a follower may have
    /// seen them), held by one `event_ids_reserved` event.
    #[test]
    fn v3_never_hands_out_an_id_the_old_counter_had_passed() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = v2_board(dir.path());
        conn.execute("DELETE FROM task_events WHERE id = 3", [])
            .unwrap();

        migrate(&mut conn).unwrap();

        let kinds: Vec<(i64, String)> = events(&conn);
        assert_eq!(
            kinds,
            [
                (1, "created".to_string()),
                (2, "claimed".to_string()),
                (3, "event_ids_reserved".to_string())
            ]
        );
        assert_eq!(next_event_id(&conn), 4);
    }

    /// A v3 board's runs come through v4 unchanged and hold no pending start (their workers,
    /// if any, are recorded or were settled by v3's rules), with the new indexes in place.
    #[test]
    fn v4_keeps_runs_and_marks_none_pending() {
        let dir = tempfile::tempdir().unwrap();
        let mut conn = Connection::open(dir.path().join("board.db")).unwrap();
        for sql in &MIGRATIONS[..3] {
            conn.execute_batch(sql).unwrap();
        }
        conn.pragma_update(None, "user_version", 3).unwrap();
        conn.execute_batch(
            "INSERT INTO tasks (id, title, status, created_at, updated_at) \
                 VALUES (1, 't', 'running', 0, 0);
             INSERT INTO task_runs (id, task_id, attempt, token, claimer, started_at, \
                 lease_expires_at, worker_pid) VALUES (7, 1, 1, 'tok', 'c', 0, 0, 42);",
        )
        .unwrap();

        migrate(&mut conn).unwrap();

        let (pid, pending): (i64, i64) = conn
            .query_row(
                "SELECT worker_pid, spawn_pending FROM task_runs WHERE id = 7",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((pid, pending), (42, 0));
        for index in ["tasks_finished", "runs_holding"] {
            assert_eq!(indexes_named(&conn, index), 1, "{index}");
        }
    }

    /// Boards migrated by earlier v4 builds — one with only `tasks_finished`, one with
    /// `runs_holding` on `worker_pid` and a `runs_spawn_pending` index — get the column and the
    /// index the caps' query names; without them SQLite refuses that query (or the board does
    /// not open) and nothing is ever dispatched.
    #[test]
    fn v5_completes_every_earlier_v4() {
        let first = "CREATE INDEX tasks_finished ON tasks(updated_at, id) \
                         WHERE status IN ('done', 'archived');";
        let second = "CREATE INDEX tasks_finished ON tasks(updated_at, id) \
                          WHERE status IN ('done', 'archived');
             ALTER TABLE task_runs ADD COLUMN spawn_pending INTEGER NOT NULL DEFAULT 0;
             CREATE INDEX runs_holding ON task_runs(assignee) \
                 WHERE ended_at IS NULL OR worker_pid IS NOT NULL OR spawn_pending = 1;
             CREATE INDEX runs_spawn_pending ON task_runs(id) WHERE spawn_pending = 1;";
        let caps_query = "SELECT coalesce(assignee, '') FROM task_runs INDEXED BY runs_holding \
             WHERE ended_at IS NULL OR worker_start_ticks IS NOT NULL OR spawn_pending = 1";
        for v4 in [first, second] {
            let dir = tempfile::tempdir().unwrap();
            let mut conn = Connection::open(dir.path().join("board.db")).unwrap();
            for sql in &MIGRATIONS[..3] {
                conn.execute_batch(sql).unwrap();
            }
            conn.execute_batch(v4).unwrap();
            conn.pragma_update(None, "user_version", 4).unwrap();
            assert!(
                conn.prepare(caps_query).is_err(),
                "served before the upgrade"
            );

            migrate(&mut conn).unwrap();

            conn.prepare(caps_query)
                .expect("the caps' query has its index");
            let old: i64 = conn
                .query_row(
                    "SELECT count(*) FROM sqlite_master WHERE name = 'runs_spawn_pending'",
                    [],
                    |r| r.get(0),
                )
                .unwrap();
            assert_eq!(old, 0);
        }
    }
}
