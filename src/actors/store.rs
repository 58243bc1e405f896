//! StoreActor: the only writer of the board while the supervisor runs.
//!
//! Every message is a typed [`StoreOp`]. The actor hands each op to a dedicated writer thread
//! that owns the read-write connection. The thread drains whatever has queued up into ONE
//! transaction (group commit: a burst of N writes costs one fsync, not N), runs each op in its
//! own savepoint (a refused transition fails only its caller), commits, and only then answers
//! each caller — a reply always means "durable". After each commit it reads the events the
//! batch appended and publishes them, in id order, to every subscriber (dispatcher, reaper,
//! `events --follow`).

use std::any::Any;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;

use actix::prelude::*;
use tokio::sync::{broadcast, oneshot};

use crate::board::{self, Board, BoardError, Event, EventId, Millis, OpenOptions, Tx, now_millis};

/// Most ops committed in one transaction; bounds the latency of the first op in a burst.
const MAX_BATCH: usize = 1024;
/// Read-only connections for queries.
const READERS: usize = 4;
/// Messages the StoreActor's mailbox holds before senders wait.
const STORE_MAILBOX: usize = 65_536;
/// How long a batch that already has company waits for more (see `writer_loop`).
const LINGER: std::time::Duration = std::time::Duration::from_micros(200);
/// Events buffered per subscriber before it is told it lagged (and re-reads from the board).
const EVENT_CHANNEL: usize = 8192;

/// A failed store call: a stable error code (the protocol's) and a one-line message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct StoreError {
    pub code: &'static str,
    pub message: String,
}

impl StoreError {
    fn stopped() -> Self {
        StoreError {
            code: "unavailable",
            message: "the store is shutting down".into(),
        }
    }
}

impl From<BoardError> for StoreError {
    fn from(e: BoardError) -> Self {
        StoreError {
            code: e.code(),
            message: e.to_string(),
        }
    }
}

/// One operation on the board, applied inside the writer's transaction at time `now`.
pub trait StoreOp: Send + 'static {
    /// What the caller gets back once the op is committed.
    type Output: Send + 'static;
    /// Applies the op. An `Err` rolls back this op only.
    fn apply(self, tx: &Tx<'_>, now: Millis) -> board::Result<Self::Output>;
}

/// Any closure over a transaction is an op (used by the library's own actors for composite
/// transitions that must be atomic, e.g. "record the exit and close the run").
pub struct WithTx<F>(pub F);

