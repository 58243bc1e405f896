//! Supervisor-wide commands: status, reap, shutdown, completions.

use clap::CommandFactory;

use super::output::{Cell, Out, Table, duration, line, status_colour};
use super::{Cli, CliError, connect};
use crate::board::TaskStatus;

/// `runwarden status` (`--json`: pid, version, uptime, paths, live workers, counts).
pub fn status(cli: &Cli, out: Out) -> Result<(), CliError> {
    let s = connect(cli)?.status()?;
    if out.json {
        return out.json(&s);
    }
    line(&format!(
        "supervisor  pid {}, runwarden {} (protocol {}), up {}",
        s.pid,
        s.version,
        s.protocol,
        duration(s.uptime_ms as i64)
    ))?;
    line(&format!("data dir    {}", s.data_dir.display()))?;
    line(&format!("socket      {}", s.socket.display()))?;
    let counts: Vec<String> = TaskStatus::ALL
        .iter()
        .map(|st| {
            let n = s.counts.get(st.as_str()).copied().unwrap_or(0);
            let text = format!("{st} {n}");
            if n > 0 {
                out.paint(&text, status_colour(*st))
            } else {
                text
            }
        })
        .collect();
    line(&format!("tasks       {}", counts.join("  ")))?;
    for (name, n) in &s.unconfigured_assignees {
        line(&format!(
            "waiting     {n} for assignee `{}`, which the config does not have (they run once it is configured again)",
            super::output::short(name, 60)
        ))?;
    }
    line(&format!("events      {} (last id)", s.last_event_id))?;
    if s.live_workers.is_empty() {
        return line("workers     none running");
    }
    line(&format!("workers     {} running", s.live_workers.len()))?;
    let mut table = Table::new(&["RUN", "TASK", "PID"]);
    for w in &s.live_workers {
        table.row(vec![
            w.run_id.to_string().into(),
            w.task_id.to_string().into(),
            Cell::from(w.pid.map_or("starting".into(), |p| p.to_string())),
        ]);
    }
    table.print(&out, "  ")
}

/// `runwarden reap`.
pub fn reap(cli: &Cli, out: Out) -> Result<(), CliError> {
    let r = connect(cli)?.reap_now()?;
    if out.json {
        return out.json(&r);
    }
    line(&format!(
        "reaper sweep started; {} closed run(s) have a worker scheduled to be ended",
        r.pending
    ))
}

/// `runwarden shutdown`.
pub fn shutdown(cli: &Cli, out: Out) -> Result<(), CliError> {
    let mut client = connect(cli)?;
    let pid = client.status()?.pid;
    let r = client.shutdown()?;
    if out.json {
        return out.json(&serde_json::json!({ "stopping": r.stopping, "pid": pid }));
    }
    line(&format!("supervisor (pid {pid}) is stopping"))
}

/// `runwarden completions SHELL`.
pub fn completions(shell: clap_complete::Shell) -> Result<(), CliError> {
    let mut cmd = Cli::command();
    // Into a buffer first: generate() panics on a failed write (a full disk, a closed pipe),
    // where `line` reports it in one line.
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut cmd, "runwarden", &mut script);
    let script = String::from_utf8_lossy(&script);
    line(script.trim_end_matches('\n'))
}
