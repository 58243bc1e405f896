//! The spawn fingerprint: what names one process across pid reuse and reboots.

use std::sync::OnceLock;

use super::{Pid, ProcessError, read_stat};

/// Identity of a spawned process: survives pid reuse checks.
///
/// `start_ticks` (field 22 of `/proc/<pid>/stat`) only means something within one boot, hence the
/// boot id beside it: a fingerprint recorded before a reboot names no process of this boot.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint {
    /// `/proc/sys/kernel/random/boot_id` of the boot the process was started in.
    pub boot_id: String,
    /// Start time of the process after boot, in clock ticks.
    pub start_ticks: u64,
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

/// The fingerprint of `pid` now: the current boot id and the process's start time.
pub fn fingerprint(pid: Pid) -> Result<Fingerprint, ProcessError> {
    Ok(Fingerprint {
        boot_id: boot_id()?,
        start_ticks: read_stat(pid)?.start_ticks,
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
        let fp = Fingerprint {
            boot_id: "b".into(),
            start_ticks: 7,
        };
        let json = serde_json::to_string(&fp).unwrap();
        assert_eq!(json, r#"{"boot_id":"b","start_ticks":7}"#);
        assert_eq!(serde_json::from_str::<Fingerprint>(&json).unwrap(), fp);
    }
}
