//! Event log: dedupe, paging, subscriptions.

mod common;

use std::time::Duration;

use harness_store::{insert_event_in, Durability, Store};
use serde_json::json;

#[tokio::test]
async fn dedupe_and_paging() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("ev.db"), Durability::Normal).unwrap();
    assert_eq!(store.last_event_id().unwrap(), 0);

    let first = store
        .append_event(Some("s1"), "t", &json!({"n": 0}), Some("k0"))
        .await
        .unwrap();
    assert!(first.is_some());
    let dup = store
        .append_event(Some("s1"), "t", &json!({"n": 99}), Some("k0"))
        .await
        .unwrap();
    assert_eq!(dup, None, "same dedupe key is ignored");
    for n in 1..10 {
        store
            .append_event(Some("s1"), "t", &json!({"n": n}), None)
            .await
            .unwrap();
        store
            .append_event(Some("s2"), "u", &json!({"n": n}), None)
            .await
            .unwrap();
    }
    let last = store
        .append_event(None, "global", &json!(null), None)
        .await
        .unwrap();

    let mut seen = Vec::new();
    let mut cursor = 0;
    loop {
        let page = store.events_after("s1", cursor, 3).unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 3);
        cursor = page.last().unwrap().id;
        seen.extend(page.into_iter().map(|e| {
            assert_eq!(e.session_id.as_deref(), Some("s1"));
            e.payload["n"].as_i64().unwrap()
        }));
    }
    assert_eq!(seen, (0..10).collect::<Vec<_>>());
    assert_eq!(store.events_after("s2", 0, 100).unwrap().len(), 9);
    // Ids are increasing, not dense (a deduped insert may burn one).
    assert_eq!(Some(store.last_event_id().unwrap()), last);
}

#[tokio::test]
async fn subscribers_are_woken() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("ev.db"), Durability::Normal).unwrap();
    let mut rx = store.subscribe_events();
    assert_eq!(*rx.borrow_and_update(), 0);

    let waiter = tokio::spawn(async move {
        rx.changed().await.unwrap();
        let id = *rx.borrow_and_update();
        (rx, id)
    });
    let id = store
        .append_event(Some("s"), "t", &json!(1), None)
        .await
        .unwrap()
        .unwrap();
    let (mut rx, seen) = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(seen, id);

    // A deduped append does not wake anyone.
    store
        .append_event(Some("s"), "t", &json!(1), Some("d"))
        .await
        .unwrap();
    rx.borrow_and_update();
    store
        .append_event(Some("s"), "t", &json!(1), Some("d"))
        .await
        .unwrap();
    assert!(!rx.has_changed().unwrap());

    // Inserts made inside a caller's write are published by notify_events.
    let inner = store
        .write(|c| insert_event_in(c, Some("s"), "t", &json!(2), None))
        .await
        .unwrap()
        .unwrap();
    assert!(!rx.has_changed().unwrap());
    store.notify_events();
    assert!(rx.has_changed().unwrap());
    assert_eq!(*rx.borrow_and_update(), inner);

    // A reopened store starts its watch at the last committed id.
    drop(store);
    let again = Store::open(&dir.path().join("ev.db"), Durability::Normal).unwrap();
    assert_eq!(*again.subscribe_events().borrow(), inner);
}

/// Every event of `session`, read in pages of `page` from `after`.
fn session_ids(store: &Store, session: &str, after: i64, page: usize) -> Vec<i64> {
    let mut out = Vec::new();
    let mut cursor = after;
    loop {
        let rows = store.events_after(session, cursor, page).unwrap();
        let Some(last) = rows.last() else {
            return out;
        };
        cursor = last.id;
        for row in rows {
            assert_eq!(row.session_id.as_deref(), Some(session));
            out.push(row.id);
        }
    }
}

/// Appends `n` events round-robin over `sessions` (and one without a session every tenth) in
/// one write; answers each session's new ids.
async fn append_round_robin(store: &Store, sessions: &[&str], n: usize) -> Vec<Vec<i64>> {
    let names: Vec<String> = sessions.iter().map(|s| s.to_string()).collect();
    let ids = store
        .write(move |c| {
            let mut ids = vec![Vec::new(); names.len()];
            for i in 0..n {
                if i % 10 == 9 {
                    insert_event_in(c, None, "global", &json!(i), None)?;
                }
                let s = i % names.len();
                let id = insert_event_in(c, Some(&names[s]), "t", &json!({"i": i}), None)?;
                ids[s].push(id.unwrap());
            }
            Ok(ids)
        })
        .await
        .unwrap();
    ids
}

