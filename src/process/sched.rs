//! The scheduling policy of the supervisor's own threads (`supervisor.scheduling`).
//!
//! Under the normal policy (`SCHED_OTHER`) a thread that wakes up may preempt the thread
//! running on its core. In a supervisor that is mostly its own threads taking each other's
//! core: the store thread wakes the actor thread with a reply and is pushed off its core before
//! it has answered the rest of its batch or gone back to sleep; the actor thread, woken by a
//! worker's exit, pushes off the spawner starting the next one. Each of those is a context
//! switch and a cache refilled. Under `SCHED_BATCH` — same nice value, same share of the CPU —
//! a waking thread does not preempt: it runs when the running thread sleeps or its slice ends.
//! On the lifecycle bench that cut the supervisor's CPU per lifecycle by about a tenth (README).
//!
//! A new thread or process inherits its creator's policy (`SCHED_RESET_ON_FORK` resets only
//! real-time policies and negative nice values, not `SCHED_BATCH`), so what a batched thread
//! starts is put back under the normal policy by its starter: a worker by its spawner (see
//! [`batched_here`] and [`normal_while`]), the runtime's blocking threads — where hooks start —
//! by the runtime's thread-start hook ([`undo_inherited_batch`]).
//!
//! Only a thread under the normal policy is moved: one a host put under a real-time, idle or
//! batch policy keeps its own, and so do the threads and processes it starts. Every change
//! made here first reads the thread's policy from the kernel and changes it only from the
//! policy it expects (batch back to normal, normal to batch): a policy an operator set
//! meanwhile (`chrt -p`) is left as it is. The other threads the actor thread starts for its
//! own work (the `/proc` scans) inherit `SCHED_BATCH`; they start no process.

use std::cell::Cell;
use std::io;

thread_local! {
    /// This thread was moved to `SCHED_BATCH` by [`batch_this_thread`] (and has not been put
    /// back by it). The kernel has the last word: someone may have changed the policy since
    /// (`chrt -p`), which every change made here checks first.
    static BATCHED: Cell<bool> = const { Cell::new(false) };
}

/// A thread moved to `SCHED_BATCH` by [`batch_this_thread`]; dropping it, on the same thread,
/// puts the normal policy back (unless someone else has changed the policy meanwhile).
#[must_use = "dropping it puts the thread back under the normal policy"]
pub struct Batched {
    /// `!Send`: the policy is the calling thread's, so is the restoring.
    _thread_bound: std::marker::PhantomData<*const ()>,
}

/// Moves the calling thread to `SCHED_BATCH`. `Ok(None)`: the thread is under another policy
/// than the normal one and was left as it is.
pub fn batch_this_thread() -> io::Result<Option<Batched>> {
    if !from_to(libc::SCHED_OTHER, libc::SCHED_BATCH)? {
        return Ok(None);
    }
    BATCHED.with(|b| b.set(true));
    Ok(Some(Batched {
        _thread_bound: std::marker::PhantomData,
    }))
}

impl Drop for Batched {
    fn drop(&mut self) {
        BATCHED.with(|b| b.set(false));
        back_to_normal();
    }
}

/// Whether the calling thread was batched by [`batch_this_thread`]: what it starts inherits
/// `SCHED_BATCH` and must be put back under the normal policy.
pub fn batched_here() -> bool {
    BATCHED.with(|b| b.get())
}

/// Runs `f` (a start of a process) under the normal policy if the calling thread is batched
/// ([`batched_here`]) and still under `SCHED_BATCH`, so that what `f` starts inherits that;
/// then batches the thread again. Best effort: a policy that cannot be changed is left.
pub fn normal_while<T>(f: impl FnOnce() -> T) -> T {
    if !batched_here() {
        return f();
    }
    let unbatched = from_to(libc::SCHED_BATCH, libc::SCHED_OTHER);
    if let Err(e) = &unbatched {
        tracing::debug!(error = %e, "cannot leave SCHED_BATCH for a start");
    }
    let result = f();
    if unbatched.is_ok_and(|changed| changed) {
        let _ = from_to(libc::SCHED_OTHER, libc::SCHED_BATCH);
    }
    result
}

/// For a thread created by a batched thread (it inherited `SCHED_BATCH`): puts it under the
/// normal policy its creator had before, unless someone has changed it meanwhile.
pub fn undo_inherited_batch() {
    back_to_normal();
}

/// `SCHED_BATCH` → `SCHED_OTHER` for the calling thread, if it is under `SCHED_BATCH`.
fn back_to_normal() {
    if let Err(e) = from_to(libc::SCHED_BATCH, libc::SCHED_OTHER) {
        tracing::debug!(error = %e, "cannot put the thread back under the normal policy");
    }
}

