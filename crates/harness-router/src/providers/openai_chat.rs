//! OpenAI Chat Completions (`POST {base}/chat/completions`, `stream: true`), for OpenAI itself
//! (`openai`) and for OpenAI-compatible servers (`openai-compatible`, `ollama`, `llamacpp`,
//! `vllm`, `lmstudio`, or any id the config gives that kind).
//!
//! Request: `system` message, `user` / `assistant` (text + `tool_calls`) / `tool` messages;
//! tools as `{"type":"function","function":{...}}` with `::`-free names;
//! `stream_options.include_usage` so the last chunk carries usage; `reasoning_effort` from
//! `thinking_level`. OpenAI gets `max_completion_tokens` (its reasoning models reject
//! `max_tokens`), compatible servers the `max_tokens` they all understand.
//!
//! Stream: `data: {chunk}` lines, `choices[0].delta` carrying `content`, `tool_calls[{index, id,
//! function{name, arguments}}]` (arguments in pieces) and, on local servers,
//! `reasoning_content` / `reasoning` (shown as thinking, never replayed); `finish_reason`; a last
//! chunk with `usage` and no choices; `data: [DONE]`. An `{"error": ...}` chunk is an in-stream
//! error.

use async_trait::async_trait;
use harness_types::message::{AgentMessage, ContentBlock, StopReason, Usage};
use harness_types::router::{ChatAck, ChatRequest, Frame};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::error::{classify_http, ProviderError};
use crate::http::{transport_error, Decoder, Flow, Transport};
use crate::names::ToolNames;
use crate::providers::wire::{
    args_object, collision, data_url, malformed, mapped_tools, max_output, merge_options,
    namespaced, prompt_cache_key, result_text, transport, Built, Call,
};
use crate::providers::{
    JsonSchemaForm, ProviderConfig, ProviderKind, Secret, Tokenize, ToolChoice, WireCaps,
};
use crate::router::{ChatContext, FrameWriter, Provider};
use crate::sse::SseEvent;

/// Output budget for compatible servers when the caller sets none.
const DEFAULT_MAX_TOKENS: u64 = 4096;

pub struct OpenAiChatProvider {
    id: String,
    base_url: String,
    key: Option<Secret>,
    /// OpenAI itself, not a compatible server.
    openai: bool,
    /// What the server accepts (a catalog row may refine it per model).
    wire: WireCaps,
    transport: Transport,
    concurrency: Option<usize>,
    /// Which tokenize endpoint answered (`llamacpp` serves two servers' forms): 0 unknown, 1
    /// llama-cpp-python's, 2 llama.cpp's, 3 neither.
    tokenize_form: std::sync::atomic::AtomicU8,
}

impl OpenAiChatProvider {
    pub fn new(cfg: &ProviderConfig) -> Self {
        OpenAiChatProvider {
            id: cfg.id.clone(),
            base_url: cfg.base_url.trim_end_matches('/').to_string(),
            key: cfg.api_key.clone(),
            openai: cfg.kind == ProviderKind::Openai,
            wire: cfg.wire,
            transport: transport(cfg),
            concurrency: cfg.concurrency,
            tokenize_form: std::sync::atomic::AtomicU8::new(0),
        }
    }

