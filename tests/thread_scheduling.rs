//! `supervisor.scheduling`: under "batch" (the default) the supervisor's own threads — the
//! actor thread, the store's writer, the spawners — run under SCHED_BATCH and its workers under
//! the normal policy; under "normal" nothing is changed. Read from /proc, on a real `serve`
//! process and on a library supervisor.

#[allow(dead_code)]
mod common;

use std::fs;
use std::path::Path;

use common::proc_guard::wait_until;
use common::runtime::{
    SETTLE, Serve, TestDir, add_to_board, lib_config, wait_worker, wait_worker_in_board,
};
use runwarden::Supervisor;
use runwarden::board::NewTask;
use runwarden::config::AssigneeConfig;
use runwarden::process::{Pid, Signal, parse_stat};

const SCHED_OTHER: u32 = libc::SCHED_OTHER as u32;
const SCHED_BATCH: u32 = libc::SCHED_BATCH as u32;

/// The scheduling policy in a `/proc/.../stat` file (field 41).
fn policy_in(stat_path: &Path) -> Option<u32> {
    parse_stat(&fs::read_to_string(stat_path).ok()?)
        .ok()?
        .policy
}

/// Every thread of `pid`: (tid, comm, policy).
fn threads_of(pid: &str) -> Vec<(String, String, u32)> {
    let dir = Path::new("/proc").join(pid).join("task");
    fs::read_dir(&dir)
        .expect("list the threads")
        .filter_map(|e| {
            let path = e.ok()?.path();
            let tid = path.file_name()?.to_string_lossy().into_owned();
            let comm = fs::read_to_string(path.join("comm")).ok()?;
            Some((tid, comm.trim().to_string(), policy_in(&path.join("stat"))?))
        })
        .collect()
}

fn policy_of_process(pid: Pid) -> u32 {
    policy_in(&Path::new("/proc").join(pid.to_string()).join("stat"))
        .unwrap_or_else(|| panic!("cannot read the policy of {pid}"))
}

/// The policies of `pid`'s threads whose name starts with `prefix`; fails if there are none.
fn policies(threads: &[(String, String, u32)], prefix: &str) -> Vec<u32> {
    let found: Vec<u32> = threads
        .iter()
        .filter(|(_, comm, _)| comm.starts_with(prefix))
        .map(|(_, _, policy)| *policy)
        .collect();
    assert!(!found.is_empty(), "no thread named {prefix}*: {threads:?}");
    found
}

/// What `serve` ran: its threads, and the policies of a worker and of a hook.
struct Seen {
    pid: String,
    threads: Vec<(String, String, u32)>,
    worker: u32,
    hook: u32,
}

/// Starts `serve` with `supervisor_keys`, a `sleep` worker and a hook on its claim, and reads
/// the policies of the serve process's threads, the worker and the hook.
fn serve_policies(supervisor_keys: &str) -> Seen {
    let td = TestDir::new();
    let hook_stat = td.path().join("hook.stat");
    let config = td.write_config(
        &format!("tick = \"100ms\"\nshutdown = \"terminate\"\n{supervisor_keys}"),
        &format!(
            "[assignees.sleeper]\ncommand = [\"sleep\", \"300\"]\n\n\
             [[hooks]]\non = [\"claimed\"]\ncommand = [\"sh\", \"-c\", {:?}]\n",
            format!(
                "cat /proc/$$/stat > {}.new && mv {0}.new {0}",
                hook_stat.display()
            )
        ),
    );
    let db = td.db_path();
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &db);
    let id = add_to_board(&db, "sleeper");
    let (worker, _) = wait_worker_in_board(&db, id);
    let pid = serve.pid().to_string();
    // The store and spawner threads exist once a worker has been started.
    let threads = threads_of(&pid);
    let worker = policy_of_process(worker);
    assert!(
        wait_until(SETTLE, || hook_stat.exists()),
        "the hook did not run; serve's stderr:\n{}",
        serve.stderr()
    );
    let hook = policy_in(&hook_stat).expect("the hook's policy");
    serve.stop_cleanly(Signal::SIGTERM);
    Seen {
        pid,
        threads,
        worker,
        hook,
    }
}

#[test]
fn serve_runs_its_threads_under_sched_batch_and_its_workers_and_hooks_normally() {
    // The supervisor's threads are moved from the normal policy only.
    assert_eq!(
        own_policy(),
        SCHED_OTHER,
        "the harness runs under the normal policy"
    );
    let Seen {
        pid,
        threads,
        worker,
        hook,
    } = serve_policies("");
    let main = threads
        .iter()
        .find(|(tid, _, _)| *tid == pid)
        .expect("the main thread");
    assert_eq!(main.2, SCHED_BATCH, "the actor (main) thread: {threads:?}");
    assert_eq!(policies(&threads, "runwarden-store"), [SCHED_BATCH]);
    let spawners = policies(&threads, "runwarden-spawn");
    assert!(
        spawners.iter().all(|p| *p == SCHED_BATCH),
        "spawners: {threads:?}"
    );
    assert_eq!(
        worker, SCHED_OTHER,
        "a worker starts under the normal policy"
    );
    assert_eq!(hook, SCHED_OTHER, "a hook starts under the normal policy");
}

