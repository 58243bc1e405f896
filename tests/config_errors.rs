//! A config mistake is refused at load with one line that names the key — never silently
//! replaced by a default — and the shipped `config.toml` loads as it is.

use std::path::{Path, PathBuf};

use runwarden::config::*;

/// The message of a refused inline config, checked to be on one line.
fn refused(text: &str) -> String {
    match Config::from_toml_str(text, Path::new("/tmp")) {
        Ok(config) => panic!("config was accepted: {config:?}\n---\n{text}"),
        Err(ConfigError::Invalid { path, message }) => {
            assert_eq!(path, Path::new("<inline>"));
            assert!(!message.is_empty());
            assert!(
                !message.contains('\n'),
                "message is not one line: {message:?}"
            );
            message
        }
        Err(other) => panic!("expected ConfigError::Invalid, got {other:?}"),
    }
}

/// A uid no user has (no passwd entry).
fn free_uid() -> u32 {
    (40_000..60_000)
        .find(|&u| {
            matches!(
                nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(u)),
                Ok(None)
            )
        })
        .expect("a free uid")
}

/// A minimal valid assignee, so each test changes exactly one thing.
const CODER: &str = "[assignees.coder]\ncommand = [\"true\"]\n";

#[test]
fn shipped_config_loads_with_two_assignees() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config.toml");
    let config = Config::load(&path).expect("the shipped config.toml must load");
    assert_eq!(config.path.as_deref(), Some(path.as_path()));
    assert_eq!(config.assignees.len(), 2, "{:?}", config.assignees.keys());
    // Data goes under ./.runwarden/ next to the file, as `cargo run -- serve` promises.
    let data_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(".runwarden");
    assert_eq!(config.supervisor.data_dir, data_dir);
    assert_eq!(config.socket_path(), data_dir.join("control.sock"));
    assert_eq!(config.db_path(), data_dir.join("board.db"));
    for (name, assignee) in &config.assignees {
        assert!(!assignee.command.is_empty(), "{name}");
        assert_eq!(config.assignee(name), Some(assignee));
    }
    let reviewer = config.assignee("reviewer").expect("reviewer assignee");
    assert_eq!(reviewer.max_in_progress, 1);
    assert_eq!(
        reviewer.max_runtime,
        Some(std::time::Duration::from_secs(600))
    );
}

#[test]
fn unknown_top_level_key_is_named() {
    let message = refused("[supervisr]\ntick = \"1s\"\n");
    assert!(message.contains("unknown key `supervisr`"), "{message}");
    assert!(message.contains("top level"), "{message}");
    assert!(message.contains("line 1"), "{message}");
}

#[test]
fn unknown_supervisor_key_is_named_with_its_section() {
    let message = refused("[supervisor]\ntick = \"1s\"\nmax_in_progres = 4\n");
    assert!(
        message.contains("unknown key `max_in_progres` in [supervisor]"),
        "{message}"
    );
    assert!(
        message.contains("max_in_progress"),
        "the expected keys are listed: {message}"
    );
    assert!(message.contains("line 3"), "{message}");
}

#[test]
fn unknown_assignee_key_is_named_with_its_section() {
    let message = refused(&format!("{CODER}max_runtme = \"1h\"\n"));
    assert!(
        message.contains("unknown key `max_runtme` in [assignees.coder]"),
        "{message}"
    );
    assert!(message.contains("line 3"), "{message}");
}

#[test]
fn bad_duration_names_the_key() {
    let message = refused("[reaper]\ngrace = \"5 parsecs\"\n");
    assert!(message.contains("[reaper] grace"), "{message}");
    assert!(message.contains("5 parsecs"), "{message}");
    assert!(message.contains("line 2"), "{message}");

    let message = refused(&format!("{CODER}max_runtime = \"5 parsecs\"\n"));
    assert!(
        message.contains("[assignees.coder] max_runtime"),
        "{message}"
    );
}

#[test]
fn wrong_type_names_the_key() {
    let message = refused("[supervisor]\nmax_in_progress = \"8\"\n");
    assert!(
        message.contains("[supervisor] max_in_progress"),
        "{message}"
    );
    assert!(message.contains("integer"), "{message}");
}

