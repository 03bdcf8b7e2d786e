//! Checkpoints run beside the writer, and the WAL still starts over under constant writes.

use harness_store::{Durability, Store};
use serde_json::json;

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
    let value = json!({"pad": "p".repeat(2000)});
    let mut tasks = Vec::new();
    for w in 0..40 {
        let (store, value) = (store.clone(), value.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..500 {
                store
                    .kv_put("c", &format!("{w:02}-{i:04}"), &value)
                    .await
                    .unwrap();
            }
        }));
    }
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
