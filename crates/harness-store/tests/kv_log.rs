//! The kv log (`kv_log.rs`): kv changes are appended and folded into `kv` in batches. Reads
//! answer the newest version before and after a fold, deletions included, and a log a killed
//! process left is folded at the next open with each key's newest version.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};

use harness_store::{Durability, Store};
use serde_json::{json, Value};

const CHILD_ENV: &str = "HARNESS_STORE_KV_LOG_CHILD_DB";

/// Rows of a table, read on a connection of the test's own.
fn rows(path: &std::path::Path, table: &str) -> i64 {
    let c = rusqlite::Connection::open(path).unwrap();
    c.query_row(&format!("SELECT COUNT(*) FROM {table}"), [], |r| r.get(0))
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_see_logged_versions_and_deletions_before_and_after_the_fold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    store.kv_put("s", "a", &json!(1)).await.unwrap();
    store.kv_put("s", "b", &json!(1)).await.unwrap();
    store.fold_events().await.unwrap();
    assert_eq!(rows(&path, "kv_log"), 0, "the fold empties the log");
    assert_eq!(rows(&path, "kv"), 2);

    // Remembered absent (and the scope's list read) before the new key is written: its
    // logged version, and then the fold's insert of its row, must not leave it so.
    assert_eq!(store.kv_get("s", "c").unwrap(), None);

    // Unfolded: a new version of a folded key, a deletion of one, a new key.
    store.kv_put("s", "a", &json!(2)).await.unwrap();
    store.kv_delete("s", "b").await.unwrap();
    store.kv_put("s", "c", &json!(3)).await.unwrap();
    assert_eq!(rows(&path, "kv_log"), 3);
    let expect = vec![("a".to_string(), json!(2)), ("c".to_string(), json!(3))];
    let check = |store: &Store, when: &str| {
        assert_eq!(store.kv_list("s").unwrap(), expect, "{when}");
        assert_eq!(store.kv_get("s", "a").unwrap(), Some(json!(2)), "{when}");
        assert_eq!(store.kv_get("s", "b").unwrap(), None, "{when}");
        assert_eq!(store.kv_get("s", "c").unwrap(), Some(json!(3)), "{when}");
    };
    check(&store, "logged");
    // Inside a write, on the writer's connection: the same, this batch's versions included.
    let seen = store
        .write(|c| {
            harness_store::kv_put_in(c, "s", "d", &json!(4))?;
            Ok((
                harness_store::kv_get_in(c, "s", "a")?,
                harness_store::kv_get_in(c, "s", "b")?,
                harness_store::kv_get_in(c, "s", "d")?,
            ))
        })
        .await
        .unwrap();
    assert_eq!(seen, (Some(json!(2)), None, Some(json!(4))));
    store.kv_delete("s", "d").await.unwrap();

    store.fold_events().await.unwrap();
    assert_eq!(rows(&path, "kv_log"), 0);
    check(&store, "folded");
    // A store opened afresh (no cache, no memory of the log) reads the same.
    store.close();
    drop(store);
    let store = Store::open(&path, Durability::Normal).unwrap();
    check(&store, "reopened");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_writer_folds_the_log_before_it_grows_past_its_bound() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("b.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let mut tasks = Vec::new();
    for w in 0..4 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..1500 {
                store
                    .kv_put("busy", &format!("{w}-{}", i % 50), &json!(i))
                    .await
                    .unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    // 6,000 versions, no pause long enough for an idle fold: folded at least once on count.
    let logged = rows(&path, "kv_log");
    assert!(logged < 6000, "{logged} versions still logged");
    assert_eq!(store.kv_list("busy").unwrap().len(), 200);
    for w in 0..4 {
        assert_eq!(
            store.kv_get("busy", &format!("{w}-49")).unwrap(),
            Some(json!(1499))
        );
    }
}

/// The child's body; a no-op when run as an ordinary test. Four writers each cycle through
/// five keys of their own, deleting every seventh time, and report each resolved call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_log_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let store = Store::open(path.as_ref(), Durability::Full).unwrap();
    let mut writers = Vec::new();
    for w in 0..4 {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            for i in 0u64.. {
                let key = format!("{w}-{}", i % 5);
                if i % 7 == 3 {
                    store.kv_delete("crash", &key).await.unwrap();
                } else {
                    store.kv_set("crash", &key, &json!(i)).await.unwrap();
                }
                println!("done {w} {i}");
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
}

/// What op `i` of a writer leaves its key holding.
fn outcome(i: u64) -> Option<Value> {
    (i % 7 != 3).then(|| json!(i))
}

#[test]
fn sigkill_leaves_a_log_the_next_open_folds_with_each_keys_newest_version() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("crash.db");
    let mut child = common::spawn_child("kv_log_child", CHILD_ENV, &db);
    let stdout = BufReader::new(child.stdout.take().unwrap());
    // Each writer's last reported op (its ops run one after another).
    let mut last: HashMap<u64, u64> = HashMap::new();
    let mut reported = 0;
    for line in stdout.lines() {
        let line = line.unwrap();
        let Some(rest) = line.strip_prefix("done ") else {
            continue;
        };
        let (w, i) = rest.split_once(' ').unwrap();
        last.insert(w.parse().unwrap(), i.parse().unwrap());
        reported += 1;
        if reported == 1500 {
            child.kill().unwrap();
        }
    }
    child.wait().unwrap();
    assert!(reported >= 1500, "the child stopped early");
    assert!(rows(&db, "kv_log") > 0, "the kill left versions in the log");

    let store = Store::open(&db, Durability::Full).unwrap();
    assert_eq!(rows(&db, "kv_log"), 0, "the open folded the log");
    for (w, &l) in &last {
        for k in 0..5u64 {
            let key = format!("{w}-{k}");
            // The last reported op on this key, or the one op after the last report (it may
            // have committed without being reported), if it was on this key.
            let reported_op = (0..=l).rev().find(|i| i % 5 == k);
            let mut allowed = vec![reported_op.and_then(outcome)];
            if (l + 1) % 5 == k {
                allowed.push(outcome(l + 1));
            }
            let found = store.kv_get("crash", &key).unwrap();
            assert!(
                allowed.contains(&found),
                "{key}: found {found:?}, allowed {allowed:?}"
            );
        }
    }
}