    /// The request body and the name table for mapping tool names back.
    pub fn body(&self, req: &ChatRequest, ctx: &ChatContext) -> Built {
        let wire = self.wire(ctx);
        let (mut names, tools) = mapped_tools(
            req,
            |name, schema| json!({"type": "function", "function": {"name": name, "parameters": schema}}),
            |tool| &mut tool["function"],
        )?;
        let mut warnings = Vec::new();
        let mut messages = Vec::new();
        if let Some(s) = req.system_prompt.as_deref().filter(|s| !s.is_empty()) {
            messages.push(json!({"role": "system", "content": s}));
        }
        for m in req.messages.iter() {
            match m {
                AgentMessage::User(u) => {
                    let only_text = u
                        .content
                        .iter()
                        .all(|b| matches!(b, ContentBlock::Text { .. }));
                    let content = if only_text {
                        json!(harness_types::message::joined_text(&u.content))
                    } else {
                        Value::Array(
                            u.content
                                .iter()
                                .filter_map(|b| match b {
                                    ContentBlock::Text { text } => {
                                        Some(json!({"type": "text", "text": text}))
                                    }
                                    ContentBlock::Image { data, mime } => Some(json!({
                                        "type": "image_url",
                                        "image_url": {"url": data_url(mime, data)},
                                    })),
                                    _ => None,
                                })
                                .collect(),
                        )
                    };
                    messages.push(json!({"role": "user", "content": content}));
                }
                AgentMessage::Assistant(a) => {
                    let text = harness_types::message::joined_text(&a.content);
                    let mut calls = Vec::new();
                    for b in &a.content {
                        if let ContentBlock::FunctionCall {
                            id,
                            function_id,
                            arguments,
                        } = b
                        {
                            calls.push(json!({
                                "id": id,
                                "type": "function",
                                "function": {
                                    "name": names.add(function_id).map_err(collision)?,
                                    "arguments": args_object(arguments).to_string(),
                                },
                            }));
                        }
                    }
                    if text.is_empty() && calls.is_empty() {
                        continue;
                    }
                    let content = match text.is_empty() {
                        false => json!(text),
                        true if wire.content_null => Value::Null,
                        true => json!(""),
                    };
                    let mut msg = json!({"role": "assistant", "content": content});
                    if !calls.is_empty() {
                        msg["tool_calls"] = Value::Array(calls);
                    }
                    messages.push(msg);
                }
                AgentMessage::FunctionResult(r) => messages.push(json!({
                    "role": "tool",
                    "tool_call_id": r.function_call_id,
                    "content": result_text(&r.content),
                })),
                AgentMessage::Custom(_) => {}
            }
        }
        let stream = tools.is_empty() || wire.stream_with_tools;
        let mut body = json!({"model": req.model, "messages": messages, "stream": stream});
        if stream && wire.stream_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        if !tools.is_empty() {
            body["tools"] = Value::Array(tools);
            if wire.tool_choice == ToolChoice::Auto {
                body["tool_choice"] = json!("auto");
            }
        }
        if self.openai {
            if req.max_output_tokens.is_some() {
                body["max_completion_tokens"] = json!(max_output(req, ctx, 0));
            }
            if let Some(d) = prompt_cache_key(ctx) {
                body["prompt_cache_key"] = json!(d);
            }
        } else {
            body["max_tokens"] = json!(max_output(req, ctx, DEFAULT_MAX_TOKENS));
        }
        if let Some(effort) = reasoning_effort(req, ctx, &mut warnings) {
            body["reasoning_effort"] = json!(effort);
        }
        if let Some(rf) = &req.response_format {
            body["response_format"] = super::structured::server_format(rf, wire.json_schema);
        }
        let family = if self.openai {
            "openai"
        } else {
            "openai-compatible"
        };
        merge_options(
            &mut body,
            namespaced(req, &[&self.id, family]),
            &["model", "messages", "stream"],
        );
        check_tool_choice(&body, &names)?;
        Ok((body, names, warnings))
    }

    /// The provider's caps with the model's catalog row laid over.
    fn wire(&self, ctx: &ChatContext) -> WireCaps {
        self.wire
            .with(ctx.model.as_ref().and_then(|m| m.wire.as_ref()))
    }

    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.key {
            Some(k) => rb.bearer_auth(k.expose()),
            None => rb,
        }
    }
}

