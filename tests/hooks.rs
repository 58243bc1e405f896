//! `[[hooks]]` with the real `runwarden serve`:
//!
//! - a hook on `gave_up` / `crashed` (the outcome of the `run_closed` a crash records) runs
//!   with the event as JSON on stdin and `RUNWARDEN_EVENT_*` in its environment (the hook
//!   writes both to files; they match the board's event exactly), and only for what it names;
//! - a hook that exceeds its timeout is killed — it and its background child, by group —
//!   while the supervisor keeps dispatching;
//! - a failing hook (non-zero exit, or a command that cannot start) is logged, never fatal;
//! - a hook sees the claims made as the supervisor starts (it subscribes before any commit).

#[allow(dead_code)]
mod common;

use std::collections::BTreeSet;
use std::fs;
use std::time::Duration;

use common::lifecycle::{Db, Seen, View, now, seen, stop_serve, wait_pid_file};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir, WorkerGuard};
use runwarden::board::{Event, NewTask, TaskId, TaskStatus, now_millis};
use runwarden::process::Signal;

/// Starts `serve` with assignee `w` running `sh -c worker` and the given `[[hooks]]` tables,
/// after creating one task per title; returns the serve, the board and the tasks.
fn start(td: &TestDir, worker: &str, hooks: &str, titles: &[&str]) -> (Serve, Db, Vec<TaskId>) {
    start_with_env(td, worker, hooks, titles, &[])
}

/// [`start`] with `env` in the supervisor's environment.
fn start_with_env(
    td: &TestDir,
    worker: &str,
    hooks: &str,
    titles: &[&str],
    env: &[(&str, &str)],
) -> (Serve, Db, Vec<TaskId>) {
    let config = td.write_config(
        "tick = \"100ms\"",
        &format!(
            "[retries]\nmax_retries = 0\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {worker:?}]\nmax_in_progress = 4\n\n{hooks}\n"
        ),
    );
    fs::create_dir_all(td.data_dir()).unwrap();
    let db = Db::new(td.db_path());
    let tasks = db.write(|tx| {
        titles
            .iter()
            .map(|t| {
                Ok(tx
                    .create_task(&NewTask::titled(*t).for_assignee("w"), now_millis())?
                    .id)
            })
            .collect()
    });
    let mut serve = Serve::start_with_env(&config, "serve", env);
    serve.wait_ready(&td.lock_path(), &td.db_path());
    (serve, db, tasks)
}

/// A directory for a hook to write into, and a script that `cd`s there and then runs `then`
/// (which writes a pid file there).
fn hook_dir(td: &TestDir, then: &str) -> (std::path::PathBuf, String) {
    let out = td.path().join("hook-out");
    fs::create_dir_all(&out).unwrap();
    let script = format!(
        "cd {out:?} || exit 1; {then}",
        out = out.display().to_string()
    );
    (out, script)
}

/// A `[[hooks]]` table.
fn hook(on: &[&str], script: &str, timeout: &str) -> String {
    format!(
        "[[hooks]]\non = {on:?}\ncommand = [\"sh\", \"-c\", {script:?}]\ntimeout = {timeout:?}\n"
    )
}

