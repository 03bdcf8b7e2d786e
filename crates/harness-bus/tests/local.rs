//! In-process calls: a function registered with a typed handler is reached without JSON, and a
//! plain re-registration (a replacement) is never bypassed.

use std::sync::Arc;
use std::time::Duration;

use harness_bus::{local, Bus, CallContext, EmbeddedBus, FunctionDef, LocalHandler, LocalValue};
use harness_store::{Durability, Store};
use serde_json::{json, Value};

fn open(dir: &std::path::Path) -> EmbeddedBus {
    let store = Store::open(&dir.join("b.db"), Durability::Normal).unwrap();
    EmbeddedBus::new(store).unwrap()
}

#[derive(Debug, PartialEq)]
struct Doubled(Vec<u64>);

fn doubler() -> Arc<dyn LocalHandler> {
    Arc::new(|payload: LocalValue, _ctx: CallContext| async move {
        let v: Vec<u64> = local::take("t::double", payload)?;
        Ok(Box::new(Doubled(v.iter().map(|x| x * 2).collect())) as LocalValue)
    })
}

fn json_handler(answer: Value) -> Arc<dyn harness_bus::Handler> {
    Arc::new(move |_p: Value, _ctx: CallContext| {
        let answer = answer.clone();
        async move { Ok(answer) }
    })
}

/// A bus with `t::double` registered twice over: its JSON handler answering `json`, and the
/// doubler in process.
fn with_doubler(dir: &std::path::Path, json: Value) -> EmbeddedBus {
    let bus = open(dir);
    bus.register_function_with_local(
        FunctionDef::new("t::double", "doubles"),
        json_handler(json),
        doubler(),
    );
    bus
}

/// Calls `handler` in process with `request`; the call must fail, with this error.
async fn refused<R: 'static>(
    handler: &dyn LocalHandler,
    function_id: &str,
    request: LocalValue,
    timeout: Duration,
) -> harness_bus::BusError {
    let ctx = CallContext::default();
    match local::invoke::<R>(handler, function_id, request, ctx, timeout).await {
        Ok(_) => panic!("{function_id} should fail"),
        Err(e) => e,
    }
}

#[tokio::test]
async fn a_typed_handler_is_called_with_the_value_itself() {
    let dir = tempfile::tempdir().unwrap();
    let bus = with_doubler(dir.path(), json!("json path"));
    let h = bus
        .local_handler("t::double")
        .expect("registered with a local handler");
    let out: Doubled = local::invoke(
        h.as_ref(),
        "t::double",
        Box::new(vec![1u64, 2, 3]),
        CallContext::default(),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    assert_eq!(out, Doubled(vec![2, 4, 6]));
    // The JSON handler is still what a JSON call reaches.
    assert_eq!(
        bus.call("t::double", json!([1]), None).await.unwrap(),
        json!("json path")
    );
}

#[tokio::test]
async fn a_replacement_registered_plainly_drops_the_typed_handler() {
    let dir = tempfile::tempdir().unwrap();
    let bus = with_doubler(dir.path(), json!("original"));
    bus.register_function(
        FunctionDef::new("t::double", "a replacement"),
        json_handler(json!("replacement")),
    );
    assert!(bus.local_handler("t::double").is_none());
    assert_eq!(
        bus.call("t::double", json!([1]), None).await.unwrap(),
        json!("replacement")
    );
    assert!(bus.local_handler("t::missing").is_none());
}

#[tokio::test]
async fn wrong_types_timeouts_and_panics_are_errors_not_crashes() {
    let dir = tempfile::tempdir().unwrap();
    let bus = with_doubler(dir.path(), Value::Null);
    let h = bus.local_handler("t::double").unwrap();
    let second = Duration::from_secs(1);
    let wrong_request =
        refused::<Doubled>(h.as_ref(), "t::double", Box::new("not a list"), second).await;
    assert!(
        wrong_request.message.contains("in-process request"),
        "{wrong_request}"
    );
    let wrong_answer =
        refused::<String>(h.as_ref(), "t::double", Box::new(vec![1u64]), second).await;
    assert!(
        wrong_answer.message.contains("in-process answer"),
        "{wrong_answer}"
    );

    let slow: Arc<dyn LocalHandler> = Arc::new(|_p: LocalValue, _c: CallContext| async move {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Ok(Box::new(()) as LocalValue)
    });
    let err = refused::<()>(
        slow.as_ref(),
        "t::slow",
        Box::new(()),
        Duration::from_millis(20),
    )
    .await;
    assert_eq!(err.code, "timeout");

    let panics: Arc<dyn LocalHandler> = Arc::new(|_p: LocalValue, _c: CallContext| async move {
        if true {
            panic!("boom");
        }
        Ok(Box::new(()) as LocalValue)
    });
    let err = refused::<()>(panics.as_ref(), "t::panics", Box::new(()), second).await;
    assert!(err.message.contains("panicked"), "{err}");
}

#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct AddRequest {
    a: u64,
    b: u64,
}

#[derive(Debug, PartialEq, serde::Serialize, schemars::JsonSchema)]
struct AddResponse {
    sum: u64,
}

#[tokio::test]
async fn a_typed_function_parses_strictly_answers_json_and_moves_values_in_process() {
    let dir = tempfile::tempdir().unwrap();
    let bus = open(dir.path());
    let offset = 100u64;
    harness_bus::typed::register_with_local(
        &bus,
        FunctionDef::new("t::add", "adds"),
        offset,
        |offset: u64, r: AddRequest| async move {
            Ok::<_, harness_types::HarnessError>(AddResponse {
                sum: offset + r.a + r.b,
            })
        },
    );
    assert_eq!(
        bus.call("t::add", json!({"a": 1, "b": 2}), None)
            .await
            .unwrap(),
        json!({"sum": 103})
    );
    let err = bus
        .call("t::add", json!({"a": 1, "b": 2, "c": 3}), None)
        .await
        .unwrap_err();
    assert!(err.to_string().contains('c'), "names the field: {err}");
    let def = bus.function_def("t::add").unwrap();
    assert_eq!(def.request_schema.unwrap()["required"], json!(["a", "b"]));
    let h = bus.local_handler("t::add").expect("a local side");
    let out: AddResponse = local::invoke(
        h.as_ref(),
        "t::add",
        Box::new(AddRequest { a: 5, b: 6 }),
        CallContext::default(),
        Duration::from_secs(1),
    )
    .await
    .unwrap();
    assert_eq!(out, AddResponse { sum: 111 });
}
