//! `lifecycle`: supervised `/bin/true` lifecycles/s against plain spawn+wait/s, dispatch
//! latency, reap precision, and a micro-profile of what one lifecycle costs.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use runwarden::actors::spawn::{self, SpawnSpec};
use runwarden::actors::store::{EventFeed, Store};
use runwarden::board::{Board, Event, NewTask, OpenOptions, TaskId, TaskStatus};
use runwarden::config::{AssigneeConfig, Config, ShutdownMode, Synchronous};
use runwarden::process;
use runwarden::{Supervisor, SupervisorHandle};
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use crate::util::{
    Summary, cpu_per_run, cpu_us, mean, median, now_ns, p50_p99, percentile, thread_cpu_report,
    thread_ticks,
};
use crate::{Opts, Probe};

const TARGET_RATIO: f64 = 0.7;
/// Hang workers alive at once in the reap-precision phase.
const REAP_BATCH: usize = 10;
/// Plain spawns of the probe measured for the dispatch-latency floor.
const FLOOR_SAMPLES: usize = 50;

/// `bench __probe`: writes the wall clock (ns) to `$OUT/$RUNWARDEN_TASK_ID` and exits.
pub fn probe_main() -> ExitCode {
    let t = now_ns();
    let (Some(out), Some(id)) = (
        std::env::var_os("OUT"),
        std::env::var_os("RUNWARDEN_TASK_ID"),
    ) else {
        return ExitCode::from(3);
    };
    match std::fs::write(Path::new(&out).join(id), format!("{t}\n")) {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::from(4),
    }
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a tokio runtime for the event feed")
}

enum Recv {
    Ev(Arc<Event>),
    Lagged,
    Timeout,
    Closed,
}

fn recv(rt: &Runtime, feed: &mut EventFeed, d: Duration) -> Recv {
    // The timer must be created inside the runtime.
    match rt.block_on(async { tokio::time::timeout(d, feed.recv()).await }) {
        Err(_) => Recv::Timeout,
        Ok(Ok(ev)) => Recv::Ev(ev),
        Ok(Err(RecvError::Lagged(_))) => Recv::Lagged,
        Ok(Err(RecvError::Closed)) => Recv::Closed,
    }
}

fn base_config(dir: &Path, opts: &Opts, slots: usize) -> Config {
    let mut c = Config::with_data_dir(dir);
    c.supervisor.max_in_progress = slots as u32;
    c.supervisor.synchronous = if opts.sync_full {
        Synchronous::Full
    } else {
        Synchronous::Normal
    };
    // Never leave a worker behind when the bench stops.
    c.supervisor.shutdown = ShutdownMode::Terminate;
    c.reaper.grace = opts.grace;
    c.reaper.kill_timeout = Duration::from_secs(2);
    // A failed run (there should be none) is retried quickly instead of after 5 s, so it
    // shows up in the outcome counts without wrecking the timing; it is reported.
    c.retries.backoff = Duration::from_millis(50);
    c
}

// ---------------------------------------------------------------------------------------------
// Throughput rounds
// ---------------------------------------------------------------------------------------------

/// Per-task timestamps from the event feed (the board's `at`, ms: the batch's start time).
#[derive(Default, Clone, Copy)]
struct Timeline {
    claimed: Option<i64>,
    spawned: Option<i64>,
    completed: Option<i64>,
    claims: u32,
}

#[derive(Default)]
struct Collected {
    completed: usize,
    blocked: usize,
    last_done: Option<Instant>,
    events: usize,
    lagged: u64,
    timed_out: bool,
    kinds: BTreeMap<String, usize>,
    outcomes: BTreeMap<String, usize>,
    first_error: Option<String>,
    timelines: HashMap<TaskId, Timeline>,
}

impl Collected {
    fn note(&mut self, ev: &Event) {
        self.events += 1;
        *self.kinds.entry(ev.kind.clone()).or_default() += 1;
        let Some(task) = ev.task_id else { return };
        let tl = self.timelines.entry(task).or_default();
        match ev.kind.as_str() {
            "claimed" => {
                tl.claimed = Some(ev.at);
                tl.claims += 1;
            }
            "worker_spawned" => tl.spawned = Some(ev.at),
            "completed" => {
                tl.completed = Some(ev.at);
                self.completed += 1;
                self.last_done = Some(Instant::now());
            }
            "blocked" => {
                self.blocked += 1;
                self.last_done = Some(Instant::now());
            }
            "run_closed" => {
                let outcome = ev
                    .payload
                    .get("outcome")
                    .and_then(|v| v.as_str())
                    .unwrap_or("?");
                *self.outcomes.entry(outcome.to_string()).or_default() += 1;
                if outcome != "completed" && self.first_error.is_none() {
                    self.first_error = Some(format!("task {task}: {}", ev.payload));
                }
            }
            _ => {}
        }
    }
}

