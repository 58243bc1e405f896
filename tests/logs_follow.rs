//! `runwarden logs --follow` across a rotation: a log is rotated by copy and truncation, so a
//! follower cannot tell from the size alone that the log started over once it has grown past
//! the follower's offset again. The new backup tells it, read from the file and through the
//! socket (`read_log`'s `rotation`), and what the follower had not read yet is printed from
//! the backup (its start recorded by the rotation) before the new log.

#[allow(dead_code)]
mod common;

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::mpsc;

use common::control_daemon::{Daemon, SETTLE, bin, scrub_env, stream, stream_of};
use common::proc_guard::ChildGuard;
use runwarden::actors::spawn::{backup_path, log_generation, rotate_if_needed};
use runwarden::process::Signal;

/// The next `n` lines the follower prints (fails after the bound).
fn lines(rx: &mpsc::Receiver<String>, n: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + SETTLE;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline
            .checked_duration_since(std::time::Instant::now())
            .unwrap_or_else(|| panic!("only {got:?} within {SETTLE:?}"));
        match rx.recv_timeout(left) {
            Ok(line) => got.push(line),
            Err(e) => panic!("after {got:?}: {e}"),
        }
    }
    got
}

fn append(path: &Path, text: &str) {
    OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .unwrap_or_else(|e| panic!("append to {}: {e}", path.display()));
}

/// Runs `f` while `follower` is stopped (SIGSTOP … SIGCONT): what `f` does to the log happens
/// between two of its looks.
fn while_stopped<T>(follower: &ChildGuard, f: impl FnOnce() -> T) -> T {
    follower
        .pidfd()
        .signal(Signal::SIGSTOP)
        .expect("stop the follower");
    let done = f();
    follower
        .pidfd()
        .signal(Signal::SIGCONT)
        .expect("continue the follower");
    done
}

/// A follower of the file `logs/<task>.log` (with `--config` and no supervisor: the file
/// itself), which has printed the log's first two lines. The directory goes with the first.
fn file_follower(
    task: u32,
) -> (
    tempfile::TempDir,
    std::path::PathBuf,
    ChildGuard,
    mpsc::Receiver<String>,
) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("config.toml");
    fs::write(&config, "[supervisor]\ndata_dir = \"data\"\n").unwrap();
    let logs = dir.path().join("data").join("logs");
    fs::create_dir_all(&logs).unwrap();
    let log = logs.join(format!("{task}.log"));
    append(&log, "old-1\nold-2\n");
    let cfg = config.to_str().unwrap();
    let (follower, rx) = stream(&["logs", &task.to_string(), "--follow", "--config", cfg]);
    assert_eq!(lines(&rx, 2), ["old-1", "old-2"]);
    (dir, log, follower, rx)
}

/// Rotates `log` while the follower is stopped and writes more than the follower had read, so
/// that the follower next sees a log longer than its offset: only the rotation marker can tell
/// it to start over. Then checks it printed the new log from its first line.
fn rotate_under(follower: &ChildGuard, rx: &mpsc::Receiver<String>, log: &Path) {
    let long = while_stopped(follower, || {
        // All of it was printed: the follower's offset.
        let offset = fs::metadata(log).unwrap().len() as usize;
        let before = log_generation(log);
        rotate_if_needed(log, 1);
        assert!(
            fs::metadata(log).unwrap().len() == 0 && backup_path(log).exists(),
            "the log was not rotated"
        );
        assert_ne!(log_generation(log), before, "a rotation shows");
        let long = "y".repeat(offset + 10);
        append(log, &format!("fresh-start\n{long}\n"));
        long
    });
    assert_eq!(
        lines(rx, 2),
        ["fresh-start".to_string(), long],
        "the follower must start the rotated log from its beginning"
    );
}

#[test]
fn following_the_file_starts_over_after_a_rotation_the_size_cannot_show() {
    let (_dir, log, follower, rx) = file_follower(7);
    rotate_under(&follower, &rx, &log);
    // And again: a second rotation is told from the first.
    append(&log, "more\n");
    assert_eq!(lines(&rx, 1), ["more"]);
    rotate_under(&follower, &rx, &log);
}

#[test]
fn following_the_file_prints_what_it_had_not_read_from_the_backup_after_a_rotation() {
    let (_dir, log, follower, rx) = file_follower(8);
    // Written, then rotated away before the follower looked again: the backup holds the old
    // log's last 20 bytes, which include both lines it had not read.
    while_stopped(&follower, || {
        append(&log, "unread-1\nunread-2\n");
        rotate_if_needed(&log, 20);
        assert_eq!(fs::metadata(&log).unwrap().len(), 0, "the log was rotated");
        append(&log, "fresh-1\n");
    });
    assert_eq!(
        lines(&rx, 3),
        ["unread-1", "unread-2", "fresh-1"],
        "nothing that is still on disk is skipped, nothing printed twice"
    );
}

