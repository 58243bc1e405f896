//! A copy of a board in use, served from another data dir on the same machine (a backup
//! opened to read it, a new build tried on a copy), must never take the original's live
//! workers for its own: it neither adopts nor signals them — not on archive, not at its
//! terminating stop — and the original goes on supervising them undisturbed. A supervisor
//! restarted on its own data dir still adopts its workers (tests/restart.rs).

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::lifecycle::runwarden_cli;
use common::runtime::{
    SETTLE, Serve, TestDir, WorkerGuard, poll_board, runs_of, task_event, wait_worker_in_board,
};
use runwarden::board::{Board, OpenOptions, TaskStatus};
use runwarden::process::Signal;

const CLI_WAIT: Duration = Duration::from_secs(30);

fn config(td: &TestDir, shutdown: &str) -> std::path::PathBuf {
    config_at(td, &td.data_dir(), shutdown)
}

/// [`config`] naming the data dir as `data_dir` (another spelling of it, say).
fn config_at(td: &TestDir, data_dir: &std::path::Path, shutdown: &str) -> std::path::PathBuf {
    let path = td.path().join("config.toml");
    std::fs::write(
        &path,
        format!(
            "[supervisor]\ndata_dir = {:?}\ntick = \"100ms\"\nshutdown = \"{shutdown}\"\n\n\
             [reaper]\ngrace = \"300ms\"\nkill_timeout = \"1s\"\n\n[leases]\nstale_after = \"1s\"\n\n\
             [assignees.w]\ncommand = [\"sleep\", \"300\"]\n",
            data_dir.display().to_string()
        ),
    )
    .expect("write config.toml");
    path
}

#[test]
fn a_copy_of_a_board_in_use_never_touches_the_originals_workers() {
    let original = TestDir::new();
    let (mut live, task, worker) = live_with_a_worker(&original);
    let pid = worker.pid;

    // A consistent copy of the live board (as `sqlite3 .backup` makes), served elsewhere.
    let copy = TestDir::new();
    copy_board(&original, &copy);
    let mut other = Serve::start(&config(&copy, "terminate"), "copy");
    other.wait_ready(&copy.lock_path(), &copy.db_path());

    // The copy's start has settled the run: adopted (what it must not do) or disowned.
    let seen = poll_board(&copy.db_path(), "the copy to settle the run", |b| {
        task_event(b, task, "worker_disowned").or_else(|| task_event(b, task, "worker_adopted"))
    });
    // Archived there, and that supervisor stopped with shutdown = "terminate".
    runwarden_cli(
        &copy.socket_path(),
        &["archive", &task.to_string()],
        CLI_WAIT,
    )
    .ok();
    poll_board(&copy.db_path(), "the archive on the copy", |b| {
        (b.read(|tx| tx.get_task(task)).ok()?.status == TaskStatus::Archived).then_some(())
    });
    other.stop_cleanly(Signal::SIGTERM);
    assert!(
        worker.alive(),
        "the copy ended the original's worker {pid}; its stderr:\n{}",
        other.stderr()
    );

    // The copy disowned it, without a signal, and closed its run there.
    assert_eq!(seen.kind, "worker_disowned", "{seen:?}");
    assert_eq!(seen.payload["pid"], pid, "{seen:?}");
    let mut board = common::runtime::open_ro(&copy.db_path());
    let runs = runs_of(&mut board, task);
    assert!(
        runs.iter().all(|r| !r.is_open() && r.worker_pid.is_none()),
        "the copy kept a worker on record: {runs:?}"
    );
    let token = &runs_of_original(&original, task)[0].token;
    assert!(
        runs.iter().all(|r| &r.token != token),
        "the copy kept the run's token: processes carrying it would be ended by it"
    );

    // The original still supervises it, as if nothing happened.
    let runs = runs_of_original(&original, task);
    assert_eq!(runs.len(), 1, "{runs:?}");
    assert!(runs[0].is_open(), "{runs:?}");
    assert_eq!(runs[0].worker_pid, Some(i64::from(pid)), "{runs:?}");
    live.stop_cleanly(Signal::SIGTERM);
    assert!(worker.alive(), "shutdown = \"leave\" leaves it running");
}

