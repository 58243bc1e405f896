//! Signalling a worker's process group, and the SIGTERM → wait → SIGKILL sequences.

use std::time::{Duration, Instant};

use super::pidfd::{Checked, open_checked};
use super::{DeadReason, Fingerprint, Liveness, Pid, PidFd, ProcessError, Signal, group_alive};

/// How often group membership is re-scanned while waiting for a group to empty.
const GROUP_POLL: Duration = Duration::from_millis(10);

/// The outcome of [`Signaller::send`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// The signal was handed to the kernel for the verified process (or its group).
    Delivered,
    /// Nothing was sent: the pid is not provably the expected process; carries the verdict.
    NotOurs(Liveness),
}

/// Who sends signals. Tests inject a failing one.
pub trait Signaller: Send + Sync {
    /// Send `sig` to the process group led by `pid` (or, if it is no longer in the group its
    /// pid names, to it and to what is left of that group), only if `pid` is still the process
    /// `expected` names (verified through a pidfd held while signalling).
    fn send(&self, pid: Pid, expected: &Fingerprint, sig: Signal) -> Result<Sent, ProcessError>;

    /// Send `sig` to the group led by the process behind `leader`, a pidfd the caller has
    /// already verified and still holds.
    ///
    /// [`terminate`] needs this when the leader was reaped while its group lives on (a shell
    /// that died of SIGTERM while its children ignore it, reaped at once by its owner): `send`
    /// can no longer verify the pid, but the held pidfd still names the group and nothing else.
    /// An empty group is `NotOurs(Dead(NoSuchProcess))`.
    fn send_group(&self, leader: &PidFd, sig: Signal) -> Result<Sent, ProcessError> {
        sent(leader.signal_group(sig))
    }
}

/// The real signaller: pidfd + fingerprint re-check + group signal.
#[derive(Debug, Default, Clone, Copy)]
pub struct PidfdSignaller;

impl Signaller for PidfdSignaller {
    fn send(&self, pid: Pid, expected: &Fingerprint, sig: Signal) -> Result<Sent, ProcessError> {
        let (pidfd, stat) = match open_checked(pid, expected)? {
            Checked::Ours { pidfd, stat } => (pidfd, stat),
            Checked::NotOurs(verdict) => {
                tracing::debug!(pid, ?sig, ?verdict, "not signalled: not our process");
                return Ok(Sent::NotOurs(verdict));
            }
        };
        // pgrp comes from the stat read that verified the fingerprint, so it is this process's.
        let result = if stat.pgrp == pid {
            pidfd.signal_group(sig)
        } else {
            // It left the group it led: it gets its signal where it is, and what it left behind
            // gets the same. The pidfd names that group exactly (its members hold the same
            // `struct pid`, whose number nobody else can take while they live); no members: no
            // one to signal. The leader's signal is what counts: one the group's cannot reach
            // (a member of another uid's, say) is said, not made the leader's failure.
            pidfd.signal(sig).inspect(|()| match pidfd.signal_group(sig) {
                Ok(()) | Err(ProcessError::NoSuchProcess { .. }) => {}
                Err(e) => {
                    tracing::warn!(pid, ?sig, error = %e, "cannot signal the group a worker left")
                }
            })
        };
        tracing::debug!(
            pid,
            ?sig,
            leads_its_group = stat.pgrp == pid,
            ok = result.is_ok(),
            "signal"
        );
        sent(result)
    }
}

/// ESRCH after verification means it ended in between: nothing of ours was left to signal.
fn sent(result: Result<(), ProcessError>) -> Result<Sent, ProcessError> {
    match result {
        Ok(()) => Ok(Sent::Delivered),
        Err(ProcessError::NoSuchProcess { .. }) => {
            Ok(Sent::NotOurs(Liveness::Dead(DeadReason::NoSuchProcess)))
        }
        Err(err) => Err(err),
    }
}

/// How a terminate ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ended {
    /// Everything was gone before the kill timeout (SIGTERM sufficed, or it was already gone).
    Sigterm,
    /// Something outlived the timeout and SIGKILL was sent.
    Sigkill,
    /// Not provably our process: nothing was signalled (or, after SIGTERM, its state became
    /// unknowable); carries the verdict.
    NotOurs(Liveness),
}

