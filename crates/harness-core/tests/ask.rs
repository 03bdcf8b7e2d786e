//! `harness::ask`: answered by the loop, never dispatched; the turn ends on the question.

mod support;

use harness_bus::{Bus, CallContext, FunctionDef};
use harness_types::api::TurnStatus;
use serde_json::{json, Value};
use std::sync::Arc;
use support::*;

fn ask_args(header: &str) -> Value {
    json!({"questions": [{"header": header, "question": "Pause or end?",
        "options": [{"label": "Pause the turn", "description": "wait"}, {"label": "End the turn"}]}]})
}

fn asking(matcher: &str, calls: Vec<(&str, Value)>) -> Value {
    let mut content = vec![json!({"type": "text", "text": "Let me ask you."})];
    for (id, args) in calls {
        content.push(json!({"type": "function_call", "id": id, "function_id": "harness::ask", "arguments": args}));
    }
    json!({"match": {"last_user_text": matcher}, "content": content})
}

#[tokio::test]
async fn an_accepted_ask_ends_the_turn_on_the_question_without_another_model_call() {
    let rt = runtime(
        json!({"generations": [
            asking("^decide", vec![("q1", ask_args("Approach")), ("q2", ask_args("Again"))]),
            {"repeat": true, "content": [{"type": "text", "text": "should not be asked"}]}
        ]}),
        config(),
    )
    .await;
    // A deny-everything hook: never consulted for an ask.
    let consulted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = consulted.clone();
    rt.bus.register_function(
        FunctionDef::new("deny::all", "denies"),
        Arc::new(move |_p: Value, _ctx: CallContext| {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok(json!({"decision": "deny", "reason": "no"})) }
        }),
    );
    rt.bind("pre-trigger", "deny::all", json!({})).await;
    let (r, s) = rt.run(allowing("decide for me", &["*"])).await;
    assert_eq!(s.status, TurnStatus::Completed);
    assert_eq!(s.result, Some(json!("Let me ask you.")));
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        1,
        "no second model call"
    );
    assert_eq!(consulted.load(std::sync::atomic::Ordering::SeqCst), 0);
    let results = rt.results(&r.session_id);
    let first = results.iter().find(|m| m.function_call_id == "q1").unwrap();
    assert!(!first.is_error);
    assert_eq!(first.details["status"], "awaiting_answer");
    assert_eq!(first.details["turn_id"], json!(r.turn_id));
    assert_eq!(first.details["questions"][0]["multi_select"], false);
    assert!(first.details["questions"][0]["options"][1]
        .get("description")
        .is_none());
    let second = results.iter().find(|m| m.function_call_id == "q2").unwrap();
    assert!(second.is_error);
    assert!(harness_types::message::joined_text(&second.content)
        .starts_with("only one harness::ask per step"));

    // The user's answer is simply the next message, and starts the next turn.
    let mut answer = send("Approach: End the turn");
    answer.session_id = Some(r.session_id.clone());
    let next = rt.send(answer).await;
    assert_ne!(next.turn_id, r.turn_id);
    rt.wait_terminal(&r.session_id, &next.turn_id).await;
}

#[tokio::test]
async fn a_broken_limit_is_refused_with_its_field_and_the_turn_goes_on() {
    let rt = runtime(
        json!({"generations": [
            asking("^decide", vec![("q1", ask_args("A header far too long"))]),
            {"repeat": true, "content": [{"type": "text", "text": "asked in text instead"}]}
        ]}),
        config(),
    )
    .await;
    let (r, s) = rt.run(allowing("decide for me", &["*"])).await;
    assert_eq!(s.result, Some(json!("asked in text instead")));
    let result = &rt.results(&r.session_id)[0];
    assert!(result.is_error);
    assert_eq!(
        harness_types::message::joined_text(&result.content),
        "questions[0].header must be at most 16 characters (got 21)"
    );
    assert_eq!(
        rt.recorder.seen.lock().unwrap().len(),
        2,
        "the model reacts"
    );
}

#[tokio::test]
async fn a_sub_agent_cannot_ask_and_a_direct_call_is_refused() {
    let rt = runtime(
        json!({"generations": [
            {"match": {"last_user_text": "^delegate"}, "content": [{"type": "function_call", "id": "s1",
              "function_id": "harness::spawn", "arguments": {"task": "child task", "options": {"orchestrator": true}}}]},
            asking("^child task", vec![("q1", ask_args("Approach"))]),
            {"repeat": true, "content": [{"type": "text", "text": "blocked: need a human"}]}
        ]}),
        config(),
    )
    .await;
    let (r, _) = rt.run(allowing("delegate it", &["*"])).await;
    let child = rt.status(&r.session_id).await.unwrap().children[0].clone();
    let refused = &rt.results(&child.session_id)[0];
    assert!(refused.is_error);
    assert!(harness_types::message::joined_text(&refused.content)
        .starts_with("harness::ask needs a human to answer and none is attached to this turn"));
    let e = rt
        .bus
        .call("harness::ask", ask_args("Approach"), None)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("harness::ask only works inside an agent turn"),
        "{e}"
    );
}
