//! The spawn fingerprint: what names one process across pid reuse and reboots.

use std::sync::OnceLock;

use super::{Pid, ProcessError, read_stat};

/// Identity of a spawned process: survives pid reuse checks.
///
/// `start_ticks` (field 22 of `/proc/<pid>/stat`) only means something within one boot, hence the
/// boot id beside it: a fingerprint recorded before a reboot names no process of this boot.
///
/// A start time counts in clock ticks (10 ms at the usual USER_HZ of 100): a process given the
/// same pid within the same tick — which takes placing the pid on purpose (`ns_last_pid`,
/// clone3's `set_tid`), or a pid namespace small enough to wrap within 10 ms — has the same
/// start time. `pidfs_ino` tells those apart: the inode number of the process's pidfd on pidfs
/// (Linux 6.9), which names one process of this boot and is never given to another. Recorded
/// for the workers runwarden starts (from the pidfd their start hands back) where the kernel
/// has pidfs; `None` elsewhere (older kernels, processes found by a `/proc` scan, rows from
/// before schema v9), and then the start time alone decides, as before.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint {
    /// `/proc/sys/kernel/random/boot_id` of the boot the process was started in.
    pub boot_id: String,
    /// Start time of the process after boot, in clock ticks.
    pub start_ticks: u64,
    /// The inode number of the process's pidfd on pidfs, when known (see above).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pidfs_ino: Option<u64>,
}

const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// The current boot id (`/proc/sys/kernel/random/boot_id`, trimmed).
///
/// It cannot change while we run, so the first successful read is cached; a failed read is not
/// cached, so a transient failure does not stick.
pub fn boot_id() -> Result<String, ProcessError> {
    static BOOT_ID: OnceLock<String> = OnceLock::new();
    if let Some(id) = BOOT_ID.get() {
        return Ok(id.clone());
    }
    let text = std::fs::read_to_string(BOOT_ID_PATH).map_err(|source| ProcessError::System {
        what: "read /proc/sys/kernel/random/boot_id",
        source,
    })?;
    let id = text.trim();
    if id.is_empty() {
        // An empty id would make every fingerprint of every boot look alike.
        return Err(ProcessError::System {
            what: "read /proc/sys/kernel/random/boot_id",
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, "empty boot id"),
        });
    }
    Ok(BOOT_ID.get_or_init(|| id.to_owned()).clone())
}

/// CLOCK_BOOTTIME in ns, as this process sees it: the clock the kernel stamps a new process's
/// start with (in the parent's clone call), which `/proc/<pid>/stat` shows in clock ticks.
pub fn boottime_ns() -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write to.
    if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
        return None;
    }
    u64::try_from(ts.tv_sec)
        .ok()?
        .checked_mul(1_000_000_000)?
        .checked_add(u64::try_from(ts.tv_nsec).ok()?)
}

/// The start time, in clock ticks, of a process this thread created between two readings of
/// [`boottime_ns`] — without reading `/proc`. The kernel stamps the child in the clone call
/// (`start_boottime`, CLOCK_BOOTTIME, on the calling thread), so the stamp lies between the
/// readings, and `/proc/<pid>/stat` shows it as whole ticks (the same namespace offsets
/// apply to both). When both readings fall in one tick, so does the stamp: that tick is the
/// answer. `None` when they straddle a tick boundary (read `/proc` then: about one start in
/// seventy on an idle machine, most of them on a loaded one, as the bracket spans the child's
/// exec), or when a tick is not a whole number of ns.
pub fn start_ticks_between(before_ns: u64, after_ns: u64) -> Option<u64> {
    static NS_PER_TICK: OnceLock<Option<u64>> = OnceLock::new();
    let ns_per_tick = (*NS_PER_TICK.get_or_init(|| {
        // SAFETY: sysconf takes no pointer.
        let hz = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok()?;
        // The kernel divides by NSEC_PER_SEC / USER_HZ only when that is exact.
        (hz > 0 && 1_000_000_000 % hz == 0).then(|| 1_000_000_000 / hz)
    }))?;
    let tick = before_ns / ns_per_tick;
    (before_ns <= after_ns && after_ns / ns_per_tick == tick).then_some(tick)
}

/// The fingerprint of a child this thread just started, `pid`, whose start time the clock
/// bracketed (`bracketed`, from `start_ticks_between`) or not (`None`: read from `/proc`).
///
/// The clock is trusted once checked: the first bracketed start, and every 256th after it, is
/// also read from `/proc` and compared. A mismatch (an `LD_PRELOAD`ed `clock_gettime`, such
/// as libfaketime's, that shifts CLOCK_BOOTTIME) turns the clock off for good, with a
/// warning: a wrong start time would make every later check call our own worker a stranger.
pub fn fingerprint_of_child(pid: Pid, bracketed: Option<u64>) -> Result<Fingerprint, ProcessError> {
    static CHECK: ClockCheck = ClockCheck::new();
    CHECK.fingerprint(pid, bracketed)
}

/// The state behind [`fingerprint_of_child`] (one per process; tests make their own).
struct ClockCheck {
    /// Bracketed starts seen.
    seen: std::sync::atomic::AtomicU64,
    /// A check found the clock wrong: `/proc` from then on.
    off: std::sync::atomic::AtomicBool,
}

/// Every this many bracketed starts, one is checked against `/proc` (the first one too).
const CHECK_EVERY: u64 = 256;

