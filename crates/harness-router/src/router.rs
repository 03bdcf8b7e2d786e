//! The router: provider registry, the catalog, in-flight generations, and the `router::*`
//! functions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use async_trait::async_trait;
use harness_bus::typed::{self, schema};
use harness_bus::{Bus, BusError, CallContext, FunctionDef, Handler, LocalHandler, LocalValue};
use harness_types::context::ModelRef;
use harness_types::fold::FrameFold;
use harness_types::message::{AssistantMessage, ContentBlock, ErrorKind, StopReason};
use harness_types::parse::parse_payload;
use harness_types::router::{
    AbortRequest, AbortResponse, ChatAck, ChatAckError, ChatCall, ChatRequest, Frame, FrameTap,
};
pub use harness_types::router::{
    CacheIntent, ChatExtras, CountAnswer, CountRequest, SystemSection,
};
use harness_types::{now_ms, HarnessError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::catalog::{Capability, Catalog, LowestReasoning, ModelEntry};
use crate::error::ProviderError;

/// What the router knows about a request beyond the request itself, handed to the provider
/// through its [`FrameWriter`].
#[derive(Clone, Debug, Default)]
pub struct ChatContext {
    /// The catalog row of the requested model on this provider.
    pub model: Option<ModelEntry>,
    pub extras: ChatExtras,
    /// The provider-native reasoning effort chosen by `reasoning: "lowest"`.
    pub reasoning_effort: Option<String>,
    /// What the request sends the model: the input side of the usage estimate for servers
    /// that report none.
    pub input: RequestInput,
}

/// A request's input, measured only when a usage estimate needs it: a server that reports
/// usage never pays for a walk over a long history.
#[derive(Clone, Debug, Default)]
pub struct RequestInput {
    messages: std::sync::Arc<Vec<harness_types::AgentMessage>>,
    /// The system prompt's and the tools' characters.
    preamble_chars: usize,
}

impl RequestInput {
    fn of(req: &ChatRequest) -> RequestInput {
        let tools: usize = req
            .tools
            .iter()
            .map(|t| t.name.len() + t.description.len() + t.parameters.to_string().len())
            .sum();
        RequestInput {
            messages: req.messages.clone(),
            preamble_chars: req.system_prompt.as_ref().map_or(0, String::len) + tools,
        }
    }

    /// Characters of everything the request sends (system prompt, messages, tools).
    pub fn chars(&self) -> usize {
        let blocks = |content: &[ContentBlock]| -> usize { content.iter().map(block_chars).sum() };
        let messages: usize = self
            .messages
            .iter()
            .map(|m| match m {
                harness_types::AgentMessage::User(u) => blocks(&u.content),
                harness_types::AgentMessage::Assistant(a) => blocks(&a.content),
                harness_types::AgentMessage::FunctionResult(r) => blocks(&r.content),
                harness_types::AgentMessage::Custom(_) => 0,
            })
            .sum();
        self.preamble_chars + messages
    }
}

/// The router's token estimate for a text of `chars` characters (the same ratio the context
/// manager budgets with).
pub(crate) fn estimate_tokens(chars: usize) -> u64 {
    chars.div_ceil(4) as u64
}

fn block_chars(b: &ContentBlock) -> usize {
    match b {
        ContentBlock::Text { text } | ContentBlock::Thinking { text, .. } => text.len(),
        ContentBlock::FunctionCall {
            function_id,
            arguments,
            ..
        } => function_id.len() + arguments.to_string().len(),
        ContentBlock::Image { .. } => 0,
        other => serde_json::to_string(other).map_or(0, |s| s.len()),
    }
}

/// Writes frames to the caller and folds them into the partial message, so a failure always
/// carries what was streamed (text, thinking with its signature, function calls, opaque blocks)
/// and a success is built from exactly what the caller saw.
pub struct FrameWriter {
    ctx: CallContext,
    /// An in-process caller's typed sink, used instead of `ctx`'s JSON one.
    tap: Option<FrameTap>,
    partial: AssistantMessage,
    fold: FrameFold,
    started: bool,
    output: bool,
    chat: ChatContext,
}

impl FrameWriter {
    pub fn new(ctx: CallContext, model: &str, provider: &str) -> Self {
        FrameWriter {
            ctx,
            tap: None,
            partial: AssistantMessage::ended(Vec::new(), model, provider, now_ms()),
            fold: FrameFold::default(),
            started: false,
            output: false,
            chat: ChatContext::default(),
        }
    }

    pub fn with_context(mut self, chat: ChatContext) -> Self {
        self.chat = chat;
        self
    }

    /// Sends the frames to `tap` as they are, not as JSON through the call context.
    pub fn with_tap(mut self, tap: Option<FrameTap>) -> Self {
        self.tap = tap;
        self
    }

    /// Hands a frame to the caller: typed to a tap, else as JSON to a streaming caller (a
    /// caller that streams nothing costs no serialization).
    fn emit(&self, frame: Frame) {
        if let Some(tap) = &self.tap {
            tap.send(frame);
        } else if self.ctx.frames.is_some() {
            if let Ok(v) = serde_json::to_value(&frame) {
                self.ctx.frame(v);
            }
        }
    }

    /// The request's catalog row, extras and resolved reasoning.
    pub fn context(&self) -> &ChatContext {
        &self.chat
    }

    /// Sends a non-terminal frame and folds it into the partial message. A second `start` (a
    /// retried request) is dropped; terminal frames go through [`done`](Self::done) or
    /// [`fail`](Self::fail) only.
    pub fn send(&mut self, frame: Frame) {
        let frame = match frame {
            Frame::Start { .. } if self.started => return,
            Frame::Start { .. } => {
                self.started = true;
                frame
            }
            Frame::Done { .. } | Frame::Error { .. } => return,
            Frame::Usage { mut usage } => {
                if usage.cost_usd.is_none() {
                    if let Some(p) = self.chat.model.as_ref().and_then(|m| m.pricing) {
                        usage.cost_usd = Some(p.cost(&usage));
                    }
                }
                self.partial.usage = Some(usage.clone());
                Frame::Usage { usage }
            }
            other => {
                self.fold(&other);
                other
            }
        };
        self.emit(frame);
    }

    fn fold(&mut self, frame: &Frame) {
        // Ends only complete a block a start already counted as output.
        self.output |= self.fold.apply(&mut self.partial.content, frame);
    }

    /// Keeps a block that has no frame (redacted thinking: opaque, replayed verbatim).
    pub fn record(&mut self, block: ContentBlock) {
        self.partial.content.push(block);
    }

    /// Adds a warning to the final message (an option the model could not honour).
    pub fn warn(&mut self, warning: impl Into<String>) {
        self.partial
            .warnings
            .get_or_insert_with(Vec::new)
            .push(warning.into());
    }

    /// True once a content frame (text, thinking, function call) reached the caller: from then
    /// on a retry would repeat output, so failures go to the loop's recovery instead.
    pub fn has_output(&self) -> bool {
        self.output
    }

    /// Forgets what an attempt that streamed no output left behind (usage, opaque blocks), so a
    /// retried request starts clean.
    pub fn restart(&mut self) {
        if !self.output {
            self.partial.content.clear();
            self.partial.usage = None;
            self.fold.clear();
        }
    }

    pub fn partial(&self) -> &AssistantMessage {
        &self.partial
    }

    /// Usage as the provider reported it, else an estimate marked `estimated` (a local server
    /// that sends none still gets counts and a cost on every message); then priced.
    fn priced(&self, mut message: AssistantMessage) -> AssistantMessage {
        if message.usage.is_none() && self.started {
            let output: usize = message.content.iter().map(block_chars).sum::<usize>()
                + if message.content.iter().any(|b| {
                    matches!(b, ContentBlock::FunctionCall { arguments, .. } if arguments.get("_partial").is_some())
                }) {
                    self.fold.pending_args_len()
                } else {
                    0
                };
            message.usage = Some(harness_types::message::Usage {
                input: Some(estimate_tokens(self.chat.input.chars())),
                output: Some(estimate_tokens(output)),
                estimated: true,
                ..Default::default()
            });
        }
        if let (Some(u), Some(p)) = (
            message.usage.as_mut(),
            self.chat.model.as_ref().and_then(|m| m.pricing),
        ) {
            if u.cost_usd.is_none() {
                u.cost_usd = Some(p.cost(u));
            }
        }
        message
    }

    /// Ends the stream with `stop` and `done`, the message being everything streamed.
    pub fn complete(
        mut self,
        stop_reason: StopReason,
        native_stop_reason: Option<String>,
    ) -> ChatAck {
        self.send(Frame::Stop {
            stop_reason,
            error_message: None,
        });
        let mut message = self.partial.clone();
        message.stop_reason = stop_reason;
        message.native_stop_reason = native_stop_reason;
        message.timestamp = now_ms();
        self.done(message)
    }

    /// Ends an aborted stream: `done` with `stop_reason: aborted` and what was streamed.
    pub fn aborted(self) -> ChatAck {
        self.complete(StopReason::Aborted, None)
    }

    /// Ends the stream with `done`.
    pub fn done(self, message: AssistantMessage) -> ChatAck {
        let message = self.priced(message);
        let ack = ChatAck {
            ok: true,
            provider: message.provider.clone(),
            model: message.model.clone(),
            stop_reason: message.stop_reason,
            usage: message.usage.clone(),
            error: None,
        };
        self.emit(Frame::Done { message });
        ack
    }

    /// Ends the stream with `error`, carrying the partial message; the frame's `error_message` is
    /// the raw diagnostic, the ack's `message` the public sentence.
    pub fn fail(mut self, err: &ProviderError) -> ChatAck {
        self.send(Frame::Stop {
            stop_reason: StopReason::Error,
            error_message: Some(err.message.clone()),
        });
        let mut partial = self.priced(self.partial.clone());
        partial.stop_reason = StopReason::Error;
        partial.error_kind = Some(err.kind);
        partial.error_message = Some(err.diagnostic());
        self.emit(Frame::Error {
            error: partial.clone(),
            error_kind: err.kind,
            error_message: err.diagnostic(),
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
                detail: err.detail.clone(),
                status: err.cause.status,
                provider_message: err.cause.provider_message.clone(),
                hint: err.cause.hint.clone(),
            }),
        }
    }
}

