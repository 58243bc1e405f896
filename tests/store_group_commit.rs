//! Group commit: many writes share one transaction, yet each caller gets its own result. A
//! refused op is rolled back alone (its events included), the others commit, and subscribers
//! are told exactly the committed events, in id order, with no gap — also when something else
//! wrote to the board in between.

#[allow(dead_code)]
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use common::board::{events_of, kinds, temp_board};
use futures::FutureExt;
use runwarden::actors::store::{EventFeed, Flush, StoreActor};
use runwarden::board::{BatchOp, BoardError, Event, NewTask, OpenOptions, TaskId};
use runwarden::config::Scheduling;
use serde_json::json;

const T: i64 = 1_700_000_000_000;

fn note(n: i64) -> serde_json::Value {
    json!({ "n": n })
}

/// A fresh board holding one task.
fn board_with_task() -> (common::board::TempBoard, TaskId) {
    let mut tb = temp_board();
    let task = tb
        .board
        .write(|tx| tx.create_task(&NewTask::titled("t"), T))
        .unwrap()
        .id;
    (tb, task)
}

fn refused() -> BoardError {
    BoardError::Conflict("refused on purpose".into())
}

#[test]
fn a_refused_op_in_a_batch_is_rolled_back_alone_and_reports_no_event() {
    let (mut tb, task) = board_with_task();
    let ops: Vec<BatchOp<'_, i64>> = vec![
        Box::new(move |tx| tx.append_event(Some(task), None, "note", note(1), T)),
        // Writes, then fails: its write must not survive.
        Box::new(move |tx| {
            tx.append_event(Some(task), None, "doomed", note(2), T)?;
            Err(refused())
        }),
        Box::new(move |tx| tx.append_event(Some(task), None, "note", note(3), T)),
    ];
    let committed = tb.board.write_batch(ops).unwrap();
    // Only a savepoint can undo op 2's write alone: the batch was applied a second time.
    assert!(committed.retried);

    assert_eq!(committed.results.len(), 3);
    let first = *committed.results[0].as_ref().expect("op 1 commits");
    assert!(matches!(committed.results[1], Err(BoardError::Conflict(_))));
    let third = *committed.results[2].as_ref().expect("op 3 commits");

    let reported: Vec<(i64, &str, i64)> = committed
        .events
        .iter()
        .map(|e| (e.id, e.kind.as_str(), e.payload["n"].as_i64().unwrap()))
        .collect();
    assert_eq!(reported, vec![(first, "note", 1), (third, "note", 3)]);
    // The rolled-back insert's id is reused: the reported ids follow on with no gap.
    assert_eq!(third, first + 1);
    assert_eq!(kinds(&mut tb.board, task), ["created", "note", "note"]);
    // What was reported is what the board holds, field for field.
    let stored = events_of(&mut tb.board, task, "note");
    assert_eq!(stored, committed.events);
}

#[test]
fn an_op_refused_before_it_writes_costs_no_second_attempt() {
    let (mut tb, task) = board_with_task();
    let calls: Arc<[AtomicUsize; 3]> = Arc::new(Default::default());
    let counted = |i: usize| {
        let calls = calls.clone();
        move || calls[i].fetch_add(1, Ordering::Relaxed)
    };
    let (c0, c1, c2) = (counted(0), counted(1), counted(2));
    let ops: Vec<BatchOp<'_, i64>> = vec![
        Box::new(move |tx| {
            c0();
            tx.append_event(Some(task), None, "note", note(1), T)
        }),
        // Reads, then refuses, as a transition's checks do: nothing to undo.
        Box::new(move |tx| {
            c1();
            tx.get_task(task)?;
            Err(refused())
        }),
        Box::new(move |tx| {
            c2();
            tx.append_event(Some(task), None, "note", note(3), T)
        }),
    ];
    let committed = tb.board.write_batch(ops).unwrap();
    assert!(!committed.retried);
    assert!(committed.results[0].is_ok());
    assert!(matches!(committed.results[1], Err(BoardError::Conflict(_))));
    assert!(committed.results[2].is_ok());
    let each: Vec<usize> = calls.iter().map(|c| c.load(Ordering::Relaxed)).collect();
    assert_eq!(each, [1, 1, 1], "every op applied once");
    let reported: Vec<i64> = committed
        .events
        .iter()
        .map(|e| e.payload["n"].as_i64().unwrap())
        .collect();
    assert_eq!(reported, [1, 3]);
    assert_eq!(kinds(&mut tb.board, task), ["created", "note", "note"]);
}

