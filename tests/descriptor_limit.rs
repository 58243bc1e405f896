//! `runwarden serve` raises its own soft descriptor limit to the hard one (a pidfd per worker,
//! a descriptor per connection: the usual 1024 runs out long before the hard limit does), and
//! its workers start with the limit the supervisor was started with, not the raised one.

#[allow(dead_code)]
mod common;

use std::os::unix::process::CommandExt;

use common::lifecycle::View;
use common::runtime::{SETTLE, Serve, TestDir};
use runwarden::board::TaskStatus;

const SOFT: u64 = 512;
const HARD: u64 = 4096;

/// `Max open files` soft and hard from `/proc/<pid>/limits`.
fn nofile_of(pid: i32) -> (u64, u64) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("its limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a Max open files line");
    let nums: Vec<u64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    (nums[0], nums[1])
}

/// Starts `cmd` with the soft and hard limits [`SOFT`] and [`HARD`].
fn with_low_limit(cmd: &mut std::process::Command) {
    // SAFETY: setrlimit between fork and exec, nothing allocated.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: SOFT,
                rlim_max: HARD,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

#[test]
fn serve_raises_its_descriptor_limit_and_its_workers_keep_the_one_it_had() {
    let td = TestDir::new();
    // `w` starts through clone3; `u`, with a umask to set, through a fork (the other path).
    let seen = |name: &str| td.path().join(format!("seen-{name}"));
    let assignee = |name: &str, more: &str| {
        format!(
            "[assignees.{name}]\ncommand = [\"sh\", \"-c\", \"echo $(ulimit -Sn) $(ulimit -Hn) > {}\"]\n{more}\n",
            seen(name).display()
        )
    };
    let config = td.write_config(
        "tick = \"50ms\"",
        &format!(
            "{}\n{}",
            assignee("w", ""),
            assignee("u", "umask = \"022\"")
        ),
    );
    let mut serve = Serve::start_with(&config, "serve", with_low_limit);
    serve.wait_ready(&td.lock_path(), &td.db_path());
    assert_eq!(
        nofile_of(serve.pid()),
        (HARD, HARD),
        "the supervisor's limit was not raised; stderr:\n{}",
        serve.stderr()
    );

    let mut db = common::lifecycle::Db::new(td.db_path());
    for name in ["w", "u"] {
        let task = common::runtime::add_to_board(&td.db_path(), name);
        let done = db.wait_status(task, TaskStatus::Done, SETTLE);
        assert_eq!(done.status, TaskStatus::Done, "{}", db.history(task));
        let worker_saw = std::fs::read_to_string(seen(name)).expect("the worker's limits");
        assert_eq!(
            worker_saw.trim(),
            format!("{SOFT} {HARD}"),
            "worker {name} did not start with the supervisor's original limit"
        );
    }
    serve.stop_cleanly(runwarden::process::Signal::SIGTERM);
}

/// A descriptor limit below what the config may need at once is said at start (a warning
/// naming both), not found out as EMFILE under load.
#[test]
fn a_descriptor_limit_below_the_configs_needs_is_warned_about_at_start() {
    let td = TestDir::new();
    let config = td.write_config("tick = \"50ms\"", "[control]\nmax_connections = 2048\n");
    let mut serve = Serve::start_with(&config, "serve", with_low_limit);
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let stderr = serve.stderr();
    assert!(
        stderr.contains("the descriptor limit is below") && stderr.contains("limit=4096"),
        "{stderr}"
    );
    serve.stop_cleanly(runwarden::process::Signal::SIGTERM);
}