/// One model provider.
#[async_trait]
pub trait Provider: Send + Sync + 'static {
    fn id(&self) -> &str;

    /// Streams one generation. Must end the writer with `done`/`complete`/`aborted` or `fail`,
    /// and stop promptly when `cancel` fires.
    async fn chat(&self, req: ChatRequest, out: FrameWriter, cancel: CancellationToken) -> ChatAck;

    /// The model ids the provider's server lists, for providers that can ask (local servers);
    /// `None` when the catalog is the list.
    async fn list_models(&self) -> Result<Option<Vec<String>>, ProviderError> {
        Ok(None)
    }

    /// The context window the provider's server reports for `model`, for servers that say
    /// (local ones); `None` when it does not or cannot be asked.
    async fn context_window(&self, _model: &str) -> Option<u64> {
        None
    }

    /// What `router::models::list` shows about the provider: kind and endpoint, never
    /// credentials.
    fn describe(&self) -> Value {
        json!({"id": self.id()})
    }

    /// Whether the server constrains a reply to a JSON schema by grammar, whatever the catalog
    /// row says (an output contract then goes natively).
    fn grammar_json(&self) -> bool {
        false
    }

    /// How many requests the server takes at once (`None`: no limit); the router queues the
    /// rest.
    fn concurrency(&self) -> Option<usize> {
        None
    }

    /// The tokens of each text by the server's own tokenizer for `model`, for servers that can
    /// count; `None` when it cannot (then the context manager estimates).
    async fn count_tokens(&self, _model: &str, _texts: &[String]) -> Option<Vec<u64>> {
        None
    }

    /// Whether [`count_tokens`](Provider::count_tokens) may answer (false once the server was
    /// found not to count).
    fn can_count(&self) -> bool {
        false
    }
}

