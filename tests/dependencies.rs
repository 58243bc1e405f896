//! Dependencies, priority and caps, end to end with real workers:
//!
//! - `link PARENT CHILD` refuses a cycle and names it;
//! - a child waits in `todo` until every parent is `done` or `archived`, then is promoted and
//!   dispatched at once — event-driven, with a 30 s tick that never fires during the test;
//! - claiming a task whose parent reopened demotes it back to `todo` with a `demoted` event;
//! - with a cap of 1, tasks run by priority (higher first), then age;
//! - caps hold across a restart: a live run of the previous incarnation (adopted by the next
//!   `runwarden serve`) occupies the slot, so a second ready task waits for it.
//!
//! The tests run one at a time: the last one runs `runwarden serve`, whose orphaned worker
//! re-parents to this process if it is a subreaper at that moment (while an in-process
//! supervisor runs here), where another test's orphan sweep must not meet it.

#[allow(dead_code)]
mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::lifecycle::{
    Db, View, add, open_gate, path_with_runwarden, runwarden_cli, serial, sh_assignee,
    spawned_identity, stop_serve, task_for, wait_for_gate, write,
};
use common::runtime::{SETTLE, Serve, TestDir, WorkerGuard, lib_config};
use runwarden::Supervisor;
use runwarden::board::{NewTask, RunOutcome, TaskStatus, now_millis};
use runwarden::process::Signal;

static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn link_refuses_a_cycle_and_names_it() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    let mut sup = Supervisor::start(lib_config(&td)).expect("start the supervisor");
    // No assignee: never dispatched, so the statuses below are the links' doing alone.
    let a = add(&sup, NewTask::titled("a"));
    let b = add(&sup, NewTask::titled("b"));
    let c = add(&sup, NewTask::titled("c"));
    write(&sup, move |tx, now| tx.link(a, b, now)).expect("link a -> b");
    write(&sup, move |tx, now| tx.link(b, c, now)).expect("link b -> c");

    let err = write(&sup, move |tx, now| tx.link(c, a, now)).expect_err("c -> a closes a cycle");
    assert_eq!(err.code, "bad_request", "{err}");
    let cycle = format!("{c} -> {a} -> {b} -> {c}");
    assert!(
        err.message.contains(&cycle),
        "the error names the cycle {cycle}: {err}"
    );
    let err = write(&sup, move |tx, now| tx.link(b, b, now)).expect_err("a self-link");
    assert!(err.message.contains("itself"), "{err}");
    // The same through the CLI and the control socket, as an operator types it.
    let socket = sup.services().config.socket_path();
    let out = runwarden_cli(&socket, &["link", &c.to_string(), &a.to_string()], SETTLE);
    assert!(!out.status.success(), "a cycle is refused: {out:?}");
    assert!(
        out.stderr.contains(&cycle),
        "the CLI names the cycle {cycle}: {out:?}"
    );
    runwarden_cli(&socket, &["link", &a.to_string(), &c.to_string()], SETTLE).ok();
    assert_eq!(sup.detail(c).parents, vec![a, b], "{}", sup.history(c));

    // The refused links wrote nothing.
    assert_eq!(
        sup.detail(a).parents,
        Vec::<i64>::new(),
        "{}",
        sup.history(a)
    );
    assert_eq!(
        sup.detail(c).children,
        Vec::<i64>::new(),
        "{}",
        sup.history(c)
    );
    assert_eq!(sup.events_of(a, "linked").len(), 0);
    assert_eq!(sup.detail(b).parents, vec![a]);
    // A ready child whose new parent is unfinished goes back to todo, with an event.
    for (child, parent) in [(b, a), (c, b)] {
        assert_eq!(
            sup.get_task(child).status,
            TaskStatus::Todo,
            "{}",
            sup.history(child)
        );
        let demoted = sup.events_of(child, "demoted");
        assert_eq!(demoted.len(), 1, "{}", sup.history(child));
        assert_eq!(demoted[0].payload["parent"], parent);
    }
    sup.shutdown();
}

