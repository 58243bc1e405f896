//! The checks serde cannot express (ranges, relations between keys, names that must exist on
//! this machine), and the resolution of relative paths and user names. Runs once, at load, so
//! the rest of runwarden can trust every value.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::diagnose::{Problem, is_bare_key};
use super::serde_helpers::MAX_DURATION;
use super::{AssigneeConfig, Config, HookConfig, RLIMIT_NAMES, rlimit_resource};

/// The variables the supervisor sets for each run: an assignee may not set them, or its worker
/// would report against the wrong run (or all its runs would share one token, whose carriers
/// are ended together). Other `RUNWARDEN_*` names (`RUNWARDEN_CONNECT_WAIT`, `RUNWARDEN_LOG`,
/// read by the CLI inside a worker) are the assignee's to set.
const RESERVED_ENV: [&str; 5] = [
    "RUNWARDEN_SOCKET",
    "RUNWARDEN_TASK_ID",
    "RUNWARDEN_RUN_ID",
    "RUNWARDEN_RUN_TOKEN",
    "RUNWARDEN_TASK_TITLE",
];

/// The shortest tick: the dispatcher's and reaper's periodic timers run this often.
const MIN_TICK: Duration = Duration::from_millis(1);

/// The longest path a Unix socket can be bound at (`sun_path` is 108 bytes with its NUL).
const MAX_SOCKET_PATH: usize = 107;

type Checked = Result<(), Problem>;

/// Validates `config` and resolves its relative paths against `base_dir` (absolute) and its
/// user and group names to ids.
pub(super) fn validate_and_resolve(config: &mut Config, base_dir: &Path) -> Checked {
    durations(config)?;
    let s = &mut config.supervisor;
    s.data_dir = resolve(base_dir, &s.data_dir, &["supervisor", "data_dir"])?;
    if let Some(socket) = &s.socket {
        s.socket = Some(resolve(base_dir, socket, &["supervisor", "socket"])?);
    }
    if s.tick < MIN_TICK {
        let message = format!(
            "must be at least {}, got {}",
            humantime::format_duration(MIN_TICK),
            humantime::format_duration(s.tick)
        );
        return Err(Problem::at(&["supervisor", "tick"], message));
    }
    at_least(
        s.max_in_progress.into(),
        1,
        &["supervisor", "max_in_progress"],
    )?;
    at_least(s.log_max_bytes, 1024, &["supervisor", "log_max_bytes"])?;

    positive(config.leases.claim_ttl, &["leases", "claim_ttl"])?;
    // Leases are looked after on the tick: one shorter than two ticks could lapse unseen.
    let tick = config.supervisor.tick;
    if config.leases.claim_ttl < tick.saturating_mul(2) {
        let message = format!(
            "must be at least twice [supervisor] tick ({}), got {}",
            humantime::format_duration(tick.saturating_mul(2)),
            humantime::format_duration(config.leases.claim_ttl)
        );
        return Err(Problem::at(&["leases", "claim_ttl"], message));
    }
    socket_path(config)?;

    let r = &config.retries;
    if r.backoff_max < r.backoff {
        let message = format!(
            "must be at least backoff ({}), got {}",
            humantime::format_duration(r.backoff),
            humantime::format_duration(r.backoff_max)
        );
        return Err(Problem::at(&["retries", "backoff_max"], message));
    }

    let c = &config.control;
    positive(c.idle_timeout, &["control", "idle_timeout"])?;
    at_least(c.max_connections.into(), 1, &["control", "max_connections"])?;
    at_least(c.max_request_bytes, 1024, &["control", "max_request_bytes"])?;

    for (name, assignee) in &mut config.assignees {
        assignee_config(name, assignee, base_dir)?;
    }
    for (index, hook) in config.hooks.iter().enumerate() {
        hook_config(&index.to_string(), hook)?;
    }
    Ok(())
}

/// Every duration within [`MAX_DURATION`], as a file's are at load: a config built in code
/// gets the same bound, so `Duration::MAX` (meant as "never") cannot wrap to "already past" in
/// the millisecond arithmetic of leases, graces and backoffs.
fn durations(config: &Config) -> Checked {
    let check = |d: Duration, path: &[&str]| -> Checked {
        if d > MAX_DURATION {
            return Err(Problem::at(
                path,
                format!(
                    "too long (max 100 years): {}",
                    humantime::format_duration(d)
                ),
            ));
        }
        Ok(())
    };
    check(config.supervisor.tick, &["supervisor", "tick"])?;
    check(config.reaper.grace, &["reaper", "grace"])?;
    check(config.reaper.kill_timeout, &["reaper", "kill_timeout"])?;
    check(config.leases.claim_ttl, &["leases", "claim_ttl"])?;
    check(config.leases.stale_after, &["leases", "stale_after"])?;
    check(config.retries.backoff, &["retries", "backoff"])?;
    check(config.retries.backoff_max, &["retries", "backoff_max"])?;
    check(config.retention.finished, &["retention", "finished"])?;
    check(config.control.idle_timeout, &["control", "idle_timeout"])?;
    for (name, a) in &config.assignees {
        if let Some(d) = a.max_runtime {
            check(d, &["assignees", name, "max_runtime"])?;
        }
        check(a.retry_cooldown, &["assignees", name, "retry_cooldown"])?;
    }
    for (index, hook) in config.hooks.iter().enumerate() {
        check(hook.timeout, &["hooks", &index.to_string(), "timeout"])?;
    }
    Ok(())
}

