//! The OpenAI Chat Completions adapter (`openai`) against a local server replaying the
//! documented `chat.completion.chunk` stream.

mod common;

use common::*;
use harness_router::providers::ProviderKind;
use harness_types::api::ThinkingLevel;
use harness_types::message::ContentBlock;
use harness_types::ErrorKind;
use serde_json::{json, Value};

const MODEL: &str = "gpt-4o";

pub fn chunk(delta: Value, finish: Value) -> Step {
    data(
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "system_fingerprint": "fp_1",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}], "usage": null}),
    )
}

pub fn usage(prompt: u64, cached: u64, completion: u64) -> Step {
    data(
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                  "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
                  "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0}}}),
    )
}

fn done() -> Step {
    raw("data: [DONE]\n\n")
}

fn text_reply(parts: &[&str]) -> Reply {
    let mut s = vec![chunk(
        json!({"role": "assistant", "content": "", "refusal": null}),
        Value::Null,
    )];
    for p in parts {
        s.push(chunk(json!({"content": p}), Value::Null));
    }
    s.push(chunk(json!({}), json!("stop")));
    s.push(usage(20, 0, 5));
    s.push(done());
    Reply::Stream(s)
}

fn tool_reply(text: Option<&str>, id: &str, pieces: &[&str]) -> Reply {
    let mut s = vec![chunk(
        json!({"role": "assistant", "content": null}),
        Value::Null,
    )];
    if let Some(t) = text {
        s.push(chunk(json!({"content": t}), Value::Null));
    }
    s.push(chunk(
        json!({"tool_calls": [{"index": 0, "id": id, "type": "function", "function": {"name": "math__add", "arguments": ""}}]}),
        Value::Null,
    ));
    for p in pieces {
        s.push(chunk(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}),
            Value::Null,
        ));
    }
    s.push(chunk(json!({}), json!("tool_calls")));
    s.push(usage(40, 0, 18));
    s.push(done());
    Reply::Stream(s)
}

fn router_for(mock: &Mock) -> harness_router::Router {
    router(mock, "openai", ProviderKind::Openai, "/v1", Some(KEY))
}

#[tokio::test]
async fn text_streams_with_usage_and_cached_tokens_priced() {
    let mut s = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    s.push(chunk(json!({"content": "Hel"}), Value::Null));
    s.push(chunk(json!({"content": "lo"}), Value::Null));
    s.push(chunk(json!({}), json!("stop")));
    s.push(usage(1000, 800, 10));
    s.push(done());
    let mock = Mock::start(vec![Reply::Stream(s)]).await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(run.kinds(), stream_kinds(&["start"], &[("text", 2)]));
    let m = run.done();
    assert_eq!(m.content, vec![ContentBlock::text("Hello")]);
    assert_eq!(m.native_stop_reason.as_deref(), Some("stop"));
    let u = m.usage.unwrap();
    assert_eq!(
        (u.input, u.cache_read, u.output),
        (Some(200), Some(800), Some(10))
    );
    let expected = (200.0 * 2.5 + 800.0 * 1.25 + 10.0 * 10.0) / 1e6;
    assert!((u.cost_usd.unwrap() - expected).abs() < 1e-9, "{u:?}");
    let req = &mock.requests()[0];
    assert_eq!(req.path, "/v1/chat/completions");
    assert_eq!(req.headers["authorization"], format!("Bearer {KEY}"));
    assert_eq!(
        req.body,
        json!({"model": MODEL, "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}],
               "stream": true, "stream_options": {"include_usage": true}})
    );
}

#[tokio::test]
async fn tool_calls_stream_split_arguments_under_their_function_ids() {
    let mock = Mock::start(vec![tool_reply(
        None,
        "call_abc",
        &["{\"a\"", ": 2, \"b\": ", "3}"],
    )])
    .await;
    let r = router_for(&mock);
    let mut req = request("openai", MODEL, vec![user("add")]);
    req.tools = vec![add_tool()];
    req.max_output_tokens = Some(500);
    let run = chat(&r, req).await;
    assert_eq!(run.add_call("call_abc").content.len(), 1, "the call alone");
    let body = &mock.bodies()[0];
    assert_eq!(body["tools"][0]["type"], "function");
    assert_eq!(body["tools"][0]["function"]["name"], "math__add");
    assert_eq!(body["max_completion_tokens"], 500);
}

