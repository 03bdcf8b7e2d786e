//! Function calls through the loop: exposure, repair, breaker, result cap.

mod support;

use std::sync::atomic::Ordering;

use harness_core::{CallReconciliation, HarnessConfig};
use harness_types::api::{ExposeMode, TurnStatus};
use harness_types::message::ContentBlock;
use harness_types::AgentMessage;
use serde_json::{json, Value};
use support::*;

#[tokio::test]
async fn a_deny_all_policy_sends_no_tools_and_agent_trigger_sends_one() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    rt.run(send("plain chat")).await;
    rt.run(allowing_as("with tools", &["*"], ExposeMode::AgentTrigger))
        .await;
    let seen = rt.recorder.seen.lock().unwrap().clone();
    assert!(seen[0].tools.is_empty(), "deny-all: no tools at all");
    assert!(seen[0]
        .system_prompt
        .as_deref()
        .unwrap()
        .contains("Function dispatch is entirely disabled"));
    let names: Vec<&str> = seen[1].tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, vec!["agent_trigger"]);
    assert_eq!(
        seen[1].tools[0].parameters["required"],
        json!(["function", "description"])
    );
}

#[tokio::test]
async fn native_exposure_lists_allowed_functions_sorted_with_their_schemas() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}});
    rt.register("weather::now", Some(schema.clone()), |_| json!({}));
    rt.register("weather::forecast", None, |_| json!({}));
    rt.register("shell::exec", None, |_| json!({}));
    rt.run(allowing_as(
        "tools please",
        &["weather::*", "engine::functions::*"],
        ExposeMode::Native,
    ))
    .await;
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let names: Vec<&str> = seen[0].tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        vec![
            "engine::functions::info",
            "engine::functions::list",
            "weather::forecast",
            "weather::now"
        ]
    );
    let now = seen[0]
        .tools
        .iter()
        .find(|t| t.name == "weather::now")
        .unwrap();
    assert_eq!(now.parameters, schema);
    let forecast = seen[0]
        .tools
        .iter()
        .find(|t| t.name == "weather::forecast")
        .unwrap();
    assert_eq!(forecast.parameters, json!({"type": "object"}));
}

#[tokio::test]
async fn discovery_through_agent_trigger_only_shows_callable_functions() {
    let script = json!({"generations": [
        call_gen("discover", "c1", "agent_trigger", json!({"function": "engine::functions::list", "description": "list", "payload": {}})),
        text_gen("done")
    ]});
    let rt = runtime(script, config()).await;
    rt.register("weather::now", None, |_| json!({}));
    rt.register("shell::exec", None, |_| json!({}));
    let (r, _) = rt
        .run(allowing_as(
            "discover",
            &["weather::*", "engine::functions::*"],
            ExposeMode::AgentTrigger,
        ))
        .await;
    let result = &rt.results(&r.session_id)[0];
    let ids = strings(&result.details["functions"], "function_id");
    assert_eq!(
        ids,
        vec![
            "engine::functions::info",
            "engine::functions::list",
            "weather::now"
        ]
    );
}

#[tokio::test]
async fn stringified_json_arguments_are_repaired_and_the_repair_is_noted() {
    let script = json!({"generations": [
        call_gen("sum", "c1", "math::sum", json!({"numbers": "[1, 2, 3]"})),
        text_gen("6")
    ]});
    let cfg = HarnessConfig {
        call_reconciliation: CallReconciliation::Coerce,
        ..config()
    };
    let rt = runtime(script, cfg).await;
    let schema = json!({"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}}, "required": ["numbers"]});
    let got = std::sync::Arc::new(std::sync::Mutex::new(Value::Null));
    let seen = got.clone();
    rt.register("math::sum", Some(schema), move |p| {
        *seen.lock().unwrap() = p.clone();
        json!({"sum": p["numbers"].as_array().map(|a| a.iter().filter_map(Value::as_i64).sum::<i64>())})
    });
    let (r, _) = rt
        .run(allowing_as("sum these", &["math::*"], ExposeMode::Native))
        .await;
    assert_eq!(
        *got.lock().unwrap(),
        json!({"numbers": [1, 2, 3]}),
        "the target got the parsed array"
    );
    let entry = rt
        .entries(&r.session_id)
        .into_iter()
        .find(|e| matches!(e.message, Some(AgentMessage::FunctionResult(_))))
        .unwrap();
    assert_eq!(
        entry.origin.as_ref().unwrap()["reconciled"][0]["path"],
        "/numbers"
    );
    assert_eq!(
        entry.origin.as_ref().unwrap()["reconciled"][0]["kind"],
        "parsed"
    );
    let Some(AgentMessage::FunctionResult(result)) = entry.message else {
        unreachable!()
    };
    let texts: Vec<&str> = result
        .content
        .iter()
        .filter_map(ContentBlock::as_text)
        .collect();
    assert_eq!(texts[0], "{\"sum\":6}");
    assert_eq!(
        texts[1],
        "[harness] `/numbers` (array) arrived as a JSON string and was parsed before dispatch."
    );
}

#[tokio::test]
async fn the_third_identical_failing_call_is_answered_by_the_breaker() {
    let script = json!({"generations": [
        call_gen("flaky", "c1", "net::get", json!({"url": "x"})),
        {"match": {"last_user_text": "flaky"}, "content": [{"type": "function_call", "id": "c2", "function_id": "net::get", "arguments": {"url": "x"}}]},
        {"match": {"last_user_text": "flaky"}, "content": [{"type": "function_call", "id": "c3", "function_id": "net::get", "arguments": {"url": "x"}}]},
        text_gen("giving up")
    ]});
    let rt = runtime(script, config()).await;
    let calls = rt.register(
        "net::get",
        None,
        |_| json!({"content": [{"type": "text", "text": "connection refused"}], "is_error": true}),
    );
    let (r, s) = rt
        .run(allowing_as("flaky", &["net::*"], ExposeMode::Native))
        .await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the target ran twice, not three times"
    );
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 3);
    assert_eq!(results[2].details["error"], "repeated_failure");
    assert_eq!(results[2].details["count"], 2);
    assert!(results[2].is_error);
}

