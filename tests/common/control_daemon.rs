//! Helpers for the control-socket and CLI tests: a real `runwarden serve` child process on a
//! temporary data dir, talked to over its real socket, and always ended by pid.

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use runwarden::board::{NewTask, TaskId};
use runwarden::control::client::Client;
use runwarden::control::protocol::{Request, Response};
use tempfile::TempDir;

use super::proc_guard::{ChildGuard, wait_until};

/// Generous bound for a supervisor to start, stop, or get somewhere; every wait polls.
pub const SETTLE: Duration = Duration::from_secs(20);

/// The `runwarden` binary under test.
pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_runwarden")
}

/// A `runwarden serve` child with its own data dir, config file and stderr log.
pub struct Daemon {
    pub child: Option<ChildGuard>,
    pub config: PathBuf,
    pub data_dir: PathBuf,
    pub socket: PathBuf,
    pub stderr: PathBuf,
    /// Holds everything above; removed last.
    pub dir: TempDir,
}

impl Daemon {
    /// Starts a supervisor. `supervisor` is extra lines for the `[supervisor]` table; `rest`
    /// is appended as is (other tables: `[control]`, `[assignees.x]`, …). Workers are ended
    /// when it stops (`shutdown = "terminate"`), so tests leave nothing behind.
    pub fn start(supervisor: &str, rest: &str) -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        Daemon::start_in(dir, supervisor, rest)
    }

    /// Like [`Daemon::start`] in a directory the caller prepared.
    pub fn start_in(dir: TempDir, supervisor: &str, rest: &str) -> Daemon {
        let config = dir.path().join("config.toml");
        let data_dir = dir.path().join("data");
        let text = format!(
            "[supervisor]\ndata_dir = \"data\"\ntick = \"200ms\"\nshutdown = \"terminate\"\n{supervisor}\n\
             [reaper]\ngrace = \"1s\"\nkill_timeout = \"2s\"\n\n{rest}\n"
        );
        fs::write(&config, text).expect("write config");
        let socket = runwarden::config::Config::load(&config)
            .expect("test config loads")
            .socket_path();
        let mut d = Daemon {
            child: None,
            stderr: dir.path().join("serve.stderr"),
            config,
            data_dir,
            socket,
            dir,
        };
        d.spawn();
        d.wait_ready();
        d
    }

    /// Starts `serve` without waiting for it; for tests of a refused start.
    pub fn spawn_serve(config: &Path, stderr: &Path) -> ChildGuard {
        let log = fs::File::create(stderr).expect("stderr file");
        let mut cmd = Command::new(bin());
        cmd.arg("--config")
            .arg(config)
            .arg("serve")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            // Its own group: a signal meant for the test's group never reaches it.
            .process_group(0)
            .env("RUNWARDEN_LOG", "info");
        scrub_env(&mut cmd);
        ChildGuard::spawn(&mut cmd).expect("spawn runwarden serve")
    }

    fn spawn(&mut self) {
        self.child = Some(Daemon::spawn_serve(&self.config, &self.stderr));
    }

    /// Polls until a client is served (hello answered), or panics with the daemon's stderr.
    pub fn wait_ready(&mut self) {
        let deadline = Instant::now() + SETTLE;
        loop {
            if let Ok(mut c) = Client::connect(&self.socket)
                && c.hello().is_ok()
            {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!(
                    "runwarden serve exited with {status}:\n{}",
                    self.stderr_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "socket never answered:\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The supervisor's pid.
    pub fn pid(&self) -> i32 {
        self.child.as_ref().expect("running").pid()
    }

    /// A connected client that has said hello.
    pub fn client(&self) -> Client {
        let mut c = Client::connect(&self.socket).expect("connect");
        c.hello().expect("hello");
        c
    }

    /// A raw connection (no hello), with a read timeout so a test never hangs.
    pub fn raw(&self) -> RawConn {
        RawConn::connect(&self.socket)
    }

    /// Runs `runwarden --socket <socket> ARGS…` and returns its output.
    pub fn cli(&self, args: &[&str]) -> Output {
        let mut cmd = command();
        cmd.arg("--socket").arg(&self.socket).args(args);
        run(cmd)
    }

    /// Runs `runwarden ARGS… --config <config>` (the flag after the subcommand).
    pub fn cli_with_config(&self, args: &[&str]) -> Output {
        let mut cmd = command();
        cmd.args(args).arg("--config").arg(&self.config);
        run(cmd)
    }

    /// What the daemon wrote to stderr so far.
    pub fn stderr_text(&self) -> String {
        fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Asserts the daemon is still running and never panicked.
    pub fn assert_healthy(&mut self) {
        let exited = self
            .child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten());
        assert!(
            exited.is_none(),
            "supervisor exited ({exited:?}):\n{}",
            self.stderr_text()
        );
        let log = self.stderr_text();
        assert!(!log.contains("panicked"), "supervisor panicked:\n{log}");
    }

    /// Waits until the daemon has exited; returns whether it exited cleanly.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let mut status = None;
        wait_until(timeout, || {
            status = child.try_wait().ok().flatten();
            status.is_some()
        });
        status
    }

    /// Stops the daemon and starts a new one on the same config and data (a restart).
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
        self.wait_ready();
    }

    /// Stops the daemon gracefully over the socket, then (if that fails) by SIGKILL.
    pub fn stop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if let Ok(mut c) = Client::connect(&self.socket)
            && c.hello().is_ok()
        {
            let _ = c.shutdown();
        }
        let _ = self.wait_exit(SETTLE);
        // Drop SIGKILLs it if it is still there, and reaps it.
        self.child = None;
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
        // A daemon that had to be SIGKILLed left its workers (group leaders of their own)
        // running: end every worker the board still records, by pid and fingerprint.
        super::runtime::kill_recorded_workers(&self.data_dir.join("board.db"));
    }
}

