//! Checkpoints run beside the writer, and the WAL still starts over under constant writes.

use harness_store::{Durability, Store};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

/// `writers` tasks, each putting `each` copies of `value` under keys of its own, all at once.
fn write_at_once(store: &Store, writers: usize, each: usize, value: &Value) -> Vec<JoinHandle<()>> {
    (0..writers)
        .map(|w| {
            let (store, value) = (store.clone(), value.clone());
            tokio::spawn(async move {
                for i in 0..each {
                    store
                        .kv_put("c", &format!("{w:02}-{i:04}"), &value)
                        .await
                        .unwrap();
                }
            })
        })
        .collect()
}

/// 40 writers keep the writer busy with no pause for well over 10,000 WAL frames (about 40 MiB
/// of new pages). The WAL file never grows past a few thousand frames: the checkpointer copies
/// frames out beside the writer, and the writer's own catch-up lets the WAL start over. All the
/// data is there afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_stays_bounded_under_constant_writes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let wal = dir.path().join("c.db-wal");
    let tasks = write_at_once(&store, 40, 500, &json!({"pad": "p".repeat(2000)}));
    let mut largest = 0;
    while tasks.iter().any(|t| !t.is_finished()) {
        largest = largest.max(std::fs::metadata(&wal).map(|m| m.len()).unwrap_or(0));
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let db = std::fs::metadata(&path).unwrap().len();
    assert!(
        db > 20 << 20,
        "the checkpoints copied the pages into the database ({db} bytes)"
    );
    assert!(
        largest < 28 << 20,
        "the WAL reached {largest} bytes: it did not start over"
    );
    assert_eq!(store.kv_list("c").unwrap().len(), 20_000);
}

#[tokio::test]
async fn the_writer_counts_its_pages_and_its_time() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("c.db"), Durability::Normal).unwrap();
    let before = store.stats();
    // One ~3 KiB value a commit: a leaf page of the table (and its index, the first time) each.
    let value = json!({"pad": "p".repeat(3000)});
    for i in 0..50 {
        store.kv_put("c", &format!("k{i}"), &value).await.unwrap();
    }
    let after = store.stats();
    let commits = after.commits - before.commits;
    let pages = after.wal_frames - before.wal_frames;
    assert_eq!(commits, 50);
    assert!(
        (50..=50 * 8).contains(&pages),
        "{pages} WAL pages for {commits} commits"
    );
    assert!(after.writer_busy_ns > before.writer_busy_ns);
    assert!(after.writer_checkpoint_ns <= after.writer_busy_ns);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_s_own_checkpoints_are_timed_within_its_busy_time() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("c.db"), Durability::Normal).unwrap();
    // Well past the WAL length at which the writer checkpoints itself (5,000 pages).
    for t in write_at_once(&store, 8, 1500, &json!({"pad": "p".repeat(3000)})) {
        t.await.unwrap();
    }
    let s = store.stats();
    assert!(s.wal_frames >= 12_000, "{s:?}");
    assert!(s.writer_checkpoint_ns > 0, "{s:?}");
    assert!(s.writer_checkpoint_ns <= s.writer_busy_ns, "{s:?}");
}
