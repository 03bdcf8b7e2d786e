//! An output contract end to end: the real loop and the OpenAI adapter against a local server
//! speaking its streaming wire format. The model has native structured output (catalog), so the
//! request carries `response_format`; an answer that is not valid JSON is nudged, the next one
//! completes the turn with the parsed value.

mod common;

use common::embedded::{config, embedded, start_loop, wait_turn_end, Embedded};
use common::*;
use harness_core::Harness;
use harness_router::providers::{ProviderConfig, ProviderKind};
use harness_router::Router;
use harness_types::api::{OutputContract, SendOptions, SendRequest, StatusReport, TurnStatus};
use serde_json::{json, Value};

fn chunk(delta: Value, finish: Value) -> Step {
    data(
        json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
    )
}

fn answer(text: &str) -> Reply {
    Reply::Stream(vec![
        chunk(json!({"role": "assistant", "content": text}), Value::Null),
        chunk(json!({}), json!("stop")),
        data(
            json!({"id": "c", "object": "chat.completion.chunk", "choices": [],
                    "usage": {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25}}),
        ),
        raw("data: [DONE]\n\n"),
    ])
}

/// The loop with the OpenAI adapter pointed at `mock`.
async fn harness_for(mock: &Mock) -> (Harness, tempfile::TempDir) {
    let Embedded { shared, dir, .. } = embedded().await;
    let router = Router::new();
    router.add_provider(
        ProviderConfig::new(
            "openai",
            ProviderKind::Openai,
            &format!("{}/v1", mock.url),
            Some(KEY),
        )
        .with_http(http())
        .build(),
    );
    harness_router::register(shared.as_ref(), &router);
    let harness = start_loop(shared, config()).await;
    (harness, dir)
}

/// Sends `options` and waits for the turn to end.
async fn end_of(harness: &Harness, options: SendOptions) -> StatusReport {
    let r = harness
        .send(SendRequest {
            message: json!("plan a trip"),
            model: Some("gpt-4o".into()),
            provider: Some("openai".into()),
            options: Some(options),
            ..Default::default()
        })
        .await
        .unwrap();
    wait_turn_end(harness, &r.session_id, &r.turn_id).await
}

async fn run(mock: &Mock, schema: Value) -> (StatusReport, tempfile::TempDir) {
    let (harness, dir) = harness_for(mock).await;
    let options = SendOptions {
        output: Some(OutputContract::Json {
            schema: Some(schema),
        }),
        ..Default::default()
    };
    (end_of(&harness, options).await, dir)
}

fn schema() -> Value {
    json!({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}})
}

#[tokio::test]
async fn the_request_carries_the_schema_and_an_invalid_answer_is_nudged_until_valid() {
    let mock = Mock::start(vec![
        answer("Oslo, I think"),
        answer("{\"city\": \"Oslo\"}"),
    ])
    .await;
    let (status, _dir) = run(&mock, schema()).await;
    assert_eq!(status.status, TurnStatus::Completed, "{status:?}");
    assert_eq!(status.result, Some(json!({"city": "Oslo"})));
    let bodies = mock.bodies();
    assert_eq!(bodies.len(), 2);
    assert_eq!(
        bodies[0]["response_format"],
        json!({"type": "json_schema", "json_schema": {"name": "result", "schema": schema(), "strict": false}})
    );
    assert!(
        bodies[0].get("tools").is_none(),
        "native mode offers no submit_result tool: {}",
        bodies[0]
    );
    let last = bodies[1]["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(last["role"], "user");
    assert!(last["content"]
        .to_string()
        .contains("Your previous result was not accepted: result is not valid JSON"));
}

#[tokio::test]
async fn three_answers_that_break_the_schema_fail_the_turn() {
    let mock = Mock::start(vec![
        answer("{\"town\": 1}"),
        answer("{\"town\": 2}"),
        answer("{\"town\": 3}"),
    ])
    .await;
    let (status, _dir) = run(&mock, schema()).await;
    assert_eq!(status.status, TurnStatus::Failed);
    assert_eq!(
        status.result,
        Some(json!("{\"town\": 3}")),
        "the raw value is kept"
    );
    assert_eq!(mock.bodies().len(), 3);
}

#[tokio::test]
async fn a_turn_whose_next_generation_would_exceed_max_cost_usd_fails_before_the_provider_is_called(
) {
    let mock = Mock::start(vec![answer("{\"city\": \"Oslo\"}")]).await;
    let (harness, _dir) = harness_for(&mock).await;
    // gpt-4o's catalog price makes 4096 reserved output tokens cost about $0.04.
    let options = SendOptions {
        max_cost_usd: Some(0.001),
        ..Default::default()
    };
    let status = end_of(&harness, options).await;
    assert_eq!(status.status, TurnStatus::Failed);
    assert!(status.result_error.unwrap().contains("budget"));
    assert!(mock.bodies().is_empty(), "the provider was never called");
}
