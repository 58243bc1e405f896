//! Whether the board a supervisor starts on is a copy of one in use (served earlier in this
//! boot from another data dir, or whose live workers report to another supervisor), and if so,
//! disowning its workers before anything adopts or signals them. The board keeps the record
//! (`board::home`); this module looks at the file system and the workers.

use std::thread;
use std::time::Duration;

use crate::board;
use crate::config::Config;
use crate::process;
use crate::supervisor::SupervisorError;

/// Records this data dir as the board's home, and disowns every worker on the board when it
/// is a copy of a board in use (see `board::home`): served earlier in this boot from another
/// data dir at another path that is still there (one that is gone was moved here: its workers
/// are this board's), or — a board that never recorded its home, or one moved — whose live
/// workers report to another supervisor's socket that answers. Done before the reaper's first
/// sweep and the first reconcile, so none of them is adopted or signalled. True when the board
/// is such a copy.
pub(crate) fn disown_a_copys_workers(config: &Config) -> Result<bool, SupervisorError> {
    use std::os::unix::fs::MetadataExt;
    let dir = &config.supervisor.data_dir;
    let dir_err = |source| SupervisorError::Dir {
        path: dir.clone(),
        source,
    };
    let id_of = |meta: &std::fs::Metadata| format!("{}:{}", meta.dev(), meta.ino());
    let home = board::Home {
        id: id_of(&std::fs::metadata(dir).map_err(dir_err)?),
        path: std::fs::canonicalize(dir)
            .map_err(dir_err)?
            .display()
            .to_string(),
    };
    let boot = process::boot_id().map_err(|e| SupervisorError::Runtime(e.to_string()))?;
    let mut board = board::Board::open(&config.db_path())?;
    let (recorded, open) = board.read(|tx| Ok((tx.recorded_home()?, tx.open_runs()?)))?;
    // Decided outside any transaction (the data dir is locked: nothing else writes the board).
    let copy_of = match board::Before::of(recorded, &boot, &home) {
        board::Before::Here => None,
        board::Before::Elsewhere(other)
            if std::fs::metadata(&other.path).is_ok_and(|m| id_of(&m) == other.id) =>
        {
            Some(format!("{} ({})", other.path, other.id))
        }
        board::Before::Elsewhere(_) | board::Before::Unrecorded => {
            workers_report_elsewhere(open, config.socket_path())
                .map(|socket| format!("the supervisor listening on {}", socket.display()))
        }
    };
    let disowned = board.write(|tx| {
        let now = board::now_millis();
        tx.record_home(&boot, &home, now)?;
        match &copy_of {
            Some(before) => Ok(Some(tx.disown_workers(before, now)?)),
            None => Ok(None),
        }
    })?;
    if let (Some(before), Some(runs)) = (&copy_of, disowned) {
        tracing::warn!(
            data_dir = %dir.display(),
            served_by = %before,
            runs,
            "this board is a copy of one in use (served from another data dir earlier in this boot, or its workers report to another supervisor): its workers are not adopted or signalled, and its open runs close here"
        );
    }
    Ok(copy_of.is_some())
}

/// How long the start waits for [`workers_report_elsewhere`]'s looks at the workers.
const LOOK_AT_WORKERS: Duration = Duration::from_secs(5);

/// The socket another supervisor answers on that a live worker of `open` reports to, if any
/// (a worker whose socket nobody serves, or ours, is this board's own). Its looks (a
/// worker's `/proc/<pid>/environ`, which an exec on a hung mount can hold) run on a thread of
/// their own, waited for `LOOK_AT_WORKERS`: past that, nothing is taken for a copy (as before
/// boards recorded their home), and the log says so.
fn workers_report_elsewhere(
    open: Vec<board::Run>,
    ours: std::path::PathBuf,
) -> Option<std::path::PathBuf> {
    let (tx, rx) = std::sync::mpsc::channel();
    let looked = thread::Builder::new()
        .name("runwarden-copy-check".into())
        .spawn(move || {
            let found = open.iter().find_map(|run| reports_elsewhere(run, &ours));
            let _ = tx.send(found);
        });
    if let Err(e) = looked {
        tracing::warn!(error = %e, "cannot look at the board's workers; taken for its own");
        return None;
    }
    rx.recv_timeout(LOOK_AT_WORKERS).unwrap_or_else(|_| {
        tracing::warn!(
            "looking at the board's workers (whom they report to) took over {LOOK_AT_WORKERS:?}; taken for its own"
        );
        None
    })
}

/// The socket `run`'s live worker reports to, when it is not ours (another file than the one
/// this supervisor has bound, however its path is spelled) and a supervisor listens on it.
fn reports_elsewhere(run: &board::Run, ours: &std::path::Path) -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    let pid = i32::try_from(run.worker_pid?).ok()?;
    let fd = match process::open_verified(pid, &run.fingerprint()?) {
        Ok(process::Verified::Ours(fd)) => fd,
        _ => return None,
    };
    let socket = process::descendants::environ_var(&fd, "RUNWARDEN_SOCKET")?;
    let socket = std::path::PathBuf::from(std::ffi::OsStr::from_bytes(&socket));
    let file = std::fs::metadata(&socket).ok()?;
    let same_file =
        std::fs::metadata(ours).is_ok_and(|o| (o.dev(), o.ino()) == (file.dev(), file.ino()));
    (!same_file && listening(&socket)).then_some(socket)
}

/// Whether a process listens on the Unix socket at `path`: a connect that does not wait (a
/// listener too busy to take it, its queue full, is still one).
fn listening(path: &std::path::Path) -> bool {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, UnixAddr, connect, socket};
    let Ok(addr) = UnixAddr::new(path) else {
        return false;
    };
    let Ok(fd) = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        None,
    ) else {
        return false;
    };
    use std::os::fd::AsRawFd;
    matches!(
        connect(fd.as_raw_fd(), &addr),
        Ok(()) | Err(nix::errno::Errno::EAGAIN) | Err(nix::errno::Errno::EINPROGRESS)
    )
}
