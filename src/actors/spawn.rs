//! Starting a worker process: argv, environment, working directory, log file, privileges.
//!
//! The child is a process-group leader (so its whole group can be signalled), reads /dev/null,
//! and appends stdout and stderr straight to its task's log file: the worker writes the file
//! itself, so it keeps running (and logging) if the supervisor restarts.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, mpsc};

use tokio::sync::oneshot;

use crate::board::{RunId, TaskId};
use crate::config::Scheduling;
use crate::process::{self, Fingerprint, PidFd};

/// Everything needed to start one run's worker.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub run_id: RunId,
    pub task_id: TaskId,
    pub token: String,
    pub title: String,
    pub argv: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cwd: PathBuf,
    /// True when `cwd` is the supervisor's own per-task directory (it may hand it to the
    /// worker's user); a configured directory is never chowned.
    pub own_cwd: bool,
    pub socket: PathBuf,
    pub log_path: PathBuf,
    pub log_max_bytes: u64,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub umask: Option<u32>,
    pub rlimits: BTreeMap<String, u64>,
}

/// A started worker: its pid, a pidfd pinning its identity, and its spawn fingerprint.
pub struct Spawned {
    pub pid: i32,
    pub pidfd: PidFd,
    pub fingerprint: Fingerprint,
    /// Where this run's output starts in the task's log (shared by the task's attempts).
    pub log_start: LogStart,
}

pub use crate::board::LogStart;

impl LogStart {
    /// The last `n` bytes of the run's output in the log at `path` ([`log_tail`]).
    pub fn tail(&self, path: &Path, n: u64) -> String {
        let rotated = log_generation(path) != self.generation;
        log_tail(path, if rotated { 0 } else { self.offset }, n)
    }
}

/// Why a worker could not be started: one line naming what failed, and whether it failed for
/// want of something the supervisor (or the machine) is short of right now — descriptors
/// (`EMFILE`, `ENFILE`), processes (`EAGAIN`), memory (`ENOMEM`) — rather than anything about
/// the task or its assignee. Such a start is no failure of the task's: it is retried later
/// without being counted, never taken towards giving the task up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpawnError {
    pub message: String,
    pub shortage: bool,
    /// For a shortage: how many starts in a row have now failed for one on this supervisor's
    /// spawner (1 for the first), so the retries back off while it lasts.
    pub streak: u32,
}

impl SpawnError {
    fn new(message: String, shortage: bool) -> SpawnError {
        SpawnError {
            message,
            shortage,
            streak: 0,
        }
    }

    /// `message`, about the OS error `e` (a shortage if `e` is one).
    fn os(message: String, e: &std::io::Error) -> SpawnError {
        SpawnError::new(message, is_shortage(e))
    }

    /// `message`, about `e` (a shortage if the OS error under it is one).
    fn process(message: String, e: &process::ProcessError) -> SpawnError {
        let shortage = match e {
            process::ProcessError::Io { source, .. }
            | process::ProcessError::System { source, .. } => is_shortage(source),
            _ => false,
        };
        SpawnError::new(message, shortage)
    }
}

impl From<String> for SpawnError {
    fn from(message: String) -> SpawnError {
        SpawnError::new(message, false)
    }
}

impl std::fmt::Display for SpawnError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Whether `e` says the supervisor or the machine is short of a resource (see [`SpawnError`]).
pub fn is_shortage(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::EAGAIN | libc::ENOMEM)
    )
}

/// A few dedicated threads that start workers, shared by every WorkerActor of a supervisor.
///
/// Starting a process blocks its caller: creating the work dir and log file, and the start
/// itself (a vfork-style start — clone3 here, fork + exec in std — holds the caller until the
/// child has exec'd). Not on an actor thread, then;
/// and not on a general blocking pool either, where every start woke a parked thread and
/// starts ran many at once, competing for the same locks and cores as the children they
/// were starting. The threads exit once the last handle is dropped.
#[derive(Clone)]
pub struct Spawner {
    jobs: mpsc::Sender<SpawnJob>,
}

struct SpawnJob {
    spec: SpawnSpec,
    reply: oneshot::Sender<Result<Handoff, SpawnError>>,
}

/// A started child on its way to its WorkerActor. Dropped undelivered — its actor stopped
/// after asking for it (the reply could not be sent, or was never read) — it kills the child
/// with its group: nobody else knows of it, its evidence was never recorded.
struct Handoff(Option<Spawned>);

impl Handoff {
    fn take(mut self) -> Spawned {
        self.0.take().expect("a handoff is taken once")
    }
}

impl Drop for Handoff {
    fn drop(&mut self) {
        let Some(child) = self.0.take() else { return };
        tracing::warn!(
            pid = child.pid,
            "spawn: its worker actor is gone; killing the new child"
        );
        // Our own, unreaped child: its pidfd names it. SIGKILL, not a grace: it is
        // milliseconds old and nobody will supervise it. Its zombie is left to the orphan
        // reaper (no owner will wait for it now).
        if let Err(e) = child.pidfd.signal_group(process::Signal::SIGKILL) {
            tracing::warn!(pid = child.pid, error = %e, "spawn: cannot kill an undelivered child");
        }
        process::owned::unregister(child.pid);
    }
}

impl Spawner {
    /// Starts `threads` spawner threads (at least one) under `scheduling`.
    pub fn start(threads: usize, scheduling: Scheduling) -> std::io::Result<Spawner> {
        let (jobs, rx) = mpsc::channel::<SpawnJob>();
        let rx = Arc::new(Mutex::new(rx));
        // Starts failed in a row for a shortage, across the threads (reset by any start).
        let shortages = Arc::new(AtomicU32::new(0));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let shortages = shortages.clone();
            super::spawn_thread(format!("runwarden-spawn-{i}"), scheduling, move || {
                loop {
                    // The lock is held only while waiting for the next job.
                    let job = match rx.lock().unwrap_or_else(|p| p.into_inner()).recv() {
                        Ok(job) => job,
                        Err(_) => return, // every handle is gone
                    };
                    // A caller that went away (its actor stopped) no longer wants a
                    // child: none is started for it, and one started while it left is
                    // killed by its Handoff's drop.
                    if job.reply.is_closed() {
                        continue;
                    }
                    let started = match spawn(&job.spec) {
                        Ok(child) => {
                            shortages.store(0, Ordering::Relaxed);
                            Ok(Handoff(Some(child)))
                        }
                        Err(mut e) => {
                            if e.shortage {
                                e.streak = shortages.fetch_add(1, Ordering::Relaxed) + 1;
                            }
                            Err(e)
                        }
                    };
                    let _ = job.reply.send(started);
                }
            })?;
        }
        Ok(Spawner { jobs })
    }

    /// Starts a supervisor's spawner: one thread per core, two to four.
    pub fn for_this_machine(scheduling: Scheduling) -> std::io::Result<Spawner> {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        Spawner::start(cores.clamp(2, 4), scheduling)
    }

    /// Queues the start of `spec`'s worker; resolves to what [`spawn`] returned.
    pub fn submit(
        &self,
        spec: SpawnSpec,
    ) -> impl Future<Output = Result<Spawned, SpawnError>> + 'static {
        let (reply, rx) = oneshot::channel();
        let queued = self.jobs.send(SpawnJob { spec, reply }).is_ok();
        async move {
            if !queued {
                return Err("the spawner has stopped".to_string().into());
            }
            match rx.await {
                Ok(started) => started.map(Handoff::take),
                Err(_) => Err("the spawner stopped before starting it".to_string().into()),
            }
        }
    }
}