#[test]
fn an_unknown_choice_names_the_key_and_the_choices() {
    let message = refused("[supervisor]\nscheduling = \"fifo\"\n");
    assert!(message.contains("[supervisor] scheduling"), "{message}");
    assert!(message.contains("fifo"), "{message}");
    assert!(
        message.contains("batch") && message.contains("normal"),
        "the accepted values are listed: {message}"
    );
}

#[test]
fn zero_max_in_progress_is_refused() {
    let message = refused("[supervisor]\nmax_in_progress = 0\n");
    assert!(
        message.contains("[supervisor] max_in_progress"),
        "{message}"
    );
    assert!(message.contains("at least 1"), "{message}");

    let message = refused(&format!("{CODER}max_in_progress = 0\n"));
    assert!(
        message.contains("[assignees.coder] max_in_progress"),
        "{message}"
    );
}

#[test]
fn zero_tick_is_refused() {
    let message = refused("[supervisor]\ntick = \"0s\"\n");
    assert!(message.contains("[supervisor] tick"), "{message}");
}

#[test]
fn empty_command_is_refused() {
    let message = refused("[assignees.coder]\ncommand = []\n");
    assert!(
        message.contains("[assignees.coder] command: must not be empty"),
        "{message}"
    );

    let message = refused("[assignees.coder]\nmax_in_progress = 1\n");
    assert!(message.contains("missing key `command`"), "{message}");
    assert!(message.contains("[assignees.coder]"), "{message}");
}

#[test]
fn unknown_user_is_refused_naming_user() {
    let message = refused(&format!("{CODER}user = \"no-such-user-for-runwarden\"\n"));
    assert!(message.contains("[assignees.coder] user"), "{message}");
    assert!(message.contains("no-such-user-for-runwarden"), "{message}");

    let message = refused(&format!("{CODER}group = \"no-such-group-for-runwarden\"\n"));
    assert!(message.contains("[assignees.coder] group"), "{message}");
}

#[test]
fn unknown_rlimit_is_refused() {
    let message = refused(&format!(
        "{CODER}rlimits = {{ nofile = 1024, files = 10 }}\n"
    ));
    assert!(message.contains("rlimits"), "{message}");
    assert!(message.contains("`files`"), "{message}");
    assert!(
        message.contains("nofile"),
        "the accepted names are listed: {message}"
    );
}

#[test]
fn bad_assignee_name_is_refused() {
    let message = refused("[assignees.\"co der\"]\ncommand = [\"true\"]\n");
    assert!(message.contains("invalid assignee name"), "{message}");
}

#[test]
fn umask_out_of_range_is_refused() {
    let message = refused(&format!("{CODER}umask = \"0999\"\n"));
    assert!(message.contains("[assignees.coder] umask"), "{message}");
    let message = refused(&format!("{CODER}umask = 0o1777\n"));
    assert!(message.contains("[assignees.coder] umask"), "{message}");
}

#[test]
fn missing_file_is_a_read_error_naming_the_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path: PathBuf = dir.path().join("absent.toml");
    match Config::load(&path) {
        Err(ConfigError::Read {
            path: named,
            source,
        }) => {
            assert_eq!(named, path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected ConfigError::Read, got {other:?}"),
    }
    let shown = Config::load(&path).unwrap_err().to_string();
    assert!(shown.contains(&path.display().to_string()), "{shown}");
}

#[test]
fn malformed_toml_is_one_line_with_its_position() {
    let message = refused("[supervisor]\ntick = \"1s\"\nmax_in_progress = = 3\n");
    assert!(message.contains("line 3"), "{message}");
    assert!(message.contains("column"), "{message}");

    let message = refused("[supervisor\n");
    assert!(message.contains("line 1"), "{message}");

    // A value TOML itself cannot hold names its key, as a wrong value does.
    let message = refused("[supervisor]\nmax_in_progress = 99999999999999999999\n");
    assert!(
        message.contains("`max_in_progress`") && message.contains("line 2"),
        "{message}"
    );
}

#[test]
fn errors_from_a_file_name_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("config.toml");
    std::fs::write(&path, "[control]\nbogus = 1\n").expect("write");
    let shown = Config::load(&path).unwrap_err().to_string();
    assert!(shown.starts_with("invalid config "), "{shown}");
    assert!(shown.contains(&path.display().to_string()), "{shown}");
    assert!(
        shown.contains("unknown key `bogus` in [control]"),
        "{shown}"
    );
    assert!(!shown.contains('\n'), "{shown}");
}

