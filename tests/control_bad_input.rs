//! Bad input on the control socket: each gets its documented answer, the daemon keeps serving
//! everyone else, and it never panics.
//!
//! - malformed JSON, invalid UTF-8, an unknown op, wrong field types: `bad_request` naming
//!   what was wrong, and the same connection goes on;
//! - a line over `max_request_bytes`: `too_large`, then the connection is closed;
//! - a client silent for `idle_timeout`: `idle_timeout`, then closed;
//! - connections beyond `max_connections`: one `too_many_connections` line, then closed;
//! - a string `id` over 256 bytes: `bad_request` with `"id":null`;
//! - a `list_tasks` limit over 10000: clamped to 10000; a list whose task text is over 16 MiB:
//!   cut to the newest that fit, marked `truncated`; an `events` page over 16 MiB of payloads:
//!   cut, with `more`; a `show_task` whose comments or events are over a third of that each:
//!   the oldest left out and counted (`omitted_comments`, `omitted_events`);
//! - a client that sends requests but does not read the replies: the server stops reading
//!   it once 8 MiB of replies wait, and answers everything once the client reads;
//! - a client that pipelines small writes answered with a big task (`block`/`unblock` of a
//!   task with a large body) and does not read: at most a few are in flight at once, so the
//!   supervisor's memory stays small, and every one is answered once the client reads;
//! - a task for an assignee the config does not have: `bad_request` naming the configured
//!   ones (library: `SupervisorError::UnknownAssignee`), nothing added.

#[allow(dead_code)]
mod common;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::control_daemon::{Daemon, RawConn, SETTLE, add_tasks, big_task, error_code};
use runwarden::board::{NewTask, TaskFilter};

/// A daemon with a short idle timeout, so the idle test takes half a second.
fn daemon() -> Daemon {
    Daemon::start("", "[control]\nidle_timeout = \"500ms\"\n")
}

fn message(v: &serde_json::Value) -> &str {
    v["error"]["message"].as_str().unwrap_or("")
}

