//! What a worker starts with, read from its own `/proc` entries while it runs: argv as
//! configured, the run's variables and the assignee's beside the supervisor's environment
//! (no variable twice), stdin from /dev/null, stdout and stderr on its task's log, no other
//! descriptor of the supervisor's (its database, socket, pidfds, /dev/null), its own process
//! group, its task's work dir, an empty signal mask and SIGPIPE at its default (the Rust
//! runtime ignores SIGPIPE in the supervisor, and an ignored signal would survive exec).

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;

use common::lifecycle::{Db, View};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir, WorkerGuard, lib_config};
use runwarden::Supervisor;
use runwarden::board::{NewTask, TaskStatus, now_millis};
use runwarden::config::AssigneeConfig;
use runwarden::process::Signal;
use runwarden::process::{Fingerprint, read_stat};

/// A mask line of /proc/<pid>/status (`SigBlk:`, `SigIgn:` …) as a number.
fn mask(status: &str, name: &str) -> u64 {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .unwrap_or_else(|| panic!("no {name} in {status}"));
    u64::from_str_radix(line.trim(), 16).expect("a hex mask")
}

#[test]
fn a_worker_starts_with_its_run_environment_stdio_group_dir_and_default_signals() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    let mut inspect = AssigneeConfig::new(["sleep", "30"]);
    inspect.env.insert("FROM_CONFIG".into(), "yes".into());
    config.assignees.insert("inspect".into(), inspect);
    let sup = Supervisor::start(config).expect("start the supervisor");
    let id = sup
        .add_task(NewTask::titled("look at me").for_assignee("inspect"))
        .expect("add task")
        .id;

    let mut run = None;
    assert!(
        wait_until(SETTLE, || {
            run = sup
                .task(id)
                .ok()
                .and_then(|t| t.runs.into_iter().find(|r| r.worker_pid.is_some()));
            run.is_some()
        }),
        "the worker was never recorded as spawned"
    );
    let run = run.unwrap();
    let pid = run.worker_pid.unwrap() as i32;
    let fp = Fingerprint {
        boot_id: run.worker_boot_id.clone().expect("boot id recorded"),
        start_ticks: run.worker_start_ticks.expect("start time recorded") as u64,
        pidfs_ino: None,
    };
    // Ended with its group when the test ends, passed or failed.
    let _worker = WorkerGuard::pin(pid, &fp);
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));

    let cmdline = fs::read(proc_dir.join("cmdline")).expect("cmdline");
    assert_eq!(cmdline, b"sleep\x0030\x00", "argv as configured");

    let environ = fs::read(proc_dir.join("environ")).expect("environ");
    let mut env = BTreeMap::new();
    for entry in environ.split(|&b| b == 0).filter(|e| !e.is_empty()) {
        let entry = String::from_utf8_lossy(entry).into_owned();
        let (key, value) = entry.split_once('=').expect("KEY=VALUE");
        let earlier = env.insert(key.to_string(), value.to_string());
        assert!(earlier.is_none(), "{key} is set twice: {environ:?}");
    }
    let socket = td.data_dir().join("control.sock");
    let expected = [
        ("RUNWARDEN_TASK_ID", id.to_string()),
        ("RUNWARDEN_RUN_ID", run.id.to_string()),
        ("RUNWARDEN_RUN_TOKEN", run.token.clone()),
        ("RUNWARDEN_TASK_TITLE", "look at me".to_string()),
        ("RUNWARDEN_SOCKET", socket.display().to_string()),
        ("FROM_CONFIG", "yes".to_string()),
    ];
    for (key, value) in expected {
        assert_eq!(env.get(key), Some(&value), "{key} in {env:?}");
    }
    if let Ok(path) = std::env::var("PATH") {
        assert_eq!(
            env.get("PATH"),
            Some(&path),
            "the supervisor's PATH is inherited"
        );
    }

    // Only 0, 1, 2: everything else of the supervisor's is closed. (Read until it is so: the
    // worker is recorded right after its exec, while `sleep` may still hold a locale file it
    // opens as it starts.)
    let fds = || -> Vec<(i32, PathBuf)> {
        let mut fds: Vec<(i32, PathBuf)> = fs::read_dir(proc_dir.join("fd"))
            .expect("fd dir")
            .filter_map(|e| {
                let e = e.ok()?;
                let fd = e.file_name().to_string_lossy().parse().ok()?;
                Some((fd, fs::read_link(e.path()).ok()?))
            })
            .collect();
        fds.sort();
        fds
    };
    let log = td.data_dir().join("logs").join(format!("{id}.log"));
    let expected = [
        (0, PathBuf::from("/dev/null")),
        (1, log.clone()),
        (2, log.clone()),
    ];
    wait_until(SETTLE, || fds() == expected);
    assert_eq!(fds(), expected, "the worker's descriptors");

    let stat = read_stat(pid).expect("stat");
    assert_eq!(stat.pgrp, pid, "the worker leads its own process group");
    // And its own session: no controlling terminal (field 7 of stat, tty_nr, is 0), and no
    // other worker can move into its group (setpgid stays within a session).
    assert_eq!(stat.session, pid, "the worker leads its own session");
    let raw = fs::read_to_string(proc_dir.join("stat")).expect("stat");
    let after_comm = &raw[raw.rfind(')').expect("comm") + 2..];
    let tty_nr = after_comm.split(' ').nth(4).expect("tty_nr");
    assert_eq!(tty_nr, "0", "the worker has a controlling terminal: {raw}");
    assert_eq!(
        fs::read_link(proc_dir.join("cwd")).expect("cwd"),
        td.data_dir().join("work").join(id.to_string()),
        "the worker works in its task's directory"
    );

    let status = fs::read_to_string(proc_dir.join("status")).expect("status");
    assert_eq!(mask(&status, "SigBlk:"), 0, "no signal blocked: {status}");
    let sigpipe = 1u64 << (libc::SIGPIPE - 1);
    assert_eq!(
        mask(&status, "SigIgn:") & sigpipe,
        0,
        "SIGPIPE is not ignored: {status}"
    );
    sup.shutdown();
}