/// Starts the worker. Errors are one line, naming what failed.
pub fn spawn(spec: &SpawnSpec) -> Result<Spawned, SpawnError> {
    let (program, args) = spec
        .argv
        .split_first()
        .ok_or_else(|| SpawnError::from("the assignee's command is empty".to_string()))?;
    // Only the supervisor's own per-task directory is created; a configured one was checked when
    // the supervisor started and is used as it is (if it has gone since, the start fails naming it).
    if spec.own_cwd {
        create_private_dir(&spec.cwd).map_err(|e| {
            let what = format!(
                "cannot create working directory {}: {e}",
                spec.cwd.display()
            );
            SpawnError::os(what, &e)
        })?;
    }
    if spec.own_cwd && (spec.uid.is_some() || spec.gid.is_some()) {
        // A worker that runs as another user must be able to work in its own directory.
        std::os::unix::fs::chown(&spec.cwd, spec.uid, spec.gid).map_err(|e| {
            let what = format!(
                "cannot hand {} to the worker's user: {e}",
                spec.cwd.display()
            );
            SpawnError::os(what, &e)
        })?;
    }
    // The rotation first, the size second: a rotation between the two (by the tick, or by
    // open_log itself) then shows as a changed generation at the crash, and the quote starts
    // at 0 — never at an offset from before a rotation the generation does not show.
    let generation = log_generation(&spec.log_path);
    let (log, offset) = open_log(&spec.log_path, spec.log_max_bytes)?;
    let log_start = LogStart { offset, generation };

    // A bare name is looked up here, in the PATH the worker will have: execve does not search
    // PATH, and std, given a PATH of the child's own, would fork the whole supervisor (a large,
    // multi-threaded process) to run execvp in the child. Not when the start forks anyway —
    // another user (whose permissions the lookup must use), or a umask or rlimits to set in
    // the child: execvp's own lookup stays.
    let forks_anyway = spec.uid.is_some()
        || spec.gid.is_some()
        || spec.umask.is_some()
        || !spec.rlimits.is_empty();
    let own_path = path_with_own_binary();
    let found = if forks_anyway {
        None
    } else {
        find_in_path(
            program,
            workers_path(spec.env.get("PATH")).as_deref(),
            &spec.cwd,
        )
    };
    // The working directory and the user are named: a worker whose user cannot reach its
    // cwd fails with a bare EACCES that otherwise reads like `program` is the problem.
    // A start as another user that fails with EAGAIN met that user's process limit
    // (RLIMIT_NPROC, checked at setuid and exec): the task's business, not a shortage of the
    // supervisor's, which retrying without counting would never end. (std reports fork's
    // errors and the child's alike; a clone3 start never switches users.)
    let other_user = spec.uid.is_some() || spec.gid.is_some();
    let failed = |e: &std::io::Error| {
        let who = spec.uid.map(|u| format!(" as uid {u}")).unwrap_or_default();
        let at = found
            .as_ref()
            .map(|p| format!(" ({})", p.display()))
            .unwrap_or_default();
        let what = format!(
            "cannot start `{program}`{at}{who} in {}: {e}",
            spec.cwd.display()
        );
        let mut error = SpawnError::os(what, e);
        if other_user && e.raw_os_error() == Some(libc::EAGAIN) {
            error.shortage = false;
        }
        error
    };

    // A name with a slash is used as it is (relative to the cwd, as exec after chdir reads it).
    let exec_path = found
        .as_deref()
        .or_else(|| program.contains('/').then(|| Path::new(program.as_str())));
    let clone_start = match exec_path {
        Some(path) if !forks_anyway && process::clone_exec::available() => {
            Some(CloneStart::prepare(spec, path, own_path).map_err(|e| failed(&e))?)
        }
        _ => None,
    };

    // Registered before anything can reap it (the guard spans fork to registration): the
    // orphan reaper must leave it to its actor. Other spawns proceed meanwhile.
    let owned = process::owned::spawning();
    let cloned = match clone_start.as_ref().map(|c| c.start(&log)) {
        Some(Ok(started)) => Some(started),
        Some(Err(Start::Failed(e))) => return Err(failed(&e)),
        Some(Err(Start::FailedAt(step, e))) => {
            // Named by its step, classified by its own error.
            let mut error = failed(&std::io::Error::other(format!("{step}: {e}")));
            error.shortage = is_shortage(&e);
            return Err(error);
        }
        Some(Err(Start::Elsewise)) | None => None,
    };
    let (pid, pidfd, in_flight, start_ticks) = match cloned {
        Some(started) => (
            started.pidfd.pid(),
            Ok(started.pidfd),
            started.in_flight,
            started.start_ticks,
        ),
        None => {
            let mut cmd = std_command(spec, program, args, found.as_deref(), own_path, log)?;
            // From a batched spawner the worker would inherit SCHED_BATCH (see process::sched).
            let child = process::sched::normal_while(|| cmd.spawn()).map_err(|e| failed(&e))?;
            let pid = child.id() as i32;
            // Dropping the std handle neither waits nor kills; the pidfd owns the lifecycle.
            drop(child);
            (pid, PidFd::open(pid), None, None)
        }
    };
    owned.register(pid);
    // Registered: no longer a spawn in flight to anyone walking recent pids.
    drop(in_flight);
    drop(owned);
    // The child is ours and not yet reaped, so its pid cannot be recycled before these reads:
    // the pidfd and the fingerprint are certainly this process's. Without either, nobody could
    // supervise it for long: without a pidfd not even this incarnation, and without a
    // fingerprint no later one could ever prove it alive or gone (its run would hold its task
    // for good). So the start fails (the run is closed as spawn_failed and retried) and the
    // child is ended now.
    let identity = pidfd
        .map_err(|e| SpawnError::process(format!("cannot open pidfd for {pid}: {e}"), &e))
        .and_then(|pidfd| match fingerprint_of_new(pid, start_ticks) {
            Ok(mut fp) => {
                // The inode tells the worker from a process given its pid within its clock
                // tick; without one (an older kernel, an fstat that failed) the start time
                // alone decides, as it did before pidfs.
                fp.pidfs_ino = pidfd.pidfs_ino().ok().flatten();
                Ok((pidfd, fp))
            }
            Err(e) => Err(SpawnError::process(
                format!("cannot fingerprint {pid} ({e})"),
                &e,
            )),
        });
    let (pidfd, fingerprint) = match identity {
        Ok(found) => found,
        Err(error) => {
            // Our unreaped child: its pid, and so its group id, cannot name anyone else until
            // it is reaped here. The child itself too, in case it has already left its group.
            // SAFETY: kill(2) with our unreaped child's pid and group id.
            unsafe {
                libc::kill(-pid, libc::SIGKILL);
                libc::kill(pid, libc::SIGKILL);
            }
            process::clone_exec::reap(pid);
            process::owned::unregister(pid);
            return Err(error);
        }
    };
    Ok(Spawned {
        pid,
        pidfd,
        fingerprint,
        log_start,
    })
}

