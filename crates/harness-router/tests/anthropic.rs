//! The Anthropic Messages adapter against a local server replaying the documented SSE stream.

mod common;

use std::time::{Duration, Instant};

use common::*;
use harness_router::providers::ProviderKind;
use harness_types::api::ThinkingLevel;
use harness_types::message::{ContentBlock, StopReason};
use harness_types::router::Frame;
use harness_types::ErrorKind;
use serde_json::{json, Value};

const MODEL: &str = "claude-sonnet-4-5";

fn message_start(input: u64, cache_read: u64, cache_write: u64) -> Step {
    ev(
        "message_start",
        json!({"type": "message_start", "message": {"id": "msg_01", "type": "message", "role": "assistant",
            "content": [], "model": MODEL, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": input, "cache_creation_input_tokens": cache_write,
                      "cache_read_input_tokens": cache_read, "output_tokens": 1}}}),
    )
}

/// A content block `index`: its start event carrying `content_block`, one delta event per entry
/// of `deltas`, and its stop event.
fn block(index: u64, content_block: Value, deltas: impl IntoIterator<Item = Value>) -> Vec<Step> {
    let mut s = vec![ev(
        "content_block_start",
        json!({"type": "content_block_start", "index": index, "content_block": content_block}),
    )];
    for delta in deltas {
        s.push(ev(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        ));
    }
    s.push(ev(
        "content_block_stop",
        json!({"type": "content_block_stop", "index": index}),
    ));
    s
}

fn text_block(index: u64, parts: &[&str]) -> Vec<Step> {
    let deltas = parts
        .iter()
        .map(|p| json!({"type": "text_delta", "text": p}));
    block(index, json!({"type": "text", "text": ""}), deltas)
}

fn tool_block(index: u64, id: &str, name: &str, pieces: &[&str]) -> Vec<Step> {
    let deltas = pieces
        .iter()
        .map(|p| json!({"type": "input_json_delta", "partial_json": p}));
    block(
        index,
        json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
        deltas,
    )
}

fn end(stop: &str, output: u64) -> Vec<Step> {
    vec![
        ev(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": null}, "usage": {"output_tokens": output}}),
        ),
        ev("message_stop", json!({"type": "message_stop"})),
    ]
}

fn text_reply(parts: &[&str]) -> Reply {
    let mut s = vec![message_start(10, 0, 0)];
    s.extend(text_block(0, parts));
    s.extend(end("end_turn", 5));
    Reply::Stream(s)
}

/// Text, then a `math__add` call as `toolu_01` whose arguments stream in `pieces`: a reply that
/// ends for the tool.
fn add_reply(text: &str, pieces: &[&str]) -> Reply {
    let mut s = vec![message_start(30, 0, 0)];
    s.extend(text_block(0, &[text]));
    s.extend(tool_block(1, "toolu_01", "math__add", pieces));
    s.extend(end("tool_use", 20));
    Reply::Stream(s)
}

/// A reply that starts a text block with `parts` and then, instead of the rest, `then`.
fn cut_short(parts: &[&str], then: Step) -> Reply {
    let mut s = vec![message_start(10, 0, 0)];
    s.extend(text_block(0, parts).into_iter().take(1 + parts.len()));
    s.push(then);
    Reply::Stream(s)
}

/// A 429 asking for `retry_after` seconds.
fn slow_down(retry_after: &str) -> Reply {
    status(
        429,
        &[("retry-after", retry_after)],
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}}),
    )
}

fn router_for(mock: &Mock) -> harness_router::Router {
    router(mock, "anthropic", ProviderKind::Anthropic, "", Some(KEY))
}

/// Sends "hi" once to a mock answering `replies`: the mock (what was sent) and the run.
async fn hi(replies: Vec<Reply>) -> (Mock, Run) {
    let mock = Mock::start(replies).await;
    let run = chat(
        &router_for(&mock),
        request("anthropic", MODEL, vec![user("hi")]),
    )
    .await;
    (mock, run)
}

