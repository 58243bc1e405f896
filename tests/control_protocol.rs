//! The control protocol against a real `runwarden serve` on a real socket: the hello
//! handshake, every op's answer, errors as responses, pipelining (order and throughput), the
//! socket's modes, a stale socket replaced, a live one refused, and `shutdown`; a `comment`
//! without an author gets the peer's user name and still commits in arrival order.

#[allow(dead_code)]
mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::control_daemon::{Daemon, SETTLE, error_code};
use runwarden::board::{NewTask, TaskStatus};
use runwarden::control::protocol::{Complete, Request, Response, ShowTask};

#[test]
fn hello_comes_first_and_an_unknown_major_version_is_refused() {
    let d = Daemon::start("", "");
    let mut c = d.raw();
    let r = c.call(r#"{"id":1,"op":"status"}"#);
    assert_eq!(error_code(&r), "bad_request");
    assert_eq!(r["id"], 1);
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("send hello first"),
        "{r}"
    );

    let r = c.call(r#"{"id":2,"op":"hello","version":"2.0"}"#);
    assert_eq!(error_code(&r), "unsupported_version");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("1.0"),
        "{r}"
    );

    // A newer minor version of the same major is fine; the server says what it speaks.
    let r = c.call(r#"{"id":"h","op":"hello","version":"1.7"}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["id"], "h");
    assert_eq!(r["result"]["protocol"], "1.0");
    assert_eq!(r["result"]["pid"], d.pid());

    let r = c.call(r#"{"id":3,"op":"status"}"#);
    assert_eq!(r["ok"], true, "{r}");
}

#[test]
fn every_op_answers_with_its_documented_result() {
    let d = Daemon::start("", "");
    let mut c = d.raw();
    c.hello();
    let a = c.call(r#"{"id":1,"op":"add_task","title":"parent","priority":5}"#);
    assert_eq!(a["ok"], true, "{a}");
    let parent = a["result"]["id"].as_i64().unwrap();
    assert_eq!(a["result"]["existed"], false);
    let child = c.call(r#"{"id":2,"op":"add_task","title":"child","idempotency_key":"k1"}"#)["result"]["id"]
        .as_i64()
        .unwrap();
    let again = c.call(r#"{"id":3,"op":"add_task","title":"child again","idempotency_key":"k1"}"#);
    assert_eq!(
        again["result"],
        serde_json::json!({"id": child, "existed": true})
    );

    let r = c.call(&format!(
        r#"{{"id":4,"op":"link","parent":{parent},"child":{child}}}"#
    ));
    assert_eq!(
        r["result"],
        serde_json::json!({"parent": parent, "child": child})
    );
    let r = c.call(&format!(
        r#"{{"id":5,"op":"comment","task":{child},"body":"hi","author":"tester"}}"#
    ));
    assert!(r["result"]["comment_id"].as_i64().is_some(), "{r}");

    let r = c.call(r#"{"id":6,"op":"list_tasks","status":"todo"}"#);
    let tasks = r["result"]["tasks"].as_array().unwrap();
    assert_eq!(tasks.len(), 1, "{r}");
    assert_eq!(tasks[0]["id"], child);

    let r = c.call(&format!(r#"{{"id":7,"op":"show_task","task":{child}}}"#));
    let t = &r["result"];
    assert_eq!(t["status"], "todo");
    assert_eq!(t["parents"], serde_json::json!([parent]));
    assert_eq!(t["comments"][0]["author"], "tester");
    let kinds: Vec<&str> = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["created", "linked", "demoted", "commented"]);

    // Operator transitions (no assignee: nothing ever runs these tasks).
    let r = c.call(&format!(
        r#"{{"id":8,"op":"block","task":{parent},"reason":"wait for me"}}"#
    ));
    assert_eq!(r["result"]["task"]["status"], "blocked", "{r}");
    let r = c.call(&format!(r#"{{"id":9,"op":"unblock","task":{parent}}}"#));
    assert_eq!(r["result"]["task"]["status"], "ready");
    let r = c.call(&format!(
        r#"{{"id":10,"op":"complete","task":{parent},"result":"fine"}}"#
    ));
    assert_eq!(r["result"]["task"]["status"], "done");
    assert_eq!(r["result"]["task"]["result"], "fine");
    // Its child was promoted in the same transaction.
    let r = c.call(&format!(
        r#"{{"id":11,"op":"show_task","task":{child},"events":2}}"#
    ));
    assert_eq!(r["result"]["status"], "ready");
    assert_eq!(r["result"]["events"].as_array().unwrap().len(), 2);
    let r = c.call(&format!(r#"{{"id":12,"op":"archive","task":{child}}}"#));
    assert_eq!(r["result"]["task"]["status"], "archived");
    let r = c.call(&format!(r#"{{"id":13,"op":"reclaim","task":{child}}}"#));
    assert_eq!(error_code(&r), "conflict");

    let r = c.call(r#"{"id":14,"op":"events","since":0,"limit":3}"#);
    assert_eq!(r["result"]["events"].as_array().unwrap().len(), 3);
    assert_eq!(r["result"]["more"], true);
    assert_eq!(r["result"]["last_id"], 3);
    // `more` means a next page, not a full one: a page that takes the last events says so.
    let last = c.call(r#"{"id":140,"op":"status"}"#)["result"]["last_event_id"]
        .as_i64()
        .unwrap();
    let r = c.call(&format!(
        r#"{{"id":141,"op":"events","since":{},"limit":3}}"#,
        last - 3
    ));
    assert_eq!(r["result"]["events"].as_array().unwrap().len(), 3, "{r}");
    assert_eq!(r["result"]["more"], false, "{r}");
    assert_eq!(r["result"]["last_id"], last);
    let r = c.call(&format!(
        r#"{{"id":15,"op":"events","since":0,"task":{parent}}}"#
    ));
    assert!(
        r["result"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["task_id"] == parent)
    );

    let r = c.call(r#"{"id":16,"op":"status"}"#);
    let s = &r["result"];
    assert_eq!(s["pid"], d.pid());
    assert_eq!(s["counts"]["done"], 1);
    assert_eq!(s["counts"]["archived"], 1);
    assert_eq!(s["live_workers"], serde_json::json!([]));
    assert!(s["last_event_id"].as_i64().unwrap() >= 10);
    assert_eq!(s["socket"], d.socket.to_str().unwrap());

    let r = c.call(r#"{"id":17,"op":"reap_now"}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert!(r["result"]["pending"].is_u64());

    // Refusals are answers; the connection goes on.
    assert_eq!(
        error_code(&c.call(r#"{"id":18,"op":"show_task","task":999}"#)),
        "not_found"
    );
    assert_eq!(
        error_code(&c.call(r#"{"id":19,"op":"unblock","task":999}"#)),
        "not_found"
    );
    let r = c.call(&format!(
        r#"{{"id":20,"op":"link","parent":{child},"child":{parent}}}"#
    ));
    assert_eq!(error_code(&r), "bad_request", "a cycle is refused: {r}");
    assert_eq!(
        error_code(&c.call(r#"{"id":21,"op":"block","task":1,"reason":" "}"#)),
        "bad_request"
    );
    let r = c.call(r#"{"id":22,"op":"heartbeat","task":1,"run":1,"token":"x"}"#);
    assert_eq!(error_code(&r), "not_found", "no run 1 exists: {r}");
    // The start time is the same in every status (not "now − uptime", off by a millisecond).
    let started: Vec<_> = (24..29)
        .map(|i| c.call(&format!(r#"{{"id":{i},"op":"status"}}"#))["result"]["started_at"].clone())
        .collect();
    assert!(
        started.iter().all(|t| *t == started[0] && t.is_i64()),
        "{started:?}"
    );

    // A parent named twice is one link, and said once.
    let r = c.call(&format!(
        r#"{{"id":30,"op":"add_task","title":"twice","parents":[{parent},{parent}]}}"#
    ));
    let twice = r["result"]["id"].as_i64().expect("added");
    let r = c.call(&format!(
        r#"{{"id":31,"op":"show_task","task":{twice},"events":1}}"#
    ));
    assert_eq!(r["result"]["parents"], serde_json::json!([parent]), "{r}");
    assert_eq!(
        r["result"]["events"][0]["payload"]["parents"],
        serde_json::json!([parent]),
        "{r}"
    );
}

#[test]
fn pipelined_requests_are_answered_in_order_and_fast() {
    let d = Daemon::start("", "");
    let mut c = d.client();
    // The benchmark size in release builds; a debug build (unoptimized SQLite) runs a smaller
    // burst to keep the suite quick.
    const N: usize = if cfg!(debug_assertions) {
        4_000
    } else {
        20_000
    };
    const WINDOW: usize = 1024;
    let start = Instant::now();
    let (mut sent, mut received) = (0usize, 0usize);
    let mut last_id = 0i64;
    let mut expected = std::collections::VecDeque::new();
    while received < N {
        while sent < N && sent - received < WINDOW {
            let new = NewTask::titled(format!("bulk {sent}"));
            expected.push_back(c.send(&Request::AddTask(new)).unwrap());
            sent += 1;
        }
        match c.recv().unwrap() {
            Response::Ok { id, result } => {
                assert_eq!(
                    id.as_ref(),
                    expected.front(),
                    "replies come in request order"
                );
                expected.pop_front();
                let task = result["id"].as_i64().unwrap();
                assert!(task > last_id, "tasks are created in request order");
                last_id = task;
            }
            other => panic!("unexpected {other:?}"),
        }
        received += 1;
    }
    let rate = N as f64 / start.elapsed().as_secs_f64();
    eprintln!(
        "pipelined add_task: {N} in {:?} = {rate:.0}/s",
        start.elapsed()
    );
    // The ≥ 20 000/s target is measured on release builds (docs/protocol.md); on a shared
    // 2-core machine a test can only assert that pipelining works at all: a request-reply
    // loop manages a few hundred per second, so these floors are far above that.
    let floor = if cfg!(debug_assertions) {
        1_000.0
    } else {
        5_000.0
    };
    assert!(rate >= floor, "{rate:.0} add_task/s is below {floor}");

    // A read after pipelined writes sees them: complete then show, without waiting between.
    let complete = c
        .send(&Request::Complete(Complete {
            task: last_id,
            result: Some("r".into()),
            ..Complete::default()
        }))
        .unwrap();
    let show = c
        .send(&Request::ShowTask(ShowTask {
            task: last_id,
            events: None,
        }))
        .unwrap();
    match (c.recv().unwrap(), c.recv().unwrap()) {
        (Response::Ok { id: a, .. }, Response::Ok { id: b, result }) => {
            assert_eq!((a, b), (Some(complete), Some(show)));
            assert_eq!(result["status"], "done");
        }
        other => panic!("unexpected {other:?}"),
    }
    let counts = c.status().unwrap().counts;
    assert_eq!(counts["ready"] + counts["done"], N as i64);
}

#[test]
fn a_comment_without_author_gets_the_peers_name_and_keeps_its_place() {
    let mut d = Daemon::start("", "");
    let mut c = d.raw();
    c.hello();
    let task = c.call(r#"{"id":1,"op":"add_task","title":"t"}"#)["result"]["id"]
        .as_i64()
        .unwrap();
    // Pipelined in one write: the first needs the user-name lookup, the second does not, and
    // must not overtake it; the third finds the name already known.
    c.send(
        format!(
            "{{\"id\":2,\"op\":\"comment\",\"task\":{task},\"body\":\"first\"}}\n\
             {{\"id\":3,\"op\":\"comment\",\"task\":{task},\"body\":\"second\",\"author\":\"x\"}}\n\
             {{\"id\":4,\"op\":\"comment\",\"task\":{task},\"body\":\"third\"}}\n"
        )
        .as_bytes(),
    );
    let ids: Vec<i64> = (2..=4)
        .map(|id| {
            let r = c.recv().expect("a reply");
            assert_eq!(r["id"], id, "in order: {r}");
            r["result"]["comment_id"].as_i64().expect("a comment id")
        })
        .collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "committed out of arrival order: {ids:?}"
    );
    let uid = nix::unistd::getuid();
    let me = match nix::unistd::User::from_uid(uid) {
        Ok(Some(user)) => user.name,
        _ => format!("uid {uid}"),
    };
    let detail = d.client().show_task(task, None).expect("show_task");
    let comments: Vec<(&str, &str)> = detail
        .comments
        .iter()
        .map(|c| (c.author.as_str(), c.body.as_str()))
        .collect();
    assert_eq!(
        comments,
        [
            (me.as_str(), "first"),
            ("x", "second"),
            (me.as_str(), "third")
        ]
    );
    d.assert_healthy();
}

#[test]
fn the_socket_is_private_and_removed_on_shutdown() {
    let mut d = Daemon::start("", "");
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d.socket), 0o600);
    assert_eq!(mode(d.socket.parent().unwrap()), 0o700);

    let r = d.client().shutdown().unwrap();
    assert!(r.stopping);
    let status = d
        .wait_exit(SETTLE)
        .expect("supervisor exits after shutdown");
    assert!(status.success(), "{status}\n{}", d.stderr_text());
    assert!(!d.socket.exists(), "the socket is removed");
    assert!(!d.stderr_text().contains("panicked"));
}

#[test]
fn a_stale_socket_is_replaced_and_a_live_one_refuses_the_start() {
    let shared = tempfile::tempdir().unwrap();
    let socket = shared.path().join("rw.sock");
    // A socket file nobody accepts on: what a killed supervisor leaves behind.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let line = format!("socket = \"{}\"", socket.display());
    let mut first = Daemon::start(&line, "");
    assert_eq!(first.socket, socket);
    first.client().status().unwrap();

    // Another data dir (so no lock conflict), the same socket path: refused, socket untouched.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    std::fs::write(
        &config,
        format!("[supervisor]\ndata_dir = \"data\"\n{line}\n"),
    )
    .unwrap();
    let stderr = dir.path().join("stderr");
    let mut second = Daemon::spawn_serve(&config, &stderr);
    let mut status = None;
    assert!(common::proc_guard::wait_until(SETTLE, || {
        status = second.try_wait().unwrap();
        status.is_some()
    }));
    assert!(!status.unwrap().success());
    let err = std::fs::read_to_string(&stderr).unwrap();
    assert!(
        err.contains("already listening on") && err.contains("rw.sock"),
        "{err}"
    );
    first
        .client()
        .status()
        .expect("the first supervisor still serves");
    first.assert_healthy();

    // A non-socket file in the way is never deleted.
    let file = shared.path().join("not-a-socket");
    std::fs::write(&file, "precious").unwrap();
    std::fs::write(
        &config,
        format!(
            "[supervisor]\ndata_dir = \"data\"\nsocket = \"{}\"\n",
            file.display()
        ),
    )
    .unwrap();
    let mut third = Daemon::spawn_serve(&config, &stderr);
    assert!(common::proc_guard::wait_until(SETTLE, || third
        .try_wait()
        .unwrap()
        .is_some()));
    assert!(
        std::fs::read_to_string(&stderr)
            .unwrap()
            .contains("is not a socket")
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "precious");
}

#[test]
fn a_task_added_over_the_socket_is_run_and_its_reply_means_committed() {
    let d = Daemon::start("", "[assignees.ok]\ncommand = [\"true\"]\n");
    let mut c = d.client();
    let id = c
        .add_task(&NewTask::titled("quick").for_assignee("ok"))
        .unwrap()
        .id;
    // The reply came after the commit: a fresh connection sees the task at once.
    let fresh = d.client().show_task(id, None);
    assert!(fresh.is_ok(), "{fresh:?}");
    let deadline = Instant::now() + SETTLE;
    loop {
        let t = c.show_task(id, None).unwrap();
        if t.task.status == TaskStatus::Done {
            assert_eq!(t.runs.len(), 1);
            assert_eq!(t.runs[0].exit_code, Some(0));
            break;
        }
        assert!(Instant::now() < deadline, "task never finished: {t:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn read_log_gives_a_log_in_pieces_and_says_when_it_was_rotated() {
    let d = Daemon::start(
        "",
        "[assignees.w]\ncommand = [\"sh\", \"-c\", \"printf 'héllo world\\\\n'\"]\n",
    );
    let mut c = d.raw();
    c.hello();
    let id = c.call(r#"{"id":1,"op":"add_task","title":"t","assignee":"w"}"#)["result"]["id"]
        .as_i64()
        .unwrap();
    let log = d.data_dir.join("logs").join(format!("{id}.log"));
    let written = "héllo world\n";
    assert!(
        common::proc_guard::wait_until(SETTLE, || std::fs::read_to_string(&log)
            .is_ok_and(|s| s == written)),
        "the worker's log never had its line"
    );
    let size = written.len() as u64;

    // The whole log; then in pieces of 2 bytes, never cutting the 'é' (two bytes) in half.
    let r = c.call(&format!(r#"{{"id":2,"op":"read_log","task":{id}}}"#));
    assert_eq!(
        r["result"],
        serde_json::json!({"offset": 0, "next": size, "size": size, "data": written}),
        "{r}"
    );
    let mut text = String::new();
    let mut offset = 0;
    while offset < size {
        let r = c.call(&format!(
            r#"{{"id":3,"op":"read_log","task":{id},"offset":{offset},"max_bytes":2}}"#
        ));
        text.push_str(r["result"]["data"].as_str().unwrap());
        let next = r["result"]["next"].as_u64().unwrap();
        assert!(next > offset, "{r}");
        offset = next;
    }
    assert_eq!(text, written);

    // Past the end (the log was rotated, say): nothing, and the size to start again from.
    let r = c.call(&format!(
        r#"{{"id":4,"op":"read_log","task":{id},"offset":{}}}"#,
        size + 100
    ));
    assert_eq!(r["result"]["data"], "", "{r}");
    assert_eq!(r["result"]["size"], size, "{r}");
    // No log: not_found.
    let r = c.call(r#"{"id":5,"op":"read_log","task":999}"#);
    assert_eq!(error_code(&r), "not_found", "{r}");
}
