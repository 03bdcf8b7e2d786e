use super::*;

#[test]
fn traceparent_is_parsed_strictly() {
    let ok = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    assert_eq!(
        parse_traceparent(ok),
        Some((
            "0af7651916cd43dd8448eb211c80319c".into(),
            "b7ad6b7169203331".into(),
            true
        ))
    );
    for bad in [
        "",
        "garbage",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
        "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    ] {
        assert_eq!(parse_traceparent(bad), None, "{bad}");
    }
}

fn entry(id: &str, turn: &str, message: AgentMessage) -> Entry {
    Entry {
        entry_id: id.into(),
        seq: 0,
        message: Some(message),
        custom: None,
        origin: Some(serde_json::json!({"turn_id": turn})),
        revision: 0,
    }
}

/// A turn whose call answered an error: the call span, its step and the turn are errors,
/// while the turn keeps its own status; every span's parent is in the tree.
fn one_failed_call() -> (TurnRecord, Vec<Entry>) {
    use harness_types::message::{AssistantMessage, FunctionResultMessage};
    let turn = "t_1";
    let mut rec = crate::machine::seeded(crate::machine::Seed {
        session_id: "s_1".into(),
        turn_id: turn.into(),
        options: Default::default(),
        depth: 0,
        parent: None,
        preview: None,
        functions_generation: None,
        now: 1_000,
    });
    rec.status = TurnStatus::Completed;
    rec.step = 1;
    let assistant = |n: u64, at: i64, content| {
        entry(
            &ids::assistant_entry(turn, n),
            turn,
            AgentMessage::Assistant(AssistantMessage {
                content,
                model: "demo".into(),
                provider: "scripted".into(),
                stop_reason: StopReason::End,
                usage: Some(Usage {
                    input: Some(10),
                    output: Some(2),
                    ..Default::default()
                }),
                error_kind: None,
                error_message: None,
                native_stop_reason: None,
                warnings: None,
                timestamp: at,
            }),
        )
    };
    let entries = vec![
        assistant(
            0,
            1_010,
            vec![ContentBlock::FunctionCall {
                id: "c1".into(),
                function_id: "fx::read".into(),
                arguments: serde_json::json!({"path": "/secret"}),
            }],
        ),
        entry(
            &ids::call_result_entry(turn, "c1"),
            turn,
            AgentMessage::FunctionResult(FunctionResultMessage {
                function_call_id: "c1".into(),
                function_id: "fx::read".into(),
                content: vec![ContentBlock::text("no such file /secret")],
                details: serde_json::Value::Null,
                is_error: true,
                timestamp: 1_020,
            }),
        ),
        assistant(1, 1_030, vec![ContentBlock::text("sorry")]),
    ];
    (rec, entries)
}

/// The facts and spans of `rec`'s turn, 40 ms long, in a sampled trace of fixed ids.
fn traced(rec: &TurnRecord, entries: &[Entry]) -> (TurnFacts, Vec<SpanRecord>) {
    let f = facts(
        rec,
        1_000_000,
        1_040_000,
        entries,
        &Default::default(),
        &|_, _| None,
    );
    let ctx = TraceCtx {
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        turn_span_id: "00f067aa0ba902b7".into(),
        parent_span_id: None,
        remote_parent: false,
        sampled: true,
        started_at_ms: 1_000,
    };
    let spans = spans(&ctx, rec, &f);
    (f, spans)
}

