//! The commands that watch things change: `events`, `logs`, `wait`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{IsTerminal, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;

use super::output::{Out, clock, line};
use super::tasks::event_detail;
use super::{Cli, CliError, EXIT_FAILURE, EXIT_LOST, EXIT_TIMEOUT, connect, load_config};
use crate::actors::spawn;
use crate::board::{Event, EventId, TaskId, TaskStatus};
use crate::control::client::{Client, ClientError};
use crate::control::protocol::code;

/// How often `logs --follow` looks for new output.
const LOG_POLL: Duration = Duration::from_millis(200);

/// `runwarden events`.
#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Only this task's events.
    #[arg(value_parser = super::task_id, allow_negative_numbers = true)]
    pub id: Option<TaskId>,
    /// Keep printing events as they commit (with --json: one JSON object per line).
    #[arg(long, short)]
    pub follow: bool,
    /// Start after this event id (default: the beginning).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(EventId).range(0..))]
    pub since: EventId,
}

/// `runwarden logs`.
#[derive(Debug, Args)]
pub struct LogsArgs {
    /// The task.
    #[arg(value_parser = super::task_id, allow_negative_numbers = true)]
    pub id: TaskId,
    /// Keep printing as the log grows (like `tail -f`).
    #[arg(long, short)]
    pub follow: bool,
}

/// `runwarden wait`.
#[derive(Debug, Args)]
pub struct WaitArgs {
    /// The tasks to wait for.
    #[arg(required = true, value_parser = super::task_id, allow_negative_numbers = true)]
    pub ids: Vec<TaskId>,
    /// Give up after this long, e.g. "90s", "10m" (exit 124); "0s" looks once and does not
    /// wait (unlike `RUNWARDEN_TIMEOUT=0s`, which means no limit on each answer).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub timeout: Option<Duration>,
}

/// Prints the event log (`--json`: an array; with `--follow`, one object per line).
pub fn events(cli: &Cli, out: Out, args: &EventsArgs) -> Result<(), CliError> {
    if !args.follow {
        let events = connect(cli)?.events(args.since, args.id)?;
        if out.json {
            return out.json(&events);
        }
        for ev in &events {
            print_event(&out, ev)?;
        }
        return Ok(());
    }
    // Followed for as long as asked: quiet stretches are no failure. A supervisor that goes
    // away (a restart) is reached again, and the stream goes on after the last event printed:
    // event ids are the board's, so none is missed or printed twice.
    let mut since = args.since;
    let mut reconnects = Reconnects::new()?;
    let mut client = connect_riding_out(cli, &mut reconnects, None)?.expect("no deadline to pass");
    loop {
        client.set_read_timeout(None)?;
        let lost = match client.follow_events(since, args.id) {
            Ok(mut stream) => loop {
                match stream.next() {
                    Some(Ok(ev)) => {
                        since = ev.id;
                        if out.json {
                            out.json_line(&ev)?;
                        } else {
                            print_event(&out, &ev)?;
                        }
                    }
                    Some(Err(e)) if super::is_passing(&e) => break e,
                    Some(Err(e)) => return Err(e.into()),
                    None => break ClientError::Closed,
                }
            },
            // A supervisor that answered the hello and then began to stop, say.
            Err(e) if super::is_passing(&e) => e,
            Err(e) => return Err(e.into()),
        };
        client = reconnects
            .reconnect(cli, &lost, None)?
            .expect("no deadline to pass");
    }
}

