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
/// the fields the router reads beside it, already typed.
#[derive(Clone, Debug)]
pub struct ChatCall {
    pub request: ChatRequest,
    pub extras: ChatExtras,
    /// Where the frames go, typed, instead of the call context's JSON sink: an in-process
    /// caller folds them as they are (a frame turned into JSON and parsed back cost more than
    /// folding it).
    pub frames: Option<FrameTap>,
}

/// A typed frame sink for [`ChatCall::frames`]. Dropping every copy ends the stream, as
/// closing the JSON sink does.
#[derive(Clone)]
pub struct FrameTap(Arc<dyn Fn(Frame) + Send + Sync>);

impl FrameTap {
    pub fn new(send: impl Fn(Frame) + Send + Sync + 'static) -> Self {
        FrameTap(Arc::new(send))
    }

    pub fn send(&self, frame: Frame) {
        (self.0)(frame)
    }
}

impl std::fmt::Debug for FrameTap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FrameTap")
    }
}

/// One section of the system prompt (spec §11 `system_sections`): the stable prefix is marked
/// `cache_boundary`, so cache-aware providers put their cache marker there.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SystemSection {
    pub text: String,
    #[serde(default)]
    pub cache_boundary: bool,
}

/// `cache_intent` of spec §11: a digest naming the stable prompt prefix.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CacheIntent {
    #[serde(default)]
    pub surface_digest: Option<String>,
}

/// `router::chat` request fields that `ChatRequest` does not carry (spec §11). On the wire they
/// sit at the top level of the same payload as the request's own fields, which is why they are
/// a type of their own and not fields of `ChatRequest`: a caller that sends them gets
/// prompt-cache sections and `reasoning: "lowest"`; one that does not loses nothing.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ChatExtras {
    #[serde(default)]
    pub system_sections: Option<Vec<SystemSection>>,
    #[serde(default)]
    pub cache_intent: Option<CacheIntent>,
    /// `"lowest"`: the least reasoning the model allows (from the catalog).
    #[serde(default)]
    pub reasoning: Option<String>,
}

impl ChatExtras {
    /// The digest `cache_intent` names, when there is one.
    pub fn surface_digest(&self) -> Option<&str> {
        self.cache_intent.as_ref()?.surface_digest.as_deref()
    }

    /// The payload `router::chat` takes across the bus: the request's fields and these beside
    /// them, at the top level.
    pub fn payload(&self, request: &ChatRequest) -> serde_json::Result<Value> {
        let mut payload = serde_json::to_value(request)?;
        // Only the fields that are set: the published schema documents them with `default:
        // null`, which is why absence is not spelled by `skip_serializing_if`.
        if let (Value::Object(p), Value::Object(x)) = (&mut payload, serde_json::to_value(self)?) {
            p.extend(x.into_iter().filter(|(_, v)| !v.is_null()));
        }
        Ok(payload)
    }
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

impl ChatRequest {
    /// A request for `model` over `messages` and nothing else (no provider, system prompt, tools,
    /// limits or options): a caller sets the few fields it needs with `..ChatRequest::new(…)`.
    pub fn new(
        request_id: impl Into<String>,
        model: impl Into<String>,
        messages: Vec<AgentMessage>,
    ) -> Self {
        ChatRequest {
            request_id: request_id.into(),
            session_id: None,
            model: model.into(),
            provider: None,
            system_prompt: None,
            messages: Arc::new(messages),
            tools: vec![],
            thinking_level: None,
            max_output_tokens: None,
            provider_options: None,
            response_format: None,
        }
    }
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

/// The public sentence of a provider error kind: a [`ChatAckError`]'s `message`, and the
/// summary of a turn that failed on it (one text, so the two never read differently). What a
/// person can do about it is the error's `hint`, not part of this sentence.
pub fn error_summary(kind: ErrorKind) -> &'static str {
    match kind {
        ErrorKind::AuthExpired => "The provider rejected the credentials.",
        ErrorKind::RateLimited => "The provider is rate limiting requests.",
        ErrorKind::ContextOverflow => "The conversation no longer fits the model's context window.",
        ErrorKind::Transient => "The provider failed temporarily.",
        ErrorKind::Permanent => "The provider rejected this request.",
    }
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

/// `router::count-tokens` request.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CountRequest {
    #[serde(default)]
    pub provider: Option<String>,
    pub model: String,
    pub texts: Vec<String>,
}

/// `router::count-tokens` answer: one count per text, or `null` when the server cannot count.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CountAnswer {
    pub counts: Option<Vec<u64>>,
    /// `server:<provider>` when the server counted.
    pub counter: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> ChatRequest {
        ChatRequest::new("t:0", "m", vec![])
    }

    /// Across the bus the extras sit at the top level beside the request's own fields, and a
    /// field that is not set is absent (not `null`), as a caller without them sends it.
    #[test]
    fn the_payload_puts_set_extras_beside_the_request() {
        let extras = ChatExtras {
            reasoning: Some("lowest".into()),
            ..ChatExtras::default()
        };
        let payload = extras.payload(&request()).unwrap();
        assert_eq!(payload["model"], "m");
        assert_eq!(payload["reasoning"], "lowest");
        assert!(payload.get("system_sections").is_none(), "{payload}");
        assert!(payload.get("cache_intent").is_none(), "{payload}");
        let back: ChatExtras = serde_json::from_value(payload).unwrap();
        assert_eq!(back, extras);
        let plain = ChatExtras::default().payload(&request()).unwrap();
        assert_eq!(plain, serde_json::to_value(request()).unwrap());
    }
}