/// The provider registry, the catalog, and the generations in flight (for `router::abort`).
#[derive(Clone, Default)]
pub struct Router {
    providers: Arc<Mutex<HashMap<String, Arc<dyn Provider>>>>,
    default_provider: Arc<Mutex<Option<String>>>,
    // std Mutex: held only to insert/remove/look up a token, never across an await.
    in_flight: Arc<Mutex<HashMap<String, CancellationToken>>>,
    catalog: Arc<RwLock<Arc<CatalogState>>>,
    /// Context windows servers reported, by (provider, model), with when they were asked: a
    /// server is asked once, not at every step (a silent one again after a minute). std Mutex:
    /// never held across the request.
    windows: Arc<Mutex<HashMap<(String, String), Reported>>>,
    /// Per provider with a limit: the permits of requests at once (see
    /// [`Provider::concurrency`]). A generation waits for one before its request is sent.
    limits: Arc<Mutex<HashMap<String, Arc<tokio::sync::Semaphore>>>>,
}

/// A context window a server reported (or did not), and when it was asked.
type Reported = (Option<u64>, std::time::Instant);

/// The catalog in use and the rows looked up in it: every step asks for its model's row twice
/// (the loop's `router::models::get`, then the request), and a lookup walks every row and
/// alias and was then turned into JSON. Replaced whole with the catalog, so no answer outlives
/// the catalog it came from.
#[derive(Default)]
struct CatalogState {
    catalog: Arc<Catalog>,
    /// By (provider, model). std Mutex: never held across an await.
    /// Shared, so a hit (every step asks) copies no entry.
    rows: Mutex<HashMap<RowKey, Arc<Row>>>,
}

