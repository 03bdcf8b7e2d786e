use super::*;

fn unwrap(function_id: &str, args: Value) -> PlannedCall {
    unwrap_call("c", function_id, &args, ExposeMode::AgentTrigger)
}

#[test]
fn agent_trigger_unwraps_string_payloads_and_hoists_keys() {
    let c = unwrap(
        "agent_trigger",
        json!({"function": "a::b", "payload": "{\"x\": 1}"}),
    );
    assert_eq!(
        (c.function_id.as_str(), c.arguments.clone()),
        ("a::b", json!({"x": 1}))
    );
    let c = unwrap(
        "agent_trigger",
        json!({"function": "a::b", "payload": "sure: {\"x\": 1} done"}),
    );
    assert_eq!(
        c.arguments,
        json!({"x": 1}),
        "the first JSON value in the text"
    );
    let c = unwrap(
        "agent_trigger",
        json!({"function": "a::b", "payload": "[1]"}),
    );
    assert_eq!(c.arguments, json!({}), "a non-object payload is dropped");
    let c = unwrap(
        "agent_trigger",
        json!({"function": "a::b", "description": "d", "x": 2}),
    );
    assert_eq!(
        (c.arguments, c.intent.as_deref()),
        (json!({"x": 2}), Some("d"))
    );
    let c = unwrap(
        "agent_trigger",
        json!({"function": "a::b", "payload": {}, "_partial": true}),
    );
    assert!(degraded(&c.arguments));
    let c = unwrap("agent_trigger", json!({"payload": {}}));
    assert_eq!(
        c.function_id, "agent_trigger",
        "no target stays agent_trigger"
    );
}

#[test]
fn block_names_are_targets_in_native_mode_and_fallbacks_in_agent_trigger_mode() {
    let c = unwrap_call(
        "c",
        "weather::now",
        &json!({"city": "Oslo"}),
        ExposeMode::Native,
    );
    assert_eq!(
        (c.function_id.as_str(), c.arguments),
        ("weather::now", json!({"city": "Oslo"}))
    );
    let c = unwrap("weather::now", json!({"city": "Oslo"}));
    assert_eq!(
        (c.function_id.as_str(), c.arguments),
        ("weather::now", json!({"city": "Oslo"}))
    );
    let c = unwrap(
        "weather::now",
        json!({"function": "weather::forecast", "payload": {"days": 2}}),
    );
    assert_eq!(
        (c.function_id.as_str(), c.arguments),
        ("weather::forecast", json!({"days": 2}))
    );
}

#[test]
fn refusals_serialize_as_the_strings_the_transcript_already_holds() {
    let all = [
        Refusal::Interrupted,
        Refusal::AgentTriggerNoTarget,
        Refusal::DegradedArguments,
        Refusal::PolicyDenied,
        Refusal::RepeatedFailure,
        Refusal::HookDenied,
        Refusal::Cancelled,
        Refusal::InvalidResult,
        Refusal::ControlPlane,
        Refusal::PendingTimeout,
        Refusal::ChildLost,
        Refusal::ForbiddenEntry,
    ];
    for r in all {
        assert_eq!(serde_json::to_value(r).unwrap(), json!(r.as_str()));
        assert_eq!(
            serde_json::from_value::<Refusal>(json!(r.as_str())).unwrap(),
            r
        );
    }
    assert_eq!(Refusal::PolicyDenied.as_str(), "policy_denied");
}

#[test]
fn normalization() {
    assert_eq!(normalize(&json!("hi")).0, vec![ContentBlock::text("hi")]);
    let (c, e) = normalize(&json!({"content": [{"type": "text", "text": "x"}], "is_error": true}));
    assert_eq!((c, e), (vec![ContentBlock::text("x")], true));
    assert_eq!(
        normalize(&json!({"a": 1})).0,
        vec![ContentBlock::text("{\"a\":1}")]
    );
    assert!(normalize(&json!({"a": 1, "is_error": true})).1);
}
