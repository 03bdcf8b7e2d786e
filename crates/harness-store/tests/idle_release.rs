//! The host's release runs on an idle writer once per idle moment: after a burst of writes has
//! been folded and the WAL emptied, not while the store is quiet with nothing to settle. Its
//! own process, so no other test's store runs the process-wide hook.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use harness_store::{set_idle_release, Durability, Store};
use serde_json::json;

static RELEASES: AtomicUsize = AtomicUsize::new(0);

fn release() {
    RELEASES.fetch_add(1, Ordering::SeqCst);
}

/// Waits until the release count reaches `n` (or a deadline far past the writer's idle delay).
async fn releases_reach(n: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    while RELEASES.load(Ordering::SeqCst) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    RELEASES.load(Ordering::SeqCst)
}

#[tokio::test]
async fn an_idle_writer_runs_the_hosts_release_once_after_each_burst() {
    assert!(set_idle_release(release), "the first setting takes");
    assert!(!set_idle_release(release), "a second one changes nothing");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Normal).unwrap();

    // Quiet with nothing written: nothing to settle, nothing to release (several idle delays).
    tokio::time::sleep(Duration::from_millis(1_600)).await;
    assert_eq!(RELEASES.load(Ordering::SeqCst), 0);

    for burst in 1..=2 {
        for i in 0..50 {
            store
                .kv_set("s", &format!("k{i}"), &json!({ "burst": burst }))
                .await
                .unwrap();
        }
        let truncations = store.stats().wal_truncations;
        assert_eq!(releases_reach(burst).await, burst, "burst {burst} released");
        // The release comes after the WAL was emptied, not before.
        assert!(store.stats().wal_truncations > truncations);
        // And once: an idle store that stays idle does not release again.
        tokio::time::sleep(Duration::from_millis(1_600)).await;
        assert_eq!(RELEASES.load(Ordering::SeqCst), burst);
    }
    store.close();
}
