//! Writer batching, savepoint isolation, visibility and the durability barrier.

mod common;

use common::{kv_keys, one_batch};
use std::sync::Arc;

use harness_store::{kv_get_in, kv_set_in, Durability, Store, StoreError};
use serde_json::json;

/// A store at `durability` in a directory that does not exist yet, below a fresh temp dir.
fn open(durability: Durability) -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("nested/dir/store.db"), durability).unwrap();
    (dir, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolved_write_is_visible_to_read() {
    let (_dir, store) = open(Durability::Normal);
    for i in 0..200 {
        store
            .write(move |c| kv_set_in(c, "s", &format!("k{i}"), &json!(i)))
            .await
            .unwrap();
        let seen = store.read(|c| kv_get_in(c, "s", &format!("k{i}"))).unwrap();
        assert_eq!(seen, Some(json!(i)));
    }
    assert!(store.path().ends_with("store.db"));
    assert_eq!(store.durability(), Durability::Normal);
}

#[tokio::test]
async fn failing_op_rolls_back_only_itself() {
    let (_dir, store) = open(Durability::Normal);
    // All four share the writer's next batch (and only that one is committed).
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write(|c| kv_set_in(c, "s", "a", &json!(1)).map(drop))),
            Box::pin(store.write(|c| {
                kv_set_in(c, "s", "b", &json!(2))?;
                Err::<(), _>(StoreError::Invalid("b fails after writing".into()))
            })),
            Box::pin(store.write(|c| -> Result<(), StoreError> {
                kv_set_in(c, "s", "p", &json!(3))?;
                panic!("p panics after writing")
            })),
            Box::pin(store.write(|c| kv_set_in(c, "s", "d", &json!(4)).map(drop))),
        ],
    )
    .await;
    assert!(out[0].is_ok());
    assert!(matches!(&out[1], Err(StoreError::Invalid(m)) if m.contains("b fails")));
    assert!(matches!(&out[2], Err(StoreError::Invalid(m)) if m.contains("panicked")));
    assert!(out[3].is_ok());
    let listed = kv_keys(&store, "s");
    assert_eq!(listed, vec!["a", "d"]);
    // The writer survived the panic.
    store.kv_set("s", "after", &json!(true)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writes_are_group_committed() {
    let (_dir, store) = open(Durability::Normal);
    let base = store.stats();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move {
            s.kv_set("c", &format!("{i:03}"), &json!(i)).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.writes - base.writes, 100);
    let commits = stats.commits - base.commits;
    assert!(
        commits < 100,
        "expected grouping, got {commits} commits for 100 writes"
    );
    assert_eq!(store.kv_list("c").unwrap().len(), 100);
}

/// One caller writing one write at a time is the whole batch each time: the writer commits
/// it at once, never waiting for a write that cannot come while its caller waits on it.
#[tokio::test]
async fn a_lone_writer_is_never_kept_waiting_for_company() {
    let (_dir, store) = open(Durability::Normal);
    for i in 0..200 {
        store.kv_set("s", "k", &json!(i)).await.unwrap();
    }
    let stats = store.stats();
    assert_eq!(stats.linger_waits, 0, "{stats:?}");
    assert!(stats.commits >= 200, "{stats:?}");
}

#[tokio::test]
async fn barrier_fsyncs_in_full_mode_only_when_needed() {
    let (_dir, store) = open(Durability::Full);
    store.kv_set("s", "k", &json!(1)).await.unwrap();
    store.barrier().await.unwrap();
    assert_eq!(store.stats().fsyncs, 1);
    // The syncer's time is the fsync's: counted when one ran, not when none was needed.
    let busy = store.stats().syncer_busy_ns;
    assert!(busy > 0, "an fsync took no time");
    store.barrier().await.unwrap();
    assert_eq!(store.stats().fsyncs, 1, "nothing new committed: no fsync");
    assert_eq!(store.stats().syncer_busy_ns, busy);
    store.kv_set("s", "k", &json!(2)).await.unwrap();
    store.barrier().await.unwrap();
    assert_eq!(store.stats().fsyncs, 2);
    assert!(store.stats().syncer_busy_ns > busy);
}

#[tokio::test]
async fn barrier_never_fsyncs_in_normal_mode() {
    let (_dir, store) = open(Durability::Normal);
    for i in 0..10 {
        store.kv_set("s", "k", &json!(i)).await.unwrap();
        store.barrier().await.unwrap();
    }
    assert_eq!(store.stats().fsyncs, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_barriers_share_fsyncs() {
    let (_dir, store) = open(Durability::Full);
    let start = Arc::new(tokio::sync::Barrier::new(100));
    let mut tasks = Vec::new();
    for i in 0..100 {
        let (s, start) = (store.clone(), start.clone());
        tasks.push(tokio::spawn(async move {
            start.wait().await;
            s.kv_set("b", &format!("{i}"), &json!(i)).await.unwrap();
            s.barrier().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let fsyncs = store.stats().fsyncs;
    assert!(
        (1..=25).contains(&fsyncs),
        "100 barriers took {fsyncs} fsyncs"
    );
}

#[tokio::test]
async fn calls_after_close_return_closed() {
    let (_dir, store) = open(Durability::Full);
    store.kv_set("s", "k", &json!(1)).await.unwrap();
    let clone = store.clone();
    store.close();
    assert!(matches!(
        clone.kv_set("s", "k", &json!(2)).await,
        Err(StoreError::Closed)
    ));
    assert!(matches!(clone.barrier().await, Err(StoreError::Closed)));
    // Reopening sees the committed data.
    let again = Store::open(store.path(), Durability::Full).unwrap();
    assert_eq!(again.kv_get("s", "k").unwrap(), Some(json!(1)));
}

#[tokio::test]
async fn read_closure_leaving_a_transaction_open_does_not_pin_a_snapshot() {
    let (_dir, store) = open(Durability::Normal);
    store.kv_set("s", "k", &json!(1)).await.unwrap();
    store
        .read(|c| {
            c.execute_batch("BEGIN")?;
            kv_get_in(c, "s", "k")
        })
        .unwrap();
    store.kv_set("s", "k", &json!(2)).await.unwrap();
    assert_eq!(store.kv_get("s", "k").unwrap(), Some(json!(2)));
}

fn put(c: &harness_store::Connection, key: &str, v: i64) -> Result<(), StoreError> {
    harness_store::kv_put_in(c, "s", key, &json!(v))
}

#[tokio::test]
async fn a_failing_replayable_op_rolls_back_only_itself_and_the_others_run_again() {
    let (_dir, store) = open(Durability::Normal);
    // `a` counts its runs in memory (what a real replayable op must not do, to observe the
    // mechanism) and in the database: the failures of `b` and `p` each roll `a` back and run
    // it again, so it ran three times and its row was written once.
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = runs.clone();
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write_replayable(move |c| {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                c.execute("INSERT INTO kv(scope, key, value, updated_at) VALUES ('runs', 'a', '1', 0) ON CONFLICT(scope, key) DO UPDATE SET value = CAST(value + 1 AS TEXT)", [])?;
                put(c, "a", 1).map(|_| "a")
            })),
            Box::pin(store.write_replayable(|c| {
                put(c, "b", 2)?;
                Err::<&str, _>(StoreError::Invalid("b fails after writing".into()))
            })),
            Box::pin(store.write_replayable(|c| -> Result<&str, StoreError> {
                put(c, "p", 3)?;
                panic!("p panics after writing")
            })),
            Box::pin(store.write_replayable(|c| put(c, "d", 4).map(|_| "d"))),
        ],
    )
    .await;
    assert_eq!(out[0].as_ref().unwrap(), &"a");
    assert!(matches!(&out[1], Err(StoreError::Invalid(m)) if m.contains("b fails")));
    assert!(matches!(&out[2], Err(StoreError::Invalid(m)) if m.contains("panicked")));
    assert_eq!(out[3].as_ref().unwrap(), &"d");
    let listed = kv_keys(&store, "s");
    assert_eq!(listed, vec!["a", "d"]);
    assert_eq!(
        store.kv_get("runs", "a").unwrap(),
        Some(json!(1)),
        "what a's earlier runs wrote was rolled back before it ran again"
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[tokio::test]
async fn replayable_ops_after_a_once_op_roll_back_to_their_own_start() {
    let (_dir, store) = open(Durability::Normal);
    let (side_tx, side_rx) = std::sync::mpsc::channel::<&str>();
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write_replayable(|c| put(c, "r1", 1))),
            // A once op may have effects outside the database: it must run exactly once, and
            // the later failure must not undo it.
            Box::pin(store.write(move |c| {
                side_tx.send("once ran").unwrap();
                put(c, "once", 2)
            })),
            Box::pin(store.write_replayable(|c| put(c, "r2", 3))),
            Box::pin(store.write_replayable(|c| {
                put(c, "bad", 4)?;
                Err(StoreError::Invalid("refused".into()))
            })),
            Box::pin(store.write_replayable(|c| put(c, "r3", 5))),
        ],
    )
    .await;
    let failed: Vec<bool> = out.iter().map(|r| r.is_err()).collect();
    assert_eq!(failed, vec![false, false, false, true, false]);
    assert_eq!(side_rx.try_iter().count(), 1, "the once op ran once");
    let listed: Vec<(String, serde_json::Value)> = store.kv_list("s").unwrap();
    assert_eq!(
        listed,
        vec![
            ("once".to_string(), json!(2)),
            ("r1".to_string(), json!(1)),
            ("r2".to_string(), json!(3)),
            ("r3".to_string(), json!(5)),
        ]
    );
}

#[tokio::test]
async fn a_replayable_op_that_ends_the_transaction_loses_the_batch() {
    let (_dir, store) = open(Durability::Normal);
    let out = one_batch(
        &store,
        vec![
            Box::pin(store.write_replayable(|c| put(c, "a", 1))),
            Box::pin(store.write_replayable(|c| {
                c.execute_batch("ROLLBACK")?;
                Ok(())
            })),
            Box::pin(store.write_replayable(|c| put(c, "c", 3))),
        ],
    )
    .await;
    assert!(matches!(&out[0], Err(StoreError::Invalid(m)) if m.contains("lost")));
    assert!(matches!(&out[1], Err(StoreError::Invalid(m)) if m.contains("lost")));
    assert!(out[2].is_ok(), "a later op starts a new transaction");
    assert_eq!(store.kv_get("s", "a").unwrap(), None);
    assert_eq!(store.kv_get("s", "c").unwrap(), Some(json!(3)));
}

/// A cached statement runs as planned, whatever value is bound: SQLite would otherwise parse
/// and plan a `MAX(…) WHERE key = ?` again for each new key (the append's next-seq lookup, on
/// the writer, once per entry), on the writer and on every reader.
#[tokio::test]
async fn cached_statements_are_not_planned_again_for_new_values() {
    use harness_store::Connection;
    use rusqlite::StatementStatus;
    const SQL: &str = "SELECT COALESCE(MAX(updated_at), 0) FROM kv WHERE scope = ?1";
    fn replans(c: &Connection) -> Result<i32, StoreError> {
        for i in 0..8 {
            let _: i64 = c
                .prepare_cached(SQL)?
                .query_row([format!("scope-{i}")], |r| r.get(0))?;
        }
        Ok(c.prepare_cached(SQL)?
            .get_status(StatementStatus::RePrepare))
    }
    let (_dir, store) = open(Durability::Normal);
    assert_eq!(store.write(replans).await.unwrap(), 0, "writer");
    assert_eq!(store.read(replans).unwrap(), 0, "reader");
    // The statement is one that would be planned again without the setting.
    let plain = Connection::open_in_memory().unwrap();
    plain
        .execute_batch(
            "CREATE TABLE kv(scope TEXT NOT NULL, key TEXT NOT NULL, value TEXT, updated_at INTEGER,
             PRIMARY KEY(scope, key)) WITHOUT ROWID",
        )
        .unwrap();
    assert!(replans(&plain).unwrap() > 0, "the control connection");
}