/// What [`Router::model_entry`] answered, kept until `until` (a catch-all row whose server
/// reported no window is asked again after [`WINDOW_RETRY`]).
struct Row {
    entry: Option<ModelEntry>,
    /// `router::models::get`'s answer (`null` without a row).
    json: Arc<Value>,
    until: Option<std::time::Instant>,
}

/// (provider, model id).
type RowKey = (Option<String>, String);

/// Rows kept per catalog; past it they are all dropped (model ids are a caller's to choose).
const MAX_ROWS: usize = 256;

/// How long a server that reported no context window is left alone.
const WINDOW_RETRY: std::time::Duration = std::time::Duration::from_secs(60);

impl Router {
    /// A router with the shipped catalog and no providers.
    pub fn new() -> Self {
        Router::default()
    }

    /// Adds a provider (replacing one with the same id); the first one added is the default for
    /// requests naming none.
    pub fn add_provider(&self, provider: Arc<dyn Provider>) {
        let id = provider.id().to_string();
        let mut default = self.default_provider.lock().expect("router lock");
        if default.is_none() {
            *default = Some(id.clone());
        }
        let mut limits = self.limits.lock().expect("router lock");
        match provider.concurrency().filter(|n| *n > 0) {
            Some(n) => {
                limits.insert(id.clone(), Arc::new(tokio::sync::Semaphore::new(n)));
            }
            None => {
                limits.remove(&id);
            }
        }
        drop(limits);
        self.providers
            .lock()
            .expect("router lock")
            .insert(id, provider);
    }

    pub fn provider(&self, id: &str) -> Option<Arc<dyn Provider>> {
        self.providers.lock().expect("router lock").get(id).cloned()
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

    /// Replaces the catalog (an override merged by the caller).
    pub fn set_catalog(&self, catalog: Catalog) {
        *self.catalog.write().expect("router lock") = Arc::new(CatalogState {
            catalog: Arc::new(catalog),
            rows: Mutex::default(),
        });
    }

    /// The catalog in use: context windows, output limits, prices, capabilities.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.read().expect("router lock").catalog.clone()
    }

    /// The catalog row of `id` on `provider`; when only a catch-all row answers, the context
    /// window the server itself reports replaces the row's guess (and bounds the output budget
    /// to half of it).
    pub async fn model_entry(&self, provider: Option<&str>, id: &str) -> Option<ModelEntry> {
        self.row(provider, id).await.entry.clone()
    }

    /// [`model_entry`](Self::model_entry) as `router::models::get` answers it (`null` without a
    /// row), shared rather than serialized again.
    pub async fn model_json(&self, provider: Option<&str>, id: &str) -> Arc<Value> {
        self.row(provider, id).await.json.clone()
    }

    /// The answer about `id` on `provider`: kept from an earlier lookup in the same catalog
    /// while it holds, else looked up and kept.
    async fn row(&self, provider: Option<&str>, id: &str) -> Arc<Row> {
        let state = self.catalog.read().expect("router lock").clone();
        let key = (provider.map(str::to_string), id.to_string());
        let kept = state.rows.lock().expect("router lock").get(&key).cloned();
        if let Some(row) = kept.filter(|r| r.until.is_none_or(|t| std::time::Instant::now() < t)) {
            return row;
        }
        let (entry, until) = self.look_up(&state.catalog, provider, id).await;
        let json = entry
            .as_ref()
            .and_then(|e| serde_json::to_value(e).ok())
            .unwrap_or(Value::Null);
        let row = Arc::new(Row {
            entry,
            json: Arc::new(json),
            until,
        });
        let mut rows = state.rows.lock().expect("router lock");
        if rows.len() >= MAX_ROWS {
            rows.clear();
        }
        rows.insert(key, row.clone());
        row
    }

