//! A real pid reuse: the kernel hands a finished worker's pid to an unrelated process, and the
//! terminal reaper must neither signal that process nor keep rescanning the stale evidence.
//!
//! Pids are allocated cyclically (last + 1, skipping pids in use, wrapping at `pid_max`), so the
//! test walks the counter once around: it burns pids with short-lived threads (a thread's tid
//! comes from the same allocator as a process's pid, at a fraction of the cost of a fork) until
//! the next allocation is the target, then spawns the long-lived stranger. Something else on the
//! machine may grab the target first; then the walk goes round again, within a bound. If the pid
//! cannot be recycled in time the test fails, saying so.

#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::board::{
    GRACE, KILL_TIMEOUT, RecordingSignaller, TempBoard, assert_evidence_cleared,
    completed_with_worker, events_of, kinds, run, sleeper, still_running, temp_board,
};
use common::proc_guard::ChildGuard;
use runwarden::board::{now_millis, reap_terminal_workers};
use runwarden::process::{
    DeadReason, Fingerprint, Liveness, Pid, PidFd, Signal, Verified, fingerprint, liveness,
    open_verified,
};

/// Bounds of the recycling walk (one full cycle of a 32768-pid space takes about a second).
const MAX_WALK: Duration = Duration::from_secs(60);
const MAX_ALLOCATIONS: u64 = 200_000;

/// Allocates (and releases) one pid: the tid of a thread that exits at once.
fn burn_one_pid() -> Pid {
    std::thread::spawn(|| {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() }
    })
    .join()
    .expect("burner thread")
}

/// True when every pid strictly between `last` and `target` is in use, i.e. the next allocation
/// (barring a wrap or another allocator on the machine) is `target`. Threads count: `/proc/<tid>`
/// resolves for them although it is not listed.
fn next_is(last: Pid, target: Pid) -> bool {
    last < target
        && target - last <= 64
        && (last + 1..target).all(|p| Path::new(&format!("/proc/{p}")).exists())
}

struct Recycled {
    holder: ChildGuard,
    allocations: u64,
    rounds: u32,
    took: Duration,
}

/// Walks the pid counter until a new `sleep` gets `target`; Err with a message if the bound
/// is reached first.
fn recycle(target: Pid, mut last: Pid) -> Result<Recycled, String> {
    let start = Instant::now();
    let mut allocations = 0u64;
    let mut rounds = 0u32;
    loop {
        if start.elapsed() > MAX_WALK || allocations > MAX_ALLOCATIONS {
            return Err(format!(
                "could not get pid {target} recycled: {allocations} allocations, {rounds} \
                 near misses in {:?} (last pid seen {last})",
                start.elapsed()
            ));
        }
        if next_is(last, target) {
            let (holder, _) = sleeper(60);
            allocations += 1;
            if holder.pid() == target {
                return Ok(Recycled {
                    holder,
                    allocations,
                    rounds,
                    took: start.elapsed(),
                });
            }
            // Someone else took it (or a pid below it was freed meanwhile): end this one by its
            // pidfd (the guard's drop) and go round again.
            rounds += 1;
            last = holder.pid();
            drop(holder);
        } else {
            last = burn_one_pid();
            allocations += 1;
        }
    }
}

/// The terminal reaper's sweep just after the grace of a run closed at `ended_at`.
fn reap_after_grace(tb: &mut TempBoard, signaller: &RecordingSignaller, ended_at: i64) -> Vec<i64> {
    reap_terminal_workers(
        &mut tb.board,
        signaller,
        ended_at + GRACE.as_millis() as i64 + 1,
        GRACE,
        KILL_TIMEOUT,
    )
    .unwrap()
}