impl Ended {
    /// Stable snake_case name, for events and logs.
    pub fn as_str(&self) -> &'static str {
        match self {
            Ended::Sigterm => "sigterm",
            Ended::Sigkill => "sigkill",
            Ended::NotOurs(_) => "not_ours",
        }
    }
}

/// SIGTERM to the group; wait (pidfd poll, then group_alive polling every ~10ms) up to
/// kill_timeout for the leader to exit AND the group to be empty; then SIGKILL the group if
/// anything is left. Returns Sigterm if everything ended before the deadline, Sigkill if SIGKILL
/// was needed. A leader that is a zombie counts as exited.
///
/// Every signal goes through `signaller` (so injected failures propagate as `Err`): `send` by pid
/// and fingerprint, and `send_group` through this function's own verified pidfd once the leader
/// can no longer be verified by pid (reaped meanwhile) while its group still lives. If the
/// process is not ours at the start, returns NotOurs without signalling.
pub fn terminate(
    signaller: &dyn Signaller,
    pid: Pid,
    expected: &Fingerprint,
    kill_timeout: Duration,
) -> Result<Ended, ProcessError> {
    match begin_terminate(signaller, pid, expected, kill_timeout)? {
        Begun::Signalled(terminating) => terminating.finish(),
        Begun::NotOurs(verdict) => Ok(Ended::NotOurs(verdict)),
    }
}

/// The first half of [`terminate`]: verifies the process and sends its SIGTERM. A caller that
/// ends more than the group (a run's escaped descendants) sends theirs before waiting, so the
/// whole tree shares one deadline (see `descendants::finish_tree_end`).
pub fn begin_terminate<'a>(
    signaller: &'a dyn Signaller,
    pid: Pid,
    expected: &'a Fingerprint,
    kill_timeout: Duration,
) -> Result<Begun<'a>, ProcessError> {
    // Our own verified pidfd, for waiting: it keeps naming the process (and its group) even if
    // the pid is reaped and reused while we wait.
    let (pidfd, stat) = match open_checked(pid, expected)? {
        Checked::Ours { pidfd, stat } => (pidfd, stat),
        Checked::NotOurs(verdict) => return Ok(Begun::NotOurs(verdict)),
    };
    let target = Terminating {
        signaller,
        pid,
        expected,
        // One that left the group it led, with members behind, is not ended before they are
        // (as far as can be told: a group that cannot be checked is not waited for).
        leads_group: stat.pgrp == pid || pidfd.group_exists().unwrap_or(false),
        pidfd,
        deadline: deadline_after(kill_timeout),
        kill_timeout,
    };
    Ok(match target.deliver(Signal::SIGTERM)? {
        None => Begun::Signalled(target),
        // It ended (or became unverifiable) between our check and the signaller's.
        Some(verdict) => Begun::NotOurs(verdict),
    })
}

/// What [`begin_terminate`] did.
pub enum Begun<'a> {
    /// SIGTERM went out (to the group its pid names, and to it where it left that group).
    Signalled(Terminating<'a>),
    /// Not provably our process: nothing was signalled; carries the verdict.
    NotOurs(Liveness),
}

/// A [`terminate`] whose SIGTERM has gone out.
pub struct Terminating<'a> {
    signaller: &'a dyn Signaller,
    pid: Pid,
    expected: &'a Fingerprint,
    pidfd: PidFd,
    /// The group its pid names (the one it was started to lead) is to be ended with it: it
    /// leads it, or left it with members behind.
    leads_group: bool,
    deadline: Instant,
    kill_timeout: Duration,
}

