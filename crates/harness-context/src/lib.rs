//! `context::assemble` and `context::count-tokens`: the model's context within a token budget.
//!
//! This is the soft baseline: the raw history, counted with a character-based estimate, and a
//! clean `context/overflow:` failure when it does not fit. Compaction and pruning slot in behind
//! the same functions. The loop calls [`assemble`] directly when no `context::assemble` is
//! registered on the bus, so a bare deployment still works.

use std::sync::Arc;

use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use harness_types::message::{AgentMessage, ContentBlock};
use harness_types::parse::parse_payload;
use harness_types::router::ToolSpec;
use schemars::{schema_for, JsonSchema};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Tokens reserved per message for role and framing.
const PER_MESSAGE_OVERHEAD: u64 = 4;

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ModelRef {
    pub id: String,
    #[serde(default)]
    pub provider: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AssembleOptions {
    /// Extra tokens the caller adds to the request (framing, response format).
    #[serde(default)]
    pub request_overhead_tokens: u64,
    /// The model's context window; the loop fills it from the model catalog.
    pub context_window: u64,
    /// Tokens kept free for the model's answer.
    #[serde(default)]
    pub max_output_tokens: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AssembleRequest {
    pub messages: Vec<AgentMessage>,
    pub model: ModelRef,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    pub options: AssembleOptions,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AssembleResponse {
    #[serde(default)]
    pub system_prompt: Option<String>,
    pub messages: Vec<AgentMessage>,
    /// Includes the system prompt, tools and request overhead.
    pub token_count: u64,
    /// Input tokens available: context window minus the output reservation.
    pub usable: u64,
}

fn estimate_chars(chars: usize) -> u64 {
    chars.div_ceil(4) as u64
}

fn block_chars(block: &ContentBlock) -> usize {
    match block {
        ContentBlock::Text { text } => text.len(),
        ContentBlock::Thinking { text, .. } => text.len(),
        ContentBlock::RedactedThinking { data } => data.len() / 2,
        // Images are billed by size class, not by bytes; a flat estimate is closer than base64.
        ContentBlock::Image { .. } => 6000,
        ContentBlock::FunctionCall {
            function_id,
            arguments,
            ..
        } => function_id.len() + arguments.to_string().len(),
        ContentBlock::FunctionResult { content, .. } => content.iter().map(block_chars).sum(),
    }
}

/// Estimated tokens of one message.
pub fn message_tokens(message: &AgentMessage) -> u64 {
    PER_MESSAGE_OVERHEAD + estimate_chars(message.content().iter().map(block_chars).sum())
}

/// Estimated tokens of a whole request.
pub fn count_tokens(
    messages: &[AgentMessage],
    system_prompt: Option<&str>,
    tools: &[ToolSpec],
) -> u64 {
    let tools_chars: usize = tools
        .iter()
        .map(|t| t.name.len() + t.description.len() + t.parameters.to_string().len())
        .sum();
    messages.iter().map(message_tokens).sum::<u64>()
        + estimate_chars(system_prompt.map_or(0, str::len))
        + estimate_chars(tools_chars)
}

/// Assembles the raw history; fails with `context/overflow: ...` when it does not fit.
pub fn assemble(req: AssembleRequest) -> Result<AssembleResponse, String> {
    let usable = req
        .options
        .context_window
        .saturating_sub(req.options.max_output_tokens);
    let messages: Vec<AgentMessage> = req
        .messages
        .into_iter()
        .filter(AgentMessage::is_model_visible)
        .collect();
    let token_count = count_tokens(&messages, req.system_prompt.as_deref(), &req.tools)
        + req.options.request_overhead_tokens;
    if token_count > usable {
        return Err(format!(
            "context/overflow: the conversation needs ~{token_count} tokens but model '{}' has {usable} usable",
            req.model.id
        ));
    }
    Ok(AssembleResponse {
        system_prompt: req.system_prompt,
        messages,
        token_count,
        usable,
    })
}

/// Registers `context::assemble` on `bus`.
pub fn register(bus: &dyn Bus) {
    let handler = |payload: Value, _ctx: CallContext| async move {
        let req: AssembleRequest = parse_payload(payload)?;
        let resp = assemble(req).map_err(|e| BusError::new("context/overflow", e))?;
        serde_json::to_value(resp).map_err(|e| BusError::internal(e.to_string()))
    };
    bus.register_function(
        FunctionDef::new(
            "context::assemble",
            "Assemble the model's context within the token budget (raw history, estimated).",
        )
        .schemas(
            serde_json::to_value(schema_for!(AssembleRequest)).unwrap_or(Value::Null),
            serde_json::to_value(schema_for!(AssembleResponse)).unwrap_or(Value::Null),
        )
        .internal(),
        Arc::new(handler) as Arc<dyn Handler>,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(text: &str, window: u64) -> AssembleRequest {
        AssembleRequest {
            messages: vec![AgentMessage::user_text(text, 0)],
            model: ModelRef {
                id: "m".into(),
                provider: None,
            },
            system_prompt: Some("be brief".into()),
            tools: vec![],
            options: AssembleOptions {
                request_overhead_tokens: 64,
                context_window: window,
                max_output_tokens: 0,
            },
        }
    }

    #[test]
    fn fits_and_counts_prompt_and_overhead() {
        let out = assemble(req("hello there", 1000)).unwrap();
        assert_eq!(out.messages.len(), 1);
        assert_eq!(out.token_count, 4 + 3 + 2 + 64);
    }

    #[test]
    fn overflow_is_a_clean_error() {
        let err = assemble(req(&"x".repeat(4000), 500)).unwrap_err();
        assert!(err.starts_with("context/overflow:"), "{err}");
    }
}
