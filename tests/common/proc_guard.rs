//! Test helper: child processes that are always ended, by pid through a pidfd, never by name.

use std::io;
use std::ops::{Deref, DerefMut};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use runwarden::process::{Pid, PidFd, Signal};

/// Owns a spawned child and a pidfd opened for it at once (while the child is unreaped, so the
/// pid cannot have been reused). On drop it SIGKILLs the child's process group through that
/// pidfd (which reaches the group even after the leader was reaped, and never a recycled pid),
/// then the child itself, and reaps the child.
///
/// Derefs to the [`Child`], so `guard.wait()`, `guard.id()` work as on the child.
pub struct ChildGuard(pub Child, PidFd);

impl ChildGuard {
    /// Takes ownership of a child that has not been waited for yet.
    pub fn new(child: Child) -> io::Result<Self> {
        let pidfd = PidFd::open(child.id() as Pid).map_err(io::Error::other);
        match pidfd {
            Ok(pidfd) => Ok(ChildGuard(child, pidfd)),
            Err(err) => {
                // Cannot pin it: end it through std's handle (its own pid, still unreaped).
                let mut child = child;
                let _ = child.kill();
                let _ = child.wait();
                Err(err)
            }
        }
    }

    /// Spawns `cmd` and guards the child.
    pub fn spawn(cmd: &mut Command) -> io::Result<Self> {
        Self::new(cmd.spawn()?)
    }

    /// The child's pid (= its process group id when spawned with `process_group(0)`).
    pub fn pid(&self) -> Pid {
        self.0.id() as Pid
    }

    /// The pidfd the guard holds for the child.
    pub fn pidfd(&self) -> &PidFd {
        &self.1
    }
}

impl Deref for ChildGuard {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl DerefMut for ChildGuard {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Errors mean "already gone" (ESRCH) or a group it does not lead: nothing to do.
        let _ = self.1.signal_group(Signal::SIGKILL);
        let _ = self.1.signal(Signal::SIGKILL);
        // Reaps it; if the test already did, std returns the cached status or ECHILD.
        let _ = self.0.wait();
    }
}

/// Polls `cond` every 10 ms until it is true (returns true) or `timeout` passes (returns false).
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
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