    /// [`model_entry`](Self::model_entry) read from `catalog`, and until when the answer holds
    /// (`None`: as long as the catalog).
    async fn look_up(
        &self,
        catalog: &Catalog,
        provider: Option<&str>,
        id: &str,
    ) -> (Option<ModelEntry>, Option<std::time::Instant>) {
        let Some(mut entry) = catalog.get(provider, id) else {
            return (None, None);
        };
        let Some(pid) = provider.filter(|_| entry.generic) else {
            return (Some(entry), None);
        };
        let key = (pid.to_string(), id.to_string());
        let cached = self
            .windows
            .lock()
            .expect("router lock")
            .get(&key)
            .copied()
            .filter(|(n, at)| n.is_some() || at.elapsed() < WINDOW_RETRY);
        let (window, asked) = match cached {
            Some(reported) => reported,
            None => {
                let n = match self.provider(pid) {
                    Some(p) => p.context_window(id).await,
                    None => None,
                };
                let asked = std::time::Instant::now();
                self.windows
                    .lock()
                    .expect("router lock")
                    .insert(key, (n, asked));
                (n, asked)
            }
        };
        // A server that reported a window keeps it; a silent one is asked again later.
        let until = window.is_none().then(|| asked + WINDOW_RETRY);
        if let Some(n) = window.filter(|n| *n > 0) {
            entry.context_window = n;
            entry.max_output_tokens = entry.max_output_tokens.min((n / 2).max(1));
            entry.generic = false;
            entry.window_known = true;
        }
        (Some(entry), until)
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
        self.chat_with(req, ChatExtras::default(), ctx).await
    }

    /// [`chat`](Self::chat) with the spec §11 fields `ChatRequest` does not carry.
    pub async fn chat_with(
        &self,
        req: ChatRequest,
        extras: ChatExtras,
        ctx: CallContext,
    ) -> ChatAck {
        self.chat_to(req, extras, ctx, None).await
    }

    /// [`chat_with`](Self::chat_with), the frames going to `tap` when one is given.
    async fn chat_to(
        &self,
        mut req: ChatRequest,
        extras: ChatExtras,
        ctx: CallContext,
        tap: Option<FrameTap>,
    ) -> ChatAck {
        let provider_id = req
            .provider
            .clone()
            .or_else(|| self.default_provider.lock().expect("router lock").clone())
            .unwrap_or_default();
        let provider = self.provider(&provider_id);
        let model = self.model_entry(Some(&provider_id), &req.model).await;
        let mut chat = ChatContext {
            model,
            extras,
            reasoning_effort: None,
            input: RequestInput::of(&req),
        };
        let out = FrameWriter::new(ctx, &req.model, &provider_id).with_tap(tap);
        let Some(provider) = provider else {
            let err = ProviderError::new(
                ErrorKind::Permanent,
                format!(
                    "provider '{provider_id}' is not configured (available: {})",
                    self.provider_ids().join(", ")
                ),
            )
            .with_code("provider_unavailable")
            .with_message("The requested provider is not configured.");
            return out.fail(&err);
        };
        if let Some(r) = chat.extras.reasoning.clone() {
            match (r.as_str(), &chat.model) {
                ("lowest", Some(m)) => {
                    if req.thinking_level.is_none() {
                        let LowestReasoning {
                            thinking_level,
                            reasoning_effort,
                        } = m.lowest_reasoning();
                        req.thinking_level = thinking_level;
                        chat.reasoning_effort = reasoning_effort;
                    }
                }
                ("lowest", None) => {
                    let err = ProviderError::new(
                        ErrorKind::Permanent,
                        format!(
                            "reasoning \"lowest\" needs a catalog row for model '{}' on provider '{provider_id}'",
                            req.model
                        ),
                    )
                    .with_code("unknown_model");
                    return out.with_context(chat).fail(&err);
                }
                (other, _) => {
                    let err = ProviderError::new(
                        ErrorKind::Permanent,
                        format!("reasoning: expected \"lowest\", got \"{other}\""),
                    )
                    .with_code("invalid_request");
                    return out.with_context(chat).fail(&err);
                }
            }
        }
        let out = out.with_context(chat);
        let token = CancellationToken::new();
        let request_id = req.request_id.clone();
        self.in_flight
            .lock()
            .expect("router lock")
            .insert(request_id.clone(), token.clone());
        // A server that takes one request at a time gets them in turn: sent at once, the
        // later one would cut the earlier one's stream (llama-cpp-python) or time out.
        let permit = match self.permit(&provider_id, &token).await {
            Some(p) => p,
            None => {
                self.in_flight
                    .lock()
                    .expect("router lock")
                    .remove(&request_id);
                return out.aborted();
            }
        };
        let ack = provider.chat(req, out, token).await;
        drop(permit);
        self.in_flight
            .lock()
            .expect("router lock")
            .remove(&request_id);
        ack
    }

