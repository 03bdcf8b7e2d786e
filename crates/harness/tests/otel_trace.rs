//! One OpenTelemetry trace per turn, exported over OTLP/HTTP (protobuf) by a real `harness
//! serve` to an in-test receiver that decodes `ExportTraceServiceRequest` with
//! `opentelemetry-proto` (the exporter's own proto crate): span tree, parent links, GenAI
//! attributes, error stamping through a sub-agent, the caller's `traceparent`, no span built
//! without an endpoint, and no message content on any span.
//!
//! `otel_python_receiver` repeats scenarios 1, 3 and 5 against an independent decoder (the
//! official Python bindings, `tests/otlp/recv.py`) when `HARNESS_OTLP_PYTHON` names a Python
//! that has `opentelemetry-proto` installed (CI sets it).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use common::*;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use prost::Message;
use serde_json::{json, Value};

/// One decoded span, flattened.
#[derive(Clone, Debug)]
struct Got {
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: i32,
    start: u64,
    end: u64,
    attrs: HashMap<String, Value>,
    /// 0 unset, 1 ok, 2 error.
    status: i32,
    events: Vec<String>,
    service: String,
    /// (trace id, span id) of each link.
    links: Vec<(String, String)>,
}

impl Got {
    fn attr(&self, k: &str) -> &Value {
        self.attrs.get(k).unwrap_or(&Value::Null)
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn any(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> Value {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(Any::StringValue(s)) => json!(s),
        Some(Any::IntValue(i)) => json!(i),
        Some(Any::DoubleValue(f)) => json!(f),
        Some(Any::BoolValue(b)) => json!(b),
        Some(Any::ArrayValue(a)) => {
            Value::Array(a.values.iter().map(|x| any(&Some(x.clone()))).collect())
        }
        _ => Value::Null,
    }
}

/// The in-test OTLP/HTTP receiver: `POST /v1/traces` on 127.0.0.1.
struct Receiver {
    url: String,
    spans: Arc<Mutex<Vec<Got>>>,
    requests: Arc<Mutex<usize>>,
}

impl Receiver {
    async fn start() -> Receiver {
        type St = (Arc<Mutex<Vec<Got>>>, Arc<Mutex<usize>>);
        async fn traces(State((spans, requests)): State<St>, body: Bytes) -> Vec<u8> {
            *requests.lock().unwrap() += 1;
            let req = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf body");
            let mut out = spans.lock().unwrap();
            for rs in req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| r.attributes.iter().find(|a| a.key == "service.name"))
                    .map(|a| any(&a.value).as_str().unwrap_or("").to_string())
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for s in ss.spans {
                        out.push(Got {
                            trace_id: hex(&s.trace_id),
                            span_id: hex(&s.span_id),
                            parent: hex(&s.parent_span_id),
                            name: s.name.clone(),
                            kind: s.kind,
                            start: s.start_time_unix_nano,
                            end: s.end_time_unix_nano,
                            attrs: s
                                .attributes
                                .iter()
                                .map(|a| (a.key.clone(), any(&a.value)))
                                .collect(),
                            status: s.status.as_ref().map_or(0, |st| st.code),
                            events: s.events.iter().map(|e| e.name.clone()).collect(),
                            service: service.clone(),
                            links: s
                                .links
                                .iter()
                                .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                                .collect(),
                        });
                    }
                }
            }
            ExportTraceServiceResponse::default().encode_to_vec()
        }
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(0));
        let app = axum::Router::new()
            .route("/v1/traces", post(traces))
            .with_state((spans.clone(), requests.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Receiver {
            url,
            spans,
            requests,
        }
    }

    fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until the turn span of `session_id` arrived (exported last, at finalize).
    async fn turn_span(&self, session_id: &str) -> Got {
        wait_for(&format!("the turn span of {session_id}"), WAIT, || async {
            self.spans().into_iter().find(|s| {
                s.name.starts_with("invoke_agent") && s.attr("iii.session.id") == session_id
            })
        })
        .await
    }

    /// [`Receiver::turn_span`], then every span of its trace.
    async fn trace_of(&self, session_id: &str) -> Vec<Got> {
        let turn = self.turn_span(session_id).await;
        self.spans()
            .into_iter()
            .filter(|s| s.trace_id == turn.trace_id)
            .collect()
    }
}

