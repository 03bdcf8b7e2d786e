//! Anthropic Messages API (`POST /v1/messages`, `stream: true`).
//!
//! Request: the system prompt as text blocks with a `cache_control` marker on the stable section
//! (the whole prompt when no sections are given) and on the last message block, so a turn's
//! steps re-read the conversation prefix from the cache; tools with `::`-free names; thinking as
//! `budget_tokens` from `thinking_level`. Replayed assistant messages keep their thinking blocks
//! (text + signature) and redacted thinking verbatim when they came from this provider, as the
//! API requires for tool use with thinking; blocks from another provider are dropped (their
//! signatures would be rejected).
//!
//! Stream: `message_start` → per block `content_block_start` / `_delta` (`text_delta`,
//! `thinking_delta`, `signature_delta`, `input_json_delta`) / `_stop` → `message_delta`
//! (stop reason, cumulative usage) → `message_stop`; `ping` any time; `error` any time.

use std::collections::HashMap;

use async_trait::async_trait;
use bytes::Bytes;
use harness_types::api::ThinkingLevel;
use harness_types::message::{AgentMessage, ContentBlock, StopReason, Usage};
use harness_types::router::{ChatAck, ChatRequest, Frame};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::error::ProviderError;
use crate::http::{Decoder, Flow, Transport};
use crate::names::{self, ToolNames};
use crate::providers::wire::{
    args_object, collision, malformed, mapped_tools, max_output, merge_options, namespaced,
    transport, Built, Call,
};
use crate::providers::{ProviderConfig, Secret};
use crate::router::{ChatContext, FrameWriter, Provider};
use crate::sse::SseEvent;

/// The API version header value.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// Output budget when the caller sets none (the model's own limit still caps it).
const DEFAULT_MAX_TOKENS: u64 = 16_384;

/// `thinking.budget_tokens` per level (the API's minimum is 1024).
pub fn thinking_budget(level: ThinkingLevel) -> u64 {
    match level {
        ThinkingLevel::Minimal => 1024,
        ThinkingLevel::Low => 4096,
        ThinkingLevel::Medium => 10_000,
        ThinkingLevel::High => 24_000,
        ThinkingLevel::Xhigh => 32_000,
    }
}

pub struct AnthropicProvider {
    id: String,
    url: String,
    base_url: String,
    key: Option<Secret>,
    transport: Transport,
}

impl AnthropicProvider {
    pub fn new(cfg: &ProviderConfig) -> Self {
        let base = cfg.base_url.trim_end_matches('/');
        let url = if base.ends_with("/v1") {
            format!("{base}/messages")
        } else {
            format!("{base}/v1/messages")
        };
        AnthropicProvider {
            id: cfg.id.clone(),
            url,
            base_url: base.to_string(),
            key: cfg.api_key.clone(),
            transport: transport(cfg),
        }
    }

    /// The request body, the name table for mapping tool names back, and warnings.
    pub fn body(&self, req: &ChatRequest, ctx: &ChatContext) -> Built {
        let (mut names, tools) = mapped_tools(
            req,
            |name, schema| json!({"name": name, "input_schema": schema}),
            |tool| tool,
        )?;
        let mut warnings = Vec::new();
        let messages = self
            .messages(&req.messages, &mut names)
            .map_err(collision)?;
        let mut body = json!({
            "model": req.model,
            "max_tokens": max_output(req, ctx, DEFAULT_MAX_TOKENS),
            "stream": true,
            "messages": messages,
        });
        if let Some(system) = system_blocks(req, ctx) {
            body["system"] = system;
        }
        if !tools.is_empty() {
            body["tools"] = Value::Array(tools);
        }
        if let Some(level) = req.thinking_level {
            let supported = ctx.model.as_ref().is_none_or(|m| m.capabilities.thinking);
            if supported {
                let budget = thinking_budget(level);
                let limit = ctx.model.as_ref().map(|m| m.max_output_tokens);
                // The budget is part of max_tokens: leave room for the answer itself.
                let mut max = body["max_tokens"].as_u64().unwrap_or(DEFAULT_MAX_TOKENS);
                if max <= budget {
                    max = budget + 4096;
                    if let Some(l) = limit {
                        max = max.min(l);
                    }
                }
                let budget = budget.min(max.saturating_sub(1)).max(1024);
                body["max_tokens"] = json!(max);
                body["thinking"] = json!({"type": "enabled", "budget_tokens": budget});
            } else {
                warnings.push(format!(
                    "thinking_level ignored: {} does not support extended thinking",
                    req.model
                ));
            }
        }
        if req.response_format.is_some() {
            warnings.push(
                "response_format ignored: the Messages API has no native JSON mode here".into(),
            );
        }
        merge_options(
            &mut body,
            namespaced(req, &[&self.id, "anthropic"]),
            &["model", "messages", "stream"],
        );
        Ok((body, names, warnings))
    }

