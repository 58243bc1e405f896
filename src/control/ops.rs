//! What each op does: one function per op, and one `match` to dispatch them.
//!
//! Writes go through `Store::with_tx` (replies come only after the commit); reads through
//! `Store::read` on the read-only connection. A worker's op on its own run is authorized with
//! `Tx::authorize_run` inside the same transaction as the transition, so a token can never be
//! checked against one state and applied to another.

use std::rc::Rc;

use futures::FutureExt;
use futures::future::LocalBoxFuture;
use serde::Serialize;

use super::conn::Session;
use super::follow;
use super::out::Out;
use super::protocol::{
    Block, CommentReply, CommentReq, Complete, Events, EventsReply, HeartbeatReply, LinkReply,
    LiveWorker, MAX_LOG_CHUNK, MAX_REPLY_TEXT_BYTES, PROTOCOL_VERSION, ReadLog, ReadLogReply,
    ReapReply, Reclaim, Request, RequestId, Response, ShutdownReply, StatusReply, TaskReply,
    TasksReply, code,
};
use super::server::{Role, Shared};
use crate::actors::reaper::SweepNow;
use crate::actors::spawn;
use crate::actors::store::StoreError;
use crate::board::{self, BoardError, Millis, Run, TaskId, TaskStatus, Tx};
use crate::process::{self, Liveness};

/// Events in a `show_task` reply unless the request says otherwise.
const DEFAULT_SHOW_EVENTS: u32 = 50;
/// Most events one `show_task` or `events` page returns.
const MAX_PAGE: u32 = 10_000;
/// Events in an `events` page unless the request says otherwise.
const DEFAULT_EVENTS_PAGE: u32 = 1000;

/// What a started request produces.
pub(super) enum Outcome {
    /// One response line.
    Line(Vec<u8>),
    /// A response line, then a task writing more lines (a followed `events`).
    Stream(Vec<u8>, StreamStart),
}

/// Starts a stream writing lines into the connection's writer queue.
pub(super) type StreamStart = Box<dyn FnOnce(Out) -> LocalBoxFuture<'static, ()>>;

/// A refusal on its way to becoming an error line.
#[derive(Debug, Clone)]
pub(super) struct OpError {
    pub code: &'static str,
    pub message: String,
}

impl OpError {
    fn bad_request(message: impl Into<String>) -> Self {
        OpError {
            code: code::BAD_REQUEST,
            message: message.into(),
        }
    }
}

impl From<StoreError> for OpError {
    fn from(e: StoreError) -> Self {
        OpError {
            code: e.code,
            message: e.message,
        }
    }
}

/// The response line for a finished request.
pub(super) fn respond<T: Serialize>(id: Option<RequestId>, result: Result<T, OpError>) -> Vec<u8> {
    let line = result.and_then(|v| {
        Response::ok_line(id.as_ref(), &v).map_err(|e| OpError {
            code: code::INTERNAL,
            message: format!("cannot encode the result: {e}"),
        })
    });
    line.unwrap_or_else(|e| Response::error(id, e.code, e.message).to_line())
}

/// The ops a worker-only peer (see [`Role::Worker`]) may send: reports on a run, each carrying
/// the run's token (checked with the transition), never forced.
fn a_workers_report(req: &Request) -> bool {
    match req {
        Request::Heartbeat(_) => true,
        Request::Complete(c) => c.run.is_some() && c.token.is_some() && !c.force,
        Request::Block(b) => b.run.is_some() && b.token.is_some() && !b.force,
        _ => false,
    }
}

fn ready(line: Vec<u8>) -> LocalBoxFuture<'static, Outcome> {
    std::future::ready(Outcome::Line(line)).boxed_local()
}

