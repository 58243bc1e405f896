//! A /proc scan that cannot be complete — here the process is out of file descriptors — is an
//! error, never "nothing found". On "nothing found" the supervisor clears a run's evidence and
//! frees its task (the tree is gone), so a scan that skipped what it could not read would leave
//! a live descendant running unsupervised. Nothing is signalled on an incomplete scan either.
//!
//! One test in this file: it lowers the process's own file-descriptor limit.

#[allow(dead_code)]
mod common;

use common::descriptors::use_up_descriptors;

use std::process::{Command, Stdio};

use common::proc_guard::{ChildGuard, wait_until};
use common::runtime::SETTLE;
use runwarden::process::descendants::{end_token_carriers, find_by_token};
use runwarden::process::{Liveness, liveness};

#[test]
fn a_scan_out_of_file_descriptors_is_an_error_not_an_empty_answer() {
    let token = format!("{:032x}", rand::random::<u128>());
    let carrier = ChildGuard::spawn(
        Command::new("sleep")
            .arg("300")
            .env("RUNWARDEN_RUN_TOKEN", &token)
            .stdin(Stdio::null()),
    )
    .expect("start a carrier");
    let (pid, fp) = {
        let mut found = Vec::new();
        assert!(
            wait_until(SETTLE, || {
                found = find_by_token(&token).expect("a complete scan");
                found.len() == 1
            }),
            "the carrier is found while descriptors are free: {found:?}"
        );
        found.remove(0)
    };
    assert_eq!(pid, carrier.pid());

    // A low limit, so using it up is quick; restored before anything is asserted.
    let (soft, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .expect("getrlimit");
    nix::sys::resource::setrlimit(
        nix::sys::resource::Resource::RLIMIT_NOFILE,
        soft.min(256),
        hard,
    )
    .expect("lower the descriptor limit");
    let mut held = use_up_descriptors();
    // None free: /proc itself cannot be listed.
    let none_free = find_by_token(&token);
    // One free: /proc is listed, but no process's own files can be opened.
    drop(held.pop());
    let one_free = find_by_token(&token);
    let ended = end_token_carriers(&token, std::time::Duration::from_millis(200));
    drop(held);
    nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, soft, hard)
        .expect("restore the descriptor limit");

    assert!(
        none_free.is_err(),
        "an unlistable /proc is not an empty answer: {none_free:?}"
    );
    assert!(
        one_free.is_err(),
        "a process whose files cannot be read is not skipped: {one_free:?}"
    );
    assert!(
        ended.is_err(),
        "ending a tree whose scan is incomplete is not \"ended\": {ended:?}"
    );
    assert_eq!(
        liveness(pid, &fp),
        Liveness::Alive,
        "nothing was signalled on an incomplete scan"
    );
    // With descriptors again, the same scan finds it.
    assert_eq!(
        find_by_token(&token).expect("a complete scan").len(),
        1,
        "found again"
    );
}
