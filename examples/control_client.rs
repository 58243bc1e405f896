//! Talking to a running supervisor over its control socket with the library's client: add a
//! task, then follow its events until it is done (or blocked, or archived).
//!
//! ```sh
//! cargo run -- serve &                                   # a supervisor on ./config.toml
//! cargo run --example control_client -- .runwarden/control.sock "write the report" coder
//! ```
//!
//! Arguments: `[SOCKET] [TITLE] [ASSIGNEE]`; the socket defaults to `$RUNWARDEN_SOCKET`, the
//! title to "hello from control_client", the assignee to `coder`.

use std::process::ExitCode;

use runwarden::board::{NewTask, TaskStatus};
use runwarden::control::client::{Client, ClientError};

fn main() -> ExitCode {
    match run() {
        Ok(TaskStatus::Done) => ExitCode::SUCCESS,
        Ok(status) => {
            eprintln!("the task ended {status}");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("control_client: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<TaskStatus, ClientError> {
    let mut args = std::env::args().skip(1);
    let socket = args
        .next()
        .or_else(|| std::env::var("RUNWARDEN_SOCKET").ok())
        .unwrap_or_else(|| ".runwarden/control.sock".into());
    let title = args
        .next()
        .unwrap_or_else(|| "hello from control_client".into());
    let assignee = args.next().unwrap_or_else(|| "coder".into());

    let mut client = Client::connect(&socket)?;
    let hello = client.hello()?;
    println!(
        "connected to runwarden {} (pid {}, protocol {})",
        hello.server, hello.pid, hello.protocol
    );

    let created = client.add_task(&NewTask::titled(title).for_assignee(assignee))?;
    let id = created.id;
    println!("added task {id}");

    // Follow this task's events from the beginning of the log: the backlog first (its
    // `created` event), then each new event as it commits, in order, with no gaps.
    for event in client.follow_events(0, Some(id))? {
        let event = event?;
        println!("  #{:<6} {:<16} {}", event.id, event.kind, event.payload);
        let settled = match event.kind.as_str() {
            "completed" => Some(TaskStatus::Done),
            "blocked" | "gave_up" => Some(TaskStatus::Blocked),
            "archived" => Some(TaskStatus::Archived),
            _ => None,
        };
        if let Some(status) = settled {
            return Ok(status);
        }
    }
    Err(ClientError::Closed)
}