#[test]
fn absurd_durations_are_refused_naming_the_key() {
    for (section, key) in [
        ("[reaper]\n", "kill_timeout"),
        ("[reaper]\n", "grace"),
        ("[supervisor]\n", "tick"),
        ("[leases]\n", "claim_ttl"),
        ("[retries]\n", "backoff_max"),
    ] {
        for absurd in ["500000000000y", "101y", "18446744073709551615s"] {
            let message = refused(&format!("{section}{key} = \"{absurd}\"\n"));
            let header = section.trim();
            assert!(
                message.contains(&format!("{header} {key}: ")),
                "{key} = {absurd}: {message}"
            );
            // Either refused as too long, or (beyond what humantime can even count) as invalid.
            assert!(
                message.contains("too long (max 100 years)") || message.contains("invalid"),
                "{key} = {absurd}: {message}"
            );
        }
    }
    let message = refused("[reaper]\nkill_timeout = \"500000000000y\"\n");
    assert!(
        message.starts_with("[reaper] kill_timeout: too long (max 100 years)"),
        "{message}"
    );
    let message = refused(&format!("{CODER}max_runtime = \"200y\"\n"));
    assert!(
        message.contains("[assignees.coder] max_runtime: too long (max 100 years)"),
        "{message}"
    );
    let message =
        refused("[[hooks]]\non = [\"completed\"]\ncommand = [\"true\"]\ntimeout = \"1000y\"\n");
    assert!(message.contains("too long (max 100 years)"), "{message}");
}

#[test]
fn a_hundred_years_is_still_accepted() {
    let config = Config::from_toml_str("[reaper]\nkill_timeout = \"100y\"\n", Path::new("/tmp"))
        .expect("100y is within the bound");
    assert_eq!(
        config.reaper.kill_timeout,
        std::time::Duration::from_secs(100 * 31_557_600)
    );
}

#[test]
fn a_tick_under_a_millisecond_is_refused() {
    let message = refused("[supervisor]\ntick = \"1ns\"\n");
    assert!(message.contains("[supervisor] tick"), "{message}");
    assert!(message.contains("at least 1ms"), "{message}");
}

