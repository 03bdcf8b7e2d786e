//! A full disk, as SQLite reports it (SQLITE_FULL), simulated with `PRAGMA max_page_count` on
//! the writer's connection (no root, no small filesystem needed; `crates/harness/tests/
//! storage_full.rs` does it for real on a tmpfs): writes fail as `StoreError::Full`, a failed
//! batch leaves nothing behind, reads keep working, the store says why it is degraded, and
//! writes, queue deliveries and acks resume by themselves once there is space.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::FutureExt;
use harness_store::{
    kv_get_in, kv_set_in, Durability, QueueConfig, QueueHandler, QueueMessage, Queues, Store,
    StoreError,
};
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(20);

fn open() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Full).unwrap();
    (dir, store)
}

/// No new page may be added to the database from now on (SQLite answers SQLITE_FULL).
async fn fill(store: &Store) {
    store
        .write(|c| {
            let pages: i64 = c.query_row("PRAGMA page_count", [], |r| r.get(0))?;
            let max: i64 = c.query_row(&format!("PRAGMA max_page_count = {pages}"), [], |r| {
                r.get(0)
            })?;
            assert_eq!(max, pages);
            Ok(())
        })
        .await
        .unwrap();
}

/// Space is back.
async fn free(store: &Store) {
    store
        .write(|c| {
            c.query_row("PRAGMA max_page_count = 1000000000", [], |r| {
                r.get::<_, i64>(0)
            })?;
            Ok(())
        })
        .await
        .unwrap();
}

/// Queues on `store` with the queue "q" defined: short backoff so retries come quickly, a
/// visibility timeout long enough that only the disk can fail a delivery.
fn queue_q(store: &Store, concurrency: usize, max_retries: u32) -> Queues {
    let queues = Queues::new(store.clone());
    queues.define(
        "q",
        QueueConfig {
            concurrency,
            max_retries,
            backoff_ms: 5,
            visibility_timeout_ms: 60_000,
        },
    );
    queues
}

