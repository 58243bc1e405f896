//! Small helpers shared by the bench scenarios: clock, percentiles, temp dir, summary block.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall-clock nanoseconds since the Unix epoch (the same clock `date +%s%N` and the board's
/// millisecond timestamps use).
pub fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// Nearest-rank percentile (`p` in 0..=100) of unsorted samples; NaN when empty.
pub fn percentile(samples: &[f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// Median (mean of the two middle values for an even count); NaN when empty.
pub fn median(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut v = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

pub fn mean(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.iter().sum::<f64>() / samples.len() as f64
}

/// "p50=1.23 p99=4.56 max=7.89" in the given unit.
pub fn p50_p99(samples: &[f64]) -> String {
    format!(
        "p50={:.2} p99={:.2} max={:.2}",
        percentile(samples, 50.0),
        percentile(samples, 99.0),
        percentile(samples, 100.0)
    )
}

/// A directory under `std::env::temp_dir()`, removed on drop unless kept.
pub struct TempDir {
    path: PathBuf,
    keep: bool,
}

impl TempDir {
    pub fn new(prefix: &str, keep: bool) -> TempDir {
        let path =
            std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), now_ns()));
        std::fs::create_dir_all(&path).expect("create the bench's temp dir");
        TempDir { path, keep }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.keep {
            println!("bench: kept {}", self.path.display());
        } else if let Err(e) = std::fs::remove_dir_all(&self.path) {
            eprintln!("bench: cannot remove {}: {e}", self.path.display());
        }
    }
}

/// The copy-pasteable block printed at the end.
#[derive(Default)]
pub struct Summary {
    lines: Vec<String>,
    pub below_target: bool,
}

impl Summary {
    pub fn line(&mut self, s: impl Into<String>) {
        self.lines.push(s.into());
    }

    /// Records a target verdict and returns its label.
    pub fn verdict(&mut self, pass: bool) -> &'static str {
        if pass {
            "PASS"
        } else {
            self.below_target = true;
            "BELOW TARGET"
        }
    }

    pub fn print(&self) {
        println!();
        println!("=== runwarden bench summary ===");
        for l in &self.lines {
            println!("{l}");
        }
        println!("=== end summary ===");
    }
}

/// Scheduler accounting of every thread of this process, by tid: (name, ns on a CPU, ns
/// waiting for a CPU on a run queue), from `/proc/self/task/<tid>/{comm,schedstat}`.
pub fn thread_ticks() -> std::collections::HashMap<u32, (String, u64, u64)> {
    let mut out = std::collections::HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let (Ok(comm), Ok(sched)) = (
            std::fs::read_to_string(e.path().join("comm")),
            std::fs::read_to_string(e.path().join("schedstat")),
        ) else {
            continue;
        };
        let mut f = sched
            .split_whitespace()
            .map(|x| x.parse::<u64>().unwrap_or(0));
        let (run, wait) = (f.next().unwrap_or(0), f.next().unwrap_or(0));
        out.insert(tid, (comm.trim().to_string(), run, wait));
    }
    out
}

/// Per-thread-name use between two [`thread_ticks`] snapshots over `wall`, busiest first:
/// "name cpu 40% runq 10% (xN)" — on a CPU, and runnable but waiting for one (the rest of
/// the wall time the thread was blocked or idle). A thread alive only at `after` counts from 0.
pub fn thread_cpu_report(
    before: &std::collections::HashMap<u32, (String, u64, u64)>,
    after: &std::collections::HashMap<u32, (String, u64, u64)>,
    wall: std::time::Duration,
) -> String {
    let mut by_name: std::collections::BTreeMap<String, (u64, u64, usize)> = Default::default();
    for (tid, (comm, run, wait)) in after {
        let (r0, w0) = before.get(tid).map(|(_, r, w)| (*r, *w)).unwrap_or((0, 0));
        let e = by_name.entry(comm.clone()).or_default();
        e.0 += run.saturating_sub(r0);
        e.1 += wait.saturating_sub(w0);
        e.2 += 1;
    }
    let mut v: Vec<_> = by_name
        .into_iter()
        .filter(|(_, (r, _, _))| *r > 0)
        .collect();
    v.sort_by_key(|e| std::cmp::Reverse(e.1.0));
    let total: u64 = v.iter().map(|(_, (r, _, _))| r).sum();
    let pct = |ns: u64| ns as f64 / 1e9 / wall.as_secs_f64() * 100.0;
    let parts: Vec<String> = v
        .iter()
        .take(5)
        .map(|(name, (r, w, n))| {
            let count = if *n > 1 {
                format!("(x{n})")
            } else {
                String::new()
            };
            format!("{name}{count} cpu {:.0}% runq {:.0}%", pct(*r), pct(*w))
        })
        .collect();
    format!(
        "{} | process cpu {:.0}% of one core",
        parts.join(", "),
        pct(total)
    )
}

/// CPU time used so far, in µs: (this process's own threads, its reaped children).
pub fn cpu_us() -> (f64, f64) {
    let usage = |who| {
        // SAFETY: getrusage only writes the struct it is given.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(who, &mut u) };
        let us = |t: libc::timeval| t.tv_sec as f64 * 1e6 + t.tv_usec as f64;
        us(u.ru_utime) + us(u.ru_stime)
    };
    (usage(libc::RUSAGE_SELF), usage(libc::RUSAGE_CHILDREN))
}

/// CPU per run between two [`cpu_us`] readings: (own, children).
pub fn cpu_per_run(before: (f64, f64), after: (f64, f64), runs: usize) -> (f64, f64) {
    let n = runs.max(1) as f64;
    ((after.0 - before.0) / n, (after.1 - before.1) / n)
}

/// Adds `n` tasks (`task(i)`) over `client`, keeping `window` requests in flight; fails on the
/// first refusal.
pub fn add_pipelined(
    client: &mut runwarden::control::client::Client,
    n: usize,
    window: usize,
    task: impl Fn(usize) -> runwarden::board::NewTask,
) -> Result<(), String> {
    use runwarden::control::protocol::{Request, Response};
    let (mut sent, mut acked) = (0usize, 0usize);
    while acked < n {
        while sent < n && sent - acked < window {
            client
                .send(&Request::AddTask(task(sent)))
                .map_err(|e| e.to_string())?;
            sent += 1;
        }
        client.flush().map_err(|e| e.to_string())?;
        match client.recv().map_err(|e| e.to_string())? {
            Response::Ok { .. } => acked += 1,
            other => return Err(format!("add refused: {other:?}")),
        }
    }
    Ok(())
}
