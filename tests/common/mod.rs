//! Helpers shared by the integration tests.

pub mod board;
pub mod control_daemon;
pub mod descriptors;
pub mod groups;
pub mod lifecycle;
pub mod proc_guard;
pub mod runtime;

use std::path::Path;

/// Copies an executable a test will run (as another user: one it can reach). The copy is made
/// by `cp` in a child process and never opened for writing here: a write descriptor opened in
/// this multi-threaded test process is inherited by every child another test forks meanwhile,
/// until that child execs, and running the copy fails with ETXTBSY ("Text file busy") for as
/// long as any of them holds it. `cp` keeps the source's mode bits.
pub fn copy_executable(from: &Path, to: &Path) {
    let status = std::process::Command::new("cp")
        .arg("--")
        .arg(from)
        .arg(to)
        .stdin(std::process::Stdio::null())
        .status()
        .expect("run cp");
    assert!(
        status.success(),
        "cp {} {}: {status}",
        from.display(),
        to.display()
    );
}
