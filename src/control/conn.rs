//! One control connection: read request lines, run them, write response lines.
//!
//! Three parts run concurrently on the supervisor's thread:
//!
//! - the **reader loop** (this function) reads a line, parses it and starts its request as a
//!   future in a [`FuturesOrdered`] window, without waiting for earlier replies;
//! - the **window** yields the replies in request order; each goes to the writer;
//! - the **writer task** ([`super::out`]) writes queued lines, several per write call.
//!
//! Writes (`add_task`, `complete`, …) pipeline: each is submitted to the store the moment it is
//! first polled, in arrival order, so a burst of them lands in one group commit. Every other op
//! (reads, `status`, `events`, `shutdown`) waits until everything before it on the connection
//! has been answered, so it sees their effects. `events --follow` turns into a stream task that
//! writes event lines through the same writer.
//!
//! Memory per connection is bounded: at most [`WINDOW`] requests in flight, of which at most
//! [`TASK_REPLY_WINDOW`] answer with a whole task, and no new request is started while
//! [`MAX_QUEUED_BYTES`](super::out::MAX_QUEUED_BYTES) of replies wait for a client that reads
//! too slowly. (A reply exists, and takes memory, from the moment its commit answers, whether
//! or not the client reads: a few-byte `block` whose reply carries a task with a 1 MiB body
//! must not be admitted a thousand at a time.)

use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::LocalBoxFuture;
use futures::stream::{FuturesOrdered, FuturesUnordered};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedReadHalf;
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::ops::{self, Outcome};
use super::out::Out;
use super::protocol::{
    self, HelloReply, PROTOCOL_MAJOR, PROTOCOL_VERSION, Request, RequestId, Response, code,
};
use super::server::{Peer, Shared};

/// Requests of one connection in flight at once; reading pauses while the window is full.
const WINDOW: usize = 1024;
/// Of those, requests answered with a whole task (`complete`, `block`, `unblock`, `archive`,
/// `reclaim`): a task's texts may be megabytes, and its reply exists from its commit on.
const TASK_REPLY_WINDOW: usize = 8;
/// Followed `events` streams open at once on one connection: each reads the board through the
/// shared read pool while it catches up, so one client must not start arbitrarily many.
const MAX_STREAMS: usize = 4;
/// Read buffer size.
const READ_BUF: usize = 64 * 1024;
/// How long the last lines (a refusal, the final replies) may take to write on close.
const CLOSE_DRAIN: Duration = Duration::from_secs(2);
/// After a refusal that closes the connection while the client may still be sending (a line
/// over the limit, an idle timeout), how long, and how much, of its input is read and thrown
/// away before the close: a socket closed with unread input makes the client's next read fail
/// with "connection reset" (after the refusal line, but a client reading to the end loses it
/// as well when its read-all gives up on the error).
const REFUSAL_DRAIN: Duration = Duration::from_secs(1);
const REFUSAL_DRAIN_BYTES: usize = 64 * 1024 * 1024;
/// A client silent this long (one that was idle, say) has nothing more on its way: the drain
/// stops, and its slot is freed.
const REFUSAL_DRAIN_GAP: Duration = Duration::from_millis(100);
/// How long a new connection has to say hello (at most `idle_timeout`).
pub const HELLO_WAIT: Duration = Duration::from_secs(10);
/// How often a connection whose client has shut down its sending side, but still has streams
/// open, checks whether the client has closed the socket altogether.
const HANGUP_PROBE: Duration = Duration::from_secs(1);

/// Per-connection state the ops may read.
pub(super) struct Session {
    pub peer: Peer,
    /// The peer's user name (the default `comment` author), looked up at most once, on a
    /// blocking thread (see `ops::comment`).
    pub user_name: Rc<OnceCell<String>>,
    hello: bool,
}

enum LineError {
    TooLarge,
    Io,
}

