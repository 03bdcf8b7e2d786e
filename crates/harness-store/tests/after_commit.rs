//! `after_commit`: work a write leaves runs once its batch committed, before the write is
//! answered, exactly once per committed write, and never for a write that was rolled back.
//! `on_rollback`: the undo a write leaves runs when its changes roll back, newest first, and
//! never for a committed write.

mod common;

use std::sync::{Arc, Mutex};

use common::one_batch;
use harness_store::{
    after_commit, kv_set_in, on_rollback, Connection, Durability, Store, StoreError,
};
use serde_json::json;

type Log = Arc<Mutex<Vec<String>>>;

fn note(log: &Log, what: &str) -> bool {
    let (log, what) = (log.clone(), what.to_string());
    after_commit(move || log.lock().unwrap().push(what))
}

fn noted(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// A write of `key` = `value` that leaves `leave(log, key)` behind, then fails when `fails`.
fn write_leaving(
    log: &Log,
    key: &'static str,
    value: u64,
    fails: bool,
    leave: fn(&Log, &'static str),
) -> impl FnMut(&Connection) -> Result<(), StoreError> + Send + 'static {
    let log = log.clone();
    move |c| {
        kv_set_in(c, "s", key, &json!(value))?;
        leave(&log, key);
        match fails {
            true => Err(StoreError::Invalid(format!("{key} fails"))),
            false => Ok(()),
        }
    }
}

/// A write of `key` = `value` that notes `key` after its commit, and then fails when `fails`.
fn set_and_note(
    log: &Log,
    key: &'static str,
    value: u64,
    fails: bool,
) -> impl FnMut(&Connection) -> Result<(), StoreError> + Send + 'static {
    write_leaving(log, key, value, fails, |log, key| {
        note(log, key);
    })
}

#[tokio::test]
async fn work_runs_after_the_commit_and_before_the_answer() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Normal).unwrap();
    let log = Log::default();
    let (l, s) = (log.clone(), store.clone());
    let seen_inside = store
        .write(move |c| {
            kv_set_in(c, "s", "k", &json!(1))?;
            assert!(note(&l, "k"), "on the writer thread");
            // Not yet: the batch has not committed.
            Ok(noted(&l).len())
        })
        .await
        .unwrap();
    assert_eq!(seen_inside, 0);
    assert_eq!(noted(&log), ["k"], "done before the write was answered");
    drop(s);
    // Off a writer thread the work is refused (and dropped).
    assert!(!note(&log, "here"));
    assert_eq!(noted(&log), ["k"]);
}

/// In one batch: replayable a, b (fails), c, where b's failure rolls the run of a and b back
/// and a runs again; then a once-only write d that fails in its own savepoint. Each write is
/// `write(log, key, value, fails)`; answers whether each succeeded, with the log.
async fn a_batch_with_failures<W>(
    write: impl Fn(&Log, &'static str, u64, bool) -> W,
) -> (Vec<bool>, Log, Store, tempfile::TempDir)
where
    W: FnMut(&Connection) -> Result<(), StoreError> + Send + 'static,
{
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Normal).unwrap();
    let log = Log::default();
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write_replayable(write(&log, "a", 1, false))),
            Box::pin(store.write_replayable(write(&log, "b", 2, true))),
            Box::pin(store.write_replayable(write(&log, "c", 3, false))),
            Box::pin(store.write(write(&log, "d", 4, true))),
        ],
    )
    .await;
    let ok = out.iter().map(Result::is_ok).collect();
    (ok, log, store, dir)
}

#[tokio::test]
async fn rolled_back_writes_leave_nothing_and_replayed_ones_leave_one() {
    let (ok, log, _store, _dir) = a_batch_with_failures(set_and_note).await;
    assert_eq!(ok, [true, false, true, false]);
    let mut got = noted(&log);
    got.sort();
    assert_eq!(
        got,
        ["a", "c"],
        "once per committed write, none for rolled-back ones"
    );
}

/// A write that registers the undo `undo <key>`, then fails when `fails`.
fn undoable(
    log: &Log,
    key: &'static str,
    fails: bool,
) -> impl FnMut(&Connection) -> Result<(), StoreError> + Send + 'static {
    write_leaving(log, key, 1, fails, |log, key| {
        let l = log.clone();
        assert!(on_rollback(move || l.lock().unwrap().push(format!("undo {key}"))).is_ok());
    })
}

#[tokio::test]
async fn undos_run_for_rolled_back_writes_newest_first_and_never_for_committed_ones() {
    let (ok, log, store, _dir) =
        a_batch_with_failures(|log, key, _, fails| undoable(log, key, fails)).await;
    assert_eq!(ok, [true, false, true, false]);
    assert_eq!(noted(&log), ["undo b", "undo a", "undo d"]);
    // Committed: the undos a and c left were dropped, not run later.
    store
        .write(|c| kv_set_in(c, "s", "e", &json!(1)))
        .await
        .unwrap();
    assert_eq!(noted(&log).len(), 3);
    // Off a writer thread nothing could run the undo: it is handed back.
    let l = log.clone();
    let back = on_rollback(move || l.lock().unwrap().push("handed back".into()));
    back.expect_err("off the writer thread")();
    assert_eq!(noted(&log).last().unwrap(), "handed back");
}