    fn messages(
        &self,
        messages: &[AgentMessage],
        names: &mut ToolNames,
    ) -> Result<Vec<Value>, names::NameCollision> {
        let mut out: Vec<(String, Vec<Value>)> = Vec::new();
        for m in messages {
            let (role, blocks) = match m {
                AgentMessage::User(u) => {
                    ("user", u.content.iter().filter_map(input_block).collect())
                }
                AgentMessage::Assistant(a) => {
                    let own = a.provider == self.id;
                    let mut blocks = Vec::new();
                    for b in &a.content {
                        match b {
                            ContentBlock::Text { text } if !text.is_empty() => {
                                blocks.push(json!({"type": "text", "text": text}))
                            }
                            ContentBlock::Thinking {
                                text,
                                signature: Some(sig),
                            } if own => blocks.push(
                                json!({"type": "thinking", "thinking": text, "signature": sig}),
                            ),
                            ContentBlock::RedactedThinking { data } if own => {
                                blocks.push(json!({"type": "redacted_thinking", "data": data}))
                            }
                            ContentBlock::FunctionCall {
                                id,
                                function_id,
                                arguments,
                            } => blocks.push(json!({
                                "type": "tool_use",
                                "id": tool_id(id),
                                "name": names.add(function_id)?,
                                "input": args_object(arguments),
                            })),
                            _ => {}
                        }
                    }
                    ("assistant", blocks)
                }
                AgentMessage::FunctionResult(r) => {
                    let mut content: Vec<Value> =
                        r.content.iter().filter_map(input_block).collect();
                    if content.is_empty() {
                        content.push(json!({"type": "text", "text": "(no output)"}));
                    }
                    let mut block = json!({
                        "type": "tool_result",
                        "tool_use_id": tool_id(&r.function_call_id),
                        "content": content,
                    });
                    if r.is_error {
                        block["is_error"] = json!(true);
                    }
                    ("user", vec![block])
                }
                AgentMessage::Custom(_) => continue,
            };
            if blocks.is_empty() {
                continue;
            }
            match out.last_mut() {
                Some((r, b)) if r == role => b.extend(blocks),
                _ => out.push((role.to_string(), blocks)),
            }
        }
        // Tool results lead their user message, as the API requires.
        for (role, blocks) in &mut out {
            if role == "user" {
                blocks.sort_by_key(|b| b["type"] != "tool_result");
            }
        }
        if let Some(last) = out.last_mut().and_then(|(_, b)| b.last_mut()) {
            if last["type"] != "thinking" && last["type"] != "redacted_thinking" {
                last["cache_control"] = json!({"type": "ephemeral"});
            }
        }
        Ok(out
            .into_iter()
            .map(|(role, content)| json!({"role": role, "content": content}))
            .collect())
    }
}

/// Tool-use ids must match `^[a-zA-Z0-9_-]+$`; ids from other providers may not.
fn tool_id(id: &str) -> String {
    if !id.is_empty()
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        id.to_string()
    } else {
        names::encode(id)
    }
}

fn input_block(b: &ContentBlock) -> Option<Value> {
    match b {
        ContentBlock::Text { text } if !text.is_empty() => {
            Some(json!({"type": "text", "text": text}))
        }
        ContentBlock::Image { data, mime } => Some(json!({
            "type": "image",
            "source": {"type": "base64", "media_type": mime, "data": data},
        })),
        _ => None,
    }
}