#[test]
fn env_names_must_be_portable_and_not_the_supervisors() {
    for bad in ["FOO BAR", "1X", "A-B", "É"] {
        let message = refused(&format!("{CODER}env = {{ {bad:?} = \"v\" }}\n"));
        assert!(
            message.contains("invalid variable name"),
            "{bad}: {message}"
        );
    }
    for reserved in [
        "RUNWARDEN_RUN_TOKEN",
        "RUNWARDEN_TASK_TITLE",
        "RUNWARDEN_SOCKET",
    ] {
        let message = refused(&format!("{CODER}env = {{ {reserved} = \"v\" }}\n"));
        assert!(
            message.contains(&format!("[assignees.coder] env.{reserved}")),
            "{message}"
        );
        assert!(message.contains("set by the supervisor"), "{message}");
    }
    // The CLI's own settings inside a worker are the assignee's to set.
    let ok = Config::from_toml_str(
        &format!(
            "{CODER}env = {{ _UNDER_1 = \"v\", PATH = \"/bin\", RUNWARDEN_CONNECT_WAIT = \"5s\" }}\n"
        ),
        Path::new("/tmp"),
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn hook_event_kinds_must_exist() {
    let message = refused("[[hooks]]\non = [\"gaveup\"]\ncommand = [\"true\"]\n");
    assert!(message.contains("[[hooks]] #1 on"), "{message}");
    assert!(message.contains("unknown event kind `gaveup`"), "{message}");
    assert!(message.contains("gave_up"), "names the kinds: {message}");
    for ok in ["*", "gave_up", "crashed", "terminal_worker_reaped"] {
        let text = format!("[[hooks]]\non = [{ok:?}]\ncommand = [\"true\"]\n");
        let loaded = Config::from_toml_str(&text, Path::new("/tmp"));
        assert!(loaded.is_ok(), "{ok}: {loaded:?}");
    }
}

#[test]
fn a_working_directory_must_exist_when_a_supervisor_starts() {
    let dir = tempfile::tempdir().unwrap();
    let start = |cwd: &Path| {
        let text = format!("{CODER}cwd = {:?}\n", cwd.display().to_string());
        // Loading it is fine (other commands load it too, as users who may not reach it)…
        let mut config = Config::from_toml_str(&text, Path::new("/tmp")).expect("loads");
        config.supervisor.data_dir = dir.path().join("data");
        // …a supervisor refuses to start on it.
        match runwarden::Supervisor::start(config) {
            Err(runwarden::SupervisorError::Config(ConfigError::Invalid { message, .. })) => {
                message
            }
            Err(other) => panic!("refused for another reason: {other}"),
            Ok(_) => panic!("a supervisor started with cwd {}", cwd.display()),
        }
    };
    let missing = dir.path().join("missing");
    let message = start(&missing);
    assert!(message.contains("[assignees.coder] cwd"), "{message}");
    assert!(message.contains("missing"), "{message}");
    assert!(!missing.exists(), "nothing is created by a refused start");
    // Not even the data dir, its logs/ and work/ (made before the cwd could be checked).
    assert!(
        !dir.path().join("data").exists(),
        "a refused start left its data dir behind"
    );

    let file = dir.path().join("file");
    std::fs::write(&file, "").unwrap();
    assert!(start(&file).contains("is not a directory"));
    assert!(!dir.path().join("data").exists());
}

#[test]
fn ids_set_in_code_without_names_are_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::with_data_dir(dir.path());
    let mut coder = AssigneeConfig::new(["true"]);
    coder.uid = Some(65534);
    coder.gid = Some(65534);
    config.assignees.insert("coder".into(), coder);
    config.validate().expect("valid");
    let coder = config.assignee("coder").unwrap();
    assert_eq!((coder.uid, coder.gid), (Some(65534), Some(65534)));

    // A uid alone gets its user's primary group, never the supervisor's by default.
    let daemon = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(1))
        .expect("passwd lookup")
        .expect("this test needs a user with uid 1 (daemon)");
    let coder = config.assignees.get_mut("coder").unwrap();
    (coder.uid, coder.gid) = (Some(1), None);
    config.validate().expect("valid");
    assert_eq!(
        config.assignee("coder").unwrap().gid,
        Some(daemon.gid.as_raw())
    );
    // One with no user entry needs its gid set too.
    let free = free_uid();
    let coder = config.assignees.get_mut("coder").unwrap();
    (coder.uid, coder.gid) = (Some(free), None);
    match config.validate() {
        Err(ConfigError::Invalid { message, .. }) => {
            assert!(message.contains("set gid too"), "{message}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_socket_path_too_long_to_bind_is_refused_at_load() {
    let long = format!("/tmp/{}", "d".repeat(120));
    let message = refused(&format!("[supervisor]\ndata_dir = {long:?}\n"));
    assert!(message.contains("[supervisor] data_dir"), "{message}");
    assert!(message.contains("at most 107"), "{message}");
    let message = refused(&format!("[supervisor]\nsocket = \"{long}/c.sock\"\n"));
    assert!(message.contains("[supervisor] socket"), "{message}");
}

#[test]
fn a_numeric_user_gets_its_primary_group_or_needs_one() {
    // uid 1 is `daemon` (group 1) on Debian and most distributions; read it from the system.
    let entry = nix::unistd::User::from_uid(nix::unistd::Uid::from_raw(1))
        .expect("passwd lookup")
        .expect("this test needs a user with uid 1 (daemon)");
    let config = Config::from_toml_str(&format!("{CODER}user = \"1\"\n"), Path::new("/tmp"))
        .expect("a numeric user with a passwd entry");
    let coder = config.assignee("coder").unwrap();
    assert_eq!(coder.uid, Some(1));
    // As a TOML integer too ("name or uid"), and a group alike.
    let config = Config::from_toml_str(&format!("{CODER}user = 1\ngroup = 1\n"), Path::new("/tmp"))
        .expect("a uid and gid written as integers");
    let coder = config.assignee("coder").unwrap();
    assert_eq!((coder.uid, coder.gid), (Some(1), Some(1)));
    for bad in ["-1", "4294967296", "true"] {
        let message = refused(&format!("{CODER}user = {bad}\n"));
        assert!(
            message.contains("[assignees.coder] user"),
            "{bad}: {message}"
        );
    }
    assert_eq!(
        coder.gid,
        Some(entry.gid.as_raw()),
        "the user's primary group"
    );

    // A uid nobody has: no primary group to take, so `group` is required.
    let free = free_uid();
    let message = refused(&format!("{CODER}user = \"{free}\"\n"));
    assert!(message.contains("[assignees.coder] user"), "{message}");
    assert!(message.contains("set `group` too"), "{message}");
    let config = Config::from_toml_str(
        &format!("{CODER}user = \"{free}\"\ngroup = \"{free}\"\n"),
        Path::new("/tmp"),
    )
    .expect("with an explicit group");
    assert_eq!(config.assignee("coder").unwrap().gid, Some(free));
}

#[test]
fn a_config_built_in_code_is_checked_when_validated() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = Config::with_data_dir(dir.path());
    let mut coder = AssigneeConfig::new(["true"]);
    coder.user = Some("no-such-user-for-runwarden".into());
    config.assignees.insert("coder".into(), coder);
    match config.validate() {
        Err(ConfigError::Invalid { path, message }) => {
            assert_eq!(path, Path::new("<config built in code>"));
            assert!(message.contains("[assignees.coder] user"), "{message}");
        }
        other => panic!("expected the unknown user refused, got {other:?}"),
    }
    // And a supervisor started on it refuses to start, rather than run the worker as itself.
    match runwarden::Supervisor::start(config.clone()) {
        Err(runwarden::SupervisorError::Config(ConfigError::Invalid { message, .. })) => {
            assert!(message.contains("no-such-user-for-runwarden"), "{message}");
        }
        Err(other) => panic!("refused for another reason: {other}"),
        Ok(_) => panic!("a supervisor started with an unknown user"),
    }
    // A user that exists is resolved to its ids, as at load.
    config.assignees.get_mut("coder").unwrap().user = Some("daemon".into());
    config.validate().expect("daemon exists");
    assert!(config.assignee("coder").unwrap().uid.is_some());
}

#[test]
fn a_claim_ttl_under_two_ticks_is_refused() {
    let message = refused("[supervisor]\ntick = \"1s\"\n[leases]\nclaim_ttl = \"1500ms\"\n");
    assert!(message.contains("[leases] claim_ttl"), "{message}");
    assert!(
        message.contains("at least twice [supervisor] tick (2s)"),
        "{message}"
    );
    let ok = Config::from_toml_str(
        "[supervisor]\ntick = \"1s\"\n[leases]\nclaim_ttl = \"2s\"\n",
        Path::new("/tmp"),
    );
    assert!(ok.is_ok(), "{ok:?}");
}

#[test]
fn a_data_dir_that_is_a_file_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data");
    std::fs::write(&file, "not a dir").unwrap();
    let config = Config::with_data_dir(&file);
    let message = match runwarden::Supervisor::start(config) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a supervisor started on a file as its data dir"),
    };
    assert!(
        message.contains("is not a directory") && message.contains("[supervisor] data_dir"),
        "{message}"
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "not a dir");
    // A file further up its path.
    let config = Config::with_data_dir(file.join("below"));
    let message = match runwarden::Supervisor::start(config) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a supervisor started below a file"),
    };
    assert!(
        message.contains("has a file, not a directory, on its path"),
        "{message}"
    );
    // A place nothing may create a directory in (not even root): the key is named too.
    let config = Config::with_data_dir("/proc/runwarden-test/data");
    let message = match runwarden::Supervisor::start(config) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a supervisor started in /proc"),
    };
    assert!(
        message.starts_with("[supervisor] data_dir: cannot create"),
        "{message}"
    );
}

