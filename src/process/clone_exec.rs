//! Starting a program as its own process-group leader with `clone3` + `execve`, for the
//! worker spawns of the common case (no other user, umask or rlimits to set in the child).
//!
//! std's `Command` (glibc's `posix_spawn`) does the same vfork-style start but pays, per
//! spawn, for things a supervisor can do once or have the kernel do: a fresh stack mapped
//! and unmapped (the unmap of a multi-threaded process's memory interrupts every core
//! running one of its threads), a copy of the whole environment into a map, a `pidfd_open`
//! after the start, and in the child one `sigaction` per signal (64 of them, twice for the
//! handled ones) to drop the parent's handlers. Measured with `perf` on the lifecycle bench
//! these were ~35 µs of the child's and ~40 µs of the spawning thread's CPU per start. Here:
//! - the child runs on a stack mapped once per spawning thread (`CLONE_VFORK` holds that
//!   thread until the child has exec'd or exited, so one stack serves each start in turn);
//! - the kernel resets the handled signals (`CLONE_CLEAR_SIGHAND`, Linux 5.5) and hands
//!   back a pidfd (`CLONE_PIDFD`);
//! - argv and the environment are prepared by the caller as NUL-terminated blocks.
//!
//! The child does what `posix_spawn` did with std's attributes, and a session of its own
//! (so its own process group), the
//! three descriptors given as stdin/stdout/stderr (every other descriptor closed, not only
//! the close-on-exec ones: one the supervisor inherited is not the worker's), the working
//! directory, SIGPIPE back to its default (the Rust runtime ignores it, and ignored signals
//! survive exec), an empty signal mask, the normal scheduling policy when its starter runs
//! batched (see [`super::sched`]), then `execve`. It shares the parent's memory until
//! then, so it only makes system calls (no allocation, no lock); a failing step's errno is
//! left in memory shared with the parent and the child exits 127, to be reaped here.
//!
//! Where the kernel refuses `clone3` or one of its flags (before 5.5, or a seccomp filter
//! that answers ENOSYS/EPERM) or on another architecture, [`spawn_leader`] says
//! [`CloneExecError::Unsupported`] and the caller starts the program through std instead —
//! from then on; when the child's stack cannot be mapped (out of memory or mappings), for
//! that start only.

// Elsewhere the start always goes through std (see `clone_vfork`); the stack is unused there.
#![cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]

use std::ffi::{CStr, c_char, c_int};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use super::{Pid, PidFd};

/// Why [`spawn_leader`] did not start the program.
#[derive(Debug, thiserror::Error)]
pub enum CloneExecError {
    /// This kernel (or a filter in front of it) does not offer what is needed; nothing was
    /// started. Start the program another way.
    #[error("clone3 is not available here: {0}")]
    Unsupported(io::Error),
    /// The start failed at `step` (the child, if one was made, has been reaped).
    #[error("{step}: {source}")]
    Failed {
        step: &'static str,
        #[source]
        source: io::Error,
    },
}

/// Once the kernel has said no, later starts do not ask again.
static UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// What the child needs, prepared by the parent. All pointers stay valid until the child
/// has exec'd or exited (the parent is held until then).
#[repr(C)]
struct ChildArgs {
    path: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    cwd: *const c_char,
    /// Become stdin, stdout and stderr; each is 3 or above (see [`spawn_leader`]).
    stdio: [c_int; 3],
    empty_mask: libc::sigset_t,
    /// The starting thread is batched by [`super::sched`]: the child takes the normal
    /// scheduling policy back if it inherited `SCHED_BATCH`.
    normal_policy: bool,
    /// The descriptor limit to start the program with, if not this process's own (see
    /// [`super::nofile`]).
    nofile: Option<libc::rlimit>,
    /// Written by a failing child: which step (an index into [`STEPS`]) and its errno.
    failed_step: c_int,
    errno: c_int,
}

/// The child's steps, by the index it reports.
const STEPS: [&str; 6] = ["", "setsid", "dup2", "chdir", "reset signals", "execve"];

/// A child [`spawn_leader`] started: its pidfd, and its pid's claim in
/// [`super::owned::in_flight`] (if one was free), to be dropped once the pid is registered.
pub struct Started {
    pub pidfd: PidFd,
    pub in_flight: Option<super::owned::InFlight>,
    /// Its start time in clock ticks, as `/proc/<pid>/stat` shows it, when the clock tells
    /// (`fingerprint::start_ticks_between` around the clone call); `None`: read it.
    pub start_ticks: Option<u64>,
}

