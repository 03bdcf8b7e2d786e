//! One process per database: a store holds `<database>.lock` (flock) while it is open. Another
//! open file description of that file stands in for another process (flock locks conflict
//! between descriptions, even within one process).

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;

use harness_store::{Durability, Store, StoreError};

fn flock(file: &File, mode: libc::c_int) -> bool {
    // SAFETY: flock on a descriptor the `File` owns; no pointer.
    unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) == 0 }
}

fn try_flock(file: &File) -> bool {
    flock(file, libc::LOCK_EX)
}

fn try_flock_shared(file: &File) -> bool {
    flock(file, libc::LOCK_SH)
}

#[test]
fn a_database_another_process_holds_is_refused_with_its_pid() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.db");
    let mut other = File::create(dir.path().join("h.db.lock")).unwrap();
    assert!(try_flock(&other));
    writeln!(other, "4242").unwrap();

    let err = Store::open(&db, Durability::Normal).unwrap_err();
    assert!(matches!(err, StoreError::InUse { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.starts_with("harness/store_in_use: "), "{text}");
    assert!(text.contains("process 4242"), "{text}");
    assert!(!db.exists(), "nothing was opened or created");

    drop(other);
    Store::open(&db, Durability::Normal).unwrap();
}

#[test]
fn an_open_store_holds_the_lock_until_its_last_handle_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("sub").join("h.db");
    let store = Store::open(&db, Durability::Normal).unwrap();
    // In-process opens share the lock (a restart acted out by a test reopens the store).
    let again = Store::open(&db, Durability::Normal).unwrap();
    let lock_path = dir.path().join("sub").join("h.db.lock");
    assert_eq!(
        std::fs::read_to_string(&lock_path).unwrap().trim(),
        std::process::id().to_string()
    );
    let probe = File::open(&lock_path).unwrap();
    assert!(!try_flock(&probe), "held while a store is open");
    drop(store);
    assert!(!try_flock(&probe), "held while a clone is open");
    drop(again);
    assert!(try_flock(&probe), "released with the last handle");
}

/// Workers that take turns on one database (iii standbys) hold it shared: they coexist, and an
/// exclusive opener is refused by any of them, as they are by an exclusive holder.
#[test]
fn shared_holders_coexist_and_keep_an_exclusive_opener_out() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("h.db");
    let lock_path = dir.path().join("h.db.lock");

    let other_worker = File::create(&lock_path).unwrap();
    assert!(try_flock_shared(&other_worker));
    let worker = Store::open_shared(&db, Durability::Normal).unwrap();
    drop(worker);
    // The same file under another spelling of its path.
    let err = Store::open(&dir.path().join("sub/../h.db"), Durability::Normal).unwrap_err();
    assert!(matches!(err, StoreError::InUse { .. }), "{err:?}");
    drop(other_worker);

    let embedded = File::create(&lock_path).unwrap();
    assert!(try_flock(&embedded));
    let err = Store::open_shared(&db, Durability::Normal).unwrap_err();
    assert!(matches!(err, StoreError::InUse { .. }), "{err:?}");
}