/// A session's events read the same whether they sit in the per-session index (folded), in the
/// in-memory tail, or both, with cursors on either side of the fold mark and across a reopen.
#[tokio::test]
async fn a_session_reads_the_same_events_before_and_after_a_fold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ev.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let sessions = ["a", "b", "c"];
    let mut want = append_round_robin(&store, &sessions, 60).await;
    assert_eq!(store.unfolded_events(), 60);
    for (s, ids) in sessions.iter().zip(&want) {
        assert_eq!(&session_ids(&store, s, 0, 7), ids, "{s} in the tail");
    }

    store.fold_events().await.unwrap();
    assert_eq!(store.unfolded_events(), 0);
    for (s, ids) in sessions.iter().zip(&want) {
        assert_eq!(&session_ids(&store, s, 0, 7), ids, "{s} folded");
    }

    // Half folded, half in the tail: pages and cursors cross the mark.
    let more = append_round_robin(&store, &sessions, 30).await;
    for (ids, new) in want.iter_mut().zip(more) {
        ids.extend(new);
    }
    assert_eq!(store.unfolded_events(), 30);
    for (s, ids) in sessions.iter().zip(&want) {
        assert_eq!(&session_ids(&store, s, 0, 4), ids, "{s} across the mark");
        let from = ids[15];
        assert_eq!(
            session_ids(&store, s, from, 3),
            ids[16..].to_vec(),
            "{s} from {from}"
        );
    }
    assert!(store.events_after("nobody", 0, 10).unwrap().is_empty());

    // A clean close folds the tail; what a killed process leaves above the mark (events
    // committed, no fold) is read back into the tail at open.
    store.close();
    drop(store);
    {
        let conn = harness_store::Connection::open(&path).unwrap();
        for (s, ids) in sessions.iter().zip(want.iter_mut()) {
            conn.execute(
                "INSERT INTO events(session_id, topic, payload, at_ms) VALUES (?1, 't', '{}', 1)",
                [s],
            )
            .unwrap();
            ids.push(conn.last_insert_rowid());
        }
    }
    let store = Store::open(&path, Durability::Normal).unwrap();
    assert_eq!(store.unfolded_events(), sessions.len());
    for (s, ids) in sessions.iter().zip(&want) {
        assert_eq!(&session_ids(&store, s, 0, 5), ids, "{s} after a reopen");
    }
}

/// The writer folds on its own: in parts, one after each commit from the one that makes the
/// tail long, and whole when it has had nothing to write for a while. Between the parts the
/// sessions' events read back complete and once each, whichever side of a part they are.
#[tokio::test]
async fn the_writer_folds_a_long_tail_in_parts_and_an_idle_one() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("ev.db"), Durability::Normal).unwrap();
    let names: Vec<String> = (0..40).map(|i| format!("s{i:02}")).collect();
    let sessions: Vec<&str> = names.iter().map(String::as_str).collect();
    // More events than the writer's fold threshold (32,768): its first part runs after this
    // write commits.
    let mut want = append_round_robin(&store, &sessions, 33_000).await;
    let long = store.unfolded_events();
    assert!(long >= 32_768, "{long}");
    let mut writes = 0;
    while store.unfolded_events() > writes {
        assert!(
            writes < 160,
            "{} events still unfolded",
            store.unfolded_events()
        );
        let id = store
            .append_event(Some(sessions[0]), "t", &json!("next"), None)
            .await
            .unwrap()
            .unwrap();
        want[0].push(id);
        writes += 1;
        // The written session and one more each time (reading all forty between writes could
        // outlast the writer's idle wait, 500 ms, under load, and it would fold the rest whole).
        for s in [0, writes % 40] {
            let got = session_ids(&store, sessions[s], 0, 256);
            assert_eq!(got, want[s], "{} after {writes} writes", sessions[s]);
        }
    }
    // A part is ~1,024 events: the fold took many writes' turns, not one.
    assert!(writes >= 20, "folded in {writes} parts");
    for (s, ids) in sessions.iter().zip(&want) {
        assert_eq!(&session_ids(&store, s, 0, 256), ids, "{s} folded");
    }

    append_round_robin(&store, &sessions, 10).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while store.unfolded_events() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle writer left {} events unfolded",
            store.unfolded_events()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        session_ids(&store, sessions[1], 0, 500).len(),
        want[1].len() + 1
    );
}

