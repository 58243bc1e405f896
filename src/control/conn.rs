//! One control connection: read request lines, run them, write response lines.
//!
//! Three parts run concurrently on the supervisor's thread:
//!
//! - the **reader loop** (this function) reads a line, parses it and starts its request as a
//!   future in a [`FuturesOrdered`] window, without waiting for earlier replies;
//! - the **window** yields the replies in request order; each goes to the writer;
//! - the **writer task** writes queued lines, batching whatever has queued up into one flush.
//!
//! Writes (`add_task`, `complete`, …) pipeline: each is submitted to the store the moment it is
//! first polled, in arrival order, so a burst of them lands in one group commit. Every other op
//! (reads, `status`, `events`, `shutdown`) waits until everything before it on the connection
//! has been answered, so it sees their effects. `events --follow` turns into a stream task that
//! writes event lines through the same writer.

use std::rc::Rc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::LocalBoxFuture;
use futures::stream::FuturesOrdered;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::ops::{self, Outcome};
use super::protocol::{
    self, HelloReply, PROTOCOL_MAJOR, PROTOCOL_VERSION, Request, RequestId, Response, code,
};
use super::server::{Peer, Shared};

/// Requests of one connection in flight at once; reading pauses while the window is full.
const WINDOW: usize = 1024;
/// Response lines queued for the writer before the reader waits for it.
const OUT_QUEUE: usize = 1024;
/// Read buffer size.
const READ_BUF: usize = 64 * 1024;
/// Write buffer size (lines are batched into one flush).
const WRITE_BUF: usize = 64 * 1024;
/// How long the last lines (a refusal, the final replies) may take to write on close.
const CLOSE_DRAIN: Duration = Duration::from_secs(2);

/// Per-connection state the ops may read.
pub(super) struct Session {
    pub peer: Peer,
    hello: bool,
}

enum LineError {
    TooLarge,
    Io,
}

/// Serves one accepted, authorized connection until it closes. `_permit` is its slot among
/// `max_connections`; dropping it (on return) frees the slot.
pub(super) async fn serve(
    stream: UnixStream,
    shared: Rc<Shared>,
    peer: Peer,
    _permit: OwnedSemaphorePermit,
) {
    let (rd, wr) = stream.into_split();
    let (out, out_rx) = mpsc::channel::<Vec<u8>>(OUT_QUEUE);
    let writer = actix_rt::spawn(write_lines(wr, out_rx, shared.idle_timeout));
    let mut reader = BufReader::with_capacity(READ_BUF, rd);
    let mut partial = Vec::new();
    let mut session = Session { peer, hello: false };
    let mut window: FuturesOrdered<LocalBoxFuture<'static, Outcome>> = FuturesOrdered::new();
    // A request that must wait for the window to drain before it starts.
    let mut held: Option<(RequestId, Request)> = None;
    let mut streams: Vec<JoinHandle<()>> = Vec::new();
    let mut stopping = shared.stopping.clone();
    let idle = shared.idle_timeout;
    let idle_timer = tokio::time::sleep(idle);
    tokio::pin!(idle_timer);
    let mut was_idle = true;
    let mut eof = false;
    let mut closing = *stopping.borrow();
    let mut last_words: Option<Vec<u8>> = None;

    loop {
        if window.is_empty()
            && let Some((id, req)) = held.take()
        {
            window.push_back(ops::start(&shared, &session, id, req));
        }
        streams.retain(|s| !s.is_finished());
        if window.is_empty() && held.is_none() && (eof || closing) {
            break;
        }
        let reading = !eof && !closing && held.is_none() && window.len() < WINDOW;
        // Idle means: nothing in flight, no stream, and no complete request for idle_timeout.
        let idle_now = reading && window.is_empty() && streams.is_empty();
        if idle_now && !was_idle {
            idle_timer
                .as_mut()
                .reset(Instant::from_std(crate::deadline_after(idle)));
        }
        was_idle = idle_now;
        tokio::select! {
            biased;
            _ = stopping.changed(), if !closing => {
                closing = true;
            }
            Some(outcome) = window.next(), if !window.is_empty() => {
                let (line, stream) = match outcome {
                    Outcome::Line(line) => (line, None),
                    Outcome::Stream(line, stream) => (line, Some(stream)),
                };
                if out.send(line).await.is_err() {
                    break; // The writer is gone: the peer closed or stopped reading.
                }
                if let Some(stream) = stream {
                    streams.push(actix_rt::spawn(stream(out.clone())));
                }
            }
            line = read_line(&mut reader, &mut partial, shared.max_request_bytes), if reading => {
                match line {
                    Ok(Some(line)) => {
                        idle_timer.as_mut().reset(Instant::from_std(crate::deadline_after(idle)));
                        if let Some(started) = on_line(&shared, &mut session, &line, &mut held) {
                            window.push_back(started);
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
                let msg = format!("no request for {}; closing the connection", humantime::format_duration(idle));
                last_words = Some(Response::error(None, code::IDLE_TIMEOUT, msg).to_line());
                closing = true;
            }
        }
    }
    // Streams write through `out`; end them so the writer can finish.
    for s in &streams {
        s.abort();
    }
    if let Some(line) = last_words {
        let _ = out.send(line).await;
    }
    drop(out);
    let _ = tokio::time::timeout(CLOSE_DRAIN, writer).await;
}

/// Handles one complete line: an immediate answer, a started request, or a held one.
fn on_line(
    shared: &Rc<Shared>,
    session: &mut Session,
    line: &[u8],
    held: &mut Option<(RequestId, Request)>,
) -> Option<LocalBoxFuture<'static, Outcome>> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return None; // Blank lines are keep-alives, not requests.
    }
    let answer = |r: Response| -> Option<LocalBoxFuture<'static, Outcome>> {
        Some(Box::pin(std::future::ready(Outcome::Line(r.to_line()))))
    };
    let (id, req) = match protocol::parse_request(line) {
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
    if req.is_pipelined_write() {
        Some(ops::start(shared, session, id, req))
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
        Some(major) => Response::error(
            Some(id),
            code::UNSUPPORTED_VERSION,
            format!(
                "protocol version {version} (major {major}) is not supported; this server speaks {PROTOCOL_VERSION}"
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
            return Ok(Some(std::mem::take(partial)));
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(pos) => (pos, true),
            None => (buf.len(), false),
        };
        if partial.len() + take > max {
            return Err(LineError::TooLarge);
        }
        partial.extend_from_slice(&buf[..take]);
        reader.consume(if done { take + 1 } else { take });
        if done {
            if partial.last() == Some(&b'\r') {
                partial.pop();
            }
            return Ok(Some(std::mem::take(partial)));
        }
    }
}

/// Writes queued lines, one flush per batch. Gives up (closing the connection) when the peer
/// does not take a write for `stall` — a client that never reads must not hold its slot.
async fn write_lines(wr: OwnedWriteHalf, mut lines: mpsc::Receiver<Vec<u8>>, stall: Duration) {
    let mut w = BufWriter::with_capacity(WRITE_BUF, wr);
    while let Some(line) = lines.recv().await {
        let batch = async {
            w.write_all(&line).await?;
            while let Ok(more) = lines.try_recv() {
                w.write_all(&more).await?;
            }
            w.flush().await
        };
        match tokio::time::timeout(stall, batch).await {
            Ok(Ok(())) => {}
            _ => return,
        }
    }
    let _ = tokio::time::timeout(stall, w.shutdown()).await;
}