/// How often the collector drains the event feed. It polls rather than waits: a waiting
/// subscriber is woken by every commit's broadcast, and those wakeups (a futex call in the
/// store's thread, a context switch, often a preemption of the store) were the harness's own
/// cost inside the supervised measurement. Polling bounds the harness to one wakeup per
/// period whatever the rate, and adds at most one period to a round's measured time.
const COLLECT_EVERY: Duration = Duration::from_millis(2);

/// Follows the event feed until `n` tasks are done (or blocked). If the feed lags, falls back
/// to polling the status counts.
fn collect(mut feed: EventFeed, store: Store, n: usize, timeout: Duration) -> Collected {
    let deadline = Instant::now() + timeout;
    let mut c = Collected::default();
    'outer: while c.completed + c.blocked < n {
        match feed.try_recv() {
            Ok(ev) => c.note(&ev),
            Err(TryRecvError::Empty) => {
                if Instant::now() >= deadline {
                    c.timed_out = true;
                    break;
                }
                std::thread::sleep(COLLECT_EVERY);
            }
            Err(TryRecvError::Lagged(k)) => {
                c.lagged += k;
                loop {
                    if let Ok(counts) = store.read_blocking(|tx| tx.status_counts()) {
                        let done = counts.get("done").copied().unwrap_or(0) as usize;
                        let blocked = counts.get("blocked").copied().unwrap_or(0) as usize;
                        if done + blocked >= n {
                            c.completed = done;
                            c.blocked = blocked;
                            c.last_done = Some(Instant::now());
                            break 'outer;
                        }
                    }
                    if Instant::now() >= deadline {
                        c.timed_out = true;
                        break 'outer;
                    }
                    std::thread::sleep(COLLECT_EVERY);
                }
            }
            Err(TryRecvError::Closed) => break,
        }
    }
    c
}

struct SupervisedRound {
    elapsed: Duration,
    add_elapsed: Duration,
    add_errors: usize,
    c: Collected,
    /// CPU use per thread name while the round ran.
    cpu: String,
    /// Round trips (ms) of a `LiveWorkers` message through the dispatcher's mailbox, every
    /// 20 ms during the round: how long the actor thread takes to get to a message.
    ping_ms: Vec<f64>,
    /// Store ops and commits per lifecycle (the adds included), and the batches applied twice
    /// (an op failed after writing in the first attempt).
    store_work: (f64, f64, u64),
}

/// N `/bin/true` tasks added in one burst (N concurrent store calls → group commits),
/// measured from the first add to the last `completed` event.
fn supervised_round(opts: &Opts, dir: &Path) -> Result<SupervisedRound, String> {
    let n = opts.tasks;
    let mut cfg = base_config(dir, opts, opts.parallel);
    let mut a = AssigneeConfig::new(["/bin/true"]);
    a.max_in_progress = opts.parallel as u32;
    cfg.assignees.insert("true".into(), a);
    let sup = Supervisor::start(cfg).map_err(|e| format!("cannot start the supervisor: {e}"))?;
    let store = sup.services().store.clone();
    let feed = store.subscribe();
    let timeout = Duration::from_secs(60) + Duration::from_millis(20 * n as u64);
    let collector = {
        let store = store.clone();
        std::thread::spawn(move || collect(feed, store, n, timeout))
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let pinger = {
        let (services, stop) = (sup.services().clone(), stop.clone());
        std::thread::spawn(move || {
            let mut v = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                futures::executor::block_on(services.live_workers());
                v.push(t.elapsed().as_secs_f64() * 1e3);
                std::thread::sleep(Duration::from_millis(20));
            }
            v
        })
    };
    let ticks0 = thread_ticks();
    let stats0 = store.stats();
    let t0 = Instant::now();
    let adds = (0..n).map(|i| {
        let store = store.clone();
        async move {
            store
                .with_tx(move |tx, now| {
                    tx.create_task(
                        &NewTask::titled(format!("bench {i}")).for_assignee("true"),
                        now,
                    )
                })
                .await
        }
    });
    let results = futures::executor::block_on(futures::future::join_all(adds));
    let add_elapsed = t0.elapsed();
    let add_errors = results.iter().filter(|r| r.is_err()).count();
    let c = collector
        .join()
        .map_err(|_| "the event collector panicked".to_string())?;
    let cpu = thread_cpu_report(&ticks0, &thread_ticks(), t0.elapsed());
    let stats1 = store.stats();
    let per = |d: u64| d as f64 / n.max(1) as f64;
    let store_work = (
        per(stats1.ops - stats0.ops),
        per(stats1.batches - stats0.batches),
        stats1.retried - stats0.retried,
    );
    stop.store(true, Ordering::Relaxed);
    let ping_ms = pinger.join().unwrap_or_default();
    let elapsed = c
        .last_done
        .map(|t| t.duration_since(t0))
        .unwrap_or_else(|| t0.elapsed());
    sup.shutdown();
    Ok(SupervisedRound {
        elapsed,
        add_elapsed,
        add_errors,
        c,
        cpu,
        ping_ms,
        store_work,
    })
}