#[test]
fn a_failed_call_stamps_its_step_and_the_turn_which_keeps_its_status() {
    let (rec, entries) = one_failed_call();
    let (f, spans) = traced(&rec, &entries);
    assert_eq!(f.steps.len(), 2);
    let by = |name: &str| spans.iter().find(|s| s.name == name).unwrap();
    let call = by("execute_tool fx::read");
    assert_eq!(
        call.error.as_ref().unwrap().error_type,
        "harness.call_error"
    );
    assert_eq!(
        by("harness.step 0").error.as_ref().unwrap().error_type,
        "harness.call_error"
    );
    assert!(by("harness.step 1").error.is_none());
    let turn = spans.last().unwrap();
    assert_eq!(turn.name, "invoke_agent harness");
    assert_eq!(
        turn.error.as_ref().unwrap().error_type,
        "harness.call_error"
    );
    assert!(turn
        .attributes
        .contains(&("harness.turn.status", AttrValue::Str("completed".into()))));
    assert!(turn
        .attributes
        .contains(&("harness.trace.error_span_count", AttrValue::Int(3))));
    let ids: Vec<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    for s in &spans[..spans.len() - 1] {
        assert!(
            ids.contains(&s.parent_span_id.as_deref().unwrap()),
            "{}",
            s.name
        );
        assert!(
            s.start_us >= turn.start_us && s.end_us <= turn.end_us,
            "{}",
            s.name
        );
    }
    // No argument or result text on any span.
    assert!(!format!("{spans:?}").contains("secret"));
    // The transcript-only summary counts the same spans and errors.
    let t = session_traces("s_1", &entries);
    assert_eq!(t.span_count as usize, spans.len());
    assert_eq!(t.error_span_count, 3);
}

#[test]
fn a_failed_turn_is_named_by_its_own_failure() {
    let (mut rec, entries) = one_failed_call();
    rec.status = TurnStatus::Failed;
    rec.failure = Some(crate::record::Failure {
        code: "harness.budget_exceeded".into(),
        phase: crate::record::FailurePhase::Generation,
        summary: "The budget is spent.".into(),
        detail: None,
        retryable: false,
        kind: None,
        provider: Default::default(),
    });
    let (f, mut spans) = traced(&rec, &entries);
    assert_eq!(f.reason, "budget_exceeded");
    let turn = spans.pop().unwrap();
    assert_eq!(turn.error.unwrap().error_type, "harness.budget_exceeded");
}

#[test]
fn derived_ids_are_stable_and_distinct() {
    let a = derived_span_id("00f067aa0ba902b7", "step/0");
    assert_eq!(a, derived_span_id("00f067aa0ba902b7", "step/0"));
    assert_ne!(a, derived_span_id("00f067aa0ba902b7", "step/1"));
    assert_eq!(a.len(), 16);
    assert_ne!(
        call_span_id("00f067aa0ba902b7", "c1"),
        call_span_id("00f067aa0ba902b8", "c1")
    );
}

/// Taking a turn's marks leaves the others; the oldest turn still marked is forgotten past the
/// bound, taken ones never count against it, and the queue stays bounded.
#[test]
fn marks_are_kept_per_turn_bounded_and_taken_without_a_scan() {
    let book = MarkBook::default();
    let mark = |t: &str, step: u64| book.step(t, step, |m| m.runs += 1);
    mark("a", 0);
    mark("b", 0);
    mark("b", 1);
    mark("c", 0);
    assert_eq!(book.take("b").len(), 2);
    assert!(book.take("b").is_empty(), "taken once");
    assert_eq!(book.take("a")[&0].runs, 1);
    // Many turns come and go: the queue does not grow with them.
    for i in 0..20_000 {
        let t = format!("t{i}");
        mark(&t, 0);
        book.take(&t);
    }
    {
        let m = book.0.lock().unwrap();
        assert_eq!(m.turns.len(), 1, "only c is left");
        assert!(
            m.order.len() <= 2 * m.turns.len() + 64 + 1,
            "{}",
            m.order.len()
        );
    }
    // Turns never taken: the oldest goes once MARKED_TURNS newer ones were marked.
    for i in 0..MARKED_TURNS {
        mark(&format!("n{i}"), 0);
    }
    assert!(book.take("c").is_empty(), "c was the oldest");
    assert_eq!(book.take("n0")[&0].runs, 1);
    assert_eq!(book.0.lock().unwrap().turns.len(), MARKED_TURNS - 1);
}
