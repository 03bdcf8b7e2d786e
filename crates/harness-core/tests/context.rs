//! Context assembly through the `context::assemble` sibling, end to end in-process: a long
//! conversation against a small window, with the summarizer going through the same scripted
//! router as every generation.

mod support;

use std::collections::HashSet;
use std::sync::Arc;

use harness_bus::Bus;
use harness_core::HarnessConfig;
use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions, TurnStatus};
use harness_types::context::{CompactionRecord, COMPACTION_ENTRY};
use harness_types::message::{AgentMessage, ContentBlock};
use harness_types::router::ChatRequest;
use serde_json::{json, Value};
use support::{config, runtime, send};

const TURNS: usize = 200;
const WINDOW: u64 = 32_000;
/// Characters of each function result (~1,600 tokens: a dozen fill the window).
const RESULT_CHARS: usize = 6_000;
const SUMMARY: &str = "SUMMARY: the user asked for reports 0..n; each was read with demo::read.";

fn script() -> Value {
    let mut generations = vec![json!({
        "match": {"last_user_text": "^Summarize the conversation below"},
        "repeat": true,
        "content": [{"type": "text", "text": SUMMARY}]
    })];
    for n in 0..TURNS {
        generations.push(json!({
            "match": {"last_user_text": "^turn "},
            "content": [{"type": "function_call", "id": format!("call_{n}"), "function_id": "demo::read",
                         "arguments": {"report": n}}]
        }));
        generations.push(json!({
            "match": {"last_user_text": "^turn "},
            "content": [{"type": "text", "text": format!("report {n} read")}]
        }));
    }
    json!({ "generations": generations })
}

fn texts(req: &ChatRequest) -> Vec<String> {
    req.messages.iter().map(AgentMessage::text).collect()
}