fn one<'a>(spans: &'a [Got], pred: impl Fn(&Got) -> bool, what: &str) -> &'a Got {
    let found: Vec<&Got> = spans.iter().filter(|s| pred(s)).collect();
    assert_eq!(found.len(), 1, "exactly one {what} in {:#?}", names(spans));
    found[0]
}

/// The one `harness::spawn` call span.
fn spawn_span(spans: &[Got]) -> &Got {
    one(
        spans,
        |s| s.name == "execute_tool harness::spawn",
        "spawn span",
    )
}

fn names(spans: &[Got]) -> Vec<String> {
    spans
        .iter()
        .map(|s| format!("{} {}<-{}", s.name, s.span_id, s.parent))
        .collect()
}

/// Every child starts no earlier and ends no later than its parent (ms precision).
fn assert_nested(spans: &[Got]) {
    let by_id: HashMap<&str, &Got> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    for s in spans {
        assert!(s.end >= s.start, "{} ends before it starts", s.name);
        if s.name.starts_with("execute_tool") {
            // A call that waits (a spawn) may end after the step that dispatched it.
            continue;
        }
        if let Some(p) = by_id.get(s.parent.as_str()) {
            assert!(
                s.start >= p.start && s.end <= p.end,
                "{} [{}, {}] is not inside its parent {} [{}, {}]",
                s.name,
                s.start,
                s.end,
                p.name,
                p.start,
                p.end
            );
        }
    }
}

