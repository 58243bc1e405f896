//! Whether the kernel reaps this process's children itself: SIGCHLD set to be ignored, or its
//! action flagged `SA_NOCLDWAIT`. Then a child that exits leaves no zombie and no exit status
//! — every worker's exit would be lost (and closed as a crash) — and a pidfd wait finds no
//! child. A launcher may hand the ignored disposition on across exec (`serve` puts it back);
//! a program that embeds a supervisor must not have it.

use std::io;

/// True when SIGCHLD is ignored or flagged `SA_NOCLDWAIT` in this process.
pub fn children_reaped_by_kernel() -> io::Result<bool> {
    // SAFETY: a zeroed sigaction is a valid out-parameter; a null new action only reads.
    let mut current: libc::sigaction = unsafe { std::mem::zeroed() };
    if unsafe { libc::sigaction(libc::SIGCHLD, std::ptr::null(), &mut current) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(current.sa_sigaction == libc::SIG_IGN || current.sa_flags & libc::SA_NOCLDWAIT != 0)
}

/// Puts SIGCHLD back to its default action (no flags), process-wide. For `serve` only: a
/// process of its own, whose inherited disposition was nobody's choice.
pub fn restore_default_sigchld() -> io::Result<()> {
    // SAFETY: a zeroed sigaction with SIG_DFL and an empty mask is a valid action.
    let mut default: libc::sigaction = unsafe { std::mem::zeroed() };
    default.sa_sigaction = libc::SIG_DFL;
    if unsafe { libc::sigemptyset(&mut default.sa_mask) } != 0
        || unsafe { libc::sigaction(libc::SIGCHLD, &default, std::ptr::null_mut()) } != 0
    {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