#[tokio::test]
async fn text_streams_as_frames_with_usage_cost_and_cache_markers() {
    let mut steps = vec![
        message_start(25, 100, 50),
        ev("ping", json!({"type": "ping"})),
    ];
    steps.extend(text_block(0, &["Hel", "lo"]));
    steps.extend(end("end_turn", 12));
    let (mock, run) = hi(vec![Reply::Stream(steps)]).await;
    assert_eq!(
        run.kinds(),
        stream_kinds(&["start", "usage", "ping"], &[("text", 2)])
    );
    let m = run.done();
    assert_eq!(m.content, vec![ContentBlock::text("Hello")]);
    assert_eq!(m.stop_reason, StopReason::End);
    assert_eq!(m.native_stop_reason.as_deref(), Some("end_turn"));
    let u = m.usage.unwrap();
    assert_eq!(
        (u.input, u.output, u.cache_read, u.cache_write),
        (Some(25), Some(12), Some(100), Some(50))
    );
    let expected = (25.0 * 3.0 + 12.0 * 15.0 + 100.0 * 0.3 + 50.0 * 3.75) / 1e6;
    assert!((u.cost_usd.unwrap() - expected).abs() < 1e-9, "{u:?}");
    assert!(run.ack.ok);

    let req = &mock.requests()[0];
    assert_eq!(req.path, "/v1/messages");
    assert_eq!(req.headers["x-api-key"], KEY);
    assert_eq!(req.headers["anthropic-version"], "2023-06-01");
    assert_eq!(
        req.body,
        json!({
            "model": MODEL, "max_tokens": 16384, "stream": true,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
            "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
        })
    );
}