    /// Waits for a turn at `provider` (at once when it has no limit); `None` when `cancel`
    /// fired first.
    async fn permit(
        &self,
        provider: &str,
        cancel: &CancellationToken,
    ) -> Option<Option<tokio::sync::OwnedSemaphorePermit>> {
        let limit = self
            .limits
            .lock()
            .expect("router lock")
            .get(provider)
            .cloned();
        let Some(limit) = limit else {
            return Some(None);
        };
        tokio::select! {
            permit = limit.acquire_owned() => permit.ok().map(Some),
            () = cancel.cancelled() => None,
        }
    }

    /// `router::count-tokens`: each text counted by the provider's server, when it can count
    /// (`counts: null` otherwise). Counting takes a turn like a generation: a server that takes
    /// one request at a time would otherwise cut a running stream for it.
    pub async fn count_tokens(
        &self,
        provider: Option<&str>,
        model: &str,
        texts: &[String],
    ) -> CountAnswer {
        let provider_id = provider
            .map(str::to_string)
            .or_else(|| self.default_provider.lock().expect("router lock").clone())
            .unwrap_or_default();
        let Some(p) = self.provider(&provider_id) else {
            return CountAnswer::default();
        };
        // No texts: whether the server can count at all (`counts: []`), asked before a caller
        // sends a whole history for nothing.
        if texts.is_empty() {
            return match p.can_count() {
                true => CountAnswer {
                    counts: Some(Vec::new()),
                    counter: Some(format!("server:{provider_id}")),
                },
                false => CountAnswer::default(),
            };
        }
        let never = CancellationToken::new();
        let Some(permit) = self.permit(&provider_id, &never).await else {
            return CountAnswer::default();
        };
        let counts = p.count_tokens(model, texts).await;
        drop(permit);
        CountAnswer {
            counter: counts.as_ref().map(|_| format!("server:{provider_id}")),
            counts,
        }
    }