#[test]
fn malformed_lines_get_bad_request_and_the_connection_goes_on() {
    let mut d = daemon();
    let mut c = d.raw();
    c.hello();

    let r = c.call("{\"id\":1,\"op\":");
    assert_eq!(error_code(&r), "bad_request");
    assert!(message(&r).starts_with("malformed JSON"), "{r}");
    assert_eq!(r["id"], serde_json::Value::Null);

    c.send(b"{\"id\":2,\"op\":\"status\",\"x\":\"\xff\xfe\"}\n");
    let r = c.recv().unwrap();
    assert_eq!(error_code(&r), "bad_request");
    assert!(message(&r).contains("not valid UTF-8"), "{r}");

    let r = c.call(r#"{"id":3,"op":"teleport","task":1}"#);
    assert_eq!(error_code(&r), "bad_request");
    assert_eq!(r["id"], 3);
    assert!(message(&r).contains("unknown op `teleport`"), "{r}");

    let r = c.call(r#"{"id":4,"op":"show_task","task":"seven"}"#);
    assert_eq!(error_code(&r), "bad_request");
    assert!(message(&r).contains("field `task`"), "names the field: {r}");

    let r = c.call(r#"{"id":5,"op":"add_task","title":"t","priority":"high"}"#);
    assert!(message(&r).contains("field `priority`"), "{r}");
    let r = c.call(r#"{"id":6,"op":"add_task","title":"t","urgent":true}"#);
    assert!(message(&r).contains("unknown field `urgent`"), "{r}");
    let r = c.call(r#"{"id":7,"op":"list_tasks","status":"sleeping"}"#);
    assert!(
        message(&r).contains("field `status`") && message(&r).contains("sleeping"),
        "{r}"
    );
    let r = c.call(r#"{"id":8,"op":"events","follow":"yes"}"#);
    assert!(message(&r).contains("field `follow`"), "{r}");
    let r = c.call(r#"{"id":9,"op":"complete"}"#);
    assert!(message(&r).contains("missing field `task`"), "{r}");
    let r = c.call(r#"{"id":{"a":1},"op":"status"}"#);
    assert!(message(&r).contains("field `id`"), "{r}");
    for (id, says) in [("-1", "a negative number"), ("1.5", "a fraction")] {
        let r = c.call(&format!(r#"{{"id":{id},"op":"status"}}"#));
        assert!(
            message(&r).contains("field `id`") && message(&r).contains(says),
            "{r}"
        );
    }
    let r = c.call(r#"{"id":10,"op":5}"#);
    assert!(message(&r).contains("field `op`"), "{r}");
    let r = c.call("[1,2,3]");
    assert!(message(&r).contains("JSON object"), "{r}");

    // Blank lines are ignored; the connection still works.
    c.send(b"\n\r\n");
    let r = c.call(r#"{"id":11,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["id"], 11);
    d.assert_healthy();
}

#[test]
fn an_oversized_line_gets_too_large_and_is_closed() {
    let mut d = daemon();
    let mut c = d.raw();
    c.hello();
    // 2 MiB without a newline, written from a thread: the server stops taking it as a request
    // after 1 MiB, answers and closes (the rest of our write is read and dropped first, or
    // fails if the server has closed: either is fine here).
    let mut w = c.writer.try_clone().unwrap();
    let writer = std::thread::spawn(move || {
        let big = vec![b'x'; 2 * 1024 * 1024];
        let _ = w.write_all(&big);
        let _ = w.write_all(b"\n");
    });
    let r = c.recv().expect("an answer before the close");
    assert_eq!(error_code(&r), "too_large");
    assert!(message(&r).contains("1048576"), "{r}");
    assert!(c.closed(), "the connection is closed after too_large");
    writer.join().unwrap();

    // Twice the limit, all of it written before we read (the server reads what it will not
    // take, so our write completes): the refusal, then the end of the stream, not
    // "connection reset" — a client reading to the end would otherwise lose the refusal to
    // the reset. (Without the drain the write itself fails.)
    let mut c = d.raw();
    c.hello();
    let over = vec![b'x'; 2 * 1024 * 1024 + 64 * 1024];
    c.send(&over);
    let r = c.recv().expect("an answer before the close");
    assert_eq!(error_code(&r), "too_large", "{r}");
    c.ends_cleanly()
        .expect("the connection ends cleanly after too_large");

    // Exactly at the limit is still fine (the newline does not count).
    let mut c = d.raw();
    c.hello();
    let body = "y".repeat(1024 * 1024 - r#"{"id":1,"op":"add_task","title":"t","body":""}"#.len());
    let r = c.call(&format!(
        r#"{{"id":1,"op":"add_task","title":"t","body":"{body}"}}"#
    ));
    assert_eq!(
        r["ok"], true,
        "a line of exactly max_request_bytes is accepted"
    );
    // Ended by CRLF too: the `\r` is not part of the request.
    let r = c.call(&format!(
        "{{\"id\":2,\"op\":\"add_task\",\"title\":\"t\",\"body\":\"{body}\"}}\r"
    ));
    assert_eq!(
        r["ok"], true,
        "a line of max_request_bytes ended by CRLF is accepted: {r}"
    );

    let mut ok = d.client();
    ok.status().expect("a well-behaved client is served");
    d.assert_healthy();
}

/// A client that never says hello cannot keep a connection slot, whether it is silent or keeps
/// sending something else: it is closed 10 s after its connection (the hello wait, under the
/// default 30 s idle timeout), while one that said hello and then went quiet as long is kept.
#[test]
fn a_client_that_never_says_hello_is_closed_after_the_hello_wait() {
    let mut d = Daemon::start("", "");
    let mut quiet = d.raw();
    quiet.hello();
    let mut silent = d.raw();
    let mut chatty = d.raw();
    // Answered (with "send hello first") but no hello: the wait is not reset by it.
    let chat = std::thread::spawn(move || {
        let mut refusals = 0;
        loop {
            if chatty.try_send(b"{\"id\":1,\"op\":\"status\"}\n").is_err() {
                break;
            }
            match chatty.recv() {
                Some(r) if error_code(&r) == "idle_timeout" => return (refusals, Some(r)),
                Some(_) => refusals += 1,
                None => break,
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        (refusals, None)
    });
    // RawConn reads time out at 10 s: wait past that for the line.
    silent
        .reader
        .get_ref()
        .set_read_timeout(Some(Duration::from_secs(25)))
        .unwrap();
    let r = silent.recv().expect("a closing line for the silent client");
    assert_eq!(error_code(&r), "idle_timeout", "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("hello"),
        "{r}"
    );
    assert!(silent.closed());
    let (refusals, last) = chat.join().expect("the chatty client");
    let last = last.expect("the chatty client was never closed for want of a hello");
    assert!(
        refusals >= 5,
        "it kept sending: {refusals} refusals before {last}"
    );
    // Quiet as long, but it said hello: still served.
    let r = quiet.call(r#"{"id":2,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
    d.assert_healthy();
}

#[test]
fn a_silent_client_is_disconnected_after_the_idle_timeout() {
    let mut d = daemon();
    // Silent from the start (no hello either).
    let mut silent = d.raw();
    // Said hello, then silent.
    let mut quiet = d.raw();
    quiet.hello();
    let start = Instant::now();
    for c in [&mut silent, &mut quiet] {
        let r = c.recv().expect("an idle_timeout line");
        assert_eq!(error_code(&r), "idle_timeout", "{r}");
        assert!(c.closed());
    }
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(400),
        "closed too early: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "closed too late: {waited:?}"
    );

    // A client that asked for a reply and never read it (it sits in the socket's buffer) is
    // idle too: closed within two idle periods, not kept because bytes are still unread.
    let mut unread = d.raw();
    unread.hello();
    unread.send(b"{\"id\":1,\"op\":\"status\"}\n");
    let start = Instant::now();
    let mut closed_at = None;
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || {
            // Polled without reading: the server's close shows as a hang-up on our end.
            let fd = std::os::fd::AsRawFd::as_raw_fd(&unread.writer);
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLRDHUP,
                revents: 0,
            };
            // SAFETY: one valid pollfd, no wait.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            let hung_up = n == 1 && p.revents & (libc::POLLRDHUP | libc::POLLHUP) != 0;
            if hung_up {
                closed_at = Some(start.elapsed());
            }
            hung_up
        }),
        "a client sitting on an unread reply was never closed"
    );
    let waited = closed_at.unwrap();
    assert!(
        waited >= Duration::from_millis(400),
        "closed too early: {waited:?}"
    );
    assert_eq!(unread.recv().unwrap()["id"], 1, "the reply was sent");
    assert_eq!(error_code(&unread.recv().unwrap()), "idle_timeout");

    // A client that keeps talking is not idle, and one with a follow stream open is not
    // either even if it sends nothing more.
    let mut chatty = d.client();
    let mut follower = d.raw();
    follower.hello();
    follower.send(b"{\"id\":1,\"op\":\"events\",\"follow\":true}\n");
    assert_eq!(follower.recv().unwrap()["result"]["following"], true);
    for _ in 0..8 {
        std::thread::sleep(Duration::from_millis(150));
        chatty.status().expect("an active client is not cut off");
    }
    chatty
        .add_task(&runwarden::board::NewTask::titled("ping"))
        .unwrap();
    let ev = follower
        .recv()
        .expect("the follower still gets events after the idle timeout");
    assert_eq!(ev["event"]["kind"], "created", "{ev}");
    d.assert_healthy();
}

#[test]
fn connections_beyond_the_limit_are_refused_with_one_line() {
    // The default idle timeout (30 s): the held connections must not time out meanwhile.
    let mut d = Daemon::start("", "");
    let max = 256;
    // Hold max connections (each has said hello, so each holds a slot), then 44 more.
    let mut held: Vec<RawConn> = (0..max)
        .map(|_| {
            let mut c = d.raw();
            c.hello();
            c
        })
        .collect();
    let mut extra: Vec<RawConn> = (0..300 - max).map(|_| d.raw()).collect();
    for c in &mut extra {
        let r = c.recv().expect("one refusal line");
        assert_eq!(error_code(&r), "too_many_connections", "{r}");
        assert!(message(&r).contains("256"), "{r}");
        assert!(c.closed(), "then closed");
    }
    // The held ones still work (the limit refused only the newcomers).
    let r = held[0].call(r#"{"id":1,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
    // Freeing slots lets a well-behaved client in again.
    held.clear();
    let deadline = Instant::now() + SETTLE;
    loop {
        let mut c = d.raw();
        // Still refused, the connection may be closed before the hello is written (EPIPE):
        // the refusal line is read all the same.
        let sent = c.try_send(b"{\"id\":1,\"op\":\"hello\",\"version\":\"1.0\"}\n");
        let r = c.recv().expect("an answer or a refusal");
        if sent.is_ok() && r["ok"] == true {
            break;
        }
        assert_eq!(error_code(&r), "too_many_connections", "{r}");
        assert!(Instant::now() < deadline, "slots never freed");
        std::thread::sleep(Duration::from_millis(20));
    }
    d.client().status().expect("served after the burst");
    d.assert_healthy();
}

#[test]
fn a_client_that_vanishes_mid_request_does_not_hurt_the_daemon() {
    let mut d = daemon();
    for _ in 0..20 {
        let mut c = d.raw();
        c.hello();
        // Half a line, then gone; and a pipelined burst whose replies nobody reads.
        c.send(b"{\"id\":1,\"op\":\"add_ta");
        drop(c);
        let mut c = d.raw();
        c.hello();
        for i in 0..50 {
            c.send(format!("{{\"id\":{i},\"op\":\"status\"}}\n").as_bytes());
        }
        drop(c);
    }
    d.client().status().expect("still serving");
    d.assert_healthy();
}

#[test]
fn a_long_string_id_is_refused_without_being_echoed() {
    let mut d = daemon();
    let mut c = d.raw();
    c.hello();
    let long = "i".repeat(257);
    let r = c.call(&format!(r#"{{"id":"{long}","op":"status"}}"#));
    assert_eq!(error_code(&r), "bad_request");
    assert_eq!(
        r["id"],
        serde_json::Value::Null,
        "the long id is not echoed"
    );
    assert!(message(&r).contains("at most 256 bytes"), "{r}");
    // 256 bytes is fine, and the connection went on.
    let ok = "i".repeat(256);
    let r = c.call(&format!(r#"{{"id":"{ok}","op":"status"}}"#));
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["id"], ok.as_str());
    d.assert_healthy();
}

#[test]
fn a_list_tasks_limit_over_the_maximum_is_clamped() {
    let mut d = Daemon::start("synchronous = \"normal\"", "");
    let mut c = d.client();
    add_tasks(
        &mut c,
        (0..10_001).map(|i| NewTask::titled(format!("t{i}"))),
    );
    let list = |c: &mut runwarden::control::client::Client, limit| {
        c.list_tasks(&TaskFilter {
            limit: Some(limit),
            ..TaskFilter::default()
        })
        .expect("list_tasks")
        .len()
    };
    assert_eq!(list(&mut c, 50_000), 10_000, "clamped to the maximum");
    assert_eq!(list(&mut c, u32::MAX), 10_000);
    assert_eq!(list(&mut c, 10_000), 10_000);
    assert_eq!(list(&mut c, 7), 7, "a smaller limit is kept");
    d.assert_healthy();
}

#[test]
fn a_list_or_events_page_too_big_for_one_reply_is_cut_and_says_so() {
    use runwarden::control::protocol::MAX_REPLY_TEXT_BYTES;
    let mut d = Daemon::start("synchronous = \"normal\"", "");
    let mut c = d.client();
    // 300 tasks of 128 KiB of text each (title + body): ~39 MB, over the 16 MiB a reply
    // holds; their `created` events carry the 64 KiB titles: ~19.7 MB.
    const N: usize = 300;
    let ids = add_tasks(
        &mut c,
        (0..N).map(|i| big_task(i, runwarden::board::MAX_TITLE_BYTES)),
    );
    let reply = c
        .list_tasks_reply(&TaskFilter::default())
        .expect("list_tasks");
    assert!(
        reply.truncated,
        "{} tasks and not truncated",
        reply.tasks.len()
    );
    let n = reply.tasks.len();
    assert!((1..N).contains(&n), "{n} tasks");
    let text: usize = reply
        .tasks
        .iter()
        .map(|t| t.title.len() + t.body.len())
        .sum();
    assert!(text <= MAX_REPLY_TEXT_BYTES, "{text} bytes of task text");
    // The newest first, none skipped: the cut only leaves out the oldest.
    let got: Vec<_> = reply.tasks.iter().map(|t| t.id).collect();
    let newest: Vec<_> = ids.iter().rev().take(n).copied().collect();
    assert_eq!(got, newest);
    // A list that fits says nothing of the kind.
    let small = c
        .list_tasks_reply(&TaskFilter {
            limit: Some(5),
            ..TaskFilter::default()
        })
        .expect("list_tasks");
    assert_eq!((small.tasks.len(), small.truncated), (5, false));

    // The same bound on an events page (each `created` event carries its 64 KiB title): cut
    // short with `more`, and the next page goes on from its last id, nothing skipped.
    let first = c.events_page(0, None, Some(1000)).expect("events");
    assert!(first.more, "{} events and no more", first.events.len());
    assert!(
        (1..N).contains(&first.events.len()),
        "{}",
        first.events.len()
    );
    assert_eq!(first.last_id, first.events.last().unwrap().id);
    let all = c.events(0, None).expect("all events, paged");
    let created: Vec<_> = all
        .iter()
        .filter(|e| e.kind == "created")
        .filter_map(|e| e.task_id)
        .collect();
    assert_eq!(created, ids, "every event once, in order");
    d.assert_healthy();
}

#[test]
fn a_task_with_too_much_history_for_one_reply_shows_its_newest_and_counts_the_rest() {
    use runwarden::control::protocol::{Block, MAX_REPLY_TEXT_BYTES};
    let mut d = Daemon::start("synchronous = \"normal\"", "");
    let mut c = d.client();
    // No assignee is configured, so the task never runs: its history is an operator's.
    let id = c
        .add_task(&NewTask::titled("history"))
        .expect("add_task")
        .id;
    // 10 comments and 10 block/unblock rounds of ~900 KB each: ~9 MB of comment bodies and
    // ~9 MB of `blocked` payloads, each over the third of a reply they get.
    let big = |i: usize| format!("{i} {}", "x".repeat(900_000));
    let mut comment_ids = Vec::new();
    for i in 0..10 {
        comment_ids.push(c.comment(id, &big(i), None).expect("comment"));
        c.block(Block {
            task: id,
            run: None,
            token: None,
            reason: big(i),
            force: true,
        })
        .expect("block");
        c.unblock(id).expect("unblock");
    }

    let detail = c.show_task(id, Some(10_000)).expect("show_task");
    let share = MAX_REPLY_TEXT_BYTES / 3;
    let bodies: usize = detail.comments.iter().map(|c| c.body.len()).sum();
    assert!(bodies <= share, "{bodies} bytes of comments");
    assert!(
        detail.omitted_comments > 0 && !detail.comments.is_empty(),
        "{} comments shown, {} omitted",
        detail.comments.len(),
        detail.omitted_comments
    );
    // The newest, oldest first, none skipped; shown + omitted = all.
    let shown: Vec<i64> = detail.comments.iter().map(|c| c.id).collect();
    let newest = &comment_ids[comment_ids.len() - shown.len()..];
    assert_eq!(shown, newest);
    assert_eq!(
        shown.len() as u64 + detail.omitted_comments,
        comment_ids.len() as u64
    );

    assert!(detail.omitted_events > 0, "no events omitted");
    let all = c.events(0, Some(id)).expect("the task's events, paged");
    assert_eq!(
        detail.events.len() as u64 + detail.omitted_events,
        all.len() as u64,
        "shown + omitted = every event of the task (fewer than the 10000 asked for)"
    );
    let tail: Vec<_> = all[all.len() - detail.events.len()..]
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        detail.events.iter().map(|e| e.id).collect::<Vec<_>>(),
        tail,
        "the newest events, in order"
    );

    // A task whose history fits says nothing of the kind.
    let small = c.add_task(&NewTask::titled("small")).expect("add_task").id;
    c.comment(small, "a note", None).expect("comment");
    let detail = c.show_task(small, None).expect("show_task");
    assert_eq!(
        (
            detail.comments.len(),
            detail.omitted_comments,
            detail.omitted_events,
            detail.omitted_runs
        ),
        (1, 0, 0, 0)
    );
    d.assert_healthy();
}

#[test]
fn a_client_that_does_not_read_is_held_back_and_then_answered_in_full() {
    // The default idle timeout (30 s): the stalled writes below must not be cut off.
    let mut d = Daemon::start("", "");
    // 32 tasks of 2 × 16 KiB: each `list_tasks` reply is about 1 MiB.
    add_tasks(&mut d.client(), (0..32).map(|i| big_task(i, 16 * 1024)));
    const REQUESTS: usize = 100;
    let mut c = d.raw();
    c.hello();
    // Each request padded to 32 KiB (JSON allows the spaces), so the socket buffers hold only
    // a few of them: a server that stops reading shows up as writes that stop completing.
    let padded = |i: usize| {
        let mut line = format!(r#"{{"id":{i},"op":"list_tasks"}}"#).into_bytes();
        line.pop();
        line.resize(32 * 1024 - 2, b' ');
        line.extend_from_slice(b"}\n");
        line
    };
    let sent = Arc::new(AtomicUsize::new(0));
    let mut w = c.writer.try_clone().unwrap();
    let writer = {
        let sent = sent.clone();
        std::thread::spawn(move || {
            for i in 1..=REQUESTS {
                w.write_all(&padded(i)).expect("write a request");
                sent.store(i, Ordering::SeqCst);
            }
        })
    };
    // Wait until the writes stop completing (no progress for a second), or all went out.
    let mut last = (0, Instant::now());
    let stalled = common::proc_guard::wait_until(SETTLE, || {
        let now = sent.load(Ordering::SeqCst);
        if now != last.0 {
            last = (now, Instant::now());
        }
        now == REQUESTS || last.1.elapsed() >= Duration::from_secs(1)
    });
    assert!(stalled, "the writes neither stalled nor finished");
    let held_at = sent.load(Ordering::SeqCst);
    // 8 MiB of ~1 MiB replies, plus what the socket buffers hold: far from all of them. A
    // server without the bound would have read (and answered into memory) every request.
    assert!(
        held_at < REQUESTS / 2,
        "the server kept reading a client that does not read: {held_at} requests taken"
    );
    // Nothing was dropped: once the client reads, every request is answered, in order.
    for i in 1..=REQUESTS {
        let r = c.recv().expect("a reply");
        assert_eq!(r["id"], i, "in order");
        assert_eq!(
            r["result"]["tasks"].as_array().map(Vec::len),
            Some(32),
            "{i}"
        );
    }
    writer.join().unwrap();
    d.client().status().expect("still serving");
    d.assert_healthy();
}

/// The supervisor's peak resident memory (`VmHWM`), in KiB.
fn peak_rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/<pid>/status")
}

#[test]
fn small_writes_answered_with_a_big_task_cannot_pile_up_replies_in_memory() {
    let mut d = Daemon::start("", "");
    // No assignee: it stays put, and an operator may block and unblock it at will. Each
    // reply that carries it is about 512 KiB; each request is under 100 bytes.
    let task = add_tasks(&mut d.client(), [big_task(0, 256 * 1024)])[0];
    let before = d.client().status().expect("status").last_event_id;
    let peak_before = peak_rss_kib(d.pid());
    const PAIRS: usize = 200;
    let mut c = d.raw();
    c.hello();
    let mut lines = Vec::new();
    for i in 0..PAIRS {
        lines.extend_from_slice(
            format!(
                "{{\"id\":{},\"op\":\"block\",\"task\":{task},\"reason\":\"r{i}\"}}\n\
                 {{\"id\":{},\"op\":\"unblock\",\"task\":{task}}}\n",
                2 * i + 1,
                2 * i + 2
            )
            .as_bytes(),
        );
    }
    // All of it fits the socket's buffers: the client's writes complete whether or not the
    // server reads, and the client reads nothing for now.
    c.send(&lines);
    // Wait until the server stops taking requests (no event for a second).
    let mut status = d.client();
    let mut last = (before, Instant::now());
    let settled = common::proc_guard::wait_until(SETTLE, || {
        let now = status.status().expect("status").last_event_id;
        if now != last.0 {
            last = (now, Instant::now());
        }
        now - before >= 2 * PAIRS as i64 || last.1.elapsed() >= Duration::from_secs(1)
    });
    assert!(settled, "the server neither stopped nor finished");
    let taken = last.0 - before;
    // A few in flight and 8 MiB of replies queued: tens of requests, not a thousand. Without
    // the bound every request was taken, its reply built, and the memory grew by ~400 MiB.
    assert!(
        taken < 100,
        "the server kept taking requests from a client that does not read: {taken} events"
    );
    let grew = peak_rss_kib(d.pid()).saturating_sub(peak_before);
    assert!(
        grew < 128 * 1024,
        "the supervisor's peak memory grew by {grew} KiB for one client that does not read"
    );
    // Nothing was dropped: once the client reads, every request is answered, in order.
    for id in 1..=2 * PAIRS {
        let r = c.recv().expect("a reply");
        assert_eq!(r["id"], id, "in order");
        assert_eq!(r["ok"], true, "{id}: {}", r["error"]);
        assert_eq!(r["result"]["task"]["id"], task);
    }
    d.client().status().expect("still serving");
    d.assert_healthy();
}

#[test]
fn a_task_for_an_assignee_that_is_not_configured_is_refused() {
    let mut d = Daemon::start("", "[assignees.coder]\ncommand = [\"true\"]\n");
    let mut c = d.raw();
    c.hello();
    let r = c.call(r#"{"id":1,"op":"add_task","title":"t","assignee":"codr"}"#);
    assert_eq!(error_code(&r), "bad_request", "{r}");
    assert!(
        message(&r).contains("no assignee `codr`") && message(&r).contains("configured: coder"),
        "{r}"
    );
    let r = c.call(r#"{"id":2,"op":"list_tasks"}"#);
    assert_eq!(
        r["result"]["tasks"],
        serde_json::json!([]),
        "nothing was added: {r}"
    );
    // A configured assignee, or none at all, is fine.
    let r = c.call(r#"{"id":3,"op":"add_task","title":"t","assignee":"coder"}"#);
    assert_eq!(r["ok"], true, "{r}");
    let r = c.call(r#"{"id":4,"op":"add_task","title":"unassigned"}"#);
    assert_eq!(r["ok"], true, "{r}");
    d.assert_healthy();

    // The library refuses it the same way.
    let dir = tempfile::tempdir().unwrap();
    let sup = runwarden::Supervisor::start(runwarden::config::Config::with_data_dir(dir.path()))
        .expect("start a supervisor");
    match sup.add_task(NewTask::titled("t").for_assignee("codr")) {
        Err(runwarden::SupervisorError::UnknownAssignee(m)) => {
            assert!(m.contains("configured: none"), "{m}");
        }
        other => panic!("expected UnknownAssignee, got {other:?}"),
    }
    sup.shutdown();
}

#[test]
fn out_of_range_task_limits_are_refused_naming_the_field() {
    let mut d = daemon();
    let mut c = d.raw();
    c.hello();
    // A key is a name: a megabyte of one would ride on every reply that carries the task.
    let long_key = format!("\"{}\"", "k".repeat(runwarden::board::MAX_NAME_BYTES + 1));
    for (i, (field, value)) in [
        ("max_retries", "-3"),
        ("max_runtime_ms", "-5"),
        ("max_runtime_ms", "3155760000000001"),
        ("idempotency_key", long_key.as_str()),
    ]
    .into_iter()
    .enumerate()
    {
        let r = c.call(&format!(
            r#"{{"id":{i},"op":"add_task","title":"t","{field}":{value}}}"#
        ));
        assert_eq!(error_code(&r), "bad_request", "{r}");
        assert!(message(&r).contains(field), "{r}");
    }
    let r = c.call(r#"{"id":9,"op":"list_tasks"}"#);
    assert_eq!(r["result"]["tasks"], serde_json::json!([]), "{r}");
    // In range (0 is "no limit"), it is taken.
    let r = c.call(r#"{"id":10,"op":"add_task","title":"t","max_retries":0,"max_runtime_ms":0}"#);
    assert_eq!(r["ok"], true, "{r}");
    let key = "k".repeat(runwarden::board::MAX_NAME_BYTES);
    let r = c.call(&format!(
        r#"{{"id":11,"op":"add_task","title":"t","idempotency_key":"{key}"}}"#
    ));
    assert_eq!(r["ok"], true, "a key of the longest length is taken: {r}");

    // The CLI does not wrap a duration too long for the protocol into a negative number.
    // It says so in the option's terms, before anything is sent.
    for long in ["300000000years", "101years"] {
        let out = d.cli(&["add", "t", "--max-runtime", long]);
        assert_eq!(out.status.code(), Some(2), "{long}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--max-runtime") && err.contains("at most 100 years"),
            "{err}"
        );
    }
    d.assert_healthy();
}

#[test]
fn a_page_of_nothing_is_refused_naming_the_field() {
    // An `events` page of 0 would say `more` without moving on (a pager would ask for ever),
    // and a `read_log` piece of 0 bytes would look like the log's end.
    let mut d = daemon();
    let mut c = d.raw();
    c.hello();
    let r = c.call(r#"{"id":1,"op":"add_task","title":"t"}"#);
    assert_eq!(r["ok"], true, "{r}");
    let task = r["result"]["id"].as_i64().expect("task id");
    for (i, (line, field)) in [
        (r#"{"id":2,"op":"events","limit":0}"#.to_string(), "limit"),
        (
            format!(r#"{{"id":3,"op":"read_log","task":{task},"max_bytes":0}}"#),
            "max_bytes",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let r = c.call(&line);
        assert_eq!(error_code(&r), "bad_request", "request {i}: {r}");
        assert!(message(&r).contains(field), "request {i}: {r}");
    }
    // One is a page (with a second event after it, there is more).
    let r = c.call(r#"{"id":4,"op":"add_task","title":"u"}"#);
    assert_eq!(r["ok"], true, "{r}");
    let r = c.call(r#"{"id":5,"op":"events","limit":1}"#);
    assert_eq!(
        r["result"]["events"].as_array().map(Vec::len),
        Some(1),
        "{r}"
    );
    assert_eq!(r["result"]["more"], true, "{r}");
    d.assert_healthy();
}

#[test]
fn a_field_given_twice_or_a_malformed_value_is_refused_saying_what_is_wrong() {
    let mut d = daemon();
    let mut c = d.raw();
    // The version is "MAJOR.MINOR", nothing looser.
    for (i, v) in ["1", "1.x", "1.0.5", " 1.0"].into_iter().enumerate() {
        let r = c.call(&format!(r#"{{"id":{i},"op":"hello","version":"{v}"}}"#));
        assert_eq!(error_code(&r), "bad_request", "version {v:?}: {r}");
        assert!(message(&r).contains("MAJOR.MINOR"), "{r}");
    }
    c.hello();
    // A second `op` (or `id`) is not "the last one wins". The answer carries the request's id
    // unless the id is what was given twice.
    for (line, id) in [
        (
            r#"{"id":10,"op":"status","op":"list_tasks"}"#,
            serde_json::json!(10),
        ),
        (
            r#"{"op":"status","id":"s","task":1,"task":2}"#,
            serde_json::json!("s"),
        ),
        (
            r#"{"id":10,"op":"status","id":11}"#,
            serde_json::Value::Null,
        ),
        // Also when another field was given twice first.
        (
            r#"{"id":10,"op":"status","op":"x","id":11}"#,
            serde_json::Value::Null,
        ),
    ] {
        let r = c.call(line);
        assert_eq!(error_code(&r), "bad_request", "{line}: {r}");
        assert!(message(&r).contains("duplicate field"), "{line}: {r}");
        assert_eq!(r["id"], id, "{line}: {r}");
    }
    // An id that is not one says why.
    for (line, why) in [
        (r#"{"id":18446744073709551616,"op":"status"}"#, "above 2^64"),
        (r#"{"id":1.5,"op":"status"}"#, "fraction"),
        (r#"{"id":1.0,"op":"status"}"#, "decimal point or exponent"),
        (r#"{"id":-1e30,"op":"status"}"#, "negative"),
    ] {
        let r = c.call(line);
        assert_eq!(error_code(&r), "bad_request", "{line}: {r}");
        assert!(message(&r).contains(why), "{line}: {r}");
    }
    // add_task: a missing title is named as missing; an assignee over the name limit is
    // refused for its length, not echoed back; an empty key is not a key.
    let r = c.call(r#"{"id":20,"op":"add_task"}"#);
    assert_eq!(error_code(&r), "bad_request", "{r}");
    assert!(message(&r).contains("missing field `title`"), "{r}");
    let long = "a".repeat(200_000);
    let r = c.call(&format!(
        r#"{{"id":21,"op":"add_task","title":"t","assignee":"{long}"}}"#
    ));
    assert_eq!(error_code(&r), "bad_request", "{r}");
    assert!(
        message(&r).contains("assignee must be at most 256 bytes"),
        "{}",
        message(&r)
    );
    assert!(r.to_string().len() < 1000, "the name is not echoed");
    let r = c.call(r#"{"id":22,"op":"add_task","title":"t","idempotency_key":""}"#);
    assert_eq!(error_code(&r), "bad_request", "{r}");
    assert!(message(&r).contains("idempotency_key"), "{r}");
    // A worker's report (run + token) is never forced: both at once is refused, and nothing
    // is looked up (the task does not even exist).
    for op in [
        r#""op":"complete","task":1"#,
        r#""op":"block","task":1,"reason":"r""#,
    ] {
        let line = format!(r#"{{"id":25,{op},"run":1,"token":"t","force":true}}"#);
        let r = c.call(&line);
        assert_eq!(error_code(&r), "bad_request", "{line}: {r}");
        assert!(message(&r).contains("never forced"), "{line}: {r}");
    }
    // `limit: 0` is refused with `follow` as well.
    let r = c.call(r#"{"id":23,"op":"events","follow":true,"limit":0}"#);
    assert_eq!(error_code(&r), "bad_request", "{r}");
    let r = c.call(r#"{"id":24,"op":"list_tasks"}"#);
    assert_eq!(
        r["result"]["tasks"],
        serde_json::json!([]),
        "nothing added: {r}"
    );
    d.assert_healthy();
}