/// The first connection of a command that rides out a supervisor's restart (`wait`, `events
/// --follow`). A supervisor reached that closes (or refuses) during the hello is one stopping
/// for a restart: ridden out as any later loss. Nothing listening at all is an error at once.
/// `None`: `deadline` passed while reconnecting.
fn connect_riding_out(
    cli: &Cli,
    reconnects: &mut Reconnects,
    deadline: Option<Instant>,
) -> Result<Option<Client>, CliError> {
    match super::try_connect(&super::socket_path(cli)?, super::reply_timeout()?) {
        Ok(client) => Ok(Some(client)),
        Err(e) if super::is_passing(&e) && !matches!(e, ClientError::NotRunning { .. }) => {
            reconnects.reconnect(cli, &e, deadline)
        }
        // Not 1, which `wait` gives a task that ended blocked or archived: a script must tell
        // a supervisor that is not there from a failed task.
        Err(e @ ClientError::NotRunning { .. }) => Err(CliError {
            message: e.to_string(),
            code: super::EXIT_LOST,
        }),
        Err(e) => Err(e.into()),
    }
}

/// A follower's reconnections: the pause before the next attempt carries over from one loss
/// to the next while they come quickly, so a supervisor that keeps dropping the connection
/// right after answering (a restart loop) is not hammered.
struct Reconnects {
    last: Option<Instant>,
    delay: Duration,
    /// `RUNWARDEN_CONNECT_WAIT`, read when the command starts: a value that does not parse
    /// is refused then (exit 2), not at the first restart it was meant for.
    wait: Duration,
}

impl Reconnects {
    fn new() -> Result<Self, CliError> {
        Ok(Reconnects {
            last: None,
            delay: Duration::ZERO,
            wait: super::connect_wait()?,
        })
    }

    /// The first pause of a reconnection.
    const FIRST: Duration = Duration::from_millis(50);
    /// The longest pause between two attempts.
    const MOST: Duration = Duration::from_secs(2);

    /// Reaches the supervisor again after losing it (`lost`: a restart, say), for up to
    /// `RUNWARDEN_CONNECT_WAIT` (60 s) and not past `deadline`: `None` when the deadline passed
    /// first. One line on stderr says what happened; an error with [`EXIT_LOST`] when it could
    /// not be reached.
    fn reconnect(
        &mut self,
        cli: &Cli,
        lost: &ClientError,
        deadline: Option<Instant>,
    ) -> Result<Option<Client>, CliError> {
        let quick_again = self
            .last
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1));
        self.last = Some(Instant::now());
        if quick_again {
            self.delay = (self.delay * 2).clamp(Self::FIRST, Self::MOST);
            let until = deadline.map_or(self.delay, |d| {
                self.delay.min(d.saturating_duration_since(Instant::now()))
            });
            std::thread::sleep(until);
        } else {
            self.delay = Self::FIRST;
        }
        let path = super::socket_path(cli)?;
        let timeout = super::reply_timeout()?;
        let wait = self.wait;
        say!(
            "runwarden: lost the supervisor ({lost}); reconnecting for up to {}",
            humantime::format_duration(wait)
        );
        let give_up = crate::deadline_after(wait);
        let mut delay = self.delay;
        loop {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(None);
            }
            match super::try_connect(&path, timeout) {
                Ok(client) => return Ok(Some(client)),
                Err(e) if super::is_passing(&e) && Instant::now() < give_up => {
                    let until = deadline.map_or(give_up, |d| d.min(give_up));
                    std::thread::sleep(delay.min(until.saturating_duration_since(Instant::now())));
                    delay = (delay * 2).min(Self::MOST);
                }
                Err(e) => {
                    return Err(CliError {
                        message: format!(
                            "lost the supervisor and could not reach it again within {}: {e}",
                            humantime::format_duration(wait)
                        ),
                        code: EXIT_LOST,
                    });
                }
            }
        }
    }
}

fn print_event(out: &Out, ev: &Event) -> Result<(), CliError> {
    let task = ev.task_id.map_or("-".into(), |t| t.to_string());
    let run = ev.run_id.map_or("-".into(), |r| r.to_string());
    line(&format!(
        "{:>7}  {}  task {:<6} run {:<6} {:<22} {}",
        ev.id,
        clock(ev.at),
        task,
        run,
        out.paint(&ev.kind, kind_colour(&ev.kind)),
        event_detail(ev)
    ))
}

