//! Unit tests of parsing, defaults and resolution. Error messages are covered from the outside
//! in `tests/config_errors.rs`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;

fn parse_ok(text: &str) -> Config {
    Config::from_toml_str(text, Path::new("/etc/rw")).expect("config should parse")
}

fn parse_err(text: &str) -> String {
    match Config::from_toml_str(text, Path::new("/etc/rw")) {
        Ok(c) => panic!("expected an error, parsed {c:?}"),
        Err(ConfigError::Invalid { path, message }) => {
            assert_eq!(path, Path::new("<inline>"));
            assert!(
                !message.contains('\n'),
                "message not on one line: {message:?}"
            );
            message
        }
        Err(e) => panic!("unexpected error {e}"),
    }
}

#[test]
fn empty_file_has_every_default() {
    let c = parse_ok("");
    let mut expected = Config::with_data_dir("/etc/rw/.runwarden");
    expected.path = None;
    assert_eq!(c, expected);

    let s = &c.supervisor;
    assert_eq!(s.data_dir, Path::new("/etc/rw/.runwarden"));
    assert_eq!(s.socket, None);
    assert_eq!(s.tick, Duration::from_secs(1));
    assert_eq!(s.max_in_progress, 8);
    assert_eq!(s.shutdown, ShutdownMode::Leave);
    assert_eq!(s.synchronous, Synchronous::Full);
    assert_eq!(s.scheduling, Scheduling::Batch);
    assert_eq!(s.log_max_bytes, 10 * 1024 * 1024);
    assert_eq!(c.reaper.grace, Duration::from_secs(120));
    assert_eq!(c.reaper.kill_timeout, Duration::from_secs(5));
    assert_eq!(c.leases.claim_ttl, Duration::from_secs(900));
    assert_eq!(c.leases.stale_after, Duration::ZERO);
    assert_eq!(c.retries.max_retries, 2);
    assert_eq!(c.retries.backoff, Duration::from_secs(5));
    assert_eq!(c.retries.backoff_max, Duration::from_secs(300));
    assert_eq!(c.control.idle_timeout, Duration::from_secs(30));
    assert_eq!(c.control.max_connections, 256);
    assert_eq!(c.control.max_request_bytes, 1_048_576);
    assert!(c.control.allowed_uids.is_empty());
    assert_eq!(c.retention.finished, Duration::ZERO, "kept for ever");
    assert!(c.assignees.is_empty());
    assert!(c.hooks.is_empty());
}

#[test]
fn retention_takes_a_duration_and_names_its_key_when_wrong() {
    let c = parse_ok("[retention]\nfinished = \"30days\"\n");
    assert_eq!(c.retention.finished, Duration::from_secs(30 * 24 * 3600));
    let message = parse_err("[retention]\nfinished = \"a month\"\n");
    assert!(message.contains("finished"), "{message}");
    let message = parse_err("[retention]\nfinshed = \"1d\"\n");
    assert!(message.contains("finshed"), "{message}");
}

#[test]
fn assignee_defaults() {
    let c = parse_ok("[assignees.coder]\ncommand = [\"true\"]\n");
    let a = c.assignee("coder").expect("coder");
    assert_eq!(a, &AssigneeConfig::new(["true"]));
    assert_eq!(a.max_in_progress, 1);
    assert_eq!(a.max_runtime, None);
    assert_eq!(a.max_retries, None);
    assert_eq!(a.on_exit_zero, OnExitZero::Complete);
    assert_eq!(a.retry_cooldown, Duration::from_secs(30));
    assert_eq!((a.uid, a.gid, a.umask), (None, None, None));
    assert!(c.assignee("nobody-here").is_none());
}

#[test]
fn hook_defaults() {
    let c = parse_ok("[[hooks]]\non = [\"gave_up\"]\ncommand = [\"true\"]\n");
    assert_eq!(c.hooks, vec![HookConfig::new(["gave_up"], ["true"])]);
    assert_eq!(c.hooks[0].timeout, Duration::from_secs(30));
}