/// Starts `path` (argv and envp: NULL-terminated arrays of NUL-terminated strings) in `cwd`
/// as the leader of a session and process group of its own, with the given stdio, and returns its pidfd. The child is not
/// reaped: it is the caller's to wait for (through the pidfd) and to reap.
pub fn spawn_leader(
    path: &CStr,
    argv: &[*const c_char],
    envp: &[*const c_char],
    cwd: &CStr,
    stdio: [BorrowedFd<'_>; 3],
) -> Result<Started, CloneExecError> {
    if !available() {
        return Err(CloneExecError::Unsupported(io::Error::from_raw_os_error(
            libc::ENOSYS,
        )));
    }
    assert!(
        argv.last().is_some_and(|p| p.is_null()) && envp.last().is_some_and(|p| p.is_null()),
        "argv and envp must end with a null pointer"
    );
    // The child's dup2 of descriptor n onto 0..=2 must not overwrite one it has yet to
    // move: a descriptor below 3 is copied above first (std's runtime keeps 0-2 open, so
    // this is for an embedding host that closed them). std's clone of a descriptor is
    // close-on-exec and numbered 3 or above.
    let mut raised = Vec::new();
    let mut fds = [0; 3];
    for (slot, fd) in fds.iter_mut().zip(stdio) {
        *slot = if fd.as_raw_fd() < 3 {
            let copy = fd
                .try_clone_to_owned()
                .map_err(|source| CloneExecError::Failed {
                    step: "dup",
                    source,
                })?;
            let raw = copy.as_raw_fd();
            raised.push(copy);
            raw
        } else {
            fd.as_raw_fd()
        };
    }
    // SAFETY: sigemptyset initialises the set it is given.
    let empty_mask = unsafe {
        let mut set = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(set.as_mut_ptr());
        set.assume_init()
    };
    let mut args = ChildArgs {
        path: path.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        cwd: cwd.as_ptr(),
        stdio: fds,
        empty_mask,
        normal_policy: super::sched::batched_here(),
        nofile: super::nofile::for_workers(),
        failed_step: 0,
        errno: 0,
    };
    let in_flight = super::owned::in_flight();
    let before = super::fingerprint::boottime_ns();
    let started = STACK.with(|cell| -> Result<(Pid, OwnedFd), CloneExecError> {
        let mut slot = cell.borrow_mut();
        let stack = match &mut *slot {
            Some(stack) => stack,
            // Mapped on first need; a failure (out of memory or mappings) is this start's
            // only: it goes through std, and the next one maps again.
            empty => empty.insert(ChildStack::map().map_err(CloneExecError::Unsupported)?),
        };
        // SAFETY: the stack is this thread's and unused (CLONE_VFORK: the previous child
        // left it when it exec'd or exited); `args` and everything it points to outlive
        // the call, which returns only once the child no longer runs on our memory.
        unsafe { clone_vfork(stack, &mut args, in_flight.as_ref().map(|f| f.slot())) }
    });
    let after = super::fingerprint::boottime_ns();
    let (pid, pidfd) = started?;
    drop(raised);
    // SAFETY: the child is done with `args` (exec'd or exited: CLONE_VFORK).
    let step = unsafe { std::ptr::read_volatile(&args.failed_step) };
    if step != 0 {
        let errno = unsafe { std::ptr::read_volatile(&args.errno) };
        // Our own child, failed before exec: reap it now, as posix_spawn does, so no
        // zombie is left to anyone. The in-flight claim goes first: once reaped, the pid
        // (held by the zombie until then) may be anybody's.
        drop(in_flight);
        reap(pid);
        drop(pidfd);
        return Err(CloneExecError::Failed {
            step: STEPS.get(step as usize).copied().unwrap_or("start"),
            source: io::Error::from_raw_os_error(errno),
        });
    }
    Ok(Started {
        pidfd: PidFd::from_owned(pidfd, pid),
        in_flight,
        start_ticks: before
            .zip(after)
            .and_then(|(before, after)| super::fingerprint::start_ticks_between(before, after)),
    })
}

/// Waits for our own child `pid` and reaps it (retrying an interrupted wait).
pub(crate) fn reap(pid: Pid) {
    let mut status = 0;
    // SAFETY: waitpid on our own unreaped child.
    while unsafe { libc::waitpid(pid, &mut status, libc::__WALL) } < 0
        && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
    {}
}

/// Test hook: makes this process behave as if the kernel had refused clone3 (every later
/// start goes through std). Process-wide and for good: for a test binary of its own.
#[doc(hidden)]
pub fn refuse_clone3() {
    UNSUPPORTED.store(true, Ordering::Relaxed);
}

/// Whether starts may go this way (false once the kernel has refused clone3 or a flag).
pub fn available() -> bool {
    cfg!(target_arch = "x86_64") && !UNSUPPORTED.load(Ordering::Relaxed)
}

/// The page size (for the stack's guard page).
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

/// A stack for the vfork-style child, with a guard page below it: mapped once per thread
/// that starts workers, unmapped when the thread ends.
struct ChildStack {
    map: *mut libc::c_void,
    len: usize,
    guard: usize,
}

/// The child runs `child_main` and the libc wrappers it calls: a few hundred bytes. Ample.
const STACK_SIZE: usize = 64 * 1024;

impl ChildStack {
    fn map() -> io::Result<ChildStack> {
        let guard = page_size();
        let len = STACK_SIZE + guard;
        // SAFETY: a fresh anonymous mapping; the first page is made inaccessible so an
        // overflow faults instead of writing below.
        unsafe {
            let map = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            );
            if map == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            if libc::mprotect(map, guard, libc::PROT_NONE) != 0 {
                let e = io::Error::last_os_error();
                libc::munmap(map, len);
                return Err(e);
            }
            Ok(ChildStack { map, len, guard })
        }
    }

    /// The lowest usable byte and the size above it (clone3's `stack` and `stack_size`).
    fn area(&self) -> (u64, u64) {
        (
            self.map as u64 + self.guard as u64,
            (self.len - self.guard) as u64,
        )
    }
}