/// Why [`CloneStart::start`] did not start the worker.
enum Start {
    /// Not this way here (see [`process::clone_exec`]); std's `Command` will.
    Elsewise,
    /// exec or chdir failed (their errors read as std's would).
    Failed(std::io::Error),
    /// Another step of the start failed.
    FailedAt(&'static str, std::io::Error),
}

/// The title as the worker's environment carries it: at most `MAX_TITLE_BYTES` (cut at a
/// character's boundary). Only a task created before titles were bounded can be longer, and
/// the kernel refuses a whole start over one string of more than 128 KiB.
fn env_title(title: &str) -> &[u8] {
    let mut end = title.len().min(crate::board::MAX_TITLE_BYTES);
    while !title.is_char_boundary(end) {
        end -= 1;
    }
    &title.as_bytes()[..end]
}

/// Calls `f` with each of the worker's variables (key, value), in the order std's `Command`
/// would give them precedence: our own environment as it is now, less the `RUNWARDEN_*`
/// variables we inherited and whatever is set below; PATH with our binary's directory (see
/// [`path_with_own_binary`]); the assignee's table; the run's variables last (nothing may
/// override them: a shared token would let one run's end kill another's workers). No key is
/// given twice. Our environment is read in place (no copy of each variable per start).
fn for_each_worker_var(
    spec: &SpawnSpec,
    own_path: Option<&std::ffi::OsStr>,
    mut f: impl FnMut(&[u8], &[u8]) -> std::io::Result<()>,
) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let (task_id, run_id) = (spec.task_id.to_string(), spec.run_id.to_string());
    let run: [(&str, &[u8]); 5] = [
        ("RUNWARDEN_SOCKET", spec.socket.as_os_str().as_bytes()),
        ("RUNWARDEN_TASK_ID", task_id.as_bytes()),
        ("RUNWARDEN_RUN_ID", run_id.as_bytes()),
        ("RUNWARDEN_RUN_TOKEN", spec.token.as_bytes()),
        ("RUNWARDEN_TASK_TITLE", env_title(&spec.title)),
    ];
    let is_run_var = |key: &[u8]| run.iter().any(|(k, _)| k.as_bytes() == key);
    // Ours only without the assignee's (which the table below sets).
    let own_path = own_path.filter(|_| !spec.env.contains_key("PATH"));
    let inherited = inherited_runwarden_vars();
    let set_below = |key: &[u8]| {
        inherited.iter().any(|k| k.as_bytes() == key)
            || (own_path.is_some() && key == b"PATH")
            || std::str::from_utf8(key).is_ok_and(|k| spec.env.contains_key(k))
            || is_run_var(key)
    };
    with_environment(|vars| {
        for (i, &(key, value)) in vars.iter().enumerate() {
            // A name our environment holds twice is passed once, its last value (as std does).
            let again = vars[i + 1..].iter().any(|(k, _)| *k == key);
            if !again && !set_below(key) {
                f(key, value)?;
            }
        }
        Ok::<(), std::io::Error>(())
    })?;
    if let Some(path) = own_path {
        f(b"PATH", path.as_bytes())?;
    }
    for (key, value) in &spec.env {
        if !is_run_var(key.as_bytes()) {
            f(key.as_bytes(), value.as_bytes())?;
        }
    }
    for (key, value) in run {
        f(key.as_bytes(), value)?;
    }
    Ok(())
}

/// A `KEY=VALUE` entry split as std splits it: at the first '=' after the first byte.
fn split_var(entry: &[u8]) -> Option<(&[u8], &[u8])> {
    let eq = entry.iter().skip(1).position(|&b| b == b'=')? + 1;
    Some((&entry[..eq], &entry[eq + 1..]))
}

/// Calls `f` with our environment's variables as (key, value), read in place (valid for the
/// call).
fn with_environment<R>(f: impl FnOnce(&[(&[u8], &[u8])]) -> R) -> R {
    // SAFETY: `environ` is libc's NULL-terminated array of NUL-terminated strings, read here as
    // getenv reads it. It changes only through setenv/putenv/unsetenv (std's `set_var` and
    // `remove_var` among them), which must not run while other threads read the environment
    // (`set_var` is `unsafe` for that reason); runwarden never calls them. The entries are
    // used only during `f`.
    let vars: Vec<(&[u8], &[u8])> = unsafe {
        let mut at = std::ptr::read(&raw const libc::environ) as *const *const std::ffi::c_char;
        let mut vars = Vec::new();
        while !at.is_null() && !(*at).is_null() {
            vars.extend(split_var(std::ffi::CStr::from_ptr(*at).to_bytes()));
            at = at.add(1);
        }
        vars
    };
    f(&vars)
}

/// The error for a string that would be cut short at an embedded NUL.
fn nul_in(what: &str) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{what} contains a NUL byte"),
    )
}

/// NUL-terminated strings in one buffer, and the NULL-terminated pointer array execve wants.
struct CStrings {
    buf: Vec<u8>,
    starts: Vec<usize>,
}

impl CStrings {
    /// Room for `bytes` of strings before the buffer grows.
    fn with_capacity(bytes: usize) -> CStrings {
        CStrings {
            buf: Vec::with_capacity(bytes),
            starts: Vec::new(),
        }
    }

    /// Appends the concatenation of `parts` as one string; `what` names it in the error for
    /// an embedded NUL (which would cut it short).
    fn push(&mut self, parts: &[&[u8]], what: &dyn Fn() -> String) -> std::io::Result<()> {
        if parts.iter().any(|p| p.contains(&0)) {
            return Err(nul_in(&what()));
        }
        self.starts.push(self.buf.len());
        for part in parts {
            self.buf.extend_from_slice(part);
        }
        self.buf.push(0);
        Ok(())
    }

    /// The pointers, valid while `self` is neither changed nor dropped.
    fn pointers(&self) -> Vec<*const std::ffi::c_char> {
        self.starts
            .iter()
            .map(|&i| self.buf[i..].as_ptr().cast())
            .chain(std::iter::once(std::ptr::null()))
            .collect()
    }
}

