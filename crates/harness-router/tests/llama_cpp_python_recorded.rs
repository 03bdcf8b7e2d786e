//! The `llamacpp` provider against what llama-cpp-python 0.3.36 serving Gemma 3 270M Q4_K_M
//! really sent, recorded into `tests/fixtures/llama-cpp-python-0.3.36/` by
//! `tests/fixtures/record.py` (each file names the server, its arguments and the model). One
//! test (or more) per defect found running harness against that server.

mod common;

use std::time::{Duration, Instant};

use common::embedded::{config, embedded, start_loop, wait_turn_end};
use common::recorded::{
    assert_asked_without_the_digits, digits, fixture, Exchange, Replay, LLAMA_CPP_PYTHON,
};
use common::{chat, http, llamacpp_send, nothing_listening, replies, request, user, Run};
use harness_core::{Harness, HarnessConfig};
use harness_router::providers::{ProviderConfig, ProviderKind, Tokenize, WirePatch};
use harness_router::Router;
use harness_session::SessionStore;
use harness_types::api::{SendOptions, SendRequest, StatusReport, TurnStatus};
use harness_types::message::{
    AgentMessage, AssistantMessage, ContentBlock, FunctionResultMessage, StopReason,
};
use harness_types::router::{ChatRequest, ToolSpec};
use harness_types::ErrorKind;
use serde_json::{json, Value};

const MODEL: &str = "gemma-3-270m";

fn exchanges(case: &str) -> Vec<Exchange> {
    let f = fixture(LLAMA_CPP_PYTHON, case);
    assert_eq!(f.server, "llama-cpp-python 0.3.36");
    assert!(f.model.contains("Gemma 3 270M Q4_K_M"));
    f.exchanges
}

fn llamacpp(url: &str, wire: Option<WirePatch>) -> Router {
    llamacpp_with(url, |cfg| cfg.wire = cfg.wire.with(wire.as_ref()))
}

/// A server replaying `exchanges`, and the `llamacpp` provider at it with `wire` patched in.
async fn replay(exchanges: Vec<Exchange>, wire: Option<WirePatch>) -> (Replay, Router) {
    let server = Replay::start(exchanges).await;
    let router = llamacpp(&format!("{}/v1", server.url), wire);
    (server, router)
}

/// The `llamacpp` provider at `url`, its configuration changed by `edit`.
fn llamacpp_with(url: &str, edit: impl FnOnce(&mut ProviderConfig)) -> Router {
    let router = Router::new();
    let mut cfg = ProviderConfig::new("llamacpp", ProviderKind::OpenaiCompatible, url, None)
        .with_http(http());
    edit(&mut cfg);
    router.add_provider(cfg.build());
    router
}

/// The `llamacpp` provider at `url` that never asks the server to count tokens.
fn uncounted(url: &str) -> Router {
    llamacpp_with(url, |cfg| cfg.wire.tokenize = Tokenize::None)
}

fn add_tool() -> ToolSpec {
    ToolSpec {
        name: "math::add".into(),
        description: "Add two numbers.".into(),
        parameters: json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}),
    }
}

fn ask(text: &str, max_output: u32) -> ChatRequest {
    let mut r = request("llamacpp", MODEL, vec![user(text)]);
    r.max_output_tokens = Some(max_output);
    r
}

/// The conversation the recorder replayed: a call of `math__add` and its result.
fn call_replay() -> ChatRequest {
    let call = AssistantMessage {
        content: vec![ContentBlock::FunctionCall {
            id: "call_1".into(),
            function_id: "math::add".into(),
            arguments: json!({"a": 2, "b": 3}),
        }],
        model: MODEL.into(),
        provider: "llamacpp".into(),
        stop_reason: StopReason::FunctionCall,
        usage: None,
        error_kind: None,
        error_message: None,
        native_stop_reason: Some("tool_calls".into()),
        warnings: None,
        timestamp: 1,
    };
    let mut r = ask("What is 2 + 3? Use the tool.", 64);
    std::sync::Arc::make_mut(&mut r.messages).push(AgentMessage::Assistant(call));
    std::sync::Arc::make_mut(&mut r.messages).push(AgentMessage::FunctionResult(
        FunctionResultMessage {
            function_call_id: "call_1".into(),
            function_id: "math::add".into(),
            content: vec![ContentBlock::text("5")],
            details: Value::Null,
            is_error: false,
            timestamp: 2,
        },
    ));
    r.tools = vec![add_tool()];
    r
}

fn only_chat_requests(server: &Replay) -> usize {
    server.chat_bodies().len()
}

// --- 1. a replayed function call: `content: ""`, never `null` -------------------------------