/// Between a batch's COMMIT and its after-commit step, the event it inserted is in the log but
/// not yet in the session's tail: `notify_events` then wakes nobody to it (a reader woken to
/// it would page without it, and its own wake-up later, with the same id, would be lost), and
/// does once the write resolved. The page read in between does not hold it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_events_wakes_only_to_events_a_reader_can_page() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("ev.db"), Durability::Normal).unwrap();
    let before = store
        .append_event(Some("s"), "t", &json!(0), None)
        .await
        .unwrap()
        .unwrap();
    let mut rx = store.subscribe_events();
    rx.borrow_and_update();

    let (entered, in_after_commit) = std::sync::mpsc::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let released = std::sync::Mutex::new(Some(released));
    let write = {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .write(move |c| {
                    // Registered before the insert: it runs, and holds the writer, before the
                    // tail learns of the event.
                    let released = released.lock().unwrap().take();
                    harness_store::after_commit(move || {
                        entered.send(()).unwrap();
                        if let Some(r) = released {
                            r.recv().unwrap();
                        }
                    });
                    insert_event_in(c, Some("s"), "t", &json!(1), None)
                })
                .await
                .unwrap()
                .unwrap()
        })
    };
    tokio::task::spawn_blocking(move || in_after_commit.recv().unwrap())
        .await
        .unwrap();
    // Committed: the log has it.
    assert!(store.last_event_id().unwrap() > before);
    store.notify_events();
    assert!(
        !rx.has_changed().unwrap(),
        "woken to an event not in the tail"
    );
    assert_eq!(store.events_after("s", before, 10).unwrap().len(), 0);

    release.send(()).unwrap();
    let id = write.await.unwrap();
    store.notify_events();
    assert!(rx.has_changed().unwrap());
    assert_eq!(*rx.borrow_and_update(), id);
    let page = store.events_after("s", before, 10).unwrap();
    assert_eq!(page.iter().map(|e| e.id).collect::<Vec<_>>(), vec![id]);
}

/// Whether `key` is among the folded dedupe keys (`event_keys`).
fn folded_key(store: &Store, key: &str) -> bool {
    store
        .read(|c| {
            Ok(c.prepare("SELECT 1 FROM event_keys WHERE dedupe_key = ?1")?
                .exists([key])?)
        })
        .unwrap()
}

/// A dedupe key counts wherever it is: in the writer's memory (above the fold mark, the same
/// write included), folded into `event_keys`, or read back at open from what a killed process
/// left; a key whose write rolled back was never recorded.
#[tokio::test]
async fn a_dedupe_key_counts_across_folds_rollbacks_and_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ev.db");
    let store = Store::open(&path, Durability::Normal).unwrap();
    let append = |key: &'static str| {
        let store = store.clone();
        async move {
            store
                .append_event(Some("s"), "t", &json!({ "k": key }), Some(key))
                .await
                .unwrap()
        }
    };
    assert!(append("folded").await.is_some());
    store.fold_events().await.unwrap();
    assert!(folded_key(&store, "folded"));
    assert!(append("tail").await.is_some());
    assert!(!folded_key(&store, "tail"), "above the mark: memory only");

    // Twice in one write: the second is a duplicate of the first, uncommitted as it is.
    let twice = store
        .write(|c| {
            let a = insert_event_in(c, Some("s"), "t", &json!(1), Some("same-write"))?;
            let b = insert_event_in(c, Some("s"), "t", &json!(2), Some("same-write"))?;
            Ok((a.is_some(), b.is_some()))
        })
        .await
        .unwrap();
    assert_eq!(twice, (true, false));
    // A write that fails after inserting its key leaves nothing behind.
    let failed = store
        .write(|c| {
            insert_event_in(c, Some("s"), "t", &json!(3), Some("rolled-back"))?;
            Err::<(), _>(harness_store::StoreError::Invalid("on purpose".into()))
        })
        .await;
    assert!(failed.is_err());

    for key in ["folded", "tail", "same-write"] {
        assert_eq!(append(key).await, None, "{key} was recorded");
    }
    assert!(append("rolled-back").await.is_some());

    // What a SIGKILL would leave: the database and its WAL as committed, nothing folded since.
    let crashed = common::killed_copy(&path);
    store.close();
    let reopened = Store::open(&crashed, Durability::Normal).unwrap();
    assert!(reopened.unfolded_events() > 0, "the tail was read back");
    for key in ["folded", "tail", "same-write", "rolled-back"] {
        let again = reopened
            .append_event(Some("s"), "t", &json!({}), Some(key))
            .await
            .unwrap();
        assert_eq!(again, None, "{key} still counts after the crash");
    }
    reopened.fold_events().await.unwrap();
    assert!(folded_key(&reopened, "tail") && folded_key(&reopened, "rolled-back"));
    let fresh = reopened
        .append_event(Some("s"), "t", &json!({}), Some("new"))
        .await
        .unwrap();
    assert!(fresh.is_some());
}
