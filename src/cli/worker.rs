//! The commands a worker runs on its own run — complete, block, heartbeat — which an operator
//! may also run on any task (complete and block only).
//!
//! Inside a worker (`RUNWARDEN_RUN_TOKEN` set) the task, run and token come from the
//! environment the supervisor gave it, and the socket from `RUNWARDEN_SOCKET`: a worker may not
//! be able to read the config file, so this path never loads it unless nothing else says where
//! the socket is.

use std::time::{Duration, Instant};

use clap::Args;

use super::output::{Out, line};
use super::tasks::print_changed;
use super::{Cli, CliError, connect};
use crate::board::{RunId, TaskId};
use crate::control::client::{Client, ClientError};
use crate::control::protocol::{self, Block, Complete, Heartbeat};

/// `runwarden complete`.
#[derive(Debug, Args)]
pub struct CompleteArgs {
    /// The task (inside a worker: default its own).
    #[arg(value_parser = super::task_id, allow_negative_numbers = true)]
    pub id: Option<TaskId>,
    /// The result to record.
    #[arg(long, short)]
    pub result: Option<String>,
    /// As an operator, complete even though the task's worker may still be alive.
    #[arg(long)]
    pub force: bool,
}

/// `runwarden block`.
#[derive(Debug, Args)]
pub struct BlockArgs {
    /// `ID REASON`, or just `REASON` inside a worker (its own task).
    #[arg(value_name = "ARGS", required = true, num_args = 1..=2, allow_negative_numbers = true)]
    pub args: Vec<String>,
    /// As an operator, block even though the task's worker may still be alive.
    #[arg(long)]
    pub force: bool,
}

/// `runwarden heartbeat`.
#[derive(Debug, Args)]
pub struct HeartbeatArgs {
    /// A short progress note, recorded with the heartbeat.
    #[arg(long, short)]
    pub note: Option<String>,
}

/// The run a worker is working on, from its environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEnv {
    pub task: TaskId,
    pub run: RunId,
    pub token: String,
}

impl WorkerEnv {
    /// `Some` inside a worker (`RUNWARDEN_RUN_TOKEN` set); an error if its companions are
    /// missing or malformed.
    pub fn from_env() -> Result<Option<WorkerEnv>, CliError> {
        let Some(token) = std::env::var("RUNWARDEN_RUN_TOKEN")
            .ok()
            .filter(|t| !t.is_empty())
        else {
            return Ok(None);
        };
        let number = |name: &str| -> Result<i64, CliError> {
            let text = std::env::var(name).map_err(|_| {
                CliError::usage(format!("RUNWARDEN_RUN_TOKEN is set but {name} is not"))
            })?;
            text.trim()
                .parse()
                .map_err(|_| CliError::usage(format!("{name} is not a number: {text:?}")))
        };
        Ok(Some(WorkerEnv {
            task: number("RUNWARDEN_TASK_ID")?,
            run: number("RUNWARDEN_RUN_ID")?,
            token,
        }))
    }

    /// The worker's own run when `id` is absent or names its own task.
    fn own(id: Option<TaskId>) -> Result<Option<WorkerEnv>, CliError> {
        let env = WorkerEnv::from_env()?;
        Ok(env.filter(|w| id.is_none_or(|id| id == w.task)))
    }
}

/// Marks a task done: the worker's own run, or any task as an operator.
pub fn complete(cli: &Cli, out: Out, args: &CompleteArgs) -> Result<(), CliError> {
    let req = match (WorkerEnv::own(args.id)?, args.id) {
        (Some(w), _) => Complete {
            task: w.task,
            run: Some(w.run),
            token: Some(w.token),
            result: args.result.clone(),
            force: false,
        },
        (None, Some(task)) => Complete {
            task,
            run: None,
            token: None,
            result: args.result.clone(),
            force: args.force,
        },
        (None, None) => return Err(not_in_worker("complete ID")),
    };
    let worker = req.token.is_some();
    let task = request(cli, worker, |c| c.complete(req.clone()))?;
    print_changed(&out, &task, "completed")
}

