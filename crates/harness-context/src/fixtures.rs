//! Messages the unit tests of this crate build their histories from.

use harness_types::message::{
    AgentMessage, AssistantMessage, ContentBlock, FunctionResultMessage, StopReason,
};
use serde_json::Value;

/// An assistant message calling `demo::read` as `id`, or answering "done" when `id` is `None`.
pub(crate) fn assistant(call: Option<&str>) -> AgentMessage {
    let (content, stop_reason) = match call {
        Some(id) => (
            vec![ContentBlock::FunctionCall {
                id: id.into(),
                function_id: "demo::read".into(),
                arguments: serde_json::json!({}),
            }],
            StopReason::FunctionCall,
        ),
        None => (vec![ContentBlock::text("done")], StopReason::End),
    };
    AgentMessage::Assistant(AssistantMessage {
        stop_reason,
        ..AssistantMessage::ended(content, "m", "p", 0)
    })
}

/// `demo::read`'s result for call `id`.
pub(crate) fn result(id: &str, text: impl Into<String>) -> AgentMessage {
    AgentMessage::FunctionResult(FunctionResultMessage {
        function_call_id: id.into(),
        function_id: "demo::read".into(),
        content: vec![ContentBlock::text(text.into())],
        details: Value::Null,
        is_error: false,
        timestamp: 0,
    })
}
