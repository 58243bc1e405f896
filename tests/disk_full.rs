//! A full disk under a running supervisor: a write that needs space is refused with
//! `disk_full` and nothing of it is kept, everything else keeps being served, and writes
//! succeed again once there is room — without a restart. A worker that exits while the disk is
//! full keeps its exit: it is recorded once there is room, however long that takes.
//!
//! The data dir is a real 4 MiB tmpfs filled by a file (mounting needs root, as CI runs), in
//! a mount namespace of the test's own thread: nobody else sees it, and it cannot outlive the
//! test even if the test process is killed.

#[allow(dead_code)]
mod common;

use std::ffi::CString;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use common::control_daemon::{Daemon, RawConn, error_code};

/// A small tmpfs mounted at a directory, in a private mount namespace of the calling thread
/// (inherited by the processes it starts). On drop: unmounted, and the directory holding the
/// mount point removed (whatever was cleaned up before could not remove a mount point).
struct SmallFs {
    at: PathBuf,
}

impl SmallFs {
    fn mount(at: &Path, size: &str) -> SmallFs {
        fs::create_dir_all(at).expect("mount point");
        // SAFETY: plain syscalls; CLONE_NEWNS applies to this thread only (it implies
        // CLONE_FS), which is what keeps the mount away from every other test.
        let private = unsafe {
            libc::unshare(libc::CLONE_NEWNS) == 0
                && libc::mount(
                    c"none".as_ptr(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) == 0
        };
        assert!(
            private,
            "this test needs its own mount namespace (run it as root): {}",
            std::io::Error::last_os_error()
        );
        let c = |s: &[u8]| CString::new(s).expect("no NUL");
        let (src, target, fstype, opts) = (
            c(b"tmpfs"),
            c(at.as_os_str().as_bytes()),
            c(b"tmpfs"),
            c(format!("size={size},mode=0700").as_bytes()),
        );
        // SAFETY: valid NUL-terminated strings that outlive the call.
        let rc = unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        assert_eq!(
            rc,
            0,
            "this test needs to mount a tmpfs (run it as root): {}",
            std::io::Error::last_os_error()
        );
        SmallFs {
            at: at.to_path_buf(),
        }
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let target = CString::new(self.at.as_os_str().as_bytes()).expect("no NUL");
        // SAFETY: a valid path string. MNT_DETACH: never fail a test's cleanup on a busy mount.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
        if let Some(parent) = self.at.parent() {
            let _ = fs::remove_dir_all(parent);
        }
    }
}

/// Writes zeros to `path` until the filesystem refuses; returns the bytes written.
fn fill(path: &Path) -> u64 {
    let mut f = fs::File::create(path).expect("filler file");
    let chunk = vec![0u8; 64 * 1024];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
            Err(e) => panic!("filling the disk failed otherwise: {e}"),
        }
    }
    // Also the last partial block.
    let small = [0u8; 512];
    while f.write(&small).map(|n| n > 0).unwrap_or(false) {
        written += small.len() as u64;
    }
    written
}

fn add(c: &mut RawConn, id: u64, title: &str, body: &str) -> serde_json::Value {
    c.call(
        &serde_json::json!({"id": id, "op": "add_task", "title": title, "body": body}).to_string(),
    )
}

