//! The task commands: add, ls, show, runs, unblock, archive, reclaim, link, comment.

use std::time::Duration;

use clap::Args;

use super::output::{
    Cell, Out, Table, ago, duration, line, outcome_colour, printable, short, status_colour,
};
use super::{Cli, CliError, connect};
use crate::board;
use crate::board::{Event, NewTask, Run, Task, TaskDetail, TaskFilter, TaskId, TaskStatus};

/// `runwarden add`.
#[derive(Debug, Args)]
pub struct AddArgs {
    /// The task's title.
    pub title: String,
    /// Who runs it (an `[assignees.NAME]` of the config); without one it is never dispatched.
    #[arg(long, short)]
    pub assignee: Option<String>,
    /// Longer description.
    #[arg(long, short, default_value = "")]
    pub body: String,
    /// Higher runs first.
    #[arg(long, short, default_value_t = 0, allow_negative_numbers = true)]
    pub priority: i64,
    /// A task this one waits for (repeatable).
    #[arg(long = "parent", value_name = "ID", value_parser = super::task_id, allow_negative_numbers = true)]
    pub parents: Vec<TaskId>,
    /// Longest a run may take, e.g. "30m"; "0s" for no limit (default: the assignee's).
    #[arg(long, value_parser = max_runtime)]
    pub max_runtime: Option<Duration>,
    /// Failed runs retried before the task blocks (default: the assignee's).
    #[arg(long)]
    pub max_retries: Option<i64>,
    /// If an open task already has this key, print its id instead of adding another.
    #[arg(long)]
    pub idempotency_key: Option<String>,
}

/// `runwarden ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Only tasks in this status (todo, ready, running, blocked, done, archived).
    #[arg(long, short)]
    pub status: Option<TaskStatus>,
    /// Only tasks of this assignee.
    #[arg(long, short)]
    pub assignee: Option<String>,
    /// At most this many, newest first (default 1000, at most 10000).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=board::MAX_LIST_LIMIT as i64))]
    pub limit: Option<u32>,
}

/// `--max-runtime`: a duration the board takes (at most 100 years), said in the option's
/// terms rather than the protocol field's.
fn max_runtime(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d.as_millis() > board::MAX_RUNTIME_MS as u128 {
        return Err("at most 100 years (0s: no limit)".into());
    }
    Ok(d)
}

/// A `--max-runtime` in the protocol's whole milliseconds, rounded up: `500us` is a limit,
/// and 0 would mean none.
fn runtime_ms(d: Duration) -> i64 {
    let ms = d.as_nanos().div_ceil(1_000_000);
    i64::try_from(ms).unwrap_or(i64::MAX)
}

/// Adds a task and prints its id (`--json`: `{"id":…,"existed":…}`).
pub fn add(cli: &Cli, out: Out, args: &AddArgs) -> Result<(), CliError> {
    let new = NewTask {
        title: args.title.clone(),
        body: args.body.clone(),
        assignee: args.assignee.clone(),
        priority: args.priority,
        parents: args.parents.clone(),
        // In range (checked when parsed), so it cannot wrap into a negative number.
        max_runtime_ms: args.max_runtime.map(runtime_ms),
        max_retries: args.max_retries,
        idempotency_key: args.idempotency_key.clone(),
    };
    let created = connect(cli)?.add_task(&new)?;
    if out.json {
        return out.json(&created);
    }
    if created.existed {
        say!(
            "runwarden: an open task with this idempotency key already exists: {}",
            created.id
        );
    }
    line(&created.id.to_string())
}

/// Lists tasks (`--json`: an array of tasks).
pub fn ls(cli: &Cli, out: Out, args: &LsArgs) -> Result<(), CliError> {
    // Without --limit, one more than the default is asked for, so that a cut list says so.
    let default_cut = args.limit.is_none().then_some(board::DEFAULT_LIST_LIMIT);
    let filter = TaskFilter {
        status: args.status,
        assignee: args.assignee.clone(),
        limit: args.limit.or(default_cut.map(|n| n + 1)),
    };
    let reply = connect(cli)?.list_tasks_reply(&filter)?;
    let mut tasks = reply.tasks;
    // Notices go to stderr, so `--json` stays one array on stdout.
    if reply.truncated {
        say!(
            "runwarden: only the newest {} matching tasks fit in one reply; narrow with --status, --assignee or --limit",
            tasks.len()
        );
    } else if let Some(cut) = default_cut.filter(|&n| tasks.len() > n as usize) {
        tasks.truncate(cut as usize);
        say!(
            "runwarden: showing the newest {cut} matching tasks; there are more (--limit N, up to {}, or narrow with --status or --assignee)",
            board::MAX_LIST_LIMIT
        );
    }
    if out.json {
        return out.json(&tasks);
    }
    if tasks.is_empty() {
        return line("no tasks");
    }
    let mut table = Table::new(&["ID", "STATUS", "ASSIGNEE", "PRI", "UPDATED", "TITLE"]);
    for t in &tasks {
        table.row(vec![
            t.id.to_string().into(),
            Cell::coloured(t.status.as_str(), status_colour(t.status)),
            t.assignee.clone().unwrap_or_else(|| "-".into()).into(),
            t.priority.to_string().into(),
            ago(t.updated_at).into(),
            short(&t.title, 60).into(),
        ]);
    }
    table.print(&out, "")
}