#[test]
fn a_follower_that_missed_two_rotations_prints_the_last_backup_whole() {
    let (_dir, log, follower, rx) = file_follower(9);
    // Two rotations while it is stopped: its offset (12) means nothing in the second backup,
    // which starts at 0 of the log between the two.
    while_stopped(&follower, || {
        append(&log, "lost-1\n");
        rotate_if_needed(&log, 19);
        append(&log, "kept-1\n");
        rotate_if_needed(&log, 7);
        assert_eq!(fs::read_to_string(backup_path(&log)).unwrap(), "kept-1\n");
        append(&log, "fresh-1\n");
    });
    assert_eq!(lines(&rx, 2), ["kept-1", "fresh-1"]);
}

/// `nobody`: an operator served by the socket (`allowed_uids`) who may not read the log files.
const NOBODY: u32 = 65534;

#[test]
fn following_through_the_socket_starts_over_after_a_rotation_too() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let d = Daemon::start("", &format!("[control]\nallowed_uids = [{NOBODY}]\n"));
    fs::set_permissions(d.dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    // A copy of the binary that `nobody` can run wherever the build directory is.
    let bin_dir = tempfile::tempdir().unwrap();
    fs::set_permissions(bin_dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let binary = bin_dir.path().join("runwarden");
    common::copy_executable(Path::new(bin()), &binary);
    let log = d.data_dir.join("logs").join("5.log");
    append(&log, "old-1\nold-2\n");

    let mut cmd = std::process::Command::new(&binary);
    scrub_env(&mut cmd);
    cmd.args(["logs", "5", "--follow", "--socket"])
        .arg(&d.socket)
        .uid(NOBODY)
        .gid(NOBODY);
    let (follower, rx) = stream_of(cmd);
    assert!(
        fs::File::open(&log).is_ok(),
        "(root reads it; nobody cannot, and goes through the socket)"
    );
    assert_eq!(lines(&rx, 2), ["old-1", "old-2"]);
    rotate_under(&follower, &rx, &log);
    append(&log, "more\n");
    assert_eq!(lines(&rx, 1), ["more"]);
    rotate_under(&follower, &rx, &log);
    // What it had not read when the log rotated comes from the backup, through the socket too.
    while_stopped(&follower, || {
        append(&log, "unread-1\nunread-2\n");
        rotate_if_needed(&log, 18);
        append(&log, "fresh-2\n");
    });
    assert_eq!(lines(&rx, 3), ["unread-1", "unread-2", "fresh-2"]);
}

#[test]
fn read_log_names_the_rotation_each_piece_was_read_in() {
    let d = Daemon::start("", "");
    let log = d.data_dir.join("logs").join("9.log");
    append(&log, "first generation\n");
    let mut client = d.client();
    let piece = client.read_log(9, 0, None).expect("read_log");
    assert_eq!(piece.data, "first generation\n");
    assert_eq!(piece.rotation, None, "never rotated");

    rotate_if_needed(&log, 1);
    append(&log, "second generation, longer than the first\n");
    // Past the old offset, yet the rotation says the log started over.
    let after = client.read_log(9, piece.next, None).expect("read_log");
    assert!(after.size > piece.next, "{after:?}");
    let rotation = after.rotation.clone().expect("a rotation is named");
    let again = client.read_log(9, 0, None).expect("read_log");
    assert_eq!(again.data, "second generation, longer than the first\n");
    assert_eq!(again.rotation, Some(rotation.clone()), "same rotation");

    rotate_if_needed(&log, 1);
    let third = client.read_log(9, 0, None).expect("read_log");
    assert!(
        third.rotation.is_some() && third.rotation != Some(rotation),
        "each rotation has its own name: {third:?}"
    );
}

/// A follower of a task's log file whose task is pruned by retention meanwhile (the log file
/// deleted with it) ends, saying so, instead of waiting for the file for ever.
#[test]
fn following_the_file_of_a_task_pruned_meanwhile_ends() {
    let d = Daemon::start(
        "",
        "[retention]\nfinished = \"1s\"\n\n[assignees.w]\ncommand = [\"sh\", \"-c\", \"echo line-1\"]\n",
    );
    let mut c = d.client();
    // The newest task is never pruned (ids must not come back): the followed one is older.
    let add = |c: &mut runwarden::control::client::Client, title: &str| {
        c.add_task(&runwarden::board::NewTask::titled(title).for_assignee("w"))
            .expect("add_task")
            .id
    };
    let task = add(&mut c, "followed");
    let log = d.data_dir.join("logs").join(format!("{task}.log"));
    assert!(
        common::proc_guard::wait_until(SETTLE, || fs::read_to_string(&log)
            .is_ok_and(|l| l.contains("line-1"))),
        "the worker never wrote its log"
    );
    let cfg = d.config.to_str().unwrap().to_string();
    let (mut follower, rx) = stream(&["logs", &task.to_string(), "--follow", "--config", &cfg]);
    assert_eq!(lines(&rx, 1), ["line-1"]);
    add(&mut c, "newer");
    assert!(
        common::proc_guard::wait_until(SETTLE, || !log.exists()),
        "retention never pruned task {task}"
    );
    let mut status = None;
    assert!(
        common::proc_guard::wait_until(SETTLE, || {
            status = follower.0.try_wait().ok().flatten();
            status.is_some()
        }),
        "the follower still waits for a log that is gone with its task"
    );
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{status:?}");
}