#[tokio::test]
async fn system_sections_put_the_cache_marker_on_the_stable_prefix() {
    let mock = Mock::start(vec![text_reply(&["ok"])]).await;
    let r = router_for(&mock);
    let (bus, _dir) = bus_with(&r);
    use harness_bus::Bus;
    let mut payload = serde_json::to_value(request("anthropic", MODEL, vec![user("hi")])).unwrap();
    payload["system_sections"] = json!([
        {"text": "STABLE identity", "cache_boundary": true},
        {"text": "Your session id is s_1.", "cache_boundary": false}
    ]);
    let ack = bus
        .call("router::chat", payload, Some(Duration::from_secs(10)))
        .await
        .unwrap();
    assert_eq!(ack["ok"], true, "{ack}");
    assert_eq!(
        mock.bodies()[0]["system"],
        json!([
            {"type": "text", "text": "STABLE identity", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Your session id is s_1."}
        ])
    );
}

#[tokio::test]
async fn tool_calls_stream_split_arguments_under_their_function_ids() {
    let reply = add_reply("Let me add.", &["", "{\"a\": ", "2, \"b\"", ": 3}"]);
    let mock = Mock::start(vec![reply]).await;
    let r = router_for(&mock);
    let mut req = request("anthropic", MODEL, vec![user("add 2 and 3")]);
    req.tools = vec![add_tool()];
    let run = chat(&r, req).await;
    let deltas: Vec<&str> = run
        .frames
        .iter()
        .filter_map(|f| match f {
            Frame::FunctionCallDelta { delta } => Some(delta.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(deltas, ["{\"a\": ", "2, \"b\"", ": 3}"]);
    let m = run.add_call("toolu_01");
    assert_eq!(m.content.len(), 2, "{:?}", m.content);
    let body = &mock.bodies()[0];
    assert_eq!(body["tools"][0]["name"], "math__add");
    assert_eq!(
        body["tools"][0]["input_schema"]["required"],
        json!(["a", "b"])
    );
}

#[tokio::test]
async fn thinking_with_signature_and_redacted_thinking_are_replayed_verbatim() {
    let mut steps = vec![message_start(40, 0, 0)];
    steps.extend(block(
        0,
        json!({"type": "thinking", "thinking": "", "signature": ""}),
        [
            json!({"type": "thinking_delta", "thinking": "Two plus "}),
            json!({"type": "thinking_delta", "thinking": "three is five."}),
            json!({"type": "signature_delta", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"}),
        ],
    ));
    steps.extend(block(
        1,
        json!({"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}),
        [],
    ));
    steps.extend(text_block(2, &["5"]));
    steps.extend(end("end_turn", 30));
    let mock = Mock::start(vec![Reply::Stream(steps), text_reply(&["again"])]).await;
    let r = router_for(&mock);
    let mut req = request("anthropic", MODEL, vec![user("2+3?")]);
    req.thinking_level = Some(ThinkingLevel::Medium);
    let run = chat(&r, req.clone()).await;
    assert!(run.frames.contains(&Frame::ThinkingEnd {
        signature: Some("EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds".into())
    }));
    let m = run.done();
    assert_eq!(
        m.content,
        vec![
            ContentBlock::Thinking {
                text: "Two plus three is five.".into(),
                signature: Some("EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds".into())
            },
            ContentBlock::RedactedThinking {
                data: "EmwKAhgBEgy3va3pzix/LafPsn4a".into()
            },
            ContentBlock::text("5"),
        ]
    );
    let first = &mock.bodies()[0];
    assert_eq!(
        first["thinking"],
        json!({"type": "enabled", "budget_tokens": 10000})
    );
    assert_eq!(first["max_tokens"], 16384);

    std::sync::Arc::make_mut(&mut req.messages).push(assistant(&run));
    std::sync::Arc::make_mut(&mut req.messages).push(user("and 3+4?"));
    chat(&r, req).await;
    let second = &mock.bodies()[1];
    assert_eq!(
        second["messages"][1],
        json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Two plus three is five.", "signature": "EqQBCgIYAhIM1gbcDa9GJwZA2b3hGgxBdjrkzLoky3dl1pkiMOYds"},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
            {"type": "text", "text": "5"}
        ]})
    );
}

#[tokio::test]
async fn thinking_from_another_provider_is_not_replayed() {
    let mock = Mock::start(vec![text_reply(&["ok"])]).await;
    let r = router_for(&mock);
    let foreign = harness_types::message::AssistantMessage::ended(
        vec![
            ContentBlock::Thinking {
                text: "hmm".into(),
                signature: Some("{\"id\":\"rs_1\"}".into()),
            },
            ContentBlock::text("earlier answer"),
        ],
        "gpt-5",
        "openai-responses",
        1,
    );
    let req = request(
        "anthropic",
        MODEL,
        vec![
            user("a"),
            harness_types::AgentMessage::Assistant(foreign),
            user("b"),
        ],
    );
    chat(&r, req).await;
    assert_eq!(
        mock.bodies()[0]["messages"][1],
        json!({"role": "assistant", "content": [{"type": "text", "text": "earlier answer"}]})
    );
}

#[tokio::test]
async fn a_429_with_retry_after_is_retried_after_the_wait() {
    let mock = Mock::start(vec![
        status(
            429,
            &[("retry-after", "1"), ("request-id", "req_429")],
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "Number of request tokens has exceeded your per-minute rate limit"}}),
        ),
        text_reply(&["after the wait"]),
    ])
    .await;
    let r = router_for(&mock);
    let t0 = Instant::now();
    let run = chat(&r, request("anthropic", MODEL, vec![user("hi")])).await;
    assert!(
        t0.elapsed() >= Duration::from_millis(950),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        run.done().content,
        vec![ContentBlock::text("after the wait")]
    );
    assert_eq!(mock.requests().len(), 2);
    assert_eq!(run.kinds().iter().filter(|k| *k == "start").count(), 1);
}

#[tokio::test]
async fn a_500_and_a_529_before_output_are_retried() {
    let overloaded =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    let (mock, run) = hi(vec![
        status(500, &[], json!({"type": "error", "error": {"type": "api_error", "message": "Internal server error"}})),
        status(529, &[], overloaded),
        text_reply(&["third time"]),
    ])
    .await;
    assert_eq!(run.done().content, vec![ContentBlock::text("third time")]);
    assert_eq!(mock.requests().len(), 3);
}

#[tokio::test]
async fn retries_are_bounded_and_the_failure_is_classified() {
    let overloaded =
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}});
    let (mock, run) = hi(vec![
        status(529, &[], overloaded.clone()),
        status(529, &[], overloaded.clone()),
        status(529, &[], overloaded),
    ])
    .await;
    let (partial, detail) = run.transient();
    assert!(partial.content.is_empty());
    assert!(
        detail.contains("HTTP 529 (overloaded_error): Overloaded"),
        "{detail}"
    );
    let err = run.ack.error.unwrap();
    assert_eq!(err.code, "router/transient");
    assert_eq!(err.message, "The provider failed temporarily.");
    assert!(err.retryable);
    assert_eq!(mock.requests().len(), 3);
}

