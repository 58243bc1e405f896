//! Helpers for this module's unit tests: spawn group leaders that are always cleaned up.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{PidFd, Signal};

/// On drop, SIGKILLs the group and the leader through a pidfd (never by number or name), then
/// reaps the leader, so a failing test leaves nothing running.
pub(crate) struct GroupKill(PidFd);

impl Drop for GroupKill {
    fn drop(&mut self) {
        let _ = self.0.signal_group(Signal::SIGKILL);
        let _ = self.0.signal(Signal::SIGKILL);
        let _ = self.0.wait_exit(Duration::from_secs(5));
        let _ = self.0.try_reap();
    }
}

/// Spawns `sh -c script` as the leader of a new process group; returns a pidfd for the test and
/// a guard holding its own pidfd.
#[expect(
    clippy::zombie_processes,
    reason = "reaped through the pidfd, by the test or GroupKill"
)]
pub(crate) fn spawn_leader(script: &str) -> (PidFd, GroupKill) {
    let child = Command::new("sh")
        .args(["-c", script])
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn sh");
    let pid = child.id() as i32;
    // Our unreaped child: its pid cannot be reused yet, so both opens name it.
    let guard = GroupKill(PidFd::open(pid).expect("pidfd_open (guard)"));
    let pidfd = PidFd::open(pid).expect("pidfd_open");
    (pidfd, guard)
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes.
pub(crate) fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = super::deadline_after(timeout);
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
