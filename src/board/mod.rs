//! The board: SQLite schema, migrations, every transition and sweep. Synchronous.
//!
//! Every SQL statement of the project lives below this module, so another backend can replace it
//! without touching the actors. A [`Board`] owns one `rusqlite::Connection`; work happens inside a
//! [`Tx`]: [`Board::write`] opens it with `BEGIN IMMEDIATE` (so the write lock is taken up front
//! and a transition never fails half-way with `SQLITE_BUSY` on upgrade), [`Board::read`] with a
//! deferred `BEGIN` for a consistent snapshot. Each transition checks the state it expects
//! (compare-and-swap on status and current run) and appends its event in the same transaction.

mod dispatch;
mod events;
mod home;
mod prune;
mod reads;
mod reaper;
mod rows;
mod runs;
mod schema;
mod tasks;
mod types;

use std::cell::RefCell;
use std::path::Path;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};

pub use dispatch::{
    ClaimRules, DispatchOptions, DispatchReport, SpawnFn, assignees_with_room, dispatch_once,
    plan_claims,
};
pub use home::{Before, Home};
pub use reads::{DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT};
pub use reaper::{Reap, ReapCandidate, ReapVerdict, reap_one, reap_terminal_workers};
pub use runs::{ExitInfo, FailResult, RecordedExit};
pub use schema::SCHEMA_VERSION;
pub use tasks::{MAX_NAME_BYTES, MAX_RUNTIME_MS, MAX_TITLE_BYTES};
pub use types::*;

/// Prepared statements kept per connection (more than the board has distinct statements).
const STATEMENT_CACHE: usize = 256;
/// How long a statement waits for another connection's lock before failing with `busy`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the board. Each maps to one protocol error code ([`BoardError::code`]).
#[derive(Debug, thiserror::Error)]
pub enum BoardError {
    #[error("database error: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("cannot open board {path}: {source}")]
    Open {
        path: String,
        source: rusqlite::Error,
    },
    #[error("board schema version {found} is newer than this build supports ({supported})")]
    SchemaTooNew { found: u32, supported: u32 },
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: i64 },
    #[error("{0}")]
    Conflict(String),
    #[error("run {expected} is not the current run of task {task} (current: {current})")]
    StaleRun {
        task: TaskId,
        expected: RunId,
        current: String,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Unauthorized(String),
}

impl BoardError {
    /// The stable error code clients see.
    pub fn code(&self) -> &'static str {
        match self {
            BoardError::NotFound { .. } => "not_found",
            BoardError::Conflict(_) => "conflict",
            BoardError::StaleRun { .. } => "stale_run",
            BoardError::Invalid(_) => "bad_request",
            BoardError::Unauthorized(_) => "unauthorized",
            BoardError::Sqlite(e) if is_disk_full(e) => "disk_full",
            BoardError::Sqlite(e) if is_busy(e) => "busy",
            _ => "internal",
        }
    }

    pub(crate) fn not_found(what: &'static str, id: i64) -> Self {
        BoardError::NotFound { what, id }
    }
}

/// The board holds every run's secret token: readable by its owner only. (SQLite gives the
/// -wal and -shm files the database file's permissions when it makes them; ones already there
/// are narrowed too.) Through a link, as a chmod goes; one that cannot be changed (another
/// user's, without the right to) is left as it is, said in the log.
fn restrict_to_owner(path: &Path) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut names = vec![path.to_path_buf()];
    for suffix in ["-wal", "-shm"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        names.push(name.into());
    }
    for file in names {
        let Ok(meta) = std::fs::metadata(&file) else {
            continue;
        };
        let mode = meta.mode() & 0o7777;
        if !meta.is_file() || mode & 0o077 == 0 {
            continue;
        }
        let narrowed = mode & 0o700;
        match std::fs::set_permissions(&file, std::fs::Permissions::from_mode(narrowed)) {
            Ok(()) => {
                tracing::info!(path = %file.display(), from = format!("{mode:o}"), to = format!("{narrowed:o}"), "board file was readable by others; made the owner's alone (it holds run tokens)")
            }
            Err(e) => {
                tracing::warn!(path = %file.display(), mode = format!("{mode:o}"), error = %e, "cannot restrict the board's permissions")
            }
        }
    }
}