#[test]
fn scheduling_normal_leaves_every_thread_alone() {
    // Whatever the harness runs under, serve and what it starts inherit.
    let harness = own_policy();
    let seen = serve_policies("scheduling = \"normal\"");
    assert!(
        seen.threads.iter().all(|(_, _, p)| *p == harness),
        "{:?}",
        seen.threads
    );
    assert_eq!(seen.worker, harness);
    assert_eq!(seen.hook, harness);
}

/// This thread's policy.
fn own_policy() -> u32 {
    // SAFETY: gettid takes no arguments.
    let tid = unsafe { libc::gettid() };
    policy_in(
        &Path::new("/proc/self/task")
            .join(tid.to_string())
            .join("stat"),
    )
    .expect("own policy")
}

#[test]
fn run_batches_its_calling_thread_until_it_returns() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // No subreaper in this test process: it would reap other tests' serve children.
    config.supervisor.subreaper = false;
    let during = std::thread::spawn(move || {
        assert_eq!(
            own_policy(),
            SCHED_OTHER,
            "a host thread under the normal policy"
        );
        let during = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(u32::MAX));
        let seen = during.clone();
        // Stops as soon as it is up.
        runwarden::supervisor::run(
            config,
            move |_| seen.store(own_policy(), std::sync::atomic::Ordering::SeqCst),
            async {},
        )
        .expect("run");
        assert_eq!(own_policy(), SCHED_OTHER, "put back when run returned");
        during.load(std::sync::atomic::Ordering::SeqCst)
    })
    .join()
    .expect("the host thread");
    assert_eq!(during, SCHED_BATCH, "while it ran");
}

#[test]
fn an_embedded_supervisors_threads_are_batched_and_its_workers_are_not() {
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // No subreaper in this test process: it would reap other tests' serve children.
    config.supervisor.subreaper = false;
    config
        .assignees
        .insert("sleeper".into(), AssigneeConfig::new(["sleep", "300"]));
    let sup = Supervisor::start(config).expect("start the supervisor");
    let id = sup
        .add_task(NewTask::titled("sleep").for_assignee("sleeper"))
        .expect("add task")
        .id;
    let (worker, _) = wait_worker(&sup, id);
    let threads = threads_of("self");
    // "runwarden-supervisor", cut to the 15 bytes a thread name keeps. (Another test of this
    // file may be running a supervisor in this process too: all of them are checked.)
    for name in ["runwarden-super", "runwarden-store", "runwarden-spawn"] {
        assert!(
            policies(&threads, name).iter().all(|p| *p == SCHED_BATCH),
            "{name}: {threads:?}"
        );
    }
    assert_eq!(policy_of_process(worker), SCHED_OTHER);
    sup.shutdown();
}

/// What `chrt -a -f -p 1 <pid>` does: every thread of `pid` to SCHED_FIFO, priority 1. (A
/// real-time policy rather than SCHED_IDLE, which would starve the supervisor, and so the
/// test, on a loaded machine.)
fn all_threads_to_fifo(pid: &str) {
    let param = libc::sched_param { sched_priority: 1 };
    for (tid, _, _) in threads_of(pid) {
        let tid: libc::pid_t = tid.parse().expect("numeric tid");
        // SAFETY: a valid sched_param.
        if unsafe { libc::sched_setscheduler(tid, libc::SCHED_FIFO, &param) } != 0 {
            let e = std::io::Error::last_os_error();
            // A thread that has just exited is fine; anything else means no scenario.
            assert_eq!(
                e.raw_os_error(),
                Some(libc::ESRCH),
                "chrt -f thread {tid}: {e}"
            );
        }
    }
}

#[test]
fn a_policy_an_operator_sets_on_a_running_serve_is_kept_and_inherited() {
    let td = TestDir::new();
    let config = td.write_config(
        "tick = \"100ms\"\nshutdown = \"terminate\"",
        // One worker started by clone3, one through std (a umask to set).
        "[assignees.cloned]\ncommand = [\"sleep\", \"300\"]\n\n\
         [assignees.forked]\ncommand = [\"sleep\", \"300\"]\numask = \"022\"\n",
    );
    let db = td.db_path();
    let mut serve = Serve::start(&config, "serve");
    serve.wait_ready(&td.lock_path(), &db);
    let pid = serve.pid().to_string();
    assert!(
        wait_until(SETTLE, || {
            let threads = threads_of(&pid);
            ["runwarden-store", "runwarden-spawn"]
                .iter()
                .all(|name| threads.iter().any(|(_, comm, _)| comm.starts_with(name)))
        }),
        "serve's threads: {:?}",
        threads_of(&pid)
    );
    all_threads_to_fifo(&pid);
    let fifo = libc::SCHED_FIFO as u32;

    let cloned = add_to_board(&db, "cloned");
    let forked = add_to_board(&db, "forked");
    let (cloned, _) = wait_worker_in_board(&db, cloned);
    let (forked, _) = wait_worker_in_board(&db, forked);
    assert_eq!(
        policy_of_process(cloned),
        fifo,
        "a clone3 start inherits it"
    );
    assert_eq!(policy_of_process(forked), fifo, "a std start inherits it");
    let threads = threads_of(&pid);
    assert!(
        threads.iter().all(|(_, _, p)| *p == fifo),
        "no thread was batched again: {threads:?}"
    );
    serve.stop_cleanly(Signal::SIGTERM);
}