/// A worker start through [`process::clone_exec`], prepared (outside the spawn gate): the
/// program's path (its argv\[0\] stays the configured name), working directory, argv and
/// environment as C strings.
struct CloneStart {
    path: std::ffi::CString,
    cwd: std::ffi::CString,
    argv: CStrings,
    envp: CStrings,
}

impl CloneStart {
    fn prepare(
        spec: &SpawnSpec,
        path: &Path,
        own_path: Option<&std::ffi::OsStr>,
    ) -> std::io::Result<CloneStart> {
        use std::os::unix::ffi::OsStrExt;
        let c = |bytes: &[u8], what: &str| std::ffi::CString::new(bytes).map_err(|_| nul_in(what));
        let mut argv = CStrings::with_capacity(256);
        for arg in &spec.argv {
            argv.push(&[arg.as_bytes()], &|| format!("argument {arg:?}"))?;
        }
        let mut envp = CStrings::with_capacity(4096);
        for_each_worker_var(spec, own_path, |key, value| {
            envp.push(&[key, b"=", value], &|| {
                format!("environment variable {}", String::from_utf8_lossy(key))
            })
        })?;
        Ok(CloneStart {
            path: c(path.as_os_str().as_bytes(), "the program's path")?,
            cwd: c(spec.cwd.as_os_str().as_bytes(), "the working directory")?,
            argv,
            envp,
        })
    }

    /// Starts it: stdin is /dev/null, stdout and stderr `log`.
    fn start(&self, log: &File) -> Result<process::clone_exec::Started, Start> {
        use process::clone_exec::{CloneExecError, spawn_leader};
        use std::os::fd::AsFd;
        let null = dev_null().map_err(Start::Failed)?;
        let stdio = [null.as_fd(), log.as_fd(), log.as_fd()];
        let (argv, envp) = (self.argv.pointers(), self.envp.pointers());
        match spawn_leader(&self.path, &argv, &envp, &self.cwd, stdio) {
            Ok(started) => Ok(started),
            Err(CloneExecError::Unsupported(_)) => Err(Start::Elsewise),
            // exec's and chdir's errors read as std's would; the other steps are named.
            Err(CloneExecError::Failed { step, source }) if step == "execve" || step == "chdir" => {
                Err(Start::Failed(source))
            }
            Err(CloneExecError::Failed { step, source }) => Err(Start::FailedAt(step, source)),
        }
    }
}

/// /dev/null for workers' stdin, opened once per spawning thread (close-on-exec: each child
/// gets its own copy as descriptor 0).
fn dev_null() -> std::io::Result<std::rc::Rc<File>> {
    thread_local! {
        static NULL: std::cell::OnceCell<std::rc::Rc<File>> = const { std::cell::OnceCell::new() };
    }
    NULL.with(|cell| {
        if let Some(f) = cell.get() {
            return Ok(f.clone());
        }
        let f = std::rc::Rc::new(File::open("/dev/null")?);
        Ok(cell.get_or_init(|| f).clone())
    })
}

/// The worker's start through std's `Command` (fork + exec: the child starts its own session,
/// which std's posix_spawn path cannot do): for what [`CloneStart::start`] does not do.
fn std_command(
    spec: &SpawnSpec,
    program: &str,
    args: &[String],
    found: Option<&Path>,
    own_path: Option<&std::ffi::OsStr>,
    log: File,
) -> Result<Command, SpawnError> {
    let log_err = log
        .try_clone()
        .map_err(|e| SpawnError::os(format!("cannot duplicate log file handle: {e}"), &e))?;
    let mut cmd = match found {
        Some(path) => {
            let mut c = Command::new(path);
            // The worker still sees the name it was configured with.
            c.arg0(program);
            c
        }
        None => Command::new(program),
    };
    cmd.args(args)
        .current_dir(&spec.cwd)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err);
    // The same variables as the clone3 start gives (this visit's closure never fails, so
    // neither does the visit).
    cmd.env_clear();
    let _ = for_each_worker_var(spec, own_path, |key, value| {
        use std::os::unix::ffi::OsStrExt;
        cmd.env(
            std::ffi::OsStr::from_bytes(key),
            std::ffi::OsStr::from_bytes(value),
        );
        Ok(())
    });
    if let Some(gid) = spec.gid {
        cmd.gid(gid);
    }
    if let Some(uid) = spec.uid {
        cmd.uid(uid);
    }
    let limits = rlimit_pairs(&spec.rlimits)?;
    let umask = spec.umask;
    let nofile = process::nofile::for_workers();
    // SAFETY: the closure runs between fork and exec; it only calls async-signal-safe
    // functions (setsid, umask, setrlimit) and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // A session (and group) of its own, as the clone3 start gives.
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(m) = umask {
                libc::umask(m as libc::mode_t);
            }
            // The limit the supervisor started with (best effort, as the clone3 start); the
            // assignee's own `rlimits` next, which may set it otherwise.
            if let Some(lim) = &nofile {
                libc::setrlimit(libc::RLIMIT_NOFILE, lim);
            }
            for &(resource, value) in &limits {
                let lim = libc::rlimit {
                    rlim_cur: value,
                    rlim_max: value,
                };
                if libc::setrlimit(resource, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    Ok(cmd)
}

/// The spawn fingerprint of a child just started: its start time as the clock told it at the
/// start (`start_ticks`), else read from `/proc`. A test can make it fail on its thread.
fn fingerprint_of_new(
    pid: i32,
    start_ticks: Option<u64>,
) -> Result<Fingerprint, process::ProcessError> {
    #[cfg(test)]
    if tests::FAIL_FINGERPRINT.with(|f| f.get()) {
        return Err(process::ProcessError::System {
            what: "read /proc/<pid>/stat",
            source: std::io::Error::from_raw_os_error(libc::EMFILE),
        });
    }
    process::fingerprint_of_child(pid, start_ticks)
}

/// Where `program` is in `path` (the worker's PATH; unset means `/bin:/usr/bin`, as for
/// execvp), for a worker starting in `cwd`: the first regular file this process may execute
/// (effective ids, as exec checks). Empty and relative PATH entries are relative to `cwd`.
/// `None` for a name with a slash (used as is) and for a name found nowhere (the spawn then
/// reports it missing). Unlike execvp, a candidate that then fails to exec is the answer: the
/// search does not go on, and a file without a `#!` line is not handed to `/bin/sh`.
pub fn find_in_path(program: &str, path: Option<&std::ffi::OsStr>, cwd: &Path) -> Option<PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    if program.is_empty() || program.contains('/') {
        return None;
    }
    let path = path.unwrap_or(std::ffi::OsStr::new("/bin:/usr/bin"));
    // Absolute: the child resolves a relative program path after changing to its cwd.
    let cwd = std::path::absolute(cwd).ok()?;
    std::env::split_paths(path).find_map(|dir| {
        let candidate = cwd.join(dir).join(program);
        let is_file = fs::metadata(&candidate).is_ok_and(|m| m.is_file());
        let c = std::ffi::CString::new(candidate.as_os_str().as_bytes()).ok()?;
        // SAFETY: a valid NUL-terminated path.
        let executable = is_file
            && unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::X_OK, libc::AT_EACCESS) }
                == 0;
        executable.then_some(candidate)
    })
}

