//! SIGKILL while the generation a validation nudge asked for is streaming: on restart the turn
//! resumes, the nudge is in the transcript once, and the turn completes with the valid value.

mod common;

use common::*;
use serde_json::{json, Value};

const SLOW: &str =
    "Checking the contract again before I submit the corrected result for the trip now.";

fn schema() -> Value {
    json!({"type": "object", "required": ["city", "days"], "additionalProperties": false,
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
}

fn is_nudge(e: &Value) -> bool {
    role_of(e) == Some("user") && text_of(e).starts_with("Your previous result was not accepted")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_while_a_nudge_generates_the_turn_resumes_with_one_nudge() {
    let script = script(vec![
        json!({"match": {"last_user_text": "^plan"}, "content": [
            {"type": "function_call", "id": "r1", "function_id": "submit_result", "arguments": {"city": 5}}]}),
        // The nudged answer streams for a few seconds before it submits.
        json!({"match": {"last_user_text": "^Your previous result was not accepted"},
               "chunk_delay_ms": 150, "repeat": true, "content": [
            {"type": "text", "text": SLOW},
            {"type": "function_call", "id": "r2", "function_id": "submit_result", "arguments": {"city": "Oslo", "days": 2}}]}),
    ]);
    let mut server = Server::start(&script, &[]).await;
    let sid = "s_nudge";
    let sent = server
        .ok(
            "harness::send",
            json!({"session_id": sid, "message": "plan a trip", "model": "m", "provider": "scripted",
                   "options": {"output": {"type": "json", "schema": schema()}}}),
        )
        .await;
    let tid = sent["turn_id"].as_str().unwrap().to_string();
    // Kill once the nudged generation has streamed part of its text.
    wait_for("the nudged answer to stream", WAIT, || async {
        let entries = server.transcript(sid, false).await;
        let after_nudge = entries.iter().skip_while(|e| !is_nudge(e)).skip(1);
        let partial = after_nudge
            .filter(|e| role_of(e) == Some("assistant"))
            .any(|e| {
                let t = text_of(e);
                !t.is_empty() && t.len() < SLOW.len()
            });
        partial.then_some(())
    })
    .await;
    server.kill();
    server.restart().await;

    let status = server.wait_turn(sid, &tid).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(
        status["result"],
        json!({"city": "Oslo", "days": 2}),
        "{status}"
    );
    let entries = server.transcript(sid, false).await;
    let nudges = entries.iter().filter(|e| is_nudge(e)).count();
    assert_eq!(nudges, 1, "one nudge:\n{}", render(&entries));
    let users = user_texts(&entries).len();
    assert_eq!(users, 2, "the message and the nudge:\n{}", render(&entries));
}