fn big() -> Value {
    json!("x".repeat(200_000))
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < end, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn handler<F, Fut>(f: F) -> QueueHandler
where
    F: Fn(QueueMessage) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    Arc::new(move |m| f(m).boxed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_writes_as_full_keeps_reads_and_recovers_by_itself() {
    let (_dir, store) = open();
    store.kv_set("s", "kept", &json!("before")).await.unwrap();
    assert_eq!(store.storage_full(), None);
    fill(&store).await;

    // One batch: a small write beside one that cannot fit. The failing one answers Full;
    // whatever else the batch held either answers Ok and is there, or fails and is not.
    let a = {
        let s = store.clone();
        tokio::spawn(async move {
            s.write_replayable(|c| kv_set_in(c, "s", "big", &big()))
                .await
                .map(|_| ())
        })
    };
    let b = {
        let s = store.clone();
        tokio::spawn(async move {
            s.write_replayable(|c| kv_set_in(c, "s", "small", &json!(1)))
                .await
                .map(|_| ())
        })
    };
    let a = a.await.unwrap();
    let b = b.await.unwrap();
    let full_error = |r: &Result<(), StoreError>| match r {
        Err(e @ StoreError::Full(_)) => {
            assert!(e.is_full());
            assert!(
                e.to_string().starts_with("harness/storage_full: "),
                "the kind leads the text: {e}"
            );
        }
        other => panic!("a write that cannot fit must fail as Full, got {other:?}"),
    };
    full_error(&a);
    let read = |key: &'static str| store.read(move |c| kv_get_in(c, "s", key)).unwrap();
    assert_eq!(read("big"), None, "a failed write leaves nothing");
    assert_eq!(read("small").is_some(), b.is_ok(), "small: {b:?}");
    if b.is_err() {
        full_error(&b);
    }

    // Alone: the store says why it is degraded until a commit succeeds, and reads work.
    full_error(&store.kv_set("s", "big", &big()).await.map(|_| ()));
    let reason = store.storage_full().expect("the store says it is full");
    assert!(reason.contains("full"), "{reason}");
    assert_eq!(read("kept"), Some(json!("before")));
    // Still full: failing again does not wedge the writer.
    for _ in 0..3 {
        full_error(&store.kv_set("s", "big", &big()).await.map(|_| ()));
        assert!(store.storage_full().is_some());
    }

    free(&store).await;
    // The pragma wrote no page: still degraded until a commit writes again.
    assert!(store.storage_full().is_some());
    store.kv_set("s", "big", &big()).await.unwrap();
    assert_eq!(store.storage_full(), None, "a successful commit clears it");
    assert_eq!(read("big"), Some(big()));
    store.barrier().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_failing_for_lack_of_space_spends_no_attempt_and_never_dies() {
    let (_dir, store) = open();
    let queues = queue_q(&store, 1, 1);
    fill(&store).await;
    let tries = Arc::new(AtomicUsize::new(0));
    {
        let (s, tries) = (store.clone(), tries.clone());
        queues.start(
            "q",
            handler(move |_m| {
                let (s, tries) = (s.clone(), tries.clone());
                async move {
                    tries.fetch_add(1, Ordering::SeqCst);
                    s.kv_set("s", "work", &big())
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }
            }),
        );
    }
    queues.enqueue("q", "g", "f", &json!({})).await.unwrap();
    // Far past max_retries: a message that failed only for lack of space stays alive.
    eventually("several failed tries", || tries.load(Ordering::SeqCst) >= 5).await;
    assert!(queues.dead_letters("q").unwrap().is_empty());
    let attempts: i64 = store
        .read(|c| Ok(c.query_row("SELECT attempts FROM queue_messages", [], |r| r.get(0))?))
        .unwrap();
    assert_eq!(attempts, 0, "no attempt was spent on a full disk");

    free(&store).await;
    eventually("the delivery succeeds once there is space", || {
        queues.depth("q") == 0
    })
    .await;
    assert!(queues.dead_letters("q").unwrap().is_empty());
    assert_eq!(
        store.read(|c| kv_get_in(c, "s", "work")).unwrap(),
        Some(big())
    );
    queues.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_failing_for_lack_of_space_is_retried_not_the_handler() {
    let (_dir, store) = open();
    let queues = queue_q(&store, 4, 3);
    // Deleting a queue row now needs new pages: while the database cannot grow, every ack
    // fails with SQLITE_FULL (a stand-in for a WAL that cannot grow).
    store
        .write(|c| {
            c.execute_batch(
                "CREATE TABLE ballast(x BLOB);
                 CREATE TRIGGER ack_grows BEFORE DELETE ON queue_messages
                 BEGIN INSERT INTO ballast VALUES (zeroblob(200000)); END;",
            )?;
            Ok(())
        })
        .await
        .unwrap();
    let runs: Arc<Mutex<Vec<i64>>> = Arc::default();
    {
        let runs = runs.clone();
        queues.start(
            "q",
            handler(move |m| {
                let runs = runs.clone();
                async move {
                    runs.lock().unwrap().push(m.id);
                    Ok(())
                }
            }),
        );
    }
    fill(&store).await;
    let first = queues
        .enqueue("q", "g", "f", &json!({"n": 1}))
        .await
        .unwrap();
    let second = queues
        .enqueue("q", "g", "f", &json!({"n": 2}))
        .await
        .unwrap();
    eventually("the first delivery ran", || {
        !runs.lock().unwrap().is_empty()
    })
    .await;
    eventually("its ack failed for lack of space", || {
        store.storage_full().is_some()
    })
    .await;
    // The ack is retried, never the handler, and the group waits for it.
    let rows_while_full: i64 = store
        .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM queue_messages", [], |r| r.get(0))?))
        .unwrap();
    assert_eq!(rows_while_full, 2, "neither row could be acked");
    assert_eq!(
        *runs.lock().unwrap(),
        vec![first],
        "the group waits for the ack"
    );

    free(&store).await;
    eventually("both delivered and acked", || queues.depth("q") == 0).await;
    assert_eq!(
        *runs.lock().unwrap(),
        vec![first, second],
        "each handler ran once, in order"
    );
    let rows: i64 = store
        .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM queue_messages", [], |r| r.get(0))?))
        .unwrap();
    assert_eq!(rows, 0);
    assert_eq!(store.storage_full(), None);
    queues.shutdown().await;
}
