//! `events` with `follow` delivers every event in order, with no gap and no duplicate, while a
//! thousand tasks run: followed from id 0 until all are done, the stream equals the log read
//! back afterwards. A second follower joins in the middle of the run (backlog and live feed
//! overlap then) and must agree too.

#[allow(dead_code)]
mod common;

use std::collections::HashSet;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::control_daemon::Daemon;
use runwarden::board::{Event, EventId, NewTask, TaskId};
use runwarden::control::client::{Client, ClientError};
use runwarden::control::protocol::{Request, Response};

const TASKS: usize = 1000;
/// Bound for the whole run (1000 `true` workers, 8 at a time, on 2 cores).
const BUDGET: Duration = Duration::from_secs(120);

/// Follows from `since` until every task in `expect` has a `completed` event.
fn follow_until_done(
    mut client: Client,
    since: EventId,
    expect: mpsc::Receiver<HashSet<TaskId>>,
) -> Vec<Event> {
    let mut seen = Vec::new();
    let mut completed = HashSet::new();
    let mut expected: Option<HashSet<TaskId>> = None;
    let deadline = Instant::now() + BUDGET;
    let mut stream = client.follow_events(since, None).expect("follow");
    stream
        .set_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    loop {
        if expected.is_none() {
            expected = expect.try_recv().ok();
        }
        if let Some(ids) = &expected
            && ids.is_subset(&completed)
        {
            return seen;
        }
        assert!(
            Instant::now() < deadline,
            "not all tasks completed in {BUDGET:?}"
        );
        match stream.next() {
            Some(Ok(ev)) => {
                if ev.kind == "completed" {
                    completed.insert(ev.task_id.unwrap());
                }
                seen.push(ev);
            }
            Some(Err(ClientError::Timeout)) => continue,
            other => panic!("the stream ended: {other:?}"),
        }
    }
}

#[test]
fn follow_delivers_every_event_in_order_while_a_thousand_tasks_run() {
    let mut d = Daemon::start(
        "max_in_progress = 8\nsynchronous = \"normal\"",
        "[assignees.t]\ncommand = [\"true\"]\nmax_in_progress = 8\n",
    );
    let (tx_all, rx_all) = mpsc::channel();
    let from_start = {
        let client = d.client();
        std::thread::spawn(move || follow_until_done(client, 0, rx_all))
    };
    // Add them pipelined (in windows), so the board is busy while both followers read.
    let mut c = d.client();
    let mut ids = HashSet::new();
    let mut late = None;
    let mut pending = 0;
    for i in 0..TASKS {
        c.send(&Request::AddTask(
            NewTask::titled(format!("t{i}")).for_assignee("t"),
        ))
        .unwrap();
        pending += 1;
        if pending == 100 || i + 1 == TASKS {
            for _ in 0..pending {
                match c.recv().unwrap() {
                    Response::Ok { result, .. } => {
                        ids.insert(result["id"].as_i64().unwrap());
                    }
                    other => panic!("add refused: {other:?}"),
                }
            }
            pending = 0;
        }
        if i == TASKS / 2 {
            // The second follower starts half-way, from id 0: a long backlog, then live.
            let (tx, rx) = mpsc::channel();
            let client = d.client();
            late = Some((
                tx,
                std::thread::spawn(move || follow_until_done(client, 0, rx)),
            ));
        }
    }
    let (tx_late, late) = late.unwrap();
    tx_all.send(ids.clone()).unwrap();
    tx_late.send(ids.clone()).unwrap();
    let streamed = from_start.join().expect("follower");
    let streamed_late = late.join().expect("late follower");

    let log = d.client().events(0, None).unwrap();
    for (name, s) in [("from start", &streamed), ("late", &streamed_late)] {
        assert!(!s.is_empty());
        // Strictly increasing, and exactly the log's prefix: no gap, no duplicate, no reorder.
        assert!(
            s.windows(2).all(|w| w[0].id < w[1].id),
            "{name}: ids not strictly increasing"
        );
        assert_eq!(s[0].id, 1, "{name}: starts at the first event");
        let prefix: Vec<EventId> = log.iter().take(s.len()).map(|e| e.id).collect();
        let got: Vec<EventId> = s.iter().map(|e| e.id).collect();
        assert_eq!(got, prefix, "{name}: stream differs from the log");
        assert_eq!(
            s.as_slice(),
            &log[..s.len()],
            "{name}: event contents differ"
        );
    }
    // Ids are contiguous in the log itself (one writer, one sequence).
    assert!(
        log.windows(2).all(|w| w[1].id == w[0].id + 1),
        "the log has gaps"
    );
    let done = log.iter().filter(|e| e.kind == "completed").count();
    assert_eq!(done, TASKS);
    d.assert_healthy();
}
