//! A supervisor left running for days must not keep the memory and threads of its busiest
//! moment. A burst of clients paging through the event log at once starts a blocking thread
//! per concurrent read, and each builds its replies in an allocator arena of its own; once the
//! burst is over, the idle threads end and the freed memory goes back to the system (before:
//! 10 MB → 220 MB resident after four such bursts, and 90 threads, for good).

#[allow(dead_code)]
mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::control_daemon::Daemon;
use common::proc_guard::wait_until;

/// A field of `/proc/<pid>/status`, in kB (or a count).
fn status_field(pid: i32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in /proc/{pid}/status"))
}

/// `clients` connections at once, each pipelining `requests` pages of 1000 events and reading
/// every answer.
fn burst(socket: &std::path::Path, clients: usize, requests: usize) {
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let socket = socket.to_path_buf();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&socket).expect("connect");
                s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
                let mut lines = String::from("{\"id\":0,\"op\":\"hello\",\"version\":\"1.0\"}\n");
                for i in 1..=requests {
                    lines.push_str(&format!(
                        "{{\"id\":{i},\"op\":\"events\",\"since\":0,\"limit\":1000}}\n"
                    ));
                }
                s.write_all(lines.as_bytes()).expect("send");
                let mut r = BufReader::new(s);
                let mut line = String::new();
                for _ in 0..=requests {
                    line.clear();
                    assert!(
                        r.read_line(&mut line).expect("an answer") > 0,
                        "closed early"
                    );
                    assert!(
                        line.contains("\"ok\":true"),
                        "{}",
                        &line[..line.len().min(200)]
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("a burst client");
    }
}

#[test]
fn memory_and_threads_of_a_burst_of_reads_are_given_back() {
    let mut d = Daemon::start("", "[assignees.ok]\ncommand = [\"true\"]\n");
    let pid = d.pid();
    // A few hundred tasks run: about 1800 events to page through.
    let mut c = d.raw();
    c.hello();
    for i in 0..300 {
        let r = c.call(&format!(
            r#"{{"id":{i},"op":"add_task","title":"t{i}","assignee":"ok"}}"#
        ));
        assert_eq!(r["ok"], true, "{r}");
    }
    assert!(
        wait_until(Duration::from_secs(30), || {
            let r = c.call(r#"{"id":1000,"op":"status"}"#);
            r["result"]["counts"]["done"] == 300
        }),
        "the tasks did not all run"
    );
    drop(c);
    let (rss_before, threads_before) = (status_field(pid, "VmRSS:"), status_field(pid, "Threads:"));

    for _ in 0..3 {
        burst(&d.socket, 60, 8);
    }
    let peak = status_field(pid, "VmHWM:");
    let grew = peak.saturating_sub(rss_before);
    assert!(
        grew > 10_000,
        "the bursts did not grow the supervisor ({rss_before} → {peak} kB): this test shows nothing"
    );
    let mut now = (0, 0);
    let given_back = wait_until(Duration::from_secs(30), || {
        now = (status_field(pid, "VmRSS:"), status_field(pid, "Threads:"));
        // The store's four readers may stay busy with the supervisor's own reads.
        now.0 < rss_before + grew / 4 && now.1 <= threads_before + 5
    });
    assert!(
        given_back,
        "before the bursts {rss_before} kB and {threads_before} threads, peak {peak} kB; \
         30 s after them {} kB and {} threads",
        now.0, now.1
    );
    d.assert_healthy();
}
