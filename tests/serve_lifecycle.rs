//! `runwarden serve` as a real process: one supervisor per data dir, clean stops on SIGTERM
//! and SIGINT, config errors as one line with exit 2, the shipped `config.toml` works, and
//! `shutdown = "leave"` / `"terminate"` do what they say to live workers; tasks waiting for
//! an assignee the config lost are reported at start and by `status`.

#[allow(dead_code)]
mod common;

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use common::proc_guard::wait_until;
use common::runtime::{
    SETTLE, Serve, TestDir, WorkerGuard, add_to_board, poll_board, runs_of, task_event,
    wait_worker_in_board,
};
use runwarden::board::{Board, RunOutcome, TaskStatus};
use runwarden::config::Config;
use runwarden::process::{Pid, Signal, fingerprint, group_members};

/// Pins every live member of the worker group led by `leader`, once it has `n` of them.
fn pin_group(leader: Pid, n: usize) -> Vec<WorkerGuard> {
    assert!(
        wait_until(SETTLE, || group_members(leader).len() == n),
        "worker group {leader} never had {n} live members: {:?}",
        group_members(leader)
    );
    group_members(leader)
        .into_iter()
        .map(|pid| WorkerGuard::pin(pid, &fingerprint(pid).expect("fingerprint")))
        .collect()
}

/// After a clean stop: the lock file is gone, and so is the socket if there was one.
fn assert_cleaned_up(td: &TestDir, socket_existed: bool) {
    assert!(
        !td.lock_path().exists(),
        "lock file {} left behind",
        td.lock_path().display()
    );
    if socket_existed {
        assert!(
            !td.socket_path().exists(),
            "socket {} left behind",
            td.socket_path().display()
        );
    }
}

#[test]
fn a_second_serve_is_refused_and_sigterm_stops_the_first_cleanly() {
    let td = TestDir::new();
    let config = td.write_config("tick = \"100ms\"", "");
    let mut first = Serve::start(&config, "first");
    first.wait_ready(&td.lock_path(), &td.db_path());
    let holder = first.pid().to_string();

    let mut second = Serve::start(&config, "second");
    let status = second.wait_exit(SETTLE).unwrap_or_else(|| {
        panic!(
            "the second serve kept running; stderr:\n{}",
            second.stderr()
        )
    });
    let stderr = second.stderr();
    assert!(
        !status.success(),
        "the second serve must fail: {status}; stderr:\n{stderr}"
    );
    assert_eq!(
        status.code(),
        Some(1),
        "refused (exit 1): {status}; stderr:\n{stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {holder}")),
        "stderr names the holder's pid {holder}:\n{stderr}"
    );

    // The refused one changed nothing: the first still runs and still holds the lock.
    assert!(
        matches!(first.child.try_wait(), Ok(None)),
        "the first serve died; stderr:\n{}",
        first.stderr()
    );
    assert_eq!(
        fs::read_to_string(td.lock_path())
            .expect("lock file")
            .trim(),
        holder
    );

    let socket_existed = td.socket_path().exists();
    first.stop_cleanly(Signal::SIGTERM);
    assert_cleaned_up(&td, socket_existed);
}

#[test]
fn sigint_stops_serve_cleanly() {
    let td = TestDir::new();
    let config = td.write_config("tick = \"100ms\"", "");
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let socket_existed = td.socket_path().exists();
    serve.stop_cleanly(Signal::SIGINT);
    assert_cleaned_up(&td, socket_existed);
}

#[test]
fn a_clean_stop_leaves_the_whole_board_in_board_db() {
    // A backup that copies only board.db after a clean stop must get the whole board, not
    // an empty schema whose rows are still in board.db-wal (the store's read-only
    // connections, closed after its writer, cannot checkpoint).
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"",
        "[assignees.quick]\ncommand = [\"/bin/true\"]\n",
    );
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let ids: Vec<_> = (0..3)
        .map(|_| add_to_board(&td.db_path(), "quick"))
        .collect();
    poll_board(&td.db_path(), "the three tasks to be done", |b| {
        let done = ids.iter().all(|&id| {
            b.read(|tx| tx.get_task(id))
                .is_ok_and(|t| t.status == TaskStatus::Done)
        });
        done.then_some(())
    });
    serve.stop_cleanly(Signal::SIGTERM);

    let wal = td.data_dir().join("board.db-wal");
    let wal_len = fs::metadata(&wal).map_or(0, |m| m.len());
    assert_eq!(wal_len, 0, "{} still holds {wal_len} bytes", wal.display());
    let copy = td.path().join("copy");
    fs::create_dir(&copy).unwrap();
    fs::copy(td.db_path(), copy.join("board.db")).unwrap();
    let mut alone = Board::open(&copy.join("board.db")).expect("open the copied board.db");
    for id in ids {
        let task = alone
            .read(|tx| tx.get_task(id))
            .unwrap_or_else(|e| panic!("task {id} missing from the copied board.db: {e}"));
        assert_eq!(task.status, TaskStatus::Done, "task {id} in the copy");
        assert_eq!(
            runs_of(&mut alone, id).len(),
            1,
            "task {id}'s run in the copy"
        );
    }
}

