//! A store written with the version 1 or 2 layout opens after the upgrade with every row, id
//! and dedupe key intact, and keeps working.

mod common;

use common::kv_keys;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use harness_store::{Connection, Durability, Queues, Store};
use serde_json::json;

/// The tables as version 1 of this crate created them, verbatim.
const V1_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS kv(
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY(scope, key)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS queue_messages(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    grp TEXT NOT NULL,
    function_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL DEFAULT 'ready',
    enqueued_at INTEGER NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS queue_messages_scan ON queue_messages(queue, status, id);

CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    dedupe_key TEXT UNIQUE,
    at_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_session ON events(session_id, id);
PRAGMA user_version = 1;
";

/// A version 1 store with a large value (one that overflowed its page), events with and
/// without dedupe keys, and a queued message.
fn write_v1(path: &std::path::Path) {
    let conn = Connection::open(path).unwrap();
    conn.pragma_update(None, "journal_mode", "WAL").unwrap();
    conn.execute_batch(V1_SCHEMA).unwrap();
    let big = json!({"prompt": "x".repeat(3000)}).to_string();
    conn.execute(
        "INSERT INTO kv VALUES ('harness_turn', 's1', ?1, 1), ('harness_turn', 's2', '{\"n\":2}', 2)",
        [&big],
    )
    .unwrap();
    for (i, key) in [
        None,
        Some("turn-started:t1"),
        None,
        Some("turn-completed:t1"),
    ]
    .iter()
    .enumerate()
    {
        conn.execute(
            "INSERT INTO events(session_id, topic, payload, dedupe_key, at_ms) VALUES ('s1', 't', ?1, ?2, 5)",
            (json!({"i": i}).to_string(), key),
        )
        .unwrap();
    }
    conn.execute(
        "INSERT INTO events(session_id, topic, payload, dedupe_key, at_ms) VALUES (NULL, 'global', 'null', NULL, 6)",
        [],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO queue_messages(queue, grp, function_id, payload, enqueued_at) VALUES ('q', 's1', 'f', '{\"step\":1}', 7)",
        [],
    )
    .unwrap();
}

#[tokio::test]
async fn a_version_1_store_opens_with_everything_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    write_v1(&path);

    let store = Store::open(&path, Durability::Full).unwrap();
    let layout: (String, i64) = store
        .read(|c| {
            Ok((
                c.query_row("SELECT sql FROM sqlite_schema WHERE name = 'kv'", [], |r| {
                    r.get(0)
                })?,
                c.query_row("PRAGMA user_version", [], |r| r.get(0))?,
            ))
        })
        .unwrap();
    assert!(!layout.0.contains("WITHOUT ROWID"), "{}", layout.0);
    assert_eq!(layout.1, 5);

    // State.
    let s1 = store.kv_get("harness_turn", "s1").unwrap().unwrap();
    assert_eq!(s1["prompt"].as_str().unwrap().len(), 3000);
    let listed = kv_keys(&store, "harness_turn");
    assert_eq!(listed, vec!["s1", "s2"]);
    store
        .kv_set("harness_turn", "s2", &json!({"n": 3}))
        .await
        .unwrap();
    assert_eq!(
        store.kv_get("harness_turn", "s2").unwrap(),
        Some(json!({"n": 3}))
    );

    // Events: same ids, cursors still valid, dedupe keys still deduplicate, new ids above.
    let old = store.events_after("s1", 0, 100).unwrap();
    let ids: Vec<i64> = old.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    assert_eq!(store.events_after("s1", 2, 100).unwrap().len(), 2);
    assert_eq!(store.last_event_id().unwrap(), 5);
    let dup = store
        .append_event(Some("s1"), "t", &json!({}), Some("turn-completed:t1"))
        .await
        .unwrap();
    assert_eq!(
        dup, None,
        "a dedupe key written before the upgrade still counts"
    );
    let new = store
        .append_event(Some("s1"), "t", &json!({}), None)
        .await
        .unwrap();
    assert_eq!(new, Some(6));

    // The queued message is still delivered.
    let queues = Queues::new(store.clone());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    queues.start(
        "q",
        Arc::new(move |m| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(m.payload);
                Ok(())
            }
            .boxed()
        }),
    );
    let delivered = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(delivered, json!({"step": 1}));
    queues.shutdown().await;
    store.close();

    // Opening again is a no-op.
    let again = Store::open(&path, Durability::Full).unwrap();
    assert_eq!(again.events_after("s1", 0, 100).unwrap().len(), 5);
    assert_eq!(again.kv_list("harness_turn").unwrap().len(), 2);
}

/// The event log as version 2 created it, verbatim: its `events_session` index was written by
/// every insert.
const V2_EVENTS: &str = "
CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY,
    session_id TEXT,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    dedupe_key TEXT,
    at_ms INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS events_dedupe ON events(dedupe_key) WHERE dedupe_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS events_session ON events(session_id, id);
PRAGMA user_version = 2;
";

