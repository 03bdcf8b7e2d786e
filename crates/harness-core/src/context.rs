//! The loop's side of context assembly (spec §3.3 step 13): the window it hands
//! `context::assemble` (messages from the latest compaction's tail anchor, the opening message
//! first), the compaction record it persists, the rotation of late user messages, the orphan
//! patch, and the small fallback used when no context manager is registered.
//!
//! The loop reaches the context manager only through the bus. The fallback is deliberately
//! small (raw history, a character estimate, a clean overflow): a deployment without a context
//! worker still chats, and nothing here can summarize.

use std::collections::HashSet;
use std::sync::Arc;

mod window;
pub(crate) use window::WindowState;

use crate::texts;
use harness_types::context::{
    AssembleRequest, AssembleResponse, CompactionRecord, PreviousSummary, OVERFLOW_PREFIX,
};
use harness_types::message::{AgentMessage, ContentBlock, FunctionResultMessage, StopReason};
use harness_types::session::Entry;
use serde_json::json;

/// State scope of the per-session context policy (`harness::context-policy {set}`).
pub(crate) const POLICY_SCOPE: &str = "harness_context_policy";

/// Custom entry naming a message that alone does not fit the model's window
/// (`{entry_id, detail}`): later windows leave it out, so one oversized message fails its own
/// turn and not every later send of the session.
pub(crate) const EXCLUDED_ENTRY: &str = "context_excluded";

pub(crate) use harness_types::context::too_large_index;

/// What a step sends to `context::assemble`, and what it needs to read the answer. Its lists are
/// shared with the session's [`WindowState`], never copied per step.
#[derive(Debug, Default)]
pub(crate) struct Window {
    /// Shared with an in-process `context::assemble`, which reads it without a copy.
    pub messages: Arc<Vec<AgentMessage>>,
    /// One identity per message, new whenever the message changes (for the context manager's
    /// count reuse).
    pub identities: Arc<Vec<u64>>,
    /// The entry id of each message (a tail anchor is named by its entry id).
    pub entry_ids: Arc<Vec<String>>,
    /// User messages that arrived after the previous step's watermark (rotation candidates).
    pub late_users: Vec<AgentMessage>,
    /// The latest compaction's summary.
    pub previous: Option<PreviousSummary>,
    /// Every call id with a result anywhere in the transcript.
    pub answered: Arc<HashSet<String>>,
    /// [`byte_bound`] of the messages.
    pub bytes: u64,
    /// Whether some call in the window has no result in it (so the orphan patch has work).
    pub unresolved_calls: bool,
    /// The step resumes a reply the provider cut: the recovery notice for this step's system
    /// prompt (see [`resume_notice`]).
    pub resume_notice: Option<String>,
}

/// Custom entry of a transient recovery (`{status: "recovering" | "recovered", notice, …}`).
pub(crate) const RECOVERY_ENTRY: &str = "recovery";

/// The marker after a cut text-only reply on the step that resumes it: the provider must not be
/// handed a trailing assistant message to continue, and the instructions themselves are in the
/// system prompt, so this says only what it is.
pub(crate) const RESUME_MARKER: &str = texts::RESUME_MARKER;

/// The recovery notice when the step reading `entries` is the one that resumes `turn_id`'s cut
/// reply: its latest `recovering` entry comes after the turn's last assistant message. Read from
/// the durable entry, so a redelivered step renders the same request; a later step (the entry
/// no longer last) renders none, so the model never sees the notice as conversation.
pub(crate) fn resume_notice(entries: &[Entry], turn_id: &str) -> Option<String> {
    let at = entries.iter().rposition(|e| {
        matches!(e.message, Some(AgentMessage::Assistant(_)))
            || e.custom
                .as_ref()
                .is_some_and(|c| c.custom_type == RECOVERY_ENTRY)
    })?;
    let e = &entries[at];
    let data = &e.custom.as_ref()?.data;
    let own = e
        .origin
        .as_ref()
        .and_then(|o| o["turn_id"].as_str())
        .is_none_or(|t| t == turn_id);
    (own && data["status"] == "recovering")
        .then(|| data["notice"].as_str().map(str::to_string))
        .flatten()
}

