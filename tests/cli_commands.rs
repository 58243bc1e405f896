//! Every `runwarden` command against a running supervisor (a real `runwarden serve` child on a
//! temporary data dir), in both output modes, including the worker path: a worker that runs
//! `runwarden heartbeat` and `runwarden complete` from its own environment.

#[allow(dead_code)]
mod common;

use std::fs;
use std::path::Path;
use std::sync::mpsc;

use common::control_daemon::{
    Daemon, SETTLE, bin, command, exit_code, failed, ok, ok_json, run, spawn_connected, stream,
};
use common::proc_guard::ChildGuard;
use common::proc_guard::wait_until;
use common::runtime::WorkerGuard;
use serde_json::Value;

/// `[assignees.*]` used below: a worker that reports through the CLI, one that holds its run,
/// one that takes a moment, one that fails.
fn assignees() -> String {
    let bin_dir = Path::new(bin()).parent().unwrap().display().to_string();
    format!(
        r#"
[assignees.reporter]
command = ["sh", "-c", "echo working; runwarden heartbeat --note hi && runwarden complete --result ok"]
env = {{ PATH = "{bin_dir}:/usr/local/bin:/usr/bin:/bin" }}

[assignees.hold]
command = ["sleep", "60"]
max_in_progress = 4

[assignees.brief]
command = ["sh", "-c", "sleep 0.3"]

[assignees.failing]
command = ["sh", "-c", "exit 3"]
max_retries = 0

[assignees.flaky]
command = ["sh", "-c", "while [ ! -e go ]; do sleep 0.02; done; exit 75"]
retry_exit_codes = [75]
retry_cooldown = "60s"

[assignees.noisy]
command = ["sh", "-c", "printf 'first line of the trouble\\n\\033[31mred\\033[0m and the disk is full: no space left on device\\n'; exit 4"]
max_retries = 0
"#
    )
}

fn daemon() -> Daemon {
    Daemon::start("", &assignees())
}

fn id_of(out: &std::process::Output) -> i64 {
    ok(out).trim().parse().expect("add prints the id")
}

fn show(d: &Daemon, id: i64) -> Value {
    ok_json(&d.cli(&["show", &id.to_string(), "--json"]))
}

fn wait_status(d: &Daemon, id: i64, status: &str) -> Value {
    let mut last = Value::Null;
    let reached = wait_until(SETTLE, || {
        last = show(d, id);
        last["status"] == status
    });
    assert!(reached, "task {id} never became {status}: {last:#}");
    last
}

