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

/// A write of `key` = `value` that notes `key` after its commit, and then fails when `fails`.
fn set_and_note(
    log: &Log,
    key: &'static str,
    value: u64,
    fails: bool,
) -> impl FnMut(&Connection) -> Result<(), StoreError> + Send + 'static {
    let log = log.clone();
    move |c| {
        kv_set_in(c, "s", key, &json!(value))?;
        note(&log, key);
        match fails {
            true => Err(StoreError::Invalid(format!("{key} fails"))),
            false => Ok(()),
        }
    }
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

#[tokio::test]
async fn rolled_back_writes_leave_nothing_and_replayed_ones_leave_one() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Normal).unwrap();
    let log = Log::default();
    // In one batch: replayable a, b (fails), c, where b's failure rolls the run back and a, c
    // run again; then a once-only write d that fails in its own savepoint.
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write_replayable(set_and_note(&log, "a", 1, false))),
            Box::pin(store.write_replayable(set_and_note(&log, "b", 2, true))),
            Box::pin(store.write_replayable(set_and_note(&log, "c", 3, false))),
            Box::pin(store.write(set_and_note(&log, "d", 4, true))),
        ],
    )
    .await;
    assert!(out[0].is_ok());
    assert!(out[1].is_err());
    assert!(out[2].is_ok());
    assert!(out[3].is_err());
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
    let log = log.clone();
    move |c| {
        kv_set_in(c, "s", key, &json!(1))?;
        let l = log.clone();
        assert!(on_rollback(move || l.lock().unwrap().push(format!("undo {key}"))).is_ok());
        match fails {
            true => Err(StoreError::Invalid(format!("{key} fails"))),
            false => Ok(()),
        }
    }
}

#[tokio::test]
async fn undos_run_for_rolled_back_writes_newest_first_and_never_for_committed_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Normal).unwrap();
    let log = Log::default();
    // In one batch: replayable a, b (fails: the run of a and b rolls back, a runs again), c;
    // then a once-only write d that fails in its own savepoint.
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write_replayable(undoable(&log, "a", false))),
            Box::pin(store.write_replayable(undoable(&log, "b", true))),
            Box::pin(store.write_replayable(undoable(&log, "c", false))),
            Box::pin(store.write(undoable(&log, "d", true))),
        ],
    )
    .await;
    let ok: Vec<bool> = out.iter().map(Result::is_ok).collect();
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