/// The system prompt as blocks, the cache marker on the stable section.
fn system_blocks(req: &ChatRequest, ctx: &ChatContext) -> Option<Value> {
    let cache = json!({"type": "ephemeral"});
    if let Some(sections) = ctx
        .extras
        .system_sections
        .as_ref()
        .filter(|s| !s.is_empty())
    {
        let sections: Vec<_> = sections.iter().filter(|s| !s.text.is_empty()).collect();
        // One marker, on the last stable section (the first section when none is marked):
        // everything before it is the shared prefix.
        let marked = sections.iter().rposition(|s| s.cache_boundary).unwrap_or(0);
        let blocks: Vec<Value> = sections
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut b = json!({"type": "text", "text": s.text});
                if i == marked {
                    b["cache_control"] = cache.clone();
                }
                b
            })
            .collect();
        return (!blocks.is_empty()).then_some(Value::Array(blocks));
    }
    let text = req.system_prompt.as_deref().filter(|s| !s.is_empty())?;
    Some(json!([{"type": "text", "text": text, "cache_control": cache}]))
}

#[derive(Clone, Copy, PartialEq)]
enum Block {
    Text,
    Thinking,
    Tool,
    Other,
}

struct AnthropicDecoder {
    call: Call,
    blocks: HashMap<u64, Block>,
    signature: String,
    usage: Usage,
    stop: Option<String>,
}

fn update_usage(u: &mut Usage, v: &Value) {
    let get = |k: &str| v.get(k).and_then(Value::as_u64);
    if let Some(n) = get("input_tokens") {
        u.input = Some(n);
    }
    if let Some(n) = get("output_tokens") {
        u.output = Some(n);
    }
    if let Some(n) = get("cache_read_input_tokens") {
        u.cache_read = Some(n);
    }
    if let Some(n) = get("cache_creation_input_tokens") {
        u.cache_write = Some(n);
    }
}

/// A malformed event of type `kind`.
fn malformed_event(kind: &str, data: &str) -> ProviderError {
    malformed(&format!("{kind} event"), data)
}

