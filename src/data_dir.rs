//! The data directory: its `logs/` and `work/`, whether it is the supervisor's alone, and the
//! modes that follow from that (`docs/operations.md`, "The data directory").

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use crate::config::Config;
use crate::supervisor::SupervisorError;

/// Creates the data dir and its `logs/` and `work/` where they are missing — a new one 0700
/// (`work/` 0711), so nothing of it is ever open to others, even for a start that fails next
/// — and refuses one that is shared ([`is_ours`]) or not a directory. Changes no mode of a
/// directory that exists but to take others' write access from the supervisor's own data dir
/// (as every start does): the rest is [`set_modes`]'s, once the lock is held, so a start
/// refused by a running supervisor's lock never narrows what that supervisor's users need. Returns
/// whether the data dir is the supervisor's alone, and what it created ([`Created`]: removed
/// again if the start fails).
pub(crate) fn create_dirs(config: &Config) -> Result<(bool, Created), SupervisorError> {
    let mut created = Created::default();
    let data_dir_is_ours = is_ours(config)?;
    // Others' write access goes even before the lock (every start's `set_modes` takes it away,
    // so a refused start harms no running supervisor): until then the lock file could be
    // swapped for something else.
    if data_dir_is_ours
        && let Some(current) = owned_mode(&config.supervisor.data_dir)
        && current & 0o022 != 0
    {
        let _ = std::fs::set_permissions(
            &config.supervisor.data_dir,
            std::fs::Permissions::from_mode(current & !0o022),
        );
    }
    for (dir, mode) in [
        (&config.supervisor.data_dir, 0o700),
        (&config.logs_dir(), 0o700),
        (&config.work_dir(), 0o711),
    ] {
        make_dir(dir, mode, &mut created.0).map_err(|source| {
            // "File exists" reads like success: say what is in the way.
            let problem = match source.kind() {
                std::io::ErrorKind::AlreadyExists => Some("is not a directory"),
                std::io::ErrorKind::NotADirectory => Some("has a file, not a directory, on its path"),
                _ => None,
            };
            if let Some(problem) = problem {
                let what = if *dir == config.supervisor.data_dir {
                    ""
                } else {
                    " (inside the data dir)"
                };
                return SupervisorError::Config(config.invalid(format!(
                    "[supervisor] data_dir: {} {problem}{what}; move the file away or choose another data_dir",
                    dir.display()
                )));
            }
            SupervisorError::Dir {
                path: dir.to_path_buf(),
                source,
            }
        })?;
    }
    Ok((data_dir_is_ours, created))
}

/// The directories a start created, deepest last. Dropped, it removes those still empty,
/// deepest first: a start refused before it takes the lock (a bad `cwd`) leaves no `data/`,
/// `logs/` or `work/` behind — but never anything that holds a file. [`Created::keep`] as soon
/// as the lock has been tried, taken or not: whoever holds it from then on may be using them
/// (a second start that lost the race for the lock must not remove the winner's `work/`).
#[derive(Default)]
pub(crate) struct Created(Vec<std::path::PathBuf>);

