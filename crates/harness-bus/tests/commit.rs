//! `Bus::commit` on the embedded bus: a batch is one transaction, all or nothing, and what it
//! enqueues is delivered.

use std::sync::Arc;
use std::time::Duration;

use harness_bus::{Bus, BusWrite, EmbeddedBus, QueueDef};
use harness_store::{Durability, Store, StoreError};
use serde_json::{json, Value};

fn open(dir: &std::path::Path) -> (Store, EmbeddedBus) {
    let store = Store::open(&dir.join("b.db"), Durability::Normal).unwrap();
    let bus = EmbeddedBus::new(store.clone()).unwrap();
    (store, bus)
}

#[tokio::test]
async fn a_batch_is_one_commit_and_its_step_is_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let (store, bus) = open(dir.path());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
    bus.register_function(
        harness_bus::FunctionDef::new("t::step", "records its payload"),
        Arc::new(move |p: Value, _ctx| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(p);
                Ok(Value::Null)
            }
        }),
    );
    bus.register_transactional(
        "t::write",
        Arc::new(|conn, payload: Value| {
            harness_store::kv_put_in(conn, "t", "by-call", &payload)?;
            Ok(json!({"ok": true}))
        }),
    );
    bus.define_queue(QueueDef {
        queue: "q".into(),
        message_group_field: "session_id".into(),
        concurrency: 4,
        max_retries: 1,
        backoff_ms: 10,
        visibility_timeout_ms: 10_000,
    })
    .await
    .unwrap();
    let mut events = store.subscribe_events();
    let before = store.stats().commits;
    let out = bus
        .commit(vec![
            BusWrite::Call {
                function_id: "t::write".into(),
                payload: json!(1),
            },
            BusWrite::StateSet {
                scope: "t".into(),
                key: "rec".into(),
                value: json!({"step": 2}),
            },
            BusWrite::Publish {
                topic: "t::happened".into(),
                payload: json!({"session_id": "s"}),
                dedupe_key: Some("once".into()),
            },
            BusWrite::Enqueue {
                queue: "q".into(),
                function_id: "t::step".into(),
                payload: json!({"session_id": "s", "step": 2}),
            },
        ])
        .await
        .unwrap();
    assert_eq!(
        out,
        vec![json!({"ok": true}), Value::Null, Value::Null, Value::Null]
    );
    assert_eq!(store.stats().commits - before, 1, "one transaction");
    assert_eq!(
        bus.state_get("t", "rec").await.unwrap(),
        Some(json!({"step": 2}))
    );
    assert_eq!(bus.state_get("t", "by-call").await.unwrap(), Some(json!(1)));
    let delivered = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(delivered["step"], 2);
    tokio::time::timeout(Duration::from_secs(10), events.changed())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(store.events_after("s", 0, 10).unwrap().len(), 1);
    bus.shutdown().await;
}

#[tokio::test]
async fn a_failing_write_rolls_the_whole_batch_back() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, bus) = open(dir.path());
    bus.register_transactional(
        "t::refuse",
        Arc::new(|_conn, _payload| {
            Err(StoreError::Invalid(
                "harness/invalid_request: entry_id: must not be empty".into(),
            ))
        }),
    );
    let err = bus
        .commit(vec![
            BusWrite::StateSet {
                scope: "t".into(),
                key: "rec".into(),
                value: json!(1),
            },
            BusWrite::Call {
                function_id: "t::refuse".into(),
                payload: Value::Null,
            },
        ])
        .await
        .unwrap_err();
    assert_eq!(
        err.code, "harness/invalid_request",
        "the typed code survives: {err:?}"
    );
    assert_eq!(
        bus.state_get("t", "rec").await.unwrap(),
        None,
        "rolled back"
    );
}

#[tokio::test]
async fn a_call_without_a_transactional_form_falls_back_to_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let (store, bus) = open(dir.path());
    bus.register_function(
        harness_bus::FunctionDef::new("t::plain", "answers 7"),
        Arc::new(|_p: Value, _ctx| async { Ok(json!(7)) }),
    );
    let before = store.stats().commits;
    let out = bus
        .commit(vec![
            BusWrite::StateSet {
                scope: "t".into(),
                key: "a".into(),
                value: json!(1),
            },
            BusWrite::Call {
                function_id: "t::plain".into(),
                payload: Value::Null,
            },
        ])
        .await
        .unwrap();
    assert_eq!(out, vec![Value::Null, json!(7)]);
    assert_eq!(
        store.stats().commits - before,
        1,
        "only the state write committed"
    );
    assert_eq!(bus.state_get("t", "a").await.unwrap(), Some(json!(1)));
}
