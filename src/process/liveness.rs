//! Liveness verdicts and process-group scans.

use super::{Fingerprint, Pid, ProcStat, ProcessError, boot_id, read_stat};

/// Whether the process a fingerprint names is still running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    /// The pid holds the fingerprinted process and it has not exited.
    Alive,
    /// Proven dead (or never of this boot); the reason is the proof.
    Dead(DeadReason),
    /// A probe failed, so nothing is proven either way. Never signalled, never cleared.
    Unknown(String),
}

/// The proof behind [`Liveness::Dead`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadReason {
    /// No process has the pid.
    NoSuchProcess,
    /// The process has exited and waits to be reaped (state `Z` or `X`).
    Zombie,
    /// The fingerprint was taken in another boot.
    OtherBoot,
    /// The pid now holds another process (another start time).
    Recycled,
}

impl DeadReason {
    /// Stable snake_case name, for events and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            DeadReason::NoSuchProcess => "no_such_process",
            DeadReason::Zombie => "zombie",
            DeadReason::OtherBoot => "other_boot",
            DeadReason::Recycled => "pid_recycled",
        }
    }
}

impl std::fmt::Display for DeadReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Dead only with proof: no such pid, a zombie (state Z or X), another boot id, another start
/// time or pidfs inode (= Recycled). Any probe that fails otherwise (EACCES, parse error, unreadable boot_id) is
/// `Unknown(reason)`. The boot id is checked first: a fingerprint from another boot is
/// `Dead(OtherBoot)` without looking at the pid, which may belong to anyone in this boot.
pub fn liveness(pid: Pid, expected: &Fingerprint) -> Liveness {
    if let Some(verdict) = check_boot(expected) {
        return verdict;
    }
    match read_stat(pid) {
        // The start time matched: a pidfs inode on record has the last word (see Fingerprint).
        Ok(stat) => match verdict(&stat, expected) {
            Liveness::Dead(DeadReason::Recycled) => Liveness::Dead(DeadReason::Recycled),
            other => super::pidfd::pidfs_verdict(pid, expected).unwrap_or(other),
        },
        Err(ProcessError::NoSuchProcess { .. }) => Liveness::Dead(DeadReason::NoSuchProcess),
        Err(err) => Liveness::Unknown(err.to_string()),
    }
}

/// `Some(verdict)` when the boot id alone decides: another boot, or an unreadable boot id.
pub(crate) fn check_boot(expected: &Fingerprint) -> Option<Liveness> {
    match boot_id() {
        Ok(id) if id == expected.boot_id => None,
        Ok(_) => Some(Liveness::Dead(DeadReason::OtherBoot)),
        Err(err) => Some(Liveness::Unknown(err.to_string())),
    }
}

/// The verdict for a stat read in the current boot.
pub(crate) fn verdict(stat: &ProcStat, expected: &Fingerprint) -> Liveness {
    // Start time first: a zombie that is somebody else's says nothing about ours.
    if stat.start_ticks != expected.start_ticks {
        Liveness::Dead(DeadReason::Recycled)
    } else if stat.is_zombie() {
        Liveness::Dead(DeadReason::Zombie)
    } else {
        Liveness::Alive
    }
}

/// Group liveness: true while any process other than a zombie has pgrp == pgid (scan
/// /proc/*/stat; entries that vanish mid-scan are skipped).
///
/// If /proc cannot be listed at all, or an entry is listed but its stat cannot be read (it
/// could be a member), the answer is true: an empty group must be proven, since "gone" ends
/// the waiting and the escalation to SIGKILL.
pub fn group_alive(pgid: Pid) -> bool {
    if !names_a_group(pgid) {
        return false;
    }
    let Some(pids) = proc_pids() else {
        return true;
    };
    let mut unreadable = false;
    for pid in pids {
        match read_stat(pid) {
            // Short-circuits on the first live member.
            Ok(stat) if stat.pgrp == pgid && !stat.is_zombie() => return true,
            Ok(_) | Err(ProcessError::NoSuchProcess { .. }) => {}
            Err(_) => unreadable = true,
        }
    }
    unreadable
}

/// All live (non-zombie) pids in process group pgid (empty if /proc cannot be listed).
pub fn group_members(pgid: Pid) -> Vec<Pid> {
    if !names_a_group(pgid) {
        return Vec::new();
    }
    let mut pids: Vec<Pid> = group_scan(pgid).into_iter().flatten().collect();
    pids.sort_unstable();
    pids
}

/// 0 and negative ids mean "my group" and "everyone" to kill(2), never a worker's group.
fn names_a_group(pgid: Pid) -> bool {
    pgid > 0
}

