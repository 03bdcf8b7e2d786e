//! The router: provider registry, in-flight generations, and the `router::*` functions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler};
use harness_types::message::{AssistantMessage, ErrorKind, StopReason};
use harness_types::parse::parse_payload;
use harness_types::router::{
    AbortRequest, AbortResponse, ChatAck, ChatAckError, ChatRequest, Frame,
};
use harness_types::{now_ms, HarnessError};
use schemars::schema_for;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// A provider failure before or during a stream.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ProviderError {
    /// `router/<code>`.
    pub code: String,
    pub kind: ErrorKind,
    pub message: String,
}

/// Writes frames to the caller and remembers what was streamed, so a failure can always carry
/// the partial message.
pub struct FrameWriter {
    ctx: CallContext,
    partial: AssistantMessage,
}

impl FrameWriter {
    pub fn new(ctx: CallContext, model: &str, provider: &str) -> Self {
        FrameWriter {
            ctx,
            partial: AssistantMessage {
                content: Vec::new(),
                model: model.to_string(),
                provider: provider.to_string(),
                stop_reason: StopReason::End,
                usage: None,
                error_kind: None,
                error_message: None,
                native_stop_reason: None,
                warnings: None,
                timestamp: now_ms(),
            },
        }
    }

    /// Sends a non-terminal frame and folds it into the partial message.
    pub fn send(&mut self, frame: Frame) {
        use harness_types::message::ContentBlock;
        match &frame {
            Frame::TextStart => self.partial.content.push(ContentBlock::text("")),
            Frame::TextDelta { delta } => {
                if let Some(ContentBlock::Text { text }) = self.partial.content.last_mut() {
                    text.push_str(delta);
                } else {
                    self.partial.content.push(ContentBlock::text(delta.clone()));
                }
            }
            Frame::Usage { usage } => self.partial.usage = Some(usage.clone()),
            _ => {}
        }
        self.emit(&frame);
    }

    fn emit(&self, frame: &Frame) {
        if let Ok(v) = serde_json::to_value(frame) {
            self.ctx.frame(v);
        }
    }

    pub fn partial(&self) -> &AssistantMessage {
        &self.partial
    }

    /// Ends the stream with `done`.
    pub fn done(self, message: AssistantMessage) -> ChatAck {
        let ack = ChatAck {
            ok: true,
            provider: message.provider.clone(),
            model: message.model.clone(),
            stop_reason: message.stop_reason,
            usage: message.usage.clone(),
            error: None,
        };
        self.emit(&Frame::Done { message });
        ack
    }

    /// Ends the stream with `error`, carrying the partial message.
    pub fn fail(self, err: &ProviderError) -> ChatAck {
        let mut partial = self.partial.clone();
        partial.stop_reason = StopReason::Error;
        partial.error_kind = Some(err.kind);
        partial.error_message = Some(err.message.clone());
        self.emit(&Frame::Error {
            error: partial.clone(),
            error_kind: err.kind,
            error_message: err.message.clone(),
        });
        ChatAck {
            ok: false,
            provider: partial.provider,
            model: partial.model,
            stop_reason: StopReason::Error,
            usage: partial.usage,
            error: Some(ChatAckError {
                code: err.code.clone(),
                message: err.message.clone(),
                kind: err.kind,
                retryable: err.kind.retryable(),
                detail: None,
            }),
        }
    }
}

/// One model provider.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    fn id(&self) -> &str;

    /// Streams one generation. Must end the writer with `done` or `fail` (the router guarantees
    /// a terminal frame even if it does not), and stop promptly when `cancel` fires.
    async fn chat(&self, req: ChatRequest, out: FrameWriter, cancel: CancellationToken) -> ChatAck;
}

/// The provider registry plus the generations in flight (for `router::abort`).
#[derive(Clone, Default)]
pub struct Router {
    providers: Arc<Mutex<HashMap<String, Arc<dyn Provider>>>>,
    default_provider: Arc<Mutex<Option<String>>>,
    // std Mutex: held only to insert/remove/look up a token, never across an await.
    in_flight: Arc<Mutex<HashMap<String, CancellationToken>>>,
}

