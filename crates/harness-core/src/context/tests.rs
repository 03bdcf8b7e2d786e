use harness_types::context::COMPACTION_ENTRY;
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
    assert_eq!(*w.entry_ids, ["e1", "e4", "e5", "e6"]);
    assert_eq!(w.previous.as_ref().unwrap().summary, "what happened");
    assert_eq!(w.previous.as_ref().unwrap().summarized_head_tokens, 99);
    assert_eq!(w.late_users, [user("third")]);
    // A result before the anchor still counts as answered (elided, not interrupted).
    assert!(w.answered.contains("a"));
    // Without a compaction the whole history is the window.
    let w = window(&entries[..5], None);
    assert_eq!(*w.entry_ids, ["e1", "e2", "e3", "e4", "e5"]);
    assert!(w.previous.is_none() && w.late_users.is_empty());
}

#[test]
fn late_user_messages_rotate_after_a_call_less_answer() {
    let mut m = Arc::new(vec![
        user("open"),
        user("sent while the model answered"),
        assistant(&[], StopReason::End),
    ]);
    let late = [m[1].clone()];
    assert!(rotate(&mut m, &late));
    assert_eq!(m[2], user("sent while the model answered"));
    assert!(matches!(m[1], AgentMessage::Assistant(_)));
    // The opening message never moves, and an answer with calls is left alone.
    let mut m = Arc::new(vec![user("open"), assistant(&[], StopReason::End)]);
    assert!(!rotate(&mut m, &[user("open")]));
    let mut m = Arc::new(vec![
        user("open"),
        user("late"),
        assistant(&["a"], StopReason::FunctionCall),
    ]);
    assert!(!rotate(&mut m, &[user("late")]));
}

