//! Parsing of `/proc/<pid>/stat`.
//!
//! The line is `pid (comm) state ppid pgrp session … starttime …`. `comm` is chosen by the process
//! itself (`prctl(PR_SET_NAME)`, the executable's name) and may contain spaces, parentheses and even
//! `") ("`, so the only safe anchor is the *last* `)`: every field after it is a number or the
//! one-letter state, none of which can contain a `)`.

use std::io;

use super::{Pid, ProcessError};

/// Parsed fields of `/proc/<pid>/stat` we need.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    /// Field 1: the process id.
    pub pid: Pid,
    /// Field 2: the command name, without the surrounding parentheses.
    pub comm: String,
    /// Field 3: the state letter (`R`, `S`, `D`, `Z`, `X`, …).
    pub state: char,
    /// Field 4: the parent's pid.
    pub ppid: Pid,
    /// Field 5: the process group id.
    pub pgrp: Pid,
    /// Field 6: the session id.
    pub session: Pid,
    /// Field 9: the kernel's flags for the task (`PF_*`; see [`ProcStat::is_kernel_thread`]).
    pub flags: u64,
    /// Field 20: the number of threads not yet released — all of them while the process
    /// runs; a zombie that is nothing but its exited leader counts 1.
    pub threads: u32,
    /// Field 22: start time after boot, in clock ticks. Together with the boot id it names one
    /// process for the life of the machine, which a pid alone does not.
    pub start_ticks: u64,
    /// Field 41: the scheduling policy (`SCHED_*`), when the line has it.
    pub policy: Option<u32>,
    /// Field 51: where the environment ends in the process's memory, when the line has it
    /// (Linux 3.5). Zero while an exec has not laid out the new image's environment yet (and
    /// for a reader without ptrace-read access, who cannot read the environment either); not
    /// zero for a process whose environment is empty.
    pub env_end: Option<u64>,
    /// Field 52: an exited process's status in `waitpid` form, when the line has it (Linux
    /// 3.5). The kernel shows 0 to a reader without ptrace-read access to the process: see
    /// `exit_status` before trusting it.
    pub exit_code: Option<i32>,
}

impl ProcStat {
    /// True for a kernel thread (`PF_KTHREAD`): no user memory, no environment, ever. Told by
    /// its flags, not its parent: in a pid namespace, pid 2 is an ordinary process.
    pub fn is_kernel_thread(&self) -> bool {
        const PF_KTHREAD: u64 = 0x0020_0000;
        self.flags & PF_KTHREAD != 0
    }

    /// True for a task that is exiting (`PF_EXITING`): its memory, environment included, may
    /// already be gone, and it will fork nothing more.
    pub fn is_exiting(&self) -> bool {
        const PF_EXITING: u64 = 0x0000_0004;
        self.flags & PF_EXITING != 0
    }

    /// True for a process that has exited: a zombie (`Z`) or one being torn down (`X`) — all
    /// of it. The line is the thread-group leader's, and a leader that exits alone
    /// (`pthread_exit` in `main`) shows `Z` while its other threads run on: the process is
    /// alive (it can be signalled, it keeps its pid), and only its thread count tells.
    pub fn is_zombie(&self) -> bool {
        matches!(self.state, 'Z' | 'X') && self.threads <= 1
    }

    /// True for a live process whose main thread has exited alone (see [`Self::is_zombie`]):
    /// what `/proc` shows through the main thread (its environment, say) is gone, the rest of
    /// the process is not.
    pub fn main_thread_exited_alone(&self) -> bool {
        matches!(self.state, 'Z' | 'X') && self.threads > 1
    }
}

/// Fields after the closing `)` of comm, counted from field 3 (state).
const STATE: usize = 0;
const PPID: usize = 1;
const PGRP: usize = 2;
const SESSION: usize = 3;
const FLAGS: usize = 9 - 3;
const NUM_THREADS: usize = 20 - 3;
const STARTTIME: usize = 22 - 3;
const POLICY: usize = 41 - 3;
const ENV_END: usize = 51 - 3;
const EXIT_CODE: usize = 52 - 3;

