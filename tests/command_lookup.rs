//! A command given as a bare name is looked up in the PATH the worker gets (the assignee's
//! `env` PATH wins), as execvp would: the first executable regular file, skipping entries that
//! are not; the worker sees the configured name as its argv[0]. A name found nowhere (or only
//! as a non-executable file) fails the spawn, naming it; so does a script without a `#!` line
//! (it is not handed to /bin/sh), naming where it was found.

#[allow(dead_code)]
mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;

use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::board::{NewTask, RunOutcome, TaskStatus};
use runwarden::config::AssigneeConfig;

const TOOL: &str = "runwarden-test-lookup-tool";

#[test]
fn a_bare_name_runs_the_first_executable_on_the_workers_path() {
    let td = TestDir::new();
    let (shadow, bin) = (td.path().join("shadow"), td.path().join("bin"));
    for dir in [&shadow, &bin] {
        fs::create_dir_all(dir).expect("bin dir");
    }
    // First on PATH: a file that is not executable, then a directory of the same name in
    // another entry; both are passed over. Then the real tool: a shell, by a name of its own.
    fs::write(shadow.join(TOOL), "not a program\n").expect("decoy");
    fs::set_permissions(shadow.join(TOOL), fs::Permissions::from_mode(0o644)).expect("chmod");
    let decoy_dir = td.path().join("decoy");
    fs::create_dir_all(decoy_dir.join(TOOL)).expect("decoy dir");
    std::os::unix::fs::symlink("/bin/sh", bin.join(TOOL)).expect("symlink");
    let out = td.path().join("argv0");

    let mut config = lib_config(&td);
    let path = format!(
        "{}:{}:{}",
        shadow.display(),
        decoy_dir.display(),
        bin.display()
    );
    // `sh -c SCRIPT` with no further argument sets $0 to its own argv[0].
    let mut found = AssigneeConfig::new([TOOL, "-c", "printf '%s' \"$0\" > \"$OUT\""]);
    found.env.insert("PATH".into(), path);
    found.env.insert("OUT".into(), out.display().to_string());
    config.assignees.insert("found".into(), found);
    let mut hidden = AssigneeConfig::new([TOOL, "-c", "exit 0"]);
    hidden
        .env
        .insert("PATH".into(), shadow.display().to_string());
    hidden.max_retries = Some(0);
    config.assignees.insert("hidden".into(), hidden);
    let script = td.path().join("scripts");
    fs::create_dir_all(&script).expect("scripts dir");
    fs::write(script.join(TOOL), "exit 0\n").expect("script");
    fs::set_permissions(script.join(TOOL), fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut bare_script = AssigneeConfig::new([TOOL]);
    bare_script
        .env
        .insert("PATH".into(), script.display().to_string());
    bare_script.max_retries = Some(0);
    config.assignees.insert("no_shebang".into(), bare_script);
    let sup = Supervisor::start(config).expect("start the supervisor");

    let id = sup
        .add_task(NewTask::titled("found").for_assignee("found"))
        .expect("add task")
        .id;
    let task = sup.wait_for(id, SETTLE).expect("the task finishes");
    assert_eq!(task.status, TaskStatus::Done, "{:?}", sup.task(id));
    assert_eq!(
        fs::read_to_string(&out).expect("the worker wrote its argv[0]"),
        TOOL,
        "the worker sees the configured name, not the path it was found at"
    );

    let error = spawn_error(&sup, "hidden");
    assert!(error.contains(TOOL), "names the program: {error:?}");
    assert!(
        error.contains("Permission denied"),
        "the only candidate is not executable: {error:?}"
    );

    let error = spawn_error(&sup, "no_shebang");
    let at = script.join(TOOL).display().to_string();
    assert!(error.contains(&at), "names where it was found: {error:?}");
    assert!(error.contains("Exec format error"), "{error:?}");
    sup.shutdown();
}

/// Runs one task of `assignee` (no retries), which must fail to spawn; returns the run's error.
fn spawn_error(sup: &runwarden::SupervisorHandle, assignee: &str) -> String {
    let id = sup
        .add_task(NewTask::titled(assignee).for_assignee(assignee))
        .expect("add task")
        .id;
    let task = sup.wait_for(id, SETTLE).expect("the task finishes");
    let detail = sup.task(id).expect("task detail");
    assert_eq!(task.status, TaskStatus::Blocked, "{detail:?}");
    let run = &detail.runs[0];
    assert_eq!(run.outcome, Some(RunOutcome::SpawnFailed), "{run:?}");
    run.error.clone().unwrap_or_default()
}