/// Blocks a task: the worker's own run, or any task as an operator.
pub fn block(cli: &Cli, out: Out, args: &BlockArgs) -> Result<(), CliError> {
    let (id, reason) = match args.args.as_slice() {
        [id, reason] => {
            let id = super::task_id(id)
                .map_err(|e| CliError::usage(format!("invalid task id {id:?}: {e}")))?;
            (Some(id), reason.clone())
        }
        [reason] => (None, reason.clone()),
        _ => return Err(CliError::usage("usage: runwarden block [ID] REASON")),
    };
    let req = match (WorkerEnv::own(id)?, id) {
        (Some(w), _) => Block {
            task: w.task,
            run: Some(w.run),
            token: Some(w.token),
            reason,
            force: false,
        },
        (None, Some(task)) => Block {
            task,
            run: None,
            token: None,
            reason,
            force: args.force,
        },
        // One argument outside a worker that names a task: the reason is what is missing.
        (None, None) if super::task_id(&req_reason(args)).is_ok() => {
            return Err(CliError::usage(format!(
                "a reason is needed: runwarden block {} REASON",
                req_reason(args)
            )));
        }
        (None, None) => return Err(not_in_worker("block ID REASON")),
    };
    let worker = req.token.is_some();
    let task = request(cli, worker, |c| c.block(req.clone()))?;
    print_changed(&out, &task, "blocked")
}

/// A worker's heartbeat on its own run.
pub fn heartbeat(cli: &Cli, out: Out, args: &HeartbeatArgs) -> Result<(), CliError> {
    let Some(w) = WorkerEnv::from_env()? else {
        return Err(CliError::usage(
            "heartbeat runs inside a worker: RUNWARDEN_RUN_TOKEN is not set",
        ));
    };
    let beat = Heartbeat {
        task: w.task,
        run: w.run,
        token: w.token,
        note: args.note.clone(),
    };
    let reply = request(cli, true, |c| c.heartbeat(beat.clone()))?;
    if out.json {
        return out.json(&reply);
    }
    line(&format!(
        "heartbeat recorded for task {} run {}; lease {}",
        w.task,
        w.run,
        super::output::ago(reply.lease_expires_at).replace("in ", "expires in ")
    ))
}

/// Sends one request. A worker reporting on its own run rides out a supervisor restart — the
/// socket gone or refusing, the connection closed before any reply (accepted while the server
/// was stopping), the server stopping or out of connection slots — and a full disk by retrying the whole
/// exchange for up to [`super::connect_wait`] (60 s; `RUNWARDEN_CONNECT_WAIT`), so its
/// report is not lost. A report is never applied twice: a retry of one that did land finds its
/// run closed (`stale_run`), which is said so. An operator's command fails at once.
fn request<T>(
    cli: &Cli,
    worker: bool,
    send: impl Fn(&mut Client) -> Result<T, ClientError>,
) -> Result<T, CliError> {
    if !worker {
        let mut client = connect(cli)?;
        return Ok(send(&mut client)?);
    }
    let path = super::socket_path(cli)?;
    // Each attempt waits for its answer as an operator's command does: a supervisor that
    // accepted the connection but does not answer (stopped, wedged) must not hold the worker
    // for ever. A reply that times out may still be applied, so it is not retried (exit 124).
    let timeout = super::reply_timeout()?;
    let wait = super::connect_wait()?;
    let deadline = crate::deadline_after(wait);
    let mut delay = Duration::from_millis(50);
    let mut told = false;
    let mut retried = false;
    loop {
        let attempt = super::try_connect(&path, timeout).and_then(|mut client| send(&mut client));
        let e = match attempt {
            Ok(reply) => return Ok(reply),
            Err(e) if retried && e.code() == Some(protocol::code::STALE_RUN) => {
                return Err(CliError::failure(format!(
                    "{e}; an earlier attempt of this report may have been recorded before the \
                     supervisor went away"
                )));
            }
            Err(e) if (super::is_passing(&e) || is_disk_full(&e)) && Instant::now() < deadline => e,
            Err(e) => return Err(e.into()),
        };
        if !told {
            say!(
                "runwarden: {e}; retrying for up to {}",
                humantime::format_duration(wait)
            );
            told = true;
        }
        retried = true;
        std::thread::sleep(delay.min(deadline.saturating_duration_since(Instant::now())));
        delay = (delay * 2).min(Duration::from_secs(2));
    }
}

/// `block`'s one argument (taken for the reason).
fn req_reason(args: &BlockArgs) -> String {
    args.args.first().cloned().unwrap_or_default()
}

/// A refusal for want of space: nothing of the report was written (the transaction rolled
/// back), so sending it again is safe, and it lands once the disk has room.
fn is_disk_full(e: &ClientError) -> bool {
    e.code() == Some(protocol::code::DISK_FULL)
}

fn not_in_worker(usage: &str) -> CliError {
    CliError::usage(format!(
        "no task given and not inside a worker (RUNWARDEN_RUN_TOKEN is not set); usage: runwarden {usage}"
    ))
}
