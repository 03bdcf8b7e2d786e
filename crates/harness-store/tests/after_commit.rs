//! `after_commit`: work a write leaves runs once its batch committed, before the write is
//! answered, exactly once per committed write, and never for a write that was rolled back.

use std::pin::pin;
use std::sync::{Arc, Mutex};

use futures::poll;
use harness_store::{after_commit, kv_set_in, Durability, Store, StoreError};
use serde_json::json;

type Log = Arc<Mutex<Vec<String>>>;

fn note(log: &Log, what: &str) -> bool {
    let (log, what) = (log.clone(), what.to_string());
    after_commit(move || log.lock().unwrap().push(what))
}

fn noted(log: &Log) -> Vec<String> {
    log.lock().unwrap().clone()
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
    // Park the writer so that the writes below share one batch.
    let (entered_tx, entered_rx) = tokio::sync::oneshot::channel::<()>();
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let gate = {
        let s = store.clone();
        tokio::spawn(async move {
            s.write(move |_| {
                let _ = entered_tx.send(());
                let _ = release_rx.recv();
                Ok(())
            })
            .await
            .unwrap()
        })
    };
    entered_rx.await.unwrap();

    let (la, lb, lc, ld) = (log.clone(), log.clone(), log.clone(), log.clone());
    // Replayable a, b (fails), c: b's failure rolls the run back and a, c run again.
    let mut a = pin!(store.write_replayable(move |c| {
        kv_set_in(c, "s", "a", &json!(1))?;
        note(&la, "a");
        Ok(())
    }));
    let mut b = pin!(store.write_replayable(move |c| {
        kv_set_in(c, "s", "b", &json!(2))?;
        note(&lb, "b");
        Err::<(), _>(StoreError::Invalid("b fails".into()))
    }));
    let mut c = pin!(store.write_replayable(move |c| {
        kv_set_in(c, "s", "c", &json!(3))?;
        note(&lc, "c");
        Ok(())
    }));
    // A once-only write that fails in its own savepoint.
    let mut d = pin!(store.write(move |c| {
        kv_set_in(c, "s", "d", &json!(4))?;
        note(&ld, "d");
        Err::<(), _>(StoreError::Invalid("d fails".into()))
    }));
    assert!(poll!(a.as_mut()).is_pending());
    assert!(poll!(b.as_mut()).is_pending());
    assert!(poll!(c.as_mut()).is_pending());
    assert!(poll!(d.as_mut()).is_pending());
    release_tx.send(()).unwrap();
    gate.await.unwrap();
    assert!(a.await.is_ok());
    assert!(b.await.is_err());
    assert!(c.await.is_ok());
    assert!(d.await.is_err());
    let mut got = noted(&log);
    got.sort();
    assert_eq!(
        got,
        ["a", "c"],
        "once per committed write, none for rolled-back ones"
    );
}