#[test]
fn every_duration_form() {
    let cases = [
        ("0s", Duration::ZERO),
        ("0", Duration::ZERO),
        ("10ns", Duration::from_nanos(10)),
        ("7us", Duration::from_micros(7)),
        ("500ms", Duration::from_millis(500)),
        ("1s", Duration::from_secs(1)),
        ("90 sec", Duration::from_secs(90)),
        ("2m", Duration::from_secs(120)),
        ("5min", Duration::from_secs(300)),
        ("5 minutes", Duration::from_secs(300)),
        ("1h", Duration::from_secs(3600)),
        ("1h 30m", Duration::from_secs(5400)),
        ("1h30m", Duration::from_secs(5400)),
        ("2 hours", Duration::from_secs(7200)),
        ("1d", Duration::from_secs(86_400)),
        ("1w", Duration::from_secs(7 * 86_400)),
        ("1s 500ms", Duration::from_millis(1500)),
        (" 3s ", Duration::from_secs(3)),
    ];
    for (written, expected) in cases {
        let c = parse_ok(&format!("[reaper]\ngrace = {written:?}\n"));
        assert_eq!(c.reaper.grace, expected, "{written:?}");
    }
}

#[test]
fn bad_durations_name_the_key() {
    for bad in [
        "\"5 parsecs\"",
        "\"\"",
        "\"ten seconds\"",
        "\"-1s\"",
        "5",
        "true",
    ] {
        let message = parse_err(&format!("[leases]\nclaim_ttl = {bad}\n"));
        assert!(message.contains("[leases] claim_ttl"), "{bad}: {message}");
        assert!(message.contains("line 2"), "{bad}: {message}");
    }
}

#[test]
fn durations_round_trip_through_serialize() {
    let c = parse_ok("[reaper]\ngrace = \"1h 30m\"\n");
    let text = toml::to_string(&c).expect("serialize");
    assert!(text.contains("grace = \"1h 30m\""), "{text}");
    let again = parse_ok(&text);
    assert_eq!(again, c);
}

#[test]
fn relative_paths_resolve_against_the_config_dir() {
    // Working directories must exist at load: real ones, beside the "config dir".
    let tmp = tempfile::tempdir().unwrap();
    let (conf, src, abs) = (
        tmp.path().join("rw"),
        tmp.path().join("src"),
        tmp.path().join("w"),
    );
    for d in [&conf, &src, &abs] {
        std::fs::create_dir(d).unwrap();
    }
    let c = Config::from_toml_str(
        &format!(
            r#"
        [supervisor]
        data_dir = "./state"
        socket = "run/rw.sock"
        [assignees.a]
        command = ["true"]
        cwd = "../src"
        [assignees.b]
        command = ["true"]
        cwd = {abs:?}
        "#
        ),
        &conf,
    )
    .expect("config should parse");
    assert_eq!(c.supervisor.data_dir, conf.join("state"));
    assert_eq!(c.socket_path(), conf.join("run/rw.sock"));
    assert_eq!(c.db_path(), conf.join("state/board.db"));
    assert_eq!(c.logs_dir(), conf.join("state/logs"));
    assert_eq!(c.work_dir(), conf.join("state/work"));
    assert_eq!(c.lock_path(), conf.join("state/supervisor.lock"));
    assert_eq!(c.assignees["a"].cwd.as_deref(), Some(&*conf.join("../src")));
    assert_eq!(c.assignees["b"].cwd.as_deref(), Some(abs.as_path()));
}

#[test]
fn relative_base_dir_is_made_absolute() {
    let c = Config::from_toml_str("", Path::new("conf")).expect("parse");
    assert!(c.supervisor.data_dir.is_absolute());
    assert!(c.supervisor.data_dir.ends_with("conf/.runwarden"));
}

#[test]
fn load_resolves_against_the_file_and_records_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("rw.toml");
    std::fs::write(&path, "[supervisor]\ndata_dir = \"data\"\n").expect("write");
    let c = Config::load(&path).expect("load");
    assert_eq!(c.path.as_deref(), Some(path.as_path()));
    assert_eq!(c.supervisor.data_dir, dir.path().join("data"));
}