/// Why an assignee's program cannot be found now, if it cannot: a path that names no
/// executable file, or a name in no directory of the PATH its workers get (its `env`'s, else
/// the supervisor's with its own binary's directory first). Asked at start, to warn: the
/// program may yet appear (installed later), so it is not refused — but otherwise a typo
/// shows only as every run ending `spawn_failed`. Relative paths, and relative PATH entries,
/// depend on a task's work dir and are not judged; the check uses this process's ids, not
/// those of the assignee's `user`.
pub fn program_missing(assignee: &crate::config::AssigneeConfig) -> Option<String> {
    let program = assignee.command.first()?;
    if program.contains('/') {
        let path = Path::new(program);
        let runnable = fs::metadata(path).is_ok_and(|m| {
            use std::os::unix::fs::PermissionsExt;
            m.is_file() && m.permissions().mode() & 0o111 != 0
        });
        return (path.is_absolute() && !runnable)
            .then(|| format!("{program} is not an executable file"));
    }
    let path = workers_path(assignee.env.get("PATH")).unwrap_or(std::borrow::Cow::Borrowed(
        std::ffi::OsStr::new("/bin:/usr/bin"),
    ));
    if std::env::split_paths(&path).any(|d| !d.is_absolute()) {
        return None; // Relative entries: resolved in a task's work dir, not known yet.
    }
    find_in_path(program, Some(&path), Path::new("/"))
        .is_none()
        .then(|| {
            format!(
                "`{program}` is in no directory of its PATH ({})",
                path.to_string_lossy()
            )
        })
}

/// Creates `dir` (mode 0700: a task's work is its worker's business, and the data dir may be
/// traversable by others when the socket serves them) — its parents as they come. An existing
/// one (a retry works where the first attempt did) is made 0700 if it is open to others (made
/// by an older build); should that be refused, it is used as it is.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let create = || fs::DirBuilder::new().mode(0o700).create(dir);
    let existing = || {
        // Not a link put in the directory's place: the worker would work wherever it points.
        if fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(std::io::Error::other("it is a symbolic link"));
        }
        if let Ok(meta) = fs::metadata(dir)
            && meta.permissions().mode() & 0o077 != 0
            && let Err(e) = fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        {
            tracing::warn!(path = %dir.display(), error = %e, "cannot make a task's directory private");
        }
        Ok(())
    };
    let created = match create() {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent() {
                fs::create_dir_all(parent)?;
            }
            create()
        }
        other => other,
    };
    match created {
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => existing(),
        other => other,
    }
}

/// Opens an existing log file with `opts`, never through a symbolic link and without waiting
/// (a FIFO put in its place would hold an open or a read until some peer came); anything but a
/// regular file is refused. With its metadata.
fn open_regular(path: &Path, opts: &mut OpenOptions) -> std::io::Result<(File, std::fs::Metadata)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = opts
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    Ok((file, meta))
}

/// Opens the task's log for appending (created 0600: only the supervisor reads it; the worker
/// writes through the descriptor it is given), rotating it first when it has reached
/// `max_bytes`. With the log's size once open (0 after a rotation).
fn open_log(path: &Path, max_bytes: u64) -> Result<(File, u64), SpawnError> {
    use std::os::unix::fs::OpenOptionsExt;
    // Never through a symbolic link: the log is the supervisor's file, not wherever a link
    // put in its place points.
    let open = || {
        OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)
    };
    let file = match open() {
        Ok(f) => f,
        // The log directory is created on first need (once per data dir, not once per run).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                create_private_dir(dir).map_err(|e| {
                    let what = format!("cannot create log directory {}: {e}", dir.display());
                    SpawnError::os(what, &e)
                })?;
            }
            open().map_err(|e| cannot_open_log(path, &e))?
        }
        Err(e) => return Err(cannot_open_log(path, &e)),
    };
    // Sized through the open handle: a fresh log (the common case) costs no second lookup.
    // Unknown, it counts as empty: a crash would then quote earlier attempts too, nothing worse.
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    if size < max_bytes {
        return Ok((file, size));
    }
    drop(file);
    rotate_if_needed(path, max_bytes);
    let file = open().map_err(|e| cannot_open_log(path, &e))?;
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    Ok((file, size))
}

fn cannot_open_log(path: &Path, e: &std::io::Error) -> SpawnError {
    SpawnError::os(format!("cannot open log file {}: {e}", path.display()), e)
}