#[test]
fn a_child_waits_for_every_parent_then_starts_at_once() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    let gates = td.path().join("gates");
    let mut config = lib_config(&td);
    // Far longer than the test: anything that happens is event-driven, not a tick's doing.
    let tick = Duration::from_secs(30);
    config.supervisor.tick = tick;
    let mut w = sh_assignee(&format!("{}; echo ran", wait_for_gate(20)));
    w.max_in_progress = 2;
    w.env.insert("GATE_DIR".into(), gates.display().to_string());
    config.assignees.insert("w".into(), w);
    let started = Instant::now();
    let mut sup = Supervisor::start(config).expect("start the supervisor");

    let p1 = add(&sup, task_for("parent with a worker", "w"));
    let p2 = add(&sup, NewTask::titled("parent to be archived"));
    let child = add(
        &sup,
        NewTask {
            parents: vec![p1, p2],
            ..task_for("child", "w")
        },
    );
    sup.wait_event(p1, "worker_spawned", SETTLE);
    assert_eq!(
        sup.get_task(child).status,
        TaskStatus::Todo,
        "{}",
        sup.history(child)
    );

    // One parent done: the child still waits for the other.
    open_gate(&gates, p1);
    sup.wait_status(p1, TaskStatus::Done, SETTLE);
    sup.assert_stays(
        child,
        TaskStatus::Todo,
        &["promoted", "claimed"],
        Duration::from_millis(500),
    );

    // The last parent archived: promoted, claimed and spawned at once.
    write(&sup, move |tx, now| tx.archive_task(p2, now)).expect("archive p2");
    let archived = sup.wait_event(p2, "archived", SETTLE);
    let promoted = sup.wait_event(child, "promoted", SETTLE);
    let claimed = sup.wait_event(child, "claimed", SETTLE);
    let spawned = sup.wait_event(child, "worker_spawned", SETTLE);
    assert!(archived.id < promoted.id && promoted.id < claimed.id && claimed.id < spawned.id);
    let latency = claimed.at - archived.at;
    assert!(
        latency < 2_000,
        "the child was claimed {latency} ms after its last parent finished (tick {tick:?})"
    );
    open_gate(&gates, child);
    let done = sup.wait_status(child, TaskStatus::Done, SETTLE);
    assert_eq!(done.consecutive_failures, 0);
    assert!(
        started.elapsed() < tick,
        "a tick may have fired; the test proves nothing"
    );
    sup.shutdown();
}