#[test]
fn recycled_pid_is_never_signalled_and_its_evidence_is_cleared() {
    let mut tb = temp_board();

    // The worker: spawned, fingerprinted, its run completed while it lives.
    let (mut worker, fp) = sleeper(120);
    let target = worker.pid();
    let ended_at = now_millis();
    let (task, run_id) =
        completed_with_worker(&mut tb.board, "finished", target, Some(&fp), ended_at);

    // It exits and is reaped: its pid is free for the kernel to hand out again.
    worker.pidfd().signal(Signal::SIGKILL).unwrap();
    worker.wait().unwrap();
    assert_eq!(
        liveness(target, &fp),
        Liveness::Dead(DeadReason::NoSuchProcess)
    );

    let recycled = match recycle(target, target) {
        Ok(r) => r,
        Err(msg) => panic!("{msg}; the pid reuse scenario could not be set up"),
    };
    println!(
        "pid {target} recycled after {} pid allocations ({} near misses) in {:?}",
        recycled.allocations, recycled.rounds, recycled.took
    );
    let mut stranger = recycled.holder;
    let stranger_fp = fingerprint(target).expect("fingerprint of the stranger");
    assert_eq!(stranger_fp.boot_id, fp.boot_id);
    assert_ne!(
        stranger_fp.start_ticks, fp.start_ticks,
        "the stranger started in the same clock tick as the worker: a fingerprint cannot tell \
         them apart, and this test cannot show anything"
    );
    // The recorded fingerprint now points at a live, different process.
    assert_eq!(liveness(target, &fp), Liveness::Dead(DeadReason::Recycled));

    let signaller = RecordingSignaller::default();
    let reaped = reap_after_grace(&mut tb, &signaller, ended_at);

    assert_eq!(reaped, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![], "the stranger was signalled");
    assert!(still_running(&mut stranger), "the stranger was ended");
    assert_eq!(liveness(target, &stranger_fp), Liveness::Alive);

    assert_evidence_cleared(&run(&mut tb.board, run_id), target);
    let events = events_of(&mut tb.board, task, "terminal_worker_pid_recycled");
    assert_eq!(events.len(), 1, "{:?}", kinds(&mut tb.board, task));
    assert_eq!(events[0].run_id, Some(run_id));
    assert_eq!(events[0].payload["pid"], target);
    assert_eq!(events[0].payload["start_ticks"], fp.start_ticks);

    // Not rescanned: the next sweep finds nothing and still signals nobody.
    let again = reap_terminal_workers(
        &mut tb.board,
        &signaller,
        ended_at + 2 * GRACE.as_millis() as i64,
        GRACE,
        KILL_TIMEOUT,
    )
    .unwrap();
    assert_eq!(again, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![]);
    assert!(still_running(&mut stranger));
}

/// A process paused for ever, started by a raw `clone3` (no exec: it starts within
/// microseconds), at pid `at` when given (`set_tid`, root's), ended and reaped by its pidfd on
/// drop.
struct Paused {
    pidfd: PidFd,
}

/// clone3's argument (include/uapi/linux/sched.h), up to `set_tid_size`.
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
}

impl Paused {
    fn start(at: Option<Pid>) -> std::io::Result<Paused> {
        let tid = at.unwrap_or(0);
        let args = CloneArgs {
            exit_signal: libc::SIGCHLD as u64,
            set_tid: if at.is_some() {
                &tid as *const Pid as u64
            } else {
                0
            },
            set_tid_size: u64::from(at.is_some()),
            ..CloneArgs::default()
        };
        // SAFETY: a fork-like clone3 (no CLONE_VM); the child only calls pause(2), which is
        // async-signal-safe, until it is killed.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &args as *const CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            )
        };
        match ret {
            0 => loop {
                // SAFETY: see above.
                unsafe { libc::pause() };
            },
            pid if pid < 0 => Err(std::io::Error::last_os_error()),
            pid => {
                // Our unreaped child: its pid cannot name anyone else yet.
                let pidfd = PidFd::open(pid as Pid).map_err(std::io::Error::other)?;
                Ok(Paused { pidfd })
            }
        }
    }

    fn pid(&self) -> Pid {
        self.pidfd.pid()
    }

    /// Kills and reaps it.
    fn end(&self) {
        let _ = self.pidfd.signal(Signal::SIGKILL);
        let _ = self.pidfd.wait_exit(Duration::from_secs(10));
        let _ = self.pidfd.try_reap();
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        self.end();
    }
}

