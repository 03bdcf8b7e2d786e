//! OpenAI-compatible servers (Ollama, llama.cpp, vLLM, LM Studio) over Chat Completions: a local
//! server replays their flavour of the stream (reasoning deltas, no `[DONE]`, string errors).

mod common;

use std::time::Duration;

use common::*;
use harness_bus::Bus;
use harness_router::providers::{ProviderKind, Setup};
use harness_types::message::{ContentBlock, StopReason};
use harness_types::ErrorKind;
use serde_json::{json, Value};

const MODEL: &str = "qwen3:8b";

fn chunk(delta: Value, finish: Value) -> Step {
    data(
        json!({"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
        "system_fingerprint": "fp_ollama",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
    )
}

fn text_reply(parts: &[&str]) -> Reply {
    let mut s = vec![chunk(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    )];
    for p in parts {
        s.push(chunk(
            json!({"role": "assistant", "content": p}),
            Value::Null,
        ));
    }
    s.push(chunk(
        json!({"role": "assistant", "content": ""}),
        json!("stop"),
    ));
    s.push(raw("data: [DONE]\n\n"));
    Reply::Stream(s)
}

fn router_for(mock: &Mock) -> harness_router::Router {
    router(mock, "ollama", ProviderKind::OpenaiCompatible, "/v1", None)
}

#[tokio::test]
async fn reasoning_deltas_show_as_thinking_and_no_key_means_no_auth_header() {
    let mock = Mock::start(vec![Reply::Stream(vec![
        chunk(
            json!({"role": "assistant", "content": "", "reasoning_content": "Let me think"}),
            Value::Null,
        ),
        chunk(
            json!({"role": "assistant", "reasoning_content": " briefly."}),
            Value::Null,
        ),
        chunk(json!({"role": "assistant", "content": "Hi!"}), Value::Null),
        chunk(json!({}), json!("stop")),
        data(
            json!({"id": "chatcmpl-7", "object": "chat.completion.chunk", "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21}}),
        ),
        // Some servers end the body without `data: [DONE]`.
    ])])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    assert_eq!(
        run.kinds(),
        stream_kinds(&["start"], &[("thinking", 2), ("text", 1)])
    );
    let m = run.done();
    assert_eq!(
        m.content,
        vec![
            ContentBlock::Thinking {
                text: "Let me think briefly.".into(),
                signature: None
            },
            ContentBlock::text("Hi!")
        ]
    );
    let u = m.usage.unwrap();
    assert_eq!(
        (u.input, u.output, u.cost_usd),
        (Some(12), Some(9), Some(0.0))
    );
    let req = &mock.requests()[0];
    assert!(!req.headers.contains_key("authorization"));
    assert_eq!(req.body["max_tokens"], 4096);
    assert!(req.body.get("max_completion_tokens").is_none());
}

#[tokio::test]
async fn a_configured_key_is_sent_as_bearer() {
    let mock = Mock::start(vec![text_reply(&["ok"])]).await;
    let r = router(
        &mock,
        "openai-compatible",
        ProviderKind::OpenaiCompatible,
        "/v1",
        Some("local-key-123"),
    );
    chat(&r, request("openai-compatible", MODEL, vec![user("hi")])).await;
    assert_eq!(
        mock.requests()[0].headers["authorization"],
        "Bearer local-key-123"
    );
}

#[tokio::test]
async fn whole_tool_calls_in_one_chunk_and_a_stop_finish_reason_still_call() {
    let mock = Mock::start(vec![Reply::Stream(vec![
        chunk(
            json!({"role": "assistant", "content": "", "tool_calls": [{"id": "call_x1", "index": 0, "type": "function",
                "function": {"name": "math__add", "arguments": "{\"a\":2,\"b\":3}"}}]}),
            Value::Null,
        ),
        chunk(json!({"role": "assistant", "content": ""}), json!("stop")),
        raw("data: [DONE]\n\n"),
    ])])
    .await;
    let r = router_for(&mock);
    let mut req = request("ollama", MODEL, vec![user("add")]);
    req.tools = vec![add_tool()];
    let m = chat(&r, req).await.done();
    assert_eq!(m.stop_reason, StopReason::FunctionCall);
    assert_eq!(
        m.content,
        vec![ContentBlock::FunctionCall {
            id: "call_x1".into(),
            function_id: "math::add".into(),
            arguments: json!({"a": 2, "b": 3})
        }]
    );
}

#[tokio::test]
async fn server_flavoured_errors_classify() {
    let mock = Mock::start(vec![
        status(404, &[], json!({"error": "model \"qwen3:8b\" not found, try pulling it first"})),
        status(400, &[], json!({"error": {"code": 400, "message": "the request exceeds the available context size, try increasing it", "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}})),
        status(503, &[("retry-after", "0")], json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})),
        text_reply(&["loaded"]),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::Permanent);
    assert!(run.error().2.contains("try pulling it first"));
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().1, ErrorKind::ContextOverflow);
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    assert_eq!(run.done().content, vec![ContentBlock::text("loaded")]);
    assert_eq!(mock.requests().len(), 4);
}

#[tokio::test]
async fn a_server_that_is_down_is_a_transient_connect_failure() {
    let router = harness_router::Router::new();
    let cfg = harness_router::providers::ProviderConfig::new(
        "ollama",
        ProviderKind::OpenaiCompatible,
        &nothing_listening(),
        None,
    )
    .with_http(http());
    router.add_provider(cfg.build());
    let run = chat(&router, request("ollama", MODEL, vec![user("hi")])).await;
    let (_, detail) = run.transient();
    assert!(detail.contains("cannot connect to 127.0.0.1"), "{detail}");
    assert_eq!(run.ack.error.unwrap().code, "router/connect_failed");
}

#[tokio::test]
async fn a_cut_stream_keeps_the_partial_and_abort_ends_a_slow_one() {
    let mock = Mock::start(vec![
        Reply::Stream(vec![
            chunk(json!({"content": "par"}), Value::Null),
            Step::Cut,
        ]),
        Reply::Stream(vec![
            chunk(json!({"content": "slow"}), Value::Null),
            Step::Hang,
        ]),
    ])
    .await;
    let r = router_for(&mock);
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    assert_eq!(run.error().0.content, vec![ContentBlock::text("par")]);
    abort_mid_stream(&r, request("ollama", MODEL, vec![user("hi")])).await;
}

#[tokio::test]
async fn the_model_list_comes_from_the_server() {
    let mock = Mock::start(vec![status(
        200,
        &[],
        json!({"object": "list", "data": [
            {"id": "qwen3:8b", "object": "model", "created": 1, "owned_by": "library"},
            {"id": "llama3.2:3b", "object": "model", "created": 1, "owned_by": "library"}
        ]}),
    )])
    .await;
    let r = router_for(&mock);
    let (bus, _dir) = bus_with(&r);
    let v = bus
        .call(
            "router::models::list",
            json!({"provider": "ollama"}),
            Some(Duration::from_secs(5)),
        )
        .await
        .unwrap();
    assert_eq!(mock.requests()[0].path, "/v1/models");
    let ids = strings(&v["models"], "id");
    assert_eq!(ids, ["qwen3:8b", "llama3.2:3b"]);
    assert_eq!(v["models"][0]["generic"], true);
    assert_eq!(v["models"][0]["context_window"], 32768);
    assert_eq!(v["providers"], json!(["ollama"]));
}

#[tokio::test]
async fn a_full_exchange_round_trips_in_the_chat_format() {
    let mock = Mock::start(vec![
        Reply::Stream(vec![
            chunk(json!({"role": "assistant", "content": "Adding."}), Value::Null),
            chunk(json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "math__add", "arguments": "{\"a\":"}}]}), Value::Null),
            chunk(json!({"tool_calls": [{"index": 0, "function": {"arguments": "2,\"b\":3}"}}]}), Value::Null),
            chunk(json!({}), json!("tool_calls")),
            raw("data: [DONE]\n\n"),
        ]),
        text_reply(&["It is 5."]),
    ])
    .await;
    let r = router_for(&mock);
    add_exchange(&r, "ollama", MODEL, "call_1").await;
    assert_eq!(mock.bodies()[1]["messages"], chat_format_exchange());
}

#[test]
fn presets_point_at_the_local_servers() {
    let env = |k: &str| match k {
        "OPENAI_COMPATIBLE_PRESET" => Some("vllm".to_string()),
        "LMSTUDIO_BASE_URL" => Some("http://10.1.1.1:1234/v1".to_string()),
        _ => None,
    };
    let s = Setup::from_sources(&env, None).unwrap();
    let url = |id: &str| s.provider(id).unwrap().base_url.clone();
    assert_eq!(url("openai-compatible"), "http://127.0.0.1:8000/v1");
    assert_eq!(url("ollama"), "http://127.0.0.1:11434/v1");
    assert_eq!(url("llamacpp"), "http://127.0.0.1:8080/v1");
    assert_eq!(url("lmstudio"), "http://10.1.1.1:1234/v1");
    assert_eq!(s.pick().as_deref(), Some("openai-compatible"));
}

#[tokio::test]
async fn chat_picks_flags_then_keys_then_the_demo_and_names_what_is_missing() {
    let none = Setup::from_sources(&|_: &str| None, None).unwrap();
    let c = none.choose(None, None).await.unwrap();
    assert_eq!(
        (c.provider.as_str(), c.model.as_str()),
        ("scripted", "demo")
    );
    assert!(c.note.unwrap().contains("ANTHROPIC_API_KEY"));
    let err = none.choose(Some("anthropic"), None).await.unwrap_err();
    assert!(err.contains("set ANTHROPIC_API_KEY"), "{err}");
    let err = none
        .choose(Some("openai"), Some("gpt-5"))
        .await
        .unwrap_err();
    assert!(err.contains("set OPENAI_API_KEY"), "{err}");

    let keyed = Setup::from_sources(
        &|k: &str| (k == "ANTHROPIC_API_KEY").then(|| "k".to_string()),
        None,
    )
    .unwrap();
    let c = keyed.choose(None, None).await.unwrap();
    assert_eq!(
        (c.provider.as_str(), c.model.as_str(), c.note),
        ("anthropic", "claude-sonnet-4-5", None)
    );
    let c = keyed.choose(Some("scripted"), None).await.unwrap();
    assert_eq!(c.model, "demo");

    // A local server without --model: its first listed model.
    let mock = Mock::start(vec![status(
        200,
        &[],
        json!({"object": "list", "data": [{"id": "llama3.2:3b", "object": "model"}]}),
    )])
    .await;
    let url = format!("{}/v1", mock.url);
    let local = Setup::from_sources(
        &move |k: &str| (k == "OPENAI_COMPATIBLE_BASE_URL").then(|| url.clone()),
        None,
    )
    .unwrap();
    let c = local.choose(None, None).await.unwrap();
    assert_eq!(
        (c.provider.as_str(), c.model.as_str()),
        ("openai-compatible", "llama3.2:3b")
    );
}

#[tokio::test]
async fn a_reply_finished_without_a_token_is_retried_and_never_a_completed_reply() {
    let empty = || {
        Reply::Stream(vec![
            chunk(json!({"role": "assistant"}), Value::Null),
            chunk(json!({}), json!("stop")),
            raw("data: [DONE]\n\n"),
        ])
    };
    let mock = Mock::start(vec![empty(), empty(), empty()]).await;
    let r = router_for(&mock);
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    let (_, detail) = run.transient();
    assert!(detail.contains("without a single token"), "{detail}");
    assert_eq!(run.ack.error.unwrap().code, "router/empty_reply");
    assert_eq!(
        mock.requests().len(),
        3,
        "retried while nothing was streamed"
    );

    let mock = Mock::start(vec![empty(), text_reply(&["Hi!"])]).await;
    let r = router_for(&mock);
    let run = chat(&r, request("ollama", MODEL, vec![user("hi")])).await;
    assert_eq!(run.text(), "Hi!");
}