#[test]
fn a_hook_gets_the_event_as_json_on_stdin_and_in_its_environment() {
    let td = TestDir::new();
    let out = td.path().join("hook-out");
    fs::create_dir_all(&out).unwrap();
    // The environment first, the JSON last and by rename: a `.json` file means both are whole.
    // Of the RUNWARDEN_* variables: the event's, the socket, and the operator's setting the
    // supervisor inherited (RUNWARDEN_LOG) — not the run variables it inherited (started, as
    // here, inside another supervisor's worker). The hook token is checked elsewhere.
    let script = format!(
        "cd {out:?} && env | grep '^RUNWARDEN_' | grep -v '^RUNWARDEN_HOOK_TOKEN=' | sort > \"$RUNWARDEN_EVENT_ID.env\" \
         && cat > \"$RUNWARDEN_EVENT_ID.tmp\" && mv \"$RUNWARDEN_EVENT_ID.tmp\" \"$RUNWARDEN_EVENT_ID.json\"",
        out = out.display().to_string()
    );
    let (mut serve, mut db, tasks) = start_with_env(
        &td,
        "echo 'worker failed on purpose' >&2; exit 3",
        // `crashed` is a run outcome, not an event kind: it fires on the crash's `run_closed`.
        &hook(&["gave_up", "crashed"], &script, "5s"),
        &["doomed"],
        &[
            ("RUNWARDEN_RUN_TOKEN", "an-outer-run"),
            ("RUNWARDEN_RUN_ID", "77"),
            ("RUNWARDEN_TASK_ID", "78"),
            ("RUNWARDEN_TASK_TITLE", "outer"),
            ("RUNWARDEN_SOCKET", "/nonexistent/outer.sock"),
        ],
    );
    let task = tasks[0];
    db.wait_status(task, TaskStatus::Blocked, SETTLE);
    let gave_up = db.wait_event(task, "gave_up", SETTLE);
    let closed = db.wait_event(task, "run_closed", SETTLE);
    assert_eq!(closed.payload["outcome"], "crashed", "{closed:?}");

    for ev in [&closed, &gave_up] {
        let json = out.join(format!("{}.json", ev.id));
        assert!(
            wait_until(SETTLE, || json.exists()),
            "no hook output for {} event {}; stderr:\n{}",
            ev.kind,
            ev.id,
            serve.stderr()
        );
        let text = fs::read_to_string(&json).unwrap();
        let from_stdin: Event =
            serde_json::from_str(text.trim()).expect("the hook's stdin is an event");
        assert_eq!(&from_stdin, ev, "stdin carries the board's event");
        let env = fs::read_to_string(out.join(format!("{}.env", ev.id))).unwrap();
        let mut expected = vec![
            format!("RUNWARDEN_EVENT_AT={}", ev.at),
            format!("RUNWARDEN_EVENT_ID={}", ev.id),
            format!("RUNWARDEN_EVENT_KIND={}", ev.kind),
            format!("RUNWARDEN_EVENT_RUN_ID={}", ev.run_id.unwrap()),
            format!("RUNWARDEN_EVENT_TASK_ID={task}"),
            "RUNWARDEN_LOG=info".to_string(),
            format!("RUNWARDEN_SOCKET={}", td.socket_path().display()),
        ];
        expected.sort();
        assert_eq!(env.lines().collect::<Vec<_>>(), expected, "{env}");
    }
    let last_error = gave_up.payload["last_error"].as_str().unwrap_or_default();
    assert!(
        last_error.contains("worker failed on purpose"),
        "{last_error}"
    );

    // Only the kinds it names (claimed, worker_spawned, worker_exited… ran no hook).
    let ran: BTreeSet<String> = fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json"))
        .collect();
    let expected: BTreeSet<String> = [closed.id, gave_up.id]
        .iter()
        .map(|id| format!("{id}.json"))
        .collect();
    assert_eq!(ran, expected);
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_hook_over_its_timeout_is_killed_and_the_supervisor_keeps_going() {
    let td = TestDir::new();
    let out = td.path().join("hook-out");
    fs::create_dir_all(&out).unwrap();
    // Long enough for the test to pin the hook and start watching well before it.
    let timeout = Duration::from_millis(2000);
    // Hangs, with a background child in its group; both pids published atomically.
    let script = format!(
        "cd {out:?} || exit 1; sleep 301 & echo $! > \"$RUNWARDEN_EVENT_TASK_ID-bg.tmp\"; \
         mv \"$RUNWARDEN_EVENT_TASK_ID-bg.tmp\" \"$RUNWARDEN_EVENT_TASK_ID-bg.pid\"; \
         echo $$ > \"$RUNWARDEN_EVENT_TASK_ID-hook.tmp\"; \
         mv \"$RUNWARDEN_EVENT_TASK_ID-hook.tmp\" \"$RUNWARDEN_EVENT_TASK_ID-hook.pid\"; exec sleep 300",
        out = out.display().to_string()
    );
    let (mut serve, mut db, tasks) = start(
        &td,
        "exit 0",
        &hook(&["claimed"], &script, "2s"),
        &["first"],
    );
    let first = tasks[0];
    let claimed = db.wait_event(first, "claimed", SETTLE);
    let due = claimed.at + timeout.as_millis() as i64;
    let pin_hook = |task: TaskId| -> (Vec<Seen>, Vec<WorkerGuard>) {
        let hook_pid = wait_pid_file(&out.join(format!("{task}-hook.pid")), SETTLE);
        let bg_pid = wait_pid_file(&out.join(format!("{task}-bg.pid")), SETTLE);
        let procs: Vec<Seen> = [hook_pid, bg_pid].into_iter().map(seen).collect();
        // Pinned at once: whatever fails below, they are SIGKILLed by pid through a
        // verified pidfd.
        let pins = procs.iter().filter_map(Seen::pin).collect();
        (procs, pins)
    };
    let (procs, _pins) = pin_hook(first);

    // Watched from well before the timeout, so an early kill shows as an early time; a test
    // that got here too late to tell fails rather than passing unseen.
    let watch_from = now();
    assert!(
        watch_from < due - 200,
        "the watch started at {watch_from}, too close to the hook's timeout at {due}: the scenario did not run"
    );
    // The supervisor goes on while the hook hangs: a new task is added meanwhile.
    let second = db.write(|tx| {
        Ok(tx
            .create_task(&NewTask::titled("second").for_assignee("w"), now_millis())?
            .id)
    });
    // Killed at its timeout, not before; its background child with it.
    let mut dead_at = None;
    wait_until(timeout + 2 * SETTLE, || {
        if procs.iter().all(|p| !p.alive()) {
            dead_at = Some(now());
        }
        dead_at.is_some()
    });
    let dead_at =
        dead_at.unwrap_or_else(|| panic!("hook still running: {procs:?}\n{}", serve.stderr()));
    assert!(
        dead_at >= due - 50,
        "hook killed {} ms after its event, timeout {timeout:?}",
        dead_at - claimed.at
    );
    // Both tasks were served; the second one's claim ran the hook again (pinned as well).
    db.wait_status(first, TaskStatus::Done, SETTLE);
    db.wait_status(second, TaskStatus::Done, SETTLE);
    let (_, _more_pins) = pin_hook(second);
    assert!(
        wait_until(SETTLE, || serve.stderr().contains("timed out after 2s")),
        "the timeout is logged; stderr:\n{}",
        serve.stderr()
    );
    assert!(
        matches!(serve.child.try_wait(), Ok(None)),
        "serve keeps running"
    );
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_failing_hook_is_logged_never_fatal() {
    let td = TestDir::new();
    let out = td.path().join("hook-out");
    fs::create_dir_all(&out).unwrap();
    let log = out.join("failing.log");
    let failing = format!(
        "echo \"$RUNWARDEN_EVENT_KIND\" >> {:?}; exit 7",
        log.display().to_string()
    );
    let hooks = format!(
        "{}\n[[hooks]]\non = [\"claimed\"]\ncommand = [\"/nonexistent/hook\"]\n",
        hook(&["claimed", "completed"], &failing, "5s")
    );
    let (mut serve, mut db, tasks) = start(&td, "exit 0", &hooks, &["a", "b", "c"]);
    for &task in &tasks {
        db.wait_status(task, TaskStatus::Done, SETTLE);
    }
    // The failing hook ran for every event it names, the run goes on regardless.
    let ran = wait_until(SETTLE, || {
        fs::read_to_string(&log).is_ok_and(|s| s.lines().count() == 2 * tasks.len())
    });
    let text = fs::read_to_string(&log).unwrap_or_default();
    assert!(ran, "hook runs: {text:?}");
    assert_eq!(
        text.lines().filter(|l| *l == "claimed").count(),
        tasks.len()
    );
    assert_eq!(
        text.lines().filter(|l| *l == "completed").count(),
        tasks.len()
    );
    let logged = wait_until(SETTLE, || {
        let e = serve.stderr();
        e.matches("hook failed").count() >= 3 * tasks.len()
            && e.contains("exited with")
            && e.contains("/nonexistent/hook")
    });
    let stderr = serve.stderr();
    assert!(logged, "each failure is logged; stderr:\n{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        matches!(serve.child.try_wait(), Ok(None)),
        "serve keeps running"
    );
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_hook_that_never_reads_a_big_payload_is_still_ended_by_its_timeout() {
    use runwarden::Supervisor;
    use runwarden::config::HookConfig;
    use runwarden::process::{Liveness, fingerprint, liveness};

    let td = TestDir::new();
    let out = td.path().join("hook-out");
    fs::create_dir_all(&out).unwrap();
    let mut config = common::runtime::lib_config(&td);
    // Never reads its stdin: a payload over the pipe buffer (64 KiB) can never be written whole.
    let slow = format!(
        "echo $$ > {dir}/slow-$RUNWARDEN_EVENT_TASK_ID.pid; exec sleep 300",
        dir = out.display()
    );
    // Reads its stdin whole; by rename, so a `.json` file is complete.
    let marker = format!(
        "cat > {dir}/t-$RUNWARDEN_EVENT_TASK_ID.tmp && \
         mv {dir}/t-$RUNWARDEN_EVENT_TASK_ID.tmp {dir}/t-$RUNWARDEN_EVENT_TASK_ID.json",
        dir = out.display()
    );
    config.hooks = vec![
        HookConfig {
            timeout: Duration::from_millis(500),
            ..HookConfig::new(["completed"], ["sh", "-c", &slow])
        },
        HookConfig::new(["completed"], ["sh", "-c", &marker]),
    ];
    let sup = Supervisor::start(config).expect("start the supervisor");
    // No assignee: the tasks are never dispatched, only completed from the library.
    let big_task = sup.add_task(NewTask::titled("big")).unwrap().id;
    let big = "x".repeat(100 * 1024);
    sup.complete(big_task, Some(big.clone())).unwrap();

    let pid_file = out.join(format!("slow-{big_task}.pid"));
    let pid = wait_pid_file(&pid_file, SETTLE);
    let fp = fingerprint(pid).expect("fingerprint of the slow hook");
    // Whatever happens below, it is ended by pid through a verified pidfd.
    let _pin = WorkerGuard::adopt(pid, &fp);
    assert!(
        wait_until(SETTLE, || matches!(liveness(pid, &fp), Liveness::Dead(_))),
        "the hook outlived its timeout: {:?}",
        liveness(pid, &fp)
    );

    // The hook that reads got the whole payload, and later hooks still run.
    let json = |task: TaskId| out.join(format!("t-{task}.json"));
    assert!(wait_until(SETTLE, || json(big_task).exists()));
    let event: Event = serde_json::from_slice(&fs::read(json(big_task)).unwrap()).unwrap();
    assert_eq!(event.payload["result"].as_str(), Some(big.as_str()));
    let later = sup.add_task(NewTask::titled("later")).unwrap().id;
    sup.complete(later, Some("small".into())).unwrap();
    assert!(
        wait_until(SETTLE, || json(later).exists()),
        "a later hook never ran"
    );
    sup.shutdown();
}

#[test]
fn what_a_hook_leaves_running_is_ended_once_its_time_is_up() {
    let td = TestDir::new();
    // Exits at once, leaving a background child in its group.
    let (out, script) = hook_dir(
        &td,
        "sleep 302 & echo $! > bg.tmp; mv bg.tmp bg.pid; exit 0",
    );
    let (mut serve, _db, _tasks) = start(&td, "exit 0", &hook(&["claimed"], &script, "1s"), &["t"]);
    let bg = seen(wait_pid_file(&out.join("bg.pid"), SETTLE));
    let _pin = bg.pin();
    assert!(
        wait_until(SETTLE, || !bg.alive()),
        "the hook's background child outlived the hook's timeout: {bg:?}\n{}",
        serve.stderr()
    );
    assert!(
        matches!(serve.child.try_wait(), Ok(None)),
        "serve keeps running"
    );
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_stopping_supervisor_ends_its_running_hooks_whatever_their_timeout() {
    let td = TestDir::new();
    let (out, script) = hook_dir(
        &td,
        "echo $$ > hook.tmp; mv hook.tmp hook.pid; exec sleep 303",
    );
    let (mut serve, _db, _tasks) = start(&td, "exit 0", &hook(&["claimed"], &script, "1h"), &["t"]);
    let running = seen(wait_pid_file(&out.join("hook.pid"), SETTLE));
    let _pin = running.pin();
    // Stopped well within SETTLE although the hook could run for an hour.
    serve.stop_cleanly(Signal::SIGTERM);
    assert!(!running.alive(), "the hook outlived its supervisor");
    assert!(
        serve.stderr().contains("the supervisor is stopping"),
        "{}",
        serve.stderr()
    );
    // Stopped cleanly, its hooks ended: nothing is left for the next one to end by its token
    // (what a hook detached on purpose outlives it).
    assert!(
        !td.data_dir().join("hooks.token").exists(),
        "a clean stop releases its hook token"
    );
}

/// Hooks still queued when the supervisor stops are dropped, and the log says how many — also
/// when nothing else happens after the stop begins (the count used to wait for a next event
/// or a hook's end, which a stopping supervisor rarely saw).
#[test]
fn hooks_queued_at_a_stop_are_dropped_and_counted_in_the_log() {
    let td = TestDir::new();
    let (out, script) = hook_dir(&td, "echo $$ > h.$$; exec sleep 306");
    // Six claims: four hooks run (the most at once), two wait in the queue.
    let titles = ["a", "b", "c", "d", "e", "f"];
    let (mut serve, mut db, tasks) =
        start(&td, "exit 0", &hook(&["claimed"], &script, "1h"), &titles);
    let running = wait_until(SETTLE, || fs::read_dir(&out).map_or(0, |d| d.count()) == 4);
    assert!(running, "four hooks never ran");
    // Every claim made (its event on its way to the hooks) before the stop: nothing new comes
    // after it to make the queue's count be said.
    for &task in &tasks {
        db.wait_status(task, TaskStatus::Done, SETTLE);
    }
    // Ended with the test, whatever happens to the supervisor.
    let _pins: Vec<_> = fs::read_dir(&out)
        .unwrap()
        .flatten()
        .map(|f| seen(wait_pid_file(&f.path(), SETTLE)))
        .map(|hook| hook.pin())
        .collect();
    serve.stop_cleanly(Signal::SIGTERM);
    let stderr = serve.stderr();
    let dropped: u32 = stderr
        .lines()
        .filter(|l| l.contains("queued hook runs dropped"))
        .filter_map(|l| l.split("dropped=").nth(1)?.trim().parse::<u32>().ok())
        .sum();
    assert_eq!(dropped, 2, "{stderr}");
}

/// A supervisor killed while a hook runs cannot end it, and nothing on the board records it:
/// the next one ends it as it starts (it carries the killed one's hook token).
#[test]
fn what_a_killed_supervisors_hooks_left_running_is_ended_by_the_next_one() {
    let td = TestDir::new();
    let (out, script) = hook_dir(
        &td,
        "echo $$ > hook.tmp; mv hook.tmp hook.pid; exec sleep 304",
    );
    let (mut serve, _db, _tasks) = start(&td, "exit 0", &hook(&["claimed"], &script, "1h"), &["t"]);
    let running = seen(wait_pid_file(&out.join("hook.pid"), SETTLE));
    let _pin = running.pin();
    stop_serve(&mut serve, Signal::SIGKILL, SETTLE).expect("serve killed");
    assert!(
        running.alive(),
        "the hook went with its supervisor: nothing to test"
    );
    assert!(
        td.data_dir().join("hooks.token").exists(),
        "a killed supervisor's hook token is still there"
    );

    let config = td.path().join("config.toml");
    let mut next = Serve::start(&config, "serve2");
    next.wait_ready(&td.lock_path(), &td.db_path());
    assert!(
        wait_until(SETTLE, || !running.alive()),
        "the killed supervisor's hook still runs\n{}",
        next.stderr()
    );
    // Said once the hook is gone (a moment after it is seen gone here).
    assert!(
        wait_until(SETTLE, || next.stderr().contains(
            "ended what the previous supervisor's hooks left running"
        )),
        "{}",
        next.stderr()
    );
    next.stop_cleanly(Signal::SIGTERM);
}

/// Tasks already on the board are claimed as the supervisor starts, before its actors have
/// all run once: a hook on `claimed` still sees every one of those claims.
#[test]
fn a_hook_sees_the_claims_made_as_the_supervisor_starts() {
    use common::runtime::{add_to_board, lib_config};
    use runwarden::config::{AssigneeConfig, HookConfig};
    let td = TestDir::new();
    fs::create_dir_all(td.data_dir()).unwrap();
    let ids: BTreeSet<TaskId> = (0..5).map(|_| add_to_board(&td.db_path(), "w")).collect();
    let seen = td.path().join("claimed");
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["true"]));
    config.hooks = vec![HookConfig::new(
        ["claimed"],
        [
            "sh".to_string(),
            "-c".to_string(),
            format!("echo \"$RUNWARDEN_EVENT_TASK_ID\" >> {}", seen.display()),
        ],
    )];
    let sup = runwarden::Supervisor::start(config).expect("start the supervisor");
    let claimed = || -> BTreeSet<TaskId> {
        fs::read_to_string(&seen)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    };
    assert!(
        wait_until(SETTLE, || claimed() == ids),
        "hooks ran for {:?} of {ids:?}",
        claimed()
    );
    sup.shutdown();
}