impl Drop for ChildStack {
    fn drop(&mut self) {
        // SAFETY: our own mapping, no longer used (no child runs on it: see spawn_leader).
        unsafe { libc::munmap(self.map, self.len) };
    }
}

thread_local! {
    static STACK: std::cell::RefCell<Option<ChildStack>> = const { std::cell::RefCell::new(None) };
}

/// `CLONE_CLEAR_SIGHAND` (Linux 5.5): the child starts with every handled signal back at
/// its default. (The libc crate declares it with a type too narrow to hold it.)
#[cfg(target_arch = "x86_64")]
const CLONE_CLEAR_SIGHAND: u64 = 0x1_0000_0000;

/// clone3 with the child on `stack`; returns once the child has exec'd or exited.
///
/// # Safety
/// `stack` is unused by anyone else for the call's duration; `args` is valid and stays so.
#[cfg(target_arch = "x86_64")]
unsafe fn clone_vfork(
    stack: &ChildStack,
    args: &mut ChildArgs,
    parent_tid: Option<*mut i32>,
) -> Result<(Pid, OwnedFd), CloneExecError> {
    let mut pidfd: c_int = -1;
    let (base, size) = stack.area();
    // SAFETY: clone_args is plain data; all-zero is its "nothing asked" state.
    let mut cl: libc::clone_args = unsafe { std::mem::zeroed() };
    cl.flags =
        (libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD) as u64 | CLONE_CLEAR_SIGHAND;
    if let Some(slot) = parent_tid {
        // The kernel writes the child's pid there before the child first runs.
        cl.flags |= libc::CLONE_PARENT_SETTID as u64;
        cl.parent_tid = slot as u64;
    }
    cl.pidfd = &mut pidfd as *mut c_int as u64;
    cl.exit_signal = libc::SIGCHLD as u64;
    cl.stack = base;
    cl.stack_size = size;
    let ret: i64;
    // SAFETY: the raw clone3 system call. In the parent it returns the child's pid (or
    // -errno) and clobbers only rax, rcx and r11. The child resumes after the `syscall` on
    // the new stack (the kernel sets its stack pointer to base + size, 16-byte aligned)
    // and immediately calls `child_main(args)`, which never returns; nothing of the
    // parent's frame is touched on the child's side.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r13",
            "call r12",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") &mut cl as *mut libc::clone_args,
            in("rsi") std::mem::size_of::<libc::clone_args>(),
            in("r12") child_main as unsafe extern "C" fn(*mut ChildArgs) -> !,
            in("r13") args as *mut ChildArgs,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret < 0 {
        let errno = (-ret) as c_int;
        let source = io::Error::from_raw_os_error(errno);
        return Err(match errno {
            // No clone3, an unknown flag, or a filter refusing it: std's way still works.
            libc::ENOSYS | libc::EINVAL | libc::EPERM => {
                if !UNSUPPORTED.swap(true, Ordering::Relaxed) {
                    tracing::warn!(error = %source, "clone3 refused; workers start through std's fork and exec from now on");
                }
                CloneExecError::Unsupported(source)
            }
            _ => CloneExecError::Failed {
                step: "clone3",
                source,
            },
        });
    }
    // SAFETY: CLONE_PIDFD stored a fresh descriptor for the child; it is ours alone.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    Ok((ret as Pid, pidfd))
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn clone_vfork(
    _stack: &ChildStack,
    _args: &mut ChildArgs,
    _parent_tid: Option<*mut i32>,
) -> Result<(Pid, OwnedFd), CloneExecError> {
    UNSUPPORTED.store(true, Ordering::Relaxed);
    Err(CloneExecError::Unsupported(io::Error::from_raw_os_error(
        libc::ENOSYS,
    )))
}

/// The child, on the borrowed stack, in the parent's memory: system calls only, no
/// iterator or closure (nothing that could hold a panic path, even in a debug build).
///
/// # Safety
/// Called once, by the clone trampoline, with the parent's `ChildArgs`.
#[cfg(target_arch = "x86_64")]
unsafe extern "C" fn child_main(args: *mut ChildArgs) -> ! {
    // SAFETY (whole body): `args` is valid (the parent is held until we exec or exit), and
    // every call is a plain system-call wrapper that neither allocates nor locks.
    unsafe {
        // A session of its own (and so a group it leads): no controlling terminal (the
        // operator's, when the supervisor runs in one, is not the worker's to read), and no
        // other worker can move into its group (setpgid stays within a session).
        let step = if libc::setsid() < 0 {
            1
        } else if libc::dup2((*args).stdio[0], 0) < 0
            || libc::dup2((*args).stdio[1], 1) < 0
            || libc::dup2((*args).stdio[2], 2) < 0
        {
            2
        } else {
            // Whatever else is open without close-on-exec (descriptors the supervisor
            // inherited: a terminal, a build tool's jobserver pipe) is not the worker's. Best
            // effort: a kernel without close_range (before 5.9) leaves them.
            libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                0 as libc::c_uint,
            );
            if libc::chdir((*args).cwd) != 0 {
                3
            } else if libc::signal(libc::SIGPIPE, libc::SIG_DFL) == libc::SIG_ERR
                || libc::sigprocmask(libc::SIG_SETMASK, &(*args).empty_mask, std::ptr::null_mut())
                    != 0
            {
                4
            } else {
                // Back to the normal policy if SCHED_BATCH is what it inherited from its
                // batched starter (not a policy someone set on that thread since). Best
                // effort, as for a std start: a worker that cannot leave it still runs.
                if (*args).normal_policy
                    && libc::sched_getscheduler(0) & !libc::SCHED_RESET_ON_FORK == libc::SCHED_BATCH
                {
                    libc::sched_setscheduler(
                        0,
                        libc::SCHED_OTHER,
                        &libc::sched_param { sched_priority: 0 },
                    );
                }
                // Best effort, as the policy: a worker left with the supervisor's raised
                // limit still runs.
                if let Some(lim) = &(*args).nofile {
                    libc::setrlimit(libc::RLIMIT_NOFILE, lim);
                }
                libc::execve((*args).path, (*args).argv, (*args).envp);
                5
            }
        };
        (*args).errno = *libc::__errno_location();
        (*args).failed_step = step;
        libc::_exit(127)
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use std::ffi::CString;
    use std::os::fd::AsFd;
    use std::time::Duration;

    use super::*;

    fn cstrings(items: &[&str]) -> (Vec<CString>, Vec<*const c_char>) {
        let owned: Vec<CString> = items.iter().map(|s| CString::new(*s).unwrap()).collect();
        let mut ptrs: Vec<*const c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        ptrs.push(std::ptr::null());
        (owned, ptrs)
    }

    fn start_child(
        argv: &[&str],
        env: &[&str],
        cwd: &std::path::Path,
    ) -> Result<Started, CloneExecError> {
        let (_argv, argv_p) = cstrings(argv);
        let (_env, env_p) = cstrings(env);
        let cwd = CString::new(cwd.to_str().unwrap()).unwrap();
        let null = std::fs::File::open("/dev/null").unwrap();
        let path = CString::new(argv[0]).unwrap();
        spawn_leader(
            &path,
            &argv_p,
            &env_p,
            &cwd,
            [null.as_fd(), null.as_fd(), null.as_fd()],
        )
    }

    fn start(argv: &[&str], env: &[&str], cwd: &std::path::Path) -> Result<PidFd, CloneExecError> {
        start_child(argv, env, cwd).map(|started| started.pidfd)
    }

    #[test]
    fn the_program_runs_with_its_argv_env_and_cwd_as_a_group_leader() {
        let dir = tempfile::tempdir().unwrap();
        let pidfd = start(
            &[
                "/bin/sh",
                "-c",
                "printf '%s %s %s' \"$0\" \"$GREETING\" \"$(pwd)\" > out",
            ],
            &["GREETING=hello"],
            dir.path(),
        )
        .expect("started");
        let stat = crate::process::read_stat(pidfd.pid());
        if let Ok(stat) = stat {
            assert_eq!(stat.pgrp, pidfd.pid(), "its own process group");
        }
        assert!(
            pidfd.wait_exit(Duration::from_secs(10)).unwrap(),
            "it exits"
        );
        assert!(matches!(pidfd.try_reap(), Ok(Some(_))));
        let out = std::fs::read_to_string(dir.path().join("out")).unwrap();
        assert_eq!(out, format!("/bin/sh hello {}", dir.path().display()));
    }

    #[test]
    fn a_started_child_is_in_flight_until_its_claim_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let started = start_child(&["/bin/true"], &[], dir.path()).expect("started");
        let pid = started.pidfd.pid();
        // Eight slots; parallel tests may hold some, but not all of them.
        let claim = started.in_flight.expect("a free in-flight slot");
        assert!(
            super::super::owned::is_in_flight(pid),
            "the kernel wrote the pid"
        );
        drop(claim);
        assert!(!super::super::owned::is_in_flight(pid));
        assert!(started.pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        assert!(matches!(started.pidfd.try_reap(), Ok(Some(_))));
    }

    #[test]
    fn a_start_tells_its_start_time_from_the_clock_as_proc_shows_it() {
        let dir = tempfile::tempdir().unwrap();
        let (mut told, deadline) = (0, std::time::Instant::now() + Duration::from_secs(20));
        // Under load a bracket often straddles a tick (it spans the child's exec): starts are
        // made until 20 told their start time, or for 20 s.
        while told < 20 && std::time::Instant::now() < deadline {
            let started = start_child(&["/bin/sleep", "30"], &[], dir.path()).expect("started");
            let pid = started.pidfd.pid();
            let from_proc = crate::process::read_stat(pid).map(|s| s.start_ticks);
            drop(started.in_flight);
            let _ = started.pidfd.signal(crate::process::Signal::SIGKILL);
            assert!(started.pidfd.wait_exit(Duration::from_secs(10)).unwrap());
            assert!(matches!(started.pidfd.try_reap(), Ok(Some(_))));
            if let Some(ticks) = started.start_ticks {
                assert_eq!(Ok(ticks), from_proc.map_err(|e| e.to_string()), "pid {pid}");
                told += 1;
            }
        }
        assert!(
            told >= 1,
            "no start in 20 s told its start time from the clock"
        );
    }

    #[test]
    fn a_failed_exec_or_chdir_names_its_step() {
        let dir = tempfile::tempdir().unwrap();
        let err = start(&["/nonexistent/program"], &[], dir.path()).unwrap_err();
        assert!(
            matches!(&err, CloneExecError::Failed { step: "execve", source } if source.raw_os_error() == Some(libc::ENOENT)),
            "{err:?}"
        );
        let err = start(&["/bin/true"], &[], &dir.path().join("gone")).unwrap_err();
        assert!(
            matches!(&err, CloneExecError::Failed { step: "chdir", source } if source.raw_os_error() == Some(libc::ENOENT)),
            "{err:?}"
        );
    }
}