impl Created {
    /// The lock has been tried: the directories stay.
    pub(crate) fn keep(mut self) {
        self.0.clear();
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        for dir in self.0.iter().rev() {
            // remove_dir refuses a directory that is not empty: nothing in it is lost.
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// Creates `dir` with `mode` if it is missing (its parents as they come: they are not ours to
/// close); one that is a directory already is left as it is. What it created is added to
/// `created`, outermost first.
fn make_dir(dir: &Path, mode: u32, created: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        let missing: Vec<_> = parent
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && !a.exists())
            .map(Path::to_path_buf)
            .collect();
        std::fs::create_dir_all(parent).map_err(|e| match e.kind() {
            // A file where a parent should be: said as what is wrong with `dir`'s path.
            std::io::ErrorKind::AlreadyExists => {
                std::io::Error::from(std::io::ErrorKind::NotADirectory)
            }
            _ => e,
        })?;
        created.extend(missing.into_iter().rev());
    }
    match std::fs::DirBuilder::new().mode(mode).create(dir) {
        Ok(()) => {
            created.push(dir.to_path_buf());
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        other => other,
    }
}

/// Sets the modes of the data dir, `logs/` and `work/` — the one place that decides them
/// (`docs/operations.md`, "The data directory"); run once the lock is held. The data dir: when
/// it is the supervisor's alone (`data_dir_is_ours`, from [`create_dirs`]) and the socket is in
/// it, 0700 (only our uid reaches the socket), or 0711 when other users need through it (see
/// [`others_need_through`]); alone with the socket elsewhere, it only loses others' write
/// access and gains that traversal; not the supervisor's alone, it is never narrowed, only
/// given the traversal when it is our user's. Inside it `logs/` is 0700 (other operators read
/// logs through the socket) and `work/` 0711 (a worker running as another user must reach its
/// own `work/<id>`, which is 0700 and its). Set on every start, so a board from before these
/// modes gets them too. One of them others may write in that cannot be changed refuses the
/// start.
pub(crate) fn set_modes(config: &Config, data_dir_is_ours: bool) -> Result<(), SupervisorError> {
    if !data_dir_is_ours {
        tracing::info!(
            data_dir = %config.supervisor.data_dir.display(),
            "the data dir is not the supervisor's alone (another user's, or it holds other things): its mode is left as it is, only other users' traversal may be added"
        );
    }
    for (dir, mode) in [
        (config.supervisor.data_dir.clone(), None),
        (config.logs_dir(), Some(0o700)),
        (config.work_dir(), Some(0o711)),
    ] {
        let current = std::fs::metadata(&dir)
            .map(|m| m.permissions().mode() & 0o7777)
            .map_err(|source| SupervisorError::Dir {
                path: dir.clone(),
                source,
            })?;
        // Others' write access goes (through it, `logs/` or `work/` could be swapped for a
        // link) when the data dir is the supervisor's own; the traversal other users need is
        // added whatever an earlier start left (0700, with the socket since moved elsewhere).
        let mode = mode.unwrap_or_else(|| {
            // Asked once the data dir exists: whether the socket is in it is a question of files.
            let traversal = if others_need_through(config) && owned_mode(&dir).is_some() {
                0o011
            } else {
                0
            };
            match (data_dir_is_ours, socket_entry(config).is_some()) {
                (true, true) => 0o700 | traversal,
                (true, false) => (current & !0o022) | traversal,
                (false, _) => current | traversal,
            }
        });
        if current == mode {
            continue;
        }
        // A directory someone else prepared (and owns) may refuse the change. That is theirs
        // to decide — unless others may write in it: then they could put a link in a log's
        // or a task's place and have the supervisor write (or read, or rotate) wherever it
        // points.
        if let Err(e) = std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)) {
            if current & 0o022 != 0 {
                return Err(SupervisorError::Runtime(format!(
                    "{} is writable by others (mode {current:o}) and cannot be made {mode:o}: {e}; give it to the supervisor's user or take others' write access away",
                    dir.display()
                )));
            }
            tracing::warn!(path = %dir.display(), mode = format!("{current:o}"), error = %e, "cannot chmod a data directory; left as it is (only its owner may write in it)");
        }
    }
    Ok(())
}

/// Whether users other than the supervisor's must get through the data dir: an assignee's
/// workers of another user (to their `work/<id>`; they report over the socket too), or
/// `allowed_uids` served over a socket in it.
fn others_need_through(config: &Config) -> bool {
    let me = nix::unistd::geteuid().as_raw();
    let others_work = config
        .assignees
        .values()
        .any(|a| a.uid.is_some_and(|u| u != me));
    let others_served = !config.control.allowed_uids.is_empty() && socket_entry(config).is_some();
    others_work || others_served
}

