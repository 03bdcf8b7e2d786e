//! Compaction: the head of a history that outgrew the budget becomes a summary written by the
//! session's own model (`router::chat` on the bus); the opening message and the latest
//! exchanges stay verbatim.

use std::time::Duration;

use harness_bus::Bus;
use harness_types::context::ModelRef;
use harness_types::message::{AgentMessage, ContentBlock, Usage};
use harness_types::router::{ChatRequest, Frame};
use serde_json::Value;

use crate::count::Counter;
use crate::error::ContextError;

pub use harness_types::context::{summary_message, SUMMARY_HEADER};

/// What the summarizer is asked to do.
const SUMMARIZER_PROMPT: &str = "You compress a conversation between a user and an assistant that \
calls functions, so the assistant can continue it with less context. Write a factual summary: the \
user's goals and constraints, decisions made, what each function call established (ids, paths, \
numbers, errors), and what is still open. Keep names and values exact. Do not address the user; \
answer with the summary only.";

/// The opening line of the summarizer's request.
pub const SUMMARIZE_REQUEST: &str = "Summarize the conversation below.";

/// Characters of one function result the summarizer sees.
const RESULT_CHARS: usize = 1_500;
/// Characters of one text block the summarizer sees.
const TEXT_CHARS: usize = 4_000;

/// The most a summary may take: an eighth of the budget, at most 2,048 tokens.
pub fn summary_reserve(budget: u64) -> u64 {
    (budget / 8).clamp(64, 2_048)
}

/// Where the kept tail starts: the earliest message at or after `first` that opens an exchange
/// (a user or assistant message, never a result cut from its call) such that the tail costs at
/// most `target` tokens; when even the last exchange costs more, the last exchange. `None` when
/// there is no such boundary after `first` (nothing could be summarized).
pub fn tail_start(
    messages: &[AgentMessage],
    first: usize,
    target: u64,
    counter: &Counter,
) -> Option<usize> {
    let mut suffix = 0u64;
    let mut best = None;
    for i in (first + 1..messages.len()).rev() {
        suffix += counter.message(&messages[i]);
        if matches!(messages[i], AgentMessage::FunctionResult(_)) {
            continue;
        }
        if best.is_some() && suffix > target {
            break;
        }
        best = Some(i);
    }
    best
}

fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let head: String = text.chars().take(max).collect();
    format!("{head} […]")
}

fn render(message: &AgentMessage) -> String {
    let mut out = String::new();
    match message {
        AgentMessage::User(u) => {
            out.push_str("[user] ");
            out.push_str(&cut(
                &harness_types::message::joined_text(&u.content),
                TEXT_CHARS,
            ));
        }
        AgentMessage::Assistant(a) => {
            out.push_str("[assistant] ");
            for b in &a.content {
                match b {
                    ContentBlock::Text { text } => out.push_str(&cut(text, TEXT_CHARS)),
                    ContentBlock::FunctionCall {
                        function_id,
                        arguments,
                        ..
                    } => {
                        out.push_str(&format!(
                            "(calls {function_id} {})",
                            cut(&arguments.to_string(), 400)
                        ));
                    }
                    _ => {}
                }
            }
        }
        AgentMessage::FunctionResult(r) => {
            out.push_str(&format!(
                "[result of {}{}] ",
                r.function_id,
                if r.is_error { ", error" } else { "" }
            ));
            out.push_str(&cut(
                &harness_types::message::joined_text(&r.content),
                RESULT_CHARS,
            ));
        }
        AgentMessage::Custom(_) => {}
    }
    out
}

/// The summarizer's user message: the previous summary, then the head, oldest first, within
/// `budget` tokens (the oldest messages are left out, and said to be, when it does not fit).
pub fn summarizer_input(
    previous: Option<&str>,
    head: &[AgentMessage],
    budget: u64,
    counter: &Counter,
) -> String {
    let mut parts: Vec<String> = head.iter().map(render).filter(|s| !s.is_empty()).collect();
    let fixed = counter.text(SUMMARIZE_REQUEST) + previous.map_or(0, |p| counter.text(p)) + 16;
    let mut total: u64 = fixed + parts.iter().map(|p| counter.text(p)).sum::<u64>();
    let mut dropped = 0;
    while total > budget && !parts.is_empty() {
        total -= counter.text(&parts.remove(0));
        dropped += 1;
    }
    let mut out = String::from(SUMMARIZE_REQUEST);
    if let Some(p) = previous {
        out.push_str("\n\nThe summary of what came before it:\n");
        out.push_str(p);
    }
    if dropped > 0 {
        out.push_str(&format!(
            "\n\n({dropped} older messages did not fit and are left out.)"
        ));
    }
    out.push_str("\n\nThe conversation:\n");
    out.push_str(&parts.join("\n"));
    out
}

