//! Embedding runwarden: start a supervisor in-process on a temporary directory, add a few
//! tasks whose workers are shell commands, wait for them, and print each task's runs and
//! events.
//!
//! Run: `cargo run --example embedded`

use std::time::Duration;

use runwarden::Supervisor;
use runwarden::board::NewTask;
use runwarden::config::{AssigneeConfig, Config};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("runwarden-embedded-{}", std::process::id()));
    let mut config = Config::with_data_dir(&dir);
    config.reaper.grace = Duration::from_millis(500);
    // A worker that succeeds by exiting 0 (on_exit_zero = "complete" is the default).
    let mut shell = AssigneeConfig::new([
        "sh",
        "-c",
        "echo \"working on $RUNWARDEN_TASK_TITLE\"; sleep 0.2",
    ]);
    shell.max_in_progress = 2;
    config.assignees.insert("shell".into(), shell);
    // A worker that fails: its task is retried, then blocked.
    let mut flaky = AssigneeConfig::new(["sh", "-c", "echo giving up >&2; exit 3"]);
    flaky.max_retries = Some(1);
    config.assignees.insert("flaky".into(), flaky);
    config.retries.backoff = Duration::from_millis(100);

    let supervisor = Supervisor::start(config)?;
    let mut ids = Vec::new();
    for title in ["fetch sources", "build", "write report"] {
        ids.push(
            supervisor
                .add_task(NewTask::titled(title).for_assignee("shell"))?
                .id,
        );
    }
    ids.push(
        supervisor
            .add_task(NewTask::titled("doomed").for_assignee("flaky"))?
            .id,
    );

    for id in ids {
        let task = supervisor.wait_for(id, Duration::from_secs(30))?;
        let detail = supervisor.task(id)?;
        println!("task {} {:?}: {}", task.id, task.title, task.status);
        for run in &detail.runs {
            println!(
                "  run {} attempt {}: {} (pid {:?}, exit code {:?}) {}",
                run.id,
                run.attempt,
                run.outcome.map(|o| o.as_str()).unwrap_or("open"),
                run.spawned_pid,
                run.exit_code,
                run.error.as_deref().unwrap_or("")
            );
        }
        let kinds: Vec<&str> = detail.events.iter().map(|e| e.kind.as_str()).collect();
        println!("  events: {}", kinds.join(", "));
    }
    supervisor.shutdown();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
