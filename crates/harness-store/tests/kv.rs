//! KV state round-trips.

mod common;

use common::kv_keys;
use harness_store::{
    kv_delete_in, kv_get_in, kv_set_in, Connection, Durability, Store, StoreError,
};
use serde_json::json;

#[tokio::test]
async fn kv_round_trip_old_values_and_ordering() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("kv.db"), Durability::Normal).unwrap();

    assert_eq!(store.kv_get("s", "a").unwrap(), None);
    assert_eq!(
        store.kv_set("s", "b", &json!({"x": 1})).await.unwrap(),
        None
    );
    assert_eq!(
        store.kv_set("s", "b", &json!([2])).await.unwrap(),
        Some(json!({"x": 1}))
    );
    assert_eq!(store.kv_get("s", "b").unwrap(), Some(json!([2])));
    store.kv_set("s", "c", &json!("c")).await.unwrap();
    store.kv_set("s", "a", &json!(null)).await.unwrap();
    store.kv_set("other", "a", &json!(9)).await.unwrap();

    let list = store.kv_list("s").unwrap();
    let keys: Vec<&str> = list.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["a", "b", "c"]);
    assert_eq!(list[0].1, json!(null), "JSON null is a value, not absence");
    assert_eq!(store.kv_get("s", "a").unwrap(), Some(json!(null)));

    assert_eq!(store.kv_delete("s", "b").await.unwrap(), Some(json!([2])));
    assert_eq!(store.kv_delete("s", "b").await.unwrap(), None);
    assert_eq!(store.kv_get("other", "a").unwrap(), Some(json!(9)));
}

#[tokio::test]
async fn kv_helpers_compose_in_one_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("kv.db"), Durability::Normal).unwrap();
    let moved = store
        .write(|c| {
            kv_set_in(c, "s", "from", &json!(5))?;
            let v = kv_delete_in(c, "s", "from")?.unwrap();
            kv_set_in(c, "s", "to", &v)?;
            kv_get_in(c, "s", "to")
        })
        .await
        .unwrap();
    assert_eq!(moved, Some(json!(5)));
    assert_eq!(
        store.kv_list("s").unwrap(),
        vec![("to".to_string(), json!(5))]
    );
}