/// The data dir becomes the supervisor's own (0700) only when it is: a shared directory
/// (sticky and writable by all, like `/tmp`) is refused and left as it was — as root,
/// `data_dir = "/tmp"` once made `/tmp` 0700 — and one of another user's, or one holding other
/// things (as `/var/lib` would), keeps its mode, or is refused if others may write in it.
#[test]
fn a_data_dir_not_the_supervisors_alone_keeps_its_mode() {
    use std::os::unix::fs::PermissionsExt;
    let mode_of = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    let set_mode = |p: &Path, mode: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap()
    };
    let refused = |dir: &Path| match runwarden::Supervisor::start(Config::with_data_dir(dir)) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a supervisor started in {}", dir.display()),
    };
    let started = |dir: &Path| {
        runwarden::Supervisor::start(Config::with_data_dir(dir))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .shutdown()
    };
    let dir = tempfile::tempdir().unwrap();

    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::write(shared.join("someone's"), "x").unwrap();
    set_mode(&shared, 0o1777);
    let message = refused(&shared);
    assert!(
        message.contains("[supervisor] data_dir") && message.contains("shared directory"),
        "{message}"
    );
    assert_eq!(
        mode_of(&shared),
        0o1777,
        "the shared directory's mode was changed"
    );

    // Another user's (the supervisor is root here).
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    set_mode(&theirs, 0o755);
    let uid = free_uid();
    nix::unistd::chown(&theirs, Some(nix::unistd::Uid::from_raw(uid)), None).unwrap();
    started(&theirs);
    assert_eq!(
        mode_of(&theirs),
        0o755,
        "another user's directory was made the supervisor's"
    );
    set_mode(&theirs, 0o777);
    let message = refused(&theirs);
    assert!(message.contains("others may write in it"), "{message}");
    assert_eq!(mode_of(&theirs), 0o777);

    // The supervisor's user's, but holding other things.
    let busy = dir.path().join("busy");
    std::fs::create_dir(&busy).unwrap();
    std::fs::write(busy.join("notes.txt"), "mine").unwrap();
    set_mode(&busy, 0o755);
    started(&busy);
    assert_eq!(
        mode_of(&busy),
        0o755,
        "a directory holding other things was made 0700"
    );
    set_mode(&busy, 0o777);
    let message = refused(&busy);
    assert!(
        message.contains("holds files that are not the supervisor's"),
        "{message}"
    );

    // Its own, holding only what a supervisor keeps (a board from an earlier start): 0700.
    let own = dir.path().join("own");
    started(&own);
    set_mode(&own, 0o755);
    started(&own);
    assert_eq!(mode_of(&own), 0o700);

    // Its own with something else in it, serving another user now: never narrowed, but given
    // the traversal that user needs to reach the socket (0700 → 0711).
    std::fs::write(own.join("board.db.bak"), "a copy").unwrap();
    let mut serving = Config::with_data_dir(&own);
    serving.control.allowed_uids = vec![free_uid()];
    runwarden::Supervisor::start(serving)
        .expect("start serving another user")
        .shutdown();
    assert_eq!(mode_of(&own), 0o711);
}

