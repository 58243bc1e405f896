//! The capabilities this process holds, as far as the supervisor's decisions need them.

/// `CAP_CHOWN`, `CAP_SETGID`, `CAP_SETUID` (linux/capability.h): what starting a worker as
/// another user takes (its work dir given to it, then its groups and its uid).
const SWITCH_USERS: u64 = (1 << 0) | (1 << 6) | (1 << 7);

/// Whether this process may start workers as other users without being root: it holds
/// CAP_SETUID, CAP_SETGID and CAP_CHOWN in its effective set (e.g. systemd's
/// `AmbientCapabilities=`). Unreadable: not known to, so no.
pub fn may_switch_users() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| effective(&status))
        .is_some_and(|caps| caps & SWITCH_USERS == SWITCH_USERS)
}

/// The `CapEff:` mask of a `/proc/<pid>/status` text.
fn effective(status: &str) -> Option<u64> {
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_effective_set() {
        let status = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t00000000000000c1\nCapBnd:\t000001ffffffffff\n";
        assert_eq!(effective(status), Some(0xc1));
        assert_eq!(
            effective(status).map(|c| c & SWITCH_USERS == SWITCH_USERS),
            Some(true)
        );
        assert_eq!(
            effective("CapEff:\t00000000000000c0\n").map(|c| c & SWITCH_USERS == SWITCH_USERS),
            Some(false)
        );
        assert_eq!(effective("Name:\tx\n"), None);
    }
}