#[test]
fn a_write_undone_inside_a_refused_op_still_counts_as_written() {
    let (mut tb, task) = board_with_task();
    let ops: Vec<BatchOp<'_, i64>> = vec![
        Box::new(move |tx| tx.append_event(Some(task), None, "note", note(1), T)),
        // Its own savepoint undid its write, yet "wrote nothing" cannot be told from the count
        // of changes: the cautious answer, a second attempt op by op.
        Box::new(move |tx| {
            let _ = tx.nested(|tx| {
                tx.append_event(Some(task), None, "doomed", note(2), T)?;
                Err::<i64, _>(refused())
            });
            Err(refused())
        }),
    ];
    let committed = tb.board.write_batch(ops).unwrap();
    assert!(committed.retried);
    assert!(committed.results[0].is_ok());
    assert!(matches!(committed.results[1], Err(BoardError::Conflict(_))));
    assert_eq!(committed.events.len(), 1);
    assert_eq!(kinds(&mut tb.board, task), ["created", "note"]);
}

#[test]
fn a_lone_refused_op_leaves_nothing_and_the_board_stays_writable() {
    let (mut tb, task) = board_with_task();
    let ops: Vec<BatchOp<'_, i64>> = vec![Box::new(move |tx| {
        tx.append_event(Some(task), None, "doomed", note(1), T)?;
        Err(refused())
    })];
    let committed = tb.board.write_batch(ops).unwrap();
    // A lone op's failure is its own answer: nothing to apply a second time.
    assert!(!committed.retried);
    assert!(matches!(
        committed.results[..],
        [Err(BoardError::Conflict(_))]
    ));
    assert!(committed.events.is_empty());
    assert_eq!(kinds(&mut tb.board, task), ["created"]);

    // The failed batch left no transaction open behind it.
    let ops: Vec<BatchOp<'_, i64>> = vec![Box::new(move |tx| {
        tx.append_event(Some(task), None, "note", note(2), T)
    })];
    let committed = tb.board.write_batch(ops).unwrap();
    assert!(committed.results[0].is_ok());
    assert_eq!(committed.events.len(), 1);
    assert_eq!(kinds(&mut tb.board, task), ["created", "note"]);
}

#[test]
fn a_failed_nested_step_drops_its_events_but_not_its_ops() {
    let (mut tb, task) = board_with_task();
    // Whether each attempt of the op saw itself void after the failed step.
    let void = std::cell::RefCell::new(Vec::new());
    let op = |tx: &runwarden::board::Tx<'_>| {
        let inner = tx.nested(|tx| {
            tx.append_event(Some(task), None, "inner", note(1), T)?;
            Err::<(), _>(refused())
        });
        assert!(inner.is_err());
        void.borrow_mut().push(tx.attempt_void());
        tx.append_event(Some(task), None, "outer", note(2), T)
    };
    // Once alone (no savepoint around the op) and once beside another op (one each).
    for batch_len in [1usize, 2] {
        let mut ops: Vec<BatchOp<'_, i64>> = vec![Box::new(op)];
        if batch_len == 2 {
            ops.push(Box::new(move |tx| {
                tx.append_event(Some(task), None, "other", note(3), T)
            }));
        }
        let committed = tb.board.write_batch(ops).unwrap();
        // The first attempt takes no savepoint for the nested step either; the step wrote
        // before failing, so only the op-by-op attempt could undo it alone.
        assert!(committed.retried, "batch of {batch_len}");
        let reported: Vec<&str> = committed.events.iter().map(|e| e.kind.as_str()).collect();
        let expected: &[&str] = if batch_len == 1 {
            &["outer"]
        } else {
            &["outer", "other"]
        };
        assert_eq!(reported, expected);
        // The first attempt (no savepoint) is void; the op-by-op one is not.
        assert_eq!(void.take(), [true, false], "batch of {batch_len}");
    }
    assert_eq!(
        kinds(&mut tb.board, task),
        ["created", "outer", "outer", "other"]
    );
}

#[test]
fn a_nested_step_refused_before_it_writes_costs_no_second_attempt() {
    let (mut tb, task) = board_with_task();
    let ops: Vec<BatchOp<'_, i64>> = vec![
        Box::new(move |tx| {
            // Refused by a check, before any write (as the board's claims are).
            let inner = tx.nested(|tx| {
                tx.task_events_since(task, 0, 10)?;
                Err::<(), _>(refused())
            });
            assert!(inner.is_err());
            tx.append_event(Some(task), None, "outer", note(1), T)
        }),
        Box::new(move |tx| tx.append_event(Some(task), None, "other", note(2), T)),
    ];
    let committed = tb.board.write_batch(ops).unwrap();
    assert!(!committed.retried, "nothing to undo, so no second attempt");
    assert!(committed.results.iter().all(|r| r.is_ok()));
    let reported: Vec<&str> = committed.events.iter().map(|e| e.kind.as_str()).collect();
    assert_eq!(reported, ["outer", "other"]);
    assert_eq!(kinds(&mut tb.board, task), ["created", "outer", "other"]);
}