/// A consistent copy of `from`'s board (as `sqlite3 .backup` makes) in `to`'s data dir.
fn copy_board(from: &TestDir, to: &TestDir) {
    std::fs::create_dir_all(to.data_dir()).expect("the copy's data dir");
    let source = Board::open_with(
        &from.db_path(),
        OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        },
    )
    .expect("open the live board");
    source
        .execute_raw(
            "VACUUM INTO ?1",
            [to.db_path().to_str().expect("a UTF-8 path")],
        )
        .expect("copy the board");
}

/// A supervisor running one `sleep 300` task with `shutdown = "leave"`: it, the task and its
/// pinned worker.
fn live_with_a_worker(td: &TestDir) -> (Serve, i64, WorkerGuard) {
    live_at(td, &td.data_dir())
}

/// [`live_with_a_worker`] with the data dir named `data_dir` in its config.
fn live_at(td: &TestDir, data_dir: &std::path::Path) -> (Serve, i64, WorkerGuard) {
    let mut live = Serve::start(&config_at(td, data_dir, "leave"), "live");
    live.wait_ready(&td.lock_path(), &td.db_path());
    let added = runwarden_cli(
        &td.socket_path(),
        &["add", "long job", "--assignee", "w"],
        CLI_WAIT,
    )
    .ok();
    let task: i64 = added.stdout.trim().parse().expect("add prints the id");
    let (pid, fp) = wait_worker_in_board(&td.db_path(), task);
    (live, task, WorkerGuard::pin(pid, &fp))
}

/// The first event of `kind` or `or` on `task` in the board at `db`, waited for.
fn settled(db: &std::path::Path, task: i64) -> runwarden::board::Event {
    poll_board(db, "the start to settle the run", |b| {
        task_event(b, task, "worker_disowned").or_else(|| task_event(b, task, "worker_adopted"))
    })
}

/// A board an older build served (schema 9: no home recorded), copied while its supervisor
/// runs: the copy's workers report to that supervisor, which answers — disowned all the same.
#[test]
fn a_copy_of_a_board_an_older_build_serves_disowns_its_workers_too() {
    let original = TestDir::new();
    let (mut live, task, worker) = live_with_a_worker(&original);
    let copy = TestDir::new();
    copy_board(&original, &copy);
    as_schema_9(&copy.db_path());
    let mut other = Serve::start(&config(&copy, "terminate"), "copy");
    other.wait_ready(&copy.lock_path(), &copy.db_path());
    let seen = settled(&copy.db_path(), task);
    other.stop_cleanly(Signal::SIGTERM);
    assert_eq!(
        seen.kind,
        "worker_disowned",
        "{seen:?}
{}",
        other.stderr()
    );
    assert!(worker.alive(), "the copy ended the original's worker");
    live.stop_cleanly(Signal::SIGTERM);
}

/// The data dir recreated at its own path while its workers run (`mv data data.old; cp -a
/// data.old data`, a restore into place): the same data dir, whose workers are its own —
/// adopted, not disowned (which would leave them unsupervised and run their tasks again).
#[test]
fn a_data_dir_recreated_at_its_own_path_adopts_its_workers() {
    let td = TestDir::new();
    let (mut live, task, worker) = live_with_a_worker(&td);
    live.stop_cleanly(Signal::SIGTERM);
    let data = td.data_dir();
    let old = td.path().join("data.old");
    std::fs::rename(&data, &old).expect("move the data dir away");
    cp_a(&old, &data);
    assert_adopted_by_a_start(&td, task, &worker, "again");
}

