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
    GRACE, KILL_TIMEOUT, RecordingSignaller, assert_evidence_cleared, completed_with_worker,
    events_of, kinds, run, sleeper, still_running, temp_board,
};
use common::proc_guard::ChildGuard;
use runwarden::board::{now_millis, reap_terminal_workers};
use runwarden::process::{DeadReason, Liveness, Pid, Signal, fingerprint, liveness};

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
    let reaped = reap_terminal_workers(
        &mut tb.board,
        &signaller,
        ended_at + GRACE.as_millis() as i64 + 1,
        GRACE,
        KILL_TIMEOUT,
    )
    .unwrap();

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