impl ClockCheck {
    const fn new() -> ClockCheck {
        ClockCheck {
            seen: std::sync::atomic::AtomicU64::new(0),
            off: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn fingerprint(&self, pid: Pid, bracketed: Option<u64>) -> Result<Fingerprint, ProcessError> {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(ticks) = bracketed.filter(|_| !self.off.load(Relaxed)) else {
            return fingerprint(pid);
        };
        if !self.seen.fetch_add(1, Relaxed).is_multiple_of(CHECK_EVERY) {
            return Ok(Fingerprint {
                boot_id: boot_id()?,
                start_ticks: ticks,
                pidfs_ino: None,
            });
        }
        let read = fingerprint(pid)?;
        if read.start_ticks != ticks {
            self.off.store(true, Relaxed);
            tracing::warn!(
                pid,
                clock = ticks,
                proc = read.start_ticks,
                "the clock does not give a new process's start time as /proc does \
                 (an LD_PRELOADed clock_gettime?): reading /proc for every start from now on"
            );
        }
        Ok(read)
    }
}

/// The fingerprint of `pid` now: the current boot id and the process's start time.
pub fn fingerprint(pid: Pid) -> Result<Fingerprint, ProcessError> {
    Ok(Fingerprint {
        boot_id: boot_id()?,
        start_ticks: read_stat(pid)?.start_ticks,
        pidfs_ino: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boot_id_is_stable_and_nonempty() {
        let first = boot_id().unwrap();
        assert_eq!(first.len(), 36, "a UUID: {first:?}");
        assert_eq!(boot_id().unwrap(), first);
    }

    #[test]
    fn a_start_is_known_from_the_clock_only_when_both_readings_share_a_tick() {
        // USER_HZ is 100 on Linux: 10 ms per tick.
        let tick = 10_000_000;
        assert_eq!(start_ticks_between(5 * tick, 5 * tick + 1), Some(5));
        assert_eq!(start_ticks_between(6 * tick - 1, 6 * tick - 1), Some(5));
        assert_eq!(
            start_ticks_between(6 * tick - 1, 6 * tick),
            None,
            "straddles"
        );
        assert_eq!(start_ticks_between(6 * tick, 5 * tick), None, "backwards");
    }

    #[test]
    fn a_child_started_between_two_readings_has_the_start_proc_shows() {
        // Many children, so that some start in each part of a tick; those whose readings
        // straddle a tick are not judged. Under load most straddle (the bracket spans the
        // child's exec): children are started until 100 are judged, or for 20 s.
        let mut judged = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while judged < 100 && std::time::Instant::now() < deadline {
            let before = boottime_ns().expect("CLOCK_BOOTTIME");
            let mut child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("spawn sleep");
            let after = boottime_ns().expect("CLOCK_BOOTTIME");
            let pid = child.id() as Pid;
            let from_proc = read_stat(pid).map(|s| s.start_ticks);
            child.kill().expect("kill sleep");
            child.wait().expect("reap sleep");
            if let Some(ticks) = start_ticks_between(before, after) {
                assert_eq!(Ok(ticks), from_proc.map_err(|e| e.to_string()));
                judged += 1;
            }
        }
        assert!(
            judged >= 10,
            "only {judged} starts in 20 s fell within one tick: nothing to judge"
        );
    }

    #[test]
    fn a_clock_that_disagrees_with_proc_is_turned_off() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as Pid;
        let truth = fingerprint(pid).expect("its stat");
        let check = ClockCheck::new();
        // Checked on the first start: a wrong clock is caught, the truth returned.
        let wrong = Some(truth.start_ticks + 1);
        assert_eq!(check.fingerprint(pid, wrong).expect("fingerprint"), truth);
        // And from then on /proc is read, whatever the clock says.
        for _ in 0..3 {
            assert_eq!(check.fingerprint(pid, wrong).expect("fingerprint"), truth);
        }
        // A right clock, once checked, is used without reading /proc between checks.
        let trusting = ClockCheck::new();
        let right = Some(truth.start_ticks);
        assert_eq!(trusting.fingerprint(pid, right).expect("checked"), truth);
        let unchecked = trusting.fingerprint(pid, Some(7)).expect("trusted");
        assert_eq!(
            unchecked.start_ticks, 7,
            "between checks the clock is taken as it is"
        );
        child.kill().expect("kill sleep");
        child.wait().expect("reap sleep");
    }

    #[test]
    fn fingerprint_of_self_is_stable() {
        let me = std::process::id() as Pid;
        assert_eq!(fingerprint(me).unwrap(), fingerprint(me).unwrap());
    }

    #[test]
    fn fingerprint_of_missing_pid_is_no_such_process() {
        assert!(fingerprint(1 << 23).unwrap_err().is_no_such_process());
    }

    #[test]
    fn fingerprint_round_trips_through_json() {
        let mut fp = Fingerprint {
            boot_id: "b".into(),
            start_ticks: 7,
            pidfs_ino: None,
        };
        let json = serde_json::to_string(&fp).unwrap();
        assert_eq!(json, r#"{"boot_id":"b","start_ticks":7}"#);
        assert_eq!(serde_json::from_str::<Fingerprint>(&json).unwrap(), fp);
        fp.pidfs_ino = Some(u64::MAX);
        let json = serde_json::to_string(&fp).unwrap();
        assert_eq!(serde_json::from_str::<Fingerprint>(&json).unwrap(), fp);
    }
}