#[tokio::test]
async fn a_replayed_function_call_is_sent_as_the_server_accepts_it() {
    // Recorded with `stream: false`, which a config can ask for (`wire.stream_with_tools`).
    let recorded = exchanges("replay_content_empty");
    let sent_then = recorded[0].request.clone();
    let no_stream = WirePatch {
        stream_with_tools: Some(false),
        ..WirePatch::default()
    };
    let (server, r) = replay(recorded, Some(no_stream)).await;
    let run = chat(&r, call_replay()).await;
    let done = run.done();
    assert!(!joined(&done).is_empty());
    assert_eq!(done.native_stop_reason.as_deref(), Some("length"));
    let body = &server.chat_bodies()[0];
    // Exactly the messages, tools and choices the server accepted.
    assert_eq!(body["messages"], sent_then["messages"]);
    assert_eq!(body["messages"][2]["content"], json!(""));
    assert_eq!(body["tools"], sent_then["tools"]);
    assert_eq!(body["tool_choice"], sent_then["tool_choice"]);
    assert_eq!(body["stream"], json!(false));
    // The non-streamed answer carries usage: it is the server's, not an estimate.
    let usage = done.usage.unwrap();
    assert_eq!(
        (usage.input, usage.output, usage.estimated),
        (Some(35), Some(64), false)
    );
}

#[tokio::test]
async fn content_null_is_what_the_server_rejected_and_that_rejection_is_not_retried() {
    let recorded = exchanges("replay_content_null");
    assert_eq!(recorded[0].request["messages"][2]["content"], Value::Null);
    // A config claiming the server takes `null` (as OpenAI does) gets the recorded 500.
    let claims_null = WirePatch {
        content_null: Some(true),
        ..WirePatch::default()
    };
    let (server, r) = replay(recorded, Some(claims_null)).await;
    let run = chat(&r, call_replay()).await;
    let (_, kind, detail) = run.error();
    assert_eq!(kind, ErrorKind::Permanent, "{detail}");
    assert!(detail.starts_with("HTTP 500"), "{detail}");
    assert!(
        detail.contains("Input should be a valid string"),
        "{detail}"
    );
    assert_eq!(
        run.ack.error.as_ref().unwrap().code,
        "router/invalid_request"
    );
    assert_eq!(
        only_chat_requests(&server),
        1,
        "a validation error is not retried"
    );
    assert_eq!(
        server.chat_bodies()[0]["messages"][2]["content"],
        Value::Null
    );
}

// --- 2. `[DONE]` without a finish reason is an interrupted stream ------------------------------

#[tokio::test]
async fn a_stream_the_server_interrupted_is_never_a_completed_reply() {
    let recorded = exchanges("interrupted_by_second_request");
    // The first stream: text, then `data: [DONE]` with no finish_reason, then a dropped body.
    assert!(recorded[0].body.trim_end().ends_with("data: [DONE]"));
    assert!(!recorded[0].body.contains("\"finish_reason\": \"") && !recorded[0].clean);
    let (_server, r) = replay(vec![recorded[0].clone()], None).await;
    let run = chat(&r, ask("Count from 1 to 200, one number per line.", 300)).await;
    let (partial, detail) = run.transient();
    assert!(detail.contains("without a finish_reason"), "{detail}");
    assert!(!joined(&partial).is_empty(), "the partial text is kept");
    assert_eq!(
        run.ack.error.as_ref().unwrap().code,
        "router/stream_interrupted"
    );
    assert!(!run.kinds().contains(&"done".to_string()));
}

#[tokio::test]
async fn an_interrupted_function_call_is_never_complete() {
    // The recorded forced-call stream, cut where the server cuts an interrupted stream: after
    // an event it had sent, with its `[DONE]` and no finish reason.
    let mut e = exchanges("tools_forced_stream").remove(0);
    let events: Vec<&str> = e.body.split_inclusive("\n\n").collect();
    e.body = events[..4].concat() + "data: [DONE]\n\n";
    let (_server, r) = replay(vec![e], None).await;
    let mut req = ask("What is 2 + 3? Use the tool.", 64);
    req.tools = vec![add_tool()];
    let run = chat(&r, req).await;
    let (partial, _) = run.transient();
    assert!(!run.kinds().contains(&"functioncall_end".to_string()));
    let Some(ContentBlock::FunctionCall { arguments, .. }) = partial.content.last() else {
        panic!("{partial:?}")
    };
    assert_eq!(
        arguments["_partial"], true,
        "the cut call stays marked unrunnable"
    );
}

/// A loop with the `llamacpp` provider at `url` and a function `math::add`.
async fn runtime(url: &str) -> (Harness, SessionStore, tempfile::TempDir) {
    let e = embedded().await;
    harness_router::register(e.shared.as_ref(), &llamacpp(url, None));
    let harness = start_loop(
        e.shared,
        HarnessConfig {
            default_context_window: 4096,
            ..config()
        },
    )
    .await;
    (harness, e.sessions, e.dir)
}