/// Starts request `req` (hello is handled by the connection itself).
pub(super) fn start(
    shared: &Rc<Shared>,
    session: &Session,
    id: RequestId,
    req: Request,
) -> LocalBoxFuture<'static, Outcome> {
    let id = Some(id);
    if session.peer.role == Role::Worker && !a_workers_report(&req) {
        return ready(respond::<()>(
            id,
            Err(OpError {
                code: code::UNAUTHORIZED,
                message: format!(
                    "uid {} runs workers: it may only report on its own run (heartbeat, complete, block with run and token)",
                    session.peer.uid
                ),
            }),
        ));
    }
    match req {
        Request::Hello(_) => ready(respond::<()>(
            id,
            Err(OpError::bad_request("hello is answered by the connection")),
        )),
        Request::AddTask(new) => {
            // Names first: the assignee check quotes the name.
            if let Err(message) = new.check_names().and_then(|()| {
                shared
                    .services
                    .config
                    .check_assignee(new.assignee.as_deref())
            }) {
                return ready(respond::<()>(id, Err(OpError::bad_request(message))));
            }
            write(shared, id, move |tx, now| tx.create_task(&new, now))
        }
        Request::ListTasks(filter) => read(shared, id, move |tx| {
            let (tasks, truncated) = tx.list_tasks_within(&filter, MAX_REPLY_TEXT_BYTES)?;
            Ok(TasksReply { tasks, truncated })
        }),
        Request::ShowTask(s) => read(shared, id, move |tx| {
            tx.task_detail(
                s.task,
                s.events.unwrap_or(DEFAULT_SHOW_EVENTS).min(MAX_PAGE),
                MAX_REPLY_TEXT_BYTES,
            )
        }),
        Request::Complete(c) => complete(shared, id, c),
        Request::Block(b) => block(shared, id, b),
        Request::Unblock(t) => write(shared, id, move |tx, now| {
            tx.unblock_task(t.task, now)?;
            task_reply(tx, t.task)
        }),
        Request::Archive(t) => write(shared, id, move |tx, now| {
            tx.archive_task(t.task, now)?;
            task_reply(tx, t.task)
        }),
        Request::Reclaim(r) => reclaim(shared, session, id, r),
        Request::Link(l) => write(shared, id, move |tx, now| {
            tx.link(l.parent, l.child, now)?;
            Ok(LinkReply {
                parent: l.parent,
                child: l.child,
            })
        }),
        Request::Comment(c) => comment(shared, session, id, c),
        Request::Heartbeat(h) => {
            let lease_ms = shared.services.config.leases.claim_ttl.as_millis() as i64;
            write(shared, id, move |tx, now| {
                tx.authorize_run(h.task, h.run, &h.token)?;
                tx.heartbeat(h.run, h.note.as_deref(), now, lease_ms)?;
                Ok(HeartbeatReply {
                    lease_expires_at: tx.get_run(h.run)?.lease_expires_at,
                })
            })
        }
        // A page of none would answer `more: true` without moving `last_id`: a pager would ask
        // again for ever. Refused with `follow` too, where no page is asked for, alike.
        Request::Events(e) if e.limit == Some(0) => ready(respond::<()>(
            id,
            Err(OpError::bad_request("events: limit must be at least 1")),
        )),
        Request::Events(e) if e.follow => follow::start(shared, id, e),
        Request::Events(e) => events_page(shared, id, e),
        Request::Status(_) => status(shared, id),
        Request::ReadLog(r) => read_log(shared, id, r),
        Request::ReapNow(_) => {
            let reaper = shared.services.reaper.clone();
            async move {
                let pending = reaper.send(SweepNow).await.map_err(|_| OpError {
                    code: code::UNAVAILABLE,
                    message: "the reaper is stopping".into(),
                });
                Outcome::Line(respond(id, pending.map(|pending| ReapReply { pending })))
            }
            .boxed_local()
        }
        Request::Shutdown(_) => {
            tracing::info!(uid = session.peer.uid, pid = ?session.peer.pid, "control: shutdown requested");
            shared.shutdown.notify_one();
            ready(respond(id, Ok(ShutdownReply { stopping: true })))
        }
    }
}