fn titles(c: &mut RawConn) -> Vec<String> {
    let r = c.call(r#"{"id":900,"op":"list_tasks"}"#);
    assert_eq!(r["ok"], true, "{r}");
    let mut t: Vec<String> = r["result"]["tasks"]
        .as_array()
        .expect("a list")
        .iter()
        .map(|t| t["title"].as_str().unwrap_or("").to_string())
        .collect();
    t.sort();
    t
}

/// A supervisor on a 4 MiB data dir of its own ([`SmallFs`]), connected, whose assignee `w`
/// runs `sh -c WORKER`; `WORKER` may wait at gates the test opens ([`SmallDisk::gate`],
/// [`SmallDisk::open`]), files outside that file system. Its fields drop in order: the
/// connection and the supervisor go before the unmount.
struct SmallDisk {
    c: RawConn,
    d: Daemon,
    _fs: SmallFs,
    data: PathBuf,
    gates: PathBuf,
}

impl SmallDisk {
    /// `supervisor`: more `[supervisor]` keys; `sections`: tables before `[assignees.w]`;
    /// `worker`: its script, given the gates' directory.
    fn start(supervisor: &str, sections: &str, worker: impl FnOnce(&Path) -> String) -> SmallDisk {
        let dir = tempfile::tempdir().expect("temp dir");
        let data = dir.path().join("data");
        let gates = dir.path().join("gates");
        fs::create_dir_all(&gates).expect("gates");
        let fs = SmallFs::mount(&data, "4m");
        let script = worker(&gates);
        let d = Daemon::start_in(
            dir,
            supervisor,
            &format!("{sections}\n\n[assignees.w]\ncommand = [\"sh\", \"-c\", {script:?}]\n"),
        );
        let mut c = d.raw();
        c.hello();
        SmallDisk {
            c,
            d,
            _fs: fs,
            data,
            gates,
        }
    }

    /// A shell fragment waiting until the gate `name` (in `gates`) is opened.
    fn gate(gates: &Path, name: &str) -> String {
        format!(
            "while [ ! -e {:?} ]; do sleep 0.05; done",
            gates.join(name).display().to_string()
        )
    }

    /// Opens the gate `name`.
    fn open(&self, name: &str) {
        fs::write(self.gates.join(name), "").expect("open a gate");
    }

    /// Adds a task for `w`; its id.
    fn add_w(&mut self, title: &str) -> i64 {
        let r = self.c.call(
            &serde_json::json!({"id": 1, "op": "add_task", "title": title, "assignee": "w"})
                .to_string(),
        );
        assert_eq!(r["ok"], true, "{r}");
        r["result"]["id"].as_i64().expect("an id")
    }

    /// The task's log file and its backup.
    fn log_files(&self, task: i64) -> (PathBuf, PathBuf) {
        let logs = self.data.join("logs");
        (
            logs.join(format!("{task}.log")),
            logs.join(format!("{task}.log.1")),
        )
    }

    /// Waits (up to 10 s) until the task's first run has its worker's pid on record.
    fn wait_worker(&mut self, task: i64) {
        assert!(
            common::proc_guard::wait_until(std::time::Duration::from_secs(10), || self.show(task)
                ["result"]["runs"][0]["worker_pid"]
                .is_i64()),
            "the worker never started: {}",
            self.show(task)
        );
    }

    /// The task as `show_task` answers.
    fn show(&mut self, task: i64) -> serde_json::Value {
        self.c
            .call(&format!(r#"{{"id":2,"op":"show_task","task":{task}}}"#))
    }
}

#[test]
fn a_full_disk_refuses_writes_cleanly_and_the_supervisor_recovers() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    // Declared before the daemon: dropped after it (the supervisor stops, then the unmount and
    // the removal of what the daemon's temp dir could not remove around the mount point).
    let _fs = SmallFs::mount(&data, "4m");
    let mut d = Daemon::start_in(dir, "", "");
    let mut c = d.raw();
    c.hello();

    let r = add(&mut c, 1, "before", "");
    assert_eq!(r["ok"], true, "{r}");

    // The refused write below must need new space, not WAL space SQLite already holds.
    let wal = fs::metadata(data.join("board.db-wal")).map_or(0, |m| m.len());
    assert!(wal < 256 * 1024, "the WAL is already {wal} bytes");

    let filler = data.join("filler");
    assert!(fill(&filler) > 0, "the filler wrote nothing");

    // A write that needs new space: far more than the board has ever written, so it cannot
    // fit in WAL space SQLite already holds.
    let big = "x".repeat(512 * 1024);
    let r = add(&mut c, 2, "too big for the disk", &big);
    assert_eq!(error_code(&r), "disk_full", "{r}");
    let message = r["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("disk is full"), "says why: {r}");
    let again = add(&mut c, 3, "still too big", &big);
    assert_eq!(error_code(&again), "disk_full", "{again}");

    // Everyone else is still served: reads, on this connection and a new one.
    assert_eq!(titles(&mut c), ["before"]);
    let mut other = d.raw();
    other.hello();
    let s = other.call(r#"{"id":4,"op":"status"}"#);
    assert_eq!(s["ok"], true, "{s}");
    d.assert_healthy();

    // Room again: writes succeed, with no restart, and nothing of the refused ones was kept.
    fs::remove_file(&filler).expect("remove the filler");
    let r = add(&mut c, 5, "after", &big);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(titles(&mut c), ["after", "before"]);
    d.assert_healthy();

    d.stop();
    let board = runwarden::board::Board::open(&data.join("board.db")).expect("reopen");
    assert_eq!(board.integrity_check().expect("integrity check"), "ok");
}

#[test]
fn a_worker_exit_while_the_disk_is_full_is_recorded_once_there_is_room() {
    use std::time::Duration;
    let mut sd = SmallDisk::start(
        "",
        // A stale_after well under the outage: a worker whose exit waits to be recorded is
        // not "silent", and must not be closed stale meanwhile.
        "[leases]\nstale_after = \"5s\"\n\n[retries]\nmax_retries = 0",
        |gates| format!("{}; exit 0", SmallDisk::gate(gates, "exit")),
    );
    let task = sd.add_w("exits while the disk is full");
    sd.wait_worker(task);

    let filler = sd.data.join("filler");
    assert!(fill(&filler) > 0, "the filler wrote nothing");
    sd.open("exit");
    // Longer than the few attempts any other refusal gets (1 + 2 + 3 + 4 + 5 s): the exit is
    // still waiting to be recorded, the run open, nothing closed as a crash.
    let mut seen = serde_json::Value::Null;
    let left_running = common::proc_guard::wait_until(Duration::from_secs(17), || {
        seen = sd.show(task);
        seen["result"]["status"] != "running"
    });
    assert!(!left_running, "the run did not stay open: {seen}");
    fs::remove_file(&filler).expect("remove the filler");
    let mut last = serde_json::Value::Null;
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(20), || {
            last = sd.show(task);
            last["result"]["status"] == "done"
        }),
        "the exit was never recorded: {last}"
    );
    let run = &last["result"]["runs"][0];
    assert_eq!(run["outcome"], "completed", "{last}");
    assert_eq!(run["exit_code"], 0, "{last}");
    sd.d.assert_healthy();
}

/// A worker that overruns its max runtime while the disk is full: the timeout cannot be
/// recorded, the worker is ended all the same (the limit is the limit), and its exit — waited
/// out until there is room — closes the run `timed_out`, as the timeout would have, not
/// `crashed` by the SIGTERM that ended it.
#[test]
fn a_timeout_while_the_disk_is_full_is_recorded_as_a_timeout() {
    use std::time::Duration;
    const LIMIT_MS: i64 = 3_000;
    let mut sd = SmallDisk::start("", "[retries]\nmax_retries = 0", |_| {
        "exec sleep 300".to_string()
    });
    // The limit, set here and not in `start`: `[assignees.w]` is written last there.
    let r = sd.c.call(
        &serde_json::json!({"id": 1, "op": "add_task", "title": "overruns", "assignee": "w",
                            "max_runtime_ms": LIMIT_MS})
        .to_string(),
    );
    assert_eq!(r["ok"], true, "{r}");
    let task = r["result"]["id"].as_i64().expect("an id");
    sd.wait_worker(task);
    let run = sd.show(task)["result"]["runs"][0].clone();
    let started = run["started_at"].as_i64().expect("started_at");
    let pid = run["worker_pid"].as_i64().expect("worker_pid") as i32;

    let filler = sd.data.join("filler");
    assert!(fill(&filler) > 0, "the filler wrote nothing");
    let filled_at = runwarden::board::now_millis();
    assert!(
        filled_at < started + LIMIT_MS - 500,
        "the disk was filled too late ({} ms after the start): the scenario did not happen",
        filled_at - started
    );
    // Ended at its limit although nothing could be recorded.
    let gone = common::proc_guard::wait_until(Duration::from_secs(10), || {
        // SAFETY: signal 0 only asks whether the pid exists.
        unsafe { libc::kill(pid, 0) != 0 }
    });
    assert!(gone, "the worker outlived its max runtime on a full disk");
    let open = sd.show(task);
    assert_eq!(
        open["result"]["status"], "running",
        "recorded while the disk was full: {open}"
    );
    fs::remove_file(&filler).expect("remove the filler");
    let mut last = serde_json::Value::Null;
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(20), || {
            last = sd.show(task);
            last["result"]["status"] != "running"
        }),
        "the end was never recorded: {last}"
    );
    let run = &last["result"]["runs"][0];
    assert_eq!(run["outcome"], "timed_out", "{last}");
    let error = run["error"].as_str().unwrap_or_default();
    assert!(error.contains("exceeded max runtime"), "{last}");
    sd.d.assert_healthy();
}