/// The data dir's entry the control socket is under — the socket itself, or a directory of
/// its path (`data_dir/sock/control.sock`) — however either path is spelled (through a link,
/// with `..`); `None` when it is elsewhere.
fn socket_entry(config: &Config) -> Option<std::ffi::OsString> {
    let dir = &config.supervisor.data_dir;
    let socket = config.socket_path();
    socket
        .ancestors()
        .find(|a| a.parent().is_some_and(|p| same_file(p, dir)))
        .and_then(|a| a.file_name())
        .map(|n| n.to_os_string())
}

/// Whether the data dir may have its mode set by the supervisor (0700, or 0711 when it serves
/// other users): true when it does not exist yet, or is the supervisor's user's and holds
/// nothing but what a supervisor keeps there (`docs/operations.md`). A directory that holds
/// other things is not the supervisor's alone (as root, `data_dir = "/var/lib"` would have
/// made `/var/lib` 0700): its mode is left as it is — unless others may write in it (a log or
/// a task's directory could be swapped for a link), which refuses the start. A shared
/// directory (sticky and writable by all, like `/tmp`) is named as such.
fn is_ours(config: &Config) -> Result<bool, SupervisorError> {
    let dir = &config.supervisor.data_dir;
    let Ok(meta) = std::fs::metadata(dir) else {
        return Ok(true); // Not there yet (or in the way: create_dirs says so).
    };
    if !meta.is_dir() {
        return Ok(true);
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o1000 != 0 && mode & 0o002 != 0 {
        return Err(SupervisorError::Config(config.invalid(format!(
            "[supervisor] data_dir: {} is a shared directory (mode {mode:o}: anyone may create files in it); give the supervisor a directory of its own, e.g. {}",
            dir.display(),
            dir.join("runwarden").display()
        ))));
    }
    let mine = meta.uid() == nix::unistd::geteuid().as_raw();
    if mine && holds_only_what_a_supervisor_keeps(config) {
        return Ok(true);
    }
    if mode & 0o022 != 0 {
        let whose = if mine {
            "holds files that are not the supervisor's".to_string()
        } else {
            format!("belongs to uid {}", meta.uid())
        };
        return Err(SupervisorError::Config(config.invalid(format!(
            "[supervisor] data_dir: {} {whose} and others may write in it (mode {mode:o}); give the supervisor a directory of its own",
            dir.display()
        ))));
    }
    Ok(false)
}

/// Whether every entry of the data dir is one a supervisor keeps there (the board, its lock,
/// socket, hook token, `logs/`, `work/`). Unreadable: not known to be, so not.
fn holds_only_what_a_supervisor_keeps(config: &Config) -> bool {
    const OURS: [&str; 8] = [
        "board.db",
        "board.db-wal",
        "board.db-shm",
        "board.db-journal",
        "supervisor.lock",
        "hooks.token",
        "logs",
        "work",
    ];
    let dir = &config.supervisor.data_dir;
    let socket_here = socket_entry(config);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    let others: Vec<String> = entries
        .filter_map(|e| match e {
            Ok(e) => {
                let name = e.file_name();
                let ours = OURS.iter().any(|o| name == *o) || socket_here.as_ref() == Some(&name);
                (!ours).then(|| name.to_string_lossy().into_owned())
            }
            Err(e) => Some(format!("(unreadable entry: {e})")),
        })
        .collect();
    if !others.is_empty() {
        tracing::debug!(
            data_dir = %dir.display(),
            others = ?others.iter().take(5).collect::<Vec<_>>(),
            "the data dir holds more than a supervisor keeps there"
        );
    }
    others.is_empty()
}

/// The mode of `dir` when it belongs to the supervisor's user (else `None`: not its to
/// change).
fn owned_mode(dir: &Path) -> Option<u32> {
    let meta = std::fs::metadata(dir).ok()?;
    (meta.uid() == nix::unistd::geteuid().as_raw()).then_some(meta.mode() & 0o7777)
}

/// Whether `a` and `b` name the same file (however their paths are spelled).
fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}