/// A worker (its fingerprint with its pidfs inode) that exited and was reaped, and a stranger
/// given its pid within the worker's clock tick: the same boot id and start time. Placing the
/// pid takes root (clone3's `set_tid`), as CI runs; Linux >= 6.9 for the inode.
fn same_tick_stranger() -> (Paused, Fingerprint) {
    for attempt in 1..=200 {
        let worker = Paused::start(None).expect("start a worker");
        let pid = worker.pid();
        let mut fp = fingerprint(pid).expect("the worker's fingerprint");
        fp.pidfs_ino = worker.pidfd.pidfs_ino().expect("fstat of its pidfd");
        assert!(
            fp.pidfs_ino.is_some(),
            "this kernel's pidfds are not pidfs inodes (Linux < 6.9?): this test cannot run"
        );
        worker.end();
        let stranger = match Paused::start(Some(pid)) {
            Ok(s) => s,
            // Someone else took the pid first.
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => continue,
            Err(e) => panic!("clone3 with set_tid (needs root): {e}"),
        };
        match fingerprint(pid) {
            Ok(now) if now.start_ticks == fp.start_ticks => {
                println!("stranger at pid {pid} in its worker's tick after {attempt} attempt(s)");
                return (stranger, fp);
            }
            _ => continue, // The next tick: try again.
        }
    }
    panic!("no stranger started in its worker's clock tick in 200 attempts");
}

/// A worker and a stranger given its pid within the same clock tick: the same boot id and
/// start time, so only the pidfs inode the worker's fingerprint carries tells them apart. The
/// stranger must not be taken for the worker (not alive as it, never signalled by the reaper).
/// Placing the pid takes root (clone3's `set_tid`), as CI runs.
#[test]
fn a_stranger_given_the_workers_pid_in_its_clock_tick_is_told_apart_by_its_pidfs_inode() {
    let mut tb = temp_board();
    let (stranger, fp) = same_tick_stranger();
    let pid = stranger.pid();
    // Without the inode the start time alone cannot tell: the stranger passes for the worker.
    let by_start_time = Fingerprint {
        pidfs_ino: None,
        ..fp.clone()
    };
    assert_eq!(liveness(pid, &by_start_time), Liveness::Alive);
    // With it, it is a recycled pid, to a look and to the step before any signal.
    assert_eq!(liveness(pid, &fp), Liveness::Dead(DeadReason::Recycled));
    assert!(matches!(
        open_verified(pid, &fp),
        Ok(Verified::NotOurs(Liveness::Dead(DeadReason::Recycled)))
    ));

    // The terminal reaper, the grace over: nothing signalled, the stranger lives on.
    let ended_at = now_millis();
    let (task, run_id) = completed_with_worker(&mut tb.board, "finished", pid, Some(&fp), ended_at);
    let signaller = RecordingSignaller::default();
    let reaped = reap_after_grace(&mut tb, &signaller, ended_at);
    assert_eq!(reaped, Vec::<i64>::new());
    assert_eq!(signaller.sent(), vec![], "the stranger was signalled");
    assert!(
        matches!(stranger.pidfd.try_reap(), Ok(None)),
        "the stranger was ended"
    );
    assert_evidence_cleared(&run(&mut tb.board, run_id), pid);
    let events = events_of(&mut tb.board, task, "terminal_worker_pid_recycled");
    assert_eq!(events.len(), 1, "{:?}", kinds(&mut tb.board, task));
}

/// The stranger of [`same_tick_stranger`] exits and stays a zombie: its exit status is not
/// lent to the worker whose fingerprint (start time and all) it matches but for the inode.
#[test]
fn a_zombie_given_the_workers_pid_in_its_clock_tick_does_not_lend_its_exit_status() {
    use runwarden::process::ExitStatus;
    use runwarden::process::exit_status::of_zombie;
    let (stranger, fp) = same_tick_stranger();
    let pid = stranger.pid();
    stranger
        .pidfd
        .signal(Signal::SIGKILL)
        .expect("kill the stranger");
    assert!(
        stranger.pidfd.wait_exit(Duration::from_secs(10)).unwrap(),
        "the stranger did not exit"
    );
    // Unreaped: a zombie. By start time alone it would pass for the worker's exit.
    let by_start_time = Fingerprint {
        pidfs_ino: None,
        ..fp.clone()
    };
    assert_eq!(
        of_zombie(pid, &by_start_time),
        Some(ExitStatus::Signal(libc::SIGKILL))
    );
    assert_eq!(of_zombie(pid, &fp), None, "the stranger's status was lent");
}
