//! Embedding: `Supervisor::start` works inside a tokio runtime (it runs the supervisor on a
//! thread of its own), and `supervisor::run` works on a runtime's blocking thread; a data dir
//! handed over writable by others loses their write access; a handle whose supervisor was
//! stopped from outside says so at once; refusals through the handle are short and name what
//! is wrong.

#[allow(dead_code)]
mod common;

use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::Supervisor;
use runwarden::config::AssigneeConfig;

#[test]
fn a_supervisor_embeds_in_a_tokio_program() {
    let td = TestDir::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["true"]));
    let on_blocking_thread = config.clone();
    rt.block_on(async {
        let sup = Supervisor::start(config).expect("start inside a runtime");
        let id = sup
            .add_task(runwarden::board::NewTask::titled("t").for_assignee("w"))
            .unwrap()
            .id;
        sup.wait_for(id, SETTLE).expect("runs");
        sup.shutdown();
        // `run` blocks its thread: a blocking one of the runtime's is the place for it.
        let ran = tokio::task::spawn_blocking(move || {
            runwarden::supervisor::run(on_blocking_thread, |_| {}, async {})
        })
        .await
        .expect("the blocking task");
        assert!(ran.is_ok(), "{ran:?}");
    });
}

#[test]
fn a_data_dir_others_may_write_in_loses_their_write_access() {
    use std::os::unix::fs::PermissionsExt;
    let td = TestDir::new();
    let mut config = lib_config(&td);
    // The socket elsewhere: the data dir's mode is then nobody else's business but this.
    let sockets = tempfile::tempdir().unwrap();
    config.supervisor.socket = Some(sockets.path().join("s.sock"));
    std::fs::create_dir_all(td.data_dir()).unwrap();
    std::fs::set_permissions(td.data_dir(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let sup = Supervisor::start(config).expect("start");
    let mode = std::fs::metadata(td.data_dir())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o755, "others could swap logs/ or work/ for a link");
    sup.shutdown();
}

#[test]
fn waiting_on_a_supervisor_stopped_over_its_socket_ends_at_once() {
    let td = TestDir::new();
    let config = lib_config(&td);
    let socket = config.socket_path();
    let sup = Supervisor::start(config).expect("start");
    // No assignee: it stays ready, never settles.
    let id = sup
        .add_task(runwarden::board::NewTask::titled("never settles"))
        .unwrap()
        .id;
    let mut client = runwarden::control::client::Client::connect(&socket).expect("connect");
    client.hello().expect("hello");
    client.shutdown().expect("shutdown over the socket");
    // The handle's own calls say it, not a wait of the whole timeout.
    let waited = sup.wait_for(id, SETTLE);
    assert!(
        matches!(&waited, Err(runwarden::SupervisorError::Store(e)) if e.code == "unavailable"),
        "{waited:?}"
    );
    sup.shutdown();
}

/// Bad input through the handle gets a short, clear error, as through the socket: an
/// assignee name of 100 KB is refused for its length, not quoted back; a data dir whose lock
/// file cannot be made is named with its config key.
#[test]
fn refusals_through_the_library_are_short_and_name_what_is_wrong() {
    let td = TestDir::new();
    let sup = Supervisor::start(lib_config(&td)).expect("start");
    let err = sup
        .add_task(runwarden::board::NewTask::titled("t").for_assignee("a".repeat(100_000)))
        .expect_err("a 100 KB assignee name")
        .to_string();
    assert!(err.len() < 200 && err.contains("assignee"), "{err}");
    sup.shutdown();

    // The lock file's place taken by a directory: it cannot be opened.
    let other = TestDir::new();
    std::fs::create_dir_all(other.lock_path()).expect("a directory in the lock's place");
    let err = match Supervisor::start(lib_config(&other)) {
        Ok(sup) => {
            sup.shutdown();
            panic!("started without its lock file");
        }
        Err(e) => e.to_string(),
    };
    assert!(err.starts_with("[supervisor] data_dir: "), "{err}");
}