/// A `tool_choice` that names a function must name one of the request's tools: a server
/// answers anything else with an error that blames something else (or ignores the tools), so
/// it is refused here, naming the choice and what is offered.
fn check_tool_choice(body: &Value, names: &ToolNames) -> Result<(), ProviderError> {
    let choice = &body["tool_choice"];
    let named = choice["function"]["name"]
        .as_str()
        .or_else(|| choice["name"].as_str());
    let Some(name) = named else {
        return Ok(());
    };
    let offered: Vec<&str> = body["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    if offered.contains(&name) {
        return Ok(());
    }
    let shown: Vec<String> = offered.iter().map(|n| names.id_of(n)).collect();
    let offered = if shown.is_empty() {
        "no function is offered to the model in this request".to_string()
    } else {
        format!("offered: {}", shown.join(", "))
    };
    Err(ProviderError::new(
        harness_types::ErrorKind::Permanent,
        format!(
            "tool_choice names '{}', which is not offered; {offered}",
            names.id_of(name)
        ),
    )
    .with_code("invalid_tool_choice")
    .with_message("tool_choice names a function that is not offered."))
}

/// The native effort for the request: `reasoning: "lowest"`'s pick, else `thinking_level`
/// snapped to what the model offers. Models the catalog says cannot reason get none.
pub(crate) fn reasoning_effort(
    req: &ChatRequest,
    ctx: &ChatContext,
    warnings: &mut Vec<String>,
) -> Option<String> {
    if let Some(e) = &ctx.reasoning_effort {
        return Some(e.clone());
    }
    let level = req.thinking_level?;
    match &ctx.model {
        Some(m) if !m.capabilities.thinking && m.reasoning_efforts.is_empty() => {
            warnings.push(format!(
                "thinking_level ignored: {} has no reasoning effort",
                req.model
            ));
            None
        }
        Some(m) => Some(m.effort_for(level)),
        None => Some(crate::catalog::effort_name(level).to_string()),
    }
}

/// The open block of the stream (frames fold into the last block, so one is open at a time).
#[derive(Clone, Copy, PartialEq)]
enum Open {
    None,
    Text,
    Thinking,
    Call(u64),
}

struct ChatDecoder {
    call: Call,
    open: Open,
    calls: u32,
    finish: Option<String>,
    started: bool,
    /// A text, thinking or call frame was sent.
    emitted: bool,
    request_id: String,
}

impl ChatDecoder {
    fn close(&mut self, out: &mut FrameWriter) {
        match self.open {
            Open::Text => out.send(Frame::TextEnd),
            Open::Thinking => out.send(Frame::ThinkingEnd { signature: None }),
            Open::Call(_) => out.send(Frame::FunctionCallEnd),
            Open::None => {}
        }
        self.open = Open::None;
    }

    /// Sends a piece of thinking or text, after `start` unless its `block` is the one open
    /// (a chunk may switch from reasoning to text, or back).
    fn piece(&mut self, out: &mut FrameWriter, block: Open, start: Frame, piece: Frame) {
        if self.open != block {
            self.close(out);
            out.send(start);
            self.open = block;
        }
        out.send(piece);
        self.emitted = true;
    }
}

/// OpenAI counts cached tokens inside `prompt_tokens`; the router's `input` is uncached input.
pub(crate) fn openai_usage(u: &Value, input_key: &str, output_key: &str) -> Usage {
    let n = |v: &Value| v.as_u64();
    let prompt = n(&u[input_key]);
    let details = if input_key == "prompt_tokens" {
        &u["prompt_tokens_details"]
    } else {
        &u["input_tokens_details"]
    };
    let cached = n(&details["cached_tokens"]);
    let out_details = if output_key == "completion_tokens" {
        &u["completion_tokens_details"]
    } else {
        &u["output_tokens_details"]
    };
    Usage {
        input: prompt.map(|p| p.saturating_sub(cached.unwrap_or(0))),
        output: n(&u[output_key]),
        cache_read: cached,
        cache_write: None,
        reasoning: n(&out_details["reasoning_tokens"]),
        cost_usd: None,
        estimated: false,
    }
}

