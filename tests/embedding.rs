//! Embedding misuse gets a clear error, not a panic: `supervisor::run` blocks its thread and
//! refuses to start inside an async runtime, where `Supervisor::start` (a thread of its own)
//! works.

#[allow(dead_code)]
mod common;

use common::runtime::{SETTLE, TestDir, lib_config};
use runwarden::config::AssigneeConfig;
use runwarden::{Supervisor, SupervisorError};

#[test]
fn run_inside_an_async_runtime_is_refused_and_start_works_there() {
    let td = TestDir::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let refused =
        rt.block_on(async { runwarden::supervisor::run(lib_config(&td), |_| {}, async {}) });
    match refused {
        Err(SupervisorError::Runtime(m)) => assert!(m.contains("Supervisor::start"), "{m}"),
        other => panic!("expected a Runtime error, got {other:?}"),
    }
    let mut config = lib_config(&td);
    config
        .assignees
        .insert("w".into(), AssigneeConfig::new(["true"]));
    rt.block_on(async {
        let sup = Supervisor::start(config).expect("start inside a runtime");
        let id = sup
            .add_task(runwarden::board::NewTask::titled("t").for_assignee("w"))
            .unwrap()
            .id;
        sup.wait_for(id, SETTLE).expect("runs");
        sup.shutdown();
    });
}