/// Removes runwarden's variables inherited from the test environment.
pub fn scrub_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("RUNWARDEN_") {
            cmd.env_remove(&key);
        }
    }
}

/// `runwarden` with none of runwarden's variables inherited from the test's environment.
pub fn command() -> Command {
    let mut cmd = Command::new(bin());
    scrub_env(&mut cmd);
    cmd
}

/// Spawns `runwarden ARGS…` with stdout piped to a channel of lines; ended by its guard.
pub fn stream(args: &[&str]) -> (ChildGuard, std::sync::mpsc::Receiver<String>) {
    let mut cmd = command();
    cmd.args(args);
    stream_of(cmd)
}

/// [`stream`] of a command prepared by the caller (another binary, another uid).
pub fn stream_of(mut cmd: Command) -> (ChildGuard, std::sync::mpsc::Receiver<String>) {
    cmd.current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = ChildGuard::spawn(&mut cmd).unwrap();
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Runs a command to completion (no stdin, in `/`) and returns its output.
pub fn run(mut cmd: Command) -> Output {
    cmd.stdin(Stdio::null()).current_dir("/");
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn runwarden");
    // A guard ends it by pid if the test fails (or it hangs) before it is collected.
    let mut guard = ChildGuard::new(child).expect("guard");
    // Both pipes drained on their own threads (a full pipe must not stall the command), while
    // this thread waits for the exit with a bound: a hung command fails the test, and the
    // guard's kill closes the pipes so the readers end too.
    fn drain(mut pipe: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = pipe.read_to_end(&mut buf);
            buf
        })
    }
    let stdout = drain(guard.0.stdout.take().expect("stdout"));
    let stderr = drain(guard.0.stderr.take().expect("stderr"));
    let exited = guard.pidfd().wait_exit(COMMAND_TIMEOUT).unwrap_or(false);
    assert!(exited, "runwarden did not exit within {COMMAND_TIMEOUT:?}");
    let status = guard.0.wait().expect("wait");
    Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    }
}

/// How long [`run`] lets one command take before it fails the test.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// stdout of a successful command, or a panic showing what it said.
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "command failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// stdout parsed as JSON, for a successful command.
pub fn ok_json(out: &Output) -> serde_json::Value {
    let text = ok(out);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The exit code and stderr of a command that must fail.
pub fn failed(out: &Output) -> (i32, String) {
    assert!(
        !out.status.success(),
        "command succeeded but should not have:\nstdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A raw socket connection speaking lines, for malformed-input tests.
pub struct RawConn {
    pub reader: BufReader<UnixStream>,
    pub writer: UnixStream,
}

impl RawConn {
    /// Connects (no hello) with a 10 s read timeout.
    pub fn connect(socket: &Path) -> RawConn {
        let s = UnixStream::connect(socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        RawConn {
            writer: s.try_clone().expect("clone"),
            reader: BufReader::new(s),
        }
    }

    /// Sends bytes as they are.
    pub fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("write");
    }

    /// Sends bytes as they are, when the daemon may already have refused and closed the
    /// connection (its refusal line is still there to read).
    pub fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.writer.write_all(bytes)
    }

    /// Sends `hello` and checks the answer.
    pub fn hello(&mut self) {
        self.send(b"{\"id\":0,\"op\":\"hello\",\"version\":\"1.0\"}\n");
        let r = self.recv().expect("hello answered");
        assert_eq!(r["ok"], true, "{r}");
    }

    /// The next line as JSON; None at end of stream (or reset).
    pub fn recv(&mut self) -> Option<serde_json::Value> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => None,
            Ok(_) => Some(
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad line ({e}): {line:?}")),
            ),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => None,
            Err(e) => panic!("read failed: {e}"),
        }
    }

    /// Sends a request line and returns the answer.
    pub fn call(&mut self, line: &str) -> serde_json::Value {
        self.send(line.as_bytes());
        self.send(b"\n");
        self.recv().expect("an answer")
    }

    /// True once the server has closed the connection.
    pub fn closed(&mut self) -> bool {
        self.recv().is_none()
    }

    /// Reads to the end of the stream: `Err` for a reset (the server closed with our input
    /// unread) or for more lines.
    pub fn ends_cleanly(&mut self) -> Result<(), String> {
        let mut rest = String::new();
        match self.reader.read_to_string(&mut rest) {
            Ok(_) if rest.is_empty() => Ok(()),
            Ok(_) => Err(format!("more after the last line: {rest:?}")),
            Err(e) => Err(format!("not a clean end: {e}")),
        }
    }
}

