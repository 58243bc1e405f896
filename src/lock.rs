//! The supervisor's lock file: one supervisor per board, ever.
//!
//! An exclusive `flock` on `<data_dir>/supervisor.lock`, held for the supervisor's whole life
//! (the kernel drops it if the process dies, so a crash never leaves a stale lock). The file
//! holds the holder's pid, so a refused second supervisor can name it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, flock};
use rustix::io::Errno;

/// Why the lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another supervisor (pid {pid}) is running on this board: {path} is locked")]
    Held { path: PathBuf, pid: String },
    #[error("cannot open lock file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A held lock; released (and the file removed) on drop.
///
/// Removing the file on drop is required (a clean shutdown leaves no lock file behind), which is
/// why `acquire` checks that the file it locked is still the one at the path.
#[derive(Debug)]
pub struct LockFile {
    file: File,
    path: PathBuf,
}

/// How many times [`LockFile::acquire`] starts over when the file it locked was removed or
/// replaced under it (a holder shutting down at that very moment) before giving up.
const MAX_TRIES: usize = 100;

impl LockFile {
    /// Takes the lock at `path` or says who holds it.
    ///
    /// The lock is only held if, once `flock` succeeded, `path` still names the very file that
    /// was locked: a holder removes the file on drop (before unlocking), so a contender that
    /// opened the file just before that removal would otherwise lock an unlinked inode while a
    /// third supervisor creates and locks a new file at `path`. Such a contender starts over.
    pub fn acquire(path: &Path) -> Result<LockFile, LockError> {
        let io = |source| LockError::Io {
            path: path.to_path_buf(),
            source,
        };
        for _ in 0..MAX_TRIES {
            // Not through a link put in its place: the pid would be written wherever it points.
            let mut file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .custom_flags(libc::O_NOFOLLOW)
                .open(path)
                .map_err(io)?;
            match flock(file.as_fd(), FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => {}
                Err(Errno::WOULDBLOCK) => {
                    // Locked by someone else; but if the file is no longer at `path`, its
                    // holder is going away: try the current one instead.
                    if !names_file(path, &file).map_err(io)? {
                        continue;
                    }
                    return Err(LockError::Held {
                        path: path.to_path_buf(),
                        pid: holder_pid(&mut file),
                    });
                }
                Err(errno) => return Err(io(errno.into())),
            }
            if !names_file(path, &file).map_err(io)? {
                // Locked a file that was removed (or replaced) meanwhile: the lock means
                // nothing. Dropping `file` unlocks it; start over with whatever is at `path`.
                continue;
            }
            file.set_len(0).map_err(io)?;
            file.seek(SeekFrom::Start(0)).map_err(io)?;
            writeln!(file, "{}", std::process::id()).map_err(io)?;
            file.sync_all().map_err(io)?;
            return Ok(LockFile {
                file,
                path: path.to_path_buf(),
            });
        }
        Err(io(std::io::Error::other(format!(
            "the lock file was replaced under us {MAX_TRIES} times in a row"
        ))))
    }
}

/// True if `path` currently names `file` (same device and inode); false if it is gone or names
/// another file.
fn names_file(path: &Path, file: &File) -> std::io::Result<bool> {
    let held = file.metadata()?;
    match std::fs::metadata(path) {
        Ok(now) => Ok(now.dev() == held.dev() && now.ino() == held.ino()),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err),
    }
}

/// The pid the holder wrote in the file, or "unknown" (not written yet, unreadable).
fn holder_pid(file: &mut File) -> String {
    let mut pid = String::new();
    let _ = file.read_to_string(&mut pid);
    match pid.trim() {
        "" => "unknown".into(),
        pid => pid.to_string(),
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // Removed BEFORE unlocking: once we unlock, a contender that opened this file earlier
        // may lock it, and must then find the path gone (or naming a newer file) and start over
        // (see `acquire`). Unlocking first would let it take a lock on a file we then remove,
        // while a third supervisor creates and locks a new one.
        let _ = std::fs::remove_file(&self.path);
        let _ = flock(self.file.as_fd(), FlockOperation::Unlock);
    }
}