impl<F, T> StoreOp for WithTx<F>
where
    F: FnOnce(&Tx<'_>, Millis) -> board::Result<T> + Send + 'static,
    T: Send + 'static,
{
    type Output = T;
    fn apply(self, tx: &Tx<'_>, now: Millis) -> board::Result<T> {
        (self.0)(tx, now)
    }
}

/// The message carrying an op to the StoreActor.
pub struct Exec<O: StoreOp>(pub O);

impl<O: StoreOp> Message for Exec<O> {
    type Result = Result<O::Output, StoreError>;
}

type Erased = Box<dyn Any + Send>;
type ErasedOp = Box<dyn FnOnce(&Tx<'_>, Millis) -> board::Result<Erased> + Send>;

/// An op with its types erased so ops of every kind share one queue.
struct Job {
    op: ErasedOp,
    reply: Box<dyn FnOnce(Result<Erased, StoreError>) + Send>,
}

/// The StoreActor. Start it with [`StoreActor::start_on`].
pub struct StoreActor {
    jobs: Option<mpsc::Sender<Job>>,
    writer: Option<thread::JoinHandle<()>>,
}

/// A cloneable handle: the actor's address plus the event feed.
#[derive(Clone)]
pub struct Store {
    pub addr: Addr<StoreActor>,
    events: broadcast::Sender<Arc<Event>>,
    /// Read-only connections: in WAL mode readers never wait for the writer, so queries
    /// (`show`, `ls`, `wait`, the sweeps) do not queue behind writes, nor — up to the pool's
    /// size — behind each other.
    readers: Arc<[Mutex<Board>]>,
}

impl Store {
    /// Runs `op` and waits until it is committed.
    pub async fn call<O: StoreOp>(&self, op: O) -> Result<O::Output, StoreError> {
        match self.addr.send(Exec(op)).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::stopped()),
        }
    }

    /// Runs a closure over a transaction and waits until it is committed.
    pub async fn with_tx<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(&Tx<'_>, Millis) -> board::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        self.call(WithTx(f)).await
    }

    /// Runs a query on the read connection, blocking the calling thread (not for actor threads).
    pub fn read_blocking<T>(
        &self,
        f: impl FnOnce(&Tx<'_>) -> board::Result<T>,
    ) -> Result<T, StoreError> {
        // A free connection if there is one, else wait for the first.
        let mut board = self
            .readers
            .iter()
            .find_map(|r| r.try_lock().ok())
            .unwrap_or_else(|| self.readers[0].lock().unwrap_or_else(|p| p.into_inner()));
        board.read(f).map_err(StoreError::from)
    }

    /// Runs a query on the read connection from async code (on the blocking pool).
    pub async fn read<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(&Tx<'_>) -> board::Result<T> + Send + 'static,
        T: Send + 'static,
    {
        let me = self.clone();
        actix_rt::task::spawn_blocking(move || me.read_blocking(f))
            .await
            .unwrap_or_else(|_| Err(StoreError::stopped()))
    }

    /// Forwards every event committed from now on, in id order, to `on_event` (which returns
    /// false once its receiver is gone), and the count of events missed to `on_lag` when a
    /// slow subscriber fell more than the channel's capacity behind. Runs until the feed
    /// closes or `on_event` says stop.
    pub fn forward_events(
        &self,
        mut on_event: impl FnMut(Arc<Event>) -> bool + 'static,
        mut on_lag: impl FnMut(u64) + 'static,
    ) {
        let mut feed = self.subscribe();
        actix_rt::spawn(async move {
            loop {
                match feed.recv().await {
                    Ok(ev) => {
                        if !on_event(ev) {
                            break;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => on_lag(n),
                    Err(broadcast::error::RecvError::Closed) => break,
                }
            }
        });
    }

    /// Every event committed from now on, in id order.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.events.subscribe()
    }
}

impl StoreActor {
    /// Opens the board at `path` on a new writer thread and starts the actor in the current
    /// actix system. Fails (without starting anything) if the board cannot be opened.
    pub fn start_on(path: PathBuf, opts: OpenOptions) -> Result<Store, BoardError> {
        let mut board = Board::open_with(&path, opts)?;
        let watermark = board.read(|tx| tx.last_event_id())?;
        let readers = (0..READERS)
            .map(|_| {
                Board::open_with(
                    &path,
                    OpenOptions {
                        read_only: true,
                        ..opts
                    },
                )
                .map(Mutex::new)
            })
            .collect::<Result<Vec<_>, _>>()?;
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (events, _) = broadcast::channel(EVENT_CHANNEL);
        let feed = events.clone();
        let writer = thread::Builder::new()
            .name("runwarden-store".into())
            .spawn(move || writer_loop(board, jobs_rx, feed, watermark))
            .map_err(|e| BoardError::Invalid(format!("cannot start the store thread: {e}")))?;
        let addr = StoreActor {
            jobs: Some(jobs_tx),
            writer: Some(writer),
        }
        .start();
        Ok(Store {
            addr,
            events,
            readers: readers.into(),
        })
    }
}

impl Actor for StoreActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // actix's default mailbox holds 16 messages; past that, senders park and are resumed in
        // no set order. Every write of the supervisor comes through here, in bursts (a pipelining
        // client, a pass claiming for many workers): keep arrival order and never park them.
        ctx.set_mailbox_capacity(STORE_MAILBOX);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        // Closing the queue lets the writer finish what is queued, commit, and exit; joining
        // it here means a stopped store has flushed everything it accepted.
        self.jobs.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl<O: StoreOp> Handler<Exec<O>> for StoreActor {
    type Result = ResponseFuture<Result<O::Output, StoreError>>;

    fn handle(&mut self, msg: Exec<O>, _: &mut Self::Context) -> Self::Result {
        let (tx, rx) = oneshot::channel();
        let job = Job {
            op: Box::new(move |t, now| msg.0.apply(t, now).map(|o| Box::new(o) as Erased)),
            reply: Box::new(move |r| {
                let typed = r.map(|b| *b.downcast::<O::Output>().expect("op output type"));
                let _ = tx.send(typed);
            }),
        };
        let sent = self
            .jobs
            .as_ref()
            .map(|j| j.send(job).is_ok())
            .unwrap_or(false);
        Box::pin(async move {
            if !sent {
                return Err(StoreError::stopped());
            }
            rx.await.unwrap_or_else(|_| Err(StoreError::stopped()))
        })
    }
}

/// Asks the store to stop after flushing every queued op.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Flush;

impl Handler<Flush> for StoreActor {
    type Result = ();
    fn handle(&mut self, _: Flush, ctx: &mut Self::Context) {
        ctx.stop();
    }
}

/// Moves every queued job into `batch`, up to [`MAX_BATCH`].
fn drain(jobs: &mpsc::Receiver<Job>, batch: &mut Vec<Job>) {
    while batch.len() < MAX_BATCH {
        match jobs.try_recv() {
            Ok(j) => batch.push(j),
            Err(_) => break,
        }
    }
}

fn writer_loop(
    mut board: Board,
    jobs: mpsc::Receiver<Job>,
    feed: broadcast::Sender<Arc<Event>>,
    mut watermark: EventId,
) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        drain(&jobs, &mut batch);
        if batch.len() > 1 && batch.len() < MAX_BATCH {
            // Concurrent writers are about: linger a moment (like PostgreSQL's commit_delay)
            // so callers answered by the previous commit can join this one. A lone write
            // (batch of one) never waits.
            if let Ok(j) = jobs.recv_timeout(LINGER) {
                batch.push(j);
                drain(&jobs, &mut batch);
            }
        }
        let now = now_millis();
        let (ops, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|j| (j.op, j.reply)).unzip();
        let ops = ops
            .into_iter()
            .map(|op| {
                Box::new(move |t: &Tx<'_>| op(t, now))
                    as Box<dyn FnOnce(&Tx<'_>) -> board::Result<Erased>>
            })
            .collect();
        match board.write_batch(ops) {
            Ok(results) => {
                // Publish before replying: a caller that gets "ok" and then subscribes-and-reads
                // never misses the events of its own write.
                watermark = publish(&mut board, &feed, watermark);
                for (reply, result) in replies.into_iter().zip(results) {
                    reply(result.map_err(StoreError::from));
                }
            }
            Err(e) => {
                let err = StoreError::from(e);
                tracing::error!(error = %err, "store: batch commit failed; nothing of it is durable");
                for reply in replies {
                    reply(Err(err.clone()));
                }
            }
        }
    }
    tracing::debug!("store: queue closed, writer exits");
}

/// Sends every event committed after `watermark` to the subscribers; returns the new watermark.
fn publish(
    board: &mut Board,
    feed: &broadcast::Sender<Arc<Event>>,
    mut watermark: EventId,
) -> EventId {
    loop {
        let events = match board.read(|tx| tx.events_since(watermark, 4096)) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(error = %e, "store: cannot read new events");
                return watermark;
            }
        };
        let more = events.len() == 4096;
        for ev in events {
            watermark = ev.id;
            // No subscriber is fine (send errs only then).
            let _ = feed.send(Arc::new(ev));
        }
        if !more {
            return watermark;
        }
    }
}