/// The cache of recent reads never answers with a value older than a resolved write, whoever
/// wrote it (a kv helper, raw SQL, a batch that also failed an op) and however reads and writes
/// interleave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_after_a_resolved_write_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let store =
        harness_store::Store::open(&dir.path().join("c.db"), harness_store::Durability::Normal)
            .unwrap();
    store.kv_put("s", "k", &json!(0)).await.unwrap();
    assert_eq!(store.kv_get("s", "k").unwrap(), Some(json!(0)));
    assert_eq!(
        store.kv_get("s", "k").unwrap(),
        Some(json!(0)),
        "now cached"
    );
    // Raw SQL changes only what the kv log has folded into `kv` (see `kv_log.rs`).
    store.fold_events().await.unwrap();
    store
        .write(|c| {
            c.execute(
                "UPDATE kv SET value = '1' WHERE scope = 's' AND key = 'k'",
                [],
            )?;
            Ok(())
        })
        .await
        .unwrap();
    assert_eq!(store.kv_get("s", "k").unwrap(), Some(json!(1)), "raw SQL");
    store.kv_delete("s", "k").await.unwrap();
    assert_eq!(store.kv_get("s", "k").unwrap(), None);
    // Readers hammer the key while writers move it forward: each read after a write resolved
    // sees at least that write.
    let mut tasks = Vec::new();
    for w in 0..4 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            for i in 1..=300i64 {
                let key = format!("k{w}");
                store.kv_put("s", &key, &json!(i)).await.unwrap();
                let seen = store.kv_get("s", &key).unwrap().and_then(|v| v.as_i64());
                assert_eq!(seen, Some(i), "writer {w} read back an older value");
                let other = format!("k{}", (w + 1) % 4);
                let _ = store.kv_get("s", &other).unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// A row changed behind the store's back (another connection: no writer, no invalidation), so
/// a read that still answers the old value came from the cache.
fn change_behind(path: &std::path::Path, key: &str, text: &str) {
    let c = rusqlite::Connection::open(path).unwrap();
    c.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    let n = c
        .execute(
            "UPDATE kv SET value = ?1 WHERE scope = 's' AND key = ?2",
            (text, key),
        )
        .unwrap();
    assert_eq!(n, 1, "the row exists");
}

/// A committed write puts its value in the cache (the next read skips SQLite); a write that was
/// rolled back, or overwritten later in its own batch, never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_fill_the_cache_only_with_what_committed() {
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("w.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let put = |key: &'static str, v: serde_json::Value| {
        let text = v.to_string();
        let value = Arc::new(v);
        move |c: &harness_store::Connection| {
            harness_store::kv_put_cached_in(c, "s", key, &text, &value)
        }
    };
    // The cached put of `key`, then `then` in the same op.
    let put_then = |key, v, then: fn(&Connection) -> Result<(), StoreError>| {
        let p = put(key, v);
        move |c: &Connection| {
            p(c)?;
            then(c)
        }
    };

    // Committed: cached.
    store
        .kv_put_through("s", "a", json!({"n": 1}))
        .await
        .unwrap();
    // Folded first: the kv log's fold leaves the cache as it is (it writes back what readers
    // already see), and only a folded row can be changed behind the store's back.
    store.fold_events().await.unwrap();
    change_behind(&path, "a", "{\"n\": 99}");
    assert_eq!(
        store.kv_get("s", "a").unwrap(),
        Some(json!({"n": 1})),
        "the write filled the cache"
    );
    store.write_replayable(put("a", json!(2))).await.unwrap();
    store.fold_events().await.unwrap();
    change_behind(&path, "a", "98");
    assert_eq!(store.kv_get("s", "a").unwrap(), Some(json!(2)));

    // Rolled back with its op: never the rolled-back value. (Written through the store, so the
    // committed value is the same whether the failed batch's rollback invalidated the key or
    // not: a batch that could not begin again after the rollback does not commit.)
    store.kv_put("s", "a", &json!(98)).await.unwrap();
    let refused = |_: &Connection| Err(StoreError::Invalid("refused".into()));
    let failed = store
        .write_replayable(put_then("a", json!("rolled back"), refused))
        .await;
    assert!(failed.is_err());
    assert_eq!(store.kv_get("s", "a").unwrap(), Some(json!(98)));

    // Overwritten later in the same batch: by a write that does not fill the cache, or
    // deleted.
    let by_put = |c: &Connection| harness_store::kv_put_in(c, "s", "a", &json!(3));
    store
        .write_replayable(put_then("a", json!("stale"), by_put))
        .await
        .unwrap();
    assert_eq!(store.kv_get("s", "a").unwrap(), Some(json!(3)));
    let deleted = |c: &Connection| kv_delete_in(c, "s", "b").map(drop);
    store
        .write_replayable(put_then("b", json!("gone"), deleted))
        .await
        .unwrap();
    assert_eq!(store.kv_get("s", "b").unwrap(), None);

    // Written twice in one op: the last one.
    store
        .write_replayable({
            let (p, q) = (put("c", json!("first")), put("c", json!("last")));
            move |c| {
                p(c)?;
                q(c)
            }
        })
        .await
        .unwrap();
    store.fold_events().await.unwrap();
    change_behind(&path, "c", "\"behind\"");
    assert_eq!(store.kv_get("s", "c").unwrap(), Some(json!("last")));

    // Ops batched together where some fail (their run is rolled back and the others run
    // again): whatever the batching, only the committed writes are seen.
    let mut tasks = Vec::new();
    for i in 0..40i64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let key: &'static str = Box::leak(format!("k{i}").into_boxed_str());
            let good = put(key, json!(i));
            let bad = put(key, json!("never"));
            let (a, b) = tokio::join!(
                store.write_replayable(good),
                store.write_replayable(move |c| {
                    bad(c)?;
                    Err::<(), _>(harness_store::StoreError::Invalid("refused".into()))
                })
            );
            a.unwrap();
            assert!(b.is_err());
            assert_eq!(store.kv_get("s", key).unwrap(), Some(json!(i)));
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// A value written as JSON text (the turn record) is read back as the same text, or parsed, from
/// the cache; a read that misses caches the text it found; a rolled-back text write is never
/// seen; and a value written parsed is read as text too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_value_written_as_text_is_cached_as_text_and_read_in_either_form() {
    use std::sync::Arc;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let text: Arc<str> = r#"{"b":[2],"a":1}"#.into();
    store
        .kv_put_text_through("s", "t", text.clone())
        .await
        .unwrap();
    store.fold_events().await.unwrap();
    change_behind(&path, "t", r#"{"behind":true}"#);
    let read = store.kv_get_text("s", "t").unwrap().unwrap();
    assert_eq!(&*read, &*text, "the write cached its own text");
    assert!(Arc::ptr_eq(&read, &text), "shared, not copied");
    assert_eq!(
        store.kv_get("s", "t").unwrap(),
        Some(json!({"b": [2], "a": 1})),
        "parsed from the cached text"
    );

    // Rolled back: the committed text stays. (Written again through the store first: the
    // rollback may drop the key from the cache, and the row was changed behind it.)
    store
        .kv_put_text_through("s", "t", text.clone())
        .await
        .unwrap();
    let refused = |c: &Connection| {
        harness_store::kv_put_text_cached_in(c, "s", "t", &Arc::from(r#""rolled back""#))?;
        Err::<(), _>(StoreError::Invalid("refused".into()))
    };
    assert!(store.write_replayable(refused).await.is_err());
    assert_eq!(&*store.kv_get_text("s", "t").unwrap().unwrap(), &*text);

    // Written parsed: read as text, serialised from the cached value.
    store.kv_put("s", "t", &json!({"n": 2})).await.unwrap();
    assert_eq!(
        &*store.kv_get_text("s", "t").unwrap().unwrap(),
        r#"{"n":2}"#
    );

    // A read that misses (a new store on the file: an empty cache) caches the text it found.
    store.fold_events().await.unwrap();
    drop(store);
    let store = Store::open(&path, Durability::Normal).unwrap();
    assert_eq!(
        &*store.kv_get_text("s", "t").unwrap().unwrap(),
        r#"{"n":2}"#
    );
    change_behind(&path, "t", "3");
    assert_eq!(
        &*store.kv_get_text("s", "t").unwrap().unwrap(),
        r#"{"n":2}"#
    );
    assert_eq!(store.kv_get("s", "t").unwrap(), Some(json!({"n": 2})));
    assert_eq!(store.kv_get_text("s", "absent").unwrap(), None);
}

/// A row inserted behind the store's back: a read that still misses it answered from memory.
fn insert_behind(path: &std::path::Path, scope: &str, key: &str) {
    let c = rusqlite::Connection::open(path).unwrap();
    c.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
    c.execute(
        "INSERT INTO kv(scope, key, value, updated_at) VALUES (?1, ?2, '\"behind\"', 0)",
        (scope, key),
    )
    .unwrap();
}

/// Keys found absent and scopes found empty are remembered (the loop asks for them every
/// step), and forgotten by the first insert the store commits there: kv helpers, raw SQL, a
/// batch whose other op failed; a rolled-back insert changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn absent_keys_and_empty_scopes_are_remembered_until_an_insert() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("n.db");
    let store = Store::open(&path, Durability::Normal).unwrap();

    assert_eq!(store.kv_get("s", "a").unwrap(), None);
    assert!(store.kv_list("q").unwrap().is_empty());
    insert_behind(&path, "s", "a");
    insert_behind(&path, "q", "x");
    assert_eq!(store.kv_get("s", "a").unwrap(), None, "remembered absent");
    assert!(store.kv_list("q").unwrap().is_empty(), "remembered empty");

    // An insert into another scope forgets nothing here.
    store.kv_put("other", "a", &json!(1)).await.unwrap();
    assert_eq!(store.kv_get("s", "a").unwrap(), None);
    assert!(store.kv_list("q").unwrap().is_empty());

    // A rolled-back insert: still remembered (and still right).
    let failed = store
        .write_replayable(|c| {
            harness_store::kv_put_in(c, "s", "b", &json!("rolled back"))?;
            Err::<(), _>(harness_store::StoreError::Invalid("refused".into()))
        })
        .await;
    assert!(failed.is_err());
    assert_eq!(store.kv_get("s", "b").unwrap(), None);

    // Committed inserts, by a helper and by raw SQL: seen at once.
    store.kv_put("s", "b", &json!(2)).await.unwrap();
    assert_eq!(store.kv_get("s", "b").unwrap(), Some(json!(2)));
    assert_eq!(
        store.kv_get("s", "a").unwrap(),
        None,
        "only an insert of the key itself forgets it"
    );
    store.kv_put("s", "a", &json!(1)).await.unwrap();
    assert_eq!(store.kv_get("s", "a").unwrap(), Some(json!(1)));
    store
        .write(|c| {
            c.execute(
                "INSERT INTO kv(scope, key, value, updated_at) VALUES ('q', 'y', '3', 0)",
                [],
            )?;
            Ok(())
        })
        .await
        .unwrap();
    let keys = kv_keys(&store, "q");
    assert_eq!(keys, ["x", "y"]);

    // Deleted again, then found empty and inserted in the same batch as a failing op.
    store.kv_delete("q", "x").await.unwrap();
    store.kv_delete("q", "y").await.unwrap();
    assert!(store.kv_list("q").unwrap().is_empty());
    let ok = store.write_replayable(|c| harness_store::kv_put_in(c, "q", "z", &json!(4)));
    let bad = store
        .write_replayable(|_| Err::<(), _>(harness_store::StoreError::Invalid("refused".into())));
    let (ok, bad) = tokio::join!(ok, bad);
    ok.unwrap();
    assert!(bad.is_err());
    assert_eq!(store.kv_list("q").unwrap(), vec![("z".into(), json!(4))]);
}

/// Readers that keep finding a key absent while writers insert it never hide a resolved insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_after_a_resolved_insert_sees_it() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("r.db"), Durability::Normal).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..2 {
        let (store, stop) = (store.clone(), stop.clone());
        readers.push(std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let n = i % 400;
                let _ = store.kv_get("s", &format!("k{n}")).unwrap();
                let _ = store.kv_list(&format!("q{n}")).unwrap();
                i += 1 + r;
            }
        }));
    }
    for n in 0..400 {
        let (key, scope) = (format!("k{n}"), format!("q{n}"));
        store.kv_put("s", &key, &json!(n)).await.unwrap();
        assert_eq!(store.kv_get("s", &key).unwrap(), Some(json!(n)), "{key}");
        store.kv_put(&scope, "x", &json!(n)).await.unwrap();
        assert_eq!(store.kv_list(&scope).unwrap().len(), 1, "{scope}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
}