impl Terminating<'_> {
    /// The process being ended; its SIGTERM went to the group this pid numbers.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// When SIGKILL follows: `kill_timeout` after the SIGTERM.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Waits until the deadline for the process (and its group) to be gone, then SIGKILLs
    /// what is left and waits for that to be gone too.
    pub fn finish(self) -> Result<Ended, ProcessError> {
        if self.wait_ended(self.deadline)? {
            return Ok(Ended::Sigterm);
        }
        tracing::info!(
            pid = self.pid,
            kill_timeout = ?self.kill_timeout,
            "still running after SIGTERM; sending SIGKILL"
        );
        Ok(match self.deliver(Signal::SIGKILL)? {
            // "Ended" must mean gone: the caller clears the run's evidence on it, which makes the
            // task claimable again.
            None if self.wait_ended(deadline_after(AFTER_SIGKILL))? => Ended::Sigkill,
            None => {
                return Err(ProcessError::SurvivedSigkill {
                    pid: self.pid,
                    after: AFTER_SIGKILL,
                });
            }
            // Proven gone just as the timeout ran out: SIGKILL was not needed after all.
            Some(Liveness::Dead(_)) => Ended::Sigterm,
            Some(verdict) => Ended::NotOurs(verdict),
        })
    }

    /// Sends `sig`; `Some(verdict)` if nothing of ours was left to receive it.
    fn deliver(&self, sig: Signal) -> Result<Option<Liveness>, ProcessError> {
        let verdict = match self.signaller.send(self.pid, self.expected, sig)? {
            Sent::Delivered => return Ok(None),
            Sent::NotOurs(verdict) => verdict,
        };
        // The leader is provably gone (reaped, maybe its pid reused), but the group our pidfd
        // pins may live on. An Unknown verdict is not acted upon: nothing is proven then.
        if self.leads_group && matches!(verdict, Liveness::Dead(_)) && !group_gone(&self.pidfd)? {
            return Ok(match self.signaller.send_group(&self.pidfd, sig)? {
                Sent::Delivered => None,
                Sent::NotOurs(verdict) => Some(verdict),
            });
        }
        Ok(Some(verdict))
    }

    /// Waits until the leader has exited and (if it leads a group) the group is empty.
    fn wait_ended(&self, deadline: Instant) -> Result<bool, ProcessError> {
        let exited = self.pidfd.wait_exit(time_left(deadline))?;
        if !exited || !self.leads_group {
            return Ok(exited);
        }
        wait_group_gone(&self.pidfd, deadline)
    }
}

/// Ends a group given a pidfd we already hold for its leader (our own child, possibly already
/// exited/reaped): SIGTERM group, wait up to kill_timeout for group empty (zombies ignored),
/// SIGKILL group. ESRCH = already gone = fine.
///
/// A live process that leads no group (spawned without its own process group) is ended alone,
/// the same way, rather than silently skipped.
pub fn terminate_group(pidfd: &PidFd, kill_timeout: Duration) -> Result<Ended, ProcessError> {
    let deadline = deadline_after(kill_timeout);
    match pidfd.signal_group(Signal::SIGTERM) {
        Ok(()) => finish_group_end(pidfd, deadline),
        Err(ProcessError::NoSuchProcess { .. }) => {
            if pidfd.wait_exit(Duration::ZERO)? {
                Ok(Ended::Sigterm)
            } else {
                terminate_alone(pidfd, deadline)
            }
        }
        Err(err) => Err(err),
    }
}

/// The rest of [`terminate_group`] for a group its caller has just sent SIGTERM (once: many
/// programs take a second SIGTERM as "stop now, skip the clean-up"): waits until `deadline`
/// for the group to be gone, then SIGKILLs what is left.
pub fn finish_group_end(pidfd: &PidFd, deadline: Instant) -> Result<Ended, ProcessError> {
    if wait_group_gone(pidfd, deadline)? {
        return Ok(Ended::Sigterm);
    }
    tracing::info!(
        pid = pidfd.pid(),
        "group still running after SIGTERM; sending SIGKILL"
    );
    match pidfd.signal_group(Signal::SIGKILL) {
        Ok(()) => {
            // SIGKILL cannot be ignored, but a member in uninterruptible sleep dies late:
            // "ended" must mean gone, since callers clear the run's evidence on it (and that
            // makes the task claimable again).
            if !wait_group_gone(pidfd, deadline_after(AFTER_SIGKILL))? {
                return Err(ProcessError::SurvivedSigkill {
                    pid: pidfd.pid(),
                    after: AFTER_SIGKILL,
                });
            }
            Ok(Ended::Sigkill)
        }
        Err(ProcessError::NoSuchProcess { .. }) => Ok(Ended::Sigterm),
        Err(err) => Err(err),
    }
}