/// Copy-then-truncate rotation, keeping one backup (`<name>.1`) of the log's last `max_bytes`
/// (a worker may have written far more since the last rotation: the backup stays bounded).
/// Copying (rather than renaming) keeps working while a worker holds the file open in append
/// mode: its next write lands at the new end of the truncated file. Lines written between copy
/// and truncate are lost; that is the documented price of never interrupting the worker.
///
/// The tail is copied to a fresh file that is renamed into the backup's place only after the
/// log was truncated, so a new backup ([`log_generation`]) tells a reader that the log started
/// over — even once it has grown past the reader's offset again. On a full disk, a log at
/// twice its bound or more gives up its old backup, and then its lines (it is cut with an
/// empty backup), rather than stay over its bound.
pub fn rotate_if_needed(path: &Path, max_bytes: u64) {
    let due = || fs::symlink_metadata(path).is_ok_and(|meta| meta.len() >= max_bytes);
    if !due() {
        return;
    }
    // The tick's chores and a spawn's `open_log` may both find one log due: one at a time (they
    // share `<log>.1.new`), and the second finds it rotated.
    static ROTATING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ROTATING.lock().unwrap_or_else(|p| p.into_inner());
    if !due() {
        return;
    }
    let backup = backup_path(path);
    let fresh = rotation_path(path);
    let truncated = std::cell::Cell::new(false);
    // The rotation the new backup follows, read before anything is deleted (a full disk gives
    // up the old backup first): a follower of the log checks it to know it missed nothing.
    let replaces = log_generation(path);
    // `keep`: how much of the log's tail goes to the backup.
    let rotate = |keep: u64| -> std::io::Result<()> {
        use std::os::unix::fs::OpenOptionsExt;
        let (mut src, meta) = open_regular(path, OpenOptions::new().read(true))?;
        let start = meta.len().saturating_sub(keep);
        src.seek(SeekFrom::Start(start))?;
        // A fresh file: whatever is in its place (one left by a rotation cut short, or a FIFO
        // that an open for writing would wait on for ever) goes first.
        match fs::remove_file(&fresh) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut dst = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&fresh)?;
        std::io::copy(&mut src.take(keep), &mut dst)?;
        set_backup_start(&dst, start, replaces.as_deref());
        open_regular(path, OpenOptions::new().write(true))?
            .0
            .set_len(0)?;
        truncated.set(true);
        // Replaces whatever is in the backup's place (a link is replaced, never followed).
        fs::rename(&fresh, &backup)
    };
    let mut result = rotate(max_bytes);
    if let Err(e) = &result
        && !truncated.get()
        && matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
        && fs::symlink_metadata(path).is_ok_and(|m| m.len() >= max_bytes.saturating_mul(2))
    {
        // No room for the backup, and this log is far over its bound — its worker wrote at
        // least as much again as it may keep since the last tick: it is what filled the disk.
        // Left as it is, it would stay so, and the disk full, until an operator stepped in.
        // The old backup goes first (a rotation replaces it anyway, and its space may be room
        // enough for the new one); failing that, the log is cut with nothing kept (an empty
        // backup, so that a reader following it still sees a rotation): its bound matters
        // more than its last lines. A log barely over its bound on a disk something else
        // filled keeps its lines and its backup, and is rotated once there is room. (Each
        // attempt removes what a failed one left in `fresh` itself.)
        let _ = fs::remove_file(&backup);
        result = rotate(max_bytes);
        if result.is_ok() {
            tracing::warn!(path = %path.display(), "log rotation: the disk is full and this log is far over its bound; its old backup was deleted to make room for the new one");
        } else if !truncated.get() {
            result = rotate(0);
            if result.is_ok() || truncated.get() {
                tracing::warn!(path = %path.display(), "log rotation: the disk is full and this log is far over its bound; its old backup was deleted and the log cut with no backup kept");
            }
        }
    }
    if let Err(e) = result {
        if truncated.get() {
            // The log's tail is in `<log>.1.new` alone now: left there, not lost.
            tracing::warn!(path = %path.display(), kept = %fresh.display(), error = %e, "log rotation: cannot put the backup in place");
        } else {
            let _ = fs::remove_file(&fresh);
            tracing::warn!(path = %path.display(), error = %e, "log rotation failed");
        }
    }
}

/// The extended attribute on a backup that says where in the rotated log its first byte was.
const BACKUP_START_XATTR: &std::ffi::CStr = c"user.runwarden.start";

/// Records on a new backup where in the log it starts, and which rotation it follows (the
/// generation of the backup it replaces), so that a follower of the log can print what it had
/// not read yet from the backup instead of losing it ([`backup_start`]). Best effort: a file
/// system without user extended attributes just does not tell.
fn set_backup_start(backup: &fs::File, start: u64, replaces: Option<&str>) {
    use std::os::fd::AsRawFd;
    let value = format!("{start} {}", replaces.unwrap_or("-"));
    // SAFETY: a valid descriptor, a NUL-terminated name, and a buffer of the given length.
    unsafe {
        libc::fsetxattr(
            backup.as_raw_fd(),
            BACKUP_START_XATTR.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
}

/// Where a backup starts in the log it was rotated from, and the rotation it replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupStart {
    /// The offset of the backup's first byte in the rotated log.
    pub offset: u64,
    /// The generation ([`log_generation`]) of the backup this one replaced; `None` for the first.
    pub replaces: Option<String>,
}

/// Where in the rotated log the backup of the log at `path` starts, if its rotation said so.
pub fn backup_start(path: &Path) -> Option<BackupStart> {
    use std::os::unix::ffi::OsStrExt;
    let backup = std::ffi::CString::new(backup_path(path).as_os_str().as_bytes()).ok()?;
    let mut buf = [0u8; 128];
    // SAFETY: NUL-terminated path and name, and a buffer of the given length. lgetxattr: a
    // link in the backup's place is not followed.
    let n = unsafe {
        libc::lgetxattr(
            backup.as_ptr(),
            BACKUP_START_XATTR.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).ok()?;
    let (offset, replaces) = std::str::from_utf8(&buf[..n]).ok()?.split_once(' ')?;
    Some(BackupStart {
        offset: offset.parse().ok()?,
        replaces: (replaces != "-").then(|| replaces.to_string()),
    })
}

/// The backup of the log at `path`, for reading: a regular file only, never through a link,
/// never waiting (see `open_regular`).
pub fn open_backup(path: &Path) -> std::io::Result<File> {
    open_regular(&backup_path(path), OpenOptions::new().read(true)).map(|(f, _)| f)
}

/// `<log>.1`.
pub fn backup_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// `<log>.1.new`: the next backup while a rotation writes it.
pub fn rotation_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".1.new");
    PathBuf::from(name)
}

/// Which rotation the log at `path` is in: an opaque token that changes when a rotation
/// completes (the backup's inode and modification time), `None` before the first. A reader
/// that follows the log and sees it change starts again from the log's beginning.
pub fn log_generation(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::symlink_metadata(backup_path(path)).ok()?;
    Some(format!(
        "{}-{}.{:09}",
        meta.ino(),
        meta.mtime(),
        meta.mtime_nsec()
    ))
}

/// Up to `max` bytes of a log file from `offset`, and the file's size: `Ok(None)` when there is
/// no log. Never waits on a FIFO or the like. Blocking: off the actor threads.
pub fn read_log(path: &Path, offset: u64, max: u64) -> std::io::Result<Option<(Vec<u8>, u64)>> {
    let (mut f, meta) = match open_regular(path, OpenOptions::new().read(true)) {
        Ok(found) => found,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let size = meta.len();
    let mut data = Vec::new();
    if offset < size {
        f.seek(SeekFrom::Start(offset))?;
        f.take(max.min(size - offset)).read_to_end(&mut data)?;
    }
    Ok(Some((data, size)))
}

/// The last `n` bytes of a log file written since offset `from` (lossy UTF-8), for a crash's
/// error text: `from` is where the run's own output starts (the log is shared by the task's
/// attempts). A log shorter than `from` was rotated since, and all of it is the run's. Called
/// on the actor thread, so it never waits: opened non-blocking, and anything but a regular file
/// (a FIFO put in the log's place would block a read until some writer came) gives "".
pub fn log_tail(path: &Path, from: u64, n: u64) -> String {
    let Ok((mut f, meta)) = open_regular(path, OpenOptions::new().read(true)) else {
        return String::new();
    };
    let len = meta.len();
    let from = if len < from { 0 } else { from };
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(n).max(from)));
    let mut buf = Vec::new();
    let _ = f.take(n).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().to_string()
}

