//! The OpenAI Responses adapter (`openai-responses`) against a local server replaying the
//! documented semantic event stream.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use harness_router::providers::ProviderKind;
use harness_types::api::ThinkingLevel;
use harness_types::message::{ContentBlock, StopReason};
use harness_types::ErrorKind;
use serde_json::{json, Value};

const MODEL: &str = "gpt-5";

static SEQ: AtomicU64 = AtomicU64::new(0);

fn e(kind: &str, mut body: Value) -> Step {
    body["type"] = json!(kind);
    body["sequence_number"] = json!(SEQ.fetch_add(1, Ordering::Relaxed));
    ev(kind, body)
}

fn created() -> Vec<Step> {
    let r = json!({"id": "resp_1", "object": "response", "created_at": 1, "status": "in_progress", "model": MODEL, "output": [], "usage": null});
    vec![
        e("response.created", json!({"response": r})),
        e("response.in_progress", json!({"response": r})),
    ]
}

fn reasoning(index: u64, summary: &str, encrypted: &str) -> Vec<Step> {
    vec![
        e(
            "response.output_item.added",
            json!({"output_index": index, "item": {"id": "rs_1", "type": "reasoning", "summary": []}}),
        ),
        e(
            "response.reasoning_summary_part.added",
            json!({"item_id": "rs_1", "output_index": index, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
        ),
        e(
            "response.reasoning_summary_text.delta",
            json!({"item_id": "rs_1", "output_index": index, "summary_index": 0, "delta": summary}),
        ),
        e(
            "response.reasoning_summary_text.done",
            json!({"item_id": "rs_1", "output_index": index, "summary_index": 0, "text": summary}),
        ),
        e(
            "response.output_item.done",
            json!({"output_index": index, "item": {"id": "rs_1", "type": "reasoning",
            "summary": [{"type": "summary_text", "text": summary}], "encrypted_content": encrypted}}),
        ),
    ]
}

fn message(index: u64, parts: &[&str]) -> Vec<Step> {
    let mut s = vec![
        e(
            "response.output_item.added",
            json!({"output_index": index, "item": {"id": "msg_1", "type": "message", "status": "in_progress", "role": "assistant", "content": []}}),
        ),
        e(
            "response.content_part.added",
            json!({"item_id": "msg_1", "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
        ),
    ];
    for p in parts {
        s.push(e(
            "response.output_text.delta",
            json!({"item_id": "msg_1", "output_index": index, "content_index": 0, "delta": p}),
        ));
    }
    let text: String = parts.concat();
    s.push(e(
        "response.output_text.done",
        json!({"item_id": "msg_1", "output_index": index, "content_index": 0, "text": text}),
    ));
    s.push(e("response.output_item.done", json!({"output_index": index, "item": {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]}})));
    s
}

fn call(index: u64, call_id: &str, pieces: &[&str]) -> Vec<Step> {
    let mut s = vec![e(
        "response.output_item.added",
        json!({"output_index": index, "item": {"id": "fc_1", "type": "function_call", "status": "in_progress", "arguments": "", "call_id": call_id, "name": "math__add"}}),
    )];
    for p in pieces {
        s.push(e(
            "response.function_call_arguments.delta",
            json!({"item_id": "fc_1", "output_index": index, "delta": p}),
        ));
    }
    let args: String = pieces.concat();
    s.push(e(
        "response.function_call_arguments.done",
        json!({"item_id": "fc_1", "output_index": index, "arguments": args}),
    ));
    s.push(e("response.output_item.done", json!({"output_index": index, "item": {"id": "fc_1", "type": "function_call", "status": "completed",
        "arguments": args, "call_id": call_id, "name": "math__add"}})));
    s
}

fn completed(input: u64, cached: u64, output: u64, reasoning: u64) -> Step {
    e(
        "response.completed",
        json!({"response": {"id": "resp_1", "object": "response", "status": "completed", "model": MODEL, "output": [],
            "usage": {"input_tokens": input, "input_tokens_details": {"cached_tokens": cached},
                      "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
                      "total_tokens": input + output}}}),
    )
}

fn text_reply(parts: &[&str]) -> Reply {
    let mut s = created();
    s.extend(message(0, parts));
    s.push(completed(20, 0, 5, 0));
    Reply::Stream(s)
}

fn router_for(mock: &Mock) -> harness_router::Router {
    router(
        mock,
        "openai-responses",
        ProviderKind::OpenaiResponses,
        "/v1",
        Some(KEY),
    )
}

#[tokio::test]
async fn text_and_reasoning_stream_with_usage() {
    let mut s = created();
    s.extend(reasoning(0, "Greeting the user.", "gAAAAenc1"));
    s.extend(message(1, &["Hel", "lo"]));
    s.push(completed(1000, 400, 50, 32));
    let mock = Mock::start(vec![Reply::Stream(s)]).await;
    let r = router_for(&mock);
    let mut req = request("openai-responses", MODEL, vec![user("hi")]);
    req.thinking_level = Some(ThinkingLevel::High);
    let run = chat(&r, req).await;
    assert_eq!(
        run.kinds(),
        stream_kinds(&["start"], &[("thinking", 1), ("text", 2)])
    );
    let m = run.done();
    assert_eq!(
        m.content,
        vec![
            ContentBlock::Thinking {
                text: "Greeting the user.".into(),
                signature: Some(
                    json!({"id": "rs_1", "encrypted_content": "gAAAAenc1"}).to_string()
                )
            },
            ContentBlock::text("Hello")
        ]
    );
    assert_eq!(m.stop_reason, StopReason::End);
    let u = m.usage.unwrap();
    assert_eq!(
        (u.input, u.cache_read, u.output, u.reasoning),
        (Some(600), Some(400), Some(50), Some(32))
    );
    let expected = (600.0 * 1.25 + 400.0 * 0.125 + 50.0 * 10.0) / 1e6;
    assert!((u.cost_usd.unwrap() - expected).abs() < 1e-9, "{u:?}");
    let req = &mock.requests()[0];
    assert_eq!(req.path, "/v1/responses");
    assert_eq!(req.headers["authorization"], format!("Bearer {KEY}"));
    assert_eq!(
        req.body,
        json!({"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
               "stream": true, "store": false, "instructions": "You are terse.",
               "reasoning": {"effort": "high", "summary": "auto"}, "include": ["reasoning.encrypted_content"]})
    );
}

#[tokio::test]
async fn function_calls_stream_split_arguments_under_their_function_ids() {
    let mut s = created();
    s.extend(call(0, "call_1", &["{\"a\":", " 2, \"b\"", ": 3}"]));
    s.push(completed(30, 0, 12, 0));
    let mock = Mock::start(vec![Reply::Stream(s)]).await;
    let r = router_for(&mock);
    let mut req = request("openai-responses", MODEL, vec![user("add")]);
    req.tools = vec![add_tool()];
    req.max_output_tokens = Some(1000);
    let run = chat(&r, req).await;
    assert_eq!(run.add_call("call_1").content.len(), 1, "the call alone");
    let body = &mock.bodies()[0];
    assert_eq!(
        body["tools"][0],
        json!({"type": "function", "name": "math__add", "parameters": add_tool().parameters, "strict": false, "description": "Add two numbers."})
    );
    assert_eq!(body["max_output_tokens"], 1000);
}

#[tokio::test]
async fn an_incomplete_response_stops_for_length() {
    let mut s = created();
    s.extend(message(0, &["Long"]));
    s.push(e(
        "response.incomplete",
        json!({"response": {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
            "usage": {"input_tokens": 5, "output_tokens": 16}}}),
    ));
    let mock = Mock::start(vec![Reply::Stream(s)]).await;
    let r = router_for(&mock);
    let m = chat(&r, request("openai-responses", MODEL, vec![user("hi")]))
        .await
        .done();
    assert_eq!(m.stop_reason, StopReason::Length);
    assert_eq!(m.native_stop_reason.as_deref(), Some("max_output_tokens"));
}

#[tokio::test]
async fn a_429_with_retry_after_and_a_500_are_retried() {
    let mock = Mock::start(vec![
        status(429, &[("retry-after", "0")], json!({"error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}})),
        status(500, &[], json!({"error": {"message": "The server had an error", "type": "server_error"}})),
        text_reply(&["ok"]),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai-responses", MODEL, vec![user("hi")])).await;
    assert_eq!(run.done().content, vec![ContentBlock::text("ok")]);
    assert_eq!(mock.requests().len(), 3);
}

#[tokio::test]
async fn failures_in_the_stream_are_classified_and_keep_the_partial() {
    let mut failed = created();
    failed.extend(message(0, &["Part"]).into_iter().take(3));
    failed.push(e(
        "response.failed",
        json!({"response": {"id": "resp_1", "status": "failed", "error": {"code": "server_error", "message": "The model failed to generate a response."}}}),
    ));
    let mut error = created();
    error.push(e("error", json!({"code": "context_length_exceeded", "message": "Your input exceeds the context window of this model.", "param": "input"})));
    let mock = Mock::start(vec![Reply::Stream(failed), Reply::Stream(error)]).await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai-responses", MODEL, vec![user("hi")])).await;
    let (partial, detail) = run.transient();
    assert!(detail.contains("server_error"), "{detail}");
    assert_eq!(partial.content, vec![ContentBlock::text("Part")]);
    let run = chat(&r, request("openai-responses", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::ContextOverflow);
    assert_eq!(mock.requests().len(), 2);
}

#[tokio::test]
async fn a_cut_stream_and_a_malformed_event_fail_with_the_partial() {
    let mut cut = created();
    cut.extend(message(0, &["Cut ", "here"]).into_iter().take(4));
    cut.push(Step::Cut);
    let mut bad = created();
    bad.extend(message(0, &["Bad"]).into_iter().take(3));
    bad.push(raw(
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\n\n",
    ));
    let mock = Mock::start(vec![Reply::Stream(cut), Reply::Stream(bad)]).await;
    let r = router_for(&mock);
    let run = chat(&r, request("openai-responses", MODEL, vec![user("hi")])).await;
    let (partial, _) = run.transient();
    assert_eq!(partial.content, vec![ContentBlock::text("Cut here")]);
    let run = chat(&r, request("openai-responses", MODEL, vec![user("hi")])).await;
    assert_eq!(
        run.ack.error.as_ref().unwrap().code,
        "router/malformed_stream"
    );
    assert_eq!(run.error().0.content, vec![ContentBlock::text("Bad")]);
    assert_eq!(mock.requests().len(), 2);
}

#[tokio::test]
async fn a_slow_stream_is_aborted_by_router_abort() {
    let mut s = created();
    s.extend(message(0, &["slow"]).into_iter().take(3));
    s.push(Step::Hang);
    let mock = Mock::start(vec![Reply::Stream(s)]).await;
    let r = router_for(&mock);
    let message = abort_mid_stream(&r, request("openai-responses", MODEL, vec![user("hi")])).await;
    assert_eq!(message.content, vec![ContentBlock::text("slow")]);
}

#[tokio::test]
async fn a_full_exchange_round_trips_in_the_responses_format() {
    let mut first = created();
    first.extend(reasoning(0, "Need to add.", "gAAAAenc"));
    first.extend(message(1, &["Adding."]));
    first.extend(call(2, "call_1", &["{\"a\": 2,", " \"b\": 3}"]));
    first.push(completed(30, 0, 12, 8));
    let mock = Mock::start(vec![Reply::Stream(first), text_reply(&["It is 5."])]).await;
    let r = router_for(&mock);
    add_exchange(&r, "openai-responses", MODEL, "call_1").await;
    let second = &mock.bodies()[1];
    assert_eq!(
        second["input"],
        json!([
            {"role": "user", "content": [{"type": "input_text", "text": "add 2 and 3"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Need to add."}], "encrypted_content": "gAAAAenc"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
            {"type": "function_call", "call_id": "call_1", "name": "math__add", "arguments": "{\"a\":2,\"b\":3}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "{\"sum\":5}"}
        ])
    );
    assert_eq!(second["tools"], mock.bodies()[0]["tools"]);
}