/// Adds `tasks` over `client`, pipelined (up to 256 in flight), and returns their ids in order.
pub fn add_tasks(client: &mut Client, tasks: impl IntoIterator<Item = NewTask>) -> Vec<TaskId> {
    const IN_FLIGHT: usize = 256;
    let mut ids = Vec::new();
    let mut pending = 0;
    let mut collect = |client: &mut Client, pending: &mut usize| {
        for _ in 0..std::mem::take(pending) {
            match client.recv().expect("an add_task reply") {
                Response::Ok { result, .. } => ids.push(result["id"].as_i64().expect("an id")),
                other => panic!("add_task refused: {other:?}"),
            }
        }
    };
    for task in tasks {
        client.send(&Request::AddTask(task)).expect("send add_task");
        pending += 1;
        if pending == IN_FLIGHT {
            collect(client, &mut pending);
        }
    }
    collect(client, &mut pending);
    ids
}

/// A task of `2 × bytes` of text: a title of `bytes` (at most `MAX_TITLE_BYTES`: the rest goes
/// to the body) and a body of the rest. Big replies; big `created` events up to that bound.
pub fn big_task(i: usize, bytes: usize) -> NewTask {
    // The title within its bound (MAX_TITLE_BYTES), the body the rest.
    let mut title = format!("t{i} ");
    let title_bytes = bytes.min(runwarden::board::MAX_TITLE_BYTES);
    title.extend(std::iter::repeat_n(
        'x',
        title_bytes.saturating_sub(title.len()),
    ));
    NewTask {
        body: "b".repeat(2 * bytes - title.len()),
        ..NewTask::titled(title)
    }
}

/// The error code of a refusal line.
pub fn error_code(v: &serde_json::Value) -> &str {
    assert_eq!(v["ok"], false, "expected a refusal: {v}");
    v["error"]["code"].as_str().unwrap_or("")
}

/// Whether process `pid` holds a connected Unix socket: a client that has reached the
/// supervisor (its `/proc/<pid>/fd` links matched against `/proc/net/unix`, state 03).
pub fn has_connected_socket(pid: i32) -> bool {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let inodes: Vec<String> = fds
        .flatten()
        .filter_map(|fd| fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            let link = link.to_string_lossy().into_owned();
            Some(
                link.strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let table = fs::read_to_string("/proc/net/unix").unwrap_or_default();
    table.lines().skip(1).any(|row| {
        let cols: Vec<&str> = row.split_whitespace().collect();
        cols.len() > 6 && cols[5] == "03" && inodes.iter().any(|i| i == cols[6])
    })
}

/// Spawns `cmd` (a `runwarden` that follows the supervisor: `wait`, `events --follow`) and
/// returns it once it holds a connection to a supervisor.
pub fn spawn_connected(cmd: &mut Command) -> ChildGuard {
    let child = ChildGuard::spawn(cmd).expect("spawn runwarden");
    assert!(
        crate::common::proc_guard::wait_until(SETTLE, || has_connected_socket(child.pid())),
        "{cmd:?} never connected"
    );
    child
}

/// The exit code of `child`, waited for within [`SETTLE`] (-1 for a death by a signal).
pub fn exit_code(child: &mut ChildGuard) -> Option<i32> {
    let exited = child.pidfd().wait_exit(SETTLE).unwrap_or(false);
    exited.then(|| child.0.wait().expect("wait").code().unwrap_or(-1))
}