/// P threads, each spawning and waiting `/bin/true` until N have run.
fn baseline_round(n: usize, p: usize) -> Result<Duration, String> {
    let next = AtomicUsize::new(0);
    let errors = AtomicUsize::new(0);
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..p {
            s.spawn(|| {
                while next.fetch_add(1, Ordering::Relaxed) < n {
                    let ok = Command::new("/bin/true")
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .and_then(|mut c| c.wait())
                        .map(|s| s.success())
                        .unwrap_or(false);
                    if !ok {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let elapsed = t0.elapsed();
    match errors.load(Ordering::Relaxed) {
        0 => Ok(elapsed),
        e => Err(format!("baseline: {e} spawns of /bin/true failed")),
    }
}

/// Slot accounting from the timelines of one round (board timestamps, ms).
struct SlotProfile {
    claim_to_spawned: Vec<f64>,
    spawned_to_done: Vec<f64>,
    hold: Vec<f64>,
    span_ms: f64,
    retried: usize,
}

fn slot_profile(c: &Collected) -> SlotProfile {
    let mut p = SlotProfile {
        claim_to_spawned: Vec::new(),
        spawned_to_done: Vec::new(),
        hold: Vec::new(),
        span_ms: 0.0,
        retried: 0,
    };
    let (mut first, mut last) = (i64::MAX, i64::MIN);
    for tl in c.timelines.values() {
        if tl.claims > 1 {
            p.retried += 1;
        }
        if let (Some(cl), Some(sp), Some(done)) = (tl.claimed, tl.spawned, tl.completed) {
            p.claim_to_spawned.push((sp - cl) as f64);
            p.spawned_to_done.push((done - sp) as f64);
            p.hold.push((done - cl) as f64);
            first = first.min(cl);
            last = last.max(done);
        }
    }
    p.span_ms = (last - first).max(1) as f64;
    p
}

// ---------------------------------------------------------------------------------------------
// Micro-profile
// ---------------------------------------------------------------------------------------------

struct Profile {
    commit_ms: Vec<f64>,
    rw_spawn_us: Vec<f64>,
    plain_spawn_us: Vec<f64>,
    /// `Command::spawn` with runwarden's options (cwd, process group, log file, env).
    like_spawn_us: Vec<f64>,
    /// create_dir_all(cwd) + create_dir_all(logs) + open the log (append).
    files_us: Vec<f64>,
    /// PidFd::open + fingerprint (/proc/<pid>/stat).
    pidfd_fp_us: Vec<f64>,
    group_alive_us: f64,
    /// CPU time (this thread) of one `group_alive` call and one runwarden `spawn()`.
    group_alive_cpu_us: f64,
    rw_spawn_cpu_us: f64,
    /// `kill(-pgid, 0)`: the O(1) alternative (ESRCH = no member left).
    kill0_us: f64,
    /// One dispatch pass's reads (`ready_candidates_for` one assignee, 64 +
    /// `slot_holders_by_assignee`) on a board with N ready tasks.
    pass_read_us: f64,
    log_tail_us: f64,
    procs: usize,
}

/// What the per-lifecycle building blocks cost on this machine, measured alone (no supervisor
/// is running: its orphan sweep would steal these children's exit statuses). The variants are
/// interleaved per iteration so the machine's noise hits them alike.
/// CPU time consumed by the calling thread, ns.
fn thread_cpu_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

fn micro_profile(opts: &Opts, base: &Path) -> Result<Profile, String> {
    let dir = base.join("profile");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    const K: usize = 200;
    let e = |e: std::io::Error| e.to_string();

    let mut board = Board::open_with(
        &dir.join("commit.db"),
        OpenOptions {
            synchronous_full: opts.sync_full,
            read_only: false,
        },
    )
    .map_err(|e| e.to_string())?;
    let mut p = Profile {
        commit_ms: Vec::with_capacity(K),
        rw_spawn_us: Vec::with_capacity(K),
        plain_spawn_us: Vec::with_capacity(K),
        like_spawn_us: Vec::with_capacity(K),
        files_us: Vec::with_capacity(K),
        pidfd_fp_us: Vec::with_capacity(K),
        group_alive_us: 0.0,
        group_alive_cpu_us: 0.0,
        rw_spawn_cpu_us: 0.0,
        kill0_us: 0.0,
        pass_read_us: 0.0,
        log_tail_us: 0.0,
        procs: 0,
    };
    let us = |t: Instant| t.elapsed().as_secs_f64() * 1e6;
    let mut last_pid = 0;
    for i in 0..K {
        let t = Instant::now();
        board
            .write(|tx| tx.append_event(None, None, "bench", json!({ "i": i }), 0))
            .map_err(|e| e.to_string())?;
        p.commit_ms.push(us(t) / 1e3);

        // 1. The supervisor's spawn path: work dir, log file, clone3 + execve with a process
        //    group (the pidfd from the clone), fingerprint (/proc/<pid>/stat).
        let spec = SpawnSpec {
            run_id: i as i64,
            task_id: i as i64,
            token: "0123456789abcdef0123456789abcdef".into(),
            title: "profile".into(),
            argv: vec!["/bin/true".into()],
            env: BTreeMap::new(),
            cwd: dir.join("work").join(i.to_string()),
            own_cwd: true,
            socket: dir.join("control.sock"),
            log_path: dir.join("logs").join(format!("{i}.log")),
            log_max_bytes: 10 << 20,
            uid: None,
            gid: None,
            umask: None,
            rlimits: BTreeMap::new(),
        };
        let t = Instant::now();
        let c0 = thread_cpu_ns();
        let child = spawn::spawn(&spec).map_err(|e| e.to_string())?;
        p.rw_spawn_cpu_us += (thread_cpu_ns() - c0) as f64 / 1e3 / K as f64;
        p.rw_spawn_us.push(us(t));
        child
            .pidfd
            .wait_exit(Duration::from_secs(10))
            .map_err(|e| e.to_string())?;
        child.pidfd.try_reap().map_err(|e| e.to_string())?;
        process::owned::unregister(child.pid);

        // 2. The same through std's Command (posix_spawn; the supervisor's fallback where
        //    clone3 is refused), piece by piece.
        let t = Instant::now();
        let cwd = dir.join("work2").join(i.to_string());
        std::fs::create_dir_all(&cwd).map_err(e)?;
        std::fs::create_dir_all(dir.join("logs2")).map_err(e)?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("logs2").join(format!("{i}.log")))
            .map_err(e)?;
        let log_err = log.try_clone().map_err(e)?;
        p.files_us.push(us(t));
        let t = Instant::now();
        let mut child = Command::new("/bin/true")
            .current_dir(&cwd)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .env("RUNWARDEN_SOCKET", "x")
            .env("RUNWARDEN_TASK_ID", i.to_string())
            .env("RUNWARDEN_RUN_ID", i.to_string())
            .env("RUNWARDEN_RUN_TOKEN", "0123456789abcdef0123456789abcdef")
            .env("RUNWARDEN_TASK_TITLE", "profile")
            .spawn()
            .map_err(e)?;
        p.like_spawn_us.push(us(t));
        let pid = child.id() as i32;
        let t = Instant::now();
        let fd = process::PidFd::open(pid).map_err(|e| e.to_string())?;
        std::hint::black_box(process::fingerprint(pid).ok());
        p.pidfd_fp_us.push(us(t));
        drop(fd);
        child.wait().map_err(e)?;

        // 3. A plain spawn.
        let t = Instant::now();
        let mut child = Command::new("/bin/true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(e)?;
        p.plain_spawn_us.push(us(t));
        last_pid = child.id() as i32;
        child.wait().map_err(e)?;
    }

    // What asking whether a group has members costs by a scan of every /proc/<pid>/stat (the
    // way on kernels before 6.9) against the one syscall a worker's exit uses now.
    let t = Instant::now();
    let c0 = thread_cpu_ns();
    for _ in 0..K {
        std::hint::black_box(process::group_alive(last_pid));
    }
    p.group_alive_cpu_us = (thread_cpu_ns() - c0) as f64 / 1e3 / K as f64;
    p.group_alive_us = us(t) / K as f64;
    let t = Instant::now();
    for _ in 0..K {
        // SAFETY: signal 0 only probes; the group of a reaped child has no member left.
        std::hint::black_box(unsafe { libc::kill(-last_pid, 0) });
    }
    p.kill0_us = us(t) / K as f64;

    // The reads of one dispatch pass, on a board holding N ready tasks.
    let now = runwarden::board::now_millis();
    board
        .write(|tx| {
            for i in 0..opts.tasks {
                tx.create_task(
                    &NewTask::titled(format!("bench {i}")).for_assignee("true"),
                    now,
                )?;
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    let limit = (opts.parallel as u32).saturating_mul(4).max(64);
    let assignee = ["true".to_string()];
    let t = Instant::now();
    for _ in 0..K {
        board
            .read(|tx| {
                std::hint::black_box(tx.ready_candidates_for(now, &assignee, limit)?);
                std::hint::black_box(tx.slot_holders_by_assignee()?);
                Ok(())
            })
            .map_err(|e| e.to_string())?;
    }
    p.pass_read_us = us(t) / K as f64;
    let log = dir.join("logs").join("0.log");
    let t = Instant::now();
    for _ in 0..K {
        std::hint::black_box(spawn::log_tail(&log, 0, 400));
    }
    p.log_tail_us = us(t) / K as f64;
    p.procs = std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .is_some_and(|s| s.parse::<u32>().is_ok())
                })
                .count()
        })
        .unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(p)
}

// ---------------------------------------------------------------------------------------------
// Dispatch latency and reap precision
// ---------------------------------------------------------------------------------------------

fn probe_argv(probe: Probe) -> Result<Vec<String>, String> {
    Ok(match probe {
        Probe::SelfExe => vec![
            std::env::current_exe()
                .map_err(|e| format!("cannot find the bench binary: {e}"))?
                .display()
                .to_string(),
            "__probe".into(),
        ],
        Probe::Sh => vec![
            "/bin/sh".into(),
            "-c".into(),
            "read -r _ < /dev/null; date +%s%N > \"$OUT/$RUNWARDEN_TASK_ID\"".into(),
        ],
    })
}

fn read_ns(path: &Path) -> Option<i64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// Plain spawn of the probe → its recorded exec time: the floor under dispatch latency.
fn probe_floor(argv: &[String], out: &Path) -> Result<Vec<f64>, String> {
    let mut v = Vec::with_capacity(FLOOR_SAMPLES);
    for i in 0..FLOOR_SAMPLES {
        let id = format!("floor-{i}");
        let t = now_ns();
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .env("OUT", out)
            .env("RUNWARDEN_TASK_ID", &id)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot spawn the probe: {e}"))?;
        child.wait().map_err(|e| e.to_string())?;
        let exec =
            read_ns(&out.join(&id)).ok_or_else(|| format!("probe wrote nothing for {id}"))?;
        v.push((exec - t) as f64 / 1e6);
    }
    Ok(v)
}

struct Latency {
    total_ms: Vec<f64>,
    commit_ms: Vec<f64>,
    to_claim_ms: Vec<f64>,
    claim_to_exec_ms: Vec<f64>,
    missing: usize,
}

fn dispatch_latency(sup: &SupervisorHandle, opts: &Opts, out: &Path) -> Result<Latency, String> {
    let mut adds = Vec::with_capacity(opts.latency_samples);
    for i in 0..opts.latency_samples {
        let t_add = now_ns();
        let id = sup
            .add_task(NewTask::titled(format!("probe {i}")).for_assignee("probe"))
            .map_err(|e| format!("add_task: {e}"))?
            .id;
        let t_ret = now_ns();
        adds.push((id, t_add, t_ret));
        std::thread::sleep(opts.latency_gap);
    }
    let mut l = Latency {
        total_ms: Vec::new(),
        commit_ms: Vec::new(),
        to_claim_ms: Vec::new(),
        claim_to_exec_ms: Vec::new(),
        missing: 0,
    };
    for &(id, t_add, t_ret) in &adds {
        let task = sup
            .wait_for(id, Duration::from_secs(30))
            .map_err(|e| format!("task {id}: {e}"))?;
        let Some(exec) = read_ns(&out.join(id.to_string())) else {
            l.missing += 1;
            continue;
        };
        if task.status != TaskStatus::Done {
            l.missing += 1;
        }
        l.total_ms.push((exec - t_add) as f64 / 1e6);
        l.commit_ms.push((t_ret - t_add) as f64 / 1e6);
        if let Some(run) = sup.task(id).ok().and_then(|d| d.runs.first().cloned()) {
            l.to_claim_ms
                .push(run.started_at as f64 - t_add as f64 / 1e6);
            l.claim_to_exec_ms
                .push(exec as f64 / 1e6 - run.started_at as f64);
        }
    }
    Ok(l)
}

/// The `sleep 300` workers seen in the reap phase; any still alive at the end is killed by pid
/// (after checking it is still the process we saw spawned).
#[derive(Default)]
struct HangGuard {
    pids: Vec<(i32, u64)>,
}

fn alive_same(pid: i32, ticks: u64) -> bool {
    process::read_stat(pid).is_ok_and(|st| !st.is_zombie() && st.start_ticks == ticks)
}

impl HangGuard {
    fn kill_leftovers(&mut self) -> usize {
        let mut killed = 0;
        for (pid, ticks) in self.pids.drain(..) {
            if alive_same(pid, ticks) {
                // SAFETY: plain syscalls on a pid verified (start time) to be our worker.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                killed += 1;
            }
        }
        killed
    }
}

impl Drop for HangGuard {
    fn drop(&mut self) {
        let n = self.kill_leftovers();
        if n > 0 {
            eprintln!("bench: killed {n} leftover sleep workers");
        }
    }
}

struct Reap {
    precision_ms: Vec<f64>,
    failures: Vec<String>,
}

fn spawned_from_board(sup: &SupervisorHandle, id: TaskId) -> Option<(i32, u64)> {
    let run = sup.task(id).ok()?.runs.last().cloned()?;
    let fp = run.fingerprint()?;
    Some((run.worker_pid? as i32, fp.start_ticks))
}

fn reap_precision(
    sup: &SupervisorHandle,
    opts: &Opts,
    rt: &Runtime,
    guard: &mut HangGuard,
) -> Result<Reap, String> {
    let grace_ms = opts.grace.as_secs_f64() * 1e3;
    let mut r = Reap {
        precision_ms: Vec::new(),
        failures: Vec::new(),
    };
    let mut left = opts.reap_samples;
    let mut seq = 0;
    while left > 0 {
        let b = left.min(REAP_BATCH);
        left -= b;
        let mut feed = sup.services().store.subscribe();
        let mut ids = Vec::with_capacity(b);
        for _ in 0..b {
            seq += 1;
            ids.push(
                sup.add_task(NewTask::titled(format!("hang {seq}")).for_assignee("hang"))
                    .map_err(|e| format!("add_task: {e}"))?
                    .id,
            );
        }
        // Wait for each worker's pid (and fingerprint) from its worker_spawned event.
        let mut spawned: HashMap<TaskId, (i32, u64)> = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        while spawned.len() < ids.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("reap: workers did not spawn within 15 s".into());
            }
            match recv(rt, &mut feed, left.min(Duration::from_millis(200))) {
                Recv::Ev(ev) if ev.kind == "worker_spawned" => {
                    if let (Some(t), Some(pid), Some(ticks)) = (
                        ev.task_id.filter(|t| ids.contains(t)),
                        ev.payload.get("pid").and_then(|v| v.as_i64()),
                        ev.payload.get("start_ticks").and_then(|v| v.as_u64()),
                    ) {
                        spawned.insert(t, (pid as i32, ticks));
                    }
                }
                Recv::Ev(_) => {}
                Recv::Lagged | Recv::Timeout | Recv::Closed => {
                    for &id in &ids {
                        if let Some(w) = spawned_from_board(sup, id) {
                            spawned.insert(id, w);
                        }
                    }
                }
            }
        }
        guard.pids.extend(spawned.values().copied());
        for &id in &ids {
            sup.complete(id, None)
                .map_err(|e| format!("complete {id}: {e}"))?;
        }
        // Poll each worker's liveness every millisecond until it is dead (gone or a zombie).
        let mut pending: Vec<(TaskId, i32, u64)> = ids
            .iter()
            .map(|id| (*id, spawned[id].0, spawned[id].1))
            .collect();
        let mut death: HashMap<TaskId, i64> = HashMap::new();
        let deadline = Instant::now() + opts.grace + Duration::from_secs(20);
        while !pending.is_empty() && Instant::now() < deadline {
            pending.retain(|&(id, pid, ticks)| {
                if alive_same(pid, ticks) {
                    true
                } else {
                    death.insert(id, now_ns());
                    false
                }
            });
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        for (id, pid, _) in pending {
            r.failures.push(format!(
                "task {id}: worker {pid} still alive {:?} after close",
                opts.grace + Duration::from_secs(20)
            ));
        }
        for &id in &ids {
            let Some(&died) = death.get(&id) else {
                continue;
            };
            let ended_at = sup
                .task(id)
                .ok()
                .and_then(|d| d.runs.last().and_then(|run| run.ended_at));
            match ended_at {
                Some(ended) => r
                    .precision_ms
                    .push(died as f64 / 1e6 - ended as f64 - grace_ms),
                None => r.failures.push(format!("task {id}: run has no ended_at")),
            }
        }
    }
    Ok(r)
}

struct ProbeResults {
    floor_ms: Vec<f64>,
    latency: Option<Latency>,
    reap: Option<Reap>,
    leftovers: usize,
}

fn probe_phase(opts: &Opts, base: &Path, rt: &Runtime) -> Result<ProbeResults, String> {
    let dir = base.join("probe");
    let out = dir.join("probe-out");
    std::fs::create_dir_all(&out).map_err(|e| e.to_string())?;
    let argv = probe_argv(opts.probe)?;
    // Before the supervisor starts: its orphan sweep would reap these children under us.
    let floor_ms = if opts.skip_latency {
        Vec::new()
    } else {
        probe_floor(&argv, &out)?
    };

    let mut cfg = base_config(&dir, opts, opts.parallel + REAP_BATCH);
    let mut probe = AssigneeConfig::new(argv);
    probe.max_in_progress = opts.parallel as u32;
    probe.env.insert("OUT".into(), out.display().to_string());
    cfg.assignees.insert("probe".into(), probe);
    let mut hang = AssigneeConfig::new(["sleep", "300"]);
    hang.max_in_progress = REAP_BATCH as u32;
    cfg.assignees.insert("hang".into(), hang);

    let mut guard = HangGuard::default();
    let sup = Supervisor::start(cfg).map_err(|e| format!("cannot start the supervisor: {e}"))?;
    let latency = if opts.skip_latency {
        None
    } else {
        Some(dispatch_latency(&sup, opts, &out))
    };
    let reap = if opts.skip_reap || opts.reap_samples == 0 {
        None
    } else {
        Some(reap_precision(&sup, opts, rt, &mut guard))
    };
    sup.shutdown();
    let leftovers = guard.kill_leftovers();
    Ok(ProbeResults {
        floor_ms,
        latency: latency.transpose()?,
        reap: reap.transpose()?,
        leftovers,
    })
}

// ---------------------------------------------------------------------------------------------
// The scenario
// ---------------------------------------------------------------------------------------------

pub fn run(opts: &Opts, base: &Path, summary: &mut Summary) -> Result<(), String> {
    let (n, p) = (opts.tasks, opts.parallel);
    let sync = if opts.sync_full { "full" } else { "normal" };
    println!(
        "\n== lifecycle: N={n} /bin/true tasks, P={p}, sync={sync}, {} alternating rounds ==",
        opts.rounds
    );
    let rt = runtime();
    let mut sup_rates = Vec::new();
    let mut base_rates = Vec::new();
    // CPU per run (µs, own + children) of each round: what the rates are made of.
    let mut base_cpu = Vec::new();
    let mut sup_cpu = Vec::new();
    let mut non_completed = 0usize;
    let mut notes: Vec<String> = Vec::new();
    let mut profiles: Vec<(f64, SlotProfile, String)> = Vec::new();
    for round in 0..opts.rounds {
        // Alternate which goes first so drift on the shared machine hits both alike.
        let baseline_first = round % 2 == 0;
        for step in 0..2 {
            if (step == 0) == baseline_first {
                let cpu0 = cpu_us();
                let d = baseline_round(n, p)?;
                let (own, kids) = cpu_per_run(cpu0, cpu_us(), n);
                let rate = n as f64 / d.as_secs_f64();
                println!(
                    "round {round}: baseline   {rate:8.0} spawns/s     ({n} in {:.3}s; cpu per spawn: {own:.0} µs spawner + {kids:.0} µs child)",
                    d.as_secs_f64()
                );
                base_rates.push(rate);
                base_cpu.push(own + kids);
            } else {
                let dir: PathBuf = base.join(format!("lifecycle-{round}"));
                // The round's directory stays until the bench ends: on an ext4 without a
                // journal (this VM's disk), inodes freed in the last minutes are skipped one by
                // one when new ones are allocated, so deleting 2 N files here would tax the
                // next round's file creation (seen: 0.03 ms → 0.6–1 ms per file).
                let cpu0 = cpu_us();
                let r = supervised_round(opts, &dir)?;
                let (own, kids) = cpu_per_run(cpu0, cpu_us(), r.c.completed);
                sup_cpu.push(own + kids);
                let rate = r.c.completed as f64 / r.elapsed.as_secs_f64();
                let sp = slot_profile(&r.c);
                println!(
                    "round {round}: supervised {rate:8.0} lifecycles/s ({} done, {} blocked in {:.3}s; burst of {n} adds committed in {:.0} ms{})",
                    r.c.completed,
                    r.c.blocked,
                    r.elapsed.as_secs_f64(),
                    r.add_elapsed.as_secs_f64() * 1e3,
                    if r.add_errors > 0 {
                        format!(", {} add errors", r.add_errors)
                    } else {
                        String::new()
                    }
                );
                println!(
                    "          slot: claim→worker_spawned {} ms | worker_spawned→completed {} ms | hold p50 {:.1} ms; busy slots {:.2}/{p}; {} events{}",
                    p50_p99(&sp.claim_to_spawned),
                    p50_p99(&sp.spawned_to_done),
                    median(&sp.hold),
                    sp.hold.iter().sum::<f64>() / sp.span_ms,
                    r.c.events,
                    if r.c.lagged > 0 {
                        format!(", feed lagged by {}", r.c.lagged)
                    } else {
                        String::new()
                    }
                );
                println!(
                    "          cpu: {} | per lifecycle: {own:.0} µs supervisor + {kids:.0} µs worker, {:.2} store ops in {:.2} commits ({} applied twice)",
                    r.cpu, r.store_work.0, r.store_work.1, r.store_work.2
                );
                println!(
                    "          actor-thread ping RTT ms: {} (n={})",
                    p50_p99(&r.ping_ms),
                    r.ping_ms.len()
                );
                let bad: usize =
                    r.c.outcomes
                        .iter()
                        .filter(|(k, _)| k.as_str() != "completed")
                        .map(|(_, v)| v)
                        .sum();
                if bad > 0 || sp.retried > 0 || r.c.timed_out || r.c.blocked > 0 {
                    let msg = format!(
                        "round {round}: run outcomes {:?}, {} tasks retried, timed out: {}; first: {}",
                        r.c.outcomes,
                        sp.retried,
                        r.c.timed_out,
                        r.c.first_error.as_deref().unwrap_or("-")
                    );
                    println!("          WARNING {msg}");
                    notes.push(msg);
                }
                non_completed += bad;
                if r.c.timed_out {
                    return Err(format!(
                        "round {round}: only {} of {n} tasks done before the timeout",
                        r.c.completed
                    ));
                }
                sup_rates.push(rate);
                profiles.push((
                    rate,
                    sp,
                    format!(
                        "{} | actor-thread ping RTT ms {}",
                        r.cpu,
                        p50_p99(&r.ping_ms)
                    ),
                ));
            }
        }
    }
    let (sm, bm) = (median(&sup_rates), median(&base_rates));
    let ratio = sm / bm;
    let verdict = summary.verdict(ratio >= TARGET_RATIO);
    println!(
        "lifecycle: supervised median {sm:.0}/s, baseline median {bm:.0}/s, ratio {ratio:.3} (target ≥ {TARGET_RATIO}) {verdict}"
    );
    summary.line(format!(
        "lifecycle: N={n} P={p} rounds={} sync={sync} supervised_median={sm:.0}/s baseline_median={bm:.0}/s ratio={ratio:.3} target>={TARGET_RATIO} {verdict}",
        opts.rounds
    ));
    let list = |v: &[f64]| {
        v.iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(",")
    };
    summary.line(format!(
        "lifecycle.rounds: supervised=[{}] baseline=[{}] non_completed_runs={non_completed}",
        list(&sup_rates),
        list(&base_rates)
    ));
    // What each run costs the machine, whatever the scheduling: with both cores busy the rate
    // ratio tends to this CPU ratio.
    let (sc, bc) = (median(&sup_cpu), median(&base_cpu));
    summary.line(format!(
        "lifecycle.cpu_per_run: supervised={sc:.0}us (supervisor + worker) baseline={bc:.0}us (spawner + child) cpu_ratio={:.3} | supervised=[{}] baseline=[{}]",
        bc / sc,
        list(&sup_cpu),
        list(&base_cpu)
    ));
    // The slot profile of the median supervised round.
    profiles.sort_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((_, sp, cpu)) = profiles.get(profiles.len() / 2) {
        let cycle = p as f64 * sp.span_ms / sp.hold.len().max(1) as f64;
        summary.line(format!(
            "lifecycle.slot(median round): claim→spawn_rec p50={:.1}ms spawn_rec→done p50={:.1}ms hold mean={:.1}ms slot_cycle={:.1}ms (idle gap {:.1}ms) busy_slots={:.2}/{p}",
            median(&sp.claim_to_spawned),
            median(&sp.spawned_to_done),
            mean(&sp.hold),
            cycle,
            cycle - mean(&sp.hold),
            sp.hold.iter().sum::<f64>() / sp.span_ms,
        ));
        summary.line(format!("lifecycle.cpu(median round): {cpu}"));
    }
    for n in notes {
        summary.line(format!("lifecycle.warning: {n}"));
    }

    if !opts.skip_profile {
        let pr = micro_profile(opts, base)?;
        let line = format!(
            "lifecycle.profile: commit({sync}) p50={:.2}ms p99={:.2}ms | runwarden spawn() p50={:.0}us p99={:.0}us cpu={:.0}us; through std: files {:.0} (p99 {:.0}) + Command::spawn(cwd,pgroup,log,env) {:.0} + pidfd+fingerprint {:.0} (plain Command::spawn p50={:.0}us p99={:.0}us) | group_alive={:.0}us/call cpu={:.0}us ({} procs) vs kill(-pgid,0)={:.1}us | pass reads={:.0}us | log_tail={:.0}us",
            percentile(&pr.commit_ms, 50.0),
            percentile(&pr.commit_ms, 99.0),
            percentile(&pr.rw_spawn_us, 50.0),
            percentile(&pr.rw_spawn_us, 99.0),
            pr.rw_spawn_cpu_us,
            percentile(&pr.files_us, 50.0),
            percentile(&pr.files_us, 99.0),
            percentile(&pr.like_spawn_us, 50.0),
            percentile(&pr.pidfd_fp_us, 50.0),
            percentile(&pr.plain_spawn_us, 50.0),
            percentile(&pr.plain_spawn_us, 99.0),
            pr.group_alive_us,
            pr.group_alive_cpu_us,
            pr.procs,
            pr.kill0_us,
            pr.pass_read_us,
            pr.log_tail_us,
        );
        println!("{line}");
        summary.line(line);
    }

    if !(opts.skip_latency && opts.skip_reap) {
        let pr = probe_phase(opts, base, &rt)?;
        if let Some(l) = &pr.latency {
            let probe = match opts.probe {
                Probe::SelfExe => "self",
                Probe::Sh => "sh",
            };
            let line = format!(
                "dispatch_latency_ms (add→exec, n={}, probe={probe}, gap={}ms): {} | floor (plain spawn→exec) {} | split p50: add_commit={:.2} add→claim_batch={:.2} claim_batch→exec={:.2}{}",
                l.total_ms.len(),
                opts.latency_gap.as_millis(),
                p50_p99(&l.total_ms),
                p50_p99(&pr.floor_ms),
                percentile(&l.commit_ms, 50.0),
                percentile(&l.to_claim_ms, 50.0),
                percentile(&l.claim_to_exec_ms, 50.0),
                if l.missing > 0 {
                    format!(" | {} MISSING", l.missing)
                } else {
                    String::new()
                }
            );
            println!("{line}");
            summary.line(line);
        }
        if let Some(r) = &pr.reap {
            let line = format!(
                "reap_precision_ms (death − ended_at − grace, n={}, grace={}ms): {} min={:.2} | leftover workers killed by bench: {}{}",
                r.precision_ms.len(),
                opts.grace.as_millis(),
                p50_p99(&r.precision_ms),
                percentile(&r.precision_ms, 0.0),
                pr.leftovers,
                if r.failures.is_empty() {
                    String::new()
                } else {
                    format!(" | FAILURES: {}", r.failures.join("; "))
                }
            );
            println!("{line}");
            summary.line(line);
        }
    }
    Ok(())
}