#[test]
fn claiming_a_task_whose_parent_reopened_demotes_it() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let db = Db::new(td.db_path());
    let (parent, child) = db.write(|tx| {
        let now = now_millis();
        let parent = tx.create_task(&NewTask::titled("parent"), now)?.id;
        tx.complete_task(parent, None, Some("ok"), now)?;
        let child = tx.create_task(
            &NewTask {
                parents: vec![parent],
                ..task_for("child", "w")
            },
            now,
        )?;
        Ok((parent, child.id))
    });
    // No transition reopens a finished task today; forge what a reopen leaves behind: a ready
    // child whose parent is unfinished again.
    let n = db.execute_raw(
        "UPDATE tasks SET status = 'ready', completed_at = NULL WHERE id = ?1",
        [parent],
    );
    assert_eq!(n, 1);

    let mut config = lib_config(&td);
    config.assignees.insert("w".into(), sh_assignee("exit 0"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    let demoted = sup.wait_event(child, "demoted", SETTLE);
    assert_eq!(demoted.payload["reason"], "parent_reopened", "{demoted:?}");
    assert_eq!(
        sup.get_task(child).status,
        TaskStatus::Todo,
        "{}",
        sup.history(child)
    );
    // Demoted for good: not claimed again and again on every pass (tick 50 ms).
    sup.assert_stays(
        child,
        TaskStatus::Todo,
        &["claimed", "demoted"],
        Duration::from_millis(400),
    );
    assert!(sup.runs(child).is_empty(), "{}", sup.history(child));

    // The parent finishes: the child is promoted and runs.
    sup.complete(parent, Some("ok again".into()))
        .expect("complete the parent");
    sup.wait_status(child, TaskStatus::Done, SETTLE);
    assert_eq!(sup.runs(child).len(), 1, "{}", sup.history(child));
    sup.shutdown();
}

#[test]
fn with_cap_one_tasks_run_by_priority_then_age() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let db = Db::new(td.db_path());
    // (title, priority), created in this order, 100 ms apart; all ready before the start.
    let specs = [
        ("p0 old", 0),
        ("p5 old", 5),
        ("p5 new", 5),
        ("p10", 10),
        ("p0 new", 0),
        ("p-1", -1),
    ];
    let ids = db.write(|tx| {
        let base = now_millis() - 60_000;
        let mut ids = Vec::new();
        for (i, (title, priority)) in specs.iter().enumerate() {
            let new = NewTask {
                priority: *priority,
                ..task_for(title, "w")
            };
            ids.push(tx.create_task(&new, base + 100 * i as i64)?.id);
        }
        Ok(ids)
    });
    let id_of = |title: &str| ids[specs.iter().position(|(t, _)| *t == title).unwrap()];
    let expected: Vec<i64> = ["p10", "p5 old", "p5 new", "p0 old", "p0 new", "p-1"]
        .iter()
        .map(|t| id_of(t))
        .collect();

    let mut config = lib_config(&td);
    config.assignees.insert("w".into(), sh_assignee("exit 0"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    for &id in &ids {
        sup.wait_status(id, TaskStatus::Done, SETTLE);
    }
    let events = sup.all_events();
    let order: Vec<i64> = events
        .iter()
        .filter(|e| e.kind == "claimed")
        .map(|e| e.task_id.unwrap())
        .collect();
    assert_eq!(order, expected, "claim order (priority desc, then age)");
    // Cap 1: each claim waited for the previous run to close.
    let mut open = 0;
    for e in &events {
        match e.kind.as_str() {
            "claimed" => open += 1,
            "run_closed" => open -= 1,
            _ => {}
        }
        assert!(open <= 1, "two runs open at once at event {e:?}");
    }
    sup.shutdown();
}

#[test]
fn caps_count_live_runs_of_a_previous_incarnation() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    let gates = td.path().join("gates");
    let script = format!("{}; echo done", wait_for_gate(60));
    let config = td.write_config(
        "tick = \"100ms\"\nshutdown = \"leave\"",
        &format!(
            "[reaper]\ngrace = \"300ms\"\nkill_timeout = \"1s\"\n\n\
             [retries]\nmax_retries = 0\nbackoff = \"100ms\"\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {script:?}]\nmax_in_progress = 1\n\
             env = {{ GATE_DIR = {gates:?}, PATH = {path:?} }}\n",
            gates = gates.display().to_string(),
            path = path_with_runwarden(),
        ),
    );
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let first = db.write(|tx| Ok(tx.create_task(&task_for("long", "w"), now_millis())?.id));

    let mut serve = Serve::start(&config, "serve1");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let spawned = db.wait_event(first, "worker_spawned", SETTLE);
    let (pid, fp) = spawned_identity(&spawned);
    let worker = WorkerGuard::pin(pid, &fp);
    let status = stop_serve(&mut serve, Signal::SIGTERM, SETTLE);
    assert!(
        status.is_none_or(|s| s.success()),
        "serve exited {status:?}: {}",
        serve.stderr()
    );
    assert!(
        worker.alive(),
        "shutdown = \"leave\" left the worker running"
    );

    // A second ready task while the slot is held by the previous incarnation's worker.
    let second = db.write(|tx| Ok(tx.create_task(&task_for("waits", "w"), now_millis())?.id));
    let mut serve = Serve::start(&config, "serve2");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    db.wait_event(first, "worker_adopted", SETTLE);
    // Ten ticks: the adopted run counts against the cap of 1.
    db.assert_stays(
        second,
        TaskStatus::Ready,
        &["claimed"],
        Duration::from_secs(1),
    );
    assert!(worker.alive());
    assert_eq!(db.read(|tx| tx.open_runs()).len(), 1);

    // The adopted worker dies: its run closes (max_retries 0: the task gives up) and only
    // then does the waiting task get the slot.
    drop(worker);
    let closed = db.wait_event(first, "run_closed", SETTLE);
    assert_eq!(
        closed.payload["outcome"],
        RunOutcome::Crashed.as_str(),
        "{closed:?}"
    );
    let claimed = db.wait_event(second, "claimed", SETTLE);
    assert!(
        closed.id < claimed.id,
        "{}\n{}",
        db.history(first),
        db.history(second)
    );
    db.wait_event(second, "worker_spawned", SETTLE);
    open_gate(&gates, second);
    db.wait_status(second, TaskStatus::Done, SETTLE);

    let mut open = 0;
    for e in db.all_events() {
        match e.kind.as_str() {
            "claimed" => open += 1,
            "run_closed" => open -= 1,
            _ => {}
        }
        assert!(open <= 1, "two runs of `w` open at once at event {e:?}");
    }
    let status = stop_serve(&mut serve, Signal::SIGTERM, SETTLE);
    assert!(
        status.is_none_or(|s| s.success()),
        "serve exited {status:?}: {}",
        serve.stderr()
    );
}

#[test]
fn an_assignee_at_its_cap_does_not_hold_back_another() {
    let _serial = serial(&SERIAL);
    let td = TestDir::new();
    std::fs::create_dir_all(td.data_dir()).unwrap();
    let db = Db::new(td.db_path());
    // More ready tasks of `busy` (cap 1) than a dispatch pass looks at, all older and of
    // higher priority than the one task of `idle`.
    let (busy, idle) = db.write(|tx| {
        let base = now_millis() - 60_000;
        let mut busy = Vec::new();
        for i in 0..100 {
            let new = NewTask {
                priority: 1,
                ..task_for(&format!("busy {i}"), "busy")
            };
            busy.push(tx.create_task(&new, base + i)?.id);
        }
        let idle = tx.create_task(&task_for("idle", "idle"), base + 1_000)?.id;
        Ok((busy, idle))
    });
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("busy".into(), sh_assignee("sleep 300"));
    config
        .assignees
        .insert("idle".into(), sh_assignee("exit 0"));
    let mut sup = Supervisor::start(config).expect("start the supervisor");
    sup.wait_event(busy[0], "worker_spawned", SETTLE);
    // `idle` has a free slot: it runs now, not after `busy`'s backlog drains.
    sup.wait_status(idle, TaskStatus::Done, SETTLE);
    assert_eq!(
        sup.events_of(busy[1], "claimed").len(),
        0,
        "cap 1 holds for busy"
    );
    sup.shutdown();
}