#[tokio::test]
async fn a_turn_whose_stream_was_interrupted_resumes_and_ends_with_a_reply_the_server_finished() {
    // Session A's stream interrupted by session B's request, then A's resume answered in full
    // (the second recorded stream, which ran to its finish reason).
    let recorded = exchanges("interrupted_by_second_request");
    let server = Replay::start(recorded).await;
    let (harness, sessions, _dir) = runtime(&format!("{}/v1", server.url)).await;
    let r = harness
        .send(SendRequest {
            message: json!("Count from 1 to 200, one number per line."),
            model: Some(MODEL.into()),
            provider: Some("llamacpp".into()),
            options: Some(SendOptions {
                max_output_tokens: Some(300),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let status = wait_turn_end(&harness, &r.session_id, &r.turn_id).await;
    assert_eq!(status.status, TurnStatus::Completed, "{status:?}");
    let replies = replies(&sessions, &r.session_id);
    assert_eq!(replies.len(), 2, "{replies:?}");
    // The cut reply is kept as what it is; the resumed one ended with the server's `length`.
    assert_eq!(replies[0].stop_reason, StopReason::Error, "{replies:?}");
    assert_eq!(replies[0].error_kind, Some(ErrorKind::Transient));
    assert_eq!(replies[1].stop_reason, StopReason::Length, "{replies:?}");
    assert_eq!(status.transient_resumes, 1);
    for a in &replies {
        assert!(a.usage.as_ref().is_some_and(|u| u.estimated));
    }
    assert_eq!(only_chat_requests(&server), 2);
}

// --- 3. usage when the stream carries none -----------------------------------------------------

#[tokio::test]
async fn a_stream_without_usage_gets_an_estimate_marked_and_priced() {
    let recorded = exchanges("plain_stream");
    assert!(
        !recorded[0].body.contains("\"usage\""),
        "the server sent no usage"
    );
    let (server, r) = replay(recorded.clone(), None).await;
    let run = chat(&r, ask("Say hello.", 64)).await;
    let done = run.done();
    assert_eq!(joined(&done), recorded_text(&recorded[0].body));
    let usage = done.usage.clone().expect("usage");
    assert!(usage.estimated);
    assert!(
        usage.input.unwrap() > 0 && usage.output.unwrap() > 0,
        "{usage:?}"
    );
    assert_eq!(
        usage.output.unwrap(),
        (joined(&done).len() as u64).div_ceil(4)
    );
    assert_eq!(usage.cost_usd, Some(0.0));
    assert_eq!(run.ack.usage.as_ref().unwrap(), &usage);
    // The server ignores `stream_options`: the preset does not send it.
    assert!(server.chat_bodies()[0].get("stream_options").is_none());

    // A priced catch-all row prices the estimate like any usage.
    let (_server, r) = replay(recorded, None).await;
    r.set_catalog(
        harness_router::Catalog::builtin()
            .merged(
                &json!({"models": [{"provider": "openai-compatible", "id": "*", "pricing": {"input": 1.0, "output": 2.0}}]}),
                "test",
            )
            .unwrap(),
    );
    let usage = chat(&r, ask("Say hello.", 64)).await.done().usage.unwrap();
    let want = (usage.input.unwrap() as f64 * 1.0 + usage.output.unwrap() as f64 * 2.0) / 1e6;
    assert!((usage.cost_usd.unwrap() - want).abs() < 1e-8, "{usage:?}");
}

// --- 4. errors a person can act on ---------------------------------------------------------------

#[tokio::test]
async fn a_base_url_without_v1_says_the_status_the_servers_words_and_where_to_look() {
    let server = Replay::start(exchanges("not_found_without_v1")).await;
    let r = llamacpp(&server.url, None);
    let run = chat(&r, ask("Say hello.", 64)).await;
    let (_, kind, detail) = run.error();
    assert_eq!(kind, ErrorKind::Permanent);
    assert!(detail.starts_with("HTTP 404: Not Found"), "{detail}");
    assert!(
        detail.contains(&format!("try {}/v1 as the base URL", server.url)),
        "{detail}"
    );
    assert!(detail.contains("LLAMACPP_BASE_URL"), "{detail}");
    assert_eq!(only_chat_requests(&server), 1, "a 404 is not retried");
    // The same parts, each on its own, for API clients.
    let e = run.ack.error.clone().expect("an ack error");
    assert_eq!(e.code, "router/not_found");
    assert_eq!(e.status, Some(404));
    assert_eq!(e.provider_message.as_deref(), Some("Not Found"));
    let hint = e.hint.expect("a hint");
    assert!(
        hint.starts_with(&format!(
            "OpenAI-compatible servers serve under /v1: try {}/v1",
            server.url
        )),
        "{hint}"
    );
    let raw = e.detail.expect("a detail");
    assert!(
        raw.starts_with("HTTP 404: Not Found") && !raw.contains(&hint),
        "{raw}"
    );
}

#[tokio::test]
async fn nothing_listening_says_so() {
    let url = nothing_listening();
    let r = llamacpp(&url, None);
    let run = chat(&r, ask("Say hello.", 64)).await;
    let (_, detail) = run.transient();
    assert!(
        detail.contains(&format!("nothing answers at {url}: start the server")),
        "{detail}"
    );
}

// --- 5. function calling on this server -------------------------------------------------------

#[tokio::test]
async fn tools_are_offered_with_tool_choice_and_a_forced_call_streams_back_as_a_call() {
    // Offered with `tool_choice: "auto"`, the server answers text (it ignores the tools).
    let (server, r) = replay(exchanges("tools_auto_stream"), None).await;
    let mut req = ask("What is 2 + 3? Use the tool.", 64);
    req.tools = vec![add_tool()];
    let run = chat(&r, req.clone()).await;
    assert!(!joined(&run.done()).is_empty());
    let body = &server.chat_bodies()[0];
    assert_eq!(body["tool_choice"], "auto");
    assert_eq!(body["tools"][0]["function"]["name"], "math__add");
    assert_eq!(body["stream"], true);

    // Forced through provider options, streamed: a call of `math::add` with its arguments.
    let recorded = exchanges("tools_forced_stream");
    let forced = recorded[0].request["tool_choice"].clone();
    let (server, r) = replay(recorded, None).await;
    req.provider_options = Some(json!({"llamacpp": {"tool_choice": forced.clone()}}));
    let run = chat(&r, req.clone()).await;
    assert_call(&run);
    assert_eq!(server.chat_bodies()[0]["tool_choice"], forced);

    // The same, not streamed (`wire.stream_with_tools: false`).
    let no_stream = WirePatch {
        stream_with_tools: Some(false),
        ..WirePatch::default()
    };
    let (server, r) = replay(exchanges("tools_forced_whole"), Some(no_stream)).await;
    let run = chat(&r, req).await;
    assert_call(&run);
    assert_eq!(server.chat_bodies()[0]["stream"], false);
    assert_eq!(run.done().usage.unwrap().output, Some(17));
}

fn assert_call(run: &Run) {
    let done = run.done();
    assert_eq!(done.stop_reason, StopReason::FunctionCall);
    assert_eq!(done.native_stop_reason.as_deref(), Some("tool_calls"));
    let calls: Vec<_> = done
        .content
        .iter()
        .filter_map(|b| match b {
            ContentBlock::FunctionCall {
                function_id,
                arguments,
                ..
            } => Some((function_id.clone(), arguments.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(calls.len(), 1, "{done:?}");
    assert_eq!(calls[0].0, "math::add");
    assert!(
        calls[0].1["a"].is_number() && calls[0].1["b"].is_number(),
        "{calls:?}"
    );
}

// --- 6. an error raised after the response started ---------------------------------------------

#[tokio::test]
async fn an_error_after_the_200_is_not_retried_and_not_called_temporary() {
    let recorded = exchanges("context_exceeded_stream");
    assert_eq!((recorded[0].status, recorded[0].body.as_str()), (200, ""));
    let (server, r) = replay(recorded, None).await;
    let long = format!(
        "Repeat: {}",
        "the quick brown fox jumps over the lazy dog ".repeat(80)
    );
    let run = chat(&r, ask(&long, 64)).await;
    let (_, kind, detail) = run.error();
    // Recorded: what the server does with a prompt over its window (see
    // `digits_overflow_stream` too), so it is an overflow, not the server's fault.
    assert_eq!(kind, ErrorKind::ContextOverflow);
    assert!(
        detail.contains("closed the stream without sending anything"),
        "{detail}"
    );
    assert!(!detail.contains("ended before the provider finished"));
    assert_eq!(run.ack.error.as_ref().unwrap().code, "router/empty_stream");
    assert_eq!(only_chat_requests(&server), 1, "not retried");
}

// --- 7. a local model's limits -----------------------------------------------------------------

#[tokio::test]
async fn a_length_stop_is_a_length_stop_and_the_output_budget_is_the_callers() {
    let (server, r) = replay(exchanges("length_stop"), None).await;
    let run = chat(&r, ask("Write a long story about the sea.", 8)).await;
    let done = run.done();
    assert_eq!(done.stop_reason, StopReason::Length);
    assert_eq!(done.native_stop_reason.as_deref(), Some("length"));
    assert_eq!(server.chat_bodies()[0]["max_tokens"], 8);
}

#[tokio::test]
async fn the_window_probe_asks_the_server_once_and_keeps_the_catch_all_row_when_it_says_nothing() {
    let mut recorded = exchanges("models");
    recorded.extend(exchanges("props"));
    recorded.extend(exchanges("plain_stream"));
    recorded.extend(exchanges("multi_turn_stream"));
    let (server, r) = replay(recorded, None).await;
    chat(&r, ask("Say hello.", 64)).await.done();
    let entry = r.model_entry(Some("llamacpp"), MODEL).await.unwrap();
    assert!(
        entry.generic,
        "llama-cpp-python reports no window: {entry:?}"
    );
    let mut second = request(
        "llamacpp",
        MODEL,
        vec![
            user("My name is Ada."),
            AgentMessage::Assistant(run_text("Hello Ada.")),
            user("What is my name?"),
        ],
    );
    second.max_output_tokens = Some(64);
    let done = chat(&r, second).await.done();
    assert!(joined(&done).contains("Ada"), "{done:?}");
    let paths: Vec<String> = server.asked().into_iter().map(|a| a.path).collect();
    assert_eq!(
        paths,
        [
            "/v1/models",
            "/props",
            "/v1/chat/completions",
            "/v1/chat/completions"
        ]
    );
    // The multi-turn request replays the history as the recorder sent it.
    let recorded = exchanges("multi_turn_stream");
    assert_eq!(
        server.chat_bodies()[1]["messages"],
        recorded[0].request["messages"]
    );
}

fn run_text(text: &str) -> AssistantMessage {
    AssistantMessage::ended(vec![ContentBlock::text(text)], MODEL, "llamacpp", 1)
}

/// The text a recorded stream carried: its `delta.content` pieces in order.
fn recorded_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_string)
        })
        .collect()
}

fn joined(m: &AssistantMessage) -> String {
    harness_types::message::joined_text(&m.content)
}

#[tokio::test]
async fn a_stream_interrupted_before_any_output_is_retried_and_the_retry_is_the_reply() {
    // The first stream: the role chunk, then `[DONE]`; the second request's stream in full.
    let recorded = exchanges("interrupted_before_output");
    assert!(!recorded[0].body.contains("\"content\""));
    let whole = recorded[1].clone();
    let (server, r) = replay(recorded, None).await;
    let run = chat(&r, ask("Count from 1 to 200, one number per line.", 300)).await;
    let done = run.done();
    assert_eq!(done.native_stop_reason.as_deref(), Some("stop"));
    assert_eq!(joined(&done), recorded_text(&whole.body));
    assert_eq!(
        only_chat_requests(&server),
        2,
        "retried once, before any output"
    );
}

// --- 8. small local models that just work (issue 29) -------------------------------------------

/// A loop with the context manager, on the `llamacpp` provider at `url`, whose server runs with
/// a 2,048-token window (what `--context-window 2048` sets).
async fn small_runtime(router: &Router) -> (Harness, SessionStore, tempfile::TempDir) {
    runtime_with_window(router, 2048).await
}

/// [`small_runtime`] with the window the loop is told (`default_context_window`).
async fn runtime_with_window(
    router: &Router,
    window: u64,
) -> (Harness, SessionStore, tempfile::TempDir) {
    let e = embedded().await;
    harness_router::register(e.shared.as_ref(), router);
    harness_context::register(e.shared.clone());
    let harness = start_loop(
        e.shared,
        HarnessConfig {
            default_context_window: window,
            ..config()
        },
    )
    .await;
    (harness, e.sessions, e.dir)
}

async fn send_to(
    harness: &Harness,
    session: Option<&str>,
    text: &str,
    options: SendOptions,
) -> (String, harness_types::api::StatusReport) {
    send_model(harness, MODEL, session, text, options).await
}

/// [`send_to`] naming the model (what the context manager remembers about a server's counts is
/// per provider and model, and tests share a process).
async fn send_model(
    harness: &Harness,
    model: &str,
    session: Option<&str>,
    text: &str,
    options: SendOptions,
) -> (String, harness_types::api::StatusReport) {
    let r = harness
        .send(llamacpp_send(model, session, text, options))
        .await
        .unwrap();
    let s = wait_turn_end(harness, &r.session_id, &r.turn_id).await;
    (r.session_id, s)
}

/// Sends "Say hi." to `model` in `session` and checks that the turn completed: the session goes
/// on after a message it left out.
async fn says_hi(harness: &Harness, model: &str, session: &str) {
    let (_, s) = send_model(
        harness,
        model,
        Some(session),
        "Say hi.",
        SendOptions::default(),
    )
    .await;
    assert_eq!(s.status, TurnStatus::Completed, "{s:?}");
}

#[tokio::test]
async fn the_server_counts_the_tokens_and_one_oversized_first_message_does_not_stick_to_the_session(
) {
    let mut recorded = exchanges("tokenize_count_short");
    recorded.extend(exchanges("tokenize_count_digits"));
    recorded.extend(exchanges("plain_stream"));
    let counted = &recorded[1];
    assert_eq!(counted.body, r#"{"count":3001}"#);
    assert_eq!(counted.request["input"].as_str(), Some(digits().as_str()));
    let (server, router) = replay(recorded, None).await;
    let (harness, sessions, _dir) = small_runtime(&router).await;

    // The session's first message alone is over the window: refused before any generation,
    // naming its size (the server's count) and the window.
    let (sid, s) = send_to(&harness, None, &digits(), SendOptions::default()).await;
    assert_eq!(s.status, TurnStatus::Failed, "{s:?}");
    let failure = s.failure.clone().expect("a failure");
    let detail = failure.detail.unwrap_or_default();
    assert!(detail.contains("context/message_too_large"), "{detail}");
    assert!(
        detail.contains("~3005 tokens"),
        "the server's 3,001 + framing: {detail}"
    );
    assert!(detail.contains("2048-token window"), "{detail}");
    assert_eq!(
        only_chat_requests(&server),
        0,
        "nothing was sent to the model"
    );
    assert!(server
        .asked()
        .iter()
        .any(|a| a.path == "/extras/tokenize/count" && a.body["input"] == json!(digits())));

    // The next message of the same session goes through without the oversized one, and asks
    // for no more output than the window leaves.
    says_hi(&harness, MODEL, &sid).await;
    assert_asked_without_the_digits(&server.chat_bodies());
    // The message stays in the transcript, marked as left out.
    let entries = sessions.all_entries(&sid, true).unwrap();
    assert!(entries.iter().any(|e| e
        .custom
        .as_ref()
        .is_some_and(|c| c.custom_type == "context_excluded")));
}

#[tokio::test]
async fn without_a_server_count_dense_digits_are_still_counted_as_the_server_would() {
    // A server that cannot count (llama.cpp's `/tokenize` form is not there either): the
    // estimate counts a digit a token, so the message is refused all the same.
    let mut recorded = exchanges("tokenize_llamacpp_form");
    recorded.extend(exchanges("plain_stream"));
    let server = Replay::start(recorded).await;
    let r = uncounted(&format!("{}/v1", server.url));
    let (harness, _sessions, _dir) = small_runtime(&r).await;
    let model = "gemma-3-270m-uncounted";
    let (sid, s) = send_model(&harness, model, None, &digits(), SendOptions::default()).await;
    assert_eq!(s.status, TurnStatus::Failed, "{s:?}");
    let detail = s.failure.unwrap().detail.unwrap_or_default();
    assert!(detail.contains("context/message_too_large"), "{detail}");
    assert!(server.asked().iter().all(|a| !a.path.contains("tokenize")));
    says_hi(&harness, model, &sid).await;
}

#[tokio::test]
async fn llama_cpp_s_tokenize_form_is_tried_when_llama_cpp_python_s_is_not_there() {
    // Recorded from llama-cpp-python: it has no `/tokenize`, so the provider says it cannot
    // count (and asks no more), rather than guessing.
    let mut recorded = exchanges("tokenize_llamacpp_form");
    assert_eq!(recorded[0].status, 404);
    recorded.insert(0, recorded[0].clone());
    recorded[0].path = "/extras/tokenize/count".into();
    let (server, r) = replay(recorded, None).await;
    // Asked with no texts: whether it can count (the preset says so until the server says not).
    let probe = r.count_tokens(Some("llamacpp"), MODEL, &[]).await;
    assert_eq!(probe.counts, Some(vec![]));
    let texts = vec!["Say hi.".to_string()];
    let answer = r.count_tokens(Some("llamacpp"), MODEL, &texts).await;
    assert_eq!(answer.counts, None);
    let probe = r.count_tokens(Some("llamacpp"), MODEL, &[]).await;
    assert_eq!(probe.counts, None, "known not to count now");
    let paths: Vec<String> = server.asked().into_iter().map(|a| a.path).collect();
    assert_eq!(paths, ["/extras/tokenize/count", "/tokenize"]);
    r.count_tokens(Some("llamacpp"), MODEL, &texts).await;
    assert_eq!(
        server.asked().len(),
        2,
        "a server that cannot count is not asked again"
    );
}

#[tokio::test]
async fn llama_cpp_python_counts_with_its_own_tokenizer() {
    let mut recorded = exchanges("tokenize_count_short");
    recorded.extend(exchanges("tokenize_count_digits"));
    let (_server, r) = replay(recorded, None).await;
    let answer = r
        .count_tokens(Some("llamacpp"), MODEL, &["Say hi.".into(), digits()])
        .await;
    assert_eq!(answer.counts, Some(vec![4, 3001]));
    assert_eq!(answer.counter.as_deref(), Some("server:llamacpp"));
}

#[tokio::test]
async fn a_prompt_over_the_window_answered_200_with_nothing_is_an_overflow() {
    let recorded = exchanges("digits_overflow_stream");
    assert_eq!((recorded[0].status, recorded[0].body.as_str()), (200, ""));
    let (server, r) = replay(recorded, None).await;
    let run = chat(&r, ask(&digits(), 64)).await;
    let (_, kind, _) = run.error();
    assert_eq!(kind, ErrorKind::ContextOverflow);
    assert_eq!(only_chat_requests(&server), 1, "not retried");
}

#[tokio::test]
async fn a_tool_choice_that_names_no_offered_function_is_refused_before_any_request() {
    let (server, r) = replay(exchanges("tools_forced_stream"), None).await;
    let mut req = ask("What is 2 + 3? Use the tool.", 64);
    req.tools = vec![add_tool()];
    req.provider_options = Some(
        json!({"llamacpp": {"tool_choice": {"type": "function", "function": {"name": "fs:read"}}}}),
    );
    let run = chat(&r, req.clone()).await;
    let (_, kind, detail) = run.error();
    assert_eq!(kind, ErrorKind::Permanent);
    assert!(
        detail.contains("'fs:read'") && detail.contains("offered: math::add"),
        "{detail}"
    );
    assert!(!detail.contains("context"), "{detail}");
    assert_eq!(
        run.ack.error.as_ref().unwrap().code,
        "router/invalid_tool_choice"
    );
    assert_eq!(only_chat_requests(&server), 0);
    // Naming the offered one goes through.
    req.provider_options = Some(
        json!({"llamacpp": {"tool_choice": {"type": "function", "function": {"name": "math__add"}}}}),
    );
    chat(&r, req).await.done();
    assert_eq!(only_chat_requests(&server), 1);
}

#[tokio::test]
async fn an_output_contract_on_the_llamacpp_preset_is_grammar_constrained_json() {
    let recorded = exchanges("json_object_schema_stream");
    let schema = recorded[0].request["response_format"]["schema"].clone();
    let (server, router) = replay(recorded.clone(), None).await;
    let (harness, _sessions, _dir) = small_runtime(&router).await;
    let (_, s) = send_to(
        &harness,
        None,
        "Give the capital of France and its population in millions.",
        SendOptions {
            output: Some(harness_types::api::OutputContract::Json {
                schema: Some(schema.clone()),
            }),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(s.status, TurnStatus::Completed, "{s:?}");
    let result = s.result.expect("a result");
    assert!(
        result["capital"].is_string() && result["population_millions"].is_number(),
        "{result}"
    );
    let bodies = server.chat_bodies();
    assert_eq!(bodies.len(), 1, "valid at the first generation");
    // The form llama-cpp-python takes, and no `submit_result` tool.
    assert_eq!(
        bodies[0]["response_format"],
        json!({"type": "json_object", "schema": schema})
    );
    assert!(bodies[0].get("tools").is_none(), "{}", bodies[0]);
}

#[tokio::test]
async fn llama_cpp_python_refuses_openai_s_json_schema_form() {
    // Why the preset sends `json_object` + `schema`: the recorded answer to OpenAI's form.
    let server = Replay::start(exchanges("json_schema_rejected")).await;
    let r = llamacpp(
        &format!("{}/v1", server.url),
        Some(WirePatch {
            json_schema: Some(harness_router::providers::JsonSchemaForm::Catalog),
            ..WirePatch::default()
        }),
    );
    let mut req = ask(
        "Give the capital of France and its population in millions.",
        64,
    );
    req.response_format = Some(json!({"type": "json", "schema": {"type": "object"}}));
    let run = chat(&r, req).await;
    let (_, kind, detail) = run.error();
    assert_eq!(kind, ErrorKind::Permanent, "{detail}");
    assert!(detail.contains("json_object"), "{detail}");
    assert_eq!(
        server.chat_bodies()[0]["response_format"]["type"],
        "json_schema"
    );
}

#[tokio::test]
async fn two_sessions_at_once_on_the_llamacpp_preset_take_turns() {
    let mut recorded = exchanges("plain_stream");
    recorded.extend(exchanges("multi_turn_stream"));
    let pace = Duration::from_millis(15);
    let server = Replay::start_paced(recorded.clone(), pace).await;
    let r = llamacpp(&format!("{}/v1", server.url), None);
    let (a, b) = tokio::join!(
        chat(&r, ask("Say hello.", 64)),
        chat(&r, ask("Say hello.", 64))
    );
    a.done();
    b.done();
    assert_eq!(only_chat_requests(&server), 2);
    assert_eq!(
        server.most_at_once(),
        1,
        "the preset sends one request at a time"
    );

    // The same two without the limit overlap on the server (what cut each other's streams).
    let server = Replay::start_paced(recorded, pace).await;
    let router = llamacpp_with(&format!("{}/v1", server.url), |cfg| cfg.concurrency = None);
    let (a, b) = tokio::join!(
        chat(&router, ask("Say hello.", 64)),
        chat(&router, ask("Say hello.", 64))
    );
    a.done();
    b.done();
    assert_eq!(server.most_at_once(), 2);
}

#[tokio::test]
async fn a_generation_waiting_for_its_turn_can_be_aborted() {
    let server = Replay::start_paced(exchanges("plain_stream"), Duration::from_millis(20)).await;
    let r = llamacpp(&format!("{}/v1", server.url), None);
    let first = chat(&r, ask("Say hello.", 64));
    let mut second = ask("Say hello.", 64);
    second.request_id = "waiting".into();
    let r2 = r.clone();
    let waiting = async move {
        // Aborted while the first holds the server's one slot.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !r2.abort("waiting") {
            assert!(
                Instant::now() < deadline,
                "the second request never started waiting"
            );
            tokio::task::yield_now().await;
        }
    };
    let (a, b, ()) = tokio::join!(first, chat(&r, second), waiting);
    a.done();
    assert_eq!(b.done().stop_reason, StopReason::Aborted);
    assert_eq!(
        only_chat_requests(&server),
        1,
        "the aborted one was never sent"
    );
}

#[tokio::test]
async fn the_provider_row_says_how_tokens_are_counted_and_how_many_requests_go_at_once() {
    let r = llamacpp("http://127.0.0.1:9/v1", None);
    let listed = r.list_models(None).await.unwrap();
    let row = &listed["provider_details"][0];
    assert_eq!(row["id"], "llamacpp");
    assert_eq!(row["token_counter"], "server");
    assert_eq!(row["tokenize"], "llamacpp");
    assert_eq!(row["json_schema"], "json_object_schema");
    assert_eq!(row["concurrency"], 1);
    let ollama = Router::new();
    ollama.add_provider(
        ProviderConfig::new(
            "ollama",
            ProviderKind::OpenaiCompatible,
            "http://127.0.0.1:9/v1",
            None,
        )
        .build(),
    );
    let listed = ollama.list_models(None).await.unwrap();
    let row = &listed["provider_details"][0];
    assert_eq!(row["token_counter"], "estimate");
    assert_eq!(row["concurrency"], Value::Null);
}

/// "Say hello." to `model` on a 2,048-token window, at a server that cannot count tokens and
/// answers with `recorded`: the server, the sessions, the session id, the turn's end, and the
/// directory holding the store.
async fn say_hello_uncounted(
    recorded: Vec<Exchange>,
    model: &str,
) -> (
    Replay,
    SessionStore,
    String,
    StatusReport,
    tempfile::TempDir,
) {
    let server = Replay::start(recorded).await;
    let router = uncounted(&format!("{}/v1", server.url));
    let (harness, sessions, dir) = small_runtime(&router).await;
    let (sid, s) = send_model(&harness, model, None, "Say hello.", SendOptions::default()).await;
    (server, sessions, sid, s, dir)
}

#[tokio::test]
async fn a_prompt_the_server_refuses_as_over_its_window_is_reassembled_and_asked_once_more() {
    // A server whose tokens nothing here can count, answering the first request as
    // llama-cpp-python answers a prompt over its window (200, empty body), the second in full.
    let mut recorded = exchanges("digits_overflow_stream");
    recorded.extend(exchanges("plain_stream"));
    let text = recorded_text(&recorded[1].body);
    let (server, sessions, sid, s, _dir) =
        say_hello_uncounted(recorded, "gemma-3-270m-refused-once").await;
    assert_eq!(s.status, TurnStatus::Completed, "{s:?}");
    let bodies = server.chat_bodies();
    assert_eq!(bodies.len(), 2, "asked once more, not more");
    // The second request leaves more of the window unasked for output: the count was low.
    let (first, second) = (
        bodies[0]["max_tokens"].as_u64().unwrap(),
        bodies[1]["max_tokens"].as_u64().unwrap(),
    );
    assert!(second < first, "max_tokens {first} then {second}");
    let replies = replies(&sessions, &sid);
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_eq!(joined(&replies[0]), text);
}

#[tokio::test]
async fn a_second_refusal_fails_the_turn_as_an_overflow() {
    let mut recorded = exchanges("digits_overflow_stream");
    recorded.extend(exchanges("digits_overflow_stream"));
    recorded.extend(exchanges("plain_stream"));
    let (server, sessions, sid, s, _dir) =
        say_hello_uncounted(recorded, "gemma-3-270m-refused-twice").await;
    assert_eq!(s.status, TurnStatus::Failed, "{s:?}");
    let failure = s.failure.unwrap();
    assert_eq!(
        failure.kind,
        Some(ErrorKind::ContextOverflow),
        "{failure:?}"
    );
    assert_eq!(server.chat_bodies().len(), 2, "one retry only");
    // "Say hello." is a sliver of the refused request (the system prompt is most of it): it
    // is not the message to blame, and stays.
    let entries = sessions.all_entries(&sid, true).unwrap();
    assert!(!entries.iter().any(|e| e
        .custom
        .as_ref()
        .is_some_and(|c| c.custom_type == "context_excluded")));
}

#[tokio::test]
async fn a_message_the_server_refuses_twice_under_an_unknown_window_is_left_out_and_the_session_goes_on(
) {
    // Nobody told the loop the window (the shipped default), and the server cannot count: the
    // dense message goes out, is refused (recorded), reassembled, refused again.
    let mut recorded = exchanges("digits_overflow_stream");
    recorded.extend(exchanges("digits_overflow_stream"));
    recorded.extend(exchanges("plain_stream"));
    let server = Replay::start(recorded).await;
    let router = uncounted(&format!("{}/v1", server.url));
    let (harness, _sessions, _dir) = runtime_with_window(&router, 200_000).await;
    let model = "gemma-3-270m-unknown-window";
    let (sid, s) = send_model(&harness, model, None, &digits(), SendOptions::default()).await;
    assert_eq!(s.status, TurnStatus::Failed, "{s:?}");
    assert_eq!(s.failure.unwrap().kind, Some(ErrorKind::ContextOverflow));
    assert_eq!(server.chat_bodies().len(), 2);
    says_hi(&harness, model, &sid).await;
    let bodies = server.chat_bodies();
    assert_eq!(bodies.len(), 3);
    let sent = bodies[2]["messages"].to_string();
    assert!(
        !sent.contains(&digits()[..64]),
        "the refused message was sent again"
    );
    assert!(sent.contains("Say hi."));
}