async fn metric(server: &Server, name: &str) -> f64 {
    let body = reqwest::get(format!("{}/metrics", server.url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{body}"))
        .trim()
        .parse()
        .unwrap()
}

const USER_TEXT: &str = "check the weather in Trondheim";
const REPLY: &str = "It is sunny in Trondheim today.";

fn forecast_fixture() -> Fixtures {
    Fixtures::new(json!([{"id": "fx::forecast", "response": {"sky": "sunny-fixture-result"}}]))
}

/// `harness serve` with the forecast fixture and the weather model, exporting to `otlp`. The
/// fixtures are returned because they live as long as the server needs them.
async fn weather_server(otlp: &str) -> (Fixtures, Server) {
    let fx = forecast_fixture();
    let mut extra = fx.args();
    extra.extend(["--otlp-endpoint".to_string(), otlp.to_string()]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(
        &weather_script("Trondheim-secret-arg", vec![], REPLY),
        &extra,
    )
    .await;
    (fx, server)
}

/// Runs [`weather_turn`] and returns the trace `rx` received for it.
async fn weather_trace(rx: &Receiver, server: &Server, session_id: &str) -> Vec<Got> {
    weather_turn(server, session_id).await;
    rx.trace_of(session_id).await
}

async fn weather_turn(server: &Server, session_id: &str) {
    let s = server
        .send_and_wait(
            json!({"session_id": session_id, "message": USER_TEXT, "model": "demo", "provider": "scripted",
                   "options": {"functions": {"allow": ["fx::*"], "expose": "native"}}}),
        )
        .await;
    assert_eq!(s["status"], "completed", "{s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_turn_with_a_call_is_one_trace_of_steps_generations_and_the_call() {
    let rx = Receiver::start().await;
    let (_fx, server) = weather_server(&rx.url).await;
    let spans = weather_trace(&rx, &server, "s_weather").await;

    let turn = one(&spans, |s| s.name == "invoke_agent harness", "turn span");
    assert_eq!(turn.parent, "", "the turn is the root");
    assert_eq!(turn.service, "harness");
    assert_eq!(turn.attr("gen_ai.operation.name"), "invoke_agent");
    assert_eq!(turn.attr("gen_ai.conversation.id"), "s_weather");
    assert_eq!(turn.attr("harness.turn.status"), "completed");
    assert_eq!(turn.attr("harness.turn.steps"), 2);
    assert_eq!(turn.attr("gen_ai.usage.input_tokens"), 42 + 61);
    assert_eq!(turn.status, 0, "nothing failed");
    let steps: Vec<&Got> = spans
        .iter()
        .filter(|s| s.name.starts_with("harness.step "))
        .collect();
    assert_eq!(steps.len(), 2, "{:#?}", names(&spans));
    for (n, step) in [0, 1].iter().zip([0, 1]) {
        let st = one(
            &spans,
            |s| s.name == format!("harness.step {n}"),
            "step span",
        );
        assert_eq!(st.parent, turn.span_id);
        assert_eq!(st.attr("harness.step.index"), step);
        let chat = one(
            &spans,
            |s| s.name == "chat demo" && s.parent == st.span_id,
            "chat span of the step",
        );
        assert_eq!(chat.attr("gen_ai.provider.name"), "scripted");
        assert_eq!(chat.attr("gen_ai.request.model"), "demo");
        assert_eq!(chat.kind, 1, "INTERNAL for the scripted provider");
        one(
            &spans,
            |s| s.name == "harness.context.assemble" && s.parent == st.span_id,
            "context span of the step",
        );
    }
    // The generations carry the usage the transcript recorded.
    let transcript = server.transcript("s_weather", false).await;
    let recorded: Vec<i64> = transcript
        .iter()
        .filter(|e| e["message"]["role"] == "assistant")
        .map(|e| e["message"]["usage"]["input"].as_i64().unwrap())
        .collect();
    let mut exported: Vec<i64> = spans
        .iter()
        .filter(|s| s.name == "chat demo")
        .map(|s| s.attr("gen_ai.usage.input_tokens").as_i64().unwrap())
        .collect();
    exported.sort();
    let mut recorded_sorted = recorded.clone();
    recorded_sorted.sort();
    assert_eq!(exported, recorded_sorted);
    assert_eq!(recorded_sorted, vec![42, 61]);
    let step0 = one(&spans, |s| s.name == "harness.step 0", "step 0");
    let call = one(
        &spans,
        |s| s.name == "execute_tool fx::forecast",
        "call span",
    );
    assert_eq!(call.parent, step0.span_id);
    assert_eq!(call.attr("gen_ai.tool.call.id"), "c1");
    assert_eq!(call.attr("harness.call.outcome"), "ok");
    assert_eq!(spans.len(), 1 + 2 + 2 + 2 + 1, "{:#?}", names(&spans));
    assert!(spans.iter().all(|s| s.trace_id == turn.trace_id));
    assert_nested(&spans);
    assert!(metric(&server, "harness_otel_spans_built_total").await >= 8.0);
    // harness::metrics counts the same tree from the transcript, exporter or not.
    let m = server
        .ok("harness::metrics", json!({"root_session_id": "s_weather"}))
        .await;
    assert_eq!(m["traces"]["trace_count"], 1, "{m}");
    assert_eq!(m["traces"]["span_count"], spans.len(), "{m}");
    assert_eq!(m["traces"]["error_span_count"], 0, "{m}");
}

/// A bound hook's call is a `harness.hook {point}` span of the step it ran in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_call_is_a_span_of_its_step_with_its_decision() {
    let rx = Receiver::start().await;
    let fx = Fixtures::new(json!([
        {"id": "fx::forecast", "response": {"sky": "sunny"}},
        {"id": "hook::allow", "response": {"decision": "continue"}}
    ]));
    let mut extra = fx.args();
    extra.extend(["--otlp-endpoint".to_string(), rx.url.clone()]);
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(
        &weather_script("Trondheim-secret-arg", vec![], REPLY),
        &extra,
    )
    .await;
    server
        .ok(
            "engine::register_trigger",
            json!({"trigger_type": "harness::hook::pre-trigger", "function_id": "hook::allow",
                   "config": {"functions": ["fx::*"]}}),
        )
        .await;
    let spans = weather_trace(&rx, &server, "s_hooked").await;
    let step0 = one(&spans, |s| s.name == "harness.step 0", "step 0");
    let hook = one(&spans, |s| s.name.starts_with("harness.hook "), "hook span");
    assert_eq!(hook.parent, step0.span_id);
    assert_eq!(hook.attr("harness.hook.function"), "hook::allow");
    assert_eq!(hook.attr("harness.hook.decision"), "continue");
    assert_eq!(hook.status, 0);
    assert!(hook.start >= step0.start && hook.end <= step0.end);
}

/// Scenario 7: no attribute anywhere carries the user's text, the reply or the call's
/// arguments and result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_span_carries_message_text_arguments_or_results() {
    let rx = Receiver::start().await;
    let (_fx, server) = weather_server(&rx.url).await;
    let spans = weather_trace(&rx, &server, "s_content").await;
    assert!(spans.len() >= 8);
    let dump = format!("{spans:?}");
    for needle in [
        "Trondheim",
        "sunny",
        "secret-arg",
        "fixture-result",
        USER_TEXT,
        REPLY,
    ] {
        assert!(!dump.contains(needle), "'{needle}' leaked into a span");
    }
}

fn spawn_script(child_fails: bool) -> Value {
    let child = if child_fails {
        json!({"match": {"last_user_text": "^find flights"},
               "error": {"kind": "permanent", "message": "the flight search is broken"}, "repeat": true})
    } else {
        text_gen(Some("^find flights"), "Flight AB123", 0, true)
    };
    script(vec![
        json!({"match": {"last_user_text": "^plan the trip"},
               "content": [{"type": "function_call", "id": "s1", "function_id": "harness::spawn",
                            "arguments": {"task": "find flights to Oslo"}}]}),
        child,
        text_gen(None, "Booked", 0, true),
    ])
}

async fn plan_trip(server: &Server, session_id: &str) -> Value {
    server
        .send_and_wait(
            json!({"session_id": session_id, "message": "plan the trip", "model": "demo", "provider": "scripted",
                   "options": {"functions": {"allow": ["harness::spawn"], "expose": "native"}}}),
        )
        .await
}

/// The session `session_id` spawned (the first child of its tree).
async fn child_session(server: &Server, session_id: &str) -> String {
    let tree = server
        .ok("harness::session-tree", json!({ "session_id": session_id }))
        .await;
    tree["children"][0]["session_id"]
        .as_str()
        .expect("one child session")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_spawn_puts_the_child_turn_under_the_spawn_span_in_the_same_trace() {
    let rx = Receiver::start().await;
    let server = Server::start(&spawn_script(false), &["--otlp-endpoint", &rx.url]).await;
    let s = plan_trip(&server, "s_trip").await;
    assert_eq!(s["status"], "completed", "{s}");
    let child = child_session(&server, "s_trip").await;
    let spans = rx.trace_of("s_trip").await;
    let root = one(
        &spans,
        |s| s.name == "invoke_agent harness" && s.attr("iii.session.id") == "s_trip",
        "root turn",
    );
    let spawn = spawn_span(&spans);
    let child_turn = rx.turn_span(&child).await;
    assert_eq!(child_turn.trace_id, root.trace_id, "one trace for the tree");
    assert_eq!(
        child_turn.parent, spawn.span_id,
        "the child hangs under the spawn"
    );
    assert_ne!(
        child_turn.attr("iii.session.id"),
        root.attr("iii.session.id")
    );
    assert_eq!(child_turn.attr("harness.parent.session_id"), "s_trip");
    assert_eq!(child_turn.attr("harness.turn.depth"), 1);
    assert_eq!(
        child_turn.attr("harness.parent_already_ended"),
        &Value::Null
    );
    assert!(child_turn.links.is_empty());
    assert_eq!(root.status, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_child_stamps_its_spawn_the_parent_step_and_the_root_as_errors() {
    let rx = Receiver::start().await;
    let server = Server::start(&spawn_script(true), &["--otlp-endpoint", &rx.url]).await;
    let s = plan_trip(&server, "s_broken").await;
    let child = child_session(&server, "s_broken").await;
    let child_status = server.status(&child).await;
    assert_eq!(child_status["status"], "failed", "{child_status}");
    let code = child_status["failure"]["code"]
        .as_str()
        .expect("the child's failure code")
        .to_string();
    let spans = rx.trace_of("s_broken").await;
    let root = one(
        &spans,
        |s| s.name == "invoke_agent harness" && s.attr("iii.session.id") == "s_broken",
        "root turn",
    );
    let child_turn = one(
        &spans,
        |s| s.name == "invoke_agent harness" && s.attr("iii.session.id") == child.as_str(),
        "child turn",
    );
    let spawn = spawn_span(&spans);
    let step = spans
        .iter()
        .find(|s| s.span_id == spawn.parent)
        .expect("the spawn's step");
    for (what, span) in [
        ("child turn", child_turn),
        ("spawn", spawn),
        ("parent step", step),
        ("root turn", root),
    ] {
        assert_eq!(span.status, 2, "{what} is ERROR: {span:?}");
        assert_eq!(span.attr("error.type"), code.as_str(), "{what}: {span:?}");
        assert!(span.events.iter().any(|e| e == "exception"), "{what}");
    }
    // The root keeps what the parent turn itself did.
    assert_eq!(
        root.attr("harness.turn.status"),
        s["status"].as_str().unwrap()
    );
    assert_eq!(root.attr("harness.turn.status"), "completed");
    assert!(
        root.attr("harness.trace.error_span_count")
            .as_i64()
            .unwrap()
            >= 2
    );
    // The child's failing generation carries the router's kind.
    let chat = one(
        &spans,
        |s| s.name == "chat demo" && s.parent != step.span_id && s.status == 2,
        "the child's failed generation",
    );
    assert_eq!(chat.attr("error.type"), "permanent");
    // harness::metrics counts the same spans and errors over the tree.
    let m = server
        .ok("harness::metrics", json!({"root_session_id": "s_broken"}))
        .await;
    let errors = spans.iter().filter(|s| s.status == 2).count();
    assert_eq!(m["traces"]["trace_count"], 1, "{m}");
    assert_eq!(m["traces"]["span_count"], spans.len(), "{m}");
    assert_eq!(m["traces"]["error_span_count"], errors, "{m}");
}

/// A detached child that fails after its parent's turn ended cannot restamp the parent's
/// exported spans: it says so, and links the spawn span.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_child_failing_after_its_parent_ended_links_the_spawn_instead() {
    let rx = Receiver::start().await;
    let script = script(vec![
        json!({"match": {"last_user_text": "^fire and forget"},
               "content": [{"type": "function_call", "id": "s1", "function_id": "harness::spawn",
                            "arguments": {"task": "slow child work", "options": {"detach": true}}}]}),
        json!({"match": {"last_user_text": "^slow child"}, "delay_ms": 1500,
               "error": {"kind": "permanent", "message": "gave up"}, "repeat": true}),
        text_gen(None, "Started it.", 0, true),
    ]);
    let server = Server::start(&script, &["--otlp-endpoint", &rx.url]).await;
    let s = server
        .send_and_wait(
            json!({"session_id": "s_detached", "message": "fire and forget", "model": "demo", "provider": "scripted",
                   "options": {"functions": {"allow": ["harness::spawn"], "expose": "native"}}}),
        )
        .await;
    assert_eq!(s["status"], "completed", "{s}");
    let child = child_session(&server, "s_detached").await;
    let spans = rx.trace_of("s_detached").await;
    let root = one(
        &spans,
        |s| s.attr("iii.session.id") == "s_detached" && s.name.starts_with("invoke_agent"),
        "root",
    );
    assert_eq!(root.status, 0, "the parent ended before the child failed");
    let spawn = spawn_span(&spans);
    let child_turn = rx.turn_span(&child).await;
    assert_eq!(child_turn.status, 2, "{child_turn:?}");
    assert_eq!(child_turn.parent, spawn.span_id);
    assert_eq!(child_turn.attr("harness.parent_already_ended"), true);
    assert_eq!(
        child_turn.links,
        vec![(root.trace_id.clone(), spawn.span_id.clone())]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_traceparent_is_the_turns_parent_and_a_malformed_one_is_ignored() {
    let rx = Receiver::start().await;
    let server = Server::start(
        &script(vec![text_gen(None, "hello back", 0, true)]),
        &["--otlp-endpoint", &rx.url],
    )
    .await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent = "00f067aa0ba902b7";
    for (session, header) in [
        ("s_traced", format!("00-{trace}-{parent}-01")),
        ("s_garbled", "00-not-a-trace-01".to_string()),
    ] {
        let resp = server
            .client
            .post(format!("{}/v1/functions/harness::send", server.url()))
            .header("content-type", "application/json")
            .header("traceparent", header)
            .body(
                json!({"session_id": session, "message": "hello", "model": "demo", "provider": "scripted"})
                    .to_string(),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(
            resp.status(),
            200,
            "a malformed traceparent is not an error"
        );
        let sent: Value = resp.json().await.unwrap();
        server
            .wait_turn(session, sent["turn_id"].as_str().unwrap())
            .await;
    }
    let traced = rx.trace_of("s_traced").await;
    let turn = one(&traced, |s| s.name.starts_with("invoke_agent"), "turn");
    assert_eq!(turn.trace_id, trace);
    assert_eq!(turn.parent, parent);
    let garbled = rx.trace_of("s_garbled").await;
    let turn = one(&garbled, |s| s.name.starts_with("invoke_agent"), "turn");
    assert_ne!(turn.trace_id, trace);
    assert_eq!(turn.parent, "", "a new root trace");
}

/// Scenario 6: with no endpoint nothing builds a span: 50 turns, the process's span counter
/// stays 0 and the receiver (listening, but named nowhere) hears nothing. The same holds with
/// an endpoint when `OTEL_SDK_DISABLED=true`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_fifty_turns_build_no_span() {
    let rx = Receiver::start().await;
    let mut server = Server::start(&script(vec![text_gen(None, "ok", 0, true)]), &[]).await;
    for i in 0..50 {
        let session = format!("s_quiet_{i}");
        let sent = server.send(Some(&session), "hello").await;
        server
            .wait_turn(&session, sent["turn_id"].as_str().unwrap())
            .await;
    }
    assert_eq!(metric(&server, "harness_otel_spans_built_total").await, 0.0);
    assert_eq!(
        metric(
            &server,
            "harness_turns_completed_total{reason=\"none\",status=\"completed\"}"
        )
        .await,
        50.0,
        "the turns ran and were counted"
    );
    server.set_env("OTEL_SDK_DISABLED", Some("true"));
    server.set_extra(&["--otlp-endpoint", &rx.url]);
    server.restart().await;
    let sent = server.send(Some("s_disabled"), "hello").await;
    server
        .wait_turn("s_disabled", sent["turn_id"].as_str().unwrap())
        .await;
    assert_eq!(metric(&server, "harness_otel_spans_built_total").await, 0.0);
    assert_eq!(
        *rx.requests.lock().unwrap(),
        0,
        "the receiver heard nothing"
    );
    assert!(rx.spans().is_empty());
}

/// Scenario 4: SIGKILL mid-step, restart: the turn is still one trace, its redelivered step
/// says so, and every span's parent is in the trace (the crashed attempt left no span).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_turn_cut_by_sigkill_is_one_trace_with_its_redelivered_step_marked() {
    let rx = Receiver::start().await;
    let (_fx, mut server) = weather_server(&rx.url).await;
    server.set_env("HARNESS_FAILPOINT", Some("after_assistant_appended:1"));
    server.restart().await;
    let (_, turn_id) = server
        .start_turn(
            json!({"session_id": "s_killed", "message": USER_TEXT, "model": "demo", "provider": "scripted",
                   "options": {"functions": {"allow": ["fx::*"], "expose": "native"}}}),
        )
        .await;
    let deadline = Instant::now() + WAIT;
    while !server.exited() {
        assert!(Instant::now() < deadline, "the failpoint did not fire");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    server.set_env("HARNESS_FAILPOINT", None);
    server.start_again().await;
    let s = server.wait_turn("s_killed", &turn_id).await;
    assert_eq!(s["status"], "completed", "{s}");
    let spans = rx.trace_of("s_killed").await;
    let turn = one(&spans, |s| s.name == "invoke_agent harness", "turn span");
    assert!(spans.iter().all(|s| s.trace_id == turn.trace_id));
    let ids: Vec<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    for s in &spans {
        if s.span_id != turn.span_id {
            assert!(
                ids.contains(&s.parent.as_str()),
                "{} has a parent outside the trace",
                s.name
            );
        }
    }
    let step0 = one(&spans, |s| s.name == "harness.step 0", "step 0");
    assert_eq!(step0.attr("harness.step.redelivered"), true, "{step0:?}");
    let step1 = one(&spans, |s| s.name == "harness.step 1", "step 1");
    assert_eq!(step1.attr("harness.step.redelivered"), false, "{step1:?}");
    assert_eq!(
        spans.iter().filter(|s| s.name == "chat demo").count(),
        2,
        "{:#?}",
        names(&spans)
    );
}

/// Scenario 8: with the receiver down, turns still complete, the failure is logged once (not
/// per batch), and the lost spans are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_is_down_costs_a_warning_and_a_count_not_a_turn() {
    // Nobody listens there.
    let down = format!("http://127.0.0.1:{}", free_port());
    let server = Server::start(
        &script(vec![text_gen(None, "ok", 0, true)]),
        &["--otlp-endpoint", &down],
    )
    .await;
    let started = Instant::now();
    // Two rounds, each until every span built is counted lost: at least two failed exports.
    for round in 0..2 {
        for i in 0..10 {
            let session = format!("s_down_{round}_{i}");
            let sent = server.send(Some(&session), "hello").await;
            let s = server
                .wait_turn(&session, sent["turn_id"].as_str().unwrap())
                .await;
            assert_eq!(s["status"], "completed");
        }
        wait_for("every span built counted lost", WAIT, || async {
            let built = metric(&server, "harness_otel_spans_built_total").await;
            let dropped = metric(&server, "harness_otel_spans_dropped_total").await;
            (built >= 4.0 * 10.0 * (round + 1) as f64 && dropped == built).then_some(())
        })
        .await;
    }
    // Generous: each turn takes a few ms; an exporter in the way would cost seconds each.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    let warnings = server.log().matches("OTLP export failed").count();
    assert_eq!(warnings, 1, "{}", server.log());
}

#[test]
fn grpc_is_refused_at_start_naming_http_protobuf() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("OTEL_EXPORTER_OTLP_PROTOCOL") && err.contains("http/protobuf"),
        "{err}"
    );
}

// --- Tier B: an independent decoder ----------------------------------------------------------

/// The Python receiver's JSON lines (one per span, `MessageToDict` of the span).
fn python_spans(path: &std::path::Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn py_attr<'a>(span: &'a Value, key: &str) -> Option<&'a Value> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| &a["value"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_python_receiver() {
    let Some(python) = std::env::var_os("HARNESS_OTLP_PYTHON") else {
        println!(
            "skipped: HARNESS_OTLP_PYTHON is not set (a python with opentelemetry-proto==1.45.2; see crates/harness/tests/otlp/recv.py)"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("spans.jsonl");
    let port = free_port();
    let recv = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/otlp/recv.py");
    let mut child = KillOnDrop(
        std::process::Command::new(&python)
            .arg(recv)
            .arg(port.to_string())
            .arg(&out)
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("start the python receiver"),
    );
    let ready = out.with_extension("ready");
    let deadline = Instant::now() + WAIT;
    while !ready.exists() {
        if let Some(status) = child.0.try_wait().unwrap() {
            panic!("the python receiver exited with {status}");
        }
        assert!(
            Instant::now() < deadline,
            "the python receiver did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let url = format!("http://127.0.0.1:{port}");

    // Scenario 1: a turn with a call.
    let (_fx, server) = weather_server(&url).await;
    weather_turn(&server, "s_py").await;
    let find = |name: &str, session: Option<&str>| {
        python_spans(&out).into_iter().find(|s| {
            s["name"] == name
                && session.is_none_or(|sid| {
                    py_attr(s, "iii.session.id").and_then(|v| v["stringValue"].as_str())
                        == Some(sid)
                })
        })
    };
    let turn = wait_for("the python receiver's turn span", WAIT, || async {
        find("invoke_agent harness", Some("s_py"))
    })
    .await;
    let trace_id = turn["traceId"].as_str().unwrap().to_string();
    let spans: Vec<Value> = python_spans(&out)
        .into_iter()
        .filter(|s| s["traceId"] == trace_id.as_str())
        .collect();
    let chat = spans
        .iter()
        .find(|s| s["name"] == "chat demo")
        .expect("a chat span");
    let step = spans
        .iter()
        .find(|s| s["spanId"] == chat["parentSpanId"])
        .expect("the chat's step");
    assert!(step["name"].as_str().unwrap().starts_with("harness.step "));
    assert_eq!(step["parentSpanId"], turn["spanId"]);
    assert_eq!(
        py_attr(chat, "gen_ai.provider.name").unwrap()["stringValue"],
        "scripted"
    );
    let input: i64 = py_attr(chat, "gen_ai.usage.input_tokens").unwrap()["intValue"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(input > 0);
    drop(server);

    // Scenario 3: a failing child stamps the root.
    let server = Server::start(&spawn_script(true), &["--otlp-endpoint", &url]).await;
    plan_trip(&server, "s_py_broken").await;
    let root = wait_for("the python receiver's failed root", WAIT, || async {
        find("invoke_agent harness", Some("s_py_broken"))
    })
    .await;
    assert_eq!(root["status"]["code"], "STATUS_CODE_ERROR", "{root}");
    assert!(py_attr(&root, "error.type").is_some());
    drop(server);

    // Scenario 5: the caller's traceparent.
    let server = Server::start(
        &script(vec![text_gen(None, "hello back", 0, true)]),
        &["--otlp-endpoint", &url],
    )
    .await;
    let resp = server
        .client
        .post(format!("{}/v1/functions/harness::send", server.url()))
        .header("content-type", "application/json")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .body(json!({"session_id": "s_py_tp", "message": "hello", "model": "demo", "provider": "scripted"}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let turn = wait_for("the python receiver's traced turn", WAIT, || async {
        find("invoke_agent harness", Some("s_py_tp"))
    })
    .await;
    assert_eq!(turn["traceId"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(turn["parentSpanId"], "00f067aa0ba902b7");
}
