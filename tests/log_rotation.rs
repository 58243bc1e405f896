//! A task's log (`<data_dir>/logs/<task_id>.log`) takes stdout and stderr of every run of the
//! task, appended; once it reaches `log_max_bytes` it is rotated — at the next spawn, and while
//! its worker runs (on the tick) — keeping one backup, `<task_id>.log.1`, of its last
//! `log_max_bytes`.

#[allow(dead_code)]
mod common;

use std::fs;
use std::path::PathBuf;

use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::board::{NewTask, RunOutcome, TaskId, TaskStatus};
use runwarden::config::AssigneeConfig;
use runwarden::{Supervisor, SupervisorHandle};

/// The smallest size the config accepts; the workers below write more than this.
const MAX: u64 = 1024;

fn logs(td: &TestDir, task: TaskId) -> (PathBuf, PathBuf) {
    let log = td.data_dir().join("logs").join(format!("{task}.log"));
    let backup = td.data_dir().join("logs").join(format!("{task}.log.1"));
    (log, backup)
}

fn read(path: &PathBuf) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn add(sup: &SupervisorHandle, who: &str) -> TaskId {
    sup.add_task(NewTask::titled("logs").for_assignee(who))
        .expect("add task")
        .id
}

#[test]
fn a_full_log_is_rotated_when_the_next_run_starts() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.supervisor.log_max_bytes = MAX;
    // Run 1 writes 1500 bytes (both streams) and crashes; its retry, run 2, finds the log
    // full and starts a fresh one.
    let mut a = AssigneeConfig::new([
        "sh",
        "-c",
        r#"if [ -e "$MARK" ]; then echo second run; exit 0; fi
           : > "$MARK"
           head -c 1500 /dev/zero | tr '\0' A; echo; echo first run on stderr >&2; exit 3"#,
    ]);
    a.max_retries = Some(1);
    a.env
        .insert("MARK".into(), td.path().join("mark").display().to_string());
    config.assignees.insert("w".into(), a);
    let sup = Supervisor::start(config).expect("start the supervisor");

    let id = add(&sup, "w");
    let task = sup.wait_for(id, SETTLE).expect("task finishes");
    assert_eq!(task.status, TaskStatus::Done);
    let runs = sup.task(id).expect("task detail").runs;
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(runs[0].outcome, Some(RunOutcome::Crashed));

    let (log, backup) = logs(&td, id);
    // The backup is the log's last MAX bytes: the end of the A's, then stderr's line.
    let old = read(&backup);
    assert_eq!(old.len() as u64, MAX, "backup: {} bytes", old.len());
    assert!(
        old.ends_with("first run on stderr\n"),
        "stderr goes to the log too"
    );
    assert!(old.starts_with(&"A".repeat(900)), "{old:?}");
    let new = read(&log);
    assert_eq!(new.trim(), "second run", "the fresh log holds run 2 only");
    sup.shutdown();
}

#[test]
fn a_live_workers_log_is_rotated_on_the_tick_and_it_keeps_writing() {
    let td = TestDir::new();
    let gate = td.path().join("gate");
    let mut config = lib_config(&td);
    config.supervisor.log_max_bytes = MAX;
    let mut a = AssigneeConfig::new([
        "sh",
        "-c",
        r#"head -c 2000 /dev/zero | tr '\0' B; echo
           while [ ! -e "$GATE" ]; do sleep 0.02; done
           echo after the rotation"#,
    ]);
    a.env.insert("GATE".into(), gate.display().to_string());
    config.assignees.insert("w".into(), a);
    let sup = Supervisor::start(config).expect("start the supervisor");

    let id = add(&sup, "w");
    let (log, backup) = logs(&td, id);
    // The worker is still running (it waits for the gate) when its log is rotated.
    assert!(
        wait_until(SETTLE, || fs::metadata(&log).is_ok_and(|m| m.len() < MAX)
            && fs::read_to_string(&backup).is_ok_and(
                |b| b == format!("{}\n", "B".repeat(MAX as usize - 1))
            )),
        "log never rotated: log {:?}, backup {:?}",
        fs::metadata(&log).map(|m| m.len()),
        fs::metadata(&backup).map(|m| m.len())
    );
    assert_eq!(
        sup.task(id).expect("task detail").task.status,
        TaskStatus::Running
    );

    fs::write(&gate, "").expect("open the gate");
    let task = sup.wait_for(id, SETTLE).expect("task finishes");
    assert_eq!(task.status, TaskStatus::Done);
    // The worker's append-mode writes land at the start of the truncated file: no hole of
    // zeros where the old content was.
    let new = fs::read(&log).expect("read the log");
    assert_eq!(String::from_utf8_lossy(&new).trim(), "after the rotation");
    sup.shutdown();
}