#[test]
fn what_an_op_does_after_a_failed_nested_step_never_sees_that_steps_writes() {
    let (mut tb, task) = board_with_task();
    // Refuses if the undone step's event is visible: as with a savepoint it must not be,
    // although the first attempt ran the step with none.
    let op = move |tx: &runwarden::board::Tx<'_>| {
        let _ = tx.nested(|tx| {
            tx.append_event(Some(task), None, "inner", note(1), T)?;
            Err::<(), _>(refused())
        });
        let seen = tx.task_events_since(task, 0, 100)?;
        if seen.iter().any(|e| e.kind == "inner") {
            return Err(BoardError::Conflict("saw an undone write".into()));
        }
        tx.append_event(Some(task), None, "outer", note(2), T)
    };
    // Alone: a lone op's error is normally its answer as it stands — not this one.
    let committed = tb.board.write_batch(vec![Box::new(op)]).unwrap();
    assert!(committed.retried);
    assert!(
        committed.results[0].is_ok(),
        "{:?}",
        committed.results[0].as_ref().err()
    );
    assert_eq!(kinds(&mut tb.board, task), ["created", "outer"]);
}

/// Runs `f` with a StoreActor on `path` inside its own actix system; flushes it afterwards.
fn with_store<T: 'static>(
    path: std::path::PathBuf,
    f: impl AsyncFnOnce(runwarden::actors::store::Store) -> T + 'static,
) -> T {
    let system = actix::System::new();
    let out = system.block_on(async move {
        let store = StoreActor::start_on(path, OpenOptions::default(), Scheduling::Normal)
            .expect("start the store");
        let out = f(store.clone()).await;
        store.addr.send(Flush).await.expect("flush the store");
        out
    });
    actix::System::current().stop();
    system.run().expect("stop the actix system");
    out
}

/// Takes every event already published on `feed` (the store publishes before it replies).
fn drain(feed: &mut EventFeed) -> Vec<Arc<Event>> {
    let mut out = Vec::new();
    loop {
        match feed.try_recv() {
            Ok(ev) => out.push(ev),
            Err(tokio::sync::broadcast::error::TryRecvError::Empty) => return out,
            Err(e) => panic!("event feed: {e}"),
        }
    }
}

/// Every task's title on the board, sorted.
fn sorted_titles(mut board: runwarden::board::Board) -> Vec<String> {
    let mut titles: Vec<String> = board
        .read(|tx| tx.list_tasks(&Default::default()))
        .unwrap()
        .into_iter()
        .map(|t| t.title)
        .collect();
    titles.sort();
    titles
}

/// An op holding the store's writer (see [`hold_the_writer`]).
struct Held {
    open: Arc<(Mutex<bool>, Condvar)>,
    op: actix_rt::task::JoinHandle<Result<(), runwarden::actors::store::StoreError>>,
}

impl Held {
    /// Lets the writer go on, and waits for the holding op's own commit.
    async fn release(self) {
        *self.open.0.lock().unwrap() = true;
        self.open.1.notify_all();
        self.op.await.unwrap().unwrap();
    }
}

/// Holds the writer in an op until [`Held::release`], so that the ops sent meanwhile queue
/// behind it and share one batch. The op may itself be applied again: once open, it stays
/// open.
async fn hold_the_writer(store: &runwarden::actors::store::Store) -> Held {
    let open = Arc::new((Mutex::new(false), Condvar::new()));
    let (entered_tx, entered_rx) = std::sync::mpsc::channel::<()>();
    let entered_tx = Mutex::new(entered_tx);
    let op = {
        let (store, open) = (store.clone(), open.clone());
        actix_rt::spawn(async move {
            store
                .with_tx(move |_, _| {
                    let _ = entered_tx.lock().unwrap().send(());
                    let (lock, cv) = &*open;
                    let mut go = lock.lock().unwrap();
                    while !*go {
                        go = cv.wait(go).unwrap();
                    }
                    Ok(())
                })
                .await
        })
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while entered_rx.try_recv().is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the writer never ran the holding op"
        );
        actix_rt::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    Held { open, op }
}