/// Live members of `pgid`; `None` when /proc cannot be listed.
fn group_scan(pgid: Pid) -> Option<impl Iterator<Item = Pid>> {
    Some(
        all_stats()?
            .filter(move |stat| stat.pgrp == pgid && !stat.is_zombie())
            .map(|stat| stat.pid),
    )
}

/// Every process's stat, skipping entries that vanish or cannot be read mid-scan; `None` when
/// /proc itself cannot be listed.
pub(crate) fn all_stats() -> Option<impl Iterator<Item = ProcStat>> {
    Some(proc_pids()?.filter_map(|pid| read_stat(pid).ok()))
}

/// Every process's stat, skipping entries that vanish mid-scan or are refused for good
/// ([`ProcessError::is_refused`]); an `Err` when the scan cannot be complete (/proc cannot be
/// listed, or a live process's stat cannot be read for a passing reason: out of file
/// descriptors, say). For answers where a missing entry would read as "no such process".
pub(crate) fn all_stats_checked() -> Result<Vec<ProcStat>, ProcessError> {
    let dir = std::fs::read_dir("/proc").map_err(|source| ProcessError::System {
        what: "list /proc",
        source,
    })?;
    let mut stats = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|source| ProcessError::System {
            what: "list /proc",
            source,
        })?;
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        match read_stat(pid) {
            Ok(stat) => stats.push(stat),
            Err(e) if e.is_no_such_process() || e.is_refused() => {}
            Err(e) => return Err(e),
        }
    }
    Ok(stats)
}

/// The pids listed in /proc; `None` when it cannot be listed.
fn proc_pids() -> Option<impl Iterator<Item = Pid>> {
    let dir = match std::fs::read_dir("/proc") {
        Ok(dir) => dir,
        Err(err) => {
            tracing::warn!(error = %err, "cannot list /proc");
            return None;
        }
    };
    Some(dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse().ok()))
}

#[cfg(test)]
mod tests {
    use std::process::{Command, Stdio};
    use std::time::Duration;

    use super::*;
    use crate::process::fingerprint;
    use crate::process::testutil::wait_until;

    fn me() -> Pid {
        std::process::id() as Pid
    }

    fn quick_child() -> std::process::Child {
        Command::new("true")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn true")
    }

    #[test]
    fn own_pid_is_alive() {
        assert_eq!(liveness(me(), &fingerprint(me()).unwrap()), Liveness::Alive);
    }

    #[test]
    fn zombie_then_reaped_child() {
        let mut child = quick_child();
        let pid = child.id() as Pid;
        let fp = fingerprint(pid).unwrap();
        // Not reaped yet: the exited child stays a zombie, which is dead, not alive.
        assert!(
            wait_until(Duration::from_secs(10), || liveness(pid, &fp)
                == Liveness::Dead(DeadReason::Zombie)),
            "child never became a zombie: {:?}",
            liveness(pid, &fp)
        );
        child.wait().unwrap();
        assert_eq!(
            liveness(pid, &fp),
            Liveness::Dead(DeadReason::NoSuchProcess)
        );
    }

    #[test]
    fn wrong_start_ticks_is_recycled() {
        let mut fp = fingerprint(me()).unwrap();
        fp.start_ticks += 1;
        assert_eq!(liveness(me(), &fp), Liveness::Dead(DeadReason::Recycled));
    }

    #[test]
    fn wrong_boot_id_is_other_boot_even_for_a_missing_pid() {
        let mut fp = fingerprint(me()).unwrap();
        fp.boot_id = "00000000-0000-0000-0000-000000000000".into();
        assert_eq!(liveness(me(), &fp), Liveness::Dead(DeadReason::OtherBoot));
        assert_eq!(
            liveness(1 << 23, &fp),
            Liveness::Dead(DeadReason::OtherBoot)
        );
    }

    #[test]
    fn dead_reason_names() {
        let names: Vec<_> = [
            DeadReason::NoSuchProcess,
            DeadReason::Zombie,
            DeadReason::OtherBoot,
            DeadReason::Recycled,
        ]
        .iter()
        .map(DeadReason::as_str)
        .collect();
        assert_eq!(
            names,
            ["no_such_process", "zombie", "other_boot", "pid_recycled"]
        );
    }

    #[test]
    fn group_of_a_spawned_leader_is_alive_until_it_is_killed() {
        use std::os::unix::process::CommandExt;
        let mut child = Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as Pid;
        let alive = group_alive(pid);
        let members = group_members(pid);
        // End it by its own handle before asserting, so a failure leaves nothing behind.
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(alive);
        assert_eq!(members, [pid]);
        assert!(!group_alive(pid));
    }

    #[test]
    fn bogus_groups_are_never_alive() {
        assert!(!group_alive(0));
        assert!(!group_alive(-1));
        assert!(group_members(1 << 23).is_empty());
    }
}