/// Shows one task (`--json`: the task with `runs`, `events`, `comments`, `parents`, `children`).
pub fn show(cli: &Cli, out: Out, id: TaskId, events: u32) -> Result<(), CliError> {
    let detail = connect(cli)?.show_task(id, Some(events))?;
    if out.json {
        return out.json(&detail);
    }
    print_detail(&out, &detail)
}

fn print_detail(out: &Out, d: &TaskDetail) -> Result<(), CliError> {
    let t = &d.task;
    line(&format!(
        "task {}  {}  {}",
        t.id,
        out.paint(t.status.as_str(), status_colour(t.status)),
        short(&t.title, usize::MAX)
    ))?;
    let field = |name: &str, value: String| line(&format!("  {name:<12}{value}"));
    field("assignee", t.assignee.clone().unwrap_or_else(|| "-".into()))?;
    field("priority", t.priority.to_string())?;
    field("created", ago(t.created_at))?;
    field("updated", ago(t.updated_at))?;
    if let Some(at) = t.completed_at {
        field("completed", ago(at))?;
    }
    if !t.body.is_empty() {
        field("body", short(&t.body, 200))?;
    }
    if let Some(r) = &t.result {
        field("result", short(r, 200))?;
    }
    if let Some(r) = &t.block_reason {
        field("blocked", short(r, 200))?;
    }
    if t.consecutive_failures > 0 {
        field("failures", t.consecutive_failures.to_string())?;
    }
    if !d.parents.is_empty() {
        field("waits for", join_ids(&d.parents))?;
    }
    if !d.children.is_empty() {
        field("needed by", join_ids(&d.children))?;
    }
    let omitted = |n: u64, what: &str| match n {
        0 => Ok(()),
        n => line(&format!(
            "  ({n} older {what} not shown: the reply is bounded)"
        )),
    };
    if !d.runs.is_empty() {
        line("runs")?;
        omitted(d.omitted_runs, "runs")?;
        runs_table(&d.runs).print(out, "  ")?;
        // The table cuts notes to a column; the newest run's (a crash's error with the log's
        // tail, most often) is what one came to read, so it is shown whole.
        if let Some(last) = d.runs.last() {
            let note = run_note(last);
            if note.chars().count() > NOTE_WIDTH {
                // Its lines indented under the table.
                line(&format!(
                    "  run {} note: {}",
                    last.id,
                    printable(note.trim_end()).replace('\n', "\n    ")
                ))?;
            }
        }
    }
    if !d.events.is_empty() {
        line(&format!("events (last {})", d.events.len()))?;
        omitted(d.omitted_events, "events")?;
        let mut table = Table::new(&["ID", "WHEN", "RUN", "KIND", "DETAIL"]);
        for ev in &d.events {
            table.row(vec![
                ev.id.to_string().into(),
                ago(ev.at).into(),
                ev.run_id.map_or("-".into(), |r| r.to_string()).into(),
                ev.kind.clone().into(),
                event_detail(ev).into(),
            ]);
        }
        table.print(out, "  ")?;
    }
    if !d.comments.is_empty() {
        line("comments")?;
        omitted(d.omitted_comments, "comments")?;
        for c in &d.comments {
            line(&format!(
                "  [{}] {}: {}",
                ago(c.at),
                short(&c.author, 40),
                printable(&c.body)
            ))?;
        }
    }
    Ok(())
}