/// Serves one accepted, authorized connection until it closes. `_slot` is its place among
/// `max_connections`; dropping it (on return) frees it.
pub(super) async fn serve(
    stream: UnixStream,
    shared: Rc<Shared>,
    peer: Peer,
    _slot: super::server::Slot,
) {
    let (rd, wr) = stream.into_split();
    let (out, mut writer) = Out::start(wr, shared.idle_timeout);
    let mut reader = BufReader::with_capacity(READ_BUF, rd);
    let mut partial = Vec::new();
    let mut session = Session {
        peer,
        user_name: Rc::new(OnceCell::new()),
        hello: false,
    };
    let mut window: FuturesOrdered<LocalBoxFuture<'static, Outcome>> = FuturesOrdered::new();
    // For each request in the window, in order: whether it is answered with a whole task.
    let mut task_replies: VecDeque<bool> = VecDeque::new();
    let mut task_replies_in_flight = 0usize;
    // A request that must wait for the window to drain before it starts.
    let mut held: Option<(RequestId, Request)> = None;
    // True while the request in the window must be answered before anything else is read.
    let mut exclusive = false;
    let mut streams: FuturesUnordered<JoinHandle<()>> = FuturesUnordered::new();
    let mut stopping = shared.stopping.clone();
    let idle = shared.idle_timeout;
    let idle_timer = tokio::time::sleep(idle);
    tokio::pin!(idle_timer);
    // Until its hello, a connection has HELLO_WAIT (or idle_timeout, if shorter) from its
    // accept, whatever it sends meanwhile: a client that never says hello — silent, or sending
    // anything else — cannot keep a connection slot, which operators and workers' reports need.
    let hello_wait = idle.min(HELLO_WAIT);
    let hello_by = tokio::time::sleep(hello_wait);
    tokio::pin!(hello_by);
    let mut hangup_probe = tokio::time::interval(HANGUP_PROBE);
    hangup_probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut was_idle = true;
    // The peer's unread byte count when the idle timer last fired (see the timer's arm).
    let mut unread_at_look: Option<i32> = None;
    let mut eof = false;
    let mut closing = *stopping.borrow();
    // The client can no longer be written to: end without last words.
    let mut gone = false;
    let mut last_words: Option<Vec<u8>> = None;

    loop {
        if window.is_empty() {
            exclusive = false;
            // Over the bound, the held request waits too: starting it would add a reply.
            if !out.over()
                && let Some((id, req)) = held.take()
            {
                exclusive = waits_for_user_name(&req);
                // A stream that has ended but is not collected yet (the loop below does that)
                // no longer counts against the limit.
                let open = streams.iter().filter(|s| !s.is_finished()).count();
                window.push_back(start_held(&shared, &session, id, req, open));
                task_replies.push_back(false);
            }
        }
        // After EOF the connection lives on while streams are open: a client that shut down
        // only its sending side (`socat` after its stdin ends) still reads its events.
        if window.is_empty() && held.is_none() && ((eof && streams.is_empty()) || closing) {
            break;
        }
        let reading = !eof
            && !closing
            && held.is_none()
            && !exclusive
            && window.len() < WINDOW
            && task_replies_in_flight < TASK_REPLY_WINDOW
            && !out.over();
        // Idle means: nothing in flight, no stream, every reply written, and no line (a
        // request or a blank keep-alive) for idle_timeout. A client still reading a long
        // reply is not idle; one that stopped reading is cut off by the writer instead.
        let idle_now = reading && window.is_empty() && streams.is_empty() && !out.pending();
        if idle_now && !was_idle {
            idle_timer
                .as_mut()
                .reset(Instant::from_std(crate::deadline_after(idle)));
            unread_at_look = None;
        }
        was_idle = idle_now;
        // Wake on the writer's progress while it decides what the loop may do next: whether
        // it may start requests again, or whether the connection has become idle.
        let watch_writer =
            out.over() || (reading && window.is_empty() && streams.is_empty() && out.pending());
        tokio::select! {
            biased;
            _ = out.closed() => {
                gone = true;
                break; // The writer gave up (the peer stopped reading, or closed): end now.
            }
            _ = stopping.changed(), if !closing => {
                closing = true;
            }
            Some(outcome) = window.next(), if !window.is_empty() => {
                if task_replies.pop_front() == Some(true) {
                    task_replies_in_flight -= 1;
                }
                let (line, stream) = match outcome {
                    Outcome::Line(line) => (line, None),
                    Outcome::Stream(line, stream) => (line, Some(stream)),
                };
                if out.push(line).is_err() {
                    gone = true;
                    break;
                }
                if let Some(stream) = stream {
                    streams.push(actix_rt::spawn(stream(out.clone())));
                }
            }
            // A stream ended (its writer is gone, or the board failed it); the loop
            // re-checks whether the connection is done.
            Some(_) = streams.next(), if !streams.is_empty() => {}
            _ = out.written(), if watch_writer => {}
            line = read_line(&mut reader, &mut partial, shared.max_request_bytes), if reading => {
                match line {
                    Ok(Some(line)) => {
                        idle_timer.as_mut().reset(Instant::from_std(crate::deadline_after(idle)));
                        if let Some((started, task_reply)) =
                            on_line(&shared, &mut session, &line, &mut held)
                        {
                            window.push_back(started);
                            task_replies.push_back(task_reply);
                            task_replies_in_flight += usize::from(task_reply);
                        }
                    }
                    Ok(None) | Err(LineError::Io) => eof = true,
                    Err(LineError::TooLarge) => {
                        let msg = format!(
                            "request line exceeds {} bytes; closing the connection",
                            shared.max_request_bytes
                        );
                        last_words = Some(Response::error(None, code::TOO_LARGE, msg).to_line());
                        closing = true;
                    }
                }
            }
            _ = &mut idle_timer, if idle_now => {
                // Written out of our queue is not read: a client still working through the
                // kernel's buffer of a long reply is reading, not idle — as long as it has
                // read some of it since the last look. One that stopped is idle.
                let stream: &tokio::net::UnixStream = reader.get_ref().as_ref();
                let unread = super::out::unread_by_peer(stream).unwrap_or(0);
                if unread > 0 && unread_at_look.is_none_or(|before| unread < before) {
                    unread_at_look = Some(unread);
                    idle_timer.as_mut().reset(Instant::from_std(crate::deadline_after(idle)));
                    continue;
                }
                let msg = format!("no request for {}; closing the connection", humantime::format_duration(idle));
                last_words = Some(Response::error(None, code::IDLE_TIMEOUT, msg).to_line());
                closing = true;
            }
            _ = &mut hello_by, if !session.hello && !closing && !eof => {
                let msg = format!(
                    "no hello within {}; closing the connection",
                    humantime::format_duration(hello_wait)
                );
                last_words = Some(Response::error(None, code::IDLE_TIMEOUT, msg).to_line());
                closing = true;
            }
            _ = hangup_probe.tick(), if eof && !streams.is_empty() => {
                if peer_hung_up(&reader) {
                    gone = true;
                    break;
                }
            }
        }
    }
    // Streams write through `out`; end them so the writer can finish.
    for s in streams.iter() {
        s.abort();
    }
    let refused = !gone && last_words.is_some();
    if !gone && let Some(line) = last_words {
        let _ = out.push(line);
    }
    drop(out);
    if tokio::time::timeout(CLOSE_DRAIN, &mut writer)
        .await
        .is_err()
    {
        // Do not leave a writer behind holding the socket after the slot is freed.
        writer.abort();
    }
    if refused {
        // The refusal is written and our side shut: what the client still sends is read and
        // dropped until it stops (EOF), within a bound, so the close does not reset it.
        let _ = tokio::time::timeout(REFUSAL_DRAIN, discard_input(&mut reader)).await;
    }
}