impl Decoder for AnthropicDecoder {
    fn event(&mut self, ev: &SseEvent, out: &mut FrameWriter) -> Result<Flow, ProviderError> {
        let kind = ev.event.as_str();
        if kind == "ping" {
            out.send(Frame::Ping);
            return Ok(Flow::Continue);
        }
        let v: Value =
            serde_json::from_str(&ev.data).map_err(|_| malformed_event(kind, &ev.data))?;
        let kind = if kind.is_empty() || kind == "message" {
            v["type"].as_str().unwrap_or("")
        } else {
            kind
        };
        let index = v["index"].as_u64().unwrap_or(0);
        match kind {
            "message_start" => {
                out.send(self.call.start());
                update_usage(&mut self.usage, &v["message"]["usage"]);
                out.send(Frame::Usage {
                    usage: self.usage.clone(),
                });
            }
            "content_block_start" => {
                let cb = &v["content_block"];
                let block = match cb["type"].as_str().unwrap_or("") {
                    "text" => {
                        out.send(Frame::TextStart);
                        if let Some(t) = cb["text"].as_str().filter(|t| !t.is_empty()) {
                            out.send(Frame::TextDelta { delta: t.into() });
                        }
                        Block::Text
                    }
                    "thinking" => {
                        self.signature.clear();
                        out.send(Frame::ThinkingStart);
                        if let Some(t) = cb["thinking"].as_str().filter(|t| !t.is_empty()) {
                            out.send(Frame::ThinkingDelta { delta: t.into() });
                        }
                        if let Some(s) = cb["signature"].as_str() {
                            self.signature.push_str(s);
                        }
                        Block::Thinking
                    }
                    "redacted_thinking" => {
                        out.record(ContentBlock::RedactedThinking {
                            data: cb["data"].as_str().unwrap_or("").to_string(),
                        });
                        Block::Other
                    }
                    "tool_use" => {
                        let name = cb["name"]
                            .as_str()
                            .ok_or_else(|| malformed_event(kind, &ev.data))?;
                        out.send(Frame::FunctionCallStart {
                            id: cb["id"].as_str().unwrap_or("").to_string(),
                            function_id: self.call.names.id_of(name),
                        });
                        if let Some(input) = cb["input"].as_object().filter(|o| !o.is_empty()) {
                            out.send(Frame::FunctionCallDelta {
                                delta: Value::Object(input.clone()).to_string(),
                            });
                        }
                        Block::Tool
                    }
                    _ => Block::Other,
                };
                self.blocks.insert(index, block);
            }
            "content_block_delta" => {
                let d = &v["delta"];
                let text = |k: &str| d[k].as_str().map(str::to_string);
                match d["type"].as_str().unwrap_or("") {
                    "text_delta" => out.send(Frame::TextDelta {
                        delta: text("text").ok_or_else(|| malformed_event(kind, &ev.data))?,
                    }),
                    "thinking_delta" => out.send(Frame::ThinkingDelta {
                        delta: text("thinking").ok_or_else(|| malformed_event(kind, &ev.data))?,
                    }),
                    "signature_delta" => self
                        .signature
                        .push_str(d["signature"].as_str().unwrap_or("")),
                    "input_json_delta" => {
                        let piece =
                            text("partial_json").ok_or_else(|| malformed_event(kind, &ev.data))?;
                        if !piece.is_empty() {
                            out.send(Frame::FunctionCallDelta { delta: piece });
                        }
                    }
                    _ => {}
                }
            }
            "content_block_stop" => match self.blocks.remove(&index) {
                Some(Block::Text) => out.send(Frame::TextEnd),
                Some(Block::Thinking) => out.send(Frame::ThinkingEnd {
                    signature: (!self.signature.is_empty())
                        .then(|| std::mem::take(&mut self.signature)),
                }),
                Some(Block::Tool) => out.send(Frame::FunctionCallEnd),
                _ => {}
            },
            "message_delta" => {
                if let Some(s) = v["delta"]["stop_reason"].as_str() {
                    self.stop = Some(s.to_string());
                }
                update_usage(&mut self.usage, &v["usage"]);
                out.send(Frame::Usage {
                    usage: self.usage.clone(),
                });
            }
            "message_stop" => return Ok(Flow::End),
            "error" => return Err(self.call.error(&v)),
            _ => {}
        }
        Ok(Flow::Continue)
    }

    fn finish(&mut self, _out: &mut FrameWriter) -> (StopReason, Option<String>) {
        let stop = match self.stop.as_deref() {
            Some("max_tokens") | Some("model_context_window_exceeded") => StopReason::Length,
            Some("tool_use") => StopReason::FunctionCall,
            _ => StopReason::End,
        };
        (stop, self.stop.clone())
    }
}

#[async_trait]
impl Provider for AnthropicProvider {
    fn id(&self) -> &str {
        &self.id
    }

    async fn chat(&self, req: ChatRequest, out: FrameWriter, cancel: CancellationToken) -> ChatAck {
        let built = self.body(&req, out.context());
        let request = |body: &Value| {
            let Some(key) = self.key.clone() else {
                return Err(ProviderError::new(
                    harness_types::ErrorKind::AuthExpired,
                    "no API key configured: set ANTHROPIC_API_KEY",
                )
                .with_code("missing_credentials"));
            };
            let bytes = Bytes::from(body.to_string());
            let client = self.transport.client.clone();
            let url = self.url.clone();
            Ok(move || {
                client
                    .post(&url)
                    .header("x-api-key", key.expose())
                    .header("anthropic-version", ANTHROPIC_VERSION)
                    .header("content-type", "application/json")
                    .header("accept", "text/event-stream")
                    .body(bytes.clone())
            })
        };
        let decoder = |call| AnthropicDecoder {
            call,
            blocks: HashMap::new(),
            signature: String::new(),
            usage: Usage::default(),
            stop: None,
        };
        self.transport
            .stream(&req.model, built, out, cancel, request, decoder)
            .await
    }

    fn describe(&self) -> Value {
        json!({"id": self.id, "kind": "anthropic", "base_url": crate::providers::public_url(&self.base_url)})
    }
}
