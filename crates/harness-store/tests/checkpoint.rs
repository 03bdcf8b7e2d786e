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

fn wal_len(db: &std::path::Path) -> u64 {
    let mut wal = db.as_os_str().to_owned();
    wal.push("-wal");
    std::fs::metadata(wal).map(|m| m.len()).unwrap_or(0)
}

/// Once no write has come for a while, the writer copies the WAL into the database and
/// truncates it: a quiet server's WAL holds nothing, whatever the burst before it wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_writer_empties_the_wal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.db");
    let store = Store::open(&path, Durability::Full).unwrap();
    for t in write_at_once(&store, 4, 100, &json!({"pad": "p".repeat(3000)})) {
        t.await.unwrap();
    }
    store.barrier().await.unwrap();
    assert!(wal_len(&path) > 1 << 20, "the burst wrote to the WAL");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while wal_len(&path) > 0 || store.stats().wal_truncations == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the WAL still holds {} bytes ({:?})",
            wal_len(&path),
            store.stats()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(store.kv_list("c").unwrap().len(), 400);
    // The store goes on as before: writes, barriers and reads after the truncation.
    store.kv_put("c", "after", &json!(1)).await.unwrap();
    store.barrier().await.unwrap();
    assert_eq!(store.kv_get("c", "after").unwrap(), Some(json!(1)));
}

/// A clean close leaves the data in the database file and an empty WAL, and the store opens
/// again with everything in it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_close_leaves_an_empty_wal() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.db");
    let store = Store::open(&path, Durability::Full).unwrap();
    let writers = write_at_once(&store, 8, 400, &json!({"pad": "p".repeat(3000)}));
    let mut largest = 0;
    while writers.iter().any(|t| !t.is_finished()) {
        largest = largest.max(wal_len(&path));
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    for t in writers {
        t.await.unwrap();
    }
    assert!(
        largest > 4 << 20,
        "the writes grew the WAL ({largest} bytes)"
    );
    store.close();
    assert_eq!(
        wal_len(&path),
        0,
        "bytes left in the WAL after a clean close"
    );
    drop(store);
    let store = Store::open(&path, Durability::Full).unwrap();
    assert_eq!(store.kv_list("c").unwrap().len(), 3200);
}

/// The pages commits write are counted by the table or index they belong to, and they add up
/// to the writer's own count of WAL pages.
#[tokio::test]
async fn wal_pages_are_counted_by_table() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("c.db"), Durability::Normal).unwrap();
    store.kv_put("warm", "up", &json!(0)).await.unwrap();
    store.record_wal_pages(true);
    let before = store.stats().wal_frames;
    for i in 0..20 {
        store
            .kv_put("c", &format!("k{i}"), &json!({"pad": "p".repeat(500)}))
            .await
            .unwrap();
        store
            .append_event(Some("s"), "t", &json!({"i": i}), None)
            .await
            .unwrap();
    }
    let frames = store.stats().wal_frames - before;
    let pages = store.wal_pages_by_table().unwrap();
    assert_eq!(pages.pages(), frames, "{pages:?}");
    assert_eq!(pages.frame_bytes, 4096 + 24);
    let of = |name: &str| {
        pages
            .by_table
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, n)| *n)
    };
    // One commit each, and each dirties the tree it writes to: the kv log and the events.
    // Neither `kv` nor the per-session index of the events is written per commit: both are
    // folded in batches (at most one fold here, if the writer found itself idle in between).
    assert!(of("kv_log") >= 20, "{pages:?}");
    assert!(of("events") >= 20, "{pages:?}");
    assert!(of("kv") <= 2, "{pages:?}");
    assert!(of("events_by_session") <= 2, "{pages:?}");
    store.record_wal_pages(false);
    store.kv_put("c", "off", &json!(1)).await.unwrap();
    assert_eq!(store.wal_pages_by_table().unwrap().pages(), 0);
}