/// Under `runwarden serve`, a descriptor the supervisor inherited open reaches no worker — not
/// even one started by fork + exec (a `umask` to set takes that path), which closes only what
/// is close-on-exec.
#[test]
fn a_descriptor_serve_inherited_reaches_no_worker() {
    // Inherited by the serve child below (opened without close-on-exec), numbered well above
    // what the worker opens itself (ls reads the fd directory through descriptor 3).
    let mut pipe = [0; 2];
    // SAFETY: pipe(2) fills the two descriptors it is given; F_DUPFD copies one of ours to
    // the lowest free number from 200 (without close-on-exec), and the original is closed.
    unsafe {
        assert_eq!(libc::pipe(pipe.as_mut_ptr()), 0, "pipe");
        for end in &mut pipe {
            let high = libc::fcntl(*end, libc::F_DUPFD, 200);
            assert!(high >= 200, "F_DUPFD");
            libc::close(*end);
            *end = high;
        }
    }
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"",
        "[assignees.w]\ncommand = [\"sh\", \"-c\", \"ls /proc/self/fd\"]\numask = \"022\"\n",
    );
    fs::create_dir_all(td.data_dir()).unwrap();
    let mut db = Db::new(td.db_path());
    let task = db.write(|tx| {
        Ok(tx
            .create_task(&NewTask::titled("fds").for_assignee("w"), now_millis())?
            .id)
    });
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    assert!(
        wait_until(SETTLE, || db.get_task(task).status == TaskStatus::Done),
        "task not done\n{}\n{}",
        db.history(task),
        serve.stderr()
    );
    let log = fs::read_to_string(td.data_dir().join("logs").join(format!("{task}.log")))
        .expect("the worker's log");
    let mut fds: Vec<i32> = log
        .split_whitespace()
        .filter_map(|f| f.parse().ok())
        .collect();
    fds.sort();
    assert!(fds.starts_with(&[0, 1, 2]), "{log}");
    for end in pipe {
        assert!(!fds.contains(&end), "fd {end} reached the worker: {log}");
        // SAFETY: our own descriptors, closed once.
        unsafe { libc::close(end) };
    }
    serve.stop_cleanly(Signal::SIGTERM);
}

/// A title longer than its workers' environment can carry (the kernel refuses one string of
/// more than 128 KiB, and with it the whole start) is refused when the task is added, saying
/// why; one on the board from before titles were bounded reaches the worker cut to the bound,
/// and the task runs.
#[test]
fn a_title_too_long_for_the_environment_is_refused_and_an_old_one_is_cut() {
    use runwarden::board::MAX_TITLE_BYTES;
    let td = TestDir::new();
    let mut config = lib_config(&td);
    config.assignees.insert(
        "count".into(),
        AssigneeConfig::new([
            "sh",
            "-c",
            "printf %s \"$RUNWARDEN_TASK_TITLE\" | wc -c > title.len",
        ]),
    );
    // Before the supervisor: a task whose title grew past the bound (a board of an older
    // build), one multibyte character straddling the cut.
    fs::create_dir_all(td.data_dir()).expect("the data dir");
    let mut db = Db::new(td.db_path());
    let old =
        db.write(|tx| tx.create_task(&NewTask::titled("old").for_assignee("count"), now_millis()));
    let long = format!(
        "{}é{}",
        "t".repeat(MAX_TITLE_BYTES - 1),
        "t".repeat(140_000)
    );
    db.execute_raw("UPDATE tasks SET title = ?1 WHERE id = ?2", (&long, old.id));
    let sup = Supervisor::start(config).expect("start the supervisor");

    let refused = sup
        .add_task(NewTask::titled("t".repeat(MAX_TITLE_BYTES + 1)).for_assignee("count"))
        .expect_err("a title over the bound");
    assert!(refused.to_string().contains("title"), "says why: {refused}");
    let fits = sup
        .add_task(NewTask::titled("t".repeat(MAX_TITLE_BYTES)).for_assignee("count"))
        .expect("a title at the bound")
        .id;

    for (task, want) in [(old.id, MAX_TITLE_BYTES - 1), (fits, MAX_TITLE_BYTES)] {
        let done = sup.wait_for(task, SETTLE).expect("wait");
        assert_eq!(done.status, TaskStatus::Done, "{}", db.history(task));
        let len = fs::read_to_string(
            td.data_dir()
                .join("work")
                .join(task.to_string())
                .join("title.len"),
        )
        .expect("the worker wrote its title's length");
        assert_eq!(len.trim(), want.to_string(), "task {task}");
    }
    sup.shutdown();
}
