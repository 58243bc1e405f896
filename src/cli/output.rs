//! How the CLI prints: aligned tables with relative times and colour for people (colour only
//! on a terminal, and never with `NO_COLOR`), stable snake_case JSON with `--json`.

use std::io::{self, IsTerminal, Write};

use serde::Serialize;

use super::CliError;
use crate::board::{Millis, RunOutcome, TaskStatus, now_millis};

/// Output settings for one command.
#[derive(Debug, Clone, Copy)]
pub struct Out {
    /// `--json`: machine output only.
    pub json: bool,
    /// Colour escapes are allowed (stdout is a terminal, `NO_COLOR` unset, `TERM` not dumb).
    pub colour: bool,
}

impl Out {
    /// Settings for stdout.
    pub fn new(json: bool) -> Out {
        let tty = io::stdout().is_terminal();
        let no_colour = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty())
            || std::env::var("TERM").is_ok_and(|t| t == "dumb");
        Out {
            json,
            colour: tty && !no_colour,
        }
    }

    /// Prints `value` as pretty JSON.
    pub fn json<T: Serialize + ?Sized>(&self, value: &T) -> Result<(), CliError> {
        let text = serde_json::to_string_pretty(value)
            .map_err(|e| CliError::failure(format!("cannot encode JSON output: {e}")))?;
        line(&text)
    }

    /// Prints `value` as one compact JSON line (streams).
    pub fn json_line<T: Serialize + ?Sized>(&self, value: &T) -> Result<(), CliError> {
        let text = serde_json::to_string(value)
            .map_err(|e| CliError::failure(format!("cannot encode JSON output: {e}")))?;
        line(&text)
    }

    /// `text` in `colour` (an SGR code such as "32") when colour is on.
    pub fn paint(&self, text: &str, colour: Option<&str>) -> String {
        match colour {
            Some(c) if self.colour => format!("\x1b[{c}m{text}\x1b[0m"),
            _ => text.to_string(),
        }
    }
}

/// Writes one line to stdout. A closed pipe (`runwarden events | head`) ends the command
/// quietly instead of panicking.
pub fn line(text: &str) -> Result<(), CliError> {
    let mut out = io::stdout().lock();
    match writeln!(out, "{text}").and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => Err(CliError::quiet()),
        Err(e) => Err(CliError::failure(format!("cannot write to stdout: {e}"))),
    }
}

/// The colour of a task status.
pub fn status_colour(s: TaskStatus) -> Option<&'static str> {
    match s {
        TaskStatus::Done => Some("32"),
        TaskStatus::Running => Some("36"),
        TaskStatus::Blocked => Some("31"),
        TaskStatus::Ready => Some("33"),
        TaskStatus::Todo | TaskStatus::Archived => Some("2"),
    }
}

/// The colour of a run outcome.
pub fn outcome_colour(o: Option<RunOutcome>) -> Option<&'static str> {
    match o {
        None => Some("36"),
        Some(RunOutcome::Completed) => Some("32"),
        Some(
            RunOutcome::Blocked
            | RunOutcome::Crashed
            | RunOutcome::SpawnFailed
            | RunOutcome::TimedOut,
        ) => Some("31"),
        Some(_) => Some("33"),
    }
}

/// One table cell: its text and an optional colour.
#[derive(Debug, Clone, Default)]
pub struct Cell {
    text: String,
    colour: Option<&'static str>,
}

impl Cell {
    /// A cell in `colour`.
    pub fn coloured(text: impl Into<String>, colour: Option<&'static str>) -> Cell {
        Cell {
            text: text.into(),
            colour,
        }
    }
}

impl<T: Into<String>> From<T> for Cell {
    fn from(text: T) -> Cell {
        Cell {
            text: text.into(),
            colour: None,
        }
    }
}

/// A table whose columns are aligned on the widest cell (widths count characters, not the
/// colour escapes).
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<Cell>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(headers: &[&'static str]) -> Table {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row (one cell per header).
    pub fn row(&mut self, cells: Vec<Cell>) {
        self.rows.push(cells);
    }

    /// Prints the header (dimmed on a terminal) and the rows, each line indented by `indent`.
    pub fn print(&self, out: &Out, indent: &str) -> Result<(), CliError> {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate() {
                if i < widths.len() {
                    widths[i] = widths[i].max(cell.text.chars().count());
                }
            }
        }
        let render = |cells: &[Cell]| -> String {
            let last = cells.len().saturating_sub(1);
            let mut s = String::from(indent);
            for (i, cell) in cells.iter().enumerate() {
                s.push_str(&out.paint(&cell.text, cell.colour));
                if i < last {
                    let pad = widths[i].saturating_sub(cell.text.chars().count()) + 2;
                    s.extend(std::iter::repeat_n(' ', pad));
                }
            }
            s
        };
        let header: Vec<Cell> = self
            .headers
            .iter()
            .map(|h| Cell::coloured(*h, Some("1")))
            .collect();
        line(&render(&header))?;
        for row in &self.rows {
            line(&render(row))?;
        }
        Ok(())
    }
}