/// A crash quotes its own run's output only; when the log was rotated while the run went on,
/// all of the fresh log is the run's, wherever the run's output began before.
#[test]
fn a_crash_after_a_rotation_quotes_the_runs_last_output() {
    let td = TestDir::new();
    let gate = td.path().join("gate");
    let mut config = lib_config(&td);
    config.supervisor.log_max_bytes = MAX;
    config.retries.backoff = std::time::Duration::from_millis(50);
    // Run 1 writes 601 bytes and crashes. Run 2 starts at 601 bytes into the log, writes
    // enough for the tick to rotate it, then (after the gate) 701 bytes more, and crashes.
    let mut a = AssigneeConfig::new([
        "sh",
        "-c",
        r#"if [ ! -e "$MARK" ]; then
             : > "$MARK"; head -c 600 /dev/zero | tr '\0' A; echo; exit 3
           fi
           head -c 2000 /dev/zero | tr '\0' B; echo
           while [ ! -e "$GATE" ]; do sleep 0.02; done
           head -c 301 /dev/zero | tr '\0' E; head -c 399 /dev/zero | tr '\0' F; echo
           exit 3"#,
    ]);
    a.max_retries = Some(1);
    a.env.insert("GATE".into(), gate.display().to_string());
    a.env
        .insert("MARK".into(), td.path().join("mark").display().to_string());
    config.assignees.insert("w".into(), a);
    let sup = Supervisor::start(config).expect("start the supervisor");

    let id = add(&sup, "w");
    let (log, backup) = logs(&td, id);
    assert!(
        wait_until(SETTLE, || fs::read_to_string(&backup)
            .is_ok_and(|b| b.ends_with(&format!("{}\n", "B".repeat(100))))
            && fs::metadata(&log).is_ok_and(|m| m.len() < MAX)),
        "run 2's log never rotated"
    );
    fs::write(&gate, "").expect("open the gate");
    let task = sup.wait_for(id, SETTLE).expect("task settles");
    assert_eq!(task.status, TaskStatus::Blocked);
    let runs = sup.task(id).expect("task detail").runs;
    assert_eq!(runs.len(), 2, "{runs:?}");
    assert_eq!(
        runs[1].error.as_deref(),
        Some(format!("exited with code 3; log tail: {}", "F".repeat(399)).as_str()),
        "the last 400 bytes of the run's output"
    );
    sup.shutdown();
}

#[test]
fn a_link_in_a_logs_place_is_never_followed() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.retries.max_retries = 0;
    config.assignees.insert(
        "w".into(),
        AssigneeConfig::new(["sh", "-c", "echo written"]),
    );
    let sup = Supervisor::start(config).expect("start the supervisor");
    // The next task's log place holds a link to a file that is not the supervisor's to write.
    let victim = td.path().join("victim");
    fs::write(&victim, "untouched\n").unwrap();
    let next_id = 1;
    let (log, _) = logs(&td, next_id);
    std::os::unix::fs::symlink(&victim, &log).unwrap();
    let id = add(&sup, "w");
    assert_eq!(id, next_id);
    let task = sup.wait_for(id, SETTLE).expect("task settles");
    let run = &sup.task(id).expect("task detail").runs[0];
    assert_eq!(task.status, TaskStatus::Blocked, "{run:?}");
    assert_eq!(run.outcome, Some(RunOutcome::SpawnFailed), "{run:?}");
    assert!(
        run.error
            .as_deref()
            .is_some_and(|e| e.contains("cannot open log file")),
        "{run:?}"
    );
    assert_eq!(read(&victim), "untouched\n");
    sup.shutdown();
}

#[test]
fn a_fifo_in_the_backups_place_is_replaced_not_waited_on() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.supervisor.log_max_bytes = MAX;
    config.assignees.insert(
        "w".into(),
        AssigneeConfig::new([
            "sh",
            "-c",
            "head -c 2000 /dev/zero | tr '\\0' C; echo; sleep 1",
        ]),
    );
    let sup = Supervisor::start(config).expect("start the supervisor");
    // Task 1's backup place holds a FIFO (an open for writing would wait for a reader).
    let (log, backup) = logs(&td, 1);
    let fifo = std::ffi::CString::new(backup.display().to_string()).unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let id = add(&sup, "w");
    assert_eq!(id, 1);
    // Its log passes the bound while its worker sleeps: the tick rotates it (read only once it
    // is a regular file: reading the FIFO would wait here too).
    let rotated = || {
        fs::symlink_metadata(&backup).is_ok_and(|m| m.file_type().is_file())
            && fs::read_to_string(&backup)
                .is_ok_and(|b| b == format!("{}\n", "C".repeat(MAX as usize - 1)))
    };
    assert!(
        wait_until(SETTLE, rotated),
        "not rotated: log {:?}, backup {:?}",
        fs::metadata(&log).map(|m| m.len()),
        fs::symlink_metadata(&backup).map(|m| m.file_type())
    );
    sup.wait_for(id, SETTLE).expect("task finishes");
    // The tick's chores were not stuck on the FIFO: the next task starts and finishes.
    let next = add(&sup, "w");
    sup.wait_for(next, SETTLE).expect("the next task runs");
    sup.shutdown();
}

#[test]
fn a_backup_that_cannot_be_put_in_place_is_kept_beside_it() {
    use runwarden::actors::spawn::{backup_path, rotate_if_needed, rotation_path};
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("3.log");
    fs::write(&log, "0123456789tail").unwrap();
    // A directory in the backup's place: the rename fails after the log was truncated.
    fs::create_dir(backup_path(&log)).unwrap();
    rotate_if_needed(&log, 4);
    assert_eq!(read(&log), "", "the log was truncated");
    assert_eq!(
        read(&rotation_path(&log)),
        "tail",
        "its tail is kept where it was written"
    );
    // The next rotation, with the way clear, puts a fresh backup in place.
    fs::remove_dir(backup_path(&log)).unwrap();
    fs::write(&log, "abcdefgh").unwrap();
    rotate_if_needed(&log, 4);
    assert_eq!(read(&backup_path(&log)), "efgh");
    assert!(!rotation_path(&log).exists());
}