fn kind_colour(kind: &str) -> Option<&'static str> {
    match kind {
        "completed" => Some("32"),
        "blocked" | "gave_up" | "crashed" | "spawn_failed" | "timed_out" => Some("31"),
        "claimed" | "worker_spawned" => Some("36"),
        _ => None,
    }
}

/// Prints `<data_dir>/logs/<id>.log`, read straight from the file. With `--config` (or the
/// default config) no supervisor is needed; with only a socket, the supervisor on it is asked
/// where its logs are. An operator who may not read the file (the logs directory is the
/// supervisor's alone: another uid in `allowed_uids`) gets it through the socket instead.
pub fn logs(cli: &Cli, out: Out, args: &LogsArgs) -> Result<(), CliError> {
    if out.json {
        return Err(CliError::usage(
            "--json does not apply to logs: it prints the log's bytes as they are",
        ));
    }
    let by_socket = cli.config.is_none()
        && (cli.socket.is_some()
            || std::env::var_os(super::SOCKET_ENV).is_some_and(|s| !s.is_empty()));
    let logs_dir = if by_socket {
        // A socket named without a config: the supervisor on it says where its logs are.
        match connect(cli).and_then(|mut c| Ok(c.status()?)) {
            Ok(status) => status.logs_dir,
            Err(e) => load_config(cli).map(|c| c.logs_dir()).map_err(|_| e)?,
        }
    } else {
        load_config(cli)?.logs_dir()
    };
    let path = logs_dir.join(format!("{}.log", args.id));
    let opened = File::open(&path);
    if opened
        .as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied)
    {
        return logs_by_socket(cli, args);
    }
    if !args.follow {
        let mut file = opened.map_err(|e| {
            CliError::failure(format!(
                "no log for task {} at {}: {e}",
                args.id,
                path.display()
            ))
        })?;
        return copy_to_stdout(&mut file);
    }
    if opened.is_err() {
        no_such_task_to_wait_for(cli, args.id)?;
    }
    // A log that goes away and stays away may be its task's, pruned by retention: asked
    // again every few seconds while it is missing (a rotation's gap is far shorter).
    let mut asked: Option<Instant> = None;
    follow_file(&path, || {
        if asked.is_some_and(|at| at.elapsed() < MISSING_LOG_ASK_EVERY) {
            return Ok(());
        }
        asked = Some(Instant::now());
        no_such_task_to_wait_for(cli, args.id)
    })
}

/// How often a follower whose log file is missing asks whether its task is still there.
const MISSING_LOG_ASK_EVERY: Duration = Duration::from_secs(2);

/// A log not there yet is waited for — unless the supervisor, asked, says there is no such
/// task (a typo would otherwise wait for ever). One that cannot be asked (not running: the log
/// is read from the file) leaves the wait as it was.
fn no_such_task_to_wait_for(cli: &Cli, id: TaskId) -> Result<(), CliError> {
    let Ok(mut client) = connect(cli) else {
        return Ok(());
    };
    match client.show_task(id, Some(0)) {
        Err(e) if e.code() == Some(code::NOT_FOUND) => Err(e.into()),
        _ => Ok(()),
    }
}

