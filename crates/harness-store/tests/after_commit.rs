//! `after_commit`: work a write leaves runs once its batch committed, before the write is
//! answered, exactly once per committed write, and never for a write that was rolled back.

mod common;

use std::sync::{Arc, Mutex};

use common::one_batch;
use harness_store::{after_commit, kv_set_in, Connection, Durability, Store, StoreError};
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