/// Parses one `/proc/<pid>/stat` line.
pub fn parse_stat(text: &str) -> Result<ProcStat, ProcessError> {
    let bad = |reason: String| ProcessError::Parse { pid: None, reason };
    let open = text
        .find('(')
        .ok_or_else(|| bad("no '(' before comm".into()))?;
    // The last ')' ends comm: whatever comm contains, nothing after it can be a ')'.
    let close = text
        .rfind(')')
        .filter(|&close| close > open)
        .ok_or_else(|| bad("no ')' after comm".into()))?;

    let pid = parse_num(text[..open].trim(), "pid").map_err(bad)?;
    let comm = text[open + 1..close].to_owned();
    let fields: Vec<&str> = text[close + 1..].split_ascii_whitespace().collect();
    if fields.len() <= STARTTIME {
        return Err(bad(format!(
            "truncated: {} fields after comm, need at least {}",
            fields.len(),
            STARTTIME + 1
        )));
    }

    let mut state_chars = fields[STATE].chars();
    let state = match (state_chars.next(), state_chars.next()) {
        (Some(c), None) if c.is_ascii_alphabetic() => c,
        _ => return Err(bad(format!("bad state {:?}", fields[STATE]))),
    };

    Ok(ProcStat {
        pid,
        comm,
        state,
        ppid: parse_num(fields[PPID], "ppid").map_err(bad)?,
        pgrp: parse_num(fields[PGRP], "pgrp").map_err(bad)?,
        session: parse_num(fields[SESSION], "session").map_err(bad)?,
        flags: parse_num(fields[FLAGS], "flags").map_err(bad)?,
        threads: parse_num(fields[NUM_THREADS], "num_threads").map_err(bad)?,
        start_ticks: parse_num(fields[STARTTIME], "starttime").map_err(bad)?,
        policy: fields
            .get(POLICY)
            .map(|f| parse_num(f, "policy"))
            .transpose()
            .map_err(bad)?,
        env_end: fields
            .get(ENV_END)
            .map(|f| parse_num(f, "env_end"))
            .transpose()
            .map_err(bad)?,
        exit_code: fields
            .get(EXIT_CODE)
            .map(|f| parse_num(f, "exit_code"))
            .transpose()
            .map_err(bad)?,
    })
}

fn parse_num<T: std::str::FromStr>(field: &str, name: &str) -> Result<T, String> {
    field
        .parse()
        .map_err(|_| format!("{name} is not a number: {field:?}"))
}

/// Reads and parses `/proc/<pid>/stat`.
///
/// A pid that does not exist (or exits and is reaped while we read) is
/// [`ProcessError::NoSuchProcess`]; every other failure is an error with its cause, never
/// "no such process", because only a proven absence may be acted upon as one.
pub fn read_stat(pid: Pid) -> Result<ProcStat, ProcessError> {
    if pid <= 0 {
        // /proc/0 and negative names do not exist; say so without touching the filesystem.
        return Err(ProcessError::NoSuchProcess { pid });
    }
    let mut buf = [0u8; STAT_BUF];
    let len = match read_small(&format!("/proc/{pid}/stat"), &mut buf) {
        Ok(len) => len,
        Err(err) if is_gone(&err) => return Err(ProcessError::NoSuchProcess { pid }),
        Err(source) => {
            return Err(ProcessError::Io {
                pid,
                what: "read /proc/<pid>/stat",
                source,
            });
        }
    };
    // comm is whatever bytes the process chose (not always UTF-8); only the fields after it
    // are parsed.
    let text = String::from_utf8_lossy(&buf[..len]);
    parse_stat(&text).map_err(|err| match err {
        ProcessError::Parse { reason, .. } => ProcessError::Parse {
            pid: Some(pid),
            reason,
        },
        other => other,
    })
}

/// Room for a stat line: comm is at most 64 bytes and the 50-odd numbers after it stay well
/// under 1 KiB; a longer file is an error rather than a silently truncated parse.
const STAT_BUF: usize = 4096;