fn is_disk_full(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::DiskFull)
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if matches!(f.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked))
}

/// The compare-and-swap of a task transition hit exactly one row, or the task changed under
/// it (another writer got there first): a conflict, never a silent no-op.
pub(crate) fn changed_one(changed: usize, task_id: TaskId) -> Result<()> {
    if changed == 1 {
        Ok(())
    } else {
        Err(BoardError::Conflict(format!(
            "task {task_id} changed concurrently"
        )))
    }
}

/// Result alias for board operations.
pub type Result<T, E = BoardError> = std::result::Result<T, E>;

/// How to open a board.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenOptions {
    /// `PRAGMA synchronous = FULL` (true) or `NORMAL` (false).
    pub synchronous_full: bool,
    /// Open read-only (no migration, no writes).
    pub read_only: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            synchronous_full: true,
            read_only: false,
        }
    }
}

/// One connection to a board database.
pub struct Board {
    conn: Connection,
}

impl std::fmt::Debug for Board {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Board")
            .field("path", &self.conn.path())
            .finish()
    }
}

impl Board {
    /// Opens (creating and migrating if needed) the board at `path` with default options.
    pub fn open(path: &Path) -> Result<Board> {
        Board::open_with(path, OpenOptions::default())
    }

    /// Opens the board at `path`.
    pub fn open_with(path: &Path, opts: OpenOptions) -> Result<Board> {
        let wrap = |source| BoardError::Open {
            path: path.display().to_string(),
            source,
        };
        let flags = if opts.read_only {
            OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX
        } else {
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX
        };
        let fresh = !opts.read_only && !path.exists();
        if !opts.read_only && !fresh {
            // A board copied into place (a restore from a backup, which `sqlite3 .backup`
            // writes under the umask) may be readable by others: made the owner's alone before
            // SQLite opens it, so the -wal and -shm it makes get the same mode.
            restrict_to_owner(path);
        }
        if fresh {
            // Created the owner's from its first moment, before SQLite opens it (an empty
            // file is an empty database to SQLite): made under the umask and narrowed after,
            // it could be opened by anyone in between, who would keep reading through that
            // descriptor. Should this fail, SQLite creates it and the chmod below narrows it.
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(path);
        }
        let mut conn = Connection::open_with_flags(path, flags).map_err(wrap)?;
        if fresh {
            restrict_to_owner(path);
        }
        conn.busy_timeout(BUSY_TIMEOUT).map_err(wrap)?;
        // Every statement is prepared through the cache; the default of 16 is fewer than the
        // board's distinct statements, and a thrashing cache re-prepares on every call.
        conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
        if !opts.read_only {
            // WAL: readers (CLI, `show`) never block the supervisor's writer.
            let mode: String = conn
                .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
                .map_err(wrap)?;
            if !mode.eq_ignore_ascii_case("wal") {
                tracing::warn!(%mode, "board is not in WAL mode");
            }
        }
        let sync = if opts.synchronous_full {
            "FULL"
        } else {
            "NORMAL"
        };
        conn.pragma_update(None, "synchronous", sync)
            .map_err(wrap)?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(wrap)?;
        // Savepoint journals (a claim on close has one; a group commit applied op by op, one
        // per op) and sorts stay in memory: the default spills them to a temporary file once
        // they pass 64 KiB, which made every batch pay file writes, and a close and unlink at
        // its end.
        conn.pragma_update(None, "temp_store", "MEMORY")
            .map_err(wrap)?;
        if !opts.read_only {
            schema::migrate(&mut conn)?;
        }
        Ok(Board { conn })
    }

