//! Performance benchmarks of runwarden.
//!
//! ```text
//! cargo run --release --example bench -- [lifecycle|store|socket|serve|replay|all] [options]   (--help lists them)
//! ```
//!
//! - `lifecycle`: N `/bin/true` tasks through the running actor system (a burst of N adds,
//!   first add → last `completed` event) against a plain loop spawning and waiting `/bin/true`
//!   N times with the same parallelism, alternated over a few rounds (medians). Then dispatch
//!   latency (task added → worker exec'd) and reap precision (run closed → worker dead, minus
//!   the grace), plus a micro-profile of the per-lifecycle costs.
//! - `store`: durable event appends per second through the StoreActor (group commit, FULL)
//!   against one transaction per append on a plain `Board`.
//! - `serve`: the real `runwarden serve` binary (`cargo build --release` first) with workers
//!   given as a bare name (`true`) against an absolute path (`/bin/true`).
//! - `replay`: the board's work of N lifecycles on one thread, no supervisor (steady, and
//!   deterministic under callgrind): the board's share of a lifecycle, for comparing changes.
//!
//! Everything runs in a temporary directory under `std::env::temp_dir()`, removed at the end.
//! The bench binary doubles as the dispatch-latency probe worker (`bench __probe`).

#[path = "bench/lifecycle.rs"]
mod lifecycle;
#[path = "bench/replay.rs"]
mod replay;
#[path = "bench/serve.rs"]
mod serve;
#[path = "bench/socket.rs"]
mod socket;
#[path = "bench/store.rs"]
mod store;
#[path = "bench/util.rs"]
mod util;

use std::process::ExitCode;
use std::time::Duration;

use util::Summary;

/// Which command the dispatch-latency probe assignee runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The bench binary itself (`bench __probe`): writes its clock as the first thing in main.
    SelfExe,
    /// `/bin/sh -c '…; date +%s%N > "$OUT/$RUNWARDEN_TASK_ID"'`: adds sh and date start-up.
    Sh,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Lifecycle,
    Store,
    Socket,
    Replay,
    Serve,
    All,
}

/// Command-line options (see `--help`).
#[derive(Debug, Clone)]
pub struct Opts {
    scenario: Scenario,
    /// Lifecycle: tasks per round.
    pub tasks: usize,
    /// Store: events appended through the StoreActor.
    pub events: usize,
    /// Lifecycle: worker slots (assignee and global max_in_progress) = baseline threads.
    pub parallel: usize,
    pub rounds: usize,
    pub sync_full: bool,
    pub strict: bool,
    pub latency_samples: usize,
    pub latency_gap: Duration,
    pub reap_samples: usize,
    pub grace: Duration,
    pub probe: Probe,
    /// Store: concurrent callers, each awaiting one append at a time.
    pub callers: usize,
    /// socket: pipelined adds per round.
    pub adds: usize,
    /// socket: one-at-a-time adds per round.
    pub single_adds: usize,
    /// Store: most single-transaction appends in the baseline (the rate is extrapolated).
    pub baseline_cap: usize,
    pub skip_latency: bool,
    pub skip_reap: bool,
    pub skip_profile: bool,
    pub keep_dir: bool,
}

const HELP: &str = "\
runwarden bench

USAGE:
    cargo run --release --example bench -- [SCENARIO] [OPTIONS]

SCENARIOS:
    lifecycle   (default) /bin/true tasks through the supervisor vs a plain spawn+wait loop,
                then dispatch latency, reap precision and a per-lifecycle micro-profile
    store       durable event appends/s through the StoreActor (group commit) vs one tx each
    socket      task adds over the control socket (pipelined, one at a time) vs in-process
    serve       the runwarden binary (cargo build --release first): workers given as `true`
                (looked up in PATH) vs `/bin/true`, --tasks each
    replay      the board work of --tasks lifecycles on one thread (no supervisor, no
                processes): µs per lifecycle; run it under callgrind to count instructions
    all         lifecycle, store and socket