#[test]
fn the_store_counts_a_batch_applied_twice_and_answers_each_caller() {
    let tb = temp_board();
    let (results, stats) = with_store(tb.path.clone(), async move |store| {
        let held = hold_the_writer(&store).await;
        let good = |title: &'static str| {
            let store = store.clone();
            async move {
                store
                    .with_tx(move |tx, now| Ok(tx.create_task(&NewTask::titled(title), now)?.id))
                    .await
            }
            .boxed_local()
        };
        let doomed = {
            let store = store.clone();
            async move {
                store
                    .with_tx(|tx, now| {
                        // Writes, then is refused: only a savepoint can undo it alone.
                        tx.create_task(&NewTask::titled("doomed"), now)?;
                        tx.complete_task(1_000_000, None, None, now)?;
                        unreachable!("completing an unknown task must be refused");
                    })
                    .await
            }
            .boxed_local()
        };
        let mut calls = [good("first"), doomed, good("last")];
        // Polled once each: their ops are in the writer's queue, behind the gate.
        for call in calls.iter_mut() {
            assert!(futures::poll!(call.as_mut()).is_pending());
        }
        held.release().await;
        let mut results = Vec::new();
        for call in calls {
            results.push(call.await);
        }
        (results, store.stats())
    });
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    let err = results[1].as_ref().expect_err("the doomed op is refused");
    assert_eq!(err.code, "not_found", "{err}");
    assert_eq!(stats.retried, 1, "{stats:?}");
    assert_eq!(
        stats.batches, 2,
        "the gate, then the three together: {stats:?}"
    );
    let titles = sorted_titles(tb.board);
    assert_eq!(titles, ["first", "last"], "nothing of the doomed op stands");
}

#[test]
fn concurrent_callers_each_get_their_own_result_and_subscribers_see_only_committed_events() {
    const CALLERS: usize = 64;
    let tb = temp_board();
    let path = tb.path.clone();
    let (results, published) = with_store(path, async move |store| {
        let mut feed = store.subscribe();
        let calls = (0..CALLERS).map(|i| {
            let store = store.clone();
            async move {
                store
                    .with_tx(move |tx, now| {
                        if i % 8 == 7 {
                            // Writes (a task and its event), then a transition the board
                            // refuses (an unknown task): all of it must be undone.
                            tx.create_task(&NewTask::titled(format!("doomed {i}")), now)?;
                            tx.complete_task(1_000_000 + i as TaskId, None, None, now)?;
                            unreachable!("completing an unknown task must be refused");
                        }
                        Ok(tx.create_task(&NewTask::titled(format!("t{i}")), now)?.id)
                    })
                    .await
            }
        });
        let results = futures::future::join_all(calls).await;
        (results, drain(&mut feed))
    });

    let mut created = Vec::new();
    for (i, r) in results.iter().enumerate() {
        if i % 8 == 7 {
            let err = r.as_ref().expect_err("the refused caller gets its error");
            assert_eq!(err.code, "not_found", "caller {i}: {err}");
        } else {
            created.push(*r.as_ref().unwrap_or_else(|e| panic!("caller {i}: {e}")));
        }
    }
    assert_eq!(created.len(), CALLERS - CALLERS / 8);

    // Exactly one `created` event per successful caller, in id order, with no gap.
    let ids: Vec<i64> = published.iter().map(|e| e.id).collect();
    assert_eq!(ids.len(), created.len(), "published: {ids:?}");
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "ids: {ids:?}");
    assert!(published.iter().all(|e| e.kind == "created"));
    let mut tasks: Vec<TaskId> = published.iter().map(|e| e.task_id.unwrap()).collect();
    tasks.sort_unstable();
    created.sort_unstable();
    assert_eq!(tasks, created);
}

#[test]
fn events_written_beside_the_store_are_published_too_in_order() {
    let tb = temp_board();
    let path = tb.path.clone();
    let published = with_store(path.clone(), async move |store| {
        let mut feed = store.subscribe();
        let first = store
            .with_tx(|tx, now| Ok(tx.create_task(&NewTask::titled("a"), now)?.id))
            .await
            .unwrap();
        // Another connection appends behind the store's back (an older supervisor's
        // leftover, a repair by hand): the store's own record of its batch then does not
        // follow on from what it last published, and it must not skip the stranger.
        let mut other = runwarden::board::Board::open(&path).unwrap();
        other
            .write(|tx| tx.append_event(Some(first), None, "by_hand", json!({}), T))
            .unwrap();
        drop(other);
        store
            .with_tx(|tx, now| Ok(tx.create_task(&NewTask::titled("b"), now)?.id))
            .await
            .unwrap();
        // The feed is filled before the reply: no wait here, or a break of that would hide.
        drain(&mut feed)
    });
    let seen: Vec<(i64, &str)> = published.iter().map(|e| (e.id, e.kind.as_str())).collect();
    assert_eq!(seen.len(), 3, "published: {seen:?}");
    assert_eq!(
        seen.iter().map(|s| s.1).collect::<Vec<_>>(),
        ["created", "by_hand", "created"]
    );
    assert!(seen.windows(2).all(|w| w[1].0 == w[0].0 + 1), "{seen:?}");
}