#[test]
fn sigterm_while_booting_is_a_clean_stop() {
    // The earliest outside sign of a boot is the lock file naming the new pid; the board, the
    // actors and the socket come after it. A SIGTERM sent right then must not kill the
    // supervisor mid-boot (default action) but stop it cleanly once it is up.
    for round in 0..3 {
        let td = TestDir::new();
        let config = td.write_config("tick = \"100ms\"", "");
        let mut serve = Serve::start(&config, &format!("boot{round}"));
        let me = serve.pid().to_string();
        let deadline = Instant::now() + SETTLE;
        while fs::read_to_string(td.lock_path()).map_or(true, |s| s.trim() != me) {
            assert!(
                Instant::now() < deadline && matches!(serve.child.try_wait(), Ok(None)),
                "serve never took its lock; stderr:\n{}",
                serve.stderr()
            );
            // A tight poll: the point is to signal while the boot is still under way.
            std::thread::sleep(Duration::from_micros(200));
        }
        serve.stop_cleanly(Signal::SIGTERM);
        assert_cleaned_up(&td, false);
    }
}

#[test]
fn a_malformed_config_exits_2_with_one_line_naming_the_key() {
    // A working directory that is not there is a mistake in the config too, found at start.
    let missing_cwd = "[assignees.w]\ncommand = [\"true\"]\ncwd = \"/nonexistent/work\"\n";
    for (i, (keys, assignees, key)) in [
        ("tick = \"100ms\"\nbogus_key = 1", "", "bogus_key"),
        ("max_in_progress = \"many\"", "", "max_in_progress"),
        ("tick = \"soon\"", "", "tick"),
        ("", missing_cwd, "[assignees.w] cwd"),
    ]
    .into_iter()
    .enumerate()
    {
        let td = TestDir::new();
        let config = td.write_config(keys, assignees);
        let mut serve = Serve::start(&config, &format!("bad{i}"));
        let status = serve
            .wait_exit(SETTLE)
            .unwrap_or_else(|| panic!("serve ran with a malformed config ({keys:?})"));
        let stderr = serve.stderr();
        assert_eq!(
            status.code(),
            Some(2),
            "{keys:?}: {status}; stderr:\n{stderr}"
        );
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{keys:?}: one line:\n{stderr}");
        assert!(
            lines[0].contains(&format!("`{key}`")) || lines[0].contains(key),
            "{keys:?}: the error names `{key}`: {:?}",
            lines[0]
        );
        assert!(
            !td.lock_path().exists(),
            "{keys:?}: nothing started, no lock taken"
        );
    }
}