#[tokio::test]
async fn a_retry_after_beyond_the_budget_fails_at_once() {
    let mock = Mock::start(vec![slow_down("120")]).await;
    let r = router_for(&mock);
    let t0 = Instant::now();
    let run = chat(&r, request("anthropic", MODEL, vec![user("hi")])).await;
    assert!(t0.elapsed() < Duration::from_secs(5));
    let (_, kind, detail) = run.error();
    assert_eq!(kind, ErrorKind::RateLimited);
    assert!(detail.contains("exceeds the retry budget"), "{detail}");
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn context_overflow_and_auth_are_not_retried_and_never_leak_the_key() {
    let mock = Mock::start(vec![
        status(400, &[], json!({"type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long: 208656 tokens > 200000 maximum"}})),
        status(401, &[], json!({"type": "error", "error": {"type": "authentication_error", "message": format!("invalid x-api-key {KEY}")}})),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("anthropic", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::ContextOverflow);
    assert_eq!(
        run.ack.error.as_ref().unwrap().code,
        "router/context_overflow"
    );
    let run = chat(&r, request("anthropic", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::AuthExpired);
    let everything = format!("{:?} {:?}", run.frames, run.ack);
    assert!(!everything.contains(KEY), "{everything}");
    assert!(!everything.contains("0123456789abcdef"));
    assert_eq!(mock.requests().len(), 2);
}

#[tokio::test]
async fn a_stream_cut_after_partial_text_fails_with_the_partial_and_no_retry() {
    let cut = cut_short(&["The answer", " is"], Step::Cut);
    let (mock, run) = hi(vec![cut, text_reply(&["never"])]).await;
    let (partial, _) = run.transient();
    assert_eq!(partial.content, vec![ContentBlock::text("The answer is")]);
    assert_eq!(partial.stop_reason, StopReason::Error);
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn a_malformed_event_fails_the_stream_with_the_partial() {
    let bad = raw("event: content_block_delta\ndata: {\"type\": \"content_block_delta\", \"index\": 0, \"delta\": {\"type\"\n\n");
    let (_, run) = hi(vec![cut_short(&["Partial"], bad)]).await;
    let (partial, detail) = run.transient();
    assert!(detail.contains("malformed"), "{detail}");
    assert_eq!(partial.content, vec![ContentBlock::text("Partial")]);
    assert_eq!(run.ack.error.unwrap().code, "router/malformed_stream");
}

#[tokio::test]
async fn an_in_stream_error_after_output_keeps_the_partial() {
    let error = ev(
        "error",
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}),
    );
    let (mock, run) = hi(vec![cut_short(&["Half"], error)]).await;
    let (partial, detail) = run.transient();
    assert!(detail.contains("overloaded_error"), "{detail}");
    assert_eq!(partial.content, vec![ContentBlock::text("Half")]);
    assert_eq!(mock.requests().len(), 1);
}

#[tokio::test]
async fn a_slow_stream_is_aborted_by_router_abort() {
    let mock = Mock::start(vec![cut_short(&["slow "], Step::Hang)]).await;
    let r = router_for(&mock);
    let message = abort_mid_stream(&r, request("anthropic", MODEL, vec![user("hi")])).await;
    assert_eq!(message.content, vec![ContentBlock::text("slow ")]);
}

/// text → function call → result → text, and the second request replays the first exchange in
/// the Messages format exactly.
#[tokio::test]
async fn a_full_exchange_round_trips_in_the_messages_format() {
    let first = add_reply("Adding.", &["{\"a\": 2,", " \"b\": 3}"]);
    let mock = Mock::start(vec![first, text_reply(&["It is 5."])]).await;
    let r = router_for(&mock);
    add_exchange(&r, "anthropic", MODEL, "toolu_01").await;
    let second = &mock.bodies()[1];
    assert_eq!(
        second["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "add 2 and 3"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Adding."},
                {"type": "tool_use", "id": "toolu_01", "name": "math__add", "input": {"a": 2, "b": 3}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "{\"sum\":5}"}],
                 "cache_control": {"type": "ephemeral"}}
            ]}
        ])
    );
    assert_eq!(second["tools"], mock.bodies()[0]["tools"]);
    let _: Value = second.clone();
}

#[tokio::test]
async fn an_abort_ends_a_retry_wait_at_once() {
    let mock = Mock::start(vec![slow_down("4")]).await;
    let r = router_for(&mock);
    let task = tokio::spawn({
        let r = r.clone();
        async move { chat(&r, request("anthropic", MODEL, vec![user("hi")])).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while mock.requests().is_empty() {
        assert!(Instant::now() < deadline, "no request arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The 429 is being read; give the router a moment to start waiting, then abort.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let t0 = Instant::now();
    assert!(r.abort("t_1:0"));
    let run = task.await.unwrap();
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(run.done().stop_reason, StopReason::Aborted);
    assert_eq!(mock.requests().len(), 1);
}