/// The PATH a worker gets: its assignee's (`env`), else ours with this binary's directory
/// first (see [`path_with_own_binary`]), else ours as it is (`None`: unset). Its spawn looks a
/// bare program name up in it, and so does the check at start ([`program_missing`]).
fn workers_path(assignee_path: Option<&String>) -> Option<std::borrow::Cow<'_, std::ffi::OsStr>> {
    use std::borrow::Cow;
    match (assignee_path, path_with_own_binary()) {
        (Some(p), _) => Some(Cow::Borrowed(std::ffi::OsStr::new(p.as_str()))),
        (None, Some(p)) => Some(Cow::Borrowed(p)),
        (None, None) => std::env::var_os("PATH").map(Cow::Owned),
    }
}

/// PATH with the directory of the running `runwarden` binary first, so `runwarden complete`
/// works inside a worker of `cargo run -- serve`. Embedding programs are not named runwarden
/// and leave PATH alone.
fn path_with_own_binary() -> Option<&'static std::ffi::OsStr> {
    // Computed once: the binary and the supervisor's PATH do not change while it runs.
    static PATH: OnceLock<Option<std::ffi::OsString>> = OnceLock::new();
    PATH.get_or_init(compute_path_with_own_binary).as_deref()
}

fn compute_path_with_own_binary() -> Option<std::ffi::OsString> {
    let exe = std::env::current_exe().ok()?;
    if exe.file_name()? != "runwarden" {
        return None;
    }
    let dir = exe.parent()?.to_path_buf();
    let mut parts = vec![dir];
    if let Some(p) = std::env::var_os("PATH") {
        parts.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(parts).ok()
}

/// The `RUNWARDEN_*` variables of the supervisor's own environment (set when it was itself
/// started inside a worker), read once: workers do not get them.
fn inherited_runwarden_vars() -> &'static [std::ffi::OsString] {
    static VARS: OnceLock<Vec<std::ffi::OsString>> = OnceLock::new();
    VARS.get_or_init(|| {
        std::env::vars_os()
            .map(|(key, _)| key)
            .filter(|key| key.to_string_lossy().starts_with("RUNWARDEN_"))
            .collect()
    })
}