#[tokio::test]
async fn an_oversized_result_is_elided_in_the_transcript_and_the_next_context() {
    let script = json!({"generations": [
        call_gen("dump", "c1", "db::dump", json!({})),
        text_gen("summarized")
    ]});
    let cfg = HarnessConfig {
        max_result_bytes: 2048,
        ..config()
    };
    let rt = runtime(script, cfg).await;
    rt.register("db::dump", None, |_| json!({"rows": vec!["row"; 2000]}));
    let (r, _) = rt
        .run(allowing_as("dump", &["db::*"], ExposeMode::Native))
        .await;
    let result = &rt.results(&r.session_id)[0];
    let text = result.content[0].as_text().unwrap().to_string();
    assert!(text.starts_with("<omitted: result was ~"), "{text}");
    assert!(text.contains("an object with 1 keys"), "{text}");
    assert_eq!(
        result.details,
        json!({"result_capped": {"max_bytes": 2048}})
    );
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let in_context = seen[1]
        .messages
        .iter()
        .find_map(|m| match m {
            AgentMessage::FunctionResult(f) => Some(f.content[0].as_text().unwrap().to_string()),
            _ => None,
        })
        .unwrap();
    assert_eq!(in_context, text, "the model saw the same marker");
}

#[tokio::test]
async fn degraded_and_targetless_calls_are_refused_without_running_anything() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "go"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "agent_trigger", "arguments": {"payload": {}}},
            {"type": "function_call", "id": "c2", "function_id": "fs::write", "arguments": {"_raw": "{\"path\": \"/tm"}}
        ]},
        text_gen("ok")
    ]});
    let rt = runtime(script, config()).await;
    let calls = rt.register("fs::write", None, |_| json!({}));
    let (r, _) = rt
        .run(allowing_as("go", &["*"], ExposeMode::AgentTrigger))
        .await;
    let results = rt.results(&r.session_id);
    assert_eq!(results[0].details["error"], "agent_trigger_no_target");
    assert_eq!(results[1].details["error"], "degraded_arguments");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_send_while_a_function_runs_returns_at_once_and_steers_the_next_step() {
    let script = json!({"generations": [
        call_gen("start", "c1", "job::wait", json!({})),
        {"match": {"last_user_text": "meanwhile"}, "content": [{"type": "text", "text": "noted the follow-up"}]},
        text_gen("fallback")
    ]});
    let rt = runtime(script, config()).await;
    let gate = std::sync::Arc::new(tokio::sync::Notify::new());
    let started = std::sync::Arc::new(tokio::sync::Notify::new());
    {
        use harness_bus::Bus;
        let (gate, started) = (gate.clone(), started.clone());
        rt.bus.register_function(
            harness_bus::FunctionDef::new("job::wait", "waits for the test"),
            std::sync::Arc::new(move |_p: Value, _ctx: harness_bus::CallContext| {
                let (gate, started) = (gate.clone(), started.clone());
                async move {
                    started.notify_one();
                    gate.notified().await;
                    Ok(json!({"finished": true}))
                }
            }),
        );
    }
    let r = rt
        .send(allowing_as(
            "start the job",
            &["job::*"],
            ExposeMode::Native,
        ))
        .await;
    started.notified().await;
    // The step holds the session while the function runs; the send must not wait for it.
    let mut steer = send("meanwhile, add a note");
    steer.session_id = Some(r.session_id.clone());
    let answer = tokio::time::timeout(std::time::Duration::from_secs(20), rt.harness.send(steer))
        .await
        .expect("send returned while the function was still running")
        .unwrap();
    assert_eq!((answer.merged, answer.queued), (Some(true), Some(true)));
    gate.notify_one();
    let s = rt.wait_terminal(&r.session_id, &r.turn_id).await;
    assert_eq!(s.result, Some(json!("noted the follow-up")));
    let msgs = rt.messages(&r.session_id);
    let roles: Vec<&str> = msgs.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(
        roles,
        vec!["user", "assistant", "function_result", "user", "assistant"]
    );
}