fn assignee_config(name: &str, a: &mut AssigneeConfig, base_dir: &Path) -> Checked {
    let key = |k: &'static str| ["assignees", name, k];
    if !is_bare_key(name) {
        return Err(Problem::at(
            &["assignees", name],
            "invalid assignee name; use letters, digits, `_` and `-` only",
        ));
    }
    argv(&a.command, &key("command"))?;
    at_least(a.max_in_progress.into(), 1, &key("max_in_progress"))?;
    // "0s" is how a user writes "no limit" explicitly; store it as the absence it means.
    if a.max_runtime == Some(Duration::ZERO) {
        a.max_runtime = None;
    }
    for (var, value) in &a.env {
        let path = ["assignees", name, "env", var.as_str()];
        if !is_env_name(var) {
            return Err(Problem::at(
                &path,
                "invalid variable name; use letters, digits and `_`, not starting with a digit",
            ));
        }
        if RESERVED_ENV.contains(&var.as_str()) {
            return Err(Problem::at(&path, "is set by the supervisor for each run"));
        }
        if value.contains('\0') {
            return Err(Problem::at(&path, "must not contain a NUL byte"));
        }
    }
    if let Some(cwd) = &a.cwd {
        // Its existence is checked when a supervisor starts (see `check_working_dirs`), not
        // here: other commands load this config too, as users who may not reach it.
        a.cwd = Some(resolve(base_dir, cwd, &key("cwd"))?);
    }
    exit_codes(&a.retry_exit_codes, &key("retry_exit_codes"))?;
    exit_codes(&a.fail_exit_codes, &key("fail_exit_codes"))?;
    if let Some(code) = a
        .retry_exit_codes
        .iter()
        .find(|c| a.fail_exit_codes.contains(c))
    {
        let message = format!("exit code {code} is also in retry_exit_codes");
        return Err(Problem::at(&key("fail_exit_codes"), message));
    }
    for limit in a.rlimits.keys() {
        if rlimit_resource(limit).is_none() {
            let message = format!(
                "unknown limit `{limit}` (expected one of {})",
                RLIMIT_NAMES.join(", ")
            );
            return Err(Problem::at(&["assignees", name, "rlimits", limit], message));
        }
    }
    resolve_ids(a, name)
}

/// Looks `user` and `group` up now, so a typo fails at load rather than at the first spawn.
fn resolve_ids(a: &mut AssigneeConfig, name: &str) -> Checked {
    use nix::unistd::{Group, User};
    // Derived from the names when they are given; ids set directly in code (no name) are kept.
    if a.user.is_some() {
        a.uid = None;
        a.gid = None;
    }
    if a.group.is_some() {
        a.gid = None;
    }
    if let Some(user) = &a.user {
        let path = ["assignees", name, "user"];
        match User::from_name(user) {
            Ok(Some(u)) => {
                a.uid = Some(u.uid.as_raw());
                // Without `group`, the worker runs with the user's primary group, as login would.
                a.gid = Some(u.gid.as_raw());
            }
            Ok(None) => match user.parse::<u32>() {
                Ok(uid) => {
                    a.uid = Some(uid);
                    // A uid gets its user's primary group too, as a name does; a uid with no
                    // user has none to give, and root's group must not be kept by default.
                    match User::from_uid(nix::unistd::Uid::from_raw(uid)) {
                        Ok(Some(u)) => a.gid = Some(u.gid.as_raw()),
                        Ok(None) if a.group.is_none() => {
                            let message = format!(
                                "uid {uid} has no user entry, so no primary group; set `group` too"
                            );
                            return Err(Problem::at(&path, message));
                        }
                        Ok(None) => {}
                        Err(e) => {
                            return Err(Problem::at(
                                &path,
                                format!("cannot look up uid {uid}: {e}"),
                            ));
                        }
                    }
                }
                Err(_) => return Err(Problem::at(&path, format!("no such user `{user}`"))),
            },
            Err(e) => {
                return Err(Problem::at(&path, format!("cannot look up `{user}`: {e}")));
            }
        }
    }
    if let Some(group) = &a.group {
        let path = ["assignees", name, "group"];
        match Group::from_name(group) {
            Ok(Some(g)) => a.gid = Some(g.gid.as_raw()),
            Ok(None) => match group.parse::<u32>() {
                Ok(gid) => a.gid = Some(gid),
                Err(_) => return Err(Problem::at(&path, format!("no such group `{group}`"))),
            },
            Err(e) => {
                return Err(Problem::at(&path, format!("cannot look up `{group}`: {e}")));
            }
        }
    }
    // A uid set in code without a gid gets its user's primary group, as a name does: never
    // the supervisor's own (root's) group by default.
    if let (Some(uid), None) = (a.uid, a.gid) {
        let path = ["assignees", name, "uid"];
        match User::from_uid(nix::unistd::Uid::from_raw(uid)) {
            Ok(Some(u)) => a.gid = Some(u.gid.as_raw()),
            Ok(None) => {
                let message =
                    format!("uid {uid} has no user entry, so no primary group; set gid too");
                return Err(Problem::at(&path, message));
            }
            Err(e) => return Err(Problem::at(&path, format!("cannot look up uid {uid}: {e}"))),
        }
    }
    Ok(())
}

