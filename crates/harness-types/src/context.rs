//! The `context::*` contract: what the loop asks the context manager and what it answers.
//!
//! The loop reaches the context manager only through the bus, so these shapes are the whole
//! interface. Overflow errors carry the `context/overflow:` prefix in their message; every other
//! error is something else (a bad request, a summarizer that failed) and is classified as such.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::message::AgentMessage;
use crate::router::ToolSpec;

/// The prefix of every overflow error of `context::assemble`.
pub const OVERFLOW_PREFIX: &str = "context/overflow:";

/// How a refusal of one message too large for the window starts; `message <index> of the
/// request` follows, which the loop reads to leave that message out of later requests.
pub const MESSAGE_TOO_LARGE_PREFIX: &str = "context/message_too_large:";

/// The request index a `context/message_too_large` refusal names, wherever it sits in `message`.
pub fn too_large_index(message: &str) -> Option<usize> {
    let at = message.find(MESSAGE_TOO_LARGE_PREFIX)? + MESSAGE_TOO_LARGE_PREFIX.len();
    message[at..]
        .trim_start()
        .strip_prefix("message ")?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// The custom entry type of a persisted compaction (spec §2.7).
pub const COMPACTION_ENTRY: &str = "compaction";

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelRef {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
}

/// A summary written by an earlier compaction, reused instead of summarizing again.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PreviousSummary {
    pub summary: String,
    /// Tokens the summary replaced (for the diagnostics of a later compaction).
    #[serde(default)]
    pub summarized_head_tokens: u64,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AssembleOptions {
    /// The session the context is for (the summarizer's `router::chat` names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_key: Option<String>,
    /// Extra tokens the caller adds to the request (framing, response format, hooks).
    #[serde(default)]
    pub request_overhead_tokens: u64,
    /// The model's context window; the loop fills it from the model catalog.
    pub context_window: u64,
    /// Tokens kept free for the model's answer.
    #[serde(default)]
    pub max_output_tokens: u64,
    /// The latest compaction's summary: `messages` then start after its tail anchor (with the
    /// opening message first), and the summary goes back in after the opening message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_summary: Option<PreviousSummary>,
    /// Whether aged, oversized function results may be shortened (`harness::context-policy`).
    #[serde(default)]
    pub prune_function_results: bool,
    /// The `router::chat` request id of a summarizer call: deterministic per step, so a
    /// redelivered step asks the same question under the same id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary_request_id: Option<String>,
    /// Leave compaction out: the history fits or the call fails with an overflow.
    #[serde(default)]
    pub no_compaction: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AssembleRequest {
    /// Model-visible messages, oldest first. The first one, when it is a user message, is the
    /// opening message and is always kept.
    pub messages: Vec<AgentMessage>,
    pub model: ModelRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    pub options: AssembleOptions,
}

/// `context::assemble` as an in-process call: the history is shared, not copied, with the rest
/// of the request (whose own `messages` is left empty).
#[derive(Clone, Debug)]
pub struct AssembleCall {
    pub messages: std::sync::Arc<Vec<AgentMessage>>,
    /// One identity per message, unique to that message as the caller holds it (a changed
    /// message gets a new one): the context manager reuses the counts of messages it has seen,
    /// so a long history is not recounted at every step. `None`: count everything.
    pub identities: Option<std::sync::Arc<Vec<u64>>>,
    pub request: AssembleRequest,
}

/// What assembly did beyond passing the history through.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Applied {
    /// A new summary was written in this call; the caller persists it.
    pub compacted: bool,
    /// The new summary (when `compacted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
    /// Index into the request's `messages` of the first message kept after the summary (when
    /// `compacted`): the tail anchor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_start_index: Option<usize>,
    /// Tokens of the history before compaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_before: Option<u64>,
    /// Tokens of the part the summary replaced (previous summary included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summarized_head_tokens: Option<u64>,
    /// Tokens of the request as it came in (previous summary included).
    pub initial_token_count: u64,
    /// A previous summary was put back in front of the window.
    #[serde(default)]
    pub reused_summary: bool,
    /// Function results shortened by pruning.
    #[serde(default)]
    pub pruned_results: u32,
    /// What writing the new summary cost (the summarizer's generation, as its provider
    /// reported or the router estimated it, priced).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary_usage: Option<crate::message::Usage>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AssembleResponse {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// The context to send; left empty when `unchanged`.
    #[serde(default)]
    pub messages: Vec<AgentMessage>,
    /// The request's messages fit exactly as they were (nothing pruned or dropped): the answer
    /// leaves them out and the caller sends its own list, so a long history is not serialized
    /// back on every step. With `applied.reused_summary`, the previous summary goes back in
    /// after the opening message ([`AssembleResponse::context_of`] does both).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unchanged: bool,
    /// Includes the system prompt, tools and request overhead.
    pub token_count: u64,
    /// Input tokens available: context window minus the output reservation.
    pub usable: u64,
    pub effective_max_output_tokens: u64,
    #[serde(default)]
    pub applied: Applied,
    /// How the count was made: `tiktoken:<encoding>` or `estimate:<family>`, with the usage
    /// correction applied (1.0 when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counter: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correction: Option<f64>,
}

impl AssembleResponse {
    /// The context to send: `messages`, or, when `unchanged`, the caller's own `sent` list (the
    /// same allocation, not a copy) with the previous summary put back when one was reused.
    /// `timestamp` stamps that summary message, which is never persisted.
    pub fn context_of(
        &mut self,
        sent: &Arc<Vec<AgentMessage>>,
        previous: Option<&PreviousSummary>,
        timestamp: i64,
    ) -> Arc<Vec<AgentMessage>> {
        if !self.unchanged {
            return Arc::new(std::mem::take(&mut self.messages));
        }
        match previous.filter(|_| self.applied.reused_summary) {
            Some(prev) => {
                let at = summary_position(sent);
                let mut out = Vec::with_capacity(sent.len() + 1);
                out.extend_from_slice(&sent[..at]);
                out.push(summary_message(&prev.summary, timestamp));
                out.extend_from_slice(&sent[at..]);
                Arc::new(out)
            }
            None => sent.clone(),
        }
    }
}

/// The summary message's first line, so the model (and a reader) can tell it from a user turn.
pub const SUMMARY_HEADER: &str =
    "[Summary of the earlier conversation, written when it outgrew the context window. \
The opening message above and the messages after this one are verbatim.]";

/// The user message that carries a summary in the assembled context.
pub fn summary_message(summary: &str, timestamp: i64) -> AgentMessage {
    AgentMessage::user_text(format!("{SUMMARY_HEADER}\n\n{summary}"), timestamp)
}

/// Where a summary goes in a model-visible history: after the opening user message, which is
/// always kept.
pub fn summary_position(messages: &[AgentMessage]) -> usize {
    usize::from(matches!(messages.first(), Some(AgentMessage::User(_))))
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CountTokensRequest {
    pub messages: Vec<AgentMessage>,
    pub model: ModelRef,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CountTokensResponse {
    pub tokens: u64,
    /// `tiktoken:<encoding>` or `estimate:<family>`.
    pub counter: String,
    /// The usage correction applied (1.0 when the history reported none).
    pub correction: f64,
}

/// The data of a `compaction` custom entry (spec §2.7).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CompactionRecord {
    pub summary: String,
    /// The entry id of the first message kept after the summary.
    pub tail_start_entry_id: String,
    #[serde(default)]
    pub tokens_before: u64,
    #[serde(default)]
    pub summarized_head_tokens: u64,
    #[serde(default)]
    pub initial_token_count: u64,
    #[serde(default)]
    pub assembled_token_count: u64,
    #[serde(default)]
    pub usable_input_tokens: u64,
    #[serde(default)]
    pub effective_max_output_tokens: u64,
    /// The summarizer's usage and cost: a compaction is a generation like any other, counted in
    /// `harness::metrics` and against the turn's budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<crate::message::Usage>,
}

/// `harness::context-policy`: what the context manager may do to a session's history.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextPolicyRequest {
    /// The session whose policy to read (or set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// The destination model, when asking about a model rather than a session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Set the session's pruning permission (`null` returns it to the model's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub set: Option<ContextPolicySet>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextPolicySet {
    pub prune_function_results: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PolicySource {
    /// The model's default.
    Model,
    /// Set for the session with `harness::context-policy {set}`.
    Session,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ContextPolicyResponse {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Aged, oversized function results may be shortened in the assembled context.
    pub prune_function_results: bool,
    pub source: PolicySource,
    pub reason: String,
}
