//! Embedding from async code: `Supervisor::start` works inside a tokio runtime (it runs the
//! supervisor on a thread of its own), and `supervisor::run` works on a runtime's blocking
//! thread.

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
