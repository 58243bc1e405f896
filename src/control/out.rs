//! The outgoing side of one connection: a queue of lines bounded in bytes, and the writer task
//! that empties it into the socket.
//!
//! The bound is in bytes, not lines, because one reply can be megabytes (a `list_tasks` of
//! big tasks) and a client that does not read must not make the supervisor hold more than a
//! few of them. Two kinds of producers respect it differently:
//!
//! - **replies** are already built when they are queued ([`Out::push`] never waits); the
//!   connection keeps them bounded by starting no new request while the queue is over its
//!   bound ([`Out::over`]), so at most the requests already in flight add to it;
//! - **streams** build lines from the board as they go, so [`Out::send`] waits for room first.
//!
//! The writer gives up when the peer reads nothing for `stall`: a stuck client loses its
//! connection, a slow one that keeps reading does not.

use std::cell::Cell;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{Notify, mpsc};

/// Reply bytes queued for the writer above which a connection starts no new request and its
/// streams wait.
pub(super) const MAX_QUEUED_BYTES: usize = 8 * 1024 * 1024;
/// Most bytes gathered from queued lines into one `write` call.
const WRITE_BATCH: usize = 64 * 1024;

/// The writer is gone (the peer closed, or stopped taking bytes); nothing more can be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WriterGone;

/// The producers' end of a connection's outgoing queue. Clones share the queue.
#[derive(Clone)]
pub(super) struct Out {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    queued: Rc<Queued>,
}

/// What the producers and the writer share (all on the connection's one thread).
struct Queued {
    /// Bytes queued and not yet written.
    bytes: Cell<usize>,
    /// Fired after each write and when the writer ends, for whoever waits for room.
    written: Notify,
}

impl Queued {
    fn over(&self) -> bool {
        self.bytes.get() >= MAX_QUEUED_BYTES
    }
}

impl Out {
    /// Starts the writer task on `wr` and returns the queue feeding it. The task ends when
    /// every `Out` is dropped and the queue is written, or when the peer stalls for `stall`.
    pub(super) fn start(wr: OwnedWriteHalf, stall: Duration) -> (Out, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Rc::new(Queued {
            bytes: Cell::new(0),
            written: Notify::new(),
        });
        let writer = actix_rt::spawn(write_lines(wr, rx, queued.clone(), stall));
        (Out { tx, queued }, writer)
    }

    /// Queues a line now, whatever the queue holds (see the module doc for why that is bounded).
    pub(super) fn push(&self, line: Vec<u8>) -> Result<(), WriterGone> {
        let len = line.len();
        self.tx.send(line).map_err(|_| WriterGone)?;
        self.queued.bytes.set(self.queued.bytes.get() + len);
        Ok(())
    }

    /// Queues a line once the queue is under its bound.
    pub(super) async fn send(&self, line: Vec<u8>) -> Result<(), WriterGone> {
        while self.queued.over() {
            // Created before the writer can run again, so its next notification is not missed.
            let written = self.queued.written.notified();
            if self.tx.is_closed() {
                return Err(WriterGone);
            }
            written.await;
        }
        self.push(line)
    }

    /// True while the queue holds at least [`MAX_QUEUED_BYTES`].
    pub(super) fn over(&self) -> bool {
        self.queued.over()
    }

    /// True while some queued bytes are not written yet.
    pub(super) fn pending(&self) -> bool {
        self.queued.bytes.get() > 0
    }

    /// Resolves after the writer's next write (or when it ends): then `over` and `pending`
    /// may have changed.
    pub(super) async fn written(&self) {
        self.queued.written.notified().await;
    }

    /// Resolves when the writer has ended (it gave up, or the queue is closed).
    pub(super) async fn closed(&self) {
        self.tx.closed().await;
    }
}

/// Writes queued lines, several per `write` when they have queued up, until every producer is
/// gone or the peer stalls.
async fn write_lines(
    mut wr: OwnedWriteHalf,
    mut lines: mpsc::UnboundedReceiver<Vec<u8>>,
    queued: Rc<Queued>,
    stall: Duration,
) {
    let finished = loop {
        let Some(mut batch) = lines.recv().await else {
            break true;
        };
        while batch.len() < WRITE_BATCH {
            match lines.try_recv() {
                Ok(more) => batch.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        let ok = write_all(&wr, &batch, stall).await;
        queued
            .bytes
            .set(queued.bytes.get().saturating_sub(batch.len()));
        queued.written.notify_waiters();
        if !ok {
            break false;
        }
    };
    // Closed before the last notification, so a producer woken by it sees the writer gone
    // instead of waiting for room that will never come.
    lines.close();
    queued.written.notify_waiters();
    if finished {
        let _ = tokio::time::timeout(stall, wr.shutdown()).await;
    }
}

/// Writes `buf`, giving up once the peer has read nothing for `stall`, so a client that reads
/// slowly but steadily is never cut off; only one that has stopped reading is.
///
/// Waiting for room alone cannot tell the two apart: the kernel reports a Unix socket
/// writable again only once about three quarters of its buffer are drained, which a slow
/// reader may take longer than `stall` to do. So when a write has waited `stall`, the bytes
/// the peer has not read yet are compared with when the wait began: fewer means it is reading.
async fn write_all(wr: &OwnedWriteHalf, mut buf: &[u8], stall: Duration) -> bool {
    while !buf.is_empty() {
        match wr.try_write(buf) {
            Ok(n) if n > 0 => {
                buf = &buf[n..];
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            // An error (EPIPE: the peer is gone), or a zero-length write.
            _ => return false,
        }
        // The socket is full: wait for room, as long as the peer keeps reading.
        let mut unread = unread_by_peer(wr.as_ref());
        loop {
            match tokio::time::timeout(stall, wr.writable()).await {
                Ok(Ok(())) => break,
                Ok(Err(_)) => return false,
                Err(_) => match (unread, unread_by_peer(wr.as_ref())) {
                    (Some(before), Some(now)) if now < before => unread = Some(now),
                    _ => return false, // Nothing read for `stall` (or the kernel cannot say).
                },
            }
        }
    }
    true
}

/// Bytes written to the socket that the peer has not read yet (`SIOCOUTQ`). For a Unix socket
/// it drops as the peer consumes each kernel buffer it was sent in.
pub(super) fn unread_by_peer(stream: &tokio::net::UnixStream) -> Option<i32> {
    let mut unread: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (= TIOCOUTQ) on a socket stores one int through the pointer, which
    // points to `unread`; the fd is borrowed from a live stream.
    let rc = unsafe { libc::ioctl(stream.as_raw_fd(), libc::TIOCOUTQ, &mut unread) };
    (rc == 0).then_some(unread)
}