#[tokio::test]
async fn thinking_level_maps_to_the_models_reasoning_effort() {
    let mock = Mock::start(vec![
        text_reply(&["ok"]),
        text_reply(&["ok"]),
        text_reply(&["ok"]),
    ])
    .await;
    let r = router_for(&mock);
    let mut req = request("openai", "o3", vec![user("hi")]);
    req.thinking_level = Some(ThinkingLevel::Minimal);
    chat(&r, req.clone()).await;
    req.model = "gpt-5".into();
    chat(&r, req.clone()).await;
    req.model = MODEL.into();
    let run = chat(&r, req).await;
    let bodies = mock.bodies();
    assert_eq!(bodies[0]["reasoning_effort"], "low");
    assert_eq!(bodies[1]["reasoning_effort"], "minimal");
    assert!(bodies[2].get("reasoning_effort").is_none());
    assert!(run.done().warnings.unwrap()[0].contains("thinking_level ignored"));
}

#[tokio::test]
async fn a_429_with_retry_after_ms_is_retried_and_quota_is_not() {
    let mock = Mock::start(vec![
        status(
            429,
            &[("retry-after-ms", "60"), ("x-request-id", "req_abc")],
            json!({"error": {"message": "Rate limit reached for gpt-4o", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}),
        ),
        text_reply(&["fine"]),
        status(
            429,
            &[],
            json!({"error": {"message": "You exceeded your current quota", "type": "insufficient_quota", "param": null, "code": "insufficient_quota"}}),
        ),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(run.done().content, vec![ContentBlock::text("fine")]);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::Permanent);
    assert_eq!(run.ack.error.unwrap().code, "router/quota_exceeded");
    assert_eq!(mock.requests().len(), 3);
}

#[tokio::test]
async fn server_errors_before_output_are_retried() {
    let mock = Mock::start(vec![
        status(500, &[], json!({"error": {"message": "The server had an error", "type": "server_error", "param": null, "code": null}})),
        status(503, &[], json!({"error": {"message": "overloaded", "type": "server_error"}})),
        text_reply(&["ok"]),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(run.done().content, vec![ContentBlock::text("ok")]);
    assert_eq!(mock.requests().len(), 3);
}

#[tokio::test]
async fn context_length_exceeded_is_a_context_overflow() {
    let mock = Mock::start(vec![status(
        400,
        &[],
        json!({"error": {"message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}),
    )])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::ContextOverflow);
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn a_stream_cut_after_partial_text_fails_with_the_partial() {
    let mock = Mock::start(vec![Reply::Stream(vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"content": "Half an"}), Value::Null),
        Step::Cut,
    ])])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    let (partial, _) = run.transient();
    assert_eq!(partial.content, vec![ContentBlock::text("Half an")]);
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn a_malformed_chunk_and_an_in_stream_error_fail_the_stream() {
    let mock = Mock::start(vec![
        Reply::Stream(vec![
            chunk(json!({"content": "A"}), Value::Null),
            raw("data: {\"choices\": [{\"delta\": \n\n"),
        ]),
        Reply::Stream(vec![
            chunk(json!({"content": "B"}), Value::Null),
            data(json!({"error": {"message": "The server had an error while processing your request.", "type": "server_error"}})),
        ]),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(run.ack.error.unwrap().code, "router/malformed_stream");
    let run = chat(&r, request("openai", MODEL, vec![user("hi")])).await;
    let (partial, detail) = run.transient();
    assert!(detail.contains("server_error"), "{detail}");
    assert_eq!(partial.content, vec![ContentBlock::text("B")]);
}

#[tokio::test]
async fn a_slow_stream_is_aborted_by_router_abort() {
    let mock = Mock::start(vec![Reply::Stream(vec![
        chunk(json!({"role": "assistant", "content": "slow"}), Value::Null),
        Step::Hang,
    ])])
    .await;
    let r = router_for(&mock);
    let message = abort_mid_stream(&r, request("openai", MODEL, vec![user("hi")])).await;
    assert_eq!(message.content, vec![ContentBlock::text("slow")]);
}

#[tokio::test]
async fn a_full_exchange_round_trips_in_the_chat_format() {
    let mock = Mock::start(vec![
        tool_reply(Some("Adding."), "call_1", &["{\"a\": 2,", " \"b\": 3}"]),
        text_reply(&["It is 5."]),
    ])
    .await;
    let r = router_for(&mock);
    add_exchange(&r, "openai", MODEL, "call_1").await;
    let second = &mock.bodies()[1];
    assert_eq!(second["messages"], chat_format_exchange());
    assert_eq!(second["tools"], mock.bodies()[0]["tools"]);
}