impl Decoder for ChatDecoder {
    fn event(&mut self, ev: &SseEvent, out: &mut FrameWriter) -> Result<Flow, ProviderError> {
        let data = ev.data.trim();
        if data == "[DONE]" {
            if let Some(e) = self.empty_reply() {
                return Err(e);
            }
            if self.finish.is_none() {
                // A server that stops generating early (interrupted by another request, or
                // failed) may still close with `[DONE]`: without a finish reason the reply is
                // cut, never complete, and a function call in it is never run.
                return Err(ProviderError::new(
                    harness_types::ErrorKind::Transient,
                    "the server ended the stream ([DONE]) without a finish_reason: the reply was cut short (another request to the same server may have interrupted it; llama-cpp-python does that unless started with --interrupt_requests false)",
                )
                .with_code("stream_interrupted"));
            }
            return Ok(Flow::End);
        }
        if data.is_empty() {
            return Ok(Flow::Continue);
        }
        let v: Value = serde_json::from_str(data).map_err(|_| malformed("chunk", data))?;
        if v.get("error").is_some_and(|e| !e.is_null()) || ev.event == "error" {
            return Err(self.call.error(&v));
        }
        self.chunk(&v, out)?;
        Ok(Flow::Continue)
    }

    fn whole(
        &mut self,
        v: &Value,
        out: &mut FrameWriter,
    ) -> Option<Result<(StopReason, Option<String>), ProviderError>> {
        let choice = v["choices"].get(0)?;
        // One answer is one chunk whose delta is the whole message.
        let chunk = json!({
            "choices": [{"index": 0, "delta": choice["message"], "finish_reason": choice["finish_reason"]}],
            "usage": v["usage"],
        });
        Some(self.chunk(&chunk, out).and_then(|()| {
            if let Some(e) = self.empty_reply() {
                return Err(e);
            }
            match self.finish {
                Some(_) => Ok(self.finish(out)),
                None => Err(ProviderError::new(
                    harness_types::ErrorKind::Transient,
                    "the server answered without a finish_reason: the reply was cut short",
                )
                .with_code("stream_interrupted")),
            }
        }))
    }

    fn complete_at_eof(&self) -> bool {
        self.finish.is_some() && self.empty_reply().is_none()
    }

    fn finish(&mut self, out: &mut FrameWriter) -> (StopReason, Option<String>) {
        self.close(out);
        let stop = match self.finish.as_deref() {
            Some("length") => StopReason::Length,
            _ if self.calls > 0 => StopReason::FunctionCall,
            _ => StopReason::End,
        };
        (stop, self.finish.clone())
    }
}

impl ChatDecoder {
    /// A reply the server finished as a normal end without a single token of it: never stored
    /// as a completed reply. Sampling again usually gives one, so it is transient (retried
    /// while nothing was streamed).
    fn empty_reply(&self) -> Option<ProviderError> {
        let normal_end = !matches!(self.finish.as_deref(), None | Some("length"));
        (normal_end && !self.emitted).then(|| {
            ProviderError::new(
                harness_types::ErrorKind::Transient,
                format!(
                    "the server finished the reply (finish_reason {}) without a single token of it",
                    self.finish.as_deref().unwrap_or("?")
                ),
            )
            .with_code("empty_reply")
        })
    }

    /// Folds one `chat.completion.chunk` into frames.
    fn chunk(&mut self, v: &Value, out: &mut FrameWriter) -> Result<(), ProviderError> {
        if !self.started {
            self.started = true;
            out.send(self.call.start());
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let usage = openai_usage(u, "prompt_tokens", "completion_tokens");
            out.send(Frame::Usage { usage });
        }
        let Some(choice) = v["choices"].get(0) else {
            return Ok(());
        };
        let delta = &choice["delta"];
        let reasoning = delta["reasoning_content"]
            .as_str()
            .or_else(|| delta["reasoning"].as_str())
            .filter(|s| !s.is_empty());
        if let Some(r) = reasoning {
            let frame = Frame::ThinkingDelta { delta: r.into() };
            self.piece(out, Open::Thinking, Frame::ThinkingStart, frame);
        }
        if let Some(text) = delta["content"].as_str().filter(|s| !s.is_empty()) {
            let frame = Frame::TextDelta { delta: text.into() };
            self.piece(out, Open::Text, Frame::TextStart, frame);
        }
        if let Some(calls) = delta["tool_calls"].as_array() {
            for (i, c) in calls.iter().enumerate() {
                let index = c["index"].as_u64().unwrap_or(i as u64);
                let f = &c["function"];
                if self.open != Open::Call(index) {
                    self.close(out);
                    let name = f["name"].as_str().unwrap_or("");
                    self.calls += 1;
                    let id = c["id"]
                        .as_str()
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .unwrap_or_else(|| format!("call_{}_{}", self.request_id, self.calls));
                    out.send(Frame::FunctionCallStart {
                        id,
                        function_id: self.call.names.id_of(name),
                    });
                    self.emitted = true;
                    self.open = Open::Call(index);
                }
                // Arguments are a JSON text in pieces; a few servers send the object itself.
                let piece = match &f["arguments"] {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                };
                if !piece.is_empty() {
                    out.send(Frame::FunctionCallDelta { delta: piece });
                }
            }
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.close(out);
            self.finish = Some(reason.to_string());
        }
        Ok(())
    }
}