    /// Runs `f` in one write transaction (`BEGIN IMMEDIATE`); commits on `Ok`, rolls back on `Err`.
    pub fn write<T>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let txn = Tx::new(&tx, None);
        let out = f(&txn)?;
        // Rolled back early inside `f` (which went on regardless): nothing of it may commit.
        txn.check_not_ended()?;
        if tx.is_autocommit() {
            return Err(EndedBy(None).error());
        }
        tx.commit()?;
        Ok(out)
    }

    /// Runs `f` in one read transaction (a consistent snapshot).
    pub fn read<T>(&mut self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Deferred)?;
        let out = f(&Tx::new(&tx, None))?;
        tx.finish()?;
        Ok(out)
    }

    /// Runs every op of `batch` in ONE write transaction (group commit), as if each were inside
    /// its own savepoint: an op that fails is rolled back alone and the others still commit.
    /// Returns each op's result in order, plus the events the committed ops appended (id
    /// order), or an error when the transaction as a whole failed — at the commit, or by an
    /// op's error that rolled the whole transaction back (a full disk): then nothing of the
    /// batch is durable.
    ///
    /// A savepoint costs a copy of every page its op touches, and the ops of a batch touch the
    /// same pages (the events' last page, the tasks' and runs' indexes): they were a sixth of
    /// the instructions of a lifecycle's board work (callgrind on `bench replay`). Yet the
    /// board's transitions are refused by checks made before they write, and an op that wrote
    /// nothing has nothing to undo. So the batch is first applied with no savepoint, not even
    /// for the ops' [`Tx::nested`] steps; only if an op, or a nested step, fails after writing
    /// (a composite transition refused half-way, an I/O error that left the transaction open)
    /// is that attempt rolled back whole and the batch applied again with each op, and each
    /// nested step, in a savepoint — which is why an op may be called twice (see
    /// [`BatchOp`]). The supervisor's own
    /// transitions are refused by checks made before they write, so its batches are normally
    /// applied once (the lifecycle bench counts the exceptions).
    ///
    /// "Wrote nothing" is read from SQLite's count of rows changed by INSERT, UPDATE and
    /// DELETE, the only writes `Tx` makes (there are no triggers; DDL and pragmas, which
    /// that count misses, run only in migrations, outside any batch).
    pub fn write_batch<T>(&mut self, batch: Vec<BatchOp<'_, T>>) -> Result<Committed<T>> {
        if let Some(committed) = self.apply_batch(&batch, false)? {
            return Ok(committed);
        }
        Ok(self
            .apply_batch(&batch, true)?
            .expect("a batch applied op by op always runs to its end"))
    }

    /// One attempt at [`Board::write_batch`]. `op_by_op`: each op in a savepoint of its own.
    /// Without: every op straight in the transaction, and `None` (nothing kept) when one
    /// failed after writing — the batch must then be applied op by op.
    fn apply_batch<T>(
        &mut self,
        batch: &[BatchOp<'_, T>],
        op_by_op: bool,
    ) -> Result<Option<Committed<T>>> {
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let appended = RefCell::new(Vec::new());
        let txn = Tx {
            savepoint_free: !op_by_op,
            ..Tx::new(&tx, Some(&appended))
        };
        let mut results = Vec::with_capacity(batch.len());
        let lone = batch.len() == 1;
        for op in batch {
            if op_by_op {
                let out = txn.nested(op);
                if let Some(by) = txn.ended.get() {
                    // An error rolled back the whole transaction (SQLite does that for some,
                    // e.g. a full disk) — in this op's savepoint, or one nested in it: nothing
                    // of the batch stands, and no later op may run. The error names the cause
                    // (the op's own may be a follow-up, or none if it went on regardless).
                    drop(out);
                    return Err(by.error());
                }
                results.push(out);
                continue;
            }
            let before = tx.total_changes();
            let out = op(&txn);
            if txn.undo_needed.get() {
                // A `nested` step failed after writing, and nothing can undo it alone; what the
                // op did after it ran on top of those writes — even a rollback of the whole
                // transaction (a full disk) may be theirs, the pages they took. Only the
                // op-by-op attempt answers as the op's savepoints would (dropping the
                // transaction undoes this one).
                return Ok(None);
            }
            if lone && out.is_err() {
                // A lone op's failure is its caller's answer, whatever it rolled back with it
                // (dropping the transaction undoes what it wrote).
                return Ok(Some(Committed {
                    results: vec![out],
                    events: Vec::new(),
                    retried: false,
                }));
            }
            // Rolled back as a whole inside the op (a full disk), or by its error: nothing of
            // the batch stands, as when the ops run in savepoints — no second attempt.
            txn.check_not_ended()?;
            if tx.is_autocommit() {
                return Err(EndedBy(sqlite_code(&out)).error());
            }
            if out.is_err() && tx.total_changes() != before {
                // Dropping the transaction rolls back what every op wrote.
                return Ok(None);
            }
            results.push(out);
        }
        tx.commit()?;
        Ok(Some(Committed {
            results,
            events: appended.into_inner(),
            retried: op_by_op,
        }))
    }

    /// Runs `PRAGMA integrity_check` and returns its first line (`"ok"` when healthy).
    pub fn integrity_check(&self) -> Result<String> {
        Ok(self
            .conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))?)
    }

    /// Ends a transaction that a panic unwound out of, if one is still open: rusqlite rolls
    /// back on drop but ignores that rollback's own failure, and a connection left inside a
    /// transaction would refuse every later one. `Ok` once it is back in autocommit.
    pub fn abandon_transaction(&self) -> Result<()> {
        if !self.conn.is_autocommit() {
            self.conn.execute_batch("ROLLBACK")?;
        }
        Ok(())
    }

    /// Copies everything the write-ahead log holds into the database file and empties the
    /// log (`PRAGMA wal_checkpoint(TRUNCATE)`), so that `board.db` alone is the whole board —
    /// what a backup that copies only that file gets. SQLite does this itself when the last
    /// connection closes, but a read-only connection cannot, and the store's readers may
    /// outlive its writer. `Ok(false)`: a reader kept part of the log (still in use) and the
    /// file is not complete yet. Waits at most 250 ms for readers; the connection keeps that
    /// shorter wait after (it is meant for a writer about to close).
    pub fn checkpoint(&self) -> Result<bool> {
        // Not the board's 10 s busy wait: this runs as the supervisor stops, and a reader
        // in the middle of a read only means the file is completed at the next start.
        self.conn
            .busy_timeout(std::time::Duration::from_millis(250))?;
        let busy: i64 = self
            .conn
            .query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| r.get(0))?;
        Ok(busy == 0)
    }

    /// Runs a raw statement. For tests that must forge states no transition produces (a legacy
    /// row from before fingerprints existed, a corrupted value); never used by runwarden itself.
    #[doc(hidden)]
    pub fn execute_raw(&self, sql: &str, params: impl rusqlite::Params) -> Result<usize> {
        Ok(self.conn.execute(sql, params)?)
    }
}