/// A write: `f` runs inside the store's transaction; the reply is sent after the commit.
fn write<T, F>(shared: &Rc<Shared>, id: Option<RequestId>, f: F) -> LocalBoxFuture<'static, Outcome>
where
    T: Serialize + Send + 'static,
    F: Fn(&Tx<'_>, Millis) -> board::Result<T> + Send + 'static,
{
    // The future owns a store handle; the op enters the writer's queue when the future is
    // first polled, i.e. in arrival order.
    let store = shared.services.store.clone();
    async move { Outcome::Line(respond(id, store.with_tx(f).await.map_err(OpError::from))) }
        .boxed_local()
}

/// A read on the read-only connection.
fn read<T, F>(shared: &Rc<Shared>, id: Option<RequestId>, f: F) -> LocalBoxFuture<'static, Outcome>
where
    T: Serialize + Send + 'static,
    F: FnOnce(&Tx<'_>) -> board::Result<T> + Send + 'static,
{
    let store = shared.services.store.clone();
    async move { Outcome::Line(respond(id, store.read(f).await.map_err(OpError::from))) }
        .boxed_local()
}

fn task_reply(tx: &Tx<'_>, task: TaskId) -> board::Result<TaskReply> {
    Ok(TaskReply {
        task: tx.get_task(task)?,
    })
}

/// Who may act on a task's run: its worker (run + token), or an operator (neither).
enum Caller {
    Worker { run: board::RunId, token: String },
    Operator { force: bool },
}

fn caller(
    run: Option<board::RunId>,
    token: Option<String>,
    force: bool,
) -> Result<Caller, OpError> {
    match (run, token) {
        // A worker's report is checked against its run, never forced: a caller that sends
        // both means one of them by mistake, and which one is not for the server to guess.
        (Some(_), Some(_)) if force => Err(OpError::bad_request(
            "field `force` is an operator's: a worker's own report (`run`, `token`) is never forced",
        )),
        (Some(run), Some(token)) => Ok(Caller::Worker { run, token }),
        (None, None) => Ok(Caller::Operator { force }),
        (Some(_), None) => Err(OpError::bad_request(
            "field `run` needs `token` (a worker's own run)",
        )),
        (None, Some(_)) => Err(OpError::bad_request(
            "field `token` needs `run` (a worker's own run)",
        )),
    }
}

impl Caller {
    /// Checks, inside the transition's transaction, that this actor may close the task's run.
    /// Returns the run the transition must expect (a worker's own).
    fn check(&self, tx: &Tx<'_>, task: TaskId) -> board::Result<Option<board::RunId>> {
        match self {
            Caller::Worker { run, token } => {
                tx.authorize_run(task, *run, token)?;
                Ok(Some(*run))
            }
            Caller::Operator { force: true } => Ok(None),
            Caller::Operator { force: false } => {
                ensure_worker_gone(tx, task)?;
                Ok(None)
            }
        }
    }
}

/// Refuses (conflict) while the task's current run may still have a live worker: an operator
/// must not close a run under a worker that is still working on it, unless forced.
fn ensure_worker_gone(tx: &Tx<'_>, task_id: TaskId) -> board::Result<()> {
    let task = tx.get_task(task_id)?;
    let (TaskStatus::Running, Some(run_id)) = (task.status, task.current_run_id) else {
        return Ok(());
    };
    let run = tx.get_run(run_id)?;
    let why = match worker_state(&run) {
        WorkerState::Gone => return Ok(()),
        WorkerState::Alive(pid) => format!("its worker (pid {pid}, run {run_id}) is alive"),
        WorkerState::Starting => format!("its worker (run {run_id}) is being started"),
        WorkerState::Unknown(reason) => {
            format!("cannot tell whether its worker (run {run_id}) is alive: {reason}")
        }
    };
    Err(BoardError::Conflict(format!(
        "task {task_id} is running and {why}; let the worker report, or use force (--force)"
    )))
}

enum WorkerState {
    Alive(i64),
    Starting,
    Gone,
    Unknown(String),
}

/// What the run's evidence says about its worker. Dead only with proof, like the reaper.
fn worker_state(run: &Run) -> WorkerState {
    match (run.worker_pid, run.fingerprint()) {
        (Some(pid), Some(fp)) => match i32::try_from(pid) {
            Ok(p) => match process::liveness(p, &fp) {
                Liveness::Alive => WorkerState::Alive(pid),
                Liveness::Dead(_) => WorkerState::Gone,
                Liveness::Unknown(reason) => WorkerState::Unknown(reason),
            },
            Err(_) => WorkerState::Unknown(format!("recorded pid {pid} is out of range")),
        },
        (Some(_), None) => WorkerState::Unknown("no spawn fingerprint was recorded".into()),
        // An open run with no pid yet: its spawn is under way (a run a previous incarnation
        // never spawned looks the same until the dispatcher takes it over; refusing it is safe).
        (None, _) if run.spawned_pid.is_none() => WorkerState::Starting,
        // The worker exited and its evidence was cleared.
        (None, _) => WorkerState::Gone,
    }
}

fn complete(
    shared: &Rc<Shared>,
    id: Option<RequestId>,
    c: Complete,
) -> LocalBoxFuture<'static, Outcome> {
    let who = match caller(c.run, c.token, c.force) {
        Ok(who) => who,
        Err(e) => return ready(respond::<()>(id, Err(e))),
    };
    write(shared, id, move |tx, now| {
        let expected = who.check(tx, c.task)?;
        tx.complete_task(c.task, expected, c.result.as_deref(), now)?;
        task_reply(tx, c.task)
    })
}

fn block(shared: &Rc<Shared>, id: Option<RequestId>, b: Block) -> LocalBoxFuture<'static, Outcome> {
    if b.reason.trim().is_empty() {
        return ready(respond::<()>(
            id,
            Err(OpError::bad_request("field `reason` must not be empty")),
        ));
    }
    let who = match caller(b.run, b.token, b.force) {
        Ok(who) => who,
        Err(e) => return ready(respond::<()>(id, Err(e))),
    };
    write(shared, id, move |tx, now| {
        let expected = who.check(tx, b.task)?;
        tx.block_task(b.task, expected, &b.reason, now)?;
        task_reply(tx, b.task)
    })
}