#[test]
fn a_worker_reports_through_the_cli_from_its_environment() {
    let mut d = daemon();
    let id = id_of(&d.cli(&["add", "report back", "--assignee", "reporter"]));
    let t = wait_status(&d, id, "done");
    assert_eq!(t["result"], "ok");
    let run = &t["runs"][0];
    assert_eq!(run["outcome"], "completed");
    assert_eq!(run["summary"], "ok");
    assert!(run["spawned_pid"].is_i64(), "the spawn is recorded: {run}");
    assert!(run["started_at"].is_i64() && run["ended_at"].is_i64());
    // The heartbeat refreshed the run: its time is recorded and the lease runs claim_ttl
    // (15 min by default) from it.
    let hb = run["heartbeat_at"].as_i64().expect("heartbeat recorded");
    assert!(run["lease_expires_at"].as_i64().unwrap() >= hb + 14 * 60 * 1000);
    let kinds: Vec<&str> = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    let hb_event = t["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "heartbeat");
    assert_eq!(
        hb_event.expect("a heartbeat event")["payload"]["note"],
        "hi",
        "{kinds:?}"
    );
    assert!(kinds.contains(&"completed"), "{kinds:?}");

    // Its log holds what the worker printed, including the CLI's own confirmations.
    let log = ok(&d.cli(&["logs", &id.to_string()]));
    assert!(log.contains("working"), "{log}");
    assert!(log.contains("heartbeat recorded"), "{log}");
    // `logs` reads the file directly: with --config it needs no supervisor at all.
    let log2 = ok(&d.cli_with_config(&["logs", &id.to_string()]));
    assert_eq!(log, log2);
    // Following the log of a task that does not exist is a mistake said at once, not a wait
    // for ever (one that exists but has not started is waited for).
    let (code, said) = failed(&d.cli(&["logs", "999", "--follow"]));
    assert_eq!(code, 1, "{said}");
    assert!(said.contains("999"), "{said}");
    // Its bytes as they are: `--json` does not apply, and says so (not ignored in silence).
    let (code, said) = failed(&d.cli(&["--json", "logs", &id.to_string()]));
    assert_eq!(code, 2, "{said}");
    assert!(said.contains("--json does not apply to logs"), "{said}");
    d.assert_healthy();
}

#[test]
fn task_commands_in_both_output_modes() {
    let mut d = daemon();
    // add: plain prints the id; --json an object (global flag before the subcommand here).
    let parent = id_of(&d.cli(&[
        "add",
        "parent task",
        "--priority",
        "3",
        "--body",
        "the body",
    ]));
    let created = ok_json(&d.cli(&[
        "--json",
        "add",
        "child task",
        "--parent",
        &parent.to_string(),
        "--max-runtime",
        "5m",
        "--max-retries",
        "1",
        "--idempotency-key",
        "k",
    ]));
    let child = created["id"].as_i64().unwrap();
    assert_eq!(created["existed"], false);
    let again = ok_json(&d.cli(&["add", "child again", "--idempotency-key", "k", "--json"]));
    assert_eq!(again, serde_json::json!({"id": child, "existed": true}));

    // ls: a table for people, an array with --json, filters.
    let table = ok(&d.cli(&["ls"]));
    assert!(table.starts_with("ID"), "{table}");
    assert!(
        table.contains("parent task") && table.contains("child task"),
        "{table}"
    );
    assert!(
        !table.contains("\x1b["),
        "no colour when stdout is not a terminal"
    );
    let all = ok_json(&d.cli(&["ls", "--json"]));
    assert_eq!(all.as_array().unwrap().len(), 2);
    let todo = ok_json(&d.cli(&["ls", "--status", "todo", "--json"]));
    assert_eq!(todo.as_array().unwrap().len(), 1);
    assert_eq!(todo[0]["id"], child);
    assert_eq!(todo[0]["max_runtime_ms"], 300_000);
    assert_eq!(todo[0]["max_retries"], 1);

    // show: --json carries status, runs and events; the table names things.
    let s = show(&d, parent);
    assert_eq!(s["status"], "ready");
    assert_eq!(s["priority"], 3);
    assert_eq!(s["body"], "the body");
    assert_eq!(s["children"], serde_json::json!([child]));
    assert_eq!(s["runs"], serde_json::json!([]));
    assert_eq!(s["events"][0]["kind"], "created");
    let text = ok(&d.cli(&["show", &parent.to_string()]));
    assert!(
        text.contains("parent task") && text.contains("ready") && text.contains("created"),
        "{text}"
    );

    // comment, link, block, unblock, complete, archive.
    let c = ok_json(&d.cli(&["comment", &child.to_string(), "looks fine", "--json"]));
    assert!(c["comment_id"].is_i64());
    assert!(
        ok(&d.cli(&["comment", &child.to_string(), "again", "--author", "bob"])).contains("added")
    );
    let extra = id_of(&d.cli(&["add", "extra"]));
    let out = ok(&d.cli(&["link", &extra.to_string(), &child.to_string()]));
    assert!(
        out.contains(&format!("task {child} now waits for task {extra}")),
        "{out}"
    );
    let blocked = ok_json(&d.cli(&["block", &parent.to_string(), "needs a decision", "--json"]));
    assert_eq!(blocked["status"], "blocked");
    assert_eq!(blocked["block_reason"], "needs a decision");
    assert!(ok(&d.cli(&["unblock", &parent.to_string()])).contains("now ready"));
    assert!(
        ok(&d.cli(&["complete", &parent.to_string(), "--result", "by hand"])).contains("now done")
    );
    assert!(ok(&d.cli(&["complete", &extra.to_string()])).contains("now done"));
    assert_eq!(
        show(&d, child)["status"],
        "ready",
        "promoted once both parents are done"
    );
    let archived = ok_json(&d.cli(&["archive", &child.to_string(), "--json"]));
    assert_eq!(archived["status"], "archived");
    let s = show(&d, child);
    assert_eq!(s["comments"][1]["author"], "bob");

    // events: the whole log, or one task's; a table or a JSON array.
    let events = ok_json(&d.cli(&["events", "--json"]));
    let ids: Vec<i64> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_i64().unwrap())
        .collect();
    assert!(
        ids.windows(2).all(|w| w[1] == w[0] + 1) && ids[0] == 1,
        "{ids:?}"
    );
    let mine = ok_json(&d.cli(&["events", &parent.to_string(), "--json"]));
    assert!(
        mine.as_array()
            .unwrap()
            .iter()
            .all(|e| e["task_id"] == parent)
    );
    let text = ok(&d.cli(&["events", &parent.to_string()]));
    assert!(
        text.contains("blocked") && text.contains("unblocked"),
        "{text}"
    );
    let since = ok_json(&d.cli(&[
        "events",
        "--since",
        &ids[ids.len() - 2].to_string(),
        "--json",
    ]));
    assert_eq!(since.as_array().unwrap().len(), 1);

    // Refusals: one line on stderr naming what was wrong, exit 1; usage mistakes exit 2.
    let (code, err) = failed(&d.cli(&["show", "9999"]));
    assert_eq!(code, 1);
    assert!(
        err.contains("task 9999 not found") && err.lines().count() == 1,
        "{err}"
    );
    let (code, err) = failed(&d.cli(&["unblock", &parent.to_string()]));
    assert_eq!(code, 1);
    assert!(err.contains("not blocked"), "{err}");
    let (code, _) = failed(&d.cli(&["show", "abc"]));
    assert_eq!(code, 2);
    let (code, err) = failed(&d.cli(&["complete"]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not inside a worker"), "{err}");
    let (code, err) = failed(&d.cli(&["heartbeat"]));
    assert_eq!(code, 2, "{err}");
    // A negative event id is no place to start from.
    let (code, err) = failed(&d.cli(&["events", "--since", "-1"]));
    assert_eq!(code, 2, "{err}");
    // An operator's block with a task and no reason: the reason is what is missing.
    let (code, err) = failed(&d.cli(&["block", &parent.to_string()]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("a reason is needed"), "{err}");
    d.assert_healthy();
}

#[test]
fn running_tasks_runs_reclaim_force_status_reap() {
    let mut d = daemon();
    let id = id_of(&d.cli(&["add", "holds on", "-a", "hold"]));
    let t = wait_status(&d, id, "running");
    let pid = t["runs"][0]["spawned_pid"].as_i64();
    assert!(
        wait_until(SETTLE, || show(&d, id)["runs"][0]["worker_pid"].is_i64()),
        "pid recorded: {pid:?}"
    );
    // Pinned by its recorded fingerprint: ended by pid on drop whatever fails below, and
    // watched to see the reclaim end it.
    let run = &show(&d, id)["runs"][0];
    let fp = runwarden::process::Fingerprint {
        boot_id: run["worker_boot_id"].as_str().expect("boot id").to_string(),
        start_ticks: run["worker_start_ticks"].as_u64().expect("start ticks"),
        pidfs_ino: None,
    };
    let worker = WorkerGuard::pin(run["worker_pid"].as_i64().unwrap() as i32, &fp);

    // status shows the live worker; --json is stable.
    let s = ok_json(&d.cli(&["status", "--json"]));
    assert_eq!(s["pid"], d.pid());
    assert_eq!(s["counts"]["running"], 1);
    assert_eq!(s["live_workers"][0]["task_id"], id);
    assert!(s["uptime_ms"].is_u64() && s["version"].is_string());
    let text = ok(&d.cli(&["status"]));
    assert!(
        text.contains("supervisor") && text.contains("running 1"),
        "{text}"
    );

    // An operator may not complete or block a task whose worker is alive, except with --force.
    let (code, err) = failed(&d.cli(&["complete", &id.to_string()]));
    assert_eq!(code, 1);
    assert!(err.contains("alive") && err.contains("--force"), "{err}");
    let (code, _) = failed(&d.cli(&["block", &id.to_string(), "stop"]));
    assert_eq!(code, 1);

    // reclaim: the run closes, the worker is ended, the task runs again.
    let r = ok_json(&d.cli(&[
        "reclaim",
        &id.to_string(),
        "--reason",
        "try again",
        "--json",
    ]));
    assert_eq!(r["status"], "ready");
    assert!(
        wait_until(SETTLE, || !worker.alive()),
        "the reclaimed run's worker {} is still running",
        worker.pid
    );
    assert!(wait_until(SETTLE, || show(&d, id)["runs"]
        .as_array()
        .unwrap()
        .len()
        == 2));
    let runs = ok_json(&d.cli(&["runs", &id.to_string(), "--json"]));
    assert_eq!(runs[0]["outcome"], "reclaimed");
    assert_eq!(runs[0]["error"], "try again");
    let table = ok(&d.cli(&["runs", &id.to_string()]));
    assert!(
        table.contains("reclaimed") && table.contains("ATTEMPT"),
        "{table}"
    );

    let done = ok_json(&d.cli(&[
        "complete",
        &id.to_string(),
        "--force",
        "--result",
        "forced",
        "--json",
    ]));
    assert_eq!(done["status"], "done");
    let r = ok_json(&d.cli(&["reap", "--json"]));
    assert!(r["pending"].is_u64());
    assert!(ok(&d.cli(&["reap"])).contains("sweep"));
    d.assert_healthy();
}

#[test]
fn wait_exit_codes() {
    let d = daemon();
    let quick = id_of(&d.cli(&["add", "brief", "-a", "brief"]));
    let also = id_of(&d.cli(&["add", "brief too", "-a", "brief"]));
    let out = d.cli(&[
        "wait",
        &quick.to_string(),
        &also.to_string(),
        "--timeout",
        "30s",
    ]);
    let text = ok(&out);
    assert!(text.contains(&format!("task {quick}: done")), "{text}");
    // Already done: returns at once.
    let j = ok_json(&d.cli(&["wait", &quick.to_string(), "--json"]));
    assert_eq!(j["tasks"][0]["status"], "done");
    assert_eq!(j["timed_out"], false);

    let bad = id_of(&d.cli(&["add", "fails", "-a", "failing"]));
    let (code, err) = failed(&d.cli(&["wait", &bad.to_string(), "--timeout", "30s"]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("blocked"), "{err}");

    // `show` cuts notes to the table's column, and prints the newest run's whole, with the
    // worker's control characters taken out and its lines indented.
    // Nor do a title's or a comment's.
    let noisy = id_of(&d.cli(&["add", "fails \x1b[2Jloudly", "-a", "noisy"]));
    failed(&d.cli(&["wait", &noisy.to_string(), "--timeout", "30s"]));
    ok(&d.cli(&["comment", &noisy.to_string(), "see \x1b]0;title\x07 here"]));
    let text = ok(&d.cli(&["show", &noisy.to_string()]));
    assert!(
        text.contains("note: exited with code 4; log tail: first line of the trouble\n    ")
            && text.contains("red [0m and the disk is full: no space left on device"),
        "{text}"
    );
    assert!(!text.contains('\x1b') && !text.contains('\x07'), "{text:?}");
    assert!(text.contains("fails  [2Jloudly") && text.contains("see  ]0;title  here"));
    let listed = ok(&d.cli(&["ls"]));
    assert!(!listed.contains('\x1b'), "{listed:?}");

    let never = id_of(&d.cli(&["add", "no assignee"]));
    let (code, err) = failed(&d.cli(&["wait", &never.to_string(), "--timeout", "300ms"]));
    assert_eq!(code, 124, "{err}");
    assert!(err.contains("timed out"), "{err}");
    // Not 1 (a task ended blocked): a mistyped id is a usage error.
    let (code, err) = failed(&d.cli(&["wait", "4242"]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("not found"), "{err}");

    // A failure while it waits puts the task back in line: `--json` says `ready`, not
    // `running` (the event it follows says so, no second look). The worker fails once the
    // wait follows (its gate: `go` in its work dir).
    let flaky = id_of(&d.cli(&["add", "fails once a while", "-a", "flaky"]));
    let stdout = d.dir.path().join("wait-flaky.json");
    let mut waiting = waiting_in_background(
        &d,
        &[&flaky.to_string(), "--timeout", "3s", "--json"],
        &stdout,
    );
    wait_status(&d, flaky, "running");
    fs::write(
        d.data_dir.join("work").join(flaky.to_string()).join("go"),
        "",
    )
    .unwrap();
    assert_eq!(exit_code(&mut waiting), Some(124));
    let j: Value = serde_json::from_str(&fs::read_to_string(&stdout).unwrap()).expect("JSON");
    assert_eq!(j["tasks"][0]["status"], "ready", "{j}");

    // A task seen done and archived afterwards finished: `wait` goes on for the others.
    let early = id_of(&d.cli(&["add", "done, then put away"]));
    let later = id_of(&d.cli(&["add", "done later"]));
    ok(&d.cli(&["complete", &early.to_string(), "--force"]));
    let stdout = d.dir.path().join("wait-archived.txt");
    let mut waiting = waiting_in_background(&d, &[&early.to_string(), &later.to_string()], &stdout);
    ok(&d.cli(&["archive", &early.to_string()]));
    ok(&d.cli(&["complete", &later.to_string(), "--force"]));
    assert_eq!(
        exit_code(&mut waiting),
        Some(0),
        "{}",
        fs::read_to_string(&stdout).unwrap_or_default()
    );
    // The same when it was archived before the wait began: it finished.
    let text = ok(&d.cli(&["wait", &early.to_string()]));
    assert!(text.contains(&format!("task {early}: done")), "{text}");

    // Not 1 either: no supervisor at all.
    let mut cmd = command();
    cmd.args(["wait", "1", "--socket", "/nonexistent/rw.sock"]);
    let (code, err) = failed(&run(cmd));
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("no supervisor is listening"), "{err}");
}

/// `runwarden wait ARGS` against the daemon, stdout into `stdout`; returned once it follows
/// the supervisor (connected).
fn waiting_in_background(d: &Daemon, args: &[&str], stdout: &Path) -> ChildGuard {
    let mut cmd = command();
    cmd.arg("--socket")
        .arg(&d.socket)
        .arg("wait")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(fs::File::create(stdout).unwrap())
        .stderr(std::process::Stdio::null());
    spawn_connected(&mut cmd)
}

/// Lines from `rx` until one contains `needle` (or the bound passes).
fn expect_line(rx: &mpsc::Receiver<String>, needle: &str) -> String {
    let deadline = std::time::Instant::now() + SETTLE;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(needle) => return line,
            Ok(line) => seen.push(line),
            Err(_) => break,
        }
    }
    panic!("no line containing {needle:?}; got {seen:#?}");
}

#[test]
fn events_and_logs_follow() {
    let d = daemon();
    let socket = d.socket.to_str().unwrap().to_string();
    let (_events, rx) = stream(&["events", "--follow", "--json", "--socket", &socket]);
    let id = id_of(&d.cli(&["add", "followed", "-a", "reporter"]));
    let line = expect_line(&rx, "\"kind\":\"completed\"");
    let ev: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(ev["task_id"], id);
    assert_eq!(ev["payload"]["result"], "ok");

    // Human follow of one task, and `logs --follow` of a log that keeps growing.
    let (_one, rx_one) = stream(&["events", &id.to_string(), "-f", "--socket", &socket]);
    expect_line(&rx_one, "completed");
    let (_logs, rx_logs) = stream(&["logs", &id.to_string(), "--follow", "--socket", &socket]);
    expect_line(&rx_logs, "working");
}

#[test]
fn flags_anywhere_config_or_socket_and_plain_errors() {
    let mut d = daemon();
    // --config instead of --socket, after the subcommand; --json after too.
    let s = ok_json(&d.cli_with_config(&["status", "--json"]));
    assert_eq!(s["pid"], d.pid());
    let id = id_of(&d.cli_with_config(&["add", "via config"]));
    assert_eq!(
        ok_json(&d.cli_with_config(&["show", &id.to_string(), "--json"]))["title"],
        "via config"
    );

    // Completions need no supervisor.
    let out = command().args(["completions", "bash"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("_runwarden"));
    // A failed write is one line and exit 1, not a panic.
    let full = std::fs::File::create("/dev/full").expect("/dev/full");
    let out = command()
        .args(["completions", "bash"])
        .stdout(full)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot write to stdout") && !err.contains("panicked"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");

    // shutdown: the supervisor stops, and then commands say plainly nobody is listening.
    let out = ok(&d.cli(&["shutdown"]));
    assert!(out.contains("stopping"), "{out}");
    let status = d.wait_exit(SETTLE).expect("supervisor exits");
    assert!(status.success(), "{status}");
    let (code, err) = failed(&d.cli(&["status"]));
    assert_eq!(code, 1);
    assert!(
        err.contains("no supervisor is listening on") && err.contains(d.socket.to_str().unwrap()),
        "{err}"
    );
    let mut cmd = command();
    cmd.args(["ls", "--socket", "/nonexistent/rw.sock"]);
    let (code, err) = failed(&run(cmd));
    assert_eq!(code, 1);
    assert!(err.contains("/nonexistent/rw.sock"), "{err}");
    // A file that is not a socket is named as such, not taken for a stale socket.
    let mut cmd = command();
    cmd.arg("ls").arg("--socket").arg(&d.config);
    let (code, err) = failed(&run(cmd));
    assert_eq!(code, 1);
    assert!(err.contains("it is not a socket"), "{err}");
    // A log filter that does not parse is said, and the command goes on (logging at info).
    let mut cmd = command();
    cmd.env("RUNWARDEN_LOG", "debug,x=[")
        .args(["ls", "--socket", "/nonexistent/rw.sock"]);
    let (code, err) = failed(&run(cmd));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("RUNWARDEN_LOG=\"debug,x=[\" is not a log filter")
            && err.contains("/nonexistent/rw.sock"),
        "{err}"
    );
    assert!(!d.stderr_text().contains("panicked"));
}

/// `ls` without `--limit` shows the newest 1000 and says on stderr when there are more (the
/// table and `--json` stay whole on stdout); `--limit` is checked against its range.
#[test]
fn ls_says_when_its_default_limit_cut_the_list() {
    use common::control_daemon::add_tasks;
    use runwarden::board::{DEFAULT_LIST_LIMIT, NewTask};
    let mut d = daemon();
    let n = DEFAULT_LIST_LIMIT as usize;
    let titles = |range: std::ops::Range<usize>| {
        range.map(|i| NewTask {
            title: format!("t{i}"),
            ..NewTask::default()
        })
    };
    let mut c = d.client();
    add_tasks(&mut c, titles(0..n));
    // Exactly the default: all of it, no notice.
    let out = d.cli(&["ls", "--json"]);
    assert_eq!(ok_json(&out).as_array().unwrap().len(), n);
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");

    let ids = add_tasks(&mut c, titles(n..n + 1));
    let out = d.cli(&["ls", "--json"]);
    let listed = ok_json(&out);
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), n, "the default limit holds");
    assert_eq!(listed[0]["id"], ids[0], "newest first");
    let notice = String::from_utf8_lossy(&out.stderr);
    assert!(
        notice.contains("showing the newest 1000") && notice.contains("--limit"),
        "{notice}"
    );
    let table = d.cli(&["ls"]);
    assert_eq!(ok(&table).lines().count(), n + 1, "a header and 1000 rows");
    assert!(String::from_utf8_lossy(&table.stderr).contains("there are more"));
    // Asked for explicitly: as many as asked, no notice.
    let out = d.cli(&["ls", "--json", "--limit", "1001"]);
    assert_eq!(ok_json(&out).as_array().unwrap().len(), n + 1);
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    for bad in ["0", "10001", "-1", "ten"] {
        let (code, err) = failed(&d.cli(&["ls", &format!("--limit={bad}")]));
        assert_eq!(code, 2, "--limit {bad}: {err}");
        assert!(err.contains("--limit"), "--limit {bad}: {err}");
    }
    d.assert_healthy();
}

/// A task id that is not one (negative, zero, a fraction, a word) is refused before anything
/// is sent, with one message for every command that takes ids — `-1` included, which is not
/// taken for an unknown flag.
#[test]
fn a_task_id_that_is_not_one_gets_a_clear_usage_error() {
    let mut d = daemon();
    let cases: &[&[&str]] = &[
        &["show", "-1"],
        &["show", "1.5"],
        &["runs", "0"],
        &["logs", "abc"],
        &["events", "-5"],
        &["wait", "1", "x"],
        &["link", "1", "-2"],
        &["complete", "0"],
        &["block", "-3", "a reason"],
        &["archive", "1e3"],
        &["add", "t", "--parent", "-1"],
    ];
    for args in cases {
        let (code, err) = failed(&d.cli(args));
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(
            err.contains("task ids are whole numbers from 1"),
            "{args:?}: {err}"
        );
    }
    // Nothing reached the board.
    let listed = ok_json(&d.cli(&["ls", "--json"]));
    assert_eq!(listed.as_array().unwrap().len(), 0);
    d.assert_healthy();
}
