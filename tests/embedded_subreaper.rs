//! An embedded supervisor makes its host process a child subreaper while it runs, and puts it
//! back as it was once the last supervisor of the process has stopped: a host that outlives
//! its supervisors does not keep adopting orphans that nobody reaps. (One test: the state is
//! the whole process's.)

#[allow(dead_code)]
mod common;

use common::proc_guard::wait_until;
use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::NewTask;
use runwarden::config::AssigneeConfig;
use runwarden::process::read_stat;

fn is_subreaper() -> bool {
    rustix::process::child_subreaper()
        .expect("prctl(PR_GET_CHILD_SUBREAPER)")
        .is_some()
}

fn set_subreaper(on: bool) {
    rustix::process::set_child_subreaper(on.then(rustix::process::getpid))
        .expect("prctl(PR_SET_CHILD_SUBREAPER)");
}

#[test]
fn the_host_is_a_subreaper_while_a_supervisor_runs_and_as_it_was_after() {
    assert!(!is_subreaper(), "the test process starts as no subreaper");
    let (a_dir, b_dir) = (TestDir::new(), TestDir::new());
    let a = Supervisor::start(lib_config(&a_dir)).expect("start supervisor a");
    assert!(is_subreaper(), "a supervisor runs");
    let b = Supervisor::start(lib_config(&b_dir)).expect("start supervisor b");
    a.shutdown();
    assert!(is_subreaper(), "supervisor b still runs");
    b.shutdown();
    assert!(!is_subreaper(), "no supervisor runs any more");

    // With the option off, the process is left alone.
    let mut config = lib_config(&a_dir);
    config.supervisor.subreaper = false;
    let off = Supervisor::start(config).expect("start a supervisor without subreaper");
    assert!(!is_subreaper(), "subreaper = false");
    off.shutdown();

    // Descendants adopted while it was one and ended at the shutdown are not left behind as the
    // host's zombies: a double fork leaves an escapee, re-parented to this process.
    let out = a_dir.path().join("escapee.pid");
    let mut config = lib_config(&a_dir);
    let mut w = AssigneeConfig::new([
        "sh",
        "-c",
        "(setsid sleep 300 & echo $! > \"$OUT\"); exec sleep 300",
    ]);
    w.env.insert("OUT".into(), out.display().to_string());
    config.assignees.insert("w".into(), w);
    let d = Supervisor::start(config).expect("start supervisor d");
    d.add_task(NewTask::titled("escapes").for_assignee("w"))
        .expect("add a task");
    let me = std::process::id() as i32;
    let mut escapee = 0;
    assert!(
        wait_until(SETTLE, || {
            escapee = std::fs::read_to_string(&out)
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(0);
            escapee > 0 && read_stat(escapee).is_ok_and(|st| st.ppid == me)
        }),
        "no escapee re-parented to this process"
    );
    d.shutdown();
    assert!(!is_subreaper());
    assert!(
        read_stat(escapee).is_err_and(|e| e.is_no_such_process()),
        "the escapee is gone, its zombie collected: {:?}",
        read_stat(escapee)
    );

    // A host that was a subreaper of its own accord stays one.
    set_subreaper(true);
    let c = Supervisor::start(lib_config(&b_dir)).expect("start supervisor c");
    c.shutdown();
    assert!(is_subreaper(), "the host's own setting is kept");
    set_subreaper(false);
}