/// Reads and drops the client's input until it ends, fails, or pauses for
/// [`REFUSAL_DRAIN_GAP`]; at most [`REFUSAL_DRAIN_BYTES`].
async fn discard_input(reader: &mut BufReader<OwnedReadHalf>) {
    let mut dropped = 0;
    while dropped < REFUSAL_DRAIN_BYTES {
        match tokio::time::timeout(REFUSAL_DRAIN_GAP, reader.fill_buf()).await {
            Err(_) | Ok(Ok([]) | Err(_)) => return,
            Ok(Ok(buf)) => {
                let n = buf.len();
                reader.consume(n);
                dropped += n;
            }
        }
    }
}

/// True when the client has closed its end entirely (not just shut down its sending side):
/// the kernel reports a hang-up only once both directions are shut.
fn peer_hung_up(reader: &BufReader<OwnedReadHalf>) -> bool {
    use rustix::event::{PollFd, PollFlags, poll};
    let stream: &tokio::net::UnixStream = reader.get_ref().as_ref();
    let mut fds = [PollFd::new(stream, PollFlags::empty())];
    match poll(&mut fds, 0) {
        Ok(_) => fds[0].revents().intersects(PollFlags::HUP | PollFlags::ERR),
        Err(_) => false,
    }
}

/// Starts a request that waited for the window to drain; a follow beyond [`MAX_STREAMS`] is
/// refused here, where every earlier stream of the connection is known.
fn start_held(
    shared: &Rc<Shared>,
    session: &Session,
    id: RequestId,
    req: Request,
    open_streams: usize,
) -> LocalBoxFuture<'static, Outcome> {
    if matches!(&req, Request::Events(e) if e.follow) && open_streams >= MAX_STREAMS {
        let msg = format!(
            "this connection already has {MAX_STREAMS} events streams open (the most allowed); \
             follow on another connection"
        );
        let line = Response::error(Some(id), code::TOO_MANY_STREAMS, msg).to_line();
        return Box::pin(std::future::ready(Outcome::Line(line)));
    }
    ops::start(shared, session, id, req)
}