OPTIONS:
    --n N                  N of the chosen scenario (lifecycle, serve, replay: tasks; store: events;
                           socket: pipelined adds)
    --tasks N              lifecycle / serve / replay tasks per round [default: 2000]
    --events N             store events                            [default: 100000]
    --adds N               socket: pipelined adds per round         [default: 20000]
    --single-adds N        socket: one-at-a-time adds per round     [default: 1000]
    -p, --parallel P       lifecycle worker slots / baseline threads [default: 8]
    --rounds R             alternating baseline/supervised rounds  [default: 3]
    --sync full|normal     SQLite synchronous (lifecycle, replay)  [default: full]
    --latency-samples K    dispatch-latency tasks (added one by one) [default: 200]
    --latency-gap-ms MS    pause between those adds                [default: 5]
    --probe self|sh        latency probe worker: this binary, or sh -c '...date +%s%N...'
                                                                   [default: self]
    --reap-samples K       reap-precision samples (sleep 300 workers) [default: 30]
    --grace-ms MS          reaper grace for the reap-precision phase [default: 200]
    --callers C            store: concurrent callers               [default: 64]
    --baseline-cap K       store: single-tx appends in the baseline [default: 2000]
    --no-latency           skip the dispatch-latency phase
    --no-reap              skip the reap-precision phase
    --no-profile           skip the lifecycle micro-profile
    --keep-dir             keep the temporary directory (its path is printed)
    --strict               exit 1 when a target is missed
    -h, --help             this text

TARGETS:
    lifecycle: supervised lifecycles/s >= 0.7 x plain spawns/s (ratio of medians)
    store:     >= 50000 durable event writes/s with group commit (synchronous = FULL)
    socket:    >= 20000 task adds/s from one pipelining client
    serve:     workers named `true` >= 0.9 x the rate of `/bin/true` (ratio of medians)
";

fn parse_args() -> Result<Option<Opts>, String> {
    let mut o = Opts {
        scenario: Scenario::Lifecycle,
        tasks: 2000,
        events: 100_000,
        parallel: 8,
        rounds: 3,
        sync_full: true,
        strict: false,
        latency_samples: 200,
        latency_gap: Duration::from_millis(5),
        reap_samples: 30,
        grace: Duration::from_millis(200),
        probe: Probe::SelfExe,
        callers: 64,
        adds: 20_000,
        single_adds: 1_000,
        baseline_cap: 2000,
        skip_latency: false,
        skip_reap: false,
        skip_profile: false,
        keep_dir: false,
    };
    let mut n: Option<usize> = None;
    let mut scenario_seen = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs a value"))
        };
        let num = |name: &str, v: String| -> Result<usize, String> {
            v.replace('_', "")
                .parse::<usize>()
                .map_err(|_| format!("{name}: `{v}` is not a number"))
        };
        match key.as_str() {
            "-h" | "--help" => return Ok(None),
            "lifecycle" | "store" | "socket" | "replay" | "serve" | "all" if !scenario_seen => {
                scenario_seen = true;
                o.scenario = match key.as_str() {
                    "lifecycle" => Scenario::Lifecycle,
                    "store" => Scenario::Store,
                    "socket" => Scenario::Socket,
                    "replay" => Scenario::Replay,
                    "serve" => Scenario::Serve,
                    _ => Scenario::All,
                };
            }
            "--n" | "-n" => n = Some(num(&key, value(&key)?)?),
            "--tasks" => o.tasks = num(&key, value(&key)?)?,
            "--events" => o.events = num(&key, value(&key)?)?,
            "-p" | "--parallel" => o.parallel = num(&key, value(&key)?)?,
            "--rounds" => o.rounds = num(&key, value(&key)?)?,
            "--sync" => {
                o.sync_full = match value(&key)?.to_ascii_lowercase().as_str() {
                    "full" => true,
                    "normal" => false,
                    other => return Err(format!("--sync: `{other}` is neither full nor normal")),
                }
            }
            "--latency-samples" => o.latency_samples = num(&key, value(&key)?)?,
            "--latency-gap-ms" => {
                o.latency_gap = Duration::from_millis(num(&key, value(&key)?)? as u64)
            }
            "--probe" => {
                o.probe = match value(&key)?.as_str() {
                    "self" => Probe::SelfExe,
                    "sh" => Probe::Sh,
                    other => return Err(format!("--probe: `{other}` is neither self nor sh")),
                }
            }
            "--reap-samples" => o.reap_samples = num(&key, value(&key)?)?,
            "--grace-ms" => o.grace = Duration::from_millis(num(&key, value(&key)?)? as u64),
            "--callers" => o.callers = num(&key, value(&key)?)?,
            "--adds" => o.adds = num(&key, value(&key)?)?,
            "--single-adds" => o.single_adds = num(&key, value(&key)?)?,
            "--baseline-cap" => o.baseline_cap = num(&key, value(&key)?)?,
            "--no-latency" => o.skip_latency = true,
            "--no-reap" => o.skip_reap = true,
            "--no-profile" => o.skip_profile = true,
            "--keep-dir" => o.keep_dir = true,
            "--strict" => o.strict = true,
            other => return Err(format!("unknown argument `{other}` (see --help)")),
        }
    }
    if let Some(n) = n {
        match o.scenario {
            Scenario::Lifecycle | Scenario::Replay | Scenario::Serve => o.tasks = n,
            Scenario::Store => o.events = n,
            Scenario::Socket => o.adds = n,
            Scenario::All => {
                return Err("with `all`, use --tasks and --events instead of --n".into());
            }
        }
    }
    if o.tasks == 0 || o.events == 0 || o.parallel == 0 || o.rounds == 0 || o.callers == 0 {
        return Err(
            "--tasks, --events, --parallel, --rounds and --callers must be at least 1".into(),
        );
    }
    Ok(Some(o))
}