/// Builds the window from the transcript (custom entries included), from scratch.
pub(crate) fn window(entries: &[Entry], prev_watermark: Option<&str>) -> Window {
    WindowState::build(entries).window(entries, prev_watermark)
}

/// The compaction record of an assembly that compacted, anchored to the window's entry ids.
pub(crate) fn compaction_record(
    window: &Window,
    assembled: &AssembleResponse,
) -> Option<CompactionRecord> {
    let a = &assembled.applied;
    if !a.compacted {
        return None;
    }
    let anchor = window.entry_ids.get(a.tail_start_index?)?;
    Some(CompactionRecord {
        summary: a.summary.clone()?,
        tail_start_entry_id: anchor.clone(),
        tokens_before: a.tokens_before.unwrap_or(0),
        summarized_head_tokens: a.summarized_head_tokens.unwrap_or(0),
        initial_token_count: a.initial_token_count,
        assembled_token_count: assembled.token_count,
        usable_input_tokens: assembled.usable,
        effective_max_output_tokens: assembled.effective_max_output_tokens,
        usage: a.summary_usage.clone(),
    })
}

fn calls_of(m: &AgentMessage) -> impl Iterator<Item = (&str, &str)> {
    let content: &[ContentBlock] = match m {
        AgentMessage::Assistant(a) => &a.content,
        _ => &[],
    };
    content.iter().filter_map(|b| match b {
        ContentBlock::FunctionCall {
            id, function_id, ..
        } => Some((id.as_str(), function_id.as_str())),
        _ => None,
    })
}

/// When the list ends with an assistant message that calls nothing, user messages that arrived
/// after the previous step (the model answered without seeing them) move after it, so the
/// provider is not handed a trailing assistant message to continue. The opening message never
/// moves. Returns whether anything moved.
///
/// The list is shared with the session's kept window: it is copied only when something moves,
/// or every step that found a new user message copied the whole history.
pub(crate) fn rotate(messages: &mut Arc<Vec<AgentMessage>>, late_users: &[AgentMessage]) -> bool {
    let Some(last) = messages.last() else {
        return false;
    };
    if !matches!(last, AgentMessage::Assistant(_)) || calls_of(last).next().is_some() {
        return false;
    }
    let end = messages.len() - 1;
    let late: Vec<usize> = (1..end)
        .filter(|&i| {
            matches!(messages[i], AgentMessage::User(_)) && late_users.contains(&messages[i])
        })
        .collect();
    if late.is_empty() {
        return false;
    }
    let messages = Arc::make_mut(messages);
    let mut moved = Vec::with_capacity(late.len());
    for i in late.into_iter().rev() {
        moved.push(messages.remove(i));
    }
    moved.reverse();
    messages.extend(moved);
    true
}

/// Why a call in the context has no result next to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Orphan {
    /// The call was dispatched and no result was recorded: it ran at most once.
    Interrupted,
    /// Its result is in the transcript but not in the assembled context.
    Elided,
    /// The generation that asked for it failed or was stopped: it was never dispatched.
    NeverDispatched,
}

impl Orphan {
    fn text(self) -> &'static str {
        match self {
            Orphan::Interrupted => texts::CALL_INTERRUPTED,
            Orphan::Elided => texts::CALL_ELIDED,
            Orphan::NeverDispatched => texts::CALL_NEVER_DISPATCHED,
        }
    }

    fn error(self) -> &'static str {
        match self {
            Orphan::Interrupted => "interrupted",
            Orphan::Elided => "elided",
            Orphan::NeverDispatched => "not_dispatched",
        }
    }
}