#[test]
fn socket_defaults_to_the_data_dir() {
    let c = Config::with_data_dir("/var/lib/rw");
    assert_eq!(c.socket_path(), Path::new("/var/lib/rw/control.sock"));
    let c = parse_ok("[supervisor]\ndata_dir = \"/srv/rw\"\n");
    assert_eq!(c.socket_path(), Path::new("/srv/rw/control.sock"));
}

#[test]
fn with_data_dir_makes_the_path_absolute() {
    let c = Config::with_data_dir("rel/dir");
    assert!(c.supervisor.data_dir.is_absolute());
    assert_eq!(c.path, None);
    assert!(c.assignees.is_empty());
}

#[test]
fn enums_parse_lowercase() {
    let c = parse_ok(
        r#"
        [supervisor]
        shutdown = "terminate"
        synchronous = "normal"
        scheduling = "normal"
        [assignees.a]
        command = ["true"]
        on_exit_zero = "crash"
        [assignees.b]
        command = ["true"]
        on_exit_zero = "complete"
        "#,
    );
    assert_eq!(c.supervisor.shutdown, ShutdownMode::Terminate);
    assert_eq!(c.supervisor.synchronous, Synchronous::Normal);
    assert_eq!(c.supervisor.synchronous.as_pragma(), "NORMAL");
    assert_eq!(Synchronous::Full.as_pragma(), "FULL");
    assert_eq!(c.supervisor.scheduling, Scheduling::Normal);
    assert_eq!(c.assignees["a"].on_exit_zero, OnExitZero::Crash);
    assert_eq!(c.assignees["b"].on_exit_zero, OnExitZero::Complete);
    assert_eq!(
        parse_ok("[supervisor]\nshutdown = \"leave\"")
            .supervisor
            .shutdown,
        ShutdownMode::Leave
    );

    let message = parse_err("[supervisor]\nshutdown = \"Kill\"\n");
    assert!(
        message.starts_with("[supervisor] shutdown: unknown value `Kill`"),
        "{message}"
    );
    assert!(message.contains("`leave` or `terminate`"), "{message}");
    let message = parse_err("[assignees.a]\ncommand = [\"x\"]\non_exit_zero = \"fail\"\n");
    assert!(
        message.starts_with("[assignees.a] on_exit_zero:"),
        "{message}"
    );
}

#[test]
fn zero_max_runtime_means_none() {
    let c = parse_ok("[assignees.a]\ncommand = [\"x\"]\nmax_runtime = \"0s\"\n");
    assert_eq!(c.assignees["a"].max_runtime, None);
    let c = parse_ok("[assignees.a]\ncommand = [\"x\"]\nmax_runtime = \"10m\"\n");
    assert_eq!(c.assignees["a"].max_runtime, Some(Duration::from_secs(600)));
}

#[test]
fn umask_forms() {
    for (written, expected) in [
        ("\"022\"", 0o22),
        ("\"0077\"", 0o77),
        ("\"0o027\"", 0o27),
        ("0o022", 0o22),
        ("0", 0),
    ] {
        let c = parse_ok(&format!(
            "[assignees.a]\ncommand = [\"x\"]\numask = {written}\n"
        ));
        assert_eq!(c.assignees["a"].umask, Some(expected), "{written}");
    }
    for bad in ["\"1000\"", "\"089\"", "\"\"", "0o1000", "-1", "\"rwx\""] {
        let message = parse_err(&format!(
            "[assignees.a]\ncommand = [\"x\"]\numask = {bad}\n"
        ));
        assert!(
            message.starts_with("[assignees.a] umask:"),
            "{bad}: {message}"
        );
    }
}

#[test]
fn rlimits_accept_numbers_and_unlimited() {
    let c = parse_ok(
        "[assignees.a]\ncommand = [\"x\"]\nrlimits = { nofile = 4096, core = \"unlimited\" }\n",
    );
    let limits = &c.assignees["a"].rlimits;
    assert_eq!(limits["nofile"], 4096);
    assert_eq!(limits["core"], u64::MAX);
    assert!(limits.keys().all(|name| rlimit_resource(name).is_some()));
    let json = toml::to_string(&c).expect("serialize");
    assert!(json.contains("core = \"unlimited\""), "{json}");
}