fn reclaim(
    shared: &Rc<Shared>,
    session: &Session,
    id: Option<RequestId>,
    r: Reclaim,
) -> LocalBoxFuture<'static, Outcome> {
    let reason = r
        .reason
        .unwrap_or_else(|| format!("reclaimed by an operator (uid {})", session.peer.uid));
    write(shared, id, move |tx, now| {
        tx.reclaim_task(r.task, &reason, now)?;
        task_reply(tx, r.task)
    })
}

fn comment(
    shared: &Rc<Shared>,
    session: &Session,
    id: Option<RequestId>,
    c: CommentReq,
) -> LocalBoxFuture<'static, Outcome> {
    let add = move |author: String| {
        move |tx: &Tx<'_>, now| {
            Ok(CommentReply {
                comment_id: tx.comment(c.task, &author, &c.body, now)?,
            })
        }
    };
    if let Some(author) = c.author {
        return write(shared, id, add(author));
    }
    // The default author is the peer's user name. getpwuid_r may ask NSS (LDAP, sssd) and
    // block for seconds, and this thread serves every connection: look it up on a blocking
    // thread, once per connection. The connection starts nothing else until this comment is
    // answered (`conn::waits_for_user_name`), so it still commits in arrival order.
    let names = session.user_name.clone();
    let uid = session.peer.uid;
    let shared = shared.clone();
    async move {
        let author = names
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || user_name(uid))
                    .await
                    .unwrap_or_else(|_| format!("uid {uid}"))
            })
            .await
            .clone();
        write(&shared, id, add(author)).await
    }
    .boxed_local()
}

/// The peer's user name, or `uid N` when it has none. Blocking (NSS).
fn user_name(uid: u32) -> String {
    match nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(uid)) {
        Ok(Some(user)) => user.name,
        _ => format!("uid {uid}"),
    }
}

fn events_page(
    shared: &Rc<Shared>,
    id: Option<RequestId>,
    e: Events,
) -> LocalBoxFuture<'static, Outcome> {
    let limit = e.limit.unwrap_or(DEFAULT_EVENTS_PAGE).min(MAX_PAGE);
    read(shared, id, move |tx| {
        if let Some(task) = e.task {
            tx.task_status(task)?; // not_found for a task that does not exist
        }
        // One more than the page: `more` says there is a next page, not that this one is full.
        let (mut events, cut) =
            tx.events_since_within(e.task, e.since, limit + 1, MAX_REPLY_TEXT_BYTES)?;
        let over = events.len() > limit as usize;
        events.truncate(limit as usize);
        Ok(EventsReply {
            last_id: events.last().map_or(e.since, |ev| ev.id),
            more: cut || over,
            events,
        })
    })
}

