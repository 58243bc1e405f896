//! StoreActor: the only writer of the board while the supervisor runs.
//!
//! Every message is a typed [`StoreOp`]. The actor hands each op to a dedicated writer thread
//! that owns the read-write connection. The thread drains whatever has queued up into ONE
//! transaction (group commit: a burst of N writes costs one fsync, not N), applies the ops so
//! that a refused one fails only its caller (see
//! [`Board::write_batch`](crate::board::Board::write_batch)), commits, and only then answers
//! each caller — a reply always means "durable". After each commit it publishes the events the
//! batch appended, in id order, to every subscriber (dispatcher, reaper, `events --follow`).

use std::any::Any;
use std::future::Future;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;

use actix::prelude::*;
use tokio::sync::{broadcast, oneshot};

use crate::board::{self, Board, BoardError, Event, EventId, Millis, OpenOptions, Tx, now_millis};
use crate::config::Scheduling;

/// Most ops committed in one transaction; bounds the latency of the first op in a burst.
const MAX_BATCH: usize = 1024;
/// Read-only connections for queries.
const READERS: usize = 4;
/// Messages the StoreActor's mailbox holds before senders wait.
const STORE_MAILBOX: usize = 65_536;
/// How long a batch that already has company waits for more (see `writer_loop`).
const LINGER: std::time::Duration = std::time::Duration::from_micros(200);
/// Commits (event batches) buffered per subscriber before it is told it lagged (and re-reads
/// from the board).
const EVENT_CHANNEL: usize = 1024;

/// A failed store call: a stable error code (the protocol's) and a one-line message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct StoreError {
    pub code: &'static str,
    pub message: String,
}

impl StoreError {
    /// The store (the supervisor) has stopped: nothing more can be written or waited for.
    pub(crate) fn stopped() -> Self {
        StoreError {
            code: "unavailable",
            message: "the store is shutting down".into(),
        }
    }

