//! `events` with `follow` delivers every event in order, with no gap and no duplicate, while a
//! thousand tasks run: followed from id 0 until all are done, the stream equals the log read
//! back afterwards. A second follower joins in the middle of the run (backlog and live feed
//! overlap then) and must agree too.
//!
//! And the stream's limits: at most four per connection; a client that half-closes keeps its
//! streams, one that closes frees its slot; a slow reader is served in full however long it
//! takes, while one that stops reading is cut off after `idle_timeout` and frees its slot.

#[allow(dead_code)]
mod common;

use std::collections::HashSet;
use std::io::Read;
use std::net::Shutdown;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::control_daemon::{Daemon, RawConn, SETTLE, add_tasks, big_task, error_code};
use common::proc_guard::wait_until;
use runwarden::board::{Event, EventId, NewTask, TaskId};
use runwarden::control::client::{Client, ClientError};
use runwarden::control::protocol::{Events, Request, Response};

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

/// True when a new client gets a slot and is served.
fn served(d: &Daemon) -> bool {
    Client::connect(&d.socket)
        .and_then(|mut c| c.hello())
        .is_ok()
}

/// A client served as soon as a slot is free (a closed connection frees its slot once the
/// server has seen the close).
fn client_when_free(d: &Daemon) -> Client {
    let mut client = None;
    assert!(
        wait_until(SETTLE, || {
            client = Client::connect(&d.socket)
                .and_then(|mut c| c.hello().map(|_| c))
                .ok();
            client.is_some()
        }),
        "no slot freed"
    );
    client.unwrap()
}