/// Gives every function call without a result in `messages` a synthetic one right after its
/// assistant message (the context copy only; the transcript is untouched). `answered` holds the
/// call ids with a result anywhere in the transcript. Returns whether anything was added.
///
/// Like [`rotate`], the shared list is copied only when a result is added.
pub(crate) fn patch_orphans(
    messages: &mut Arc<Vec<AgentMessage>>,
    answered: &HashSet<String>,
) -> bool {
    let present: HashSet<&str> = messages
        .iter()
        .filter_map(|m| match m {
            AgentMessage::FunctionResult(r) => Some(r.function_call_id.as_str()),
            _ => None,
        })
        .collect();
    // (index of the assistant message, its synthetic results), oldest first.
    let mut patches: Vec<(usize, Vec<AgentMessage>)> = Vec::new();
    for (at, m) in messages.iter().enumerate() {
        let AgentMessage::Assistant(a) = m else {
            continue;
        };
        let cut = matches!(a.stop_reason, StopReason::Error | StopReason::Aborted);
        let synthetic: Vec<AgentMessage> = calls_of(m)
            .filter(|(id, _)| !present.contains(id))
            .map(|(id, function_id)| {
                let why = if answered.contains(id) {
                    Orphan::Elided
                } else if cut {
                    Orphan::NeverDispatched
                } else {
                    Orphan::Interrupted
                };
                AgentMessage::FunctionResult(FunctionResultMessage {
                    function_call_id: id.to_string(),
                    function_id: function_id.to_string(),
                    content: vec![ContentBlock::text(why.text())],
                    details: json!({"error": why.error()}),
                    is_error: why != Orphan::Elided,
                    timestamp: a.timestamp,
                })
            })
            .collect();
        if !synthetic.is_empty() {
            patches.push((at, synthetic));
        }
    }
    drop(present);
    if patches.is_empty() {
        return false;
    }
    let list = Arc::make_mut(messages);
    // From the last patch back, so the earlier indexes stay valid.
    for (at, synthetic) in patches.into_iter().rev() {
        list.splice(at + 1..at + 1, synthetic);
    }
    true
}

/// Bytes of a message's text: no tokenizer yields more tokens than bytes, so a history whose
/// bytes fit the budget cannot overflow it.
pub(crate) fn byte_bound(messages: &[AgentMessage]) -> u64 {
    fn block(b: &ContentBlock) -> u64 {
        match b {
            ContentBlock::Text { text } | ContentBlock::Thinking { text, .. } => text.len() as u64,
            ContentBlock::RedactedThinking { data } => data.len() as u64,
            ContentBlock::Image { .. } => 6_000,
            ContentBlock::FunctionCall { arguments, .. } => 64 + arguments.to_string().len() as u64,
            ContentBlock::FunctionResult { content, .. } => content.iter().map(block).sum(),
        }
    }
    messages
        .iter()
        .map(|m| 8 + m.content().iter().map(block).sum::<u64>())
        .sum()
}

/// The fallback's estimate: four characters a token, four tokens a message.
pub(crate) fn estimate(
    messages: &[AgentMessage],
    system_prompt: Option<&str>,
    tools: &[harness_types::router::ToolSpec],
) -> u64 {
    let tools: u64 = tools
        .iter()
        .map(|t| (t.name.len() + t.description.len() + t.parameters.to_string().len()) as u64)
        .sum();
    (byte_bound(messages) + system_prompt.map_or(0, |p| p.len() as u64) + tools).div_ceil(4)
}

/// Without a context manager: the raw history (a previous summary after the opening message),
/// estimated, or a clean overflow.
pub(crate) fn fallback(req: AssembleRequest) -> Result<AssembleResponse, String> {
    let o = req.options;
    let usable = o.context_window.saturating_sub(o.max_output_tokens);
    let mut messages: Vec<AgentMessage> = req
        .messages
        .into_iter()
        .filter(AgentMessage::is_model_visible)
        .collect();
    if let Some(prev) = &o.previous_summary {
        let at = harness_types::context::summary_position(&messages);
        messages.insert(
            at,
            harness_types::context::summary_message(&prev.summary, harness_types::now_ms()),
        );
    }
    let token_count =
        estimate(&messages, req.system_prompt.as_deref(), &req.tools) + o.request_overhead_tokens;
    if token_count > usable {
        return Err(format!(
            "{OVERFLOW_PREFIX} the conversation needs ~{token_count} tokens but model '{}' has {usable} usable (no context manager is registered to compact it)",
            req.model.id
        ));
    }
    Ok(AssembleResponse {
        system_prompt: req.system_prompt,
        messages,
        unchanged: false,
        token_count,
        usable,
        effective_max_output_tokens: o.max_output_tokens,
        applied: harness_types::context::Applied {
            initial_token_count: token_count,
            reused_summary: o.previous_summary.is_some(),
            ..Default::default()
        },
        counter: Some("estimate:fallback".into()),
        correction: None,
    })
}

#[cfg(test)]
mod tests;