/// Asks the session's model for the summary through `router::chat`.
#[allow(clippy::too_many_arguments)]
pub async fn summarize(
    bus: &dyn Bus,
    model: &ModelRef,
    session_id: Option<String>,
    request_id: String,
    input: String,
    max_output_tokens: u64,
    timeout: Duration,
) -> Result<(String, Option<Usage>), ContextError> {
    let req = ChatRequest {
        request_id,
        session_id,
        model: model.id.clone(),
        provider: model.provider.clone(),
        system_prompt: Some(SUMMARIZER_PROMPT.to_string()),
        messages: vec![AgentMessage::user_text(input, harness_types::now_ms())].into(),
        tools: vec![],
        thinking_level: None,
        max_output_tokens: Some(max_output_tokens.min(u32::MAX as u64) as u32),
        provider_options: None,
        response_format: None,
    };
    let payload =
        serde_json::to_value(&req).map_err(|e| ContextError::Summarizer(e.to_string()))?;
    let call = bus
        .call_streaming("router::chat", payload, Some(timeout))
        .await
        .map_err(|e| ContextError::Summarizer(format!("router::chat: {e}")))?;
    let mut frames = call.frames;
    let mut terminal = None;
    let drain = async {
        while let Some(frame) = frames.recv().await {
            if let Ok(f) = serde_json::from_value::<Frame>(frame) {
                if f.is_terminal() {
                    terminal = Some(f);
                }
            }
        }
    };
    let (ack, ()) = tokio::join!(call.result, drain);
    let ack: Value = ack.map_err(|e| ContextError::Summarizer(format!("router::chat: {e}")))?;
    match terminal {
        Some(Frame::Done { message }) => {
            let text = harness_types::message::joined_text(&message.content);
            if text.trim().is_empty() {
                return Err(ContextError::Summarizer(
                    "the model answered the summary request with no text".into(),
                ));
            }
            Ok((
                cut(text.trim(), (max_output_tokens as usize).saturating_mul(4)),
                message.usage,
            ))
        }
        Some(Frame::Error { error_message, .. }) => Err(ContextError::Summarizer(format!(
            "the model failed to summarize: {error_message}"
        ))),
        _ => Err(ContextError::Summarizer(format!(
            "router::chat ended without an answer (ack {ack})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counter() -> Counter {
        Counter::new(&ModelRef {
            id: "local".into(),
            provider: None,
        })
    }

    use crate::fixtures::assistant;

    fn result(id: &str, chars: usize) -> AgentMessage {
        crate::fixtures::result(id, "r".repeat(chars))
    }

    #[test]
    fn the_tail_never_starts_on_a_result() {
        let h = vec![
            AgentMessage::user_text("open", 0),
            assistant(Some("a")),
            result("a", 4_000),
            assistant(Some("b")),
            result("b", 4_000),
            assistant(None),
        ];
        let c = counter();
        // A target that the last result alone exceeds: the tail still starts at its call.
        let at = tail_start(&h, 0, 10, &c).unwrap();
        assert_eq!(at, 5, "the last exchange alone");
        let at = tail_start(&h, 0, 1_100, &c).unwrap();
        assert_eq!(at, 3, "the call and its result stay together");
        // Everything would fit: the head still keeps at least message 1.
        assert_eq!(tail_start(&h, 0, 1_000_000, &c), Some(1));
        // Nothing after the first kept message: nothing to summarize.
        assert_eq!(tail_start(&h[..1], 0, 10, &c), None);
    }

    #[test]
    fn summarizer_input_fits_its_budget() {
        let mut head = Vec::new();
        for i in 0..50 {
            head.push(assistant(Some(&format!("c{i}"))));
            head.push(result(&format!("c{i}"), 10_000));
        }
        let c = counter();
        let text = summarizer_input(Some("earlier facts"), &head, 5_000, &c);
        assert!(c.text(&text) <= 5_000, "{}", c.text(&text));
        assert!(text.contains("earlier facts"));
        assert!(text.contains("older messages did not fit"));
        // The most recent part of the head is the part kept.
        assert!(text.contains("(calls demo::read"));
    }
}
