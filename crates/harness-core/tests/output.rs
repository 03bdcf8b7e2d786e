//! Output contracts through the `submit_result` fallback (the scripted model has no native
//! structured output): validation, nudges, failure with the raw value kept.

mod support;

use harness_types::api::{OutputContract, SendOptions, TurnStatus};
use serde_json::{json, Value};
use support::*;

fn schema() -> Value {
    json!({"type": "object", "required": ["city", "days"], "additionalProperties": false,
           "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}})
}

fn submit(matcher: &str, id: &str, value: Value) -> Value {
    json!({"match": {"last_user_text": matcher}, "content": [
        {"type": "function_call", "id": id, "function_id": "submit_result", "arguments": value}]})
}

fn contract(text: &str) -> harness_types::api::SendRequest {
    let mut req = send(text);
    req.options = Some(SendOptions {
        output: Some(OutputContract::Json {
            schema: Some(schema()),
        }),
        ..Default::default()
    });
    req
}

#[tokio::test]
async fn an_invalid_result_is_nudged_and_the_valid_one_completes_the_turn_with_its_value() {
    let rt = runtime(
        json!({"generations": [
            submit("^plan", "r1", json!({"city": 5})),
            submit("^Your previous result was not accepted", "r2", json!({"city": "Oslo", "days": 2}))
        ]}),
        config(),
    )
    .await;
    let (r, s) = rt.run(contract("plan a trip")).await;
    assert_eq!(s.status, TurnStatus::Completed, "{s:?}");
    assert_eq!(s.result, Some(json!({"city": "Oslo", "days": 2})));
    let events = rt.completed_events(&r.session_id, &r.turn_id).await;
    assert_eq!(events[0]["result"], json!({"city": "Oslo", "days": 2}));

    // The model was offered the contract as a tool with the schema, and no native format.
    let seen = rt.recorder.seen.lock().unwrap().clone();
    let tool = seen[0]
        .tools
        .iter()
        .find(|t| t.name == "submit_result")
        .expect("the submit_result tool");
    assert_eq!(tool.parameters, schema());
    assert!(seen[0].response_format.is_none());

    // Every submit_result call is answered, in the transcript, before the nudge.
    let results = rt.results(&r.session_id);
    assert_eq!(results.len(), 2);
    assert!(results[0].is_error);
    assert_eq!(results[0].details["error"], "invalid_result");
    assert!(!results[1].is_error);
    let nudge = rt
        .entries(&r.session_id)
        .into_iter()
        .find(|e| e.entry_id.ends_with("_nudge_1"))
        .expect("the nudge entry");
    let text = nudge.message.unwrap().text();
    assert!(
        text.starts_with("Your previous result was not accepted: result failed schema validation:"),
        "{text}"
    );
}

#[tokio::test]
async fn three_invalid_results_fail_the_turn_with_the_raw_value_kept() {
    let rt = runtime(
        json!({"generations": [
            submit("^plan", "r1", json!({"city": 1})),
            {"match": {"last_user_text": "^Your previous"}, "repeat": true,
             "content": [{"type": "text", "text": "Oslo, two days"}]}
        ]}),
        config(),
    )
    .await;
    let (r, s) = rt.run(contract("plan a trip")).await;
    assert_eq!(s.status, TurnStatus::Failed);
    assert_eq!(
        s.result,
        Some(json!("Oslo, two days")),
        "the raw value is kept"
    );
    let detail = rt.error_detail(
        &r.session_id,
        "harness.output_contract_invalid",
        "output_validation",
    );
    assert!(
        detail.contains("no submit_result call was made"),
        "{detail}"
    );
    // The first answer and two nudged retries: three generations in all.
    assert_eq!(rt.recorder.seen.lock().unwrap().len(), 3);
}