/// How long [`terminate`] and [`terminate_group`] wait for a SIGKILLed worker to be gone.
pub(crate) const AFTER_SIGKILL: Duration = Duration::from_secs(5);

/// [`terminate_group`] for a process outside its own group: signals reach the process only.
fn terminate_alone(pidfd: &PidFd, deadline: Instant) -> Result<Ended, ProcessError> {
    let gone = |result: Result<(), ProcessError>| match result {
        Ok(()) => Ok(false),
        Err(ProcessError::NoSuchProcess { .. }) => Ok(true),
        Err(err) => Err(err),
    };
    if gone(pidfd.signal(Signal::SIGTERM))? || pidfd.wait_exit(time_left(deadline))? {
        return Ok(Ended::Sigterm);
    }
    if gone(pidfd.signal(Signal::SIGKILL))? {
        return Ok(Ended::Sigterm);
    }
    // "Ended" must mean gone, as for a group (see `terminate_group`).
    if !pidfd.wait_exit(AFTER_SIGKILL)? {
        return Err(ProcessError::SurvivedSigkill {
            pid: pidfd.pid(),
            after: AFTER_SIGKILL,
        });
    }
    Ok(Ended::Sigkill)
}

/// True once no live member of the pinned group is left.
///
/// Two proofs, either suffices: signal 0 through the pidfd finds no member at all (exact, but
/// zombies count as members), or no live process has the group's number as pgrp (skips
/// zombies; the number cannot be reused while any member, zombie or not, still carries it).
fn group_gone(pidfd: &PidFd) -> Result<bool, ProcessError> {
    // The syscall first: it is cheap, and a /proc scan is not.
    Ok(!pidfd.group_exists()? || !group_alive(pidfd.pid()))
}

fn wait_group_gone(pidfd: &PidFd, deadline: Instant) -> Result<bool, ProcessError> {
    loop {
        if group_gone(pidfd)? {
            return Ok(true);
        }
        let left = time_left(deadline);
        if left.is_zero() {
            return Ok(false);
        }
        std::thread::sleep(left.min(GROUP_POLL));
    }
}

fn time_left(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// `now + timeout`, saturating instead of panicking on absurd timeouts: a timeout too long to
/// add is taken as "about a century", which no wait outlives.
pub fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .or_else(|| now.checked_add(FAR_FUTURE))
        .unwrap_or(now)
}