/// A worker that fills the disk with its own output: the tick's rotation cannot write the
/// log's backup, so it cuts the log with nothing kept rather than leave it over its bound and
/// the disk full for good. The board is writable again without anyone stepping in, and the
/// worker's run still ends normally.
#[test]
fn a_log_that_filled_the_disk_is_cut_and_the_disk_has_room_again() {
    use std::time::Duration;
    // 600 KiB first (rotated as usual: a backup to give up later), then more than the disk
    // holds, in one write(2) (no tick's rotation can keep up with it, on however slow a
    // machine): it writes until the disk is full, then waits for its last gate.
    let mut sd = SmallDisk::start("log_max_bytes = 524288", "", |gates| {
        format!(
            "head -c 614400 /dev/zero | tr '\\0' y; {}; dd if=/dev/zero bs=8M count=1 2>/dev/null; {}; echo after",
            SmallDisk::gate(gates, "fill"),
            SmallDisk::gate(gates, "after")
        )
    });
    let task = sd.add_w("chatty");
    let data = sd.data.clone();
    let (log, backup) = sd.log_files(task);
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || {
            fs::metadata(&backup).is_ok_and(|m| m.len() == 524288)
        }),
        "the first 600 KiB were never rotated"
    );
    let first_rotation = runwarden::actors::spawn::log_generation(&log);
    assert!(first_rotation.is_some());
    sd.open("fill");
    let free = || {
        let st = nix::sys::statvfs::statvfs(&data).expect("statvfs");
        st.blocks_available() as u64 * st.fragment_size() as u64
    };
    // The writer stops at a full disk, several times over its bound: the rotation cannot
    // write a backup, and must make room — by the old backup if a rotation during the
    // writing left one, else by cutting the log.
    let said_cut = || {
        let said = sd.d.stderr_text();
        said.contains("the log cut with no backup kept")
            || said.contains("its old backup was deleted to make room")
    };
    let mut seen = (0, 0);
    // Every rotation seen on the way (a tick may rotate between two of dd's writes, and that
    // backup be the one given up).
    let mut rotations: std::collections::BTreeSet<Option<String>> = [first_rotation.clone()].into();
    let cut = common::proc_guard::wait_until(Duration::from_secs(10), || {
        let size = fs::metadata(&log).map_or(u64::MAX, |m| m.len());
        seen = (size, free());
        let now = runwarden::actors::spawn::log_generation(&log);
        let done = said_cut() && size < 524288 && seen.1 > 1024 * 1024;
        if !done {
            rotations.insert(now);
        }
        done
    });
    assert!(
        cut,
        "the log (then {} bytes) was never cut; {} bytes free; stderr:\n{}",
        seen.0,
        seen.1,
        sd.d.stderr_text()
    );
    assert!(
        fs::metadata(&backup).is_ok_and(|m| m.len() <= 524288),
        "a backup within the bound is in place"
    );
    // A follower of the log learns from the new backup which rotation it follows — one it
    // saw, though that backup was given up to make room: it missed nothing in between.
    let start =
        runwarden::actors::spawn::backup_start(&log).expect("the new backup says where it starts");
    assert!(
        start.replaces.is_some() && rotations.contains(&start.replaces),
        "the new backup follows {:?}, not one of the rotations seen: {rotations:?}",
        start.replaces
    );
    assert_ne!(
        start.replaces,
        runwarden::actors::spawn::log_generation(&log),
        "a backup does not follow itself"
    );
    let r =
        sd.c.call(r#"{"id":2,"op":"add_task","title":"room again"}"#);
    assert_eq!(r["ok"], true, "the board is writable again: {r}");
    sd.open("after");
    let mut last = serde_json::Value::Null;
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || {
            last = sd.show(task);
            last["result"]["status"] == "done"
        }),
        "the run never ended: {last}"
    );
    assert!(
        fs::read_to_string(&log).is_ok_and(|l| l.ends_with("after\n")),
        "the worker's later output lands in the cut log"
    );
    sd.d.assert_healthy();
}