/// The log through the supervisor (`read_log`), a piece at a time; with `--follow`, polled for
/// more, starting over when it was rotated.
fn logs_by_socket(cli: &Cli, args: &LogsArgs) -> Result<(), CliError> {
    let mut client = connect(cli)?;
    let mut offset = 0u64;
    let mut waiting_noted = false;
    let mut rotations: Option<Rotations> = None;
    loop {
        let piece = match client.read_log(args.id, offset, None) {
            Ok(piece) => piece,
            Err(e) if args.follow && e.code() == Some(code::NOT_FOUND) => {
                if !waiting_noted {
                    no_such_task_to_wait_for(cli, args.id)?;
                    say!("runwarden: task {} has no log yet; waiting", args.id);
                    waiting_noted = true;
                }
                std::thread::sleep(LOG_POLL);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if args.follow {
            let rotations = rotations.get_or_insert_with(|| Rotations::new(piece.rotation.clone()));
            let seen = rotations.seen.clone();
            // The supervisor answers between rotations (it reads again during one).
            match rotations.check(false, piece.rotation.clone(), piece.offset, piece.size) {
                Verdict::Print => {}
                Verdict::Wait => {
                    std::thread::sleep(LOG_POLL);
                    continue;
                }
                Verdict::Rotated => {
                    catch_up_by_socket(&mut client, args.id, offset, seen.as_deref())?;
                    offset = 0;
                    continue;
                }
                Verdict::StartOver => {
                    say!(
                        "runwarden: the log of task {} was truncated; following from its start",
                        args.id
                    );
                    offset = 0;
                    continue;
                }
            }
        } else if piece.offset > piece.size {
            return Ok(());
        }
        write_stdout(piece.data.as_bytes())?;
        // No progress: the log ends inside a character its writer has not finished.
        let stuck = piece.next == offset;
        offset = piece.next;
        if offset >= piece.size || stuck {
            if !args.follow {
                return Ok(());
            }
            std::thread::sleep(LOG_POLL);
        }
    }
}

/// What a follower of a log does with the piece it has just read.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Print,
    /// The log is shorter than the offset while a rotation is under way (it truncates the log
    /// first, then puts the new backup in place): look again once it is done.
    Wait,
    /// The log was truncated (by hand, or by a rotation cut short): the piece is not to be
    /// printed; read again from 0.
    StartOver,
    /// The log was rotated (a new backup): the piece is not to be printed; what was not read
    /// before the rotation is at the end of the backup; then read again from 0.
    Rotated,
}

/// A follower's knowledge of the log's rotations ([`spawn::log_generation`]).
#[derive(Debug)]
struct Rotations {
    seen: Option<String>,
    waited: bool,
}

impl Rotations {
    fn new(generation: Option<String>) -> Rotations {
        Rotations {
            seen: generation,
            waited: false,
        }
    }

    /// `rotating` (a rotation's new backup exists) and `generation` are read after the piece,
    /// in that order; `offset` is where the piece was read and `size` the log's size then.
    fn check(
        &mut self,
        rotating: bool,
        generation: Option<String>,
        offset: u64,
        size: u64,
    ) -> Verdict {
        let waited = std::mem::take(&mut self.waited);
        if generation.is_some() && generation != self.seen {
            // Also when the log has grown past the offset again since: the size cannot tell.
            self.seen = generation;
            return Verdict::Rotated;
        }
        // A backup removed (by hand, or with its task) is no rotation.
        self.seen = generation;
        if offset > size {
            if rotating && !waited {
                // Once: a backup left in the making by a rotation cut short stays for ever.
                self.waited = true;
                return Verdict::Wait;
            }
            return Verdict::StartOver;
        }
        Verdict::Print
    }
}

fn write_stdout(bytes: &[u8]) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(bytes)
        .and_then(|_| stdout.flush())
        .map_err(stdout_error)
}

/// A reader that went away (`| head`) ends the command quietly; anything else is said.
fn stdout_error(e: std::io::Error) -> CliError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        CliError::quiet()
    } else {
        CliError::failure(format!("cannot write to stdout: {e}"))
    }
}

/// Copies what is left of `file` to stdout.
fn copy_to_stdout(file: &mut File) -> Result<(), CliError> {
    let mut stdout = std::io::stdout().lock();
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| CliError::failure(format!("cannot read the log: {e}")))?;
        if n == 0 {
            break;
        }
        stdout.write_all(&buf[..n]).map_err(stdout_error)?;
    }
    stdout.flush().map_err(|_| CliError::quiet())
}

