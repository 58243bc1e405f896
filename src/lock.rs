//! The supervisor's lock file: one supervisor per board, ever.
//!
//! An exclusive `flock` on `<data_dir>/supervisor.lock`, held for the supervisor's whole life
//! (the kernel drops it if the process dies, so a crash never leaves a stale lock). The file
//! holds the holder's pid, so a refused second supervisor can name it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use rustix::fs::{FlockOperation, flock};

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
#[derive(Debug)]
pub struct LockFile {
    file: File,
    path: PathBuf,
}

impl LockFile {
    /// Takes the lock at `path` or says who holds it.
    pub fn acquire(path: &Path) -> Result<LockFile, LockError> {
        let io = |source| LockError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        if flock(file.as_fd(), FlockOperation::NonBlockingLockExclusive).is_err() {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            let pid = pid.trim();
            return Err(LockError::Held {
                path: path.to_path_buf(),
                pid: if pid.is_empty() {
                    "unknown".into()
                } else {
                    pid.to_string()
                },
            });
        }
        file.set_len(0).map_err(io)?;
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        file.sync_all().map_err(io)?;
        Ok(LockFile {
            file,
            path: path.to_path_buf(),
        })
    }
}

impl Drop for LockFile {
    fn drop(&mut self) {
        // Remove while still holding the lock, so a waiting supervisor never locks a file
        // that is about to vanish under it.
        let _ = std::fs::remove_file(&self.path);
        let _ = flock(self.file.as_fd(), FlockOperation::Unlock);
    }
}