/// A version 2 log opens indexed by session in one go (nothing left in the in-memory tail), the
/// old per-insert index gone, and every session reads the same events with the same ids.
#[tokio::test]
async fn a_version_2_event_log_is_indexed_by_session_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v2.db");
    {
        let conn = Connection::open(&path).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.execute_batch(V2_EVENTS).unwrap();
        for i in 0..40 {
            let session = match i % 3 {
                0 => Some("a"),
                1 => Some("b"),
                _ => None,
            };
            conn.execute(
                "INSERT INTO events(session_id, topic, payload, at_ms) VALUES (?1, 't', ?2, 1)",
                (session, json!({"i": i}).to_string()),
            )
            .unwrap();
        }
    }
    let store = Store::open(&path, Durability::Full).unwrap();
    assert_eq!(store.unfolded_events(), 0);
    let (version, old_index): (i64, bool) = store
        .read(|c| {
            Ok((
                c.query_row("PRAGMA user_version", [], |r| r.get(0))?,
                c.prepare("SELECT 1 FROM sqlite_schema WHERE name = 'events_session'")?
                    .exists([])?,
            ))
        })
        .unwrap();
    assert_eq!((version, old_index), (5, false));
    let a: Vec<i64> = store
        .events_after("a", 0, 100)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(
        a,
        (0..40)
            .filter(|i| i % 3 == 0)
            .map(|i| i + 1)
            .collect::<Vec<i64>>()
    );
    let b = store.events_after("b", 20, 100).unwrap();
    assert_eq!(b.first().map(|e| e.payload["i"].clone()), Some(json!(22)));
    let next = store
        .append_event(Some("a"), "t", &json!({}), None)
        .await
        .unwrap();
    assert_eq!(next, Some(41));
    assert_eq!(store.events_after("a", 40, 10).unwrap().len(), 1);
}

#[tokio::test]
async fn a_store_written_by_a_newer_harness_is_refused_and_left_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("newer.db");
    {
        let store = Store::open(&path, Durability::Full).unwrap();
        store
            .kv_set("harness_turn", "s1", &json!({"n": 1}))
            .await
            .unwrap();
        store.close();
    }
    {
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch("PRAGMA user_version = 99; CREATE TABLE from_the_future(x);")
            .unwrap();
    }

    let err = Store::open(&path, Durability::Full).expect_err("refused");
    let text = err.to_string();
    assert!(text.starts_with("harness/store_too_new: "), "{text}");
    assert!(
        text.contains("schema 99") && text.contains("up to 5"),
        "{text}"
    );
    assert!(text.contains("newer.db"), "{text}");

    // Nothing was migrated or stamped over: the newer harness finds its database as it left it.
    let conn = Connection::open(&path).unwrap();
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, 99);
    let value: String = conn
        .query_row("SELECT value FROM kv WHERE key = 's1'", [], |r| r.get(0))
        .unwrap();
    assert_eq!(value, r#"{"n":1}"#);
}

/// The event log and its fold mark as version 4 left them: the dedupe keys in a unique index
/// every insert wrote, events folded up to id 2.
const V4_EVENTS: &str = "
CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY,
    session_id TEXT,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    dedupe_key TEXT,
    at_ms INTEGER NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS events_dedupe ON events(dedupe_key) WHERE dedupe_key IS NOT NULL;
CREATE TABLE IF NOT EXISTS events_by_session(
    session_id TEXT NOT NULL,
    id INTEGER NOT NULL,
    PRIMARY KEY(session_id, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS folds(
    name TEXT PRIMARY KEY,
    upto INTEGER NOT NULL
) WITHOUT ROWID;
INSERT INTO events VALUES (1, 's', 't', '{}', 'k-folded', 1), (2, 's', 't', '{}', NULL, 1),
    (3, 's', 't', '{}', 'k-tail', 1), (4, 's', 't', '{}', NULL, 1);
INSERT INTO events_by_session VALUES ('s', 1), ('s', 2);
INSERT INTO folds VALUES ('events', 2);
PRAGMA user_version = 4;
";

/// A version 4 log opens with its dedupe keys moved off the per-insert index: the folded
/// events' keys into `event_keys`, the tail's into the writer's memory, and every one of them
/// still deduplicates.
#[tokio::test]
async fn a_version_4_log_keeps_every_dedupe_key_off_the_index() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("v4.db");
    {
        let conn = Connection::open(&path).unwrap();
        conn.pragma_update(None, "journal_mode", "WAL").unwrap();
        conn.execute_batch(V4_EVENTS).unwrap();
    }
    let store = Store::open(&path, Durability::Full).unwrap();
    let (version, index, folded): (i64, bool, Vec<String>) = store
        .read(|c| {
            let folded = c
                .prepare("SELECT dedupe_key FROM event_keys ORDER BY dedupe_key")?
                .query_map([], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            Ok((
                c.query_row("PRAGMA user_version", [], |r| r.get(0))?,
                c.prepare("SELECT 1 FROM sqlite_schema WHERE name = 'events_dedupe'")?
                    .exists([])?,
                folded,
            ))
        })
        .unwrap();
    assert_eq!((version, index), (5, false));
    assert_eq!(folded, vec!["k-folded".to_string()]);
    assert_eq!(store.unfolded_events(), 2);
    for key in ["k-folded", "k-tail"] {
        let again = store
            .append_event(Some("s"), "t", &json!({}), Some(key))
            .await
            .unwrap();
        assert_eq!(again, None, "{key} still deduplicates");
    }
    let ids: Vec<i64> = store
        .events_after("s", 0, 10)
        .unwrap()
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(ids, vec![1, 2, 3, 4]);
    assert_eq!(
        store
            .append_event(Some("s"), "t", &json!({}), Some("k-new"))
            .await
            .unwrap(),
        Some(5)
    );
}
