//! A worker's escaped descendant that keeps forking away from its pid (each generation starts
//! the next in a session of its own and exits): when the run is reclaimed, the task's next run
//! starts only once that chain is proven gone. A look for the run's token can miss such a
//! chain (it is mid-exec, or its next generation starts where the look has already passed),
//! so the worker's exit, seen while its tree is being ended, must leave the run's evidence to
//! that end — which proves the chain gone — rather than clear it on a look of its own.

#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::Duration;

use common::lifecycle::{Db, View, runwarden_cli};
use common::proc_guard::wait_until;
use common::runtime::{SETTLE, Serve, TestDir};
use runwarden::board::{TaskId, TaskStatus};
use runwarden::process::Signal;

/// Hops at most this many times (a few seconds), so a chain the code under test fails to end
/// still stops by itself.
const HOPS: u32 = 6_000;

/// The first run starts the chain — each generation forks the next, which moves to a session
/// of its own, and exits: a hop takes a fork, far less than a look through `/proc` — and
/// goes on with `then`; every 50th generation appends `hop N` to `log`. The next run appends
/// `second` and exits 0. (Perl's POSIX module is part of Debian's essential
/// `perl-base`.)
fn script(dir: &Path, then: &str) -> String {
    let d = dir.display();
    format!(
        r#"LOG="{d}/log"
if [ -e "{d}/started" ]; then echo second >> "{d}/log"; exit 0; fi
touch "{d}/started"
perl -MPOSIX -e 'open(my $l, ">>", $ARGV[0]) or die;
  for my $i (1..{HOPS}) {{ my $p = fork(); die "fork" unless defined $p; exit 0 if $p;
    POSIX::setsid(); syswrite($l, "hop $i\n") if $i % 50 == 0;
    select(undef, undef, undef, 0.0005) }}' "{d}/log" &
{then}"#
    )
}

fn log_lines(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("log"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Runs a task whose first run starts the chain and goes on with `then`; with `reclaim`, the
/// task is reclaimed once the chain hops. Asserts that its next run started only once the
/// chain was gone, and that the first run's evidence was cleared by the end of its tree.
fn next_run_waits_for_the_chain(then: &str, reclaim: bool) {
    let td = TestDir::new();
    let work = tempfile::tempdir().expect("a directory for the worker's files");
    let config = td.write_config(
        "tick = \"200ms\"",
        &format!(
            "[reaper]\nkill_timeout = \"1s\"\n\n[retries]\nbackoff = \"0s\"\n\n\
             [assignees.w]\ncommand = [\"sh\", \"-c\", {:?}]\n",
            script(work.path(), then)
        ),
    );
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &td.db_path());
    let socket = td.socket_path();
    let added = runwarden_cli(&socket, &["add", "hops away", "--assignee", "w"], SETTLE).ok();
    let task: TaskId = added.stdout.trim().parse().expect("the new task's id");
    let mut db = Db::new(td.db_path());
    assert!(
        wait_until(SETTLE, || !db.runs(task).is_empty()),
        "never claimed"
    );
    let first = db.runs(task).remove(0);
    // Whatever happens, the chain is ended when the test ends (it also stops by itself).
    let token = first.token.clone();
    let _cleanup = Cleanup(Some(move || {
        wait_until(SETTLE, || {
            let found =
                runwarden::process::descendants::pidfds_by_token(&token).unwrap_or_default();
            for fd in &found {
                let _ = fd.signal(Signal::SIGKILL);
            }
            found.is_empty()
        });
    }));
    assert!(
        wait_until(SETTLE, || log_lines(work.path()).len() >= 20),
        "the chain never started hopping: {:?}",
        log_lines(work.path())
    );

    if reclaim {
        runwarden_cli(&socket, &["reclaim", &task.to_string()], SETTLE).ok();
    }
    db.wait_status(task, TaskStatus::Done, SETTLE);

    // A chain left running hops every fraction of a millisecond: give it time to show.
    let later = |lines: &[String]| {
        lines
            .iter()
            .position(|l| l == "second")
            .is_some_and(|i| i + 1 < lines.len())
    };
    wait_until(Duration::from_millis(300), || {
        later(&log_lines(work.path()))
    });
    let lines = log_lines(work.path());
    let second = lines
        .iter()
        .position(|l| l == "second")
        .unwrap_or_else(|| panic!("no second run in {lines:?}"));
    let hops_before = lines[..second].len() * 50;
    assert!(
        hops_before < HOPS as usize,
        "the chain stopped by itself ({hops_before} hops): it was never ended"
    );
    let after: Vec<_> = lines[second + 1..].iter().take(5).collect();
    assert!(
        after.is_empty(),
        "the chain still hopped after the task's next run started: {after:?} (hop {hops_before} before)"
    );
    // The run's evidence was cleared by the end of its tree, which proved the chain gone —
    // not by its worker's exit, seen while that end was under way, on a look of its own.
    let ended: Vec<_> = db
        .events_of(task, "worker_group_ended")
        .into_iter()
        .filter(|e| e.run_id == Some(first.id))
        .collect();
    assert_eq!(
        ended.len(),
        1,
        "the first run's evidence was not cleared by its tree's end:\n{}",
        db.history(task)
    );
    serve.stop_cleanly(Signal::SIGTERM);
}

#[test]
fn a_reclaimed_runs_hopping_escapee_is_gone_before_its_task_runs_again() {
    next_run_waits_for_the_chain("sleep 300", true);
}

/// The worker exits by itself (a crash, retried at once) while its escapee hops: the look at
/// its exit must see the chain (a scan of `/proc` alone almost never does: each generation
/// has moved on by the time the scan reads it).
#[test]
fn a_crashed_runs_hopping_escapee_is_gone_before_its_retry_starts() {
    next_run_waits_for_the_chain(
        "until [ \"$(cat \"$LOG\" 2>/dev/null | wc -l)\" -ge 20 ]; do sleep 0.02; done; exit 3",
        false,
    );
}

struct Cleanup<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Drop for Cleanup<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}
