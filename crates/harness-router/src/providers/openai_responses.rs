//! OpenAI Responses API (`POST {base}/responses`, `stream: true`), provider id
//! `openai-responses` (same key and base URL as `openai`).
//!
//! Request: `instructions` (system prompt), `input` items (user messages, assistant `message`
//! items, `function_call` and `function_call_output` items, and this provider's `reasoning`
//! items replayed with their encrypted content), tools as `{"type":"function", name, ...}`,
//! `reasoning: {effort, summary: "auto"}` from `thinking_level`, `max_output_tokens`,
//! `store: false` (the transcript is ours; nothing is kept server-side) with
//! `include: ["reasoning.encrypted_content"]` so reasoning can be replayed statelessly.
//!
//! Stream: semantic events — `response.created`, `response.output_item.added` / `.done`
//! (message, function_call, reasoning), `response.output_text.delta`,
//! `response.function_call_arguments.delta`, `response.reasoning_summary_text.delta`,
//! `response.completed` (usage) / `response.incomplete` / `response.failed`, and `error`.
//!
//! A reasoning item becomes a thinking block: the summary is its text, and its signature is
//! `{"id": ..., "encrypted_content": ...}` as JSON — opaque to everyone but this adapter.

use async_trait::async_trait;
use harness_types::message::{AgentMessage, ContentBlock, StopReason};
use harness_types::router::{ChatAck, ChatRequest, Frame};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::error::{classify_stream, parse_error_body, ProviderError};
use crate::http::{Decoder, Flow, Transport};
use crate::providers::openai_chat::{openai_usage, reasoning_effort};
use crate::providers::wire::{
    args_object, collision, data_url, malformed, mapped_tools, max_output, merge_options,
    namespaced, prompt_cache_key, result_text, transport, Built, Call,
};
use crate::providers::{ProviderConfig, Secret};
use crate::router::{ChatContext, FrameWriter, Provider};
use crate::sse::SseEvent;

pub struct OpenAiResponsesProvider {
    id: String,
    base_url: String,
    key: Option<Secret>,
    transport: Transport,
}

/// The signature a reasoning item is kept under.
fn reasoning_signature(item: &Value) -> Option<String> {
    let id = item["id"].as_str()?;
    Some(json!({"id": id, "encrypted_content": item["encrypted_content"]}).to_string())
}

impl OpenAiResponsesProvider {
    pub fn new(cfg: &ProviderConfig) -> Self {
        OpenAiResponsesProvider {
            id: cfg.id.clone(),
            base_url: cfg.base_url.trim_end_matches('/').to_string(),
            key: cfg.api_key.clone(),
            transport: transport(cfg),
        }
    }