/// The SQLite error code of `out`'s error, if it is one.
fn sqlite_code<T>(out: &Result<T>) -> Option<rusqlite::ffi::Error> {
    match out {
        Err(BoardError::Sqlite(rusqlite::Error::SqliteFailure(code, _))) => Some(*code),
        _ => None,
    }
}

/// One op of [`Board::write_batch`].
///
/// It may be called twice (see [`Board::write_batch`]), so its only effects must be on the
/// transaction it is given; being `Fn`, it cannot consume what it captured.
pub type BatchOp<'a, T> = Box<dyn Fn(&Tx<'_>) -> Result<T> + 'a>;

/// What [`Board::write_batch`] committed: each op's result, in order, and the events the
/// successful ops appended, in id order (what a subscriber must be told, without reading
/// them back).
#[derive(Debug)]
pub struct Committed<T> {
    pub results: Vec<Result<T>>,
    pub events: Vec<Event>,
    /// An op, or a [`Tx::nested`] step of one, failed after writing in the first attempt, so
    /// the batch was applied a second time, each op and step in a savepoint (for statistics:
    /// how often the cheap attempt is wasted).
    pub retried: bool,
}

/// An open transaction on the board. Every transition and query is a method of `Tx`.
pub struct Tx<'a> {
    conn: &'a Connection,
    /// Events appended in this transaction, when the caller wants them (group commit).
    appended: Option<&'a RefCell<Vec<Event>>>,
    /// An error inside a [`Tx::nested`] step rolled the whole transaction back: whatever else
    /// ran in it is rolled back too, whatever its callers make of that error.
    ended: std::cell::Cell<Option<EndedBy>>,
    /// The first attempt of a batch: [`Tx::nested`] takes no savepoint (see there).
    savepoint_free: bool,
    /// A step of [`Tx::nested`] failed after writing while `savepoint_free`: nothing can undo
    /// it alone, so this attempt must be abandoned and the batch applied op by op.
    undo_needed: std::cell::Cell<bool>,
}

