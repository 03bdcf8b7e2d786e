//! The scripted provider (`scripted`): replays generations from a JSON script.
//!
//! ```json
//! {"generations": [{"match": {"last_user_text": "^hello"}, "delay_ms": 0, "chunk_delay_ms": 0,
//!   "content": [{"type": "text", "text": "Hi there."}], "stop_reason": "end"}]}
//! ```
//!
//! Each request takes the first unused generation whose `match` holds (`repeat: true` marks a
//! generation that is never used up). The assignment is durable: the same `request_id`
//! (`<turn_id>:<step>`) always gets the same generation, across restarts, so a crash test
//! replays exactly. Text is streamed in several deltas.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use harness_bus::Bus;
use harness_types::message::{
    AgentMessage, AssistantMessage, ContentBlock, ErrorKind, StopReason, Usage,
};
use harness_types::router::{ChatAck, ChatRequest, Frame};
use harness_types::{now_ms, HarnessError};
use regex::Regex;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::error::ProviderError;
use crate::router::{FrameWriter, Provider};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptFile {
    generations: Vec<GenerationSpec>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MatchSpec {
    #[serde(default)]
    last_user_text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ErrorSpec {
    kind: ErrorKind,
    message: String,
    #[serde(default)]
    after_text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerationSpec {
    #[serde(default, rename = "match")]
    matcher: Option<MatchSpec>,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    chunk_delay_ms: u64,
    #[serde(default)]
    content: Vec<ContentBlock>,
    #[serde(default)]
    stop_reason: Option<StopReason>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<ErrorSpec>,
    #[serde(default)]
    repeat: bool,
}

struct Generation {
    last_user_text: Option<Regex>,
    delay: Duration,
    chunk_delay: Duration,
    content: Vec<ContentBlock>,
    stop_reason: StopReason,
    usage: Option<Usage>,
    error: Option<ErrorSpec>,
    repeat: bool,
}

/// A parsed, validated script.
pub struct Script {
    generations: Vec<Generation>,
    digest: String,
}

impl Script {
    pub fn from_json(text: &str) -> Result<Script, HarnessError> {
        let file: ScriptFile = harness_types::parse::parse_payload(
            serde_json::from_str(text)
                .map_err(|e| HarnessError::invalid(format!("script: not JSON: {e}")))?,
        )
        .map_err(|e| HarnessError::invalid(format!("script: {}", e.message)))?;
        let mut generations = Vec::with_capacity(file.generations.len());
        for (i, g) in file.generations.into_iter().enumerate() {
            let last_user_text = match g.matcher.and_then(|m| m.last_user_text) {
                Some(pattern) => Some(Regex::new(&pattern).map_err(|e| {
                    HarnessError::invalid_field(
                        &format!("script: generations[{i}].match.last_user_text"),
                        e,
                    )
                })?),
                None => None,
            };
            let has_calls = g
                .content
                .iter()
                .any(|b| matches!(b, ContentBlock::FunctionCall { .. }));
            generations.push(Generation {
                last_user_text,
                delay: Duration::from_millis(g.delay_ms),
                chunk_delay: Duration::from_millis(g.chunk_delay_ms),
                stop_reason: g.stop_reason.unwrap_or(if has_calls {
                    StopReason::FunctionCall
                } else {
                    StopReason::End
                }),
                content: g.content,
                usage: g.usage,
                error: g.error,
                repeat: g.repeat,
            });
        }
        Ok(Script {
            generations,
            digest: harness_types::digest::fnv1a_hex(text.as_bytes()),
        })
    }

    pub fn load(path: &Path) -> Result<Script, HarnessError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            HarnessError::invalid(format!("script: cannot read {}: {e}", path.display()))
        })?;
        Script::from_json(&text)
    }

    /// True when no generation is ever used up: the choice is then a pure function of the
    /// request, and nothing needs to be remembered.
    fn stateless(&self) -> bool {
        self.generations.iter().all(|g| g.repeat)
    }
}

/// `{request_id}` in a scripted call id makes it unique per generation, as a real model's ids
/// are: a `repeat` generation can then call a function at every step.
fn with_request_id(block: &ContentBlock, request_id: &str) -> ContentBlock {
    match block {
        ContentBlock::FunctionCall {
            id,
            function_id,
            arguments,
        } if id.contains("{request_id}") => ContentBlock::FunctionCall {
            id: id.replace("{request_id}", &harness_types::ids::san(request_id)),
            function_id: function_id.clone(),
            arguments: arguments.clone(),
        },
        other => other.clone(),
    }
}