/// Changes the calling thread's policy `from` → `to` if it is `from` now (keeping a
/// `SCHED_RESET_ON_FORK` flag, which only `CAP_SYS_NICE` may clear); whether it changed it.
fn from_to(from: libc::c_int, to: libc::c_int) -> io::Result<bool> {
    // SAFETY: sched_getscheduler takes no pointer; pid 0 is the calling thread.
    let current = unsafe { libc::sched_getscheduler(0) };
    if current < 0 {
        return Err(io::Error::last_os_error());
    }
    if current & !libc::SCHED_RESET_ON_FORK != from {
        return Ok(false);
    }
    set(to | (current & libc::SCHED_RESET_ON_FORK))?;
    Ok(true)
}

fn set(policy: libc::c_int) -> io::Result<()> {
    // Priority 0 is the only one the normal and batch policies take.
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `param` is a valid sched_param for the duration of the call; pid 0 is the
    // calling thread.
    if unsafe { libc::sched_setscheduler(0, policy, &param) } == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::{Command, Stdio};

    /// The policy in a `/proc/.../stat` file.
    fn policy_in(path: &str) -> u32 {
        let stat = std::fs::read_to_string(path).expect("read stat");
        let parsed = crate::process::parse_stat(&stat).expect("parse stat");
        parsed.policy.expect("policy field")
    }

    fn own_policy() -> u32 {
        // SAFETY: gettid takes no arguments.
        let tid = unsafe { libc::gettid() };
        policy_in(&format!("/proc/self/task/{tid}/stat"))
    }

    /// The policy `sleep` starts under when started from this thread by `start`.
    fn child_policy(start: impl FnOnce(&mut Command) -> std::process::Child) -> u32 {
        let mut cmd = Command::new("sleep");
        cmd.arg("30").stdin(Stdio::null());
        let mut child = start(&mut cmd);
        let policy = policy_in(&format!("/proc/{}/stat", child.id()));
        child.kill().expect("kill sleep");
        child.wait().expect("reap sleep");
        policy
    }

    const OTHER: u32 = libc::SCHED_OTHER as u32;
    const BATCH: u32 = libc::SCHED_BATCH as u32;

    #[test]
    fn a_batched_threads_starts_are_put_back_and_drop_restores_it() {
        std::thread::spawn(|| {
            assert_eq!(own_policy(), OTHER);
            assert!(!batched_here());
            let batched = batch_this_thread().expect("batch").expect("moved");
            assert_eq!(own_policy(), BATCH);
            assert!(batched_here());

            // What the kernel does on its own: the child inherits SCHED_BATCH.
            assert_eq!(child_policy(|c| c.spawn().expect("spawn")), BATCH);
            // Started through normal_while, it starts normal; the thread stays batched.
            let started = child_policy(|c| normal_while(|| c.spawn().expect("spawn")));
            assert_eq!(started, OTHER, "a child started through normal_while");
            assert_eq!(own_policy(), BATCH, "batched again after the start");

            let inherited = std::thread::spawn(own_policy).join().expect("join");
            assert_eq!(inherited, BATCH, "a new thread inherits the policy");
            let undone = std::thread::spawn(|| {
                undo_inherited_batch();
                own_policy()
            });
            assert_eq!(undone.join().expect("join"), OTHER);

            drop(batched);
            assert_eq!(own_policy(), OTHER, "restored");
            assert!(!batched_here());
        })
        .join()
        .expect("test thread");
    }

    #[test]
    fn a_policy_set_from_outside_after_batching_is_kept() {
        std::thread::spawn(|| {
            let batched = batch_this_thread().expect("batch").expect("moved");
            // What `chrt -i -p 0 <tid>` does to the thread.
            set(libc::SCHED_IDLE).expect("SCHED_IDLE is open to every thread");
            let started = child_policy(|c| normal_while(|| c.spawn().expect("spawn")));
            assert_eq!(
                started,
                libc::SCHED_IDLE as u32,
                "the operator's policy is inherited"
            );
            assert_eq!(own_policy(), libc::SCHED_IDLE as u32, "kept after a start");
            undo_inherited_batch();
            assert_eq!(own_policy(), libc::SCHED_IDLE as u32, "kept by the undo");
            drop(batched);
            assert_eq!(own_policy(), libc::SCHED_IDLE as u32, "kept by the drop");
        })
        .join()
        .expect("test thread");
    }

    #[test]
    fn a_thread_under_another_policy_keeps_it_and_so_do_its_starts() {
        std::thread::spawn(|| {
            set(libc::SCHED_IDLE).expect("SCHED_IDLE is open to every thread");
            assert!(batch_this_thread().expect("no error").is_none());
            assert_eq!(own_policy(), libc::SCHED_IDLE as u32);
            assert!(!batched_here());
            let started = child_policy(|c| normal_while(|| c.spawn().expect("spawn")));
            assert_eq!(
                started,
                libc::SCHED_IDLE as u32,
                "the host's policy is inherited"
            );
        })
        .join()
        .expect("test thread");
    }
}