fn rlimit_pairs(
    limits: &BTreeMap<String, u64>,
) -> Result<Vec<(libc::__rlimit_resource_t, u64)>, String> {
    limits
        .iter()
        .map(|(name, &value)| {
            let r = match name.as_str() {
                "nofile" => libc::RLIMIT_NOFILE,
                "as" => libc::RLIMIT_AS,
                "nproc" => libc::RLIMIT_NPROC,
                "cpu" => libc::RLIMIT_CPU,
                "fsize" => libc::RLIMIT_FSIZE,
                "core" => libc::RLIMIT_CORE,
                "memlock" => libc::RLIMIT_MEMLOCK,
                "stack" => libc::RLIMIT_STACK,
                "data" => libc::RLIMIT_DATA,
                other => return Err(format!("unknown rlimit `{other}`")),
            };
            Ok((r, value))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::time::Duration;

    use super::*;

    thread_local! {
        /// Makes `fingerprint_of_new` fail on this thread (spawn() runs on the caller's thread).
        pub(super) static FAIL_FINGERPRINT: Cell<bool> = const { Cell::new(false) };
    }

    #[test]
    fn a_child_that_cannot_be_fingerprinted_is_killed_and_the_start_fails() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = spec(dir.path(), &["sleep", "60"]);
        // A token of its own: the scan below must find only this test's child.
        spec.token = format!("unfingerprinted-{}", std::process::id());
        FAIL_FINGERPRINT.with(|f| f.set(true));
        let t0 = std::time::Instant::now();
        let res = spawn(&spec);
        FAIL_FINGERPRINT.with(|f| f.set(false));
        // It reaps the child before returning: long before the child's own 60 s, it was killed.
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "waited for the child to exit"
        );
        let error = match res {
            Ok(child) => {
                let _ = child.pidfd.signal_group(process::Signal::SIGKILL);
                panic!("started a worker without a fingerprint (pid {})", child.pid);
            }
            Err(e) => e,
        };
        let error = error.to_string();
        assert!(error.contains("cannot fingerprint"), "{error}");
        // Killed and reaped before spawn() returned: no process carries its token any more,
        // and its pid is no longer one an owner will wait for.
        let pid: i32 = error
            .split_whitespace()
            .nth(2)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no pid in {error:?}"));
        assert!(!process::owned::is_registered(pid));
        assert_eq!(
            process::descendants::find_by_token(&spec.token).unwrap(),
            []
        );
    }

    fn spec(dir: &Path, argv: &[&str]) -> SpawnSpec {
        SpawnSpec {
            run_id: 1,
            task_id: 1,
            token: "0123456789abcdef0123456789abcdef".into(),
            title: "t".into(),
            argv: argv.iter().map(|s| s.to_string()).collect(),
            env: BTreeMap::new(),
            cwd: dir.join("work").join("1"),
            own_cwd: true,
            socket: dir.join("control.sock"),
            log_path: dir.join("logs").join("1.log"),
            log_max_bytes: 10 << 20,
            uid: None,
            gid: None,
            umask: None,
            rlimits: BTreeMap::new(),
        }
    }

    /// Waits for our child's exit through a pidfd of our own, then reaps it.
    fn exits_and_is_reaped(pidfd: &PidFd) -> bool {
        let exited = pidfd.wait_exit(Duration::from_secs(10)).unwrap_or(false);
        exited && matches!(pidfd.try_reap(), Ok(Some(_)))
    }

    #[test]
    fn a_spawner_delivers_a_started_registered_child() {
        let dir = tempfile::tempdir().unwrap();
        let spawner = Spawner::start(1, Scheduling::Normal).unwrap();
        let child = futures::executor::block_on(spawner.submit(spec(dir.path(), &["true"])))
            .expect("spawned");
        assert!(process::owned::is_registered(child.pid));
        // The start time /proc shows, and the inode of the pidfd the start handed back.
        let read = process::fingerprint(child.pid).unwrap();
        assert_eq!(child.fingerprint.start_ticks, read.start_ticks);
        assert_eq!(child.fingerprint.boot_id, read.boot_id);
        // A pidfd opened anew names the same process: the same inode (Linux >= 6.9 has pidfs).
        let again = process::PidFd::open(child.pid)
            .unwrap()
            .pidfs_ino()
            .unwrap();
        assert!(
            again.is_some(),
            "pidfds are not pidfs inodes here (Linux < 6.9?)"
        );
        assert_eq!(child.fingerprint.pidfs_ino, again);
        assert!(exits_and_is_reaped(&child.pidfd));
        process::owned::unregister(child.pid);
    }

    #[test]
    fn a_started_workers_fingerprint_is_the_one_proc_shows() {
        let dir = tempfile::tempdir().unwrap();
        for _ in 0..50 {
            let child = spawn(&spec(dir.path(), &["sleep", "30"])).expect("spawned");
            let read = process::fingerprint(child.pid);
            let _ = child.pidfd.signal_group(process::Signal::SIGKILL);
            assert!(exits_and_is_reaped(&child.pidfd));
            process::owned::unregister(child.pid);
            let read = read.expect("its /proc/<pid>/stat");
            assert_eq!(
                (&child.fingerprint.boot_id, child.fingerprint.start_ticks),
                (&read.boot_id, read.start_ticks)
            );
        }
    }

    #[test]
    fn an_undelivered_child_is_killed_and_left_to_the_orphan_reaper() {
        let dir = tempfile::tempdir().unwrap();
        let child = spawn(&spec(dir.path(), &["sleep", "30"])).expect("spawned");
        let pid = child.pid;
        // Our own view of it, to see it die after the handoff is dropped.
        let watch = PidFd::open(pid).expect("pidfd of our unreaped child");
        drop(Handoff(Some(child)));
        assert!(
            !process::owned::is_registered(pid),
            "the orphan reaper may collect it"
        );
        assert!(
            exits_and_is_reaped(&watch),
            "the undelivered child was not killed"
        );
    }

    /// The worker's variables as for_each_worker_var gives them, in order.
    fn worker_vars(spec: &SpawnSpec, own_path: Option<&str>) -> Vec<(String, String)> {
        let mut vars = Vec::new();
        for_each_worker_var(spec, own_path.map(std::ffi::OsStr::new), |k, v| {
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            vars.push((text(k), text(v)));
            Ok(())
        })
        .unwrap();
        vars
    }

    #[test]
    fn a_worker_gets_each_variable_once_the_assignees_path_and_the_runs_own_ids() {
        let dir = tempfile::tempdir().unwrap();
        let mut spec = spec(dir.path(), &["true"]);
        spec.env.insert("PATH".into(), "/assignee/bin".into());
        spec.env.insert("RUNWARDEN_TASK_ID".into(), "forged".into());
        spec.env.insert("FROM_CONFIG".into(), "yes".into());
        let vars = worker_vars(&spec, Some("/own/dir:/usr/bin"));
        let mut keys: Vec<&str> = vars.iter().map(|(k, _)| k.as_str()).collect();
        keys.sort();
        let before = keys.len();
        keys.dedup();
        assert_eq!(keys.len(), before, "a variable given twice: {vars:?}");
        let get = |key: &str| vars.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        assert_eq!(
            get("PATH"),
            Some("/assignee/bin"),
            "the assignee's PATH wins"
        );
        assert_eq!(get("RUNWARDEN_TASK_ID"), Some("1"), "the run's own id wins");
        assert_eq!(get("FROM_CONFIG"), Some("yes"));
        assert_eq!(get("RUNWARDEN_RUN_TOKEN"), Some(spec.token.as_str()));

        spec.env.remove("PATH");
        let vars = worker_vars(&spec, Some("/own/dir:/usr/bin"));
        let paths: Vec<_> = vars.iter().filter(|(k, _)| k == "PATH").collect();
        assert_eq!(paths.len(), 1, "{vars:?}");
        assert_eq!(
            paths[0].1, "/own/dir:/usr/bin",
            "our binary's directory first"
        );
    }

    #[test]
    fn find_in_path_follows_execvp() {
        use std::ffi::OsStr;
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let exe = |p: &Path| {
            fs::create_dir_all(p.parent().unwrap()).unwrap();
            fs::write(p, "#!/bin/sh\n").unwrap();
            fs::set_permissions(p, fs::Permissions::from_mode(0o755)).unwrap();
        };
        exe(&d.join("b/tool"));
        exe(&d.join("cwd/rel/tool"));
        exe(&d.join("cwd/tool"));
        fs::create_dir_all(d.join("a/tool")).unwrap(); // a directory: passed over
        fs::create_dir_all(d.join("n")).unwrap();
        fs::write(d.join("n/tool"), "").unwrap(); // not executable: passed over
        fs::set_permissions(d.join("n/tool"), fs::Permissions::from_mode(0o644)).unwrap();
        let cwd = d.join("cwd");
        let path = |p: &str| Some(OsStr::new(p).to_owned());
        let find =
            |name: &str, p: Option<std::ffi::OsString>| find_in_path(name, p.as_deref(), &cwd);

        let abs = format!("{0}/a:{0}/n:{0}/b", d.display());
        assert_eq!(find("tool", path(&abs)), Some(d.join("b/tool")));
        // Relative and empty entries are relative to the worker's cwd.
        assert_eq!(find("tool", path("rel")), Some(cwd.join("rel/tool")));
        assert_eq!(
            find("tool", path(&format!(":{abs}"))),
            Some(cwd.join("tool"))
        );
        // Names with a slash are used as they are; names found nowhere are left to the spawn.
        assert_eq!(find("./tool", path(&abs)), None);
        assert_eq!(find("missing", path(&abs)), None);
        assert_eq!(
            find("tool", path(&format!("{0}/a:{0}/n", d.display()))),
            None
        );
        // No PATH at all: execvp's default.
        assert_eq!(find("sh", None), Some(PathBuf::from("/bin/sh")));
    }

    /// A crash's log tail is read on the actor thread: a FIFO in the log's place (no writer)
    /// must give "" at once, not block it.
    #[test]
    fn log_tail_of_a_fifo_returns_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("1.log");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let path = fifo.clone();
        std::thread::spawn(move || tx.send(log_tail(&path, 0, 400)));
        let tail = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("log_tail blocked on a FIFO");
        assert_eq!(tail, "");
        // A regular file still gives its tail.
        let log = dir.path().join("2.log");
        fs::write(&log, "first\nlast words\n").unwrap();
        assert_eq!(log_tail(&log, 0, 11), "last words");
    }

    /// A crash quotes its own run's output only: the log is the task's, shared by attempts.
    #[test]
    fn log_tail_starts_at_the_runs_own_output() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("1.log");
        fs::write(&log, "attempt one: disk on fire\n").unwrap();
        let (_, start) = open_log(&log, 1 << 20).unwrap();
        assert_eq!(start, 26);
        // This attempt wrote nothing: nothing to quote (not the previous attempt's words).
        assert_eq!(log_tail(&log, start, 400), "");
        fs::write(&log, "attempt one: disk on fire\nattempt two: ok?\n").unwrap();
        assert_eq!(log_tail(&log, start, 400), "attempt two: ok?");
        // The last `n` bytes when the run wrote more.
        assert_eq!(log_tail(&log, start, 4), "ok?");
        // Rotated since the start (shorter than the start): all of it is this run's.
        fs::write(&log, "after\n").unwrap();
        assert_eq!(log_tail(&log, start, 400), "after");
        // A log at its size limit is rotated when a worker gets it: it starts at 0.
        fs::write(&log, "x".repeat(64)).unwrap();
        let (_, start) = open_log(&log, 64).unwrap();
        assert_eq!(start, 0);
    }
}