fn main() -> ExitCode {
    // The dispatch-latency probe: record the clock before doing anything else.
    if std::env::args().nth(1).as_deref() == Some("__probe") {
        return lifecycle::probe_main();
    }
    let opts = match parse_args() {
        Ok(Some(o)) => o,
        Ok(None) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("bench: {e}");
            return ExitCode::from(2);
        }
    };
    let dir = util::TempDir::new("runwarden-bench", opts.keep_dir);
    println!("bench: working in {}", dir.path().display());
    let mut summary = Summary::default();
    let mut failed = false;
    if matches!(opts.scenario, Scenario::Lifecycle | Scenario::All)
        && let Err(e) = lifecycle::run(&opts, dir.path(), &mut summary)
    {
        eprintln!("bench: lifecycle failed: {e}");
        summary.line(format!("lifecycle: ERROR {e}"));
        failed = true;
    }
    if matches!(opts.scenario, Scenario::Store | Scenario::All)
        && let Err(e) = store::run(&opts, dir.path(), &mut summary)
    {
        eprintln!("bench: store failed: {e}");
        summary.line(format!("store: ERROR {e}"));
        failed = true;
    }
    if matches!(opts.scenario, Scenario::Socket | Scenario::All)
        && let Err(e) = socket::run(&opts, dir.path(), &mut summary)
    {
        eprintln!("bench: socket failed: {e}");
        summary.line(format!("socket: ERROR {e}"));
        failed = true;
    }
    if opts.scenario == Scenario::Serve
        && let Err(e) = serve::run(&opts, dir.path(), &mut summary)
    {
        eprintln!("bench: serve failed: {e}");
        summary.line(format!("serve: ERROR {e}"));
        failed = true;
    }
    if opts.scenario == Scenario::Replay
        && let Err(e) = replay::run(&opts, dir.path(), &mut summary)
    {
        eprintln!("bench: replay failed: {e}");
        summary.line(format!("replay: ERROR {e}"));
        failed = true;
    }
    summary.print();
    drop(dir);
    if failed || (opts.strict && summary.below_target) {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