/// A `comment` whose author is the peer's user name, not looked up yet: it must wait for the
/// lookup, and nothing after it may start meanwhile, or a later write would commit first.
fn waits_for_user_name(req: &Request) -> bool {
    matches!(req, Request::Comment(c) if c.author.is_none())
}

/// Handles one complete line: an immediate answer, a started request, or a held one.
fn on_line(
    shared: &Rc<Shared>,
    session: &mut Session,
    line: &[u8],
    held: &mut Option<(RequestId, Request)>,
) -> Option<(LocalBoxFuture<'static, Outcome>, bool)> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return None; // Blank lines are keep-alives, not requests.
    }
    let answer = |r: Response| -> Option<(LocalBoxFuture<'static, Outcome>, bool)> {
        Some((
            Box::pin(std::future::ready(Outcome::Line(r.to_line()))),
            false,
        ))
    };
    let (id, mut req) = match protocol::parse_request(line) {
        Ok(parsed) => parsed,
        Err(e) => return answer(Response::error(e.id, code::BAD_REQUEST, e.message)),
    };
    if let Request::Hello(hello) = &req {
        return answer(say_hello(session, id, &hello.version));
    }
    if !session.hello {
        return answer(Response::error(
            Some(id),
            code::BAD_REQUEST,
            format!(
                "send hello first: {{\"id\":1,\"op\":\"hello\",\"version\":\"{PROTOCOL_VERSION}\"}}"
            ),
        ));
    }
    if let Request::Comment(c) = &mut req
        && c.author.is_none()
        && let Some(name) = session.user_name.get()
    {
        c.author = Some(name.clone());
    }
    if req.is_pipelined_write() && !waits_for_user_name(&req) {
        let task_reply = req.replies_with_task();
        Some((ops::start(shared, session, id, req), task_reply))
    } else {
        // Started by the loop once every earlier request has been answered.
        *held = Some((id, req));
        None
    }
}

fn say_hello(session: &mut Session, id: RequestId, version: &str) -> Response {
    match protocol::major_version(version) {
        Some(PROTOCOL_MAJOR) => {
            session.hello = true;
            let reply = HelloReply {
                protocol: PROTOCOL_VERSION.to_string(),
                server: env!("CARGO_PKG_VERSION").to_string(),
                pid: std::process::id(),
            };
            Response::Ok {
                id: Some(id),
                result: serde_json::to_value(reply).unwrap_or_default(),
            }
        }
        Some(_) => Response::error(
            Some(id),
            code::UNSUPPORTED_VERSION,
            format!(
                "protocol version {version} is not supported; this server speaks {PROTOCOL_VERSION}"
            ),
        ),
        None => Response::error(
            Some(id),
            code::BAD_REQUEST,
            format!(
                "field `version`: expected \"MAJOR.MINOR\" such as \"{PROTOCOL_VERSION}\", got {version:?}"
            ),
        ),
    }
}

/// Reads one line (without its newline, and without a trailing `\r`) into a fresh vector.
///
/// Cancel-safe: bytes are moved from the reader's buffer into `partial` synchronously after
/// each await, so a `select!` that drops this future loses nothing. `Ok(None)` is a clean end
/// of stream; a final line without a newline still counts as a line.
async fn read_line(
    reader: &mut BufReader<OwnedReadHalf>,
    partial: &mut Vec<u8>,
    max: usize,
) -> Result<Option<Vec<u8>>, LineError> {
    loop {
        let buf = reader.fill_buf().await.map_err(|_| LineError::Io)?;
        if buf.is_empty() {
            if partial.is_empty() {
                return Ok(None);
            }
            if partial.len() > max {
                return Err(LineError::TooLarge);
            }
            return Ok(Some(std::mem::take(partial)));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(pos) => (pos, true),
            None => (buf.len(), false),
        };
        // One byte over for a trailing `\r`, which is not part of the request: a line of
        // `max` bytes ended by CRLF is as acceptable as one ended by LF.
        if partial.len() + take > max + 1 {
            return Err(LineError::TooLarge);
        }
        partial.extend_from_slice(&buf[..take]);
        reader.consume(if done { take + 1 } else { take });
        if done {
            if partial.last() == Some(&b'\r') {
                partial.pop();
            }
            if partial.len() > max {
                return Err(LineError::TooLarge);
            }
            return Ok(Some(std::mem::take(partial)));
        }
    }
}