#[async_trait]
impl Provider for OpenAiChatProvider {
    fn id(&self) -> &str {
        &self.id
    }

    async fn chat(&self, req: ChatRequest, out: FrameWriter, cancel: CancellationToken) -> ChatAck {
        let built = self.body(&req, out.context());
        let url = format!("{}/chat/completions", self.base_url);
        let request = |body: &Value| Ok(self.transport.bearer_sse_post(url, body, &self.key));
        let request_id: String = req
            .request_id
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let decoder = |call| ChatDecoder {
            call,
            open: Open::None,
            calls: 0,
            finish: None,
            started: false,
            emitted: false,
            request_id: request_id.clone(),
        };
        self.transport
            .stream(&req.model, built, out, cancel, request, decoder)
            .await
    }

    /// Compatible servers list their models at `GET {base}/models`.
    async fn list_models(&self) -> Result<Option<Vec<String>>, ProviderError> {
        if self.openai {
            return Ok(None);
        }
        let t = &self.transport;
        let hinted = |mut e: ProviderError| {
            t.hint(&mut e);
            e
        };
        let resp = self
            .auth(t.client.get(format!("{}/models", self.base_url)))
            .timeout(std::time::Duration::from_secs(10))
            .send()
            .await
            .map_err(|e| hinted(transport_error(&e, &t.secrets)))?;
        let status = resp.status().as_u16();
        let text = resp
            .text()
            .await
            .map_err(|e| hinted(transport_error(&e, &t.secrets)))?;
        if !(200..300).contains(&status) {
            return Err(hinted(classify_http(status, &text, None, None, &t.secrets)));
        }
        let v: Value = serde_json::from_str(&text).map_err(|_| malformed("chunk", &text))?;
        let ids = v["data"]
            .as_array()
            .or_else(|| v["models"].as_array())
            .map(|list| {
                list.iter()
                    .filter_map(|m| m["id"].as_str().or_else(|| m["name"].as_str()))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        Ok(Some(ids))
    }

    /// Where compatible servers say it: the model's row of `GET {base}/models`
    /// (`max_model_len`, `context_length`, `loaded_context_length`), else `GET {root}/props`
    /// (`default_generation_settings.n_ctx`), else the row's training context
    /// (`meta.n_ctx_train`). A short timeout: this runs before a generation.
    async fn context_window(&self, model: &str) -> Option<u64> {
        if self.openai || !self.wire.window_probe {
            return None;
        }
        let get = |url: String| async move {
            let resp = self
                .auth(self.transport.client.get(url))
                .timeout(std::time::Duration::from_secs(3))
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success())?;
            resp.json::<Value>().await.ok()
        };
        let listed = get(format!("{}/models", self.base_url)).await;
        let row = listed.as_ref().and_then(|v| {
            v["data"]
                .as_array()?
                .iter()
                .find(|m| m["id"] == model)
                .or_else(|| v["data"].as_array().filter(|d| d.len() == 1)?.first())
                .cloned()
        });
        let n = |v: &Value| v.as_u64().filter(|n| *n > 0);
        if let Some(row) = &row {
            let said = ["max_model_len", "context_length", "loaded_context_length"]
                .iter()
                .find_map(|k| n(&row[*k]));
            if said.is_some() {
                return said;
            }
        }
        let root = self.base_url.trim_end_matches("/v1");
        if let Some(props) = get(format!("{root}/props")).await {
            if let Some(w) =
                n(&props["default_generation_settings"]["n_ctx"]).or_else(|| n(&props["n_ctx"]))
            {
                return Some(w);
            }
        }
        row.and_then(|r| n(&r["meta"]["n_ctx_train"]))
    }

    fn concurrency(&self) -> Option<usize> {
        self.concurrency
    }

    fn can_count(&self) -> bool {
        !self.openai
            && self.wire.tokenize != Tokenize::None
            && self
                .tokenize_form
                .load(std::sync::atomic::Ordering::Relaxed)
                != 3
    }

    fn grammar_json(&self) -> bool {
        !self.openai && self.wire.json_schema != JsonSchemaForm::Catalog
    }

    /// llama-cpp-python: `POST {root}/extras/tokenize/count {input}` → `{count}`; llama.cpp:
    /// `POST {root}/tokenize {content}` → `{tokens}`; vLLM: `POST {root}/tokenize {model,
    /// prompt}` → `{count}`. Any failure answers `None` (the estimate stands in).
    async fn count_tokens(&self, model: &str, texts: &[String]) -> Option<Vec<u64>> {
        use std::sync::atomic::Ordering;
        if self.openai || self.wire.tokenize == Tokenize::None {
            return None;
        }
        let root = self.base_url.trim_end_matches("/v1").to_string();
        let post = |url: String, body: Value| async move {
            let resp = self
                .auth(self.transport.client.post(url))
                .json(&body)
                .timeout(std::time::Duration::from_secs(20))
                .send()
                .await
                .ok()?;
            let ok = resp.status().is_success();
            let v = resp.json::<Value>().await.ok();
            Some((ok, v))
        };
        let count_of = |v: &Value| {
            v["count"]
                .as_u64()
                .or_else(|| v["tokens"].as_array().map(|t| t.len() as u64))
        };
        let mut out = Vec::with_capacity(texts.len());
        for text in texts {
            let n = match self.wire.tokenize {
                Tokenize::Vllm => {
                    let (ok, v) = post(
                        format!("{root}/tokenize"),
                        json!({"model": model, "prompt": text}),
                    )
                    .await?;
                    v.filter(|_| ok).as_ref().and_then(count_of)?
                }
                _ => loop {
                    match self.tokenize_form.load(Ordering::Relaxed) {
                        0 | 1 => {
                            let (ok, v) = post(
                                format!("{root}/extras/tokenize/count"),
                                json!({"model": model, "input": text}),
                            )
                            .await?;
                            if let Some(n) = v.filter(|_| ok).as_ref().and_then(count_of) {
                                self.tokenize_form.store(1, Ordering::Relaxed);
                                break n;
                            }
                            if self.tokenize_form.load(Ordering::Relaxed) == 1 {
                                return None;
                            }
                            self.tokenize_form.store(2, Ordering::Relaxed);
                        }
                        2 => {
                            let (ok, v) =
                                post(format!("{root}/tokenize"), json!({"content": text})).await?;
                            if let Some(n) = v.filter(|_| ok).as_ref().and_then(count_of) {
                                break n;
                            }
                            self.tokenize_form.store(3, Ordering::Relaxed);
                            return None;
                        }
                        _ => return None,
                    }
                },
            };
            out.push(n);
        }
        Some(out)
    }

    fn describe(&self) -> Value {
        json!({
            "id": self.id,
            "kind": if self.openai { "openai" } else { "openai-compatible" },
            "base_url": crate::providers::public_url(&self.base_url),
            // How the context budget counts for this server, and how many requests go at once.
            "token_counter": match self.wire.tokenize {
                Tokenize::None => "estimate",
                _ => "server",
            },
            "tokenize": self.wire.tokenize,
            "json_schema": self.wire.json_schema,
            "concurrency": self.concurrency,
        })
    }
}
