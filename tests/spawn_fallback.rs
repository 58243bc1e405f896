//! Where the kernel (before 5.5) or a seccomp filter refuses `clone3`, workers start through
//! std's fork and exec with the same contract: each variable once (the run's, the assignee's,
//! the supervisor's), stdin from /dev/null, stdout and stderr on the task's log, its own
//! session and process group, its task's work dir, the normal scheduling policy. The refusal is forced by a process-wide hook: this file
//! is its own test binary.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::fs;

use common::lifecycle::{sh_assignee, task_for};
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::TaskStatus;

#[test]
fn a_worker_started_without_clone3_gets_the_same_start() {
    runwarden::process::clone_exec::refuse_clone3();
    assert!(!runwarden::process::clone_exec::available());
    let td = TestDir::new();
    let mut config = lib_config(&td);
    let mut w = sh_assignee(
        "env > env.txt; readlink /proc/$$/fd/0 > stdin.txt; cat /proc/$$/stat > stat.txt; \
         pwd > cwd.txt; echo logged",
    );
    w.env.insert("FROM_CONFIG".into(), "yes".into());
    config.assignees.insert("w".into(), w);
    let sup = Supervisor::start(config).expect("start");
    let id = sup
        .add_task(task_for("fallback", "w"))
        .expect("add task")
        .id;
    let done = sup.wait_for(id, SETTLE).expect("the task ends");
    assert_eq!(done.status, TaskStatus::Done, "{:?}", sup.task(id));
    let run = sup.task(id).expect("task").runs.remove(0);
    let work = td.data_dir().join("work").join(id.to_string());
    let read = |name: &str| fs::read_to_string(work.join(name)).unwrap_or_default();

    let mut env = BTreeMap::new();
    for line in read("env.txt").lines() {
        if let Some((key, value)) = line.split_once('=') {
            assert!(
                env.insert(key.to_string(), value.to_string()).is_none(),
                "{key} is set twice"
            );
        }
    }
    assert_eq!(env.get("RUNWARDEN_TASK_ID"), Some(&id.to_string()));
    assert_eq!(env.get("RUNWARDEN_RUN_ID"), Some(&run.id.to_string()));
    assert_eq!(env.get("RUNWARDEN_RUN_TOKEN"), Some(&run.token));
    assert_eq!(env.get("FROM_CONFIG").map(String::as_str), Some("yes"));
    assert_eq!(read("stdin.txt").trim(), "/dev/null");
    assert_eq!(read("cwd.txt").trim(), work.display().to_string());
    // Field 5 of /proc/<pid>/stat (after the comm in parentheses) is the process group.
    let stat = read("stat.txt");
    let (pid, rest) = stat.split_once(" (").expect("stat");
    let fields: Vec<&str> = rest.rsplit_once(") ").expect("stat").1.split(' ').collect();
    assert_eq!(
        fields.get(2),
        Some(&pid),
        "the worker leads its own group: {stat}"
    );
    // Field 6 is the session: its own too, as the clone3 start gives.
    assert_eq!(
        fields.get(3),
        Some(&pid),
        "the worker leads its own session: {stat}"
    );
    // The normal scheduling policy (0), though its spawner runs SCHED_BATCH.
    let policy = runwarden::process::parse_stat(&stat).expect("stat").policy;
    assert_eq!(policy, Some(0), "the worker's scheduling policy: {stat}");
    let log = fs::read_to_string(td.data_dir().join("logs").join(format!("{id}.log")));
    assert_eq!(log.expect("the log").trim(), "logged");
    sup.shutdown();
}
