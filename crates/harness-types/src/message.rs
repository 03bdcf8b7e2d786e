//! Transcript messages and content blocks.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One block of message content.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        text: String,
    },
    Image {
        data: String,
        mime: String,
    },
    Thinking {
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signature: Option<String>,
    },
    /// Opaque redacted thinking payload, replayed verbatim on the wire.
    RedactedThinking {
        data: String,
    },
    FunctionCall {
        id: String,
        function_id: String,
        arguments: Value,
    },
    FunctionResult {
        function_call_id: String,
        content: Vec<ContentBlock>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
}

impl ContentBlock {
    pub fn text(text: impl Into<String>) -> Self {
        ContentBlock::Text { text: text.into() }
    }

    pub fn as_text(&self) -> Option<&str> {
        match self {
            ContentBlock::Text { text } => Some(text),
            _ => None,
        }
    }
}

/// Joins the text blocks of `content` with no separator, the way a streamed reply reads.
pub fn joined_text(content: &[ContentBlock]) -> String {
    content.iter().filter_map(ContentBlock::as_text).collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    End,
    Length,
    FunctionCall,
    Aborted,
    Error,
}

/// Classification of a provider failure; `rate_limited` and `transient` are retryable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    AuthExpired,
    RateLimited,
    ContextOverflow,
    Transient,
    Permanent,
}

impl ErrorKind {
    pub fn retryable(self) -> bool {
        matches!(self, ErrorKind::RateLimited | ErrorKind::Transient)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::AuthExpired => "auth_expired",
            ErrorKind::RateLimited => "rate_limited",
            ErrorKind::ContextOverflow => "context_overflow",
            ErrorKind::Transient => "transient",
            ErrorKind::Permanent => "permanent",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
    /// The provider reported no usage: the token counts are the router's estimate from the
    /// characters sent and received (priced the same way).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub estimated: bool,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct UserMessage {
    pub content: Vec<ContentBlock>,
    #[serde(default)]
    pub timestamp: i64,
}

/// A message the model never sees (notices, records, UI cards).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CustomMessage {
    pub custom_type: String,
    #[serde(default)]
    pub content: Vec<ContentBlock>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
    #[serde(default)]
    pub timestamp: i64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AssistantMessage {
    pub content: Vec<ContentBlock>,
    pub model: String,
    pub provider: String,
    pub stop_reason: StopReason,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<ErrorKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub native_stop_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warnings: Option<Vec<String>>,
    #[serde(default)]
    pub timestamp: i64,
}

impl AssistantMessage {
    /// A reply of `model` at `provider` that ended normally (`StopReason::End`) with nothing
    /// else reported: no usage, error, native stop reason or warnings.
    pub fn ended(
        content: Vec<ContentBlock>,
        model: impl Into<String>,
        provider: impl Into<String>,
        timestamp: i64,
    ) -> Self {
        AssistantMessage {
            content,
            model: model.into(),
            provider: provider.into(),
            stop_reason: StopReason::End,
            usage: None,
            error_kind: None,
            error_message: None,
            native_stop_reason: None,
            warnings: None,
            timestamp,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct FunctionResultMessage {
    pub function_call_id: String,
    pub function_id: String,
    pub content: Vec<ContentBlock>,
    #[serde(default)]
    pub details: Value,
    #[serde(default)]
    pub is_error: bool,
    #[serde(default)]
    pub timestamp: i64,
}

/// The canonical transcript message, discriminated by `role`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum AgentMessage {
    User(UserMessage),
    Assistant(AssistantMessage),
    FunctionResult(FunctionResultMessage),
    Custom(CustomMessage),
}

impl AgentMessage {
    pub fn user_text(text: impl Into<String>, timestamp: i64) -> Self {
        AgentMessage::User(UserMessage {
            content: vec![ContentBlock::text(text)],
            timestamp,
        })
    }

    pub fn role(&self) -> &'static str {
        match self {
            AgentMessage::User(_) => "user",
            AgentMessage::Assistant(_) => "assistant",
            AgentMessage::FunctionResult(_) => "function_result",
            AgentMessage::Custom(_) => "custom",
        }
    }

    pub fn content(&self) -> &[ContentBlock] {
        match self {
            AgentMessage::User(m) => &m.content,
            AgentMessage::Assistant(m) => &m.content,
            AgentMessage::FunctionResult(m) => &m.content,
            AgentMessage::Custom(m) => &m.content,
        }
    }

    pub fn timestamp(&self) -> i64 {
        match self {
            AgentMessage::User(m) => m.timestamp,
            AgentMessage::Assistant(m) => m.timestamp,
            AgentMessage::FunctionResult(m) => m.timestamp,
            AgentMessage::Custom(m) => m.timestamp,
        }
    }

    /// Model-visible messages are everything but `custom`.
    pub fn is_model_visible(&self) -> bool {
        !matches!(self, AgentMessage::Custom(_))
    }

    pub fn text(&self) -> String {
        joined_text(self.content())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_round_trip_with_role_tags() {
        let m: AgentMessage = serde_json::from_value(json!({
            "role": "assistant", "content": [{"type": "text", "text": "hi"},
              {"type": "function_call", "id": "c1", "function_id": "a::b", "arguments": {"x": 1}}],
            "model": "m", "provider": "p", "stop_reason": "function_call", "timestamp": 5
        }))
        .unwrap();
        assert_eq!(m.role(), "assistant");
        let back = serde_json::to_value(&m).unwrap();
        assert_eq!(back["content"][1]["function_id"], "a::b");
        assert_eq!(back["stop_reason"], "function_call");
    }

    #[test]
    fn thinking_signature_is_optional() {
        let b: ContentBlock =
            serde_json::from_value(json!({"type": "thinking", "text": "t"})).unwrap();
        assert_eq!(
            b,
            ContentBlock::Thinking {
                text: "t".into(),
                signature: None
            }
        );
    }
}