/// Something that is not a socket in the socket's place is never replaced, and the refusal
/// names the key that put the socket there.
#[test]
fn a_socket_path_taken_by_something_else_names_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let taken = dir.path().join("taken");
    std::fs::create_dir(&taken).unwrap();
    let mut config = Config::with_data_dir(dir.path().join("data"));
    config.supervisor.socket = Some(taken.clone());
    let message = match runwarden::Supervisor::start(config) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a supervisor started with a directory as its socket"),
    };
    assert!(
        message.starts_with("[supervisor] socket:") && message.contains("is not a socket"),
        "{message}"
    );
    assert!(taken.is_dir(), "what was in the socket's place was touched");
    assert!(
        !dir.path().join("data").exists(),
        "a refused start left its data dir behind"
    );

    // A data dir that was there before is kept, and what it holds.
    let kept = dir.path().join("kept");
    std::fs::create_dir_all(kept.join("logs")).unwrap();
    std::fs::write(kept.join("logs").join("1.log"), "earlier output").unwrap();
    let mut config = Config::with_data_dir(kept.clone());
    config.supervisor.socket = Some(taken.clone());
    assert!(runwarden::Supervisor::start(config).is_err());
    assert_eq!(
        std::fs::read_to_string(kept.join("logs").join("1.log"))
            .ok()
            .as_deref(),
        Some("earlier output")
    );
    assert!(kept.is_dir());
}