/// "just now", "42s ago", "3m ago", "5h ago", "2d ago" (or "in 3m", "in under 1s" for a
/// future time).
pub fn ago(at: Millis) -> String {
    let delta = now_millis() - at;
    let (future, ms) = if delta < 0 {
        (true, -delta)
    } else {
        (false, delta)
    };
    let s = ms / 1000;
    let text = if s < 1 {
        // A lease or a retry due within the second is still ahead, not "just now".
        return if future { "in under 1s" } else { "just now" }.into();
    } else if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m", s / 60)
    } else if s < 86_400 {
        format!("{}h", s / 3600)
    } else {
        format!("{}d", s / 86_400)
    };
    if future {
        format!("in {text}")
    } else {
        format!("{text} ago")
    }
}

/// A duration as people read it: "850ms", "12s", "3m4s", "2h5m", "3d4h".
pub fn duration(ms: i64) -> String {
    let ms = ms.max(0);
    let s = ms / 1000;
    if ms < 1000 {
        format!("{ms}ms")
    } else if s < 60 {
        format!("{s}s")
    } else if s < 3600 {
        format!("{}m{}s", s / 60, s % 60)
    } else if s < 86_400 {
        format!("{}h{}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}d{}h", s / 86_400, (s % 86_400) / 3600)
    }
}

/// The local time of day, "14:03:27", for streamed lines.
pub fn clock(at: Millis) -> String {
    let secs = (at / 1000) as libc::time_t;
    // SAFETY: localtime_r only writes the `tm` we pass; a zeroed tm is a valid initial value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let ok = unsafe { !libc::localtime_r(&secs, &mut tm).is_null() };
    if ok {
        format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
    } else {
        format!("@{}", at / 1000)
    }
}

/// `text` with every control character but the newline made a space: what the board holds
/// is anyone's (a worker's words in an error, a client's title), and an escape sequence in
/// it must not reach the operator's terminal. So are the invisible marks that reorder text
/// (bidirectional overrides, embeddings, isolates): a title must not make a row read as
/// something it is not.
pub fn printable(text: &str) -> String {
    // The Arabic letter mark, left-to-right and right-to-left marks, embeddings and
    // overrides, isolates.
    let reorders = |c: char| {
        matches!(
            c,
            '\u{061c}'
                | '\u{200e}'
                | '\u{200f}'
                | '\u{202a}'..='\u{202e}'
                | '\u{2066}'..='\u{2069}'
        )
    };
    text.chars()
        .map(|c| {
            if (c.is_control() && c != '\n') || reorders(c) {
                ' '
            } else {
                c
            }
        })
        .collect()
}

/// `text` cut to `max` characters with an ellipsis, on one line (see [`printable`]).
pub fn short(text: &str, max: usize) -> String {
    let one_line = printable(text).replace('\n', " ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let mut s: String = one_line.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printable_blanks_controls_and_reordering_marks_but_keeps_text() {
        assert_eq!(
            printable("a\x1b[31mb\tc\u{202e}txt.exe\u{2066}d\ne é ✓"),
            "a [31mb c txt.exe d\ne é ✓"
        );
    }

    #[test]
    fn durations_read_like_people_write_them() {
        assert_eq!(duration(850), "850ms");
        assert_eq!(duration(12_000), "12s");
        assert_eq!(duration(184_000), "3m4s");
        assert_eq!(duration(7_500_000), "2h5m");
    }

    #[test]
    fn relative_times() {
        let now = now_millis();
        assert_eq!(ago(now), "just now");
        assert_eq!(ago(now + 900), "in under 1s");
        assert_eq!(ago(now - 180_000), "3m ago");
        assert_eq!(ago(now + 120_500), "in 2m");
    }

    #[test]
    fn short_cuts_with_an_ellipsis() {
        assert_eq!(short("abc", 5), "abc");
        assert_eq!(short("abcdefgh", 5), "abcd…");
        assert_eq!(short("a\nb", 5), "a b");
    }
}