#[test]
fn a_list_shared_with_the_kept_window_is_copied_only_when_it_changes() {
    let kept = Arc::new(vec![
        user("open"),
        assistant(&["a"], StopReason::FunctionCall),
        result("a"),
        user("late"),
    ]);
    let mut m = kept.clone();
    // Ends on a user message: nothing moves; every call has its result: nothing is patched.
    assert!(!rotate(&mut m, &[user("late")]));
    assert!(!patch_orphans(&mut m, &HashSet::new()));
    assert!(Arc::ptr_eq(&m, &kept));
    // A change is made on a copy: the kept list stays as it was.
    let kept = Arc::new(vec![
        user("open"),
        user("late"),
        assistant(&[], StopReason::End),
    ]);
    let mut m = kept.clone();
    assert!(rotate(&mut m, &[user("late")]));
    assert!(!Arc::ptr_eq(&m, &kept));
    assert_eq!(kept[1], user("late"));
    assert_eq!(m[2], user("late"));
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
    let mut m = Arc::new(vec![
        user("open"),
        assistant(&["elided", "done"], StopReason::FunctionCall),
        result("done"),
        assistant(&["ran"], StopReason::FunctionCall),
        assistant(&["cut"], StopReason::Error),
    ]);
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

/// The kept window, brought up to date after each change, equals one built from scratch: for
/// appends, updates of the latest entries, updates deep in the history, compactions (and one
/// that does not read), and results that arrive before or after their calls.
#[test]
fn a_kept_window_matches_a_fresh_one_after_every_change() {
    fn compaction(id: &str, tail: &str, summary: &str) -> Entry {
        Entry {
            entry_id: id.into(),
            seq: 0,
            message: None,
            custom: Some(CustomEntry {
                custom_type: COMPACTION_ENTRY.into(),
                data: json!({"summary": summary, "tail_start_entry_id": tail, "summarized_head_tokens": 7}),
            }),
            origin: None,
            revision: 0,
        }
    }
    /// The window as a plain scan of the transcript defines it (no state kept).
    fn scanned(
        entries: &[Entry],
        watermark: &str,
    ) -> (Vec<AgentMessage>, Vec<String>, Vec<AgentMessage>) {
        let record = entries.iter().rev().find_map(|e| {
            let c = e
                .custom
                .as_ref()
                .filter(|c| c.custom_type == COMPACTION_ENTRY)?;
            serde_json::from_value::<CompactionRecord>(c.data.clone()).ok()
        });
        let start = record
            .and_then(|r| {
                entries
                    .iter()
                    .position(|e| e.entry_id == r.tail_start_entry_id)
            })
            .unwrap_or(0);
        let w = entries.iter().position(|e| e.entry_id == watermark);
        let opening = entries
            .iter()
            .position(|e| matches!(e.message, Some(AgentMessage::User(_))));
        let (mut messages, mut ids, mut late) = (Vec::new(), Vec::new(), Vec::new());
        if let Some(at) = opening.filter(|at| *at < start) {
            messages.push(entries[at].message.clone().unwrap());
            ids.push(entries[at].entry_id.clone());
        }
        for (i, e) in entries.iter().enumerate().skip(start) {
            let Some(m) = &e.message else { continue };
            if matches!(m, AgentMessage::User(_)) && w.is_some_and(|w| i > w) && Some(i) != opening
            {
                late.push(m.clone());
            }
            messages.push(m.clone());
            ids.push(e.entry_id.clone());
        }
        (messages, ids, late)
    }
    fn same(kept: &Window, fresh: &Window, what: &str) {
        assert_eq!(kept.messages, fresh.messages, "{what}: messages");
        assert_eq!(kept.entry_ids, fresh.entry_ids, "{what}: entry ids");
        assert_eq!(kept.late_users, fresh.late_users, "{what}: late users");
        assert_eq!(
            kept.previous.as_ref().map(|p| &p.summary),
            fresh.previous.as_ref().map(|p| &p.summary),
            "{what}: summary"
        );
        assert_eq!(kept.answered, fresh.answered, "{what}: answered");
        assert_eq!(kept.bytes, fresh.bytes, "{what}: bytes");
        assert_eq!(
            kept.bytes,
            byte_bound(&fresh.messages),
            "{what}: bytes bound"
        );
        assert_eq!(
            kept.unresolved_calls, fresh.unresolved_calls,
            "{what}: unresolved"
        );
    }
    // A fixed pseudo-random walk: the same cases on every run.
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: u64| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    let mut entries: Vec<Entry> = vec![entry("e0", user("open"))];
    let mut state = WindowState::build(&entries);
    let mut open_calls: Vec<String> = Vec::new();
    for step in 0..600usize {
        let id = format!("e{}", entries.len());
        let dirty_from = match next(12) {
            0..=2 => {
                entries.push(entry(&id, user(&format!("u{step}"))));
                entries.len() - 1
            }
            3..=4 => {
                let call = format!("c{step}");
                open_calls.push(call.clone());
                entries.push(entry(&id, assistant(&[&call], StopReason::FunctionCall)));
                entries.len() - 1
            }
            5..=6 if !open_calls.is_empty() => {
                let call = open_calls.remove(next(open_calls.len() as u64) as usize);
                entries.push(entry(&id, result(&call)));
                entries.len() - 1
            }
            7 => {
                // The latest assistant entry rewritten (a stream's final content).
                let at = entries.len() - 1;
                entries[at].message = Some(assistant(&[], StopReason::End));
                at
            }
            8 if entries.len() > 4 => {
                // An update deep in the history (a direct session::update-message).
                let at = 1 + next(entries.len() as u64 - 1) as usize;
                entries[at].message = Some(user(&format!("edited {step}")));
                at
            }
            9 if entries.len() > 6 => {
                let tail = &entries[entries.len() - 1 - next(4) as usize]
                    .entry_id
                    .clone();
                entries.push(compaction(&id, tail, &format!("summary {step}")));
                entries.len() - 1
            }
            10 if step % 50 == 0 => {
                entries.push(Entry {
                    custom: Some(CustomEntry {
                        custom_type: COMPACTION_ENTRY.into(),
                        data: json!({"not": "a record"}),
                    }),
                    ..compaction(&id, "e0", "")
                });
                entries.len() - 1
            }
            _ => {
                entries.push(entry(&id, assistant(&[], StopReason::End)));
                entries.len() - 1
            }
        };
        state.update(&entries, dirty_from);
        let watermark = entries[entries.len().saturating_sub(1 + next(3) as usize)]
            .entry_id
            .clone();
        let kept = state.window(&entries, Some(&watermark));
        let fresh = window(&entries, Some(&watermark));
        same(&kept, &fresh, &format!("step {step}"));
        let (messages, ids, late) = scanned(&entries, &watermark);
        assert_eq!(*fresh.messages, messages, "step {step}: scanned messages");
        assert_eq!(*fresh.entry_ids, ids, "step {step}: scanned ids");
        assert_eq!(fresh.late_users, late, "step {step}: scanned late users");
    }
    // Most changes were folded in, not rebuilt (compactions and deep edits rebuild).
    assert!(
        state.rebuilds < 200,
        "{} rebuilds in 600 steps",
        state.rebuilds
    );
}

#[test]
fn a_message_refused_as_too_large_is_left_out_of_later_windows() {
    fn exclusion(id: &str, of: &str) -> Entry {
        Entry {
            entry_id: id.into(),
            seq: 0,
            message: None,
            custom: Some(CustomEntry {
                custom_type: EXCLUDED_ENTRY.into(),
                data: json!({"entry_id": of, "detail": "context/message_too_large: message 0 of the request"}),
            }),
            origin: None,
            revision: 0,
        }
    }
    let mut entries = vec![entry("e1", user(&"7".repeat(3000)))];
    let mut state = WindowState::build(&entries);
    assert_eq!(state.window(&entries, None).messages.len(), 1);
    // The refusal is recorded after the message; the kept window drops it, as a fresh one does.
    entries.push(exclusion("x1", "e1"));
    entries.push(entry("e2", user("Say hi.")));
    state.update(&entries, 1);
    let kept = state.window(&entries, None);
    let fresh = window(&entries, None);
    for w in [&kept, &fresh] {
        assert_eq!(w.messages.as_slice(), &[user("Say hi.")]);
        assert_eq!(w.entry_ids.as_slice(), &["e2".to_string()]);
    }
    // The index the loop reads from the context manager's refusal.
    assert_eq!(
        too_large_index("context/message_too_large: message 3 of the request needs ~9 tokens"),
        Some(3)
    );
    assert_eq!(
        too_large_index("context/overflow: message 3 of the request"),
        None
    );
}