/// A piece of a task's log, read off the actor thread: what `runwarden logs` asks for when the
/// operator may not read the file (the logs directory is the supervisor's alone).
fn read_log(
    shared: &Rc<Shared>,
    id: Option<RequestId>,
    r: ReadLog,
) -> LocalBoxFuture<'static, Outcome> {
    // An empty piece would look like the log's end (`next == offset`).
    if r.max_bytes == Some(0) {
        return ready(respond::<()>(
            id,
            Err(OpError::bad_request(
                "read_log: max_bytes must be at least 1",
            )),
        ));
    }
    let path = shared
        .services
        .config
        .logs_dir()
        .join(format!("{}.log", r.task));
    let (offset, max) = (
        r.offset.unwrap_or(0),
        r.max_bytes.unwrap_or(MAX_LOG_CHUNK).min(MAX_LOG_CHUNK),
    );
    let backup = r.backup;
    async move {
        let read = actix_rt::task::spawn_blocking(move || {
            let piece = if backup {
                read_log_piece(&spawn::backup_path(&path), &path, offset, max)
            } else {
                read_log_piece(&path, &path, offset, max)
            };
            piece.map(|p| (p, backup.then(|| spawn::backup_start(&path)).flatten()))
        })
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
        let result = match read {
            Ok((Some((bytes, size, rotation)), start)) => Ok(ReadLogReply {
                rotation,
                backup_start: start.as_ref().map(|s| s.offset),
                replaces: start.and_then(|s| s.replaces),
                ..log_piece(offset, &bytes, size)
            }),
            Ok((None, _)) => Err(OpError {
                code: code::NOT_FOUND,
                message: if backup {
                    format!("task {} has no log backup", r.task)
                } else {
                    format!("task {} has no log", r.task)
                },
            }),
            Err(e) => Err(OpError {
                code: code::INTERNAL,
                message: format!("cannot read the log of task {}: {e}", r.task),
            }),
        };
        Outcome::Line(respond(id, result))
    }
    .boxed_local()
}

/// A piece of a log: its bytes, the log's size, and the rotation it was read in.
type Piece = (Vec<u8>, u64, Option<String>);