/// What ended a transaction early: the SQLite error code, when it was one.
#[derive(Debug, Clone, Copy)]
struct EndedBy(Option<rusqlite::ffi::Error>);

impl EndedBy {
    fn error(self) -> BoardError {
        let code = self
            .0
            .unwrap_or_else(|| rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_ABORT));
        BoardError::Sqlite(rusqlite::Error::SqliteFailure(
            code,
            Some("the transaction was rolled back by an error inside it".into()),
        ))
    }
}

impl<'a> Tx<'a> {
    fn new(conn: &'a Connection, appended: Option<&'a RefCell<Vec<Event>>>) -> Self {
        Tx {
            conn,
            appended,
            ended: std::cell::Cell::new(None),
            savepoint_free: false,
            undo_needed: std::cell::Cell::new(false),
        }
    }

    /// `Err` once the transaction was rolled back early (see [`Tx::nested`]): its writer must
    /// roll back whatever ran after, not commit it.
    fn check_not_ended(&self) -> Result<()> {
        match self.ended.get() {
            Some(by) => Err(by.error()),
            None => Ok(()),
        }
    }

    /// After a [`Tx::nested`] step: if its error rolled back the whole transaction, savepoints
    /// included (SQLite does that on a full disk), records it in `ended`. A caller that goes on
    /// regardless (one refused claim in a pass is not the pass's failure) must not have its
    /// next statements commit one by one, outside any transaction: they run in a fresh one
    /// that the writer rolls back, seeing `ended`.
    fn note_if_rolled_back<T>(&self, out: &Result<T>) -> Result<()> {
        if self.ended.get().is_none() && self.conn.is_autocommit() {
            self.ended.set(Some(EndedBy(sqlite_code(out))));
            self.conn.execute_batch("BEGIN")?;
        }
        Ok(())
    }

    /// This attempt of a [`Board::write_batch`] is void (a [`Tx::nested`] step failed after
    /// writing with no savepoint to undo it): it will be rolled back and the batch applied
    /// again, op by op. What an op sees go wrong in it (to log, say) happens again then.
    pub fn attempt_void(&self) -> bool {
        self.undo_needed.get()
    }