/// After a rotation, prints what the follower had not read yet (from `pos` in the log it was
/// reading, whose backup's generation was `seen`) out of the new backup, which holds the old
/// log's end and says where it starts and which rotation it follows
/// ([`spawn::backup_start`]). Says so when that is not known, when the log was rotated more
/// than once since the follower last read it, or when some of it was rotated out of reach.
fn catch_up_from_backup(path: &Path, pos: u64, seen: Option<&str>) -> Result<(), CliError> {
    let backup = spawn::backup_path(path);
    let Some(start) = spawn::backup_start(path) else {
        say!(
            "runwarden: {} was rotated; following from its start (what was written just \
             before the rotation is in {})",
            path.display(),
            backup.display()
        );
        return Ok(());
    };
    let what = path.display().to_string();
    let from = catch_up_from(&what, pos, start.offset, start.replaces.as_deref(), seen);
    let read =
        |e: std::io::Error| CliError::failure(format!("cannot read {}: {e}", backup.display()));
    let mut file = spawn::open_backup(path).map_err(read)?;
    file.seek(SeekFrom::Start(from)).map_err(read)?;
    copy_to_stdout(&mut file)
}

/// [`catch_up_from_backup`] through the supervisor (`read_log` with `backup`), for an operator
/// who may not read the files.
fn catch_up_by_socket(
    client: &mut Client,
    task: TaskId,
    pos: u64,
    seen: Option<&str>,
) -> Result<(), CliError> {
    let what = format!("the log of task {task}");
    // The first piece says where the backup starts, and which rotation it is.
    let first = match client.read_log_backup(task, 0, Some(1)) {
        Ok(piece) => piece,
        Err(e) if e.code() == Some(code::NOT_FOUND) => {
            say!("runwarden: {what} was rotated; following from its start");
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let Some(start) = first.backup_start else {
        say!(
            "runwarden: {what} was rotated; following from its start (what was written just \
             before the rotation is in its backup)"
        );
        return Ok(());
    };
    let mut offset = catch_up_from(&what, pos, start, first.replaces.as_deref(), seen);
    loop {
        let piece = client.read_log_backup(task, offset, None)?;
        if piece.rotation != first.rotation {
            say!("runwarden: {what} was rotated again while its backup was read");
            return Ok(());
        }
        write_stdout(piece.data.as_bytes())?;
        if piece.next == offset || piece.next >= piece.size {
            return Ok(());
        }
        offset = piece.next;
    }
}

/// Where in a new backup (starting at `start` of the rotated log, replacing the backup whose
/// rotation was `replaces`) a follower that was at `pos` of that log, having last seen the
/// rotation `seen`, goes on; says on stderr what it lost, if anything.
fn catch_up_from(
    what: &str,
    pos: u64,
    start: u64,
    replaces: Option<&str>,
    seen: Option<&str>,
) -> u64 {
    if replaces != seen {
        // Rotated twice or more: `pos` is an offset in a log that is gone.
        say!(
            "runwarden: {what} was rotated more than once since it was last read; what was \
             written before the last rotation is lost to this follower"
        );
        return 0;
    }
    if pos < start {
        say!(
            "runwarden: {what} was rotated; {} bytes written before it were rotated out unread",
            start - pos
        );
    }
    pos.saturating_sub(start)
}

/// `tail -f`: prints the file, then polls for growth; after a rotation, what it had not read
/// from the backup, then the new log from its start. While the file is missing, `missing` is
/// asked whether to go on waiting (an error ends the follow).
fn follow_file(
    path: &PathBuf,
    mut missing: impl FnMut() -> Result<(), CliError>,
) -> Result<(), CliError> {
    /// Read (and held) at most this much at a time.
    const CHUNK: u64 = 1 << 20;
    let mut pos = 0u64;
    let mut waiting_noted = false;
    let mut rotations = Rotations::new(spawn::log_generation(path));
    loop {
        match File::open(path) {
            Ok(mut file) => {
                let len = file.metadata().map(|m| m.len()).unwrap_or(0);
                let mut piece = Vec::new();
                if len > pos {
                    file.seek(SeekFrom::Start(pos))
                        .and_then(|_| file.take(CHUNK).read_to_end(&mut piece))
                        .map_err(|e| {
                            CliError::failure(format!("cannot read {}: {e}", path.display()))
                        })?;
                }
                // After the read: a rotation that completed meanwhile voids the piece.
                let rotating = spawn::rotation_path(path).exists();
                let seen = rotations.seen.clone();
                match rotations.check(rotating, spawn::log_generation(path), pos, len) {
                    Verdict::Print if !piece.is_empty() => {
                        write_stdout(&piece)?;
                        pos += piece.len() as u64;
                        if piece.len() as u64 == CHUNK {
                            continue; // more is there already
                        }
                    }
                    Verdict::Print | Verdict::Wait => {}
                    Verdict::Rotated => {
                        catch_up_from_backup(path, pos, seen.as_deref())?;
                        pos = 0;
                        continue;
                    }
                    Verdict::StartOver => {
                        say!(
                            "runwarden: {} was truncated; following from its start",
                            path.display()
                        );
                        pos = 0;
                        continue;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                missing()?;
                if !waiting_noted {
                    say!("runwarden: waiting for {} to appear", path.display());
                    waiting_noted = true;
                }
            }
            Err(e) => {
                return Err(CliError::failure(format!(
                    "cannot open {}: {e}",
                    path.display()
                )));
            }
        }
        std::thread::sleep(LOG_POLL);
    }
}

/// How a waited-for task stands.
fn settled(status: TaskStatus) -> bool {
    matches!(
        status,
        TaskStatus::Done | TaskStatus::Blocked | TaskStatus::Archived
    )
}

/// What an event does to a waited-for task's status (only the kinds that settle or reopen it).
fn status_after(ev: &crate::board::Event) -> Option<TaskStatus> {
    match ev.kind.as_str() {
        "completed" => Some(TaskStatus::Done),
        "blocked" | "gave_up" => Some(TaskStatus::Blocked),
        "archived" => Some(TaskStatus::Archived),
        "claimed" => Some(TaskStatus::Running),
        "promoted" => Some(TaskStatus::Ready),
        "demoted" => Some(TaskStatus::Todo),
        // Back in line (a released run, a retry after its backoff, an unblock): ready, or
        // waiting for a parent — the event says which.
        "reclaimed" | "retry_scheduled" | "unblocked" => ev.payload["status"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .or(Some(TaskStatus::Ready)),
        _ => None,
    }
}

/// A task seen done stays done for `wait`: archiving it afterwards (put away, as retention
/// would prune it) does not undo that it finished.
fn after_done(was: TaskStatus, now: TaskStatus) -> TaskStatus {
    if was == TaskStatus::Done && now == TaskStatus::Archived {
        TaskStatus::Done
    } else {
        now
    }
}

/// Waits until every task is done (exit 0), one ends blocked or archived (exit 1), or the
/// timeout passes (exit 124). Follows the event stream; no polling. Rides out a supervisor
/// restart (exit 3 if it does not come back within `RUNWARDEN_CONNECT_WAIT`).
pub fn wait(cli: &Cli, out: Out, args: &WaitArgs) -> Result<(), CliError> {
    let progress = std::io::stderr().is_terminal() && !out.json;
    // Exit 1 is a task that ended blocked or archived, and only that: a supervisor that could
    // not be asked (refused the connection, said `unauthorized`, answered garbage) is 3, as
    // one not running is — a script must tell a failed task from an unanswered question.
    let (state, timed_out) = wait_for_tasks(cli, args, progress).map_err(|e| match e.code {
        super::EXIT_FAILURE => CliError {
            code: super::EXIT_LOST,
            ..e
        },
        _ => e,
    })?;
    if progress {
        say_raw!("\r\x1b[2K");
    }
    report_wait(&out, &state, timed_out)
}

/// [`wait`]'s waiting: the tasks' last statuses, and whether the deadline passed first.
fn wait_for_tasks(
    cli: &Cli,
    args: &WaitArgs,
    progress: bool,
) -> Result<(BTreeMap<TaskId, TaskStatus>, bool), CliError> {
    let deadline = args.timeout.map(crate::deadline_after);
    let mut state: BTreeMap<TaskId, TaskStatus> = BTreeMap::new();
    let mut timed_out = false;
    let mut reconnects = Reconnects::new()?;
    let Some(mut client) = connect_riding_out(cli, &mut reconnects, deadline)? else {
        return Ok((state, true));
    };
    loop {
        match wait_on(&mut client, args, deadline, progress, &mut state)? {
            Waited::Settled => break,
            Waited::TimedOut => {
                timed_out = true;
                break;
            }
            Waited::Lost(lost) => match reconnects.reconnect(cli, &lost, deadline)? {
                Some(again) => client = again,
                None => {
                    timed_out = true;
                    break;
                }
            },
        }
    }
    Ok((state, timed_out))
}

/// How one connection's wait ended.
enum Waited {
    /// Every task done, or one blocked or archived.
    Settled,
    TimedOut,
    /// The connection was lost (the supervisor went away).
    Lost(ClientError),
}

/// [`wait`] over one connection: the tasks' statuses, then the events that change them.
fn wait_on(
    client: &mut Client,
    args: &WaitArgs,
    deadline: Option<Instant>,
    progress: bool,
    state: &mut BTreeMap<TaskId, TaskStatus>,
) -> Result<Waited, CliError> {
    let lost = |e: ClientError| -> Result<Waited, CliError> {
        if super::is_passing(&e) {
            Ok(Waited::Lost(e))
        } else {
            Err(e.into())
        }
    };
    // The watermark first, then the statuses: whatever settles after the watermark is in the
    // stream that follows from it, so nothing between the two reads is missed. (Read afresh
    // on every connection: what changed while the supervisor was away is in the statuses.)
    let since = match client.status() {
        Ok(status) => status.last_event_id,
        Err(e) => return lost(e),
    };
    for &id in &args.ids {
        match client.show_task(id, Some(0)) {
            Ok(detail) => {
                // Archived after it was completed: it finished (the row keeps `completed_at`),
                // whether or not this wait saw it done first.
                let now = match detail.task.status {
                    TaskStatus::Archived if detail.task.completed_at.is_some() => TaskStatus::Done,
                    status => status,
                };
                let was = state.get(&id).copied();
                state.insert(id, was.map_or(now, |w| after_done(w, now)))
            }
            // Seen finished on an earlier connection and pruned by retention since (while the
            // supervisor restarted): it finished as seen.
            Err(ClientError::Server { code, .. })
                if code == "not_found" && state.get(&id).is_some_and(|s| settled(*s)) =>
            {
                continue;
            }
            // Not 1, which says a task ended blocked or archived: a script must tell a
            // mistyped id from a failed task.
            Err(ClientError::Server { code, message }) if code == "not_found" => {
                return Err(CliError::usage(format!(
                    "{message}; wait needs tasks that exist"
                )));
            }
            Err(e) => return lost(e),
        };
    }
    if state.values().all(|s| settled(*s)) || any_failed(state) {
        return Ok(Waited::Settled);
    }
    let mut stream = match client.follow_events(since, None) {
        Ok(stream) => stream,
        Err(e) => return lost(e),
    };
    loop {
        show_progress(progress, state);
        let remaining = match deadline {
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(r) if !r.is_zero() => Some(r),
                _ => return Ok(Waited::TimedOut),
            },
            None => None,
        };
        stream.set_timeout(remaining)?;
        match stream.next() {
            Some(Ok(ev)) => {
                if let (Some(task), Some(status)) = (ev.task_id, status_after(&ev))
                    && let Some(s) = state.get_mut(&task)
                {
                    *s = after_done(*s, status);
                }
                if state.values().all(|s| settled(*s)) || any_failed(state) {
                    return Ok(Waited::Settled);
                }
            }
            Some(Err(ClientError::Timeout)) => return Ok(Waited::TimedOut),
            Some(Err(e)) => return lost(e),
            None => return lost(ClientError::Closed),
        }
    }
}

fn any_failed(state: &BTreeMap<TaskId, TaskStatus>) -> bool {
    state
        .values()
        .any(|s| matches!(s, TaskStatus::Blocked | TaskStatus::Archived))
}

fn show_progress(on: bool, state: &BTreeMap<TaskId, TaskStatus>) {
    if on {
        let done = state.values().filter(|s| **s == TaskStatus::Done).count();
        say_raw!("\r\x1b[2Kwaiting: {done}/{} done", state.len());
        let _ = std::io::stderr().flush();
    }
}

fn report_wait(
    out: &Out,
    state: &BTreeMap<TaskId, TaskStatus>,
    timed_out: bool,
) -> Result<(), CliError> {
    if out.json {
        let tasks: Vec<_> = state
            .iter()
            .map(|(id, s)| serde_json::json!({ "id": id, "status": s }))
            .collect();
        out.json(&serde_json::json!({ "tasks": tasks, "timed_out": timed_out }))?;
    } else {
        for (id, s) in state {
            let shown = if settled(*s) { s.as_str() } else { "not done" };
            line(&format!(
                "task {id}: {}",
                out.paint(shown, super::output::status_colour(*s))
            ))?;
        }
    }
    let failed: Vec<String> = state
        .iter()
        .filter(|(_, s)| matches!(s, TaskStatus::Blocked | TaskStatus::Archived))
        .map(|(id, s)| format!("task {id} is {s}"))
        .collect();
    if !failed.is_empty() {
        return Err(CliError {
            message: failed.join(", "),
            code: EXIT_FAILURE,
        });
    }
    if timed_out {
        let open = state.iter().filter(|(_, s)| !settled(**s)).count();
        return Err(CliError {
            message: format!("timed out with {open} task(s) not done"),
            code: EXIT_TIMEOUT,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Rotations, Verdict};

    fn rotation(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn a_follower_starts_over_once_per_rotation_even_past_its_offset() {
        let mut r = Rotations::new(None);
        assert_eq!(r.check(false, None, 0, 10), Verdict::Print);
        // Rotated and regrown past the offset: only the generation says so.
        assert_eq!(r.check(false, rotation("a"), 10, 50), Verdict::Rotated);
        assert_eq!(r.check(false, rotation("a"), 0, 50), Verdict::Print);
        // Caught between the truncation and the new backup: wait, then one start over.
        assert_eq!(r.check(true, rotation("a"), 50, 0), Verdict::Wait);
        assert_eq!(r.check(false, rotation("b"), 50, 20), Verdict::Rotated);
        assert_eq!(r.check(false, rotation("b"), 0, 20), Verdict::Print);
    }

    #[test]
    fn a_truncation_by_hand_starts_over_at_once_and_a_removed_backup_changes_nothing() {
        let mut r = Rotations::new(rotation("a"));
        assert_eq!(r.check(false, rotation("a"), 50, 0), Verdict::StartOver);
        assert_eq!(r.check(false, rotation("a"), 0, 10), Verdict::Print);
        assert_eq!(r.check(false, None, 10, 30), Verdict::Print);
        // A new backup after that is a rotation again.
        assert_eq!(r.check(false, rotation("a"), 30, 40), Verdict::Rotated);
    }

    #[test]
    fn a_backup_left_in_the_making_delays_a_start_over_by_one_poll_only() {
        let mut r = Rotations::new(rotation("a"));
        assert_eq!(r.check(true, rotation("a"), 50, 0), Verdict::Wait);
        assert_eq!(r.check(true, rotation("a"), 50, 0), Verdict::StartOver);
        assert_eq!(r.check(true, rotation("a"), 0, 5), Verdict::Print);
    }
}