/// [`spawn::read_log`] of `file` (the log at `log`, or its backup) with the rotation the bytes
/// belong to, read between rotations: again (a millisecond later) when one was under way or
/// completed meanwhile. A few times at most: a backup left in the making by a rotation cut
/// short stays until the next rotation.
fn read_log_piece(
    file: &std::path::Path,
    log: &std::path::Path,
    offset: u64,
    max: u64,
) -> std::io::Result<Option<Piece>> {
    let mut attempts = 0;
    loop {
        let before = spawn::log_generation(log);
        let read = spawn::read_log(file, offset, max)?;
        let rotating = spawn::rotation_path(log).exists();
        let after = spawn::log_generation(log);
        attempts += 1;
        if (before == after && !rotating) || attempts == 3 {
            return Ok(read.map(|(bytes, size)| (bytes, size, after)));
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// `bytes` (read at `offset`) as text: a character cut by the end of the piece is left for the
/// next one (unless it is all there is), anything else invalid is replaced.
fn log_piece(offset: u64, bytes: &[u8], size: u64) -> ReadLogReply {
    let at_end = offset + bytes.len() as u64 >= size;
    let whole = complete_prefix(bytes, at_end);
    ReadLogReply {
        offset,
        next: offset + whole as u64,
        size,
        data: String::from_utf8_lossy(&bytes[..whole]).into_owned(),
        rotation: None,
        backup_start: None,
        replaces: None,
    }
}

/// How much of `bytes` ends on a character boundary: a multi-byte sequence begun in the last
/// three bytes and not finished is held back — whatever invalid bytes come before it. When it
/// is all there is, it is held back only `at_end` of the log (the writer has not finished it
/// yet: nothing is given, the client asks again later); a piece cut short by `max_bytes` gives
/// it, replaced, so a reader always gets on.
fn complete_prefix(bytes: &[u8], at_end: bool) -> usize {
    let n = bytes.len();
    for back in 1..=n.min(3) {
        let b = bytes[n - back];
        if b & 0xC0 == 0x80 {
            continue; // a continuation byte: its lead is further back
        }
        let len = match b {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        return match (len > back, back < n) {
            (false, _) => n,
            (true, true) => n - back,
            (true, false) if at_end => 0,
            (true, false) => n,
        };
    }
    n
}

#[cfg(test)]
#[test]
fn a_log_piece_never_cuts_a_character() {
    let text = "aé".as_bytes(); // 'é' is two bytes
    let cut = log_piece(10, &text[..2], 3);
    assert_eq!((cut.data.as_str(), cut.next), ("a", 11));
    let whole = log_piece(10, text, 3);
    assert_eq!((whole.data.as_str(), whole.next), ("aé", 13));
    let invalid = log_piece(0, b"a\xffb", 3);
    assert_eq!((invalid.data.as_str(), invalid.next), ("a\u{fffd}b", 3));
    // A piece that is nothing but the start of a character: held back at the log's end (its
    // writer is not done with it), given (replaced) when the piece was cut short.
    let lead = log_piece(0, &"é".as_bytes()[..1], 1);
    assert_eq!((lead.data.as_str(), lead.next), ("", 0));
    let cut_short = log_piece(0, &"é".as_bytes()[..1], 2);
    assert_eq!((cut_short.data.as_str(), cut_short.next), ("\u{fffd}", 1));
    // Followed at the end while it is written: "ab" and half a character, then the rest.
    let first = log_piece(0, &"ab😀".as_bytes()[..4], 4);
    assert_eq!((first.data.as_str(), first.next), ("ab", 2));
    let waiting = log_piece(2, &"😀".as_bytes()[..2], 4);
    assert_eq!(waiting.next, 2);
    let done = log_piece(2, "😀".as_bytes(), 6);
    assert_eq!((done.data.as_str(), done.next), ("😀", 6));
    // An invalid byte earlier in the piece does not stop the cut character being held back.
    let mixed = log_piece(0, b"\xffa\xc3", 3);
    assert_eq!((mixed.data.as_str(), mixed.next), ("\u{fffd}a", 2));
    let four = "a😀".as_bytes(); // a four-byte character
    assert_eq!(log_piece(0, &four[..4], 5).next, 1);
    assert_eq!(log_piece(0, four, 5).next, 5);
    assert_eq!(log_piece(1, &four[1..4], 4).next, 1, "held at the end");
    assert_eq!(
        log_piece(1, &four[1..4], 5).next,
        4,
        "cut short: given, replaced"
    );
}

fn status(shared: &Rc<Shared>, id: Option<RequestId>) -> LocalBoxFuture<'static, Outcome> {
    let services = shared.services.clone();
    let socket = shared.socket.clone();
    async move {
        let live = services.live_workers().await;
        let counts = services
            .store
            .read(|tx| {
                Ok((
                    tx.status_counts()?,
                    tx.last_event_id()?,
                    tx.waiting_by_assignee()?,
                ))
            })
            .await
            .map_err(OpError::from);
        let result = counts.map(|(counts, last_event_id, waiting)| {
            let uptime = services.started_at.elapsed();
            StatusReply {
                pid: std::process::id(),
                version: env!("CARGO_PKG_VERSION").to_string(),
                protocol: PROTOCOL_VERSION.to_string(),
                started_at: services.started_at_ms,
                uptime_ms: uptime.as_millis() as u64,
                data_dir: services.config.supervisor.data_dir.clone(),
                logs_dir: services.config.logs_dir(),
                socket,
                live_workers: live
                    .into_iter()
                    .map(|(run_id, task_id, pid)| LiveWorker {
                        run_id,
                        task_id,
                        pid,
                    })
                    .collect(),
                counts,
                unconfigured_assignees: services.config.unconfigured(waiting),
                last_event_id,
            }
        });
        Outcome::Line(respond(id, result))
    }
    .boxed_local()
}