#[test]
fn a_connection_may_follow_at_most_four_streams() {
    let mut d = Daemon::start("", "");
    let mut c = d.raw();
    c.hello();
    for id in 1..=4 {
        let r = c.call(&format!(r#"{{"id":{id},"op":"events","follow":true}}"#));
        assert_eq!(r["result"]["following"], true, "{r}");
    }
    let r = c.call(r#"{"id":5,"op":"events","follow":true}"#);
    assert_eq!(error_code(&r), "too_many_streams", "{r}");
    assert_eq!(r["id"], 5);
    // The connection goes on, and its four streams still deliver.
    d.client().add_task(&NewTask::titled("one")).unwrap();
    let mut got = HashSet::new();
    while got.len() < 4 {
        let ev = c.recv().expect("an event on each stream");
        assert_eq!(ev["event"]["kind"], "created", "{ev}");
        assert!(
            got.insert(ev["id"].as_u64().unwrap()),
            "one event per stream: {ev}"
        );
    }
    assert_eq!(got, (1..=4).collect());
    let r = c.call(r#"{"id":6,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
    d.assert_healthy();
}

#[test]
fn a_half_closed_client_keeps_its_streams_and_a_closed_one_frees_its_slot() {
    // Two slots: the follower's, and the adder's. The default idle timeout (30 s) is far
    // longer than any wait below.
    let mut d = Daemon::start("", "[control]\nmax_connections = 2\n");
    let mut f = d.raw();
    f.hello();
    // A follow and a status, then the end of the client's input (`socat` when its stdin ends).
    f.send(b"{\"id\":1,\"op\":\"events\",\"follow\":true}\n{\"id\":2,\"op\":\"status\"}\n");
    f.writer.shutdown(Shutdown::Write).unwrap();
    assert_eq!(f.recv().unwrap()["result"]["following"], true);
    assert_eq!(
        f.recv().unwrap()["id"],
        2,
        "a request sent before the half-close is answered"
    );
    let mut adder = d.client();
    adder
        .add_task(&NewTask::titled("after the half-close"))
        .unwrap();
    let ev = f.recv().expect("events still come after the half-close");
    assert_eq!(ev["id"], 1, "{ev}");
    assert_eq!(ev["event"]["kind"], "created", "{ev}");

    // Closed altogether, with no event to write that would show it: the slot is freed anyway.
    drop(f);
    assert!(
        wait_until(Duration::from_secs(10), || served(&d)),
        "a closed follower still holds its slot"
    );
    adder.status().expect("the adder is still served");
    d.assert_healthy();
}

/// Reads `lines` lines at about 640 KiB/s (16 KiB per 25 ms): slowly, but never stuck.
fn read_lines_slowly(c: &mut RawConn, lines: usize) -> Vec<serde_json::Value> {
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut chunk = vec![0; 16 * 1024];
    while out.len() < lines {
        let n = c.reader.read(&mut chunk).expect("read");
        assert!(n > 0, "closed after {} of {lines} lines", out.len());
        buf.extend_from_slice(&chunk[..n]);
        while let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            out.push(serde_json::from_slice(&line).expect("a JSON line"));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(buf.is_empty(), "more than {lines} lines");
    out
}

#[test]
fn a_slow_but_steady_reader_is_served_in_full() {
    let idle = Duration::from_millis(500);
    let mut d = Daemon::start("", "[control]\nidle_timeout = \"500ms\"\n");
    // 40 tasks of 2 × 32 KiB: a 2.5 MiB `list_tasks` reply, and 1.25 MiB of `created` events.
    let ids = add_tasks(&mut d.client(), (0..40).map(|i| big_task(i, 32 * 1024)));
    let mut c = d.raw();
    c.hello();
    let start = Instant::now();
    c.send(b"{\"id\":1,\"op\":\"list_tasks\"}\n");
    let reply = read_lines_slowly(&mut c, 1).remove(0);
    assert_eq!(reply["id"], 1);
    assert_eq!(reply["result"]["tasks"].as_array().map(Vec::len), Some(40));
    // The same through a stream: the backlog of a `watch --since 0`.
    c.send(b"{\"id\":2,\"op\":\"events\",\"follow\":true}\n");
    let lines = read_lines_slowly(&mut c, 1 + ids.len());
    assert_eq!(lines[0]["result"]["following"], true, "{}", lines[0]);
    let created: Vec<i64> = lines[1..]
        .iter()
        .map(|l| {
            assert_eq!(l["id"], 2, "{l}");
            l["event"]["task_id"].as_i64().unwrap()
        })
        .collect();
    assert_eq!(created, ids, "every event, in order");
    // The premise: the transfer took many idle timeouts, so no timeout may cover it whole.
    assert!(
        start.elapsed() > 4 * idle,
        "too fast to matter: {:?}",
        start.elapsed()
    );
    let r = c.call(r#"{"id":3,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
    d.assert_healthy();
}

#[test]
fn a_follower_that_stops_reading_is_cut_off_and_its_slot_freed() {
    // One slot, so a newcomer is served only once the stuck follower's slot is free.
    let mut d = Daemon::start(
        "",
        "[control]\nidle_timeout = \"500ms\"\nmax_connections = 1\n",
    );
    // 64 `created` events of 32 KiB each: far more than the socket buffers hold.
    add_tasks(
        &mut client_when_free(&d),
        (0..64).map(|i| big_task(i, 32 * 1024)),
    );
    let mut stuck = client_when_free(&d);
    stuck
        .send(&Request::Events(Events {
            follow: true,
            ..Events::default()
        }))
        .unwrap();
    stuck.flush().unwrap();
    let start = Instant::now();
    // It never reads: the writes stall, the server gives up after idle_timeout, and the slot
    // is free at once, although the connection has a stream open and said nothing more.
    assert!(
        wait_until(Duration::from_secs(10), || served(&d)),
        "the stuck follower's slot was never freed"
    );
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(400),
        "freed before a write could have been stuck for idle_timeout: {waited:?}"
    );
    // The server closed its end: past what the socket buffers held, the client reads the end.
    stuck.set_read_timeout(Some(SETTLE)).unwrap();
    loop {
        match stuck.recv() {
            Ok(_) => continue,
            Err(ClientError::Closed) => break,
            Err(e) => panic!("expected the end of the stream, got {e:?}"),
        }
    }
    d.assert_healthy();
}