/// A copy of the whole data dir (`cp -a`) while a hook of the original runs: the copied
/// `hooks.token` is the original's, and the copy ends nothing that carries it.
#[test]
fn a_copy_of_the_whole_data_dir_leaves_the_originals_hooks_alone() {
    let original = TestDir::new();
    let pid_file = original.path().join("hook.pid");
    let script = format!(
        "echo $$ > {0}.tmp; mv {0}.tmp {0}; exec sleep 300",
        pid_file.display()
    );
    let config = original.write_config(
        "tick = \"100ms\"",
        &format!(
            "[[hooks]]\non = [\"created\"]\ncommand = [\"sh\", \"-c\", {script:?}]\ntimeout = \"10m\"\n"
        ),
    );
    let mut live = Serve::start(&config, "live");
    live.wait_ready(&original.lock_path(), &original.db_path());
    runwarden_cli(&original.socket_path(), &["add", "hooked"], CLI_WAIT).ok();
    let pid = common::lifecycle::wait_pid_file(&pid_file, SETTLE);
    let hook_proc = common::lifecycle::seen(pid);
    let _pin = hook_proc.pin();
    let copy = TestDir::new();
    cp_a(original.data_dir(), copy.data_dir());
    // Its lock and socket are the original's: a copy made live has them too.
    let _ = std::fs::remove_file(copy.lock_path());
    let _ = std::fs::remove_file(copy.socket_path());
    let copy_config = copy.write_config("tick = \"100ms\"", "");
    let mut other = Serve::start(&copy_config, "copy");
    other.wait_ready(&copy.lock_path(), &copy.db_path());
    other.stop_cleanly(Signal::SIGTERM);
    assert!(
        hook_proc.alive(),
        "the copy ended the original's hook; its stderr:\n{}",
        other.stderr()
    );
    live.stop_cleanly(Signal::SIGTERM);
}

/// `cp -a from to`.
fn cp_a(from: impl AsRef<std::path::Path>, to: impl AsRef<std::path::Path>) {
    let copied = std::process::Command::new("cp")
        .arg("-a")
        .arg(from.as_ref())
        .arg(to.as_ref())
        .status()
        .expect("cp -a");
    assert!(copied.success(), "cp -a failed");
}

/// Makes the board at `db` one of schema 9, which recorded no home.
fn as_schema_9(db: &std::path::Path) {
    let board = Board::open(db).expect("open the board");
    for sql in ["DROP TABLE board_home", "PRAGMA user_version = 9"] {
        board.execute_raw(sql, []).expect("as a board of schema 9");
    }
}

/// Starts `serve` on `td` (`leave`), and checks it adopts `task`'s `worker`; stops it.
fn assert_adopted_by_a_start(td: &TestDir, task: i64, worker: &WorkerGuard, name: &str) {
    let mut again = Serve::start(&config(td, "leave"), name);
    again.wait_ready(&td.lock_path(), &td.db_path());
    let seen = settled(&td.db_path(), task);
    assert_eq!(seen.kind, "worker_adopted", "{seen:?}\n{}", again.stderr());
    again.stop_cleanly(Signal::SIGTERM);
    assert!(worker.alive(), "shutdown = \"leave\" leaves it running");
}

fn runs_of_original(td: &TestDir, task: i64) -> Vec<runwarden::board::Run> {
    let mut board = common::runtime::open_ro(&td.db_path());
    runs_of(&mut board, task)
}

/// The data dir moved to another path (and file system) while its workers run — copied there
/// and the original removed, as a move to a bigger disk goes: the board's recorded home is
/// gone, so this is that data dir moved, not a copy of one in use: its workers are adopted.
#[test]
fn a_data_dir_moved_elsewhere_adopts_its_workers() {
    let td = TestDir::new();
    let (mut live, task, worker) = live_with_a_worker(&td);
    live.stop_cleanly(Signal::SIGTERM);
    let moved = TestDir::new();
    cp_a(td.data_dir(), moved.data_dir());
    std::fs::remove_dir_all(td.data_dir()).expect("remove the old data dir");
    assert_adopted_by_a_start(&moved, task, &worker, "moved");
}

/// A board an older build served (no home recorded) whose worker reports to this very data
/// dir's socket, spelled another way (the config named the data dir through a link then): the
/// socket it names is the one this supervisor listens on — its own, not another's.
#[test]
fn a_worker_reporting_to_our_own_socket_by_another_path_is_adopted() {
    let td = TestDir::new();
    let alias = td.path().join("alias");
    std::os::unix::fs::symlink(td.path(), &alias).expect("a link to the test dir");
    let through_link = alias.join("data");
    let (mut first, task, worker) = live_at(&td, &through_link);
    first.stop_cleanly(Signal::SIGTERM);
    // As a board of schema 9, which recorded no home.
    as_schema_9(&td.db_path());

    assert_adopted_by_a_start(&td, task, &worker, "again");
}