    /// Runs `f` in a nested savepoint: if it fails, only its own writes are undone and the
    /// enclosing transaction goes on (e.g. one refused claim in a dispatch pass).
    ///
    /// In the first attempt of a [`Board::write_batch`] there is no savepoint (a savepoint
    /// copies every page its step then touches: the claim made on each worker's exit cost a
    /// tenth of a lifecycle's board work that way, callgrind on `bench replay`). A step that
    /// fails before writing (the board's transitions check first) has nothing to undo; one
    /// that fails after writing makes the whole attempt void, and the batch is applied again
    /// with every op, and every `nested` step in it, in a savepoint of its own.
    pub fn nested<T>(&self, f: impl FnOnce(&Tx<'_>) -> Result<T>) -> Result<T> {
        self.check_not_ended()?;
        if !self.savepoint_free {
            // Prepared once per connection: parsing "SAVEPOINT …" each time (once per op of
            // every batch, when each op had one) was a visible share of the writer's time.
            self.conn.prepare_cached("SAVEPOINT nested")?.execute([])?;
        }
        let before = self.conn.total_changes();
        let mark = self.appended.map(|a| a.borrow().len());
        // Events of an undone step are never published (dropped before the rollback itself,
        // should that fail).
        let forget_events = || {
            if let (Some(a), Some(mark)) = (self.appended, mark) {
                a.borrow_mut().truncate(mark);
            }
        };
        let out = f(self);
        self.note_if_rolled_back(&out)?;
        // Rolled back early, in `f` or in a step nested in it: a savepoint is gone with the
        // transaction (nothing to release or roll back to).
        if let Some(by) = self.ended.get() {
            forget_events();
            return Err(out.err().unwrap_or_else(|| by.error()));
        }
        if self.savepoint_free {
            if out.is_err() && self.conn.total_changes() != before {
                self.undo_needed.set(true);
            }
            return out;
        }
        match out {
            Ok(v) => {
                self.conn.prepare_cached("RELEASE nested")?.execute([])?;
                Ok(v)
            }
            Err(e) => {
                forget_events();
                self.conn
                    .prepare_cached("ROLLBACK TO nested")?
                    .execute([])?;
                self.conn.prepare_cached("RELEASE nested")?.execute([])?;
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A board restored from a backup written under the umask (0644), with a -wal left from
    /// it: both are the owner's alone once a supervisor opens them, and so is the -shm SQLite
    /// then makes. Read-only opens (the CLI's `logs`, say) change nothing.
    #[test]
    fn a_board_readable_by_others_is_made_the_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("board.db");
        drop(Board::open(&path).unwrap());
        let wal = dir.path().join("board.db-wal");
        std::fs::write(&wal, b"").unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        for p in [&path, &wal] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        drop(
            Board::open_with(
                &path,
                OpenOptions {
                    read_only: true,
                    ..OpenOptions::default()
                },
            )
            .unwrap(),
        );
        assert_eq!(mode(&path), 0o644, "a read-only open changes nothing");
        let board = Board::open(&path).unwrap();
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&wal), 0o600);
        assert_eq!(mode(&dir.path().join("board.db-shm")), 0o600);
        drop(board);
    }

    /// A title over the bound, or with a NUL (neither can be a worker's environment), is
    /// refused; a retry under the key of a task made before titles were bounded still finds it.
    #[test]
    fn titles_a_worker_could_not_be_given_are_refused_but_a_retry_finds_its_task() {
        let dir = tempfile::tempdir().unwrap();
        let mut board = Board::open(&dir.path().join("board.db")).unwrap();
        let long = "t".repeat(MAX_TITLE_BYTES + 1);
        for title in [long.as_str(), "a\0b"] {
            let err = board
                .write(|tx| tx.create_task(&NewTask::titled(title), 1))
                .expect_err("refused");
            assert!(err.to_string().contains("title"), "{err}");
        }
        let mut keyed = NewTask::titled("short");
        keyed.idempotency_key = Some("k".into());
        let made = board.write(|tx| tx.create_task(&keyed, 1)).unwrap();
        board
            .execute_raw(
                "UPDATE tasks SET title = ?1 WHERE id = ?2",
                (&long, made.id),
            )
            .unwrap();
        keyed.title = long.clone();
        let again = board.write(|tx| tx.create_task(&keyed, 2)).unwrap();
        assert_eq!((again.id, again.existed), (made.id, true));
    }

    /// A fresh board reached through a link (to a file not there yet) is narrowed as any
    /// fresh board: a chmod goes through the link.
    #[test]
    fn a_fresh_board_through_a_link_is_the_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("real.db");
        let link = dir.path().join("board.db");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        drop(Board::open(&link).unwrap());
        let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    /// A board that has room for only a few more pages.
    fn nearly_full() -> (tempfile::TempDir, Board) {
        with_room_for(3)
    }

    /// A board that has room for only `room` more pages.
    fn with_room_for(room: i64) -> (tempfile::TempDir, Board) {
        let dir = tempfile::tempdir().unwrap();
        let board = Board::open(&dir.path().join("board.db")).unwrap();
        let pages: i64 = board
            .conn
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .unwrap();
        let _: i64 = board
            .conn
            .query_row(
                &format!("PRAGMA max_page_count = {}", pages + room),
                [],
                |r| r.get(0),
            )
            .unwrap();
        (dir, board)
    }

    fn big_task() -> NewTask {
        let mut new = NewTask::titled("big");
        new.body = "x".repeat(1 << 20);
        new
    }

    fn titles(board: &mut Board) -> Vec<String> {
        board
            .read(|tx| tx.list_tasks(&Default::default()))
            .unwrap()
            .into_iter()
            .map(|t| t.title)
            .collect()
    }

    fn is_disk_full(e: &BoardError) -> bool {
        matches!(e, BoardError::Sqlite(rusqlite::Error::SqliteFailure(code, _))
            if code.code == rusqlite::ErrorCode::DiskFull)
    }

    #[test]
    fn a_full_disk_inside_a_swallowed_savepoint_leaves_nothing_of_the_transaction() {
        let (_dir, mut board) = nearly_full();
        // One op goes on after its nested write failed on the full disk (as a dispatch pass
        // does after one refused claim); another op follows in the same batch.
        let res = board.write_batch(vec![
            Box::new(|tx: &Tx<'_>| {
                let _ = tx.nested(|tx| tx.create_task(&big_task(), 1));
                tx.create_task(&NewTask::titled("after"), 1).map(|_| ())
            }) as BatchOp<'_, ()>,
            Box::new(|tx: &Tx<'_>| tx.create_task(&NewTask::titled("next op"), 1).map(|_| ())),
        ]);
        let err = res.expect_err("the batch was rolled back");
        assert!(is_disk_full(&err), "{err:?}");
        assert_eq!(titles(&mut board), Vec::<String>::new());

        // The same for a lone op and for a plain write.
        let res = board.write_batch(vec![Box::new(|tx: &Tx<'_>| {
            let _ = tx.nested(|tx| tx.create_task(&big_task(), 1));
            tx.create_task(&NewTask::titled("after"), 1).map(|_| ())
        }) as BatchOp<'_, ()>]);
        assert!(is_disk_full(&res.expect_err("rolled back")));
        let res = board.write(|tx| {
            let _ = tx.nested(|tx| tx.create_task(&big_task(), 1));
            tx.create_task(&NewTask::titled("after"), 1)
        });
        assert!(is_disk_full(&res.expect_err("rolled back")));
        assert_eq!(titles(&mut board), Vec::<String>::new());

        // An op that swallows the error of a plain statement (no savepoint of its own): the
        // next op never runs outside a transaction.
        let res = board.write_batch(vec![
            Box::new(|tx: &Tx<'_>| {
                let _ = tx.create_task(&big_task(), 1);
                Ok(())
            }) as BatchOp<'_, ()>,
            Box::new(|tx: &Tx<'_>| tx.create_task(&NewTask::titled("next op"), 1).map(|_| ())),
        ]);
        assert!(res.is_err(), "{:?}", res.map(|c| c.results.len()));
        assert_eq!(titles(&mut board), Vec::<String>::new());

        // Small writes still fit, and commit.
        board
            .write(|tx| tx.create_task(&NewTask::titled("fits"), 1))
            .unwrap();
        assert_eq!(titles(&mut board), ["fits"]);
    }

    #[test]
    fn pages_taken_by_a_failed_nested_step_do_not_fill_the_disk_for_the_rest_of_the_batch() {
        let (_dir, mut board) = with_room_for(40);
        let sized = |title: &str| {
            let mut new = NewTask::titled(title);
            new.body = "x".repeat(100 << 10);
            new
        };
        // Room for one such task, not two: the first step's task must be undone before the
        // second step runs, as a savepoint would.
        let op = move |tx: &Tx<'_>| {
            let _ = tx.nested(|tx| {
                tx.create_task(&sized("undone"), 1)?;
                Err::<(), _>(BoardError::Conflict("refused after writing".into()))
            });
            tx.nested(|tx| tx.create_task(&sized("kept"), 1))
                .map(|_| ())
        };
        let committed = board
            .write_batch(vec![
                Box::new(op) as BatchOp<'_, ()>,
                Box::new(|tx: &Tx<'_>| tx.create_task(&NewTask::titled("other"), 1).map(|_| ())),
            ])
            .expect("the batch commits");
        assert!(committed.retried);
        assert!(committed.results.iter().all(|r| r.is_ok()));
        let mut kept = titles(&mut board);
        kept.sort();
        assert_eq!(kept, ["kept", "other"]);
    }
}