/// A first start on a full disk fails (no room for the lock file or the board) and says so;
/// the data dir it made is already the supervisor's alone (0700), not left open to all.
#[test]
fn a_first_start_on_a_full_disk_fails_and_leaves_its_data_dir_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let mount = dir.path().join("small");
    let _fs = SmallFs::mount(&mount, "1m");
    fs::set_permissions(&mount, fs::Permissions::from_mode(0o755)).expect("chmod");
    assert!(fill(&mount.join("filler")) > 0, "the filler wrote nothing");
    let data = mount.join("data");
    let config = dir.path().join("config.toml");
    fs::write(
        &config,
        format!(
            "[supervisor]\ndata_dir = {:?}\n",
            data.display().to_string()
        ),
    )
    .expect("write config");
    let stderr = dir.path().join("serve.stderr");
    let mut serve = Daemon::spawn_serve(&config, &stderr);
    assert!(
        serve
            .pidfd()
            .wait_exit(std::time::Duration::from_secs(10))
            .unwrap_or(false),
        "serve kept running on a full disk"
    );
    let status = serve.0.wait().expect("wait");
    let said = fs::read_to_string(&stderr).unwrap_or_default();
    assert_eq!(status.code(), Some(1), "{said}");
    assert!(said.contains("No space left"), "says why: {said}");
    let mode = fs::metadata(&data)
        .expect("the data dir")
        .permissions()
        .mode()
        & 0o7777;
    assert_eq!(mode, 0o700, "{said}");
}

