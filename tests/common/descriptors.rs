//! Test helper: using up this test process's file descriptors (nextest runs each test in a
//! process of its own, so nothing else in it is starved).

use std::fs::File;

/// Opens `/dev/null` until the descriptor limit refuses (EMFILE); the files hold the
/// descriptors until dropped.
pub fn use_up_descriptors() -> Vec<File> {
    let mut held = Vec::new();
    loop {
        match File::open("/dev/null") {
            Ok(f) => held.push(f),
            Err(e) if e.raw_os_error() == Some(libc::EMFILE) => return held,
            Err(e) => panic!("open /dev/null: {e}"),
        }
        assert!(
            held.len() < 1 << 20,
            "no descriptor limit reached after {} files",
            held.len()
        );
    }
}