#[derive(Default)]
struct Assignments {
    loaded: bool,
    used: HashSet<usize>,
    by_request: HashMap<String, usize>,
}

/// The scripted provider.
pub struct ScriptedProvider {
    script: Script,
    bus: Arc<dyn Bus>,
    // A tokio Mutex: choosing a generation and persisting the choice must be one atomic step, and
    // persisting awaits the store.
    assignments: Mutex<Assignments>,
}

fn last_user_text(messages: &[AgentMessage]) -> String {
    messages
        .iter()
        .rev()
        .find_map(|m| match m {
            AgentMessage::User(u) => Some(harness_types::message::joined_text(&u.content)),
            _ => None,
        })
        .unwrap_or_default()
}

/// Splits text into word-sized deltas (at least one).
fn deltas(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for ch in text.chars() {
        current.push(ch);
        if ch.is_whitespace() && !current.trim().is_empty() {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() || out.is_empty() {
        out.push(current);
    }
    out
}

impl ScriptedProvider {
    pub fn new(script: Script, bus: Arc<dyn Bus>) -> Self {
        ScriptedProvider {
            script,
            bus,
            assignments: Mutex::new(Assignments::default()),
        }
    }

    fn scope(&self) -> String {
        format!("router_scripted:{}", self.script.digest)
    }

    fn first_match(&self, used: &HashSet<usize>, text: &str) -> Option<usize> {
        self.script
            .generations
            .iter()
            .enumerate()
            .position(|(i, g)| {
                (g.repeat || !used.contains(&i))
                    && g.last_user_text.as_ref().is_none_or(|re| re.is_match(text))
            })
    }

    async fn assign(&self, req: &ChatRequest) -> Result<Option<usize>, ProviderError> {
        let text = last_user_text(&req.messages);
        if self.script.stateless() {
            return Ok(self.first_match(&HashSet::new(), &text));
        }
        let state_err = |e: harness_bus::BusError| ProviderError {
            code: "router/state".into(),
            kind: ErrorKind::Transient,
            message: format!("scripted provider could not read its assignments: {e}"),
            detail: None,
            retry_after: None,
            cause: Box::default(),
        };
        let mut a = self.assignments.lock().await;
        if !a.loaded {
            for (key, value) in self
                .bus
                .state_list(&self.scope())
                .await
                .map_err(state_err)?
            {
                if let Some(i) = value.get("index").and_then(|v| v.as_u64()) {
                    a.used.insert(i as usize);
                    a.by_request.insert(key, i as usize);
                }
            }
            a.loaded = true;
        }
        if let Some(i) = a.by_request.get(&req.request_id) {
            return Ok(Some(*i));
        }
        let Some(i) = self.first_match(&a.used, &text) else {
            return Ok(None);
        };
        self.bus
            .state_set(&self.scope(), &req.request_id, json!({"index": i}))
            .await
            .map_err(state_err)?;
        a.used.insert(i);
        a.by_request.insert(req.request_id.clone(), i);
        Ok(Some(i))
    }
}

/// Sleeps unless cancelled first; true when cancelled.
async fn pause(d: Duration, cancel: &CancellationToken) -> bool {
    if d.is_zero() {
        return cancel.is_cancelled();
    }
    tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = cancel.cancelled() => true,
    }
}

fn estimate_tokens(chars: usize) -> u64 {
    chars.div_ceil(4) as u64
}

#[async_trait]
impl Provider for ScriptedProvider {
    fn id(&self) -> &str {
        "scripted"
    }

    async fn chat(
        &self,
        req: ChatRequest,
        mut out: FrameWriter,
        cancel: CancellationToken,
    ) -> ChatAck {
        let index = match self.assign(&req).await {
            Ok(Some(i)) => i,
            Ok(None) => {
                return out.fail(&ProviderError {
                    code: "router/script_exhausted".into(),
                    kind: ErrorKind::Permanent,
                    message: format!(
                        "the script has no unused generation matching the last user message (request {})",
                        req.request_id
                    ),
                    detail: None,
                    retry_after: None,
                    cause: Box::default(),
                })
            }
            Err(e) => return out.fail(&e),
        };
        let g = &self.script.generations[index];
        let mut message = AssistantMessage {
            stop_reason: g.stop_reason,
            ..AssistantMessage::ended(Vec::new(), req.model.clone(), "scripted", now_ms())
        };
        let aborted = |mut message: AssistantMessage, out: FrameWriter| {
            message.stop_reason = StopReason::Aborted;
            message.content = out.partial().content.clone();
            out.done(message)
        };
        if pause(g.delay, &cancel).await {
            return aborted(message, out);
        }
        out.send(Frame::Start {
            model: Some(req.model.clone()),
            provider: Some("scripted".into()),
        });
        if let Some(err) = &g.error {
            if let Some(text) = &err.after_text {
                out.send(Frame::TextStart);
                for d in deltas(text) {
                    if pause(g.chunk_delay, &cancel).await {
                        return aborted(message, out);
                    }
                    out.send(Frame::TextDelta { delta: d });
                }
            }
            return out.fail(&ProviderError {
                code: format!("router/{}", err.kind.as_str()),
                kind: err.kind,
                message: err.message.clone(),
                detail: None,
                retry_after: None,
                cause: Box::default(),
            });
        }
        for block in &g.content {
            let block = &with_request_id(block, &req.request_id);
            match block {
                ContentBlock::Text { text } => {
                    out.send(Frame::TextStart);
                    for d in deltas(text) {
                        if pause(g.chunk_delay, &cancel).await {
                            return aborted(message, out);
                        }
                        out.send(Frame::TextDelta { delta: d });
                    }
                    out.send(Frame::TextEnd);
                }
                ContentBlock::Thinking { text, signature } => {
                    out.send(Frame::ThinkingStart);
                    out.send(Frame::ThinkingDelta {
                        delta: text.clone(),
                    });
                    out.send(Frame::ThinkingEnd {
                        signature: signature.clone(),
                    });
                }
                ContentBlock::FunctionCall {
                    id,
                    function_id,
                    arguments,
                } => {
                    if pause(g.chunk_delay, &cancel).await {
                        return aborted(message, out);
                    }
                    out.send(Frame::FunctionCallStart {
                        id: id.clone(),
                        function_id: function_id.clone(),
                    });
                    out.send(Frame::FunctionCallDelta {
                        delta: arguments.to_string(),
                    });
                    out.send(Frame::FunctionCallEnd);
                }
                _ => {}
            }
            message.content.push(block.clone());
        }
        let usage = g.usage.clone().unwrap_or_else(|| Usage {
            input: Some(estimate_tokens(text_chars(&req))),
            output: Some(estimate_tokens(
                harness_types::message::joined_text(&message.content).len(),
            )),
            cost_usd: Some(0.0),
            ..Usage::default()
        });
        out.send(Frame::Usage {
            usage: usage.clone(),
        });
        out.send(Frame::Stop {
            stop_reason: message.stop_reason,
            error_message: None,
        });
        message.usage = Some(usage);
        out.done(message)
    }
}

/// Characters of the request's text (system prompt and message text), for the usage estimate;
/// counted in place, nothing joined.
fn text_chars(req: &ChatRequest) -> usize {
    req.messages
        .iter()
        .flat_map(|m| m.content())
        .filter_map(ContentBlock::as_text)
        .map(str::len)
        .sum::<usize>()
        + req.system_prompt.as_ref().map_or(0, String::len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_split_into_several_deltas_that_join_back() {
        let text = "The quick brown fox jumps.";
        let parts = deltas(text);
        assert!(parts.len() >= 4, "{parts:?}");
        assert_eq!(parts.concat(), text);
        assert_eq!(deltas(""), vec![String::new()]);
    }

    #[test]
    fn bad_scripts_name_the_field() {
        let err = Script::from_json(r#"{"generations": [{"match": {"last_user_text": "("}}]}"#)
            .err()
            .unwrap();
        assert!(
            err.message.contains("generations[0].match.last_user_text"),
            "{err}"
        );
        let err = Script::from_json(r#"{"generations": [{"stop_reason": "sideways"}]}"#)
            .err()
            .unwrap();
        assert!(err.message.contains("generations[0].stop_reason"), "{err}");
    }
}
