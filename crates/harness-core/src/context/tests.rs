use harness_types::message::AssistantMessage;
use harness_types::session::CustomEntry;
use serde_json::Value;

use super::*;

fn entry(id: &str, message: AgentMessage) -> Entry {
    Entry {
        entry_id: id.into(),
        seq: 0,
        message: Some(message),
        custom: None,
        origin: None,
        revision: 0,
    }
}

fn assistant(calls: &[&str], stop_reason: StopReason) -> AgentMessage {
    AgentMessage::Assistant(AssistantMessage {
        content: if calls.is_empty() {
            vec![ContentBlock::text("answer")]
        } else {
            calls
                .iter()
                .map(|id| ContentBlock::FunctionCall {
                    id: id.to_string(),
                    function_id: "demo::f".into(),
                    arguments: json!({}),
                })
                .collect()
        },
        model: "m".into(),
        provider: "p".into(),
        stop_reason,
        usage: None,
        error_kind: None,
        error_message: None,
        native_stop_reason: None,
        warnings: None,
        timestamp: 0,
    })
}

fn result(id: &str) -> AgentMessage {
    AgentMessage::FunctionResult(FunctionResultMessage {
        function_call_id: id.into(),
        function_id: "demo::f".into(),
        content: vec![ContentBlock::text("ok")],
        details: Value::Null,
        is_error: false,
        timestamp: 0,
    })
}

fn user(text: &str) -> AgentMessage {
    AgentMessage::user_text(text, 0)
}

#[test]
fn the_window_starts_at_the_tail_anchor_with_the_opening_message_first() {
    let mut entries = vec![
        entry("e1", user("open")),
        entry("e2", assistant(&["a"], StopReason::FunctionCall)),
        entry("e3", result("a")),
        entry("e4", user("second")),
        entry("e5", assistant(&[], StopReason::End)),
    ];
    entries.push(Entry {
        entry_id: "e_t_3_compaction".into(),
        seq: 0,
        message: None,
        custom: Some(CustomEntry {
            custom_type: COMPACTION_ENTRY.into(),
            data: json!({"summary": "what happened", "tail_start_entry_id": "e4", "summarized_head_tokens": 99}),
        }),
        origin: None,
        revision: 0,
    });
    entries.push(entry("e6", user("third")));
    let w = window(&entries, Some("e5"));
    assert_eq!(w.entry_ids, ["e1", "e4", "e5", "e6"]);
    assert_eq!(w.previous.as_ref().unwrap().summary, "what happened");
    assert_eq!(w.previous.as_ref().unwrap().summarized_head_tokens, 99);
    assert_eq!(w.late_users, [user("third")]);
    // A result before the anchor still counts as answered (elided, not interrupted).
    assert!(w.answered.contains("a"));
    // Without a compaction the whole history is the window.
    let w = window(&entries[..5], None);
    assert_eq!(w.entry_ids, ["e1", "e2", "e3", "e4", "e5"]);
    assert!(w.previous.is_none() && w.late_users.is_empty());
}

#[test]
fn late_user_messages_rotate_after_a_call_less_answer() {
    let mut m = vec![
        user("open"),
        user("sent while the model answered"),
        assistant(&[], StopReason::End),
    ];
    let late = [m[1].clone()];
    assert!(rotate(&mut m, &late));
    assert_eq!(m[2], user("sent while the model answered"));
    assert!(matches!(m[1], AgentMessage::Assistant(_)));
    // The opening message never moves, and an answer with calls is left alone.
    let mut m = vec![user("open"), assistant(&[], StopReason::End)];
    assert!(!rotate(&mut m, &[user("open")]));
    let mut m = vec![
        user("open"),
        user("late"),
        assistant(&["a"], StopReason::FunctionCall),
    ];
    assert!(!rotate(&mut m, &[user("late")]));
}

fn patched_text(m: &AgentMessage) -> (String, bool, Value) {
    match m {
        AgentMessage::FunctionResult(r) => (
            harness_types::message::joined_text(&r.content),
            r.is_error,
            r.details.clone(),
        ),
        other => panic!("not a result: {other:?}"),
    }
}

#[test]
fn orphans_get_the_text_of_what_happened_to_them() {
    let answered: HashSet<String> = ["elided".to_string(), "done".to_string()].into();
    let mut m = vec![
        user("open"),
        assistant(&["elided", "done"], StopReason::FunctionCall),
        result("done"),
        assistant(&["ran"], StopReason::FunctionCall),
        assistant(&["cut"], StopReason::Error),
    ];
    assert!(patch_orphans(&mut m, &answered));
    // Each synthetic result sits right after its assistant message.
    assert_eq!(m.len(), 8);
    let (text, is_error, details) = patched_text(&m[2]);
    assert!(
        text.starts_with("result elided from the assembled context"),
        "{text}"
    );
    assert!(!is_error);
    assert_eq!(details["error"], "elided");
    let (text, is_error, details) = patched_text(&m[5]);
    assert!(text.contains("ran at most once"), "{text}");
    assert!(is_error);
    assert_eq!(details["error"], "interrupted");
    let (text, is_error, details) = patched_text(&m[7]);
    assert!(
        text.contains("never ran") && !text.contains("at most once"),
        "{text}"
    );
    assert!(is_error);
    assert_eq!(details["error"], "not_dispatched");
    // Nothing left to patch: a second pass changes nothing.
    assert!(!patch_orphans(&mut m, &answered));
}

#[test]
fn the_fallback_estimates_and_fails_cleanly() {
    use harness_types::context::{AssembleOptions, ModelRef};
    let req = |text: &str, window: u64| AssembleRequest {
        messages: vec![user(text)],
        model: ModelRef {
            id: "m".into(),
            provider: None,
        },
        system_prompt: None,
        tools: vec![],
        options: AssembleOptions {
            request_overhead_tokens: 64,
            context_window: window,
            ..AssembleOptions::default()
        },
    };
    let ok = fallback(req("hello there", 1000)).unwrap();
    assert_eq!(ok.token_count, (8 + 11u64).div_ceil(4) + 64);
    let err = fallback(req(&"x".repeat(4000), 500)).unwrap_err();
    assert!(err.starts_with(OVERFLOW_PREFIX), "{err}");
}