fn join_ids(ids: &[TaskId]) -> String {
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Characters of a run's note the runs table shows.
const NOTE_WIDTH: usize = 60;

/// A run's note: its worker's summary, else its error.
fn run_note(r: &Run) -> &str {
    r.summary.as_deref().or(r.error.as_deref()).unwrap_or("")
}

fn runs_table(runs: &[Run]) -> Table {
    let mut table = Table::new(&[
        "RUN", "ATTEMPT", "OUTCOME", "PID", "STARTED", "TOOK", "EXIT", "NOTE",
    ]);
    for r in runs {
        let outcome = r.outcome.map_or("running", |o| o.as_str());
        let exit = match (r.exit_code, r.exit_signal) {
            (Some(c), _) => c.to_string(),
            (None, Some(s)) => format!("sig {s}"),
            _ => "-".into(),
        };
        let took = match r.ended_at {
            Some(end) => duration(end - r.started_at),
            None => format!("{}…", duration(crate::board::now_millis() - r.started_at)),
        };
        let note = run_note(r);
        table.row(vec![
            r.id.to_string().into(),
            r.attempt.to_string().into(),
            Cell::coloured(outcome, outcome_colour(r.outcome)),
            r.spawned_pid.map_or("-".into(), |p| p.to_string()).into(),
            ago(r.started_at).into(),
            took.into(),
            exit.into(),
            short(note, NOTE_WIDTH).into(),
        ]);
    }
    table
}

/// The interesting part of an event's payload, on one line.
pub fn event_detail(ev: &Event) -> String {
    let p = &ev.payload;
    let pick = |k: &str| p.get(k).filter(|v| !v.is_null());
    let text = match ev.kind.as_str() {
        "created" => pick("title").map(|v| format!("{}", v)),
        "completed" => pick("result").map(|v| format!("result {v}")),
        "blocked" => pick("reason").map(|v| format!("reason {v}")),
        "heartbeat" => pick("note").map(|v| format!("note {v}")),
        "worker_spawned" => pick("pid").map(|v| format!("pid {v}")),
        "run_closed" => pick("outcome").map(|v| format!("outcome {v}")),
        "claimed" => pick("attempt").map(|v| format!("attempt {v}")),
        _ => None,
    };
    let text = text.unwrap_or_else(|| match p {
        serde_json::Value::Object(m) if m.is_empty() => String::new(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    });
    short(&text, 80)
}

/// Lists a task's runs (`--json`: an array of runs).
pub fn runs(cli: &Cli, out: Out, id: TaskId) -> Result<(), CliError> {
    let detail = connect(cli)?.show_task(id, Some(0))?;
    if out.json {
        return out.json(&detail.runs);
    }
    if detail.runs.is_empty() {
        return line(&format!("task {id} has no runs yet"));
    }
    runs_table(&detail.runs).print(&out, "")
}

/// Prints a task after a transition (`--json`: the task).
fn changed(out: &Out, task: &Task, what: &str) -> Result<(), CliError> {
    if out.json {
        return out.json(task);
    }
    line(&format!(
        "task {} {what}; now {}",
        task.id,
        out.paint(task.status.as_str(), status_colour(task.status))
    ))
}

/// `runwarden unblock ID`.
pub fn unblock(cli: &Cli, out: Out, id: TaskId) -> Result<(), CliError> {
    let task = connect(cli)?.unblock(id)?;
    changed(&out, &task, "unblocked")
}

/// `runwarden archive ID`.
pub fn archive(cli: &Cli, out: Out, id: TaskId) -> Result<(), CliError> {
    let task = connect(cli)?.archive(id)?;
    changed(&out, &task, "archived")
}

/// `runwarden reclaim ID`.
pub fn reclaim(cli: &Cli, out: Out, id: TaskId, reason: Option<String>) -> Result<(), CliError> {
    let task = connect(cli)?.reclaim(id, reason)?;
    changed(&out, &task, "reclaimed")
}

/// `runwarden link PARENT CHILD`.
pub fn link(cli: &Cli, out: Out, parent: TaskId, child: TaskId) -> Result<(), CliError> {
    let reply = connect(cli)?.link(parent, child)?;
    if out.json {
        return out.json(&reply);
    }
    line(&format!("task {child} now waits for task {parent}"))
}

/// `runwarden comment ID TEXT`.
pub fn comment(
    cli: &Cli,
    out: Out,
    id: TaskId,
    text: &str,
    author: Option<String>,
) -> Result<(), CliError> {
    let comment_id = connect(cli)?.comment(id, text, author)?;
    if out.json {
        return out.json(&serde_json::json!({ "comment_id": comment_id, "task_id": id }));
    }
    line(&format!("comment {comment_id} added to task {id}"))
}

/// Prints a task changed by a worker-side command.
pub fn print_changed(out: &Out, task: &Task, what: &str) -> Result<(), CliError> {
    changed(out, task, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runtime_under_a_millisecond_is_a_limit_not_none() {
        assert_eq!(runtime_ms(Duration::from_micros(500)), 1);
        assert_eq!(runtime_ms(Duration::from_millis(1500)), 1500);
        assert_eq!(runtime_ms(Duration::from_nanos(1_000_001)), 2);
        assert_eq!(runtime_ms(Duration::ZERO), 0, "0s: no limit, as documented");
    }
}