#[test]
fn a_full_disk_fails_the_batch_cleanly_and_the_board_goes_on() {
    let (mut tb, task) = board_with_task();
    // Room for small rows in the pages the board has, none for a new page: a "full disk" for
    // any op that needs one (SQLITE_FULL, the same error a full file system gives). SQLite
    // clamps the limit to the board's current size. (The pragma answers with a row, which
    // `execute_raw` reports as an error after applying it.)
    let _ = tb.board.execute_raw("PRAGMA max_page_count = 1", []);
    let big = "x".repeat(64 * 1024);
    let ops: Vec<BatchOp<'_, i64>> = vec![
        Box::new(move |tx| tx.append_event(Some(task), None, "small", note(1), T)),
        Box::new(move |tx| tx.comment(task, "me", &big, T)),
        Box::new(move |tx| tx.append_event(Some(task), None, "small", note(3), T)),
    ];
    // SQLite rolls the whole transaction back on SQLITE_FULL: the batch fails as one, with a
    // clear code, and nothing of it — not even the op after the failing one — is durable.
    let err = tb
        .board
        .write_batch(ops)
        .expect_err("the full disk fails the batch");
    assert_eq!(err.code(), "disk_full", "{err}");
    assert_eq!(kinds(&mut tb.board, task), ["created"]);

    // Alone, the op that needs the space gets its own clear error; small writes go on.
    let big = "x".repeat(64 * 1024);
    let ops: Vec<BatchOp<'_, i64>> = vec![Box::new(move |tx| tx.comment(task, "me", &big, T))];
    let committed = tb
        .board
        .write_batch(ops)
        .expect("a lone op's failure is its own");
    assert!(matches!(&committed.results[..], [Err(e)] if e.code() == "disk_full"));
    let ops: Vec<BatchOp<'_, i64>> = vec![
        Box::new(move |tx| tx.append_event(Some(task), None, "small", note(4), T)),
        Box::new(move |tx| tx.append_event(Some(task), None, "small", note(5), T)),
    ];
    let committed = tb.board.write_batch(ops).expect("small writes still fit");
    assert!(committed.results.iter().all(|r| r.is_ok()));
    assert_eq!(kinds(&mut tb.board, task), ["created", "small", "small"]);
}

/// A store op that panics (a closure an embedding program gave `Store::with_tx`, or a bug)
/// fails alone: its batch is rolled back as the panic unwinds and applied again op by op, so
/// the ops sharing its batch commit, it gets `internal`, nothing it wrote stands, and the
/// writer goes on serving. (Before, the writer thread died with it: every later write was
/// `unavailable` while the process lived on.)
#[test]
fn a_panicking_op_fails_alone_and_the_writer_goes_on() {
    let tb = temp_board();
    let results = with_store(tb.path.clone(), async move |store| {
        let held = hold_the_writer(&store).await;
        let call = |title: &'static str, panics: bool| {
            let store = store.clone();
            async move {
                store
                    .with_tx(move |tx, now| {
                        let id = tx.create_task(&NewTask::titled(title), now)?.id;
                        if panics {
                            panic!("an op that panics after writing");
                        }
                        Ok(id)
                    })
                    .await
            }
            .boxed_local()
        };
        let mut calls = [
            call("first", false),
            call("boom", true),
            call("last", false),
        ];
        for c in calls.iter_mut() {
            assert!(futures::poll!(c.as_mut()).is_pending());
        }
        held.release().await;
        let mut results = Vec::new();
        for c in calls {
            results.push(c.await);
        }
        // The writer is alive: a write after the panic commits.
        results.push(call("after", false).await);
        results
    });
    assert!(
        results[0].is_ok() && results[2].is_ok() && results[3].is_ok(),
        "{results:?}"
    );
    let err = results[1].as_ref().expect_err("the panicking op fails");
    assert_eq!(err.code, "internal", "{err}");
    let titles = sorted_titles(tb.board);
    assert_eq!(
        titles,
        ["after", "first", "last"],
        "nothing of the panicking op stands"
    );
}