    /// `router::models::list`: configured providers and the catalog rows (of one provider, plus
    /// what its server lists, when `provider` is given).
    pub async fn list_models(&self, provider: Option<&str>) -> Result<Value, HarnessError> {
        let catalog = self.catalog();
        let mut models: Vec<Value> = catalog
            .entries(provider)
            .into_iter()
            .filter(|m| m.id != "*")
            .map(|m| serde_json::to_value(m).unwrap_or(Value::Null))
            .collect();
        let mut details = Vec::new();
        for id in self.provider_ids() {
            if let Some(p) = self.provider(&id) {
                details.push(p.describe());
            }
        }
        if let Some(pid) = provider {
            let Some(p) = self.provider(pid) else {
                return Err(HarnessError::invalid_field(
                    "provider",
                    format!(
                        "'{pid}' is not configured (available: {})",
                        self.provider_ids().join(", ")
                    ),
                ));
            };
            match p.list_models().await {
                Ok(Some(ids)) => {
                    for id in ids {
                        let listed = json!(id);
                        if models.iter().any(|m| m["id"] == listed) {
                            continue;
                        }
                        if let Some(entry) = catalog.get(Some(pid), &id) {
                            models.push(serde_json::to_value(entry).unwrap_or(Value::Null));
                        } else {
                            models.push(json!({"provider": pid, "id": id}));
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    return Err(HarnessError::dependency(format!(
                        "{pid}: cannot list models: {}",
                        e.diagnostic()
                    )))
                }
            }
        }
        Ok(json!({"providers": self.provider_ids(), "provider_details": details, "models": models}))
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ListRequest {
    #[serde(default)]
    provider: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct GetRequest {
    #[serde(default)]
    provider: Option<String>,
    id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SupportsRequest {
    provider: String,
    id: String,
    capability: String,
}

fn to_value<T: Serialize>(v: &T) -> Result<Value, BusError> {
    serde_json::to_value(v).map_err(|e| BusError::internal(e.to_string()))
}

/// `router::chat`'s request as a caller across the bus may send it: `ChatRequest` plus the
/// fields it reads from the same payload (`system_sections`, `cache_intent`, `reasoning`), so the
/// prompt-cache seam is as visible to another worker as it is in process.
fn chat_request_schema() -> Value {
    let mut request = schema::<ChatRequest>();
    let extras = schema::<ChatExtras>();
    for key in ["properties", "definitions", "$defs"] {
        let Some(theirs) = extras.get(key).and_then(Value::as_object) else {
            continue;
        };
        if let Some(ours) = request
            .as_object_mut()
            .and_then(|r| r.entry(key).or_insert_with(|| json!({})).as_object_mut())
        {
            for (k, v) in theirs {
                ours.entry(k.clone()).or_insert_with(|| v.clone());
            }
        }
    }
    request
}

/// Registers `router::chat`, `router::abort`, `router::models::list`, `router::models::get` and
/// `router::models::supports` on `bus`.
pub fn register(bus: &dyn Bus, router: &Router) {
    let r = router.clone();
    let chat = move |payload: Value, ctx: CallContext| {
        let r = r.clone();
        async move {
            let extras: ChatExtras = match &payload {
                Value::Object(map) => {
                    let pick = |k: &str| map.get(k).cloned().unwrap_or(Value::Null);
                    parse_payload(json!({
                        "system_sections": pick("system_sections"),
                        "cache_intent": pick("cache_intent"),
                        "reasoning": pick("reasoning"),
                    }))?
                }
                _ => ChatExtras::default(),
            };
            let req: ChatRequest = parse_payload(payload)?;
            let ack = r.chat_with(req, extras, ctx).await;
            to_value(&ack)
        }
    };
    let r = router.clone();
    let local = move |payload: LocalValue, ctx: CallContext| {
        let r = r.clone();
        async move {
            let call: ChatCall = harness_bus::local::take("router::chat", payload)?;
            let ack = r.chat_to(call.request, call.extras, ctx, call.frames).await;
            Ok(Box::new(ack) as LocalValue)
        }
    };
    bus.register_function_with_local(
        FunctionDef::new(
            "router::chat",
            "Stream one generation as frames; answers with the ack when the stream ended.",
        )
        .schemas(chat_request_schema(), schema::<ChatAck>()),
        Arc::new(chat) as Arc<dyn Handler>,
        Arc::new(local) as Arc<dyn LocalHandler>,
    );
    typed::register(
        bus,
        FunctionDef::new(
            "router::abort",
            "Cancel the generation with this request_id.",
        ),
        router.clone(),
        |r, req: AbortRequest| async move {
            let aborted = r.abort(&req.request_id);
            Ok::<_, BusError>(AbortResponse { aborted })
        },
    );
    // With a typed side: harness-context asks on every step whether the server counts.
    typed::register_with_local(
        bus,
        FunctionDef::new(
            "router::count-tokens",
            "Count texts with the server's own tokenizer (llama.cpp, llama-cpp-python, vLLM); counts is null where the server cannot count.",
        ),
        router.clone(),
        |r, req: CountRequest| async move {
            let answer = r
                .count_tokens(req.provider.as_deref(), &req.model, &req.texts)
                .await;
            Ok::<_, BusError>(answer)
        },
    );
    let r = router.clone();
    let list = move |payload: Value, _ctx: CallContext| {
        let r = r.clone();
        async move {
            let payload = if payload.is_null() {
                json!({})
            } else {
                payload
            };
            let req: ListRequest = parse_payload(payload)?;
            Ok::<_, BusError>(r.list_models(req.provider.as_deref()).await?)
        }
    };
    bus.register_function(
        FunctionDef::new(
            "router::models::list",
            "Configured providers and catalog models (with `provider`: that provider's, plus what its server lists).",
        )
        .schemas(schema::<ListRequest>(), json!({"type": "object"})),
        Arc::new(list) as Arc<dyn Handler>,
    );
    let get = typed::handler(router.clone(), |r, req: GetRequest| async move {
        let row = r.model_json(req.provider.as_deref(), &req.id).await;
        Ok::<_, BusError>(Arc::unwrap_or_clone(row))
    });
    // In process the loop asks on every step: it takes a `ModelRef` and the shared answer.
    let r = router.clone();
    let get_local = move |payload: LocalValue, _ctx: CallContext| {
        let r = r.clone();
        async move {
            let req: ModelRef = harness_bus::local::take("router::models::get", payload)?;
            let row = r.model_json(req.provider.as_deref(), &req.id).await;
            Ok(Box::new(row) as LocalValue)
        }
    };
    bus.register_function_with_local(
        FunctionDef::new(
            "router::models::get",
            "The catalog row of a model (context window, max output, capabilities, prices per million tokens), or null.",
        )
        .schemas(schema::<GetRequest>(), schema::<Option<ModelEntry>>()),
        get,
        Arc::new(get_local) as Arc<dyn LocalHandler>,
    );
    let supports = typed::handler(router.clone(), |r, req: SupportsRequest| async move {
        let Some(cap) = Capability::parse(&req.capability) else {
            return Err(HarnessError::invalid_field(
                "capability",
                format!(
                    "unknown capability '{}' (known: {})",
                    req.capability,
                    Capability::NAMES
                ),
            ));
        };
        let grammar = cap == Capability::StructuredOutput
            && r.provider(&req.provider).is_some_and(|p| p.grammar_json());
        let supported = grammar || r.catalog().supports(Some(&req.provider), &req.id, cap);
        Ok(json!({"supported": supported}))
    });
    bus.register_function(
        FunctionDef::new(
            "router::models::supports",
            "Whether a model has a capability: tools, vision, thinking, structured_output.",
        )
        .schemas(
            schema::<SupportsRequest>(),
            json!({"type": "object", "properties": {"supported": {"type": "boolean"}}}),
        ),
        supports,
    );
}

#[cfg(test)]
mod chat_schema_tests {
    use super::*;

    /// A worker on another process learns the cache seam from the registered schema.
    #[test]
    fn the_chat_schema_names_the_cache_seam_fields() {
        let s = chat_request_schema();
        let props = s["properties"].as_object().unwrap();
        for field in [
            "messages",
            "model",
            "system_sections",
            "cache_intent",
            "reasoning",
        ] {
            assert!(props.contains_key(field), "{field} in {s}");
        }
        let defs = s
            .get("definitions")
            .or_else(|| s.get("$defs"))
            .and_then(Value::as_object)
            .unwrap();
        assert!(
            defs["SystemSection"]["properties"]
                .get("cache_boundary")
                .is_some(),
            "{s}"
        );
        assert!(
            defs["CacheIntent"]["properties"]
                .get("surface_digest")
                .is_some(),
            "{s}"
        );
    }
}

#[cfg(test)]
mod tap_tests {
    use super::*;
    use harness_types::message::AgentMessage;
    use std::sync::Mutex as StdMutex;

    /// Streams "hi" as one text block.
    struct Hi;

    #[async_trait]
    impl Provider for Hi {
        fn id(&self) -> &str {
            "hi"
        }

        async fn chat(
            &self,
            req: ChatRequest,
            mut out: FrameWriter,
            _cancel: CancellationToken,
        ) -> ChatAck {
            out.send(Frame::Start {
                model: Some(req.model.clone()),
                provider: Some("hi".into()),
            });
            out.send(Frame::TextStart);
            out.send(Frame::TextDelta { delta: "hi".into() });
            out.send(Frame::TextEnd);
            out.complete(StopReason::End, None)
        }
    }

    fn request() -> ChatRequest {
        ChatRequest {
            provider: Some("hi".into()),
            ..ChatRequest::new("r1", "m", vec![AgentMessage::user_text("hello", 0)])
        }
    }

    fn router() -> Router {
        let router = Router::new();
        router.add_provider(Arc::new(Hi));
        router
    }

    /// Without the message's timestamp, which differs between two runs.
    fn shape(frames: Vec<Frame>) -> Vec<Frame> {
        frames
            .into_iter()
            .map(|f| match f {
                Frame::Done { mut message } => {
                    message.timestamp = 0;
                    Frame::Done { message }
                }
                other => other,
            })
            .collect()
    }

    #[tokio::test]
    async fn a_tapped_chat_hands_the_tap_the_frames_a_json_caller_gets_and_serializes_none() {
        let (json_tx, mut json_rx) = tokio::sync::mpsc::unbounded_channel();
        let ctx = |frames| CallContext {
            frames,
            metadata: Value::Null,
        };
        router()
            .chat_with(request(), ChatExtras::default(), ctx(Some(json_tx)))
            .await;
        let mut via_json = Vec::new();
        while let Ok(v) = json_rx.try_recv() {
            via_json.push(serde_json::from_value::<Frame>(v).unwrap());
        }

        let tapped = Arc::new(StdMutex::new(Vec::new()));
        let sink = tapped.clone();
        let tap = FrameTap::new(move |f| sink.lock().unwrap().push(f));
        let (json_tx, mut json_rx) = tokio::sync::mpsc::unbounded_channel();
        let ack = router()
            .chat_to(
                request(),
                ChatExtras::default(),
                ctx(Some(json_tx)),
                Some(tap),
            )
            .await;
        assert!(ack.ok, "{ack:?}");
        assert!(json_rx.try_recv().is_err(), "a tapped chat also sent JSON");
        let via_tap = std::mem::take(&mut *tapped.lock().unwrap());

        assert!(
            matches!(via_tap.last(), Some(Frame::Done { message }) if harness_types::message::joined_text(&message.content) == "hi"),
            "{via_tap:?}"
        );
        assert_eq!(shape(via_tap), shape(via_json));
    }
}
