//! Event log: dedupe, paging, subscriptions.

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