#[test]
fn user_and_group_resolve_to_ids() {
    let c = parse_ok("[assignees.a]\ncommand = [\"x\"]\nuser = \"root\"\n");
    assert_eq!(
        (c.assignees["a"].uid, c.assignees["a"].gid),
        (Some(0), Some(0))
    );
    let c = parse_ok("[assignees.a]\ncommand = [\"x\"]\nuser = \"4242\"\ngroup = \"4343\"\n");
    assert_eq!(
        (c.assignees["a"].uid, c.assignees["a"].gid),
        (Some(4242), Some(4343))
    );
    let c = parse_ok("[assignees.a]\ncommand = [\"x\"]\ngroup = \"root\"\n");
    assert_eq!(
        (c.assignees["a"].uid, c.assignees["a"].gid),
        (None, Some(0))
    );
}

#[test]
fn resolve_path_prefers_the_flag() {
    // The environment fallback is not exercised here: tests run in parallel threads and
    // setting a variable would race with other tests.
    let flag = PathBuf::from("/x/y.toml");
    assert_eq!(Config::resolve_path(Some(&flag)), flag);
    if std::env::var_os(CONFIG_ENV).is_none() {
        assert_eq!(Config::resolve_path(None), Path::new("config.toml"));
    }
}

#[test]
fn assignee_names_are_checked() {
    let message = parse_err("[assignees.\"bad name\"]\ncommand = [\"x\"]\n");
    assert!(
        message.starts_with("[assignees.\"bad name\"]: invalid assignee name"),
        "{message}"
    );
    let message = parse_err("[assignees.\"\"]\ncommand = [\"x\"]\n");
    assert!(message.contains("invalid assignee name"), "{message}");
    parse_ok("[assignees.Code_r-2]\ncommand = [\"x\"]\n");
}

#[test]
fn relations_between_keys_are_checked() {
    let message = parse_err("[retries]\nbackoff = \"1m\"\nbackoff_max = \"30s\"\n");
    assert!(
        message.starts_with("[retries] backoff_max: must be at least backoff"),
        "{message}"
    );
    let message = parse_err(
        "[assignees.a]\ncommand = [\"x\"]\nretry_exit_codes = [75]\nfail_exit_codes = [2, 75]\n",
    );
    assert!(
        message.starts_with("[assignees.a] fail_exit_codes: exit code 75"),
        "{message}"
    );
    let message = parse_err("[assignees.a]\ncommand = [\"x\"]\nretry_exit_codes = [0]\n");
    assert!(message.contains("on_exit_zero"), "{message}");
    let message =
        parse_err("[assignees.a]\ncommand = [\"x\"]\nenv = { RUNWARDEN_RUN_ID = \"1\" }\n");
    assert!(
        message.starts_with("[assignees.a] env.RUNWARDEN_RUN_ID:"),
        "{message}"
    );
}

#[test]
fn hook_errors_name_the_entry() {
    let message = parse_err(
        "[[hooks]]\non = [\"crashed\"]\ncommand = [\"x\"]\n\n[[hooks]]\non = []\ncommand = [\"x\"]\n",
    );
    assert!(
        message.starts_with("[[hooks]] #2 on: must name at least one event kind"),
        "{message}"
    );
    assert!(message.contains("line 6"), "{message}");
    let message =
        parse_err("[[hooks]]\non = [\"crashed\"]\ncommand = [\"x\"]\ntimeout = \"soon\"\n");
    assert!(message.starts_with("[[hooks]] #1 timeout:"), "{message}");
    let message = parse_err("[[hooks]]\non = [\"crashed\"]\ncommand = [\"x\"]\nwhen = 1\n");
    assert!(
        message.starts_with("unknown key `when` in [[hooks]] #1"),
        "{message}"
    );
}