/// A log just over its bound on a disk something else filled keeps its lines and its old
/// backup: the rotation fails (and says so) until there is room, then rotates as usual.
#[test]
fn a_log_barely_over_its_bound_on_a_disk_filled_by_others_keeps_its_lines() {
    use std::time::Duration;
    // 600 KiB of `y` (rotated as usual), then at the second gate 600 KiB of `z`.
    let mut sd = SmallDisk::start("log_max_bytes = 524288", "", |gates| {
        format!(
            "{}; head -c 614400 /dev/zero | tr '\\0' y; {}; head -c 614400 /dev/zero | tr '\\0' z; exec sleep 30",
            SmallDisk::gate(gates, "a"),
            SmallDisk::gate(gates, "b")
        )
    });
    let task = sd.add_w("a bit over");
    let data = sd.data.clone();
    let (log, backup) = sd.log_files(task);
    let size = || fs::metadata(&log).map_or(0, |m| m.len());
    let backup_of = |byte: u8| {
        fs::read(&backup).is_ok_and(|b| b.len() == 524288 && b.iter().all(|&x| x == byte))
    };
    sd.open("a");
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || backup_of(b'y')),
        "the first 600 KiB were never rotated"
    );
    // Someone else fills the disk, leaving room for the worker's output but not for a backup.
    let filler = data.join("filler");
    fill(&filler);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .expect("filler");
    let len = f.metadata().expect("filler size").len();
    f.set_len(len - 700 * 1024).expect("free 700 KiB");
    drop(f); // An open file keeps its space after its removal below.
    sd.open("b");
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || size() >= 614400),
        "the worker's output never landed: {} bytes",
        size()
    );
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || sd
            .d
            .stderr_text()
            .contains("log rotation failed")),
        "no failed rotation said: {}",
        sd.d.stderr_text()
    );
    // Several ticks (200 ms) later the log still has every line, and the backup its own.
    let lost = common::proc_guard::wait_until(Duration::from_secs(1), || {
        size() < 614400 || !backup_of(b'y')
    });
    assert!(
        !lost,
        "a log barely over its bound lost lines: log {} bytes, backup of y: {}",
        size(),
        backup_of(b'y')
    );
    // Room again: the next tick rotates it as usual, its last 512 KiB in the backup.
    fs::remove_file(&filler).expect("remove the filler");
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || backup_of(b'z')),
        "never rotated once there was room"
    );
    sd.d.assert_healthy();
}

/// A worker's own report refused for want of space is sent again, not given up at once: its
/// result lands once there is room (before, `runwarden complete` failed at the first
/// `disk_full`, and the worker's clean exit then closed the run with no result).
#[test]
fn a_workers_report_refused_by_a_full_disk_lands_once_there_is_room() {
    use std::time::Duration;
    let mut sd = SmallDisk::start("", "[retries]\nmax_retries = 0", |gates| {
        // The CLI's own messages go outside the full file system, where the test reads them.
        let err = gates.join("complete.err").display().to_string();
        format!(
            "{}; runwarden complete --result 'kept through a full disk' 2>{err:?}; {}",
            SmallDisk::gate(gates, "report"),
            SmallDisk::gate(gates, "exit")
        )
    });
    let task = sd.add_w("reports while the disk is full");
    sd.wait_worker(task);
    let filler = sd.data.join("filler");
    assert!(fill(&filler) > 0, "the filler wrote nothing");
    sd.open("report");
    let err = sd.gates.join("complete.err");
    let mut said = String::new();
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(10), || {
            said = fs::read_to_string(&err).unwrap_or_default();
            said.contains("retrying")
        }),
        "the report was not retried: {said:?}, task {}",
        sd.show(task)
    );
    assert!(said.contains("disk"), "{said:?}");
    assert_eq!(sd.show(task)["result"]["status"], "running");
    fs::remove_file(&filler).expect("remove the filler");
    let mut last = serde_json::Value::Null;
    assert!(
        common::proc_guard::wait_until(Duration::from_secs(15), || {
            last = sd.show(task);
            last["result"]["status"] == "done"
        }),
        "the report never landed: {last}"
    );
    assert_eq!(
        last["result"]["result"], "kept through a full disk",
        "{last}"
    );
    assert_eq!(last["result"]["runs"][0]["outcome"], "completed", "{last}");
    sd.open("exit");
    sd.d.assert_healthy();
}