/// Reads a small file whole into `buf` without the size probe (statx, lseek) that
/// `read_to_string` makes first (pointless for /proc, whose files all report size 0). Called
/// for every spawn and liveness check.
fn read_small(path: &str, buf: &mut [u8]) -> io::Result<usize> {
    use std::io::Read;
    let mut file = std::fs::File::open(path)?;
    let mut len = 0;
    loop {
        if len == buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{path} is larger than {} bytes", buf.len()),
            ));
        }
        match file.read(&mut buf[len..]) {
            Ok(0) => return Ok(len),
            Ok(n) => len += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// ENOENT: the /proc entry is gone; ESRCH: the task died between open and read.
pub(crate) fn is_gone(err: &io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::ENOENT | libc::ESRCH))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real line (from a `sleep`), with fields up to and past starttime.
    fn line(comm: &str) -> String {
        format!(
            "4242 ({comm}) S 4200 4242 4100 34816 4242 4194304 110 0 0 0 0 0 0 0 20 0 1 0 \
             987654 8699904 224 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 \
             0 0 0 0 0 0 0 0\n"
        )
    }

    fn expect(comm: &str) -> ProcStat {
        ProcStat {
            pid: 4242,
            comm: comm.into(),
            state: 'S',
            ppid: 4200,
            pgrp: 4242,
            session: 4100,
            flags: 4194304,
            threads: 1,
            start_ticks: 987654,
            policy: Some(0),
            env_end: Some(0),
            exit_code: Some(0),
        }
    }

    #[test]
    fn a_zombie_line_has_its_exit_status() {
        // `exit 7` in waitpid form, the last field of a zombie's line (Linux 6.x).
        let text = "4242 (sh) Z 1 4242 4100 0 -1 4227148 26 0 0 0 0 0 0 0 20 0 1 0 987654 0 0 \
                    18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 \
                    0 1792\n";
        let stat = parse_stat(text).unwrap();
        assert!(stat.is_zombie());
        assert_eq!(stat.exit_code, Some(7 << 8));
        assert_eq!(stat.env_end, Some(0));
        // An older kernel's shorter line has none.
        let older = "4242 (sleep) S 4200 4242 4100 34816 4242 4194304 110 0 0 0 0 0 0 0 20 0 1 0 \
                     987654 8699904 224 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 \
                     0 0 0\n";
        assert_eq!(parse_stat(older).unwrap().exit_code, None);
    }

    #[test]
    fn parses_a_normal_line() {
        assert_eq!(parse_stat(&line("sleep")).unwrap(), expect("sleep"));
        assert!(!expect("sleep").is_kernel_thread());
    }

    #[test]
    fn a_kernel_thread_is_told_by_its_flags() {
        // kthreadd's children have PF_KTHREAD (0x00200000) among their flags.
        let text = "57 (kworker/0:1) I 2 0 0 0 -1 69238880 0 0 0 0 0 0 0 0 20 0 1 0 \
                    120 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 0 0 0 0 0 0\n";
        assert!(parse_stat(text).unwrap().is_kernel_thread());
        // Our own process is not one, whatever its pid or parent.
        assert!(
            !super::super::read_stat(std::process::id() as Pid)
                .unwrap()
                .is_kernel_thread()
        );
    }

    #[test]
    fn comm_with_spaces() {
        assert_eq!(parse_stat(&line("my worker")).unwrap(), expect("my worker"));
    }

    #[test]
    fn comm_with_closing_paren() {
        assert_eq!(parse_stat(&line("a)b")).unwrap(), expect("a)b"));
        assert_eq!(parse_stat(&line(")")).unwrap(), expect(")"));
    }

    #[test]
    fn comm_that_fakes_the_field_boundary() {
        // A comm of ") (" would end comm early for a parser anchored on the first ')'.
        assert_eq!(parse_stat(&line(") (")).unwrap(), expect(") ("));
        assert_eq!(
            parse_stat(&line("x) Z 1 1 1 (")).unwrap(),
            expect("x) Z 1 1 1 (")
        );
    }

    #[test]
    fn comm_with_opening_parens() {
        assert_eq!(parse_stat(&line("((")).unwrap(), expect("(("));
        assert_eq!(parse_stat(&line("")).unwrap(), expect(""));
    }

    #[test]
    fn parses_zombie_state() {
        let text = line("sh").replacen(") S ", ") Z ", 1);
        let stat = parse_stat(&text).unwrap();
        assert_eq!(stat.state, 'Z');
        assert!(stat.is_zombie());
        // A leader that exited alone, its other thread still running: alive.
        let text = text.replacen(" 20 0 1 0 987654 ", " 20 0 2 0 987654 ", 1);
        let stat = parse_stat(&text).unwrap();
        assert_eq!((stat.state, stat.threads), ('Z', 2));
        assert!(!stat.is_zombie() && stat.main_thread_exited_alone());
    }

    #[test]
    fn truncated_line_is_an_error() {
        let full = line("sleep");
        // Cut inside the fields before starttime.
        let cut = &full[..full.find(" 987654").unwrap()];
        assert!(matches!(parse_stat(cut), Err(ProcessError::Parse { .. })));
        // Cut inside comm: no ')' at all.
        assert!(matches!(
            parse_stat("4242 (sle"),
            Err(ProcessError::Parse { .. })
        ));
        assert!(matches!(parse_stat(""), Err(ProcessError::Parse { .. })));
    }

    #[test]
    fn non_number_field_is_an_error() {
        let text = line("sleep").replacen(" 987654 ", " 98x654 ", 1);
        let err = parse_stat(&text).unwrap_err();
        assert!(err.to_string().contains("starttime"), "{err}");
        let text = line("sleep").replacen(" 4200 ", " -x ", 1);
        assert!(matches!(parse_stat(&text), Err(ProcessError::Parse { .. })));
        let text = line("sleep").replacen("4242 (", "42a (", 1);
        assert!(matches!(parse_stat(&text), Err(ProcessError::Parse { .. })));
        let text = line("sleep").replacen(") S ", ") SS ", 1);
        assert!(matches!(parse_stat(&text), Err(ProcessError::Parse { .. })));
    }

    #[test]
    fn reads_own_stat() {
        let me = std::process::id() as Pid;
        let stat = read_stat(me).unwrap();
        assert_eq!(stat.pid, me);
        assert!(stat.start_ticks > 0);
        assert!(!stat.is_zombie());
    }

    #[test]
    fn missing_pid_is_no_such_process() {
        assert!(matches!(
            read_stat(0),
            Err(ProcessError::NoSuchProcess { pid: 0 })
        ));
        // Above the largest possible pid_max (2^22), so it can never exist.
        let absent = 1 << 23;
        assert!(matches!(
            read_stat(absent),
            Err(ProcessError::NoSuchProcess { .. })
        ));
    }
}
