//! A full agent turn through the real loop (harness-core) and each provider's adapter against
//! its local server: text → function call → result → text. The loop streams the first answer,
//! runs `math::add` once, and the second request replays the first exchange in the provider's
//! own format.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::embedded::{config, embedded, start_loop, wait_turn_end};
use common::*;
use harness_bus::{CallContext, FunctionDef};
use harness_core::Harness;
use harness_router::providers::{ProviderConfig, ProviderKind};
use harness_router::Router;
use harness_session::SessionStore;
use harness_types::api::{FunctionPolicy, SendOptions, SendRequest, TurnStatus};
use serde_json::{json, Value};

struct Rt {
    harness: Harness,
    sessions: SessionStore,
    calls: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

async fn runtime(mock: &Mock, id: &str, kind: ProviderKind, suffix: &str) -> Rt {
    let e = embedded().await;
    let router = Router::new();
    let key = (kind != ProviderKind::OpenaiCompatible).then_some(KEY);
    router.add_provider(
        ProviderConfig::new(id, kind, &format!("{}{suffix}", mock.url), key)
            .with_http(http())
            .build(),
    );
    harness_router::register(e.shared.as_ref(), &router);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    e.shared.register_function(
        FunctionDef::new("math::add", "add two numbers"),
        Arc::new(move |p: Value, _ctx: CallContext| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(json!({"sum": p["a"].as_i64().unwrap_or(0) + p["b"].as_i64().unwrap_or(0)}))
            }
        }),
    );
    let harness = start_loop(e.shared, config()).await;
    Rt {
        harness,
        sessions: e.sessions,
        calls,
        _dir: e.dir,
    }
}

/// Runs "add 2 and 3" to the end; returns the transcript as `(role, text)` and the final result.
async fn turn(rt: &Rt, provider: &str, model: &str) -> (Vec<(String, String)>, Option<Value>) {
    let r = rt
        .harness
        .send(SendRequest {
            message: json!("add 2 and 3"),
            model: Some(model.into()),
            provider: Some(provider.into()),
            options: Some(SendOptions {
                functions: Some(FunctionPolicy {
                    allow: vec!["math::*".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let status = wait_turn_end(&rt.harness, &r.session_id, &r.turn_id).await;
    assert_eq!(status.status, TurnStatus::Completed, "{status:?}");
    let messages = rt
        .sessions
        .all_entries(&r.session_id, false)
        .unwrap()
        .into_iter()
        .filter_map(|e| e.message.map(|m| (m.role().to_string(), m.text())))
        .collect();
    (messages, status.result)
}

fn expected_transcript() -> Vec<(String, String)> {
    vec![
        ("user".into(), "add 2 and 3".into()),
        ("assistant".into(), "Adding.".into()),
        ("function_result".into(), "{\"sum\":5}".into()),
        ("assistant".into(), "It is 5.".into()),
    ]
}

#[tokio::test]
async fn an_agent_turn_runs_through_the_anthropic_adapter() {
    let start = |n: u64| {
        ev(
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg", "type": "message", "role": "assistant",
            "content": [], "model": "claude-sonnet-4-5", "stop_reason": null, "usage": {"input_tokens": n, "output_tokens": 1}}}),
        )
    };
    let text = |i: u64, t: &str| {
        vec![
            ev(
                "content_block_start",
                json!({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}}),
            ),
            ev(
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": t}}),
            ),
            ev(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": i}),
            ),
        ]
    };
    let stop = |reason: &str| {
        vec![
            ev(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": reason}, "usage": {"output_tokens": 9}}),
            ),
            ev("message_stop", json!({"type": "message_stop"})),
        ]
    };
    let mut first = vec![start(50)];
    first.extend(text(0, "Adding."));
    first.extend([
        ev("content_block_start", json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_9", "name": "math__add", "input": {}}})),
        ev("content_block_delta", json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"a\": 2, "}})),
        ev("content_block_delta", json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "\"b\": 3}"}})),
        ev("content_block_stop", json!({"type": "content_block_stop", "index": 1})),
    ]);
    first.extend(stop("tool_use"));
    let mut second = vec![start(80)];
    second.extend(text(0, "It is 5."));
    second.extend(stop("end_turn"));
    let mock = Mock::start(vec![Reply::Stream(first), Reply::Stream(second)]).await;
    let rt = runtime(&mock, "anthropic", ProviderKind::Anthropic, "").await;
    let (messages, result) = turn(&rt, "anthropic", "claude-sonnet-4-5").await;
    assert_eq!(messages, expected_transcript());
    assert_eq!(result, Some(json!("It is 5.")));
    assert_eq!(rt.calls.load(Ordering::SeqCst), 1);
    let bodies = mock.bodies();
    assert_eq!(bodies.len(), 2);
    assert_eq!(
        bodies[1]["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "add 2 and 3"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Adding."},
                {"type": "tool_use", "id": "toolu_9", "name": "math__add", "input": {"a": 2, "b": 3}}
            ]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                "content": [{"type": "text", "text": "{\"sum\":5}"}], "cache_control": {"type": "ephemeral"}}]}
        ])
    );
    assert_eq!(bodies[0]["system"], bodies[1]["system"]);
}

fn chat_chunk(delta: Value, finish: Value) -> Step {
    data(
        json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
    )
}