fn hook_config(index: &str, h: &HookConfig) -> Checked {
    let on = ["hooks", index, "on"];
    if h.on.is_empty() {
        return Err(Problem::at(&on, "must name at least one event kind"));
    }
    if h.on.iter().any(|kind| kind.trim().is_empty()) {
        return Err(Problem::at(&on, "event kinds must not be empty"));
    }
    let known = |k: &str| {
        k == "*"
            || crate::board::EVENT_KINDS.contains(&k)
            || crate::actors::hooks::OUTCOME_ALIASES.contains(&k)
    };
    if let Some(kind) = h.on.iter().find(|k| !known(k)) {
        let message = format!(
            "unknown event kind `{kind}` (expected `*`, a run outcome ({}) or one of {})",
            crate::actors::hooks::OUTCOME_ALIASES.join(", "),
            crate::board::EVENT_KINDS.join(", ")
        );
        return Err(Problem::at(&on, message));
    }
    argv(&h.command, &["hooks", index, "command"])?;
    positive(h.timeout, &["hooks", index, "timeout"])
}

/// An argv that `execvp` can take: a non-empty program name, no NUL bytes.
fn argv(command: &[String], path: &[&str]) -> Checked {
    match command.first() {
        None => Err(Problem::at(path, "must not be empty")),
        Some(program) if program.is_empty() => Err(Problem::at(
            path,
            "the program (first element) must not be empty",
        )),
        Some(_) if command.iter().any(|arg| arg.contains('\0')) => {
            Err(Problem::at(path, "arguments must not contain a NUL byte"))
        }
        Some(_) => Ok(()),
    }
}

/// Exit codes a process can actually report (1–255); 0 is governed by `on_exit_zero`.
fn exit_codes(codes: &[i32], path: &[&str]) -> Checked {
    match codes.iter().find(|&&c| !(1..=255).contains(&c)) {
        Some(0) => Err(Problem::at(
            path,
            "exit code 0 is not allowed here (a clean exit is governed by on_exit_zero)",
        )),
        Some(code) => Err(Problem::at(
            path,
            format!("exit code {code} is out of range; expected 1 to 255"),
        )),
        None => Ok(()),
    }
}

/// A portable environment variable name: letters, digits and `_`, not starting with a digit.
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The control socket must fit in `sun_path`: found now, naming the key, not when serving.
fn socket_path(config: &Config) -> Checked {
    use std::os::unix::ffi::OsStrExt;
    let socket = config.socket_path();
    let len = socket.as_os_str().as_bytes().len();
    if len <= MAX_SOCKET_PATH {
        return Ok(());
    }
    let (key, what): (&[&str], _) = match config.supervisor.socket {
        Some(_) => (&["supervisor", "socket"], "this path"),
        None => (&["supervisor", "data_dir"], "the default socket in it"),
    };
    let message = format!(
        "{what} ({}) is {len} bytes long; a Unix socket path can have at most {MAX_SOCKET_PATH} (set [supervisor] socket to a shorter one)",
        socket.display()
    );
    Err(Problem::at(key, message))
}

fn positive(value: Duration, path: &[&str]) -> Checked {
    if value.is_zero() {
        return Err(Problem::at(path, "must be greater than 0s"));
    }
    Ok(())
}

fn at_least(value: u64, min: u64, path: &[&str]) -> Checked {
    if value < min {
        return Err(Problem::at(
            path,
            format!("must be at least {min}, got {value}"),
        ));
    }
    Ok(())
}

/// `path` made absolute against `base_dir` (already absolute); an empty path is refused rather
/// than silently meaning the config directory itself.
fn resolve(base_dir: &Path, path: &Path, key: &[&str]) -> Result<PathBuf, Problem> {
    if path.as_os_str().is_empty() {
        return Err(Problem::at(key, "must not be empty"));
    }
    // Collecting the components drops the `.` of "./x", so paths print cleanly.
    Ok(base_dir.join(path).components().collect())
}
