//! The `router::chat` request, its streamed frames and its acknowledgement.

use std::sync::Arc;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api::ThinkingLevel;
use crate::message::{AgentMessage, AssistantMessage, ErrorKind, StopReason, Usage};

/// A tool offered to the model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments.
    pub parameters: Value,
}

/// `router::chat` as an in-process call: the request moves instead of being serialized, with
/// the fields the router reads beside it (`system_sections`, `cache_intent`, `reasoning`) as
/// they would sit in the JSON payload.
#[derive(Clone, Debug)]
pub struct ChatCall {
    pub request: ChatRequest,
    pub extras: serde_json::Map<String, serde_json::Value>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChatRequest {
    /// `<turn_id>:<step>`; the same request id always names the same generation.
    pub request_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Shared, not owned: the loop hands an in-process router the very list its session's
    /// window keeps, so a step on a long conversation does not copy (or free) its history.
    pub messages: Arc<Vec<AgentMessage>>,
    #[serde(default)]
    pub tools: Vec<ToolSpec>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_level: Option<ThinkingLevel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_options: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<Value>,
}

/// One streamed frame of a generation. Exactly one terminal frame (`done` or `error`) ends a
/// stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Frame {
    Start {
        #[serde(default)]
        model: Option<String>,
        #[serde(default)]
        provider: Option<String>,
    },
    TextStart,
    TextDelta {
        delta: String,
    },
    TextEnd,
    ThinkingStart,
    ThinkingDelta {
        delta: String,
    },
    ThinkingEnd {
        #[serde(default)]
        signature: Option<String>,
    },
    #[serde(rename = "functioncall_start")]
    FunctionCallStart {
        id: String,
        function_id: String,
    },
    #[serde(rename = "functioncall_delta")]
    FunctionCallDelta {
        delta: String,
    },
    #[serde(rename = "functioncall_end")]
    FunctionCallEnd,
    Usage {
        usage: Usage,
    },
    Ping,
    Stop {
        stop_reason: StopReason,
        #[serde(default)]
        error_message: Option<String>,
    },
    Done {
        message: AssistantMessage,
    },
    Error {
        /// The partial message, `stop_reason: error`.
        error: AssistantMessage,
        error_kind: ErrorKind,
        error_message: String,
    },
}

impl Frame {
    pub fn is_terminal(&self) -> bool {
        matches!(self, Frame::Done { .. } | Frame::Error { .. })
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChatAckError {
    pub code: String,
    pub message: String,
    pub kind: ErrorKind,
    pub retryable: bool,
    #[serde(default)]
    pub detail: Option<String>,
    /// The HTTP status the provider answered with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// The provider's own words, bounded, credentials redacted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_message: Option<String>,
    /// What a person can do about it (not part of `detail`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

/// The RPC result of `router::chat`, after the stream ended.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChatAck {
    pub ok: bool,
    pub provider: String,
    pub model: String,
    pub stop_reason: StopReason,
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub error: Option<ChatAckError>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AbortRequest {
    pub request_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AbortResponse {
    pub aborted: bool,
}
