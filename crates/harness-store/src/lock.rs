//! One process per database: an exclusive lock held for as long as any [`crate::Store`] of the
//! process has the database open.
//!
//! Why: the store keeps copies of what it wrote in memory (the kv cache, the transcripts'
//! change log) and trusts them because its writer is the only one; the queue dispatches each
//! message once because it is the only dispatcher. A second process on the same file (a
//! `harness chat` started beside `harness serve` on the same data directory) would break all
//! three without a word: stale records, steps run twice. With the lock it is told, by name.
//!
//! How: `flock(LOCK_NB)` on `<database>.lock`, which also holds the holder's pid for the
//! message. The kernel drops the lock with the process, so a SIGKILLed process never leaves it
//! behind. The embedded runtime locks exclusively. iii workers that take turns on one database
//! (a standby with `--with session` shares the serving worker's data directory, and serves only
//! once that one is gone) lock it shared: they keep an embedded runtime out, not each other. Within one process, every `Store` over the same file shares one lock (opening a
//! database twice in-process is the caller's business, as it always was; tests reopen stores
//! to act out a restart).

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use crate::error::StoreError;

/// The lock, released when the last `Store` of the process holding it is dropped.
pub(crate) struct DbLock {
    file: Option<File>,
    path: PathBuf,
}

impl Drop for DbLock {
    fn drop(&mut self) {
        // The file is closed (and the lock released) before the entry goes, both under the
        // registry's lock: an opener that finds the entry dead waits for exactly this.
        let mut held = held().lock().unwrap_or_else(|e| e.into_inner());
        drop(self.file.take());
        if held.get(&self.path).is_some_and(|w| w.strong_count() == 0) {
            held.remove(&self.path);
        }
    }
}

fn held() -> &'static Mutex<HashMap<PathBuf, Weak<DbLock>>> {
    static HELD: std::sync::OnceLock<Mutex<HashMap<PathBuf, Weak<DbLock>>>> =
        std::sync::OnceLock::new();
    HELD.get_or_init(Mutex::default)
}

/// How a store holds its database's lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// The only process on the database (the embedded runtime).
    Exclusive,
    /// One of the processes that take turns on it (iii workers): refused only by an exclusive
    /// holder, and refuses only an exclusive opener.
    Shared,
}

/// Takes (or, in the process that holds it, shares) the lock of the database at `db`, whose
/// directory exists.
pub(crate) fn acquire(db: &Path, access: Access) -> Result<Arc<DbLock>, StoreError> {
    let dir = match db.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.canonicalize()?,
        _ => std::env::current_dir()?,
    };
    let mut name = db.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    let path = dir.join(name);
    let mut held = loop {
        let held = held().lock().unwrap_or_else(|e| e.into_inner());
        match held.get(&path).map(Weak::upgrade) {
            Some(Some(lock)) => return Ok(lock),
            // The last store of this process is closing it: its lock is about to be released.
            Some(None) => {
                drop(held);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            None => break held,
        }
    };
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)?;
    let mode = match access {
        Access::Exclusive => libc::LOCK_EX,
        Access::Shared => libc::LOCK_SH,
    };
    // SAFETY: flock takes a file descriptor this `File` owns and keeps open; no pointer.
    if unsafe { libc::flock(file.as_raw_fd(), mode | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(err.into());
        }
        let mut holder = String::new();
        let _ = file.read_to_string(&mut holder);
        return Err(StoreError::InUse {
            path: db.display().to_string(),
            holder: match holder.trim().parse::<u32>() {
                Ok(pid) => format!("process {pid}"),
                Err(_) => "another process".into(),
            },
        });
    }
    // Only for the message another opener prints; the lock itself is what counts.
    file.set_len(0)?;
    file.rewind()?;
    writeln!(file, "{}", std::process::id())?;
    let lock = Arc::new(DbLock {
        file: Some(file),
        path: path.clone(),
    });
    held.insert(path, Arc::downgrade(&lock));
    Ok(lock)
}