fn chat_turn_replies() -> (Reply, Reply) {
    let first = Reply::Stream(vec![
        chat_chunk(
            json!({"role": "assistant", "content": "Adding."}),
            Value::Null,
        ),
        chat_chunk(
            json!({"tool_calls": [{"index": 0, "id": "call_9", "type": "function", "function": {"name": "math__add", "arguments": "{\"a\": 2,"}}]}),
            Value::Null,
        ),
        chat_chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": " \"b\": 3}"}}]}),
            Value::Null,
        ),
        chat_chunk(json!({}), json!("tool_calls")),
        data(
            json!({"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 9, "total_tokens": 59}}),
        ),
        raw("data: [DONE]\n\n"),
    ]);
    let second = Reply::Stream(vec![
        chat_chunk(
            json!({"role": "assistant", "content": "It is 5."}),
            Value::Null,
        ),
        chat_chunk(json!({}), json!("stop")),
        raw("data: [DONE]\n\n"),
    ]);
    (first, second)
}

fn expected_chat_messages() -> Value {
    json!([
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "math__add", "arguments": "{\"a\":2,\"b\":3}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_9", "content": "{\"sum\":5}"}
    ])
}

/// Runs the chat-completions turn through provider `id` of `kind` and checks what every chat
/// dialect owes it: the transcript, and the second request replaying the turn after the system
/// prompt.
async fn chat_dialect_turn(id: &str, kind: ProviderKind, model: &str) -> (Rt, Mock) {
    let (first, second) = chat_turn_replies();
    let mock = Mock::start(vec![first, second]).await;
    let rt = runtime(&mock, id, kind, "/v1").await;
    let (messages, _) = turn(&rt, id, model).await;
    assert_eq!(messages, expected_transcript());
    let bodies = mock.bodies();
    let msgs = bodies[1]["messages"].as_array().unwrap();
    assert_eq!(msgs[0]["role"], "system");
    assert_eq!(Value::Array(msgs[1..].to_vec()), expected_chat_messages());
    (rt, mock)
}

#[tokio::test]
async fn an_agent_turn_runs_through_the_openai_chat_adapter() {
    let (rt, _mock) = chat_dialect_turn("openai", ProviderKind::Openai, "gpt-4o").await;
    assert_eq!(rt.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_agent_turn_runs_through_an_openai_compatible_server() {
    let (_rt, mock) = chat_dialect_turn("ollama", ProviderKind::OpenaiCompatible, "qwen3:8b").await;
    assert!(!mock.requests()[0].headers.contains_key("authorization"));
}

#[tokio::test]
async fn an_agent_turn_runs_through_the_openai_responses_adapter() {
    let e = |kind: &str, mut v: Value| {
        v["type"] = json!(kind);
        ev(kind, v)
    };
    let created = || {
        e(
            "response.created",
            json!({"response": {"id": "resp", "status": "in_progress", "output": []}}),
        )
    };
    let message = |i: u64, t: &str| {
        vec![
            e(
                "response.output_item.added",
                json!({"output_index": i, "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": []}}),
            ),
            e(
                "response.output_text.delta",
                json!({"item_id": "msg_1", "output_index": i, "content_index": 0, "delta": t}),
            ),
            e(
                "response.output_item.done",
                json!({"output_index": i, "item": {"id": "msg_1", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]}}),
            ),
        ]
    };
    let completed = || {
        e(
            "response.completed",
            json!({"response": {"status": "completed", "usage": {"input_tokens": 50, "output_tokens": 9}}}),
        )
    };
    let mut first = vec![created()];
    first.extend(message(0, "Adding."));
    first.extend([
        e("response.output_item.added", json!({"output_index": 1, "item": {"id": "fc_1", "type": "function_call", "call_id": "call_9", "name": "math__add", "arguments": ""}})),
        e("response.function_call_arguments.delta", json!({"item_id": "fc_1", "output_index": 1, "delta": "{\"a\": 2,"})),
        e("response.function_call_arguments.delta", json!({"item_id": "fc_1", "output_index": 1, "delta": " \"b\": 3}"})),
        e("response.output_item.done", json!({"output_index": 1, "item": {"id": "fc_1", "type": "function_call", "call_id": "call_9", "name": "math__add", "arguments": "{\"a\": 2, \"b\": 3}"}})),
        completed(),
    ]);
    let mut second = vec![created()];
    second.extend(message(0, "It is 5."));
    second.push(completed());
    let mock = Mock::start(vec![Reply::Stream(first), Reply::Stream(second)]).await;
    let rt = runtime(
        &mock,
        "openai-responses",
        ProviderKind::OpenaiResponses,
        "/v1",
    )
    .await;
    let (messages, _) = turn(&rt, "openai-responses", "gpt-5").await;
    assert_eq!(messages, expected_transcript());
    assert_eq!(rt.calls.load(Ordering::SeqCst), 1);
    assert_eq!(
        mock.bodies()[1]["input"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "add 2 and 3"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
            {"type": "function_call", "call_id": "call_9", "name": "math__add", "arguments": "{\"a\":2,\"b\":3}"},
            {"type": "function_call_output", "call_id": "call_9", "output": "{\"sum\":5}"}
        ])
    );
}