fn is_summarizer(req: &ChatRequest) -> bool {
    req.messages.len() == 1
        && req.messages[0]
            .text()
            .starts_with("Summarize the conversation below")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversation_is_compacted_and_never_fails() {
    let rt = runtime(
        script(),
        HarnessConfig {
            default_context_window: WINDOW,
            ..config()
        },
    )
    .await;
    // The context manager on the same bus: it summarizes through router::chat.
    let bus: Arc<dyn Bus> = Arc::new(rt.bus.clone());
    harness_context::register(bus.clone());
    rt.register(
        "demo::read",
        None,
        |args| json!({"report": args["report"], "body": "x".repeat(RESULT_CHARS)}),
    );
    let options = SendOptions {
        functions: Some(FunctionPolicy {
            allow: vec!["demo::*".into()],
            deny: vec![],
            expose: ExposeMode::Native,
        }),
        ..Default::default()
    };
    let mut session: Option<String> = None;
    for n in 0..TURNS {
        let mut req = send(&format!("turn {n}: read report {n}"));
        req.session_id = session.clone();
        req.options = Some(options.clone());
        let (sent, status) = rt.run(req).await;
        assert_eq!(
            status.status,
            TurnStatus::Completed,
            "turn {n} ended {:?}: {:?}",
            status.status,
            status.result_error
        );
        session = Some(sent.session_id);
    }
    let sid = session.unwrap();

    // Compaction fired and was persisted, anchored to entries that exist.
    let entries = rt.entries(&sid);
    let ids: HashSet<&str> = entries.iter().map(|e| e.entry_id.as_str()).collect();
    let compactions: Vec<CompactionRecord> = entries
        .iter()
        .filter_map(|e| e.custom.as_ref())
        .filter(|c| c.custom_type == COMPACTION_ENTRY)
        .map(|c| serde_json::from_value(c.data.clone()).unwrap())
        .collect();
    assert!(compactions.len() >= 2, "compactions: {}", compactions.len());
    for c in &compactions {
        assert!(ids.contains(c.tail_start_entry_id.as_str()));
        assert_eq!(c.summary, SUMMARY);
        assert!(c.tokens_before > c.assembled_token_count);
        assert!(c.assembled_token_count <= c.usable_input_tokens);
    }
    // Each summary was a generation, accounted on its compaction entry and in the metrics.
    let mut summarized = (0u64, 0u64);
    for c in &compactions {
        let u = c.usage.as_ref().expect("the summary's usage on its entry");
        assert!(
            u.input.unwrap_or(0) > 0 && u.output.unwrap_or(0) > 0,
            "{u:?}"
        );
        summarized.0 += u.input.unwrap();
        summarized.1 += u.output.unwrap();
    }
    let replied = entries
        .iter()
        .filter_map(|e| match &e.message {
            Some(AgentMessage::Assistant(a)) => a.usage.clone(),
            _ => None,
        })
        .fold((0u64, 0u64), |(i, o), u| {
            (i + u.input.unwrap_or(0), o + u.output.unwrap_or(0))
        });
    let metrics = rt
        .harness
        .metrics(harness_types::api::MetricsRequest {
            root_session_id: sid.clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        metrics.totals.counters.input_tokens,
        Some(replied.0 + summarized.0)
    );
    assert_eq!(
        metrics.totals.counters.output_tokens,
        Some(replied.1 + summarized.1)
    );
    // Every message stayed in the transcript: compaction only changes what is sent.
    let messages = entries.iter().filter(|e| e.message.is_some()).count();
    assert_eq!(messages, TURNS * 4);

    let seen = rt.recorder.seen.lock().unwrap().clone();
    let (summaries, turns): (Vec<&ChatRequest>, Vec<&ChatRequest>) =
        seen.iter().partition(|r| is_summarizer(r));
    assert_eq!(turns.len(), TURNS * 2, "two generations a turn");
    assert_eq!(
        summaries.len(),
        compactions.len(),
        "each summary was asked once"
    );
    // The summary is reused: most requests carry it without a new summary being written.
    let with_summary = turns
        .iter()
        .filter(|r| texts(r).iter().any(|t| t.contains(SUMMARY)))
        .count();
    assert!(
        with_summary > 4 * summaries.len(),
        "{with_summary} requests carried a summary, {} summaries written",
        summaries.len()
    );
    for (k, r) in turns.iter().enumerate() {
        let n = k / 2;
        let t = texts(r);
        // The opening message is always first.
        assert_eq!(t[0], "turn 0: read report 0", "request {k}");
        // The latest exchanges: this turn's message and the previous turn's, verbatim.
        assert!(
            t.contains(&format!("turn {n}: read report {n}")),
            "request {k}"
        );
        if n > 0 {
            let prev = n - 1;
            assert!(
                t.contains(&format!("turn {prev}: read report {prev}")),
                "request {k}"
            );
            assert!(t.contains(&format!("report {prev} read")), "request {k}");
        }
        // No call without its result.
        let results: HashSet<&str> = r
            .messages
            .iter()
            .filter_map(|m| match m {
                AgentMessage::FunctionResult(f) => Some(f.function_call_id.as_str()),
                _ => None,
            })
            .collect();
        for m in r.messages.iter() {
            if let AgentMessage::Assistant(a) = m {
                for b in &a.content {
                    if let ContentBlock::FunctionCall { id, .. } = b {
                        assert!(
                            results.contains(id.as_str()),
                            "request {k}: {id} unanswered"
                        );
                    }
                }
            }
        }
    }
    eprintln!(
        "{} compactions, {} summarizer calls, {with_summary} of {} requests carried a summary",
        compactions.len(),
        summaries.len(),
        turns.len()
    );
    // Every request fit the window as the provider itself measured it (its reported usage).
    for e in &entries {
        if let Some(AgentMessage::Assistant(a)) = &e.message {
            let input = a.usage.as_ref().and_then(|u| u.input).unwrap();
            assert!(input <= WINDOW, "{}: {input} input tokens", e.entry_id);
        }
    }
    // The second generation of the last turn saw its own call's full result.
    let last = turns.last().unwrap();
    assert!(last.messages.iter().any(|m| matches!(m,
        AgentMessage::FunctionResult(f) if f.function_call_id == format!("call_{}", TURNS - 1)
            && f.content.iter().any(|b| b.as_text().is_some_and(|t| t.len() > RESULT_CHARS)))));
}