impl Router {
    pub fn new() -> Self {
        Router::default()
    }

    /// Adds a provider; the first one added is the default for requests naming none.
    pub fn add_provider(&self, provider: Arc<dyn Provider>) {
        let id = provider.id().to_string();
        let mut default = self.default_provider.lock().expect("router lock");
        if default.is_none() {
            *default = Some(id.clone());
        }
        self.providers
            .lock()
            .expect("router lock")
            .insert(id, provider);
    }

    pub fn provider_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .providers
            .lock()
            .expect("router lock")
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    pub fn abort(&self, request_id: &str) -> bool {
        match self.in_flight.lock().expect("router lock").get(request_id) {
            Some(token) => {
                token.cancel();
                true
            }
            None => false,
        }
    }

    pub async fn chat(&self, req: ChatRequest, ctx: CallContext) -> ChatAck {
        let provider_id = req
            .provider
            .clone()
            .or_else(|| self.default_provider.lock().expect("router lock").clone())
            .unwrap_or_default();
        let provider = self
            .providers
            .lock()
            .expect("router lock")
            .get(&provider_id)
            .cloned();
        let out = FrameWriter::new(ctx, &req.model, &provider_id);
        let Some(provider) = provider else {
            let err = ProviderError {
                code: "router/provider_unavailable".into(),
                kind: ErrorKind::Permanent,
                message: format!(
                    "provider '{provider_id}' is not configured (available: {})",
                    self.provider_ids().join(", ")
                ),
            };
            return out.fail(&err);
        };
        let token = CancellationToken::new();
        let request_id = req.request_id.clone();
        self.in_flight
            .lock()
            .expect("router lock")
            .insert(request_id.clone(), token.clone());
        let ack = provider.chat(req, out, token).await;
        self.in_flight
            .lock()
            .expect("router lock")
            .remove(&request_id);
        ack
    }
}

/// Registers `router::chat`, `router::abort` and `router::models::list` on `bus`.
pub fn register(bus: &dyn Bus, router: &Router) {
    let r = router.clone();
    let chat = move |payload: Value, ctx: CallContext| {
        let r = r.clone();
        async move {
            let req: ChatRequest = parse_payload(payload)?;
            let ack = r.chat(req, ctx).await;
            serde_json::to_value(ack).map_err(|e| BusError::internal(e.to_string()))
        }
    };
    bus.register_function(
        FunctionDef::new(
            "router::chat",
            "Stream one generation as frames; answers with the ack when the stream ended.",
        )
        .schemas(
            serde_json::to_value(schema_for!(ChatRequest)).unwrap_or(Value::Null),
            serde_json::to_value(schema_for!(ChatAck)).unwrap_or(Value::Null),
        ),
        Arc::new(chat) as Arc<dyn Handler>,
    );
    let r = router.clone();
    let abort = move |payload: Value, _ctx: CallContext| {
        let r = r.clone();
        async move {
            let req: AbortRequest = parse_payload(payload)?;
            let aborted = r.abort(&req.request_id);
            serde_json::to_value(AbortResponse { aborted })
                .map_err(|e| BusError::internal(e.to_string()))
        }
    };
    bus.register_function(
        FunctionDef::new(
            "router::abort",
            "Cancel the generation with this request_id.",
        ),
        Arc::new(abort) as Arc<dyn Handler>,
    );
    let r = router.clone();
    let list = move |_payload: Value, _ctx: CallContext| {
        let r = r.clone();
        async move { Ok::<_, BusError>(json!({"providers": r.provider_ids()})) }
    };
    bus.register_function(
        FunctionDef::new("router::models::list", "Configured providers."),
        Arc::new(list) as Arc<dyn Handler>,
    );
}

impl From<ProviderError> for HarnessError {
    fn from(e: ProviderError) -> Self {
        HarnessError::dependency(e.to_string())
    }
}