#[test]
fn the_shipped_config_loads_and_serves() {
    let shipped = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
    let config = Config::load(&shipped).expect("the shipped config.toml loads");
    for name in ["coder", "reviewer"] {
        assert!(
            config.assignee(name).is_some(),
            "the shipped config defines assignee {name}"
        );
    }

    // The same file with its data dir pointed at a temporary directory.
    let td = TestDir::new();
    let text = fs::read_to_string(&shipped).expect("read config.toml");
    let mut replaced = 0;
    let copy: String = text
        .lines()
        .map(|line| {
            if line.trim_start().starts_with("data_dir") {
                replaced += 1;
                format!("data_dir = {:?}", td.data_dir().display().to_string())
            } else {
                line.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(replaced, 1, "the shipped config sets data_dir on one line");
    let path = td.path().join("config.toml");
    fs::write(&path, copy).expect("write the copy");
    assert_eq!(
        Config::load(&path)
            .expect("the copy loads")
            .supervisor
            .data_dir,
        td.data_dir()
    );

    let mut serve = Serve::start(&path, "shipped");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let socket_existed = td.socket_path().exists();
    serve.stop_cleanly(Signal::SIGTERM);
    assert_cleaned_up(&td, socket_existed);
}

#[test]
fn shutdown_leave_keeps_workers_running() {
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"\nshutdown = \"leave\"",
        "[assignees.sleeper]\ncommand = [\"sleep\", \"300\"]\n",
    );
    let db = td.db_path();
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &db);
    let id = add_to_board(&db, "sleeper");
    let (pid, fp) = wait_worker_in_board(&db, id);
    let worker = WorkerGuard::pin(pid, &fp);

    serve.stop_cleanly(Signal::SIGTERM);
    assert!(
        worker.alive(),
        "the worker was ended by a \"leave\" shutdown"
    );
    // Its run stays open for the next incarnation to adopt.
    let mut board = Board::open(&db).expect("open the board");
    let run = runs_of(&mut board, id).pop().expect("the run");
    assert_eq!(run.outcome, None, "{run:?}");
    assert_eq!(run.worker_pid, Some(i64::from(pid)), "{run:?}");
    let task = board.read(|tx| tx.get_task(id)).expect("task");
    assert_eq!(task.status, TaskStatus::Running, "{task:?}");
    assert_cleaned_up(&td, false);
}

#[test]
fn shutdown_terminate_ends_workers_and_releases_their_runs() {
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"\nshutdown = \"terminate\"",
        "[reaper]\nkill_timeout = \"1s\"\n\n\
         [assignees.group]\ncommand = [\"sh\", \"-c\", \"sleep 300 & sleep 300\"]\n",
    );
    let db = td.db_path();
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &db);
    let id = add_to_board(&db, "group");
    let (pid, _) = wait_worker_in_board(&db, id);
    let members = pin_group(pid, 3);

    serve.stop_cleanly(Signal::SIGTERM);
    // Ended before serve exited (it waits for its workers): dead the moment it is gone.
    for m in &members {
        assert!(
            !m.alive(),
            "worker process {} survived a \"terminate\" shutdown; stderr:\n{}",
            m.pid,
            serve.stderr()
        );
    }
    let mut board = Board::open(&db).expect("open the board");
    let run = runs_of(&mut board, id).pop().expect("the run");
    assert_eq!(run.outcome, Some(RunOutcome::Reclaimed), "{run:?}");
    assert_eq!(run.exit_signal, Some(i64::from(libc::SIGTERM)), "{run:?}");
    assert_eq!(run.worker_pid, None, "the exit was recorded: {run:?}");
    let task = board.read(|tx| tx.get_task(id)).expect("task");
    assert_eq!(
        task.status,
        TaskStatus::Ready,
        "released, not failed: {task:?}"
    );
    assert_eq!(task.consecutive_failures, 0, "{task:?}");
    assert!(task_event(&mut board, id, "reclaimed").is_some());
    assert!(task_event(&mut board, id, "worker_exited").is_some());
    assert_cleaned_up(&td, false);
}

/// Tasks left waiting for an assignee the config no longer has never run: `serve` says so once
/// at start (naming the assignee and the count), and `status` says it on request.
#[test]
fn tasks_for_an_assignee_the_config_lost_are_reported() {
    use common::control_daemon::{command, ok, ok_json, run};
    let td = TestDir::new();
    fs::create_dir_all(td.data_dir()).unwrap();
    add_to_board(&td.db_path(), "gone");
    add_to_board(&td.db_path(), "gone");
    let config = td.write_config("", "[assignees.w]\ncommand = [\"true\"]\n");
    let mut serve = Serve::start(&config, "lost");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let warned = wait_until(SETTLE, || {
        serve.stderr().lines().any(|l| {
            l.contains("WARN")
                && l.contains("assignee the config does not have")
                && l.contains("assignee=gone")
                && l.contains("tasks=2")
        })
    });
    assert!(warned, "no warning naming `gone`:\n{}", serve.stderr());
    let status = |json: bool| {
        let mut cmd = command();
        cmd.arg("--socket").arg(td.socket_path()).arg("status");
        if json {
            cmd.arg("--json");
        }
        run(cmd)
    };
    let reply = ok_json(&status(true));
    assert_eq!(
        reply["unconfigured_assignees"],
        serde_json::json!({"gone": 2}),
        "{reply}"
    );
    let text = ok(&status(false));
    assert!(
        text.contains("2 for assignee `gone`, which the config does not have"),
        "{text}"
    );
    // Nothing claimed them.
    assert_eq!(reply["counts"]["ready"], 2, "{reply}");
}

/// A program no worker could start is said at start, naming the assignee's `command` — a typo
/// otherwise shows only as every run ending `spawn_failed` — and not refused (it may be
/// installed later): the supervisor serves on. A program that is there is not named.
#[test]
fn a_program_that_is_not_there_is_warned_about_at_start() {
    let td = TestDir::new();
    let config = td.write_config(
        "",
        "[assignees.by_path]\ncommand = [\"/no/such/dir/prog\"]\n\n\
         [assignees.by_name]\ncommand = [\"no-such-program-rw\", \"--flag\"]\n\n\
         [assignees.fine]\ncommand = [\"sh\", \"-c\", \"true\"]\n",
    );
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let said = |key: &str, what: &str| {
        serve
            .stderr()
            .lines()
            .any(|l| l.contains("WARN") && l.contains(key) && l.contains(what))
    };
    assert!(
        wait_until(SETTLE, || said(
            "[assignees.by_path] command",
            "/no/such/dir/prog"
        ) && said(
            "[assignees.by_name] command",
            "no-such-program-rw"
        )),
        "{}",
        serve.stderr()
    );
    assert!(!said("[assignees.fine]", ""), "{}", serve.stderr());
    serve.stop_cleanly(Signal::SIGTERM);
}
