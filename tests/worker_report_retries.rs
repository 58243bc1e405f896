//! A worker's reports ride out supervisor restarts. With `shutdown = "leave"` a worker keeps
//! running, and its run stays current, across a restart; every `runwarden heartbeat` it sends
//! meanwhile must land — whether it found no socket, a socket nobody accepts on, or a
//! connection accepted by a supervisor that was stopping and closed it unread.

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::control_daemon::{Daemon, SETTLE, command, run};
use common::proc_guard::wait_until;
use runwarden::board::NewTask;

/// A worker that saves its environment in its working directory, then waits.
const HOLDER: &str = r#"
[assignees.hold]
command = ["sh", "-c", "env | grep ^RUNWARDEN_ > env.tmp && mv env.tmp env && exec sleep 120"]
"#;

fn set_shutdown(d: &Daemon, from: &str, to: &str) {
    let text = std::fs::read_to_string(&d.config).unwrap();
    assert!(text.contains(from), "{text}");
    std::fs::write(&d.config, text.replace(from, to)).unwrap();
}

fn restart(d: &mut Daemon) {
    d.stop();
    d.child = Some(Daemon::spawn_serve(&d.config, &d.stderr));
    d.wait_ready();
}

#[test]
fn a_workers_heartbeats_all_land_across_supervisor_restarts() {
    let mut d = Daemon::start("", HOLDER);
    set_shutdown(&d, "shutdown = \"terminate\"", "shutdown = \"leave\"");
    restart(&mut d);
    let task = d
        .client()
        .add_task(&NewTask::titled("t").for_assignee("hold"))
        .unwrap()
        .id;
    let env_file = d.data_dir.join("work").join(task.to_string()).join("env");
    assert!(
        wait_until(SETTLE, || env_file.exists()),
        "worker never started"
    );
    let env: BTreeMap<String, String> = std::fs::read_to_string(&env_file)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();

    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let reporters: Vec<_> = (0..3)
        .map(|_| {
            let (stop, sent, failures, env) =
                (stop.clone(), sent.clone(), failures.clone(), env.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let mut cmd = command();
                    cmd.arg("heartbeat").envs(&env);
                    let out = run(cmd);
                    sent.fetch_add(1, Ordering::Relaxed);
                    if !out.status.success() {
                        let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
                        failures.lock().unwrap().push(err);
                    }
                }
            })
        })
        .collect();
    for _ in 0..4 {
        let before = sent.load(Ordering::Relaxed);
        // Reports are under way when the supervisor goes.
        assert!(wait_until(SETTLE, || sent.load(Ordering::Relaxed) > before + 3));
        restart(&mut d);
    }
    let before = sent.load(Ordering::Relaxed);
    assert!(wait_until(SETTLE, || sent.load(Ordering::Relaxed) > before + 3));
    stop.store(true, Ordering::Relaxed);
    for r in reporters {
        r.join().unwrap();
    }
    // The worker was left running on purpose: the last stop ends it.
    set_shutdown(&d, "shutdown = \"leave\"", "shutdown = \"terminate\"");
    restart(&mut d);
    d.stop();

    let failures = failures.lock().unwrap();
    assert!(
        failures.is_empty(),
        "{} of {} heartbeats were lost across restarts, e.g. {:?}",
        failures.len(),
        sent.load(Ordering::Relaxed),
        &failures[..failures.len().min(3)]
    );
}
