//! Token counts from the model's own server (`router::count-tokens`): a server that cannot count
//! is asked only that, never sent the history; one that can is sent each text once.

use std::sync::{Arc, Mutex};

use harness_bus::{Bus, BusError, CallContext, EmbeddedBus, FunctionDef, LocalHandler, LocalValue};
use harness_store::{Durability, Store};
use harness_types::context::{AssembleOptions, AssembleRequest, ModelRef};
use harness_types::message::AgentMessage;
use harness_types::router::{CountAnswer, CountRequest};
use serde_json::{json, Value};

/// The texts of every `router::count-tokens` request, in order.
type Asked = Arc<Mutex<Vec<Vec<String>>>>;

/// A bus whose `router::count-tokens` answers `counts` (each text's length, or `null` when
/// `counts` is false) and keeps every request's texts.
fn bus_with_counter(dir: &std::path::Path, counts: bool) -> (Arc<EmbeddedBus>, Asked) {
    let store = Store::open(&dir.join("c.db"), Durability::Normal).unwrap();
    let bus = Arc::new(EmbeddedBus::new(store).unwrap());
    let asked: Asked = Arc::default();
    let log = asked.clone();
    bus.register_function(
        FunctionDef::new("router::count-tokens", "test counter"),
        Arc::new(move |payload: Value, _ctx: CallContext| {
            let log = log.clone();
            async move {
                let texts: Vec<String> = serde_json::from_value(payload["texts"].clone()).unwrap();
                let answer = match counts {
                    true => json!({"counts": texts.iter().map(|t| t.len()).collect::<Vec<_>>()}),
                    false => json!({"counts": null}),
                };
                log.lock().unwrap().push(texts);
                Ok(answer)
            }
        }),
    );
    (bus, asked)
}

fn request(model: &str) -> AssembleRequest {
    AssembleRequest {
        messages: Vec::new(),
        model: ModelRef {
            id: model.into(),
            provider: Some("local".into()),
        },
        system_prompt: Some("be brief".into()),
        tools: vec![],
        options: AssembleOptions {
            context_window: 1_000_000,
            ..AssembleOptions::default()
        },
    }
}

fn history(n: usize) -> Vec<AgentMessage> {
    (0..n)
        .map(|i| AgentMessage::user_text(format!("message number {i}"), 0))
        .collect()
}

#[tokio::test]
async fn a_server_that_cannot_count_is_asked_only_whether_it_can() {
    let dir = tempfile::tempdir().unwrap();
    let (bus, asked) = bus_with_counter(dir.path(), false);
    let messages = history(300);
    for n in [299, 300] {
        let out = harness_context::assemble_over(
            Some(bus.as_ref() as &dyn Bus),
            &messages[..n],
            request("cannot-count"),
        )
        .await
        .unwrap();
        assert_eq!(out.counter.as_deref(), Some("estimate:generic"));
    }
    let asked = asked.lock().unwrap();
    // One question a step, and no text of the history in it.
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(asked.iter().all(Vec::is_empty), "{asked:?}");
}

#[tokio::test]
async fn a_counting_server_is_sent_each_text_once() {
    let dir = tempfile::tempdir().unwrap();
    let (bus, asked) = bus_with_counter(dir.path(), true);
    let mut messages = history(3);
    // The same text twice is asked once.
    messages.push(AgentMessage::user_text("message number 0", 0));
    let out = harness_context::assemble_over(
        Some(bus.as_ref() as &dyn Bus),
        &messages,
        request("counts"),
    )
    .await
    .unwrap();
    assert_eq!(out.counter.as_deref(), Some("server+estimate:generic"));
    // The server's counts (each text's length) and 4 tokens of framing a message.
    let texts: u64 = messages
        .iter()
        .map(|m| m.content()[0].as_text().unwrap().len() as u64 + 4)
        .sum();
    assert_eq!(out.token_count, texts + "be brief".len() as u64 + 4);
    messages.push(AgentMessage::user_text("a new one", 0));
    harness_context::assemble_over(Some(bus.as_ref() as &dyn Bus), &messages, request("counts"))
        .await
        .unwrap();
    let asked = asked.lock().unwrap();
    let non_empty: Vec<&Vec<String>> = asked.iter().filter(|t| !t.is_empty()).collect();
    assert_eq!(
        non_empty,
        [
            &vec![
                "be brief".to_string(),
                "message number 0".into(),
                "message number 1".into(),
                "message number 2".into(),
            ],
            &vec!["a new one".to_string()],
        ],
        "{asked:?}"
    );
}

#[tokio::test]
async fn an_in_process_counter_is_asked_typed_and_its_counts_are_used() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("c.db"), Durability::Normal).unwrap();
    let bus = Arc::new(EmbeddedBus::new(store).unwrap());
    let asked: Arc<Mutex<Vec<CountRequest>>> = Arc::default();
    let log = asked.clone();
    // The JSON side refuses: only the typed side may answer this caller.
    let json = Arc::new(|_payload: Value, _ctx: CallContext| async move {
        Err::<Value, _>(BusError::internal("asked over JSON"))
    });
    let local = move |payload: LocalValue, _ctx: CallContext| {
        let req: CountRequest = *payload.downcast().unwrap();
        let counts = req.texts.iter().map(|t| t.len() as u64 * 10).collect();
        log.lock().unwrap().push(req);
        async move {
            let answer = CountAnswer {
                counts: Some(counts),
                counter: Some("server:local".into()),
            };
            Ok(Box::new(answer) as LocalValue)
        }
    };
    bus.register_function_with_local(
        FunctionDef::new("router::count-tokens", "test counter"),
        json,
        Arc::new(local) as Arc<dyn LocalHandler>,
    );
    let messages = history(2);
    let out = harness_context::assemble_over(
        Some(bus.as_ref() as &dyn Bus),
        &messages,
        request("counts-in-process"),
    )
    .await
    .unwrap();
    assert_eq!(out.counter.as_deref(), Some("server+estimate:generic"));
    let texts: u64 = ["be brief", "message number 0", "message number 1"]
        .iter()
        .map(|t| t.len() as u64 * 10 + 4)
        .sum();
    assert_eq!(out.token_count, texts);
    let asked = asked.lock().unwrap();
    // The probe (no texts), then the texts, with the turn's provider and model.
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(asked[0].texts.is_empty(), "{asked:?}");
    assert_eq!(asked[1].texts.len(), 3, "{asked:?}");
    assert!(asked
        .iter()
        .all(|r| r.model == "counts-in-process" && r.provider.as_deref() == Some("local")));
}
