//! `serve`: the real `runwarden serve` binary, its workers' command given as a bare name
//! (`true`, looked up in PATH) against an absolute path (`/bin/true`), N tasks each, added
//! over the socket; alternating rounds, ratio of medians. `serve` gives workers a PATH of its
//! own, and a bare name used to make every start fork the whole supervisor.
//!
//! Needs the binary beside the examples: `cargo build --release` first.

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use runwarden::board::NewTask;
use runwarden::control::client::Client;

use crate::Opts;
use crate::util::{Summary, add_pipelined, median};

/// Bare-name lifecycles/s over absolute-path lifecycles/s.
const TARGET_RATIO: f64 = 0.9;
/// Requests in flight while adding.
const WINDOW: usize = 512;

/// Runs the scenario and appends its lines to `summary`.
pub fn run(opts: &Opts, dir: &Path, summary: &mut Summary) -> Result<(), String> {
    let bin = serve_binary()?;
    let n = opts.tasks;
    println!(
        "\n== serve: `{}` with N={n} tasks, P={}, command `true` vs `/bin/true`, {} alternating rounds ==",
        bin.display(),
        opts.parallel,
        opts.rounds
    );
    let (mut bare, mut absolute) = (Vec::new(), Vec::new());
    for round in 0..opts.rounds {
        // Alternate which goes first, so a drift of the machine's load favours neither.
        let order: [&str; 2] = if round % 2 == 0 {
            ["true", "/bin/true"]
        } else {
            ["/bin/true", "true"]
        };
        for command in order {
            let data = dir.join(format!("serve-{round}-{}", command.replace('/', "_")));
            let rate = one_round(&bin, &data, command, n, opts.parallel)?;
            println!("round {round}: command {command:<10} {rate:8.0} lifecycles/s");
            if command == "true" {
                bare.push(rate);
            } else {
                absolute.push(rate);
            }
        }
    }
    let (b, a) = (median(&bare), median(&absolute));
    let ratio = b / a;
    let verdict = if ratio >= TARGET_RATIO {
        "PASS"
    } else {
        "BELOW TARGET"
    };
    summary.line(format!(
        "serve: N={n} P={} rounds={} bare_name_median={b:.0}/s absolute_path_median={a:.0}/s ratio={ratio:.3} target>={TARGET_RATIO} {verdict}",
        opts.parallel, opts.rounds
    ));
    Ok(())
}

/// `target/release/runwarden`, beside this example's directory.
fn serve_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("runwarden"))
        .ok_or("cannot locate the target directory")?;
    if bin.is_file() {
        let modified = |p: &Path| fs::metadata(p).and_then(|m| m.modified()).ok();
        if let (Some(b), Some(e)) = (modified(&bin), modified(&exe))
            && b < e
        {
            println!(
                "serve: warning: {} is older than this bench; `cargo build --release` to measure the current code",
                bin.display()
            );
        }
        Ok(bin)
    } else {
        Err(format!(
            "{} is missing: run `cargo build --release` first",
            bin.display()
        ))
    }
}

/// A `runwarden serve` child, killed (SIGKILL, by pid) and reaped on drop unless it already
/// exited — only on an error path: a round ends with a graceful shutdown, which ends the
/// workers (`shutdown = "terminate"`; each leads its own group, out of reach of this kill).
struct Serve(Child);

impl Drop for Serve {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            // SAFETY: a plain kill(2) of our own, unreaped child (its pid cannot be reused).
            unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
            let _ = self.0.wait();
        }
    }
}

/// One supervisor on a fresh data dir: N adds pipelined over the socket, then polls until all
/// are done; returns lifecycles/s from the first add.
fn one_round(
    bin: &Path,
    data: &Path,
    command: &str,
    n: usize,
    slots: usize,
) -> Result<f64, String> {
    fs::create_dir_all(data).map_err(|e| e.to_string())?;
    let config = data.join("config.toml");
    fs::write(
        &config,
        format!(
            "[supervisor]\ndata_dir = \"data\"\nmax_in_progress = {slots}\nshutdown = \"terminate\"\n\n\
             [assignees.w]\ncommand = [\"{command}\"]\nmax_in_progress = {slots}\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    let mut serve = Serve(
        Command::new(bin)
            .arg("--config")
            .arg(&config)
            .arg("serve")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", bin.display()))?,
    );
    let socket = data.join("data").join("control.sock");
    let mut client = connect(&socket, &mut serve)?;
    let start = Instant::now();
    add_pipelined(&mut client, n, WINDOW, |i| {
        NewTask::titled(format!("t{i}")).for_assignee("w")
    })?;
    let deadline = start + Duration::from_secs(60) + Duration::from_millis(20 * n as u64);
    loop {
        let status = client.status().map_err(|e| e.to_string())?;
        if status.counts.get("done").copied().unwrap_or(0) as usize >= n {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "`{command}`: not all {n} tasks done in time: {:?}",
                status.counts
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let rate = n as f64 / start.elapsed().as_secs_f64();
    let _ = client.shutdown();
    let exit_by = Instant::now() + Duration::from_secs(20);
    while matches!(serve.0.try_wait(), Ok(None)) && Instant::now() < exit_by {
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(rate)
}

/// Connects once the socket answers (or fails if `serve` exited).
fn connect(socket: &Path, serve: &mut Serve) -> Result<Client, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut c) = Client::connect(socket)
            && c.hello().is_ok()
        {
            return Ok(c);
        }
        if let Ok(Some(status)) = serve.0.try_wait() {
            return Err(format!("runwarden serve exited: {status}"));
        }
        if Instant::now() > deadline {
            return Err("runwarden serve never answered on its socket".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
