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

/// Registers `function_id` as a plain function that sends each payload it is called with to the
/// returned channel and answers what `answer` makes of it.
fn recording(
    bus: &EmbeddedBus,
    function_id: &str,
    description: &str,
    answer: fn(&Value) -> Value,
) -> tokio::sync::mpsc::UnboundedReceiver<Value> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Value>();
    bus.register_function(
        harness_bus::FunctionDef::new(function_id, description),
        Arc::new(move |p: Value, _ctx| {
            let (tx, out) = (tx.clone(), answer(&p));
            async move {
                let _ = tx.send(p);
                Ok(out)
            }
        }),
    );
    rx
}

/// A batch that sets the state key `t/key` to 1 and then calls `function_id`.
fn set_then_call(key: &str, function_id: &str) -> Vec<BusWrite> {
    vec![
        BusWrite::StateSet {
            scope: "t".into(),
            key: key.into(),
            value: json!(1),
        },
        BusWrite::Call {
            function_id: function_id.into(),
            payload: Value::Null,
        },
    ]
}

#[tokio::test]
async fn a_batch_is_one_commit_and_its_step_is_delivered() {
    let dir = tempfile::tempdir().unwrap();
    let (store, bus) = open(dir.path());
    let mut rx = recording(&bus, "t::step", "records its payload", |_| Value::Null);
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
        .commit(set_then_call("rec", "t::refuse"))
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
    let out = bus.commit(set_then_call("a", "t::plain")).await.unwrap();
    assert_eq!(out, vec![Value::Null, json!(7)]);
    assert_eq!(
        store.stats().commits - before,
        1,
        "only the state write committed"
    );
    assert_eq!(bus.state_get("t", "a").await.unwrap(), Some(json!(1)));
}

/// A request of the loop's own writes, as a typed form takes it.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Note {
    text: String,
}

/// A `BusWrite::Typed` reaches a typed in-transaction form as the Rust value it was made with
/// (no JSON on the way); a request of another type, a JSON-only form and a function with no
/// in-transaction form all get its JSON, so the outcome never depends on the path.
#[tokio::test]
async fn typed_writes_skip_json_where_the_form_takes_their_type() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = tempfile::tempdir().unwrap();
    let (store, bus) = open(dir.path());
    let parsed = Arc::new(AtomicUsize::new(0));
    let write = |text: String| -> harness_bus::TxWrite {
        Box::new(move |conn| {
            harness_store::kv_put_in(conn, "t", &text, &json!(text))?;
            Ok(harness_bus::TxAnswer {
                answer: harness_bus::TxValue::Ready(json!({"wrote": text})),
                event: None,
            })
        })
    };
    bus.register_prepared_typed(
        "t::note",
        Arc::new({
            let parsed = parsed.clone();
            move |payload: Value| {
                parsed.fetch_add(1, Ordering::SeqCst);
                let note: Note = serde_json::from_value(payload)?;
                Ok(write(note.text))
            }
        }),
        Arc::new(
            move |request: harness_bus::TypedRequest| match request.take::<Note>() {
                Ok(note) => Ok(write(note.text)),
                Err(other) => Err(Ok(other)),
            },
        ),
    );
    bus.register_transactional(
        "t::in-writer",
        Arc::new(|conn, payload: Value| {
            harness_store::kv_put_in(conn, "t", "in-writer", &payload)?;
            Ok(payload)
        }),
    );
    let typed = |function_id: &str, text: &str| BusWrite::Typed {
        function_id: function_id.into(),
        request: harness_bus::TypedRequest::new(Note { text: text.into() }),
    };
    let before = store.stats().commits;
    let out = bus
        .commit(vec![
            typed("t::note", "a"),
            // Another type: the form hands it back, and it goes through JSON.
            BusWrite::Typed {
                function_id: "t::note".into(),
                request: harness_bus::TypedRequest::new(json!({"text": "b"})),
            },
            typed("t::in-writer", "c"),
        ])
        .await
        .unwrap();
    assert_eq!(store.stats().commits - before, 1, "one transaction");
    assert_eq!(
        out,
        vec![
            json!({"wrote": "a"}),
            json!({"wrote": "b"}),
            json!({"text": "c"})
        ]
    );
    assert_eq!(
        parsed.load(Ordering::SeqCst),
        1,
        "only the untyped one parsed"
    );
    assert_eq!(bus.state_get("t", "a").await.unwrap(), Some(json!("a")));
    assert_eq!(bus.state_get("t", "b").await.unwrap(), Some(json!("b")));

    // A function with no in-transaction form: called one by one with the request's JSON.
    let mut rx = recording(&bus, "t::plain", "echoes", |p| p.clone());
    let out = bus.commit(vec![typed("t::plain", "d")]).await.unwrap();
    assert_eq!(out, vec![json!({"text": "d"})]);
    assert_eq!(rx.recv().await.unwrap(), json!({"text": "d"}));
}

/// A value given as JSON text is written as that text, in a batch's transaction or one by one,
/// read back as the same text or parsed, and rolled back with its batch.
#[tokio::test]
async fn state_written_as_text_commits_rolls_back_and_reads_in_either_form() {
    let dir = tempfile::tempdir().unwrap();
    let (_store, bus) = open(dir.path());
    let text = |key: &str, text: &str| BusWrite::StateSetText {
        scope: "t".into(),
        key: key.into(),
        text: text.into(),
    };
    bus.commit(vec![text("a", r#"{"z":1,"a":[true]}"#)])
        .await
        .unwrap();
    assert_eq!(
        bus.state_get_text("t", "a").await.unwrap().as_deref(),
        Some(r#"{"z":1,"a":[true]}"#)
    );
    assert_eq!(
        bus.state_get("t", "a").await.unwrap(),
        Some(json!({"z": 1, "a": [true]}))
    );

    // In a batch that fails: rolled back with it.
    bus.register_transactional(
        "t::refuse",
        Arc::new(|_conn, _payload| Err(StoreError::Invalid("refused".into()))),
    );
    let refused = vec![
        text("a", r#""rolled back""#),
        BusWrite::Call {
            function_id: "t::refuse".into(),
            payload: Value::Null,
        },
    ];
    assert!(bus.commit(refused).await.is_err());
    assert_eq!(
        bus.state_get_text("t", "a").await.unwrap().as_deref(),
        Some(r#"{"z":1,"a":[true]}"#)
    );

    // One by one (a call without a transactional form), and by `state_set_text`.
    bus.register_function(
        harness_bus::FunctionDef::new("t::plain", "answers 7"),
        Arc::new(|_p: Value, _ctx| async { Ok(json!(7)) }),
    );
    let plain = BusWrite::Call {
        function_id: "t::plain".into(),
        payload: Value::Null,
    };
    bus.commit(vec![text("b", "[1,2]"), plain]).await.unwrap();
    assert_eq!(bus.state_get("t", "b").await.unwrap(), Some(json!([1, 2])));
    bus.state_set_text("t", "c", "\"c\"".into()).await.unwrap();
    assert_eq!(
        bus.state_get_text("t", "c").await.unwrap().as_deref(),
        Some("\"c\"")
    );
    // A value written parsed reads as text too.
    bus.state_set("t", "d", json!({"n": 1})).await.unwrap();
    assert_eq!(
        bus.state_get_text("t", "d").await.unwrap().as_deref(),
        Some(r#"{"n":1}"#)
    );
    assert_eq!(bus.state_get_text("t", "none").await.unwrap(), None);
}
