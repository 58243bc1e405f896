//! The supervisor lock file: one holder at a time, the holder's pid in the refusal, the file
//! removed on drop, and a lock taken on a file removed under the contender never counts.

use std::fs;

use runwarden::lock::{LockError, LockFile};

#[test]
fn acquire_refuse_drop_reacquire() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("supervisor.lock");

    let first = LockFile::acquire(&path).unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap().trim(),
        std::process::id().to_string()
    );

    // flock is per open file description: a second acquire in this very process is refused.
    match LockFile::acquire(&path) {
        Err(LockError::Held { path: held, pid }) => {
            assert_eq!(held, path);
            assert_eq!(pid, std::process::id().to_string());
            let message = LockError::Held { path: held, pid }.to_string();
            assert!(
                message.contains(&format!("pid {}", std::process::id())),
                "{message}"
            );
        }
        other => panic!("second acquire was not refused: {other:?}"),
    }

    drop(first);
    assert!(!path.exists(), "the lock file outlived its holder");

    let second = LockFile::acquire(&path).unwrap();
    assert!(path.exists());
    drop(second);
    assert!(!path.exists());
}

#[test]
fn unknown_holder_pid_when_the_file_is_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("supervisor.lock");
    // A holder that locked but has not written its pid yet.
    let holder = fs::File::create(&path).unwrap();
    rustix::fs::flock(&holder, rustix::fs::FlockOperation::LockExclusive).unwrap();
    match LockFile::acquire(&path) {
        Err(LockError::Held { pid, .. }) => assert_eq!(pid, "unknown"),
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn a_lock_whose_file_was_replaced_is_not_held_twice() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("supervisor.lock");
    // A stale file that was unlinked while someone still held it locked, then replaced.
    let stale = fs::File::create(&path).unwrap();
    rustix::fs::flock(&stale, rustix::fs::FlockOperation::LockExclusive).unwrap();
    fs::remove_file(&path).unwrap();

    // The path is free: acquire locks the new file, not the stale inode.
    let lock = LockFile::acquire(&path).unwrap();
    // And nobody else can take it while it is held.
    assert!(matches!(
        LockFile::acquire(&path),
        Err(LockError::Held { .. })
    ));
    drop(lock);
    drop(stale);
}

#[test]
fn racing_acquires_never_hold_the_lock_twice() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Barrier};

    let dir = tempfile::tempdir().unwrap();
    let path = Arc::new(dir.path().join("supervisor.lock"));
    let holders = Arc::new(AtomicUsize::new(0));
    let threads = 8;
    let barrier = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (path, holders, barrier) = (path.clone(), holders.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                for _ in 0..500 {
                    if let Ok(lock) = LockFile::acquire(&path) {
                        let now = holders.fetch_add(1, Ordering::SeqCst) + 1;
                        assert_eq!(now, 1, "two holders of the lock at once");
                        // Hold it a moment, so an overlapping holder would be seen.
                        for _ in 0..20 {
                            std::thread::yield_now();
                        }
                        holders.fetch_sub(1, Ordering::SeqCst);
                        drop(lock);
                    }
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
}