/// A resource limit no worker could be given is refused when a supervisor starts, naming the
/// key — not found out at every spawn (`spawn_failed`). Checked against the starting process:
/// `nofile` above `fs.nr_open` for anyone, and any limit above this process's hard limit for a
/// worker that runs as another user (only root may raise a hard limit).
#[test]
fn a_resource_limit_no_worker_could_be_given_is_refused_at_start() {
    use nix::sys::resource::{Resource, getrlimit};
    let nr_open: u64 = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .expect("fs.nr_open")
        .trim()
        .parse()
        .expect("a number");
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    assert!(
        hard < nr_open,
        "this test needs a finite nofile hard limit under fs.nr_open ({hard} / {nr_open})"
    );
    let with = |user: Option<&str>, nofile: u64| {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::with_data_dir(dir.path());
        let mut coder = AssigneeConfig::new(["true"]);
        coder.user = user.map(str::to_string);
        coder.rlimits.insert("nofile".into(), nofile);
        config.assignees.insert("coder".into(), coder);
        config.validate().expect("valid at load");
        config.check_rlimits()
    };
    let message = |r: Result<(), ConfigError>| match r {
        Err(ConfigError::Invalid { message, .. }) => message,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let m = message(with(None, nr_open + 1));
    assert!(
        m.contains("[assignees.coder] rlimits.nofile") && m.contains("fs.nr_open"),
        "{m}"
    );
    // Root (this test) may raise its hard limit for a worker that runs as root...
    with(None, hard + 1).expect("a root worker may raise the hard limit");
    // ...not for one that runs as another user.
    let m = message(with(Some("daemon"), hard + 1));
    assert!(
        m.contains("[assignees.coder] rlimits.nofile") && m.contains("hard limit"),
        "{m}"
    );
    with(Some("daemon"), hard).expect("up to the hard limit is fine");
}

/// A config built in code is bounded as a file is: a duration over 100 years (`Duration::MAX`
/// meant as "never") is refused naming its key, not left to wrap to "already past" in the
/// arithmetic of leases, graces and backoffs (a run closed stale at once, a worker ended with
/// no grace, a respawn loop, an overflow in the store).
#[test]
fn a_duration_too_long_in_a_config_built_in_code_is_refused_naming_its_key() {
    use std::time::Duration;
    type Set = fn(&mut Config);
    let cases: [(&str, Set); 12] = [
        ("[leases] stale_after", |c| {
            c.leases.stale_after = Duration::MAX
        }),
        ("[reaper] grace", |c| c.reaper.grace = Duration::MAX),
        ("[retries] backoff", |c| {
            c.retries.backoff = Duration::MAX;
            c.retries.backoff_max = Duration::MAX;
        }),
        ("[assignees.coder] retry_cooldown", |c| {
            c.assignees.get_mut("coder").unwrap().retry_cooldown = Duration::MAX
        }),
        ("[assignees.coder] max_runtime", |c| {
            c.assignees.get_mut("coder").unwrap().max_runtime = Some(Duration::MAX)
        }),
        ("[leases] claim_ttl", |c| c.leases.claim_ttl = Duration::MAX),
        ("[supervisor] tick", |c| c.supervisor.tick = Duration::MAX),
        ("[reaper] kill_timeout", |c| {
            c.reaper.kill_timeout = Duration::MAX
        }),
        ("[retries] backoff_max", |c| {
            c.retries.backoff_max = Duration::MAX
        }),
        ("[retention] finished", |c| {
            c.retention.finished = Duration::MAX
        }),
        ("[control] idle_timeout", |c| {
            c.control.idle_timeout = Duration::MAX
        }),
        ("[[hooks]] #1 timeout", |c| {
            c.hooks.push(HookConfig {
                on: vec!["completed".into()],
                command: vec!["true".into()],
                timeout: Duration::MAX,
            })
        }),
    ];
    for (key, set) in cases {
        let mut config = Config::with_data_dir("/tmp/runwarden-never-created");
        config
            .assignees
            .insert("coder".into(), AssigneeConfig::new(["true"]));
        set(&mut config);
        match config.validate() {
            Err(ConfigError::Invalid { message, .. }) => assert!(
                message.contains(key) && message.contains("too long (max 100 years)"),
                "{key}: {message}"
            ),
            other => panic!("{key}: expected a refusal, got {other:?}"),
        }
    }
    // 100 years is fine, as in a file ("100y").
    let mut config = Config::with_data_dir("/tmp/runwarden-never-created");
    config.leases.stale_after = Duration::from_secs(100 * 31_557_600);
    config.validate().expect("100 years is allowed");
}
