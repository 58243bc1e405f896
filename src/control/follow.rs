//! `events` with `follow`: every event with id greater than `since`, in id order, with no gap
//! and no duplicate, then each new event as it commits.
//!
//! The order of the steps is what makes it gap-free:
//!
//! 1. **Subscribe** to the store's feed first. From this instant every event the store commits
//!    and publishes is queued for us.
//! 2. **Read the backlog** from the board (pages of events after `since`). Anything committed
//!    before the subscription is on the board; anything committed after it is in the feed; an
//!    event can be in both, never in neither.
//! 3. **Forward the feed**, skipping every event whose id is not greater than the last one
//!    sent (the overlap of 1 and 2).
//!
//! If the feed overflows (`Lagged`: this follower fell more than the channel's capacity
//! behind), the missed events are still on the board: go back to step 2 from the last id sent.

use std::rc::Rc;

use futures::FutureExt;
use futures::future::LocalBoxFuture;
use tokio::sync::broadcast;

use super::ops::{OpError, Outcome, respond};
use super::out::Out;
use super::protocol::{Events, FollowReply, MAX_REPLY_TEXT_BYTES, RequestId, Response};
use super::server::Shared;
use crate::actors::store::{EventFeed, Store};
use crate::board::{Event, EventId, TaskId};

/// Events read from the board per catch-up page.
const PAGE: u32 = 1000;

/// Starts a followed `events` request: subscribes now, answers once the task (if any) is known
/// to exist, then streams.
pub(super) fn start(
    shared: &Rc<Shared>,
    id: Option<RequestId>,
    req: Events,
) -> LocalBoxFuture<'static, Outcome> {
    // Step 1, before anything is read.
    let feed = shared.services.store.subscribe();
    let store = shared.services.store.clone();
    async move {
        if let Some(task) = req.task
            && let Err(e) = store.read(move |tx| tx.task_status(task)).await
        {
            return Outcome::Line(respond::<()>(id, Err(OpError::from(e))));
        }
        let reply = respond(
            id.clone(),
            Ok(FollowReply {
                following: true,
                since: req.since,
            }),
        );
        let follower = Follower {
            store,
            feed,
            id,
            task: req.task,
            last: req.since,
        };
        Outcome::Stream(reply, Box::new(move |out| follower.run(out).boxed_local()))
    }
    .boxed_local()
}

struct Follower {
    store: Store,
    feed: EventFeed,
    id: Option<RequestId>,
    task: Option<TaskId>,
    /// The highest event id already accounted for (sent, or skipped by the task filter).
    last: EventId,
}

impl Follower {
    /// Streams until the connection's writer goes away or the store stops.
    async fn run(mut self, out: Out) {
        loop {
            // Step 2: catch up from the board.
            if !self.catch_up(&out).await {
                return;
            }
            // Step 3: the live feed, until it lags (then catch up again) or closes.
            loop {
                match self.feed.recv().await {
                    Ok(ev) => {
                        if !self.send(&ev, &out).await {
                            return;
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        tracing::debug!(
                            missed = n,
                            last = self.last,
                            "events follower lagged; re-reading from the board"
                        );
                        break;
                    }
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        }
    }

    /// Sends every board event after `last`; false when the stream must end.
    async fn catch_up(&mut self, out: &Out) -> bool {
        loop {
            let (task, after) = (self.task, self.last);
            let page = self
                .store
                .read(move |tx| tx.events_since_within(task, after, PAGE, MAX_REPLY_TEXT_BYTES))
                .await;
            let page = match page {
                Ok(page) => page,
                Err(e) => {
                    let line = Response::error(
                        self.id.clone(),
                        e.code,
                        format!("events stream ended: {}", e.message),
                    );
                    // Under the follow's own id: the client learns which stream ended and why.
                    let _ = out.send(line.to_line()).await;
                    return false;
                }
            };
            let (page, cut) = page;
            let full = cut || page.len() as u32 == PAGE;
            for ev in &page {
                if !self.send(ev, out).await {
                    return false;
                }
            }
            if !full {
                return true;
            }
        }
    }

    /// Sends `ev` unless already accounted for or filtered out; false when the writer is gone.
    async fn send(&mut self, ev: &Event, out: &Out) -> bool {
        if ev.id <= self.last {
            return true; // Seen in the backlog already.
        }
        self.last = ev.id;
        if self.task.is_some() && ev.task_id != self.task {
            return true;
        }
        let line = Response::Event {
            id: self.id.clone(),
            event: ev.clone(),
        };
        // Waits while the connection's queue is full: a slow reader slows the stream down
        // instead of making the supervisor hold the board's whole history for it.
        out.send(line.to_line()).await.is_ok()
    }
}
