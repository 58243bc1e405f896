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

/// Our child whose main thread has exited (alone, as `pthread_exit` in main does) while another thread of it runs
/// on, leader of its own process group: `/proc` shows it `Z`, and it is alive. Killed (by the
/// pid of our unreaped child, which cannot name anyone else) and reaped on drop.
pub(crate) struct ThreadsLeft(pub super::Pid);

impl ThreadsLeft {
    pub(crate) fn start() -> ThreadsLeft {
        extern "C" fn park(_: *mut libc::c_void) -> *mut libc::c_void {
            loop {
                // SAFETY: pause has no preconditions.
                unsafe { libc::pause() };
            }
        }
        // SAFETY: the child only makes system calls and glibc thread calls (both fine after
        // fork), and never returns into the test harness: a raw exit(2) ends its main thread
        // alone (pthread_exit would unwind through the harness's frames), _exit ends it if the
        // thread cannot be made.
        unsafe {
            match libc::fork() {
                -1 => panic!("fork: {}", std::io::Error::last_os_error()),
                0 => {
                    libc::setpgid(0, 0);
                    let mut thread: libc::pthread_t = 0;
                    if libc::pthread_create(
                        &mut thread,
                        std::ptr::null(),
                        park,
                        std::ptr::null_mut(),
                    ) != 0
                    {
                        libc::_exit(99);
                    }
                    libc::syscall(libc::SYS_exit, 0);
                    libc::_exit(98);
                }
                pid => {
                    let left = ThreadsLeft(pid);
                    let exited = wait_until(Duration::from_secs(10), || {
                        super::read_stat(pid).is_ok_and(|s| s.state == 'Z')
                    });
                    assert!(exited, "the child's main thread never exited");
                    left
                }
            }
        }
    }
}

impl Drop for ThreadsLeft {
    fn drop(&mut self) {
        // SAFETY: kill and waitpid on our own unreaped child.
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}