/// What [`deadline_after`] saturates to.
const FAR_FUTURE: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::Mutex;

    use super::*;
    use crate::process::fingerprint;
    use crate::process::testutil::{spawn_leader, wait_until};

    /// Fails every send, as a broken kill path would.
    struct Failing;

    fn injected(pid: Pid) -> ProcessError {
        ProcessError::Io {
            pid,
            what: "injected",
            source: io::Error::from_raw_os_error(libc::EPERM),
        }
    }

    impl Signaller for Failing {
        fn send(&self, pid: Pid, _: &Fingerprint, _: Signal) -> Result<Sent, ProcessError> {
            Err(injected(pid))
        }
        fn send_group(&self, leader: &PidFd, _: Signal) -> Result<Sent, ProcessError> {
            Err(injected(leader.pid()))
        }
    }

    /// Records every signal, then delivers it for real.
    #[derive(Default)]
    struct Recording(Mutex<Vec<(&'static str, Signal)>>);

    impl Signaller for Recording {
        fn send(
            &self,
            pid: Pid,
            expected: &Fingerprint,
            sig: Signal,
        ) -> Result<Sent, ProcessError> {
            self.0.lock().unwrap().push(("send", sig));
            PidfdSignaller.send(pid, expected, sig)
        }
        fn send_group(&self, leader: &PidFd, sig: Signal) -> Result<Sent, ProcessError> {
            self.0.lock().unwrap().push(("send_group", sig));
            PidfdSignaller.send_group(leader, sig)
        }
    }

    #[test]
    fn names() {
        assert_eq!(Ended::Sigterm.as_str(), "sigterm");
        assert_eq!(Ended::Sigkill.as_str(), "sigkill");
        assert_eq!(Ended::NotOurs(Liveness::Alive).as_str(), "not_ours");
    }

    #[test]
    fn injected_failure_propagates_and_leaves_the_process_alone() {
        let (pidfd, _guard) = spawn_leader("exec sleep 30");
        let fp = fingerprint(pidfd.pid()).unwrap();
        let err = terminate(&Failing, pidfd.pid(), &fp, Duration::from_millis(100)).unwrap_err();
        assert!(err.to_string().contains("injected"), "{err}");
        assert!(!pidfd.wait_exit(Duration::from_millis(50)).unwrap());
    }

    #[test]
    fn sigterm_suffices_for_a_plain_process() {
        let (pidfd, _guard) = spawn_leader("exec sleep 30");
        let fp = fingerprint(pidfd.pid()).unwrap();
        let rec = Recording::default();
        let ended = terminate(&rec, pidfd.pid(), &fp, Duration::from_secs(10)).unwrap();
        assert_eq!(ended, Ended::Sigterm);
        assert_eq!(*rec.0.lock().unwrap(), [("send", Signal::SIGTERM)]);
        assert_eq!(
            pidfd.try_reap().unwrap(),
            Some(crate::process::ExitStatus::Signal(libc::SIGTERM))
        );
    }

    #[test]
    fn other_boot_is_never_signalled() {
        let (pidfd, _guard) = spawn_leader("exec sleep 30");
        let fp = Fingerprint {
            boot_id: "another-boot".into(),
            ..fingerprint(pidfd.pid()).unwrap()
        };
        let rec = Recording::default();
        let ended = terminate(&rec, pidfd.pid(), &fp, Duration::from_secs(1)).unwrap();
        assert_eq!(ended, Ended::NotOurs(Liveness::Dead(DeadReason::OtherBoot)));
        assert!(rec.0.lock().unwrap().is_empty());
        assert_eq!(
            PidfdSignaller
                .send(pidfd.pid(), &fp, Signal::SIGKILL)
                .unwrap(),
            Sent::NotOurs(Liveness::Dead(DeadReason::OtherBoot))
        );
        assert!(!pidfd.wait_exit(Duration::from_millis(50)).unwrap());
    }

    #[test]
    fn terminate_group_of_an_already_empty_group_is_fine() {
        let (pidfd, _guard) = spawn_leader("exit 0");
        assert!(pidfd.wait_exit(Duration::from_secs(10)).unwrap());
        pidfd.try_reap().unwrap();
        assert_eq!(
            terminate_group(&pidfd, Duration::from_secs(1)).unwrap(),
            Ended::Sigterm
        );
    }

    #[test]
    fn terminate_group_ends_a_process_that_leads_no_group() {
        // Spawned into our own group: the group signal finds no group led by it.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pidfd = PidFd::open(child.id() as Pid).unwrap();
        let ended = terminate_group(&pidfd, Duration::from_secs(10));
        // Never leave it running, whatever happened above.
        let _ = pidfd.signal(Signal::SIGKILL);
        child.wait().unwrap();
        assert_eq!(ended.unwrap(), Ended::Sigterm);
    }

    #[test]
    fn a_process_that_leads_no_group_and_ignores_sigterm_is_gone_when_sigkill_is_reported() {
        let mut child = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; exec sleep 30"])
            .spawn()
            .unwrap();
        let pidfd = PidFd::open(child.id() as Pid).unwrap();
        // Its trap is set once its status shows SIGTERM ignored (SigIgn, bit 15).
        let ignores_term = || {
            std::fs::read_to_string(format!("/proc/{}/status", child.id())).is_ok_and(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("SigIgn:"))
                    .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
                    .is_some_and(|m| m & (1 << 14) != 0)
            })
        };
        assert!(wait_until(Duration::from_secs(10), ignores_term));
        let ended = terminate_group(&pidfd, Duration::from_millis(200));
        let gone = pidfd.wait_exit(Duration::ZERO);
        let _ = pidfd.signal(Signal::SIGKILL);
        child.wait().unwrap();
        assert_eq!(ended.unwrap(), Ended::Sigkill);
        assert!(
            gone.unwrap(),
            "reported ended by SIGKILL while still running"
        );
    }

    #[test]
    fn deadline_saturates() {
        assert!(deadline_after(Duration::MAX) > Instant::now());
        assert!(wait_until(Duration::ZERO, || true));
    }
}
