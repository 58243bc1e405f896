//! A blocking client for the control socket, over a std `UnixStream`: what the CLI, the
//! examples and the tests use.
//!
//! ```no_run
//! use runwarden::board::NewTask;
//! use runwarden::control::client::Client;
//!
//! let mut client = Client::connect("/path/to/control.sock")?;
//! client.hello()?;
//! let created = client.add_task(&NewTask::titled("write the report").for_assignee("coder"))?;
//! for event in client.follow_events(0, Some(created.id))? {
//!     println!("{}", event?.kind);
//! }
//! # Ok::<(), runwarden::control::client::ClientError>(())
//! ```
//!
//! Each typed method sends one request and waits for its reply. For pipelining, use
//! [`Client::send`] (buffered; nothing is flushed until [`Client::flush`] or a receive) and
//! [`Client::recv`]; keep a bounded number in flight so neither side's buffers fill up.

use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;

use super::protocol::{
    Block, CommentReply, CommentReq, Complete, Empty, ErrorBody, Events, EventsReply, FollowReply,
    Heartbeat, HeartbeatReply, Hello, HelloReply, Link, LinkReply, PROTOCOL_VERSION, ReadLog,
    ReadLogReply, ReapReply, Reclaim, Request, RequestId, Response, ShowTask, ShutdownReply,
    StatusReply, TaskRef, TaskReply, TasksReply,
};
use crate::board::{Created, Event, EventId, NewTask, Task, TaskDetail, TaskFilter, TaskId};

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing answers on the socket path (no file, or a stale socket).
    #[error("no supervisor is listening on {path} ({})", not_running_reason(.path, .source))]
    NotRunning { path: PathBuf, source: io::Error },
    /// The socket exists but this user may not open it (the file-system layer refused).
    #[error(
        "permission denied connecting to {path}; the control socket is only for its owner, root and [control] allowed_uids"
    )]
    PermissionDenied { path: PathBuf },
    /// The supervisor answered with a refusal.
    #[error("{message} ({code})")]
    Server { code: String, message: String },
    /// The supervisor closed the connection (it is stopping, or refused the connection).
    #[error("the supervisor closed the connection")]
    Closed,
    /// No answer within the read timeout.
    #[error("timed out waiting for the supervisor")]
    Timeout,
    /// The supervisor sent something this client does not understand.
    #[error("unexpected response from the supervisor: {0}")]
    Protocol(String),
    /// Reading or writing the socket failed.
    #[error("control socket I/O failed: {0}")]
    Io(io::Error),
}

fn not_running_reason(path: &std::path::Path, e: &io::Error) -> String {
    use std::os::unix::fs::FileTypeExt;
    match e.kind() {
        io::ErrorKind::NotFound => "no socket file there; is `runwarden serve` running?".into(),
        // The kernel refuses a connection to a file that is not a socket the same way.
        io::ErrorKind::ConnectionRefused
            if std::fs::metadata(path).is_ok_and(|m| !m.file_type().is_socket()) =>
        {
            "it is not a socket; check --socket or [supervisor] socket".into()
        }
        io::ErrorKind::ConnectionRefused => {
            "the socket file is stale: nothing accepts on it".into()
        }
        _ => e.to_string(),
    }
}

impl ClientError {
    /// The server's error code, for a [`ClientError::Server`].
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Server { code, .. } => Some(code),
            _ => None,
        }
    }

    fn io(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout,
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof => ClientError::Closed,
            _ => ClientError::Io(e),
        }
    }
}

impl From<ErrorBody> for ClientError {
    fn from(e: ErrorBody) -> Self {
        ClientError::Server {
            code: e.code,
            message: e.message,
        }
    }
}

/// A connection to a supervisor's control socket.
pub struct Client {
    path: PathBuf,
    reader: BufReader<UnixStream>,
    writer: BufWriter<UnixStream>,
    next_id: u64,
    /// The line being received; kept across a timeout so a half-read line is not lost.
    line: Vec<u8>,
}