    /// The request body and the name table for mapping tool names back.
    pub fn body(&self, req: &ChatRequest, ctx: &ChatContext) -> Built {
        let shape = |name, schema| {
            json!({
                "type": "function",
                "name": name,
                "parameters": schema,
                "strict": false,
            })
        };
        let (mut names, tools) = mapped_tools(req, shape, |tool| tool)?;
        let mut warnings = Vec::new();
        let mut input = Vec::new();
        for m in req.messages.iter() {
            match m {
                AgentMessage::User(u) => {
                    let content: Vec<Value> = u
                        .content
                        .iter()
                        .filter_map(|b| match b {
                            ContentBlock::Text { text } => {
                                Some(json!({"type": "input_text", "text": text}))
                            }
                            ContentBlock::Image { data, mime } => Some(
                                json!({"type": "input_image", "image_url": data_url(mime, data)}),
                            ),
                            _ => None,
                        })
                        .collect();
                    if !content.is_empty() {
                        input.push(json!({"role": "user", "content": content}));
                    }
                }
                AgentMessage::Assistant(a) => {
                    let own = a.provider == self.id;
                    for b in &a.content {
                        match b {
                            ContentBlock::Text { text } if !text.is_empty() => input.push(json!({
                                "type": "message",
                                "role": "assistant",
                                "content": [{"type": "output_text", "text": text}],
                            })),
                            ContentBlock::Thinking {
                                text,
                                signature: Some(sig),
                            } if own => {
                                let Ok(s) = serde_json::from_str::<Value>(sig) else {
                                    continue;
                                };
                                let summary = if text.is_empty() {
                                    json!([])
                                } else {
                                    json!([{"type": "summary_text", "text": text}])
                                };
                                let mut item =
                                    json!({"type": "reasoning", "id": s["id"], "summary": summary});
                                if !s["encrypted_content"].is_null() {
                                    item["encrypted_content"] = s["encrypted_content"].clone();
                                }
                                input.push(item);
                            }
                            ContentBlock::FunctionCall {
                                id,
                                function_id,
                                arguments,
                            } => input.push(json!({
                                "type": "function_call",
                                "call_id": id,
                                "name": names.add(function_id).map_err(collision)?,
                                "arguments": args_object(arguments).to_string(),
                            })),
                            _ => {}
                        }
                    }
                }
                AgentMessage::FunctionResult(r) => input.push(json!({
                    "type": "function_call_output",
                    "call_id": r.function_call_id,
                    "output": result_text(&r.content),
                })),
                AgentMessage::Custom(_) => {}
            }
        }
        let mut body = json!({
            "model": req.model,
            "input": input,
            "stream": true,
            "store": false,
        });
        if let Some(s) = req.system_prompt.as_deref().filter(|s| !s.is_empty()) {
            body["instructions"] = json!(s);
        }
        if !tools.is_empty() {
            body["tools"] = Value::Array(tools);
        }
        if req.max_output_tokens.is_some() {
            body["max_output_tokens"] = json!(max_output(req, ctx, 0));
        }
        let reasons = ctx
            .model
            .as_ref()
            .is_none_or(|m| m.capabilities.thinking || !m.reasoning_efforts.is_empty());
        if let Some(effort) = reasoning_effort(req, ctx, &mut warnings) {
            body["reasoning"] = json!({"effort": effort, "summary": "auto"});
        }
        if reasons {
            body["include"] = json!(["reasoning.encrypted_content"]);
        }
        if let Some(d) = prompt_cache_key(ctx) {
            body["prompt_cache_key"] = json!(d);
        }
        if let Some(rf) = req
            .response_format
            .as_ref()
            .map(super::structured::chat_completions_format)
        {
            let rf = &rf;
            // Chat Completions' `{"type":"json_schema","json_schema":{name, schema, strict}}`
            // is `text.format` with the schema fields inlined here.
            let format = match rf.get("json_schema") {
                Some(js) => {
                    let mut f = js.clone();
                    f["type"] = json!("json_schema");
                    f
                }
                None => rf.clone(),
            };
            body["text"] = json!({"format": format});
        }
        merge_options(
            &mut body,
            namespaced(req, &[&self.id, "openai"]),
            &["model", "input", "stream"],
        );
        Ok((body, names, warnings))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Open {
    None,
    Text,
    Thinking,
    Call,
}

struct ResponsesDecoder {
    call: Call,
    open: Open,
    /// Arguments were streamed for the open call (else `output_item.done` carries them).
    call_args_streamed: bool,
    /// A summary part was already written into the open thinking block.
    summary_parts: u32,
    calls: u32,
    stop: Option<(StopReason, Option<String>)>,
}

impl ResponsesDecoder {
    fn close(&mut self, out: &mut FrameWriter, signature: Option<String>) {
        match self.open {
            Open::Text => out.send(Frame::TextEnd),
            Open::Thinking => out.send(Frame::ThinkingEnd { signature }),
            Open::Call => out.send(Frame::FunctionCallEnd),
            Open::None => {}
        }
        self.open = Open::None;
    }

    fn ensure_text(&mut self, out: &mut FrameWriter) {
        if self.open != Open::Text {
            self.close(out, None);
            out.send(Frame::TextStart);
            self.open = Open::Text;
        }
    }

    fn ensure_thinking(&mut self, out: &mut FrameWriter) {
        if self.open != Open::Thinking {
            self.close(out, None);
            out.send(Frame::ThinkingStart);
            self.open = Open::Thinking;
            self.summary_parts = 0;
        }
    }

    fn usage(&self, out: &mut FrameWriter, response: &Value) {
        if let Some(u) = response.get("usage").filter(|u| u.is_object()) {
            out.send(Frame::Usage {
                usage: openai_usage(u, "input_tokens", "output_tokens"),
            });
        }
    }
}

impl Decoder for ResponsesDecoder {
    fn event(&mut self, ev: &SseEvent, out: &mut FrameWriter) -> Result<Flow, ProviderError> {
        let v: Value = serde_json::from_str(&ev.data).map_err(|_| malformed("event", &ev.data))?;
        let kind = v["type"].as_str().unwrap_or(ev.event.as_str()).to_string();
        let text = |k: &str| v[k].as_str().map(str::to_string);
        match kind.as_str() {
            "response.created" => out.send(self.call.start()),
            "response.output_item.added" => {
                let item = &v["item"];
                match item["type"].as_str().unwrap_or("") {
                    "function_call" => {
                        self.close(out, None);
                        self.calls += 1;
                        let name = item["name"].as_str().unwrap_or("");
                        out.send(Frame::FunctionCallStart {
                            id: item["call_id"]
                                .as_str()
                                .or_else(|| item["id"].as_str())
                                .unwrap_or("")
                                .to_string(),
                            function_id: self.call.names.id_of(name),
                        });
                        self.open = Open::Call;
                        self.call_args_streamed = false;
                    }
                    "reasoning" => self.ensure_thinking(out),
                    _ => {}
                }
            }
            "response.output_text.delta" | "response.refusal.delta" => {
                let delta = text("delta").ok_or_else(|| malformed("event", &ev.data))?;
                self.ensure_text(out);
                out.send(Frame::TextDelta { delta });
            }
            "response.reasoning_summary_part.added" => {
                self.ensure_thinking(out);
                if self.summary_parts > 0 {
                    out.send(Frame::ThinkingDelta {
                        delta: "\n\n".into(),
                    });
                }
                self.summary_parts += 1;
            }
            "response.reasoning_summary_text.delta" | "response.reasoning_text.delta" => {
                let delta = text("delta").ok_or_else(|| malformed("event", &ev.data))?;
                self.ensure_thinking(out);
                out.send(Frame::ThinkingDelta { delta });
            }
            "response.function_call_arguments.delta" => {
                let delta = text("delta").ok_or_else(|| malformed("event", &ev.data))?;
                if self.open == Open::Call && !delta.is_empty() {
                    self.call_args_streamed = true;
                    out.send(Frame::FunctionCallDelta { delta });
                }
            }
            "response.output_item.done" => {
                let item = &v["item"];
                match item["type"].as_str().unwrap_or("") {
                    "function_call" if self.open == Open::Call => {
                        if !self.call_args_streamed {
                            if let Some(a) = item["arguments"].as_str().filter(|a| !a.is_empty()) {
                                out.send(Frame::FunctionCallDelta { delta: a.into() });
                            }
                        }
                        self.close(out, None);
                    }
                    "reasoning" => {
                        self.ensure_thinking(out);
                        self.close(out, reasoning_signature(item));
                    }
                    "message" if self.open == Open::Text => self.close(out, None),
                    _ => {}
                }
            }
            "response.completed" => {
                self.close(out, None);
                self.usage(out, &v["response"]);
                let stop = if self.calls > 0 {
                    StopReason::FunctionCall
                } else {
                    StopReason::End
                };
                self.stop = Some((stop, Some("completed".into())));
                return Ok(Flow::End);
            }
            "response.incomplete" => {
                self.close(out, None);
                let r = &v["response"];
                self.usage(out, r);
                let reason = r["incomplete_details"]["reason"]
                    .as_str()
                    .unwrap_or("incomplete")
                    .to_string();
                let stop = if reason == "max_output_tokens" {
                    StopReason::Length
                } else {
                    StopReason::End
                };
                self.stop = Some((stop, Some(reason)));
                return Ok(Flow::End);
            }
            "response.failed" => {
                let r = &v["response"];
                let body = parse_error_body(r.get("error").map_or(r, |e| e));
                return Err(classify_stream(&body, &self.call.secrets));
            }
            "error" => return Err(self.call.error(&v)),
            _ => {}
        }
        Ok(Flow::Continue)
    }

    fn finish(&mut self, out: &mut FrameWriter) -> (StopReason, Option<String>) {
        self.close(out, None);
        self.stop.clone().unwrap_or((StopReason::End, None))
    }
}

#[async_trait]
impl Provider for OpenAiResponsesProvider {
    fn id(&self) -> &str {
        &self.id
    }

    async fn chat(&self, req: ChatRequest, out: FrameWriter, cancel: CancellationToken) -> ChatAck {
        let built = self.body(&req, out.context());
        let url = format!("{}/responses", self.base_url);
        let request = |body: &Value| Ok(self.transport.bearer_sse_post(url, body, &self.key));
        let decoder = |call| ResponsesDecoder {
            call,
            open: Open::None,
            call_args_streamed: false,
            summary_parts: 0,
            calls: 0,
            stop: None,
        };
        self.transport
            .stream(&req.model, built, out, cancel, request, decoder)
            .await
    }

    fn describe(&self) -> Value {
        json!({"id": self.id, "kind": "openai-responses", "base_url": crate::providers::public_url(&self.base_url)})
    }
}