#[tokio::test]
async fn a_registry_change_is_announced_once_to_a_session_that_may_call_functions() {
    let rt = runtime(json!({"generations": [text_gen("ok")]}), config()).await;
    let (a, _) = rt
        .run(allowing_as("first", &["*"], ExposeMode::AgentTrigger))
        .await;
    rt.ok("harness::on-functions-change", json!({})).await;
    for text in ["second", "third"] {
        let mut next = send(text);
        next.session_id = Some(a.session_id.clone());
        rt.run(next).await;
    }
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let last_text = |i: usize| seen[i].messages.last().unwrap().text();
    assert!(!last_text(0).contains("registered functions changed"));
    assert!(
        last_text(1).starts_with("[harness] The set of registered functions changed"),
        "{}",
        last_text(1)
    );
    assert_eq!(last_text(2), "third", "announced once");
    assert!(
        rt.messages(&a.session_id)
            .iter()
            .all(|(_, t)| !t.contains("registered functions changed")),
        "never persisted"
    );
}

#[tokio::test]
async fn arguments_repair_could_not_fix_get_one_diagnosis_naming_fields_and_types() {
    let script = json!({"generations": [
        call_gen("store", "c1", "db::put", json!({"count": "many", "note": "private text"})),
        {"match": {"last_user_text": "store"}, "content": [{"type": "function_call", "id": "c2", "function_id": "db::put", "arguments": {"count": "lots", "note": "private text"}}]},
        text_gen("done")
    ]});
    let rt = runtime(script, config()).await;
    let schema = json!({"type": "object", "required": ["count"],
        "properties": {"count": {"type": "integer"}}, "additionalProperties": false});
    rt.register(
        "db::put",
        Some(schema),
        |_| json!({"content": [{"type": "text", "text": "bad request"}], "is_error": true}),
    );
    let (r, _) = rt
        .run(allowing_as("store it", &["db::*"], ExposeMode::Native))
        .await;
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 2);
    let texts: Vec<String> = results
        .iter()
        .map(|m| harness_types::message::joined_text(&m.content))
        .collect();
    assert!(
        texts[0].contains("[harness] The arguments of db::put do not match its schema")
            && texts[0].contains("`/count` expects integer")
            && texts[0].contains("`note` not accepted"),
        "{}",
        texts[0]
    );
    assert!(
        !texts[0].contains("many") && !texts[0].contains("private text"),
        "no value preview: {}",
        texts[0]
    );
    assert!(
        !texts[1].contains("[harness]"),
        "once per turn and call pattern: {}",
        texts[1]
    );
}

/// A call whose arguments arrived whole but do not parse is told they are malformed; one the
/// stream cut is told it was cut short. Neither runs.
#[tokio::test]
async fn malformed_arguments_are_named_apart_from_cut_ones() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "go"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fs::write", "arguments": {"_raw": "{\"path\": \"a\n\"}"}},
            {"type": "function_call", "id": "c2", "function_id": "fs::write", "arguments": {"_partial": true}}
        ]},
        text_gen("ok")
    ]});
    let rt = runtime(script, config()).await;
    let calls = rt.register("fs::write", None, |_| json!({}));
    let (r, _) = rt.run(allowing_as("go", &["*"], ExposeMode::Native)).await;
    let results = rt.results(&r.session_id);
    let text = |i: usize| harness_types::message::joined_text(&results[i].content);
    assert!(text(0).contains("not valid JSON"), "{}", text(0));
    assert!(!text(0).contains("cut short"), "{}", text(0));
    assert!(text(1).contains("cut short"), "{}", text(1));
    assert_eq!(results[0].details["error"], "degraded_arguments");
    assert_eq!(results[1].details["error"], "degraded_arguments");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}