impl Client {
    /// Connects to the socket at `path`. Says plainly when nothing is listening there.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client, ClientError> {
        let path = path.as_ref().to_path_buf();
        let stream = match UnixStream::connect(&path) {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                return Err(ClientError::PermissionDenied { path });
            }
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                ) =>
            {
                return Err(ClientError::NotRunning { path, source: e });
            }
            Err(e) => return Err(ClientError::Io(e)),
        };
        let writer = stream.try_clone().map_err(ClientError::Io)?;
        Ok(Client {
            path,
            reader: BufReader::with_capacity(64 * 1024, stream),
            writer: BufWriter::with_capacity(64 * 1024, writer),
            next_id: 1,
            line: Vec::new(),
        })
    }

    /// The socket path this client is connected to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sets how long a receive may wait (None: forever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.reader
            .get_ref()
            .set_read_timeout(timeout)
            .map_err(ClientError::Io)
    }

    /// Sets how long a send may wait for room in the socket (None: forever): a supervisor
    /// that stopped reading leaves a large request blocked otherwise. A send that times out
    /// is [`ClientError::Timeout`]; what it wrote of the request may have been sent.
    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.writer
            .get_ref()
            .set_write_timeout(timeout)
            .map_err(ClientError::Io)
    }

    /// Queues a request (buffered) and returns the id it was given.
    pub fn send(&mut self, req: &Request) -> Result<RequestId, ClientError> {
        let id = RequestId::Num(self.next_id);
        self.next_id += 1;
        // `{"id":N,` + the request's own object without its opening brace: no intermediate
        // JSON value, so a pipelining client spends its time waiting, not encoding.
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let rest = body.strip_prefix(b"{").ok_or_else(|| {
            ClientError::Protocol("a request must encode as a JSON object".into())
        })?;
        write!(self.writer, "{{\"id\":{},", self.next_id - 1).map_err(ClientError::io)?;
        self.writer.write_all(rest).map_err(ClientError::io)?;
        self.writer.write_all(b"\n").map_err(ClientError::io)?;
        Ok(id)
    }

    /// Sends a raw line (which should end with a newline) as is: for tests and debugging.
    pub fn send_raw(&mut self, line: &[u8]) -> Result<(), ClientError> {
        self.writer.write_all(line).map_err(ClientError::io)?;
        self.flush()
    }

    /// Flushes queued requests to the socket.
    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.writer.flush().map_err(ClientError::io)
    }

    /// Receives the next response line (flushing queued requests first).
    pub fn recv(&mut self) -> Result<Response, ClientError> {
        if let Err(e) = self.flush() {
            // A server that refused the connection (unauthorized, too many connections) has
            // already written its reason and closed: our write fails, but the reason is
            // still waiting to be read, and it says more than "closed".
            if !matches!(e, ClientError::Closed) {
                return Err(e);
            }
        }
        self.reader
            .read_until(b'\n', &mut self.line)
            .map_err(ClientError::io)?;
        if self.line.last() != Some(&b'\n') {
            // End of stream (possibly after a partial line).
            return Err(ClientError::Closed);
        }
        let parsed = serde_json::from_slice(&self.line).map_err(|e| {
            ClientError::Protocol(format!(
                "{e}: {}",
                String::from_utf8_lossy(&self.line).trim_end()
            ))
        });
        self.line.clear();
        parsed
    }

    /// Sends `req`, waits for its reply, and decodes the result as `T`.
    pub fn call<T: DeserializeOwned>(&mut self, req: &Request) -> Result<T, ClientError> {
        let id = self.send(req)?;
        self.reply_to(&id, req.op())
    }

    /// Waits for the reply to request `id` (an `op`) and decodes its result as `T`.
    fn reply_to<T: DeserializeOwned>(
        &mut self,
        id: &RequestId,
        op: &str,
    ) -> Result<T, ClientError> {
        loop {
            match self.recv()? {
                Response::Ok {
                    id: Some(got),
                    result,
                } if got == *id => {
                    return serde_json::from_value(result)
                        .map_err(|e| ClientError::Protocol(format!("{op}: {e}")));
                }
                // A refusal without an id (too large, idle, unauthorized…) is about this connection.
                Response::Err { id: got, error } if got.as_ref().is_none_or(|g| g == id) => {
                    return Err(error.into());
                }
                // Lines of another request (a stream this caller abandoned) are skipped.
                _ => continue,
            }
        }
    }

    /// Opens the session; must be the first request.
    pub fn hello(&mut self) -> Result<HelloReply, ClientError> {
        self.call(&Request::Hello(Hello {
            version: PROTOCOL_VERSION.into(),
            client: Some(format!("runwarden-client/{}", env!("CARGO_PKG_VERSION"))),
        }))
    }

    /// Adds a task.
    pub fn add_task(&mut self, new: &NewTask) -> Result<Created, ClientError> {
        self.call(&Request::AddTask(new.clone()))
    }

    /// Tasks matching `filter`, newest first (as many as fit in one reply: see
    /// [`Client::list_tasks_reply`] to know whether some were left out).
    pub fn list_tasks(&mut self, filter: &TaskFilter) -> Result<Vec<Task>, ClientError> {
        Ok(self.list_tasks_reply(filter)?.tasks)
    }

    /// Tasks matching `filter`, newest first, and whether more matched than one reply holds.
    pub fn list_tasks_reply(&mut self, filter: &TaskFilter) -> Result<TasksReply, ClientError> {
        self.call::<TasksReply>(&Request::ListTasks(filter.clone()))
    }

    /// A task with its links, runs, recent events (`events`, default 50) and comments.
    pub fn show_task(
        &mut self,
        task: TaskId,
        events: Option<u32>,
    ) -> Result<TaskDetail, ClientError> {
        self.call(&Request::ShowTask(ShowTask { task, events }))
    }

    /// Marks a task done: as its worker (`run` + `token` set) or as an operator.
    pub fn complete(&mut self, req: Complete) -> Result<Task, ClientError> {
        Ok(self.call::<TaskReply>(&Request::Complete(req))?.task)
    }

    /// Blocks a task: as its worker (`run` + `token` set) or as an operator.
    pub fn block(&mut self, req: Block) -> Result<Task, ClientError> {
        Ok(self.call::<TaskReply>(&Request::Block(req))?.task)
    }

    /// Returns a blocked task to ready (or todo).
    pub fn unblock(&mut self, task: TaskId) -> Result<Task, ClientError> {
        Ok(self
            .call::<TaskReply>(&Request::Unblock(TaskRef { task }))?
            .task)
    }

    /// Archives a task.
    pub fn archive(&mut self, task: TaskId) -> Result<Task, ClientError> {
        Ok(self
            .call::<TaskReply>(&Request::Archive(TaskRef { task }))?
            .task)
    }

    /// Releases a running task back to ready; its worker is ended.
    pub fn reclaim(&mut self, task: TaskId, reason: Option<String>) -> Result<Task, ClientError> {
        Ok(self
            .call::<TaskReply>(&Request::Reclaim(Reclaim { task, reason }))?
            .task)
    }

    /// Makes `child` wait for `parent`.
    pub fn link(&mut self, parent: TaskId, child: TaskId) -> Result<LinkReply, ClientError> {
        self.call(&Request::Link(Link { parent, child }))
    }

    /// Comments on a task; returns the comment's id.
    pub fn comment(
        &mut self,
        task: TaskId,
        body: &str,
        author: Option<String>,
    ) -> Result<i64, ClientError> {
        let req = Request::Comment(CommentReq {
            task,
            body: body.into(),
            author,
        });
        Ok(self.call::<CommentReply>(&req)?.comment_id)
    }

    /// A worker's heartbeat on its own run.
    pub fn heartbeat(&mut self, req: Heartbeat) -> Result<HeartbeatReply, ClientError> {
        self.call(&Request::Heartbeat(req))
    }

    /// One page of events after `since` (at most `limit`, default 1000).
    pub fn events_page(
        &mut self,
        since: EventId,
        task: Option<TaskId>,
        limit: Option<u32>,
    ) -> Result<EventsReply, ClientError> {
        self.call(&Request::Events(Events {
            since,
            task,
            limit,
            follow: false,
        }))
    }

    /// Every event after `since` (optionally of one task), reading page after page.
    pub fn events(
        &mut self,
        since: EventId,
        task: Option<TaskId>,
    ) -> Result<Vec<Event>, ClientError> {
        let mut all = Vec::new();
        let mut since = since;
        loop {
            let page = self.events_page(since, task, Some(10_000))?;
            since = page.last_id;
            all.extend(page.events);
            if !page.more {
                return Ok(all);
            }
        }
    }

    /// Follows events after `since` (optionally of one task): the backlog, then each new event
    /// as it commits, in id order. The connection is taken over by the stream.
    pub fn follow_events(
        &mut self,
        since: EventId,
        task: Option<TaskId>,
    ) -> Result<EventStream<'_>, ClientError> {
        let req = Request::Events(Events {
            since,
            task,
            limit: None,
            follow: true,
        });
        let id = self.send(&req)?;
        self.reply_to::<FollowReply>(&id, req.op())?;
        Ok(EventStream {
            client: self,
            id,
            done: false,
        })
    }

    /// The supervisor's state.
    pub fn status(&mut self) -> Result<StatusReply, ClientError> {
        self.call(&Request::Status(Empty {}))
    }

    /// A piece of task `task`'s log (see [`ReadLog`]).
    pub fn read_log(
        &mut self,
        task: TaskId,
        offset: u64,
        max_bytes: Option<u64>,
    ) -> Result<ReadLogReply, ClientError> {
        self.read_log_of(task, offset, max_bytes, false)
    }

    /// [`Client::read_log`] of the task's log backup (`<log>.1`), with where it starts.
    pub fn read_log_backup(
        &mut self,
        task: TaskId,
        offset: u64,
        max_bytes: Option<u64>,
    ) -> Result<ReadLogReply, ClientError> {
        self.read_log_of(task, offset, max_bytes, true)
    }

    fn read_log_of(
        &mut self,
        task: TaskId,
        offset: u64,
        max_bytes: Option<u64>,
        backup: bool,
    ) -> Result<ReadLogReply, ClientError> {
        self.call(&Request::ReadLog(ReadLog {
            task,
            offset: Some(offset),
            max_bytes,
            backup,
        }))
    }

    /// Runs the terminal-reaper sweep now.
    pub fn reap_now(&mut self) -> Result<ReapReply, ClientError> {
        self.call(&Request::ReapNow(Empty {}))
    }

    /// Asks the supervisor to stop gracefully.
    pub fn shutdown(&mut self) -> Result<ShutdownReply, ClientError> {
        self.call(&Request::Shutdown(Empty {}))
    }
}

/// The events of a followed `events` request, as they come. Ends (after yielding the error)
/// when the supervisor refuses or closes the stream.
pub struct EventStream<'a> {
    client: &'a mut Client,
    id: RequestId,
    done: bool,
}

impl EventStream<'_> {
    /// Sets how long `next` may wait for an event (None: forever); a timeout yields
    /// [`ClientError::Timeout`] and the stream can be read again afterwards.
    pub fn set_timeout(&self, timeout: Option<Duration>) -> Result<(), ClientError> {
        self.client.set_read_timeout(timeout)
    }
}

impl Iterator for EventStream<'_> {
    type Item = Result<Event, ClientError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        loop {
            match self.client.recv() {
                Ok(Response::Event {
                    id: Some(got),
                    event,
                }) if got == self.id => return Some(Ok(event)),
                Ok(Response::Err { id: got, error })
                    if got.as_ref().is_none_or(|g| *g == self.id) =>
                {
                    self.done = true;
                    return Some(Err(error.into()));
                }
                Ok(_) => continue,
                Err(ClientError::Timeout) => return Some(Err(ClientError::Timeout)),
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}