    /// The op panicked while it was applied: nothing of it was written.
    pub(crate) fn panicked() -> Self {
        StoreError {
            code: "internal",
            message: "the store op panicked; nothing of it was written".into(),
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
    ///
    /// An op may be applied more than once, so its only effects must be on `tx`: a batch is
    /// first applied without savepoints, and if one of its ops (or a nested step of one) fails
    /// after writing, the batch is rolled back and applied again with each op and step in a
    /// savepoint of its own (see [`Board::write_batch`](crate::board::Board::write_batch));
    /// and when an op panics, the batch is rolled back and each op applied again alone.
    fn apply(&self, tx: &Tx<'_>, now: Millis) -> board::Result<Self::Output>;
}

/// Any closure over a transaction is an op (used by the library's own actors for composite
/// transitions that must be atomic, e.g. "record the exit and close the run"). Like every
/// op, it may be called more than once (see [`StoreOp::apply`]).
pub struct WithTx<F>(pub F);

impl<F, T> StoreOp for WithTx<F>
where
    F: Fn(&Tx<'_>, Millis) -> board::Result<T> + Send + 'static,
    T: Send + 'static,
{
    type Output = T;
    fn apply(&self, tx: &Tx<'_>, now: Millis) -> board::Result<T> {
        (self.0)(tx, now)
    }
}

/// The message carrying an op to the StoreActor.
pub struct Exec<O: StoreOp>(pub O);

impl<O: StoreOp> Message for Exec<O> {
    type Result = Result<O::Output, StoreError>;
}

type Erased = Box<dyn Any + Send>;
type ErasedOp = Box<dyn Fn(&Tx<'_>, Millis) -> board::Result<Erased> + Send>;

/// An op with its types erased so ops of every kind share one queue.
struct Job {
    op: ErasedOp,
    reply: Reply,
}

/// Answers one op's caller.
type Reply = Box<dyn FnOnce(Result<Erased, StoreError>) + Send>;

/// What the writer thread's queue carries.
enum Queued {
    Job(Job),
    /// Commit what came before, then exit (sent once, by the actor when it stops).
    Stop,
}

/// The StoreActor. Start it with [`StoreActor::start_on`].
pub struct StoreActor {
    jobs: mpsc::Sender<Queued>,
    writer: Option<thread::JoinHandle<()>>,
}

/// A cloneable handle: the actor's address plus the event feed.
#[derive(Clone)]
pub struct Store {
    pub addr: Addr<StoreActor>,
    /// The writer thread's queue. Ops go straight into it from whichever thread calls: a trip
    /// through the actor's mailbox would cost every write an extra turn of the actor thread,
    /// which is shared with every worker and the dispatcher. It is unbounded; what can be in
    /// flight is bounded by the callers (the control server: connections × pipelining window;
    /// each actor awaits its own ops).
    jobs: mpsc::Sender<Queued>,
    events: broadcast::Sender<EventBatch>,
    /// Read-only connections: in WAL mode readers never wait for the writer, so queries
    /// (`show`, `ls`, `wait`, the sweeps) do not queue behind writes, nor — up to the pool's
    /// size — behind each other.
    readers: Arc<[Mutex<Board>]>,
    /// One per reader: [`Store::read`]s beyond that wait here, not on a blocking thread each
    /// (a burst of clients would otherwise start a thread per concurrent read, each building
    /// its replies in an allocator arena of its own, only to wait for a connection).
    read_slots: Arc<tokio::sync::Semaphore>,
    stats: Arc<Counters>,
}

/// What the writer has done so far (for benchmarks and diagnostics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Ops applied (committed or refused).
    pub ops: u64,
    /// Batches committed (each in one transaction; one applied twice also rolled back a
    /// first).
    pub batches: u64,
    /// Batches committed at a second attempt because an op failed after writing (see
    /// [`StoreOp::apply`]).
    pub retried: u64,
}

#[derive(Default)]
struct Counters {
    ops: std::sync::atomic::AtomicU64,
    batches: std::sync::atomic::AtomicU64,
    retried: std::sync::atomic::AtomicU64,
}

impl Store {
    /// Runs `op` and waits until it is committed.
    pub async fn call<O: StoreOp>(&self, op: O) -> Result<O::Output, StoreError> {
        submit(&self.jobs, op).await
    }

    /// Runs a closure over a transaction and waits until it is committed. The closure may be
    /// called more than once (see [`StoreOp::apply`]).
    pub async fn with_tx<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        F: Fn(&Tx<'_>, Millis) -> board::Result<T> + Send + 'static,
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
        let Ok(slot) = self.read_slots.clone().acquire_owned().await else {
            return Err(StoreError::stopped());
        };
        let me = self.clone();
        actix_rt::task::spawn_blocking(move || {
            // Held until the read is done, even if its caller went away meanwhile.
            let _slot = slot;
            me.read_blocking(f)
        })
        .await
        .unwrap_or_else(|_| Err(StoreError::stopped()))
    }

    /// Forwards every event committed from now on, in id order, to `on_event` (which returns
    /// false once its receiver is gone), and the count of events missed to `on_lag` when a
    /// slow subscriber fell more than the channel's capacity behind. Runs until the feed
    /// closes or `on_event` says stop. Call it inside the supervisor's actix system (an
    /// actor's context: it spawns a local task there); from any other thread, use
    /// [`Store::subscribe`] and receive from the feed.
    pub fn forward_events(
        &self,
        on_event: impl FnMut(Arc<Event>) -> bool + 'static,
        on_lag: impl FnMut(u64) + 'static,
    ) {
        self.subscribe().forward(on_event, on_lag);
    }

    /// Counts of the writer's work since the store started.
    pub fn stats(&self) -> StoreStats {
        use std::sync::atomic::Ordering::Relaxed;
        StoreStats {
            ops: self.stats.ops.load(Relaxed),
            batches: self.stats.batches.load(Relaxed),
            retried: self.stats.retried.load(Relaxed),
        }
    }

    /// Every event committed from now on, in id order.
    pub fn subscribe(&self) -> EventFeed {
        EventFeed {
            batches: self.events.subscribe(),
            current: None,
        }
    }
}

impl EventFeed {
    /// [`Store::forward_events`] for a feed subscribed earlier: it forwards every event
    /// committed since [`Store::subscribe`] — an actor that subscribes when it is made, not
    /// when it first runs, misses nothing committed in between.
    pub fn forward(
        mut self,
        mut on_event: impl FnMut(Arc<Event>) -> bool + 'static,
        mut on_lag: impl FnMut(u64) + 'static,
    ) {
        // `on_lag` hears of missed commits (each one or more events).
        actix_rt::spawn(async move {
            loop {
                match self.recv().await {
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
}

/// The events of one commit, in id order: the unit the store publishes (one wake-up per
/// subscriber per commit, not one per event).
pub type EventBatch = Arc<[Arc<Event>]>;

/// A subscription to the committed events ([`Store::subscribe`]), handed out one at a time.
pub struct EventFeed {
    batches: broadcast::Receiver<EventBatch>,
    /// The batch being handed out and the index of its next event.
    current: Option<(EventBatch, usize)>,
}

impl EventFeed {
    /// The next committed event. `Lagged(n)`: this subscriber fell more than the channel's
    /// capacity behind and `n` commits' events were dropped for it (re-read them from the
    /// board); `Closed`: the store has stopped.
    pub async fn recv(&mut self) -> Result<Arc<Event>, broadcast::error::RecvError> {
        loop {
            if let Some(ev) = self.next_pending() {
                return Ok(ev);
            }
            let batch = self.batches.recv().await?;
            self.current = Some((batch, 0));
        }
    }

    /// [`EventFeed::recv`] without waiting.
    pub fn try_recv(&mut self) -> Result<Arc<Event>, broadcast::error::TryRecvError> {
        loop {
            if let Some(ev) = self.next_pending() {
                return Ok(ev);
            }
            let batch = self.batches.try_recv()?;
            self.current = Some((batch, 0));
        }
    }

    fn next_pending(&mut self) -> Option<Arc<Event>> {
        let (batch, next) = self.current.as_mut()?;
        let ev = batch.get(*next).cloned();
        *next += 1;
        if ev.is_none() {
            self.current = None;
        }
        ev
    }
}

impl StoreActor {
    /// Opens the board at `path` on a new writer thread (under `scheduling`) and starts the
    /// actor in the current actix system. Fails (without starting anything) if the board
    /// cannot be opened.
    pub fn start_on(
        path: PathBuf,
        opts: OpenOptions,
        scheduling: Scheduling,
    ) -> Result<Store, BoardError> {
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
        let (jobs_tx, jobs_rx) = mpsc::channel::<Queued>();
        let (events, _) = broadcast::channel(EVENT_CHANNEL);
        let feed = events.clone();
        let stats = Arc::new(Counters::default());
        let counters = stats.clone();
        let writer = super::spawn_thread("runwarden-store".into(), scheduling, move || {
            writer_loop(board, jobs_rx, feed, watermark, &counters)
        })
        .map_err(|e| BoardError::Invalid(format!("cannot start the store thread: {e}")))?;
        let addr = StoreActor {
            jobs: jobs_tx.clone(),
            writer: Some(writer),
        }
        .start();
        Ok(Store {
            addr,
            jobs: jobs_tx,
            events,
            readers: readers.into(),
            read_slots: Arc::new(tokio::sync::Semaphore::new(READERS)),
            stats,
        })
    }
}

impl Actor for StoreActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // The supervisor's own writes go straight to the writer's queue (Store::call); the
        // mailbox carries typed `Exec` messages sent through the address. actix's default holds
        // 16; past that, senders park and are resumed in no set order: keep arrival order.
        ctx.set_mailbox_capacity(STORE_MAILBOX);
    }

    fn stopped(&mut self, _: &mut Self::Context) {
        // The writer finishes what is queued ahead of the stop, commits, and exits; joining it
        // here means a stopped store has flushed everything it accepted. Ops sent after the
        // stop are dropped unanswered, which their callers see as "unavailable".
        let _ = self.jobs.send(Queued::Stop);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

impl<O: StoreOp> Handler<Exec<O>> for StoreActor {
    type Result = ResponseFuture<Result<O::Output, StoreError>>;

    fn handle(&mut self, msg: Exec<O>, _: &mut Self::Context) -> Self::Result {
        Box::pin(submit(&self.jobs, msg.0))
    }
}

/// Queues `op` for the writer thread; resolves once it is committed (or refused).
fn submit<O: StoreOp>(
    jobs: &mpsc::Sender<Queued>,
    op: O,
) -> impl Future<Output = Result<O::Output, StoreError>> + 'static {
    let (tx, rx) = oneshot::channel();
    let job = Job {
        op: Box::new(move |t, now| op.apply(t, now).map(|o| Box::new(o) as Erased)),
        reply: Box::new(move |r| {
            let typed = r.map(|b| *b.downcast::<O::Output>().expect("op output type"));
            let _ = tx.send(typed);
        }),
    };
    let sent = jobs.send(Queued::Job(job)).is_ok();
    async move {
        if !sent {
            return Err(StoreError::stopped());
        }
        rx.await.unwrap_or_else(|_| Err(StoreError::stopped()))
    }
}

impl Drop for StoreActor {
    fn drop(&mut self) {
        // A system torn down without stopping its actors still lets the writer commit what it
        // has and exit (the handles' senders would otherwise keep it waiting forever).
        let _ = self.jobs.send(Queued::Stop);
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

/// Moves every queued job into `batch`, up to [`MAX_BATCH`]. False once the stop was seen.
fn drain(jobs: &mpsc::Receiver<Queued>, batch: &mut Vec<Job>) -> bool {
    while batch.len() < MAX_BATCH {
        match jobs.try_recv() {
            Ok(Queued::Job(j)) => batch.push(j),
            Ok(Queued::Stop) => return false,
            Err(_) => break,
        }
    }
    true
}

fn writer_loop(
    mut board: Board,
    jobs: mpsc::Receiver<Queued>,
    feed: broadcast::Sender<EventBatch>,
    mut watermark: EventId,
    counters: &Counters,
) {
    let mut open = true;
    while open {
        let Ok(Queued::Job(first)) = jobs.recv() else {
            break;
        };
        let mut batch = vec![first];
        open = drain(&jobs, &mut batch);
        if open && batch.len() > 1 && batch.len() < MAX_BATCH {
            // Concurrent writers are about: linger a moment (like PostgreSQL's commit_delay)
            // so callers answered by the previous commit can join this one. A lone write
            // (batch of one) never waits.
            match jobs.recv_timeout(LINGER) {
                Ok(Queued::Job(j)) => {
                    batch.push(j);
                    open = drain(&jobs, &mut batch);
                }
                Ok(Queued::Stop) => open = false,
                Err(_) => {}
            }
        }
        let now = now_millis();
        counters
            .ops
            .fetch_add(batch.len() as u64, std::sync::atomic::Ordering::Relaxed);
        counters
            .batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (ops, replies): (Vec<_>, Vec<_>) = batch.into_iter().map(|j| (j.op, j.reply)).unzip();
        let ops: Vec<Rc<ErasedOp>> = ops.into_iter().map(Rc::new).collect();
        match commit(&mut board, &ops, now) {
            Ok(Ok(committed)) => {
                watermark = answer(&mut board, &feed, watermark, counters, committed, replies);
            }
            Ok(Err(e)) => {
                let err = StoreError::from(e);
                tracing::error!(error = %err, "store: batch commit failed; nothing of it is durable");
                for reply in replies {
                    reply(Err(err.clone()));
                }
            }
            Err(()) => {
                // An op panicked (a closure given to `Store::with_tx` by an embedding program,
                // or a bug): its batch was rolled back as the panic unwound. The writer goes
                // on — a dead writer would leave a supervisor that answers reads and can
                // record nothing. Each op is applied again alone, so only the one that panics
                // fails (ops may be applied more than once: see `StoreOp::apply`).
                if ops.len() == 1 {
                    // Alone: nothing else to save, and a second try would panic again.
                    for reply in replies {
                        reply(Err(StoreError::panicked()));
                    }
                } else {
                    tracing::warn!(
                        "store: the batch of the op that panicked is applied again op by op"
                    );
                    for (op, reply) in ops.iter().zip(replies) {
                        match commit(&mut board, std::slice::from_ref(op), now) {
                            Ok(Ok(committed)) => {
                                watermark = answer(
                                    &mut board,
                                    &feed,
                                    watermark,
                                    counters,
                                    committed,
                                    vec![reply],
                                );
                            }
                            Ok(Err(e)) => reply(Err(StoreError::from(e))),
                            Err(()) => reply(Err(StoreError::panicked())),
                        }
                    }
                }
            }
        }
    }
    // A stop leaves the whole board in `board.db` (see `Board::checkpoint`).
    match board.checkpoint() {
        Ok(true) => {}
        Ok(false) => tracing::warn!(
            "store: a reader kept part of the write-ahead log at the stop; board.db needs its board.db-wal beside it until the next start"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "store: cannot checkpoint the write-ahead log at the stop; board.db needs its board.db-wal beside it until the next start")
        }
    }
    tracing::debug!("store: queue closed, writer exits");
}

/// Applies `ops` in one transaction (see [`Board::write_batch`]); `Err(())` when one of them
/// panicked (logged; the transaction is rolled back).
fn commit(
    board: &mut Board,
    ops: &[Rc<ErasedOp>],
    now: Millis,
) -> Result<board::Result<board::Committed<Erased>>, ()> {
    let batch = ops
        .iter()
        .map(|op| {
            let op = op.clone();
            Box::new(move |t: &Tx<'_>| op(t, now)) as Box<dyn Fn(&Tx<'_>) -> board::Result<Erased>>
        })
        .collect();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| board.write_batch(batch))).map_err(
        |panic| {
            // Said here: the panic hook's own message went to stderr, which may be lost.
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            tracing::error!(panic = %what, "store: an op panicked");
            if let Err(e) = board.abandon_transaction() {
                tracing::error!(error = %e, "store: cannot roll back the panicked op's transaction; later writes will fail");
            }
        },
    )
}

/// Publishes what a commit appended, then answers its callers (in that order: a caller that
/// gets "ok" and then subscribes-and-reads never misses the events of its own write). Returns
/// the new watermark.
fn answer(
    board: &mut Board,
    feed: &broadcast::Sender<EventBatch>,
    watermark: EventId,
    counters: &Counters,
    committed: board::Committed<Erased>,
    replies: Vec<Reply>,
) -> EventId {
    if committed.retried {
        counters
            .retried
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    let watermark = publish(board, feed, watermark, committed.events);
    for (reply, result) in replies.into_iter().zip(committed.results) {
        reply(result.map_err(StoreError::from));
    }
    watermark
}

/// Sends the events a batch committed to the subscribers, in id order; returns the new
/// watermark. They are the batch's own record of what it appended, so nothing is read back —
/// unless they do not follow on from `watermark` (something else wrote to the board), in which
/// case everything after the watermark is read from the board, so no event is ever skipped.
fn publish(
    board: &mut Board,
    feed: &broadcast::Sender<EventBatch>,
    watermark: EventId,
    appended: Vec<Event>,
) -> EventId {
    let contiguous = appended
        .iter()
        .zip(watermark + 1..)
        .all(|(ev, expected)| ev.id == expected);
    if !contiguous {
        return publish_from_board(board, feed, watermark);
    }
    let Some(last) = appended.last().map(|ev| ev.id) else {
        return watermark;
    };
    // No subscriber is fine (send errs only then).
    let _ = feed.send(appended.into_iter().map(Arc::new).collect());
    last
}

/// Sends every event committed after `watermark`, read from the board; returns the new
/// watermark.
fn publish_from_board(
    board: &mut Board,
    feed: &broadcast::Sender<EventBatch>,
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
        if let Some(last) = events.last() {
            watermark = last.id;
            let _ = feed.send(events.into_iter().map(Arc::new).collect());
        }
        if !more {
            return watermark;
        }
    }
}
