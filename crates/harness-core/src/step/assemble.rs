//! The context of a generation: `context::assemble` (or its fallback), the compaction it
//! persists, the ephemeral notices, the pre-generate hooks and the final count, at most two
//! passes; and what a refused message leaves out of later windows.

use std::sync::Arc;

use harness_types::context::{
    AssembleCall, AssembleOptions, AssembleRequest, AssembleResponse, CountTokensRequest,
    CountTokensResponse, ModelRef, COMPACTION_ENTRY, OVERFLOW_PREFIX,
};
use harness_types::message::AgentMessage;
use harness_types::{ids, now_ms, HarnessError};
use serde_json::{json, Value};

use crate::context::{self, Window};
use crate::failpoint;
use crate::harness::{custom_append, Harness, Result};
use crate::hooks::{self, Decision, HookPoint};
use crate::machine::ContextRefusal;
use crate::record::TurnRecord;

/// Tokens reserved for request framing.
const FRAMING_TOKENS: u64 = 64;

/// A step's context, ready to send.
pub(super) struct Prepared {
    pub system_prompt: Option<String>,
    pub messages: Arc<Vec<AgentMessage>>,
    /// Its token count.
    pub tokens: u64,
    /// See [`output_room`].
    pub max_output_tokens: Option<u32>,
    /// What a compaction's summary cost, when this step wrote one.
    pub compaction_usage: Option<harness_types::message::Usage>,
}

/// The output cap of a generation: never more than the window leaves after the prompt (a
/// server asked for more fills its window and fails, or runs for minutes). The turn's own cap
/// is kept when smaller; without one, the catalog's limit stands when the room exceeds it
/// (nothing is sent that the provider would not have been sent before).
fn output_room(
    window: u64,
    prompt_tokens: u64,
    cap: Option<u32>,
    catalog: Option<&Value>,
) -> Option<u32> {
    let room = window
        .saturating_sub(prompt_tokens)
        .clamp(1, u32::MAX as u64) as u32;
    match cap {
        Some(c) => Some(c.min(room)),
        None => {
            let limit = catalog.and_then(|c| c["max_output_tokens"].as_u64());
            limit.is_none_or(|l| (room as u64) < l).then_some(room)
        }
    }
}

/// Reserved up front when `pre_generate` hooks may add to the request, and added to the
/// overflow of a first pass before the one reassembly.
pub(super) const REASSEMBLY_SLACK: u64 = 256;

impl Harness {
    /// Runs the pre-generate chain: it may replace the system prompt, append messages (never
    /// persisted) or deny the generation; static `inject_prompt` texts are appended to the prompt.
    /// The final budget check is the caller's.
    async fn pre_generate(
        &self,
        hooks: &[hooks::Hook],
        rec: &TurnRecord,
        system_prompt: Option<String>,
        messages: Vec<AgentMessage>,
        tools: &[harness_types::router::ToolSpec],
    ) -> Result<std::result::Result<(Option<String>, Vec<AgentMessage>), ContextRefusal>> {
        let expose = rec.options.expose();
        let mut env = hooks::envelope(
            HookPoint::PreGenerate,
            &rec.session_id,
            &rec.turn_id,
            rec.step,
            rec.depth,
            rec.options.metadata.as_ref(),
        );
        env["generate"] = json!({"system_prompt": system_prompt, "messages": messages,
                                 "model": rec.options.model, "provider": rec.options.provider, "tools": tools, "expose": expose});
        let chain = self
            .run_chain(HookPoint::PreGenerate, hooks, env, None, None)
            .await?;
        if let Decision::Deny(reason) = chain.decision {
            return Ok(Err(ContextRefusal::Denied(reason)));
        }
        let generate = &chain.payload["generate"];
        let mut prompt = generate["system_prompt"].as_str().map(str::to_string);
        for text in chain.injected {
            prompt = Some(match prompt {
                Some(p) => format!("{p}\n\n{text}"),
                None => text,
            });
        }
        let messages: Vec<AgentMessage> = match serde_json::from_value(generate["messages"].clone())
        {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(session = %rec.session_id, "pre_generate hooks left messages that do not parse, ignoring them: {e}");
                messages
            }
        };
        Ok(Ok((prompt, messages)))
    }

    /// Spec §3.3 step 13, at most two passes: `context::assemble` → persist a compaction →
    /// rotate late user messages → registry notice → `pre_generate` hooks → orphan patch →
    /// final count. A first overflow reassembles once with the difference reserved; a second
    /// one is a clean `harness.context_overflow`. Answers the prompt, the messages and their
    /// token count, or why the context was refused.
    pub(super) async fn assemble_context(
        &self,
        rec: &TurnRecord,
        window: &Window,
        system_prompt: Option<String>,
        tools: &[harness_types::router::ToolSpec],
        held_back: u64,
    ) -> Result<std::result::Result<Prepared, ContextRefusal>> {
        let catalog = self.catalog_entry(rec).await;
        let context_window = self.context_window_of(catalog.as_deref());
        let max_output = rec.options.max_output_tokens.unwrap_or(0) as u64;
        // The policy is read only when the history could overflow at all: no tokenizer yields
        // more tokens than bytes, and the usage correction at most doubles a count.
        let tools_bytes: u64 = tools
            .iter()
            .map(|t| {
                (t.name.len() + t.description.len() + t.parameters.to_string().len()) as u64 + 16
            })
            .sum();
        let may_overflow = 2
            * (window.bytes
                + window
                    .previous
                    .as_ref()
                    .map_or(0, |p| p.summary.len() as u64 + 256)
                + system_prompt.as_ref().map_or(0, |p| p.len() as u64 + 8)
                + tools_bytes
                + FRAMING_TOKENS
                + REASSEMBLY_SLACK)
            > context_window.saturating_sub(max_output);
        let prune = may_overflow && self.prune_allowed(rec, catalog.as_deref()).await?.0;
        // Read once for the step: whether to run them, and the chain each pass runs.
        let pre_generate = self.hooks(HookPoint::PreGenerate).await?;
        let hooked = !pre_generate.is_empty();
        let registry_changed = {
            let live = self.functions_generation();
            rec.functions_generation.is_some_and(|seen| seen != live)
                && rec
                    .options
                    .functions
                    .as_ref()
                    .is_some_and(|p| !p.allow.is_empty())
        };
        let preloaded = self.preloaded_notice(rec).await;
        let mut extra = if hooked { REASSEMBLY_SLACK } else { 0 } + held_back;
        for pass in 0..2u32 {
            let model = ModelRef {
                id: rec.options.model.clone(),
                provider: rec.options.provider.clone(),
            };
            let options = AssembleOptions {
                lease_key: Some(rec.session_id.clone()),
                request_overhead_tokens: FRAMING_TOKENS + extra,
                context_window,
                max_output_tokens: max_output,
                previous_summary: window.previous.clone(),
                prune_function_results: prune,
                summary_request_id: Some(format!(
                    "{}:compaction:{pass}",
                    ids::request_id(&rec.turn_id, rec.step)
                )),
                no_compaction: false,
            };
            let req = AssembleRequestRef {
                shared: &window.messages,
                identities: &window.identities,
                messages: &window.messages,
                model: &model,
                system_prompt: system_prompt.as_deref(),
                tools,
                options: &options,
            };
            let mut assembled = match self.call_assemble(req).await? {
                Ok(a) => a,
                Err(ContextRefusal::Overflow(detail))
                    if context::too_large_index(&detail).is_some() =>
                {
                    self.exclude_message(rec, window, &detail).await?;
                    return Ok(Err(ContextRefusal::Overflow(detail)));
                }
                // The second pass only exists because the hooks' additions did not fit.
                Err(ContextRefusal::Overflow(detail)) if pass == 1 && hooked => {
                    return Ok(Err(ContextRefusal::OverflowAfterHooks(detail)))
                }
                Err(why) => return Ok(Err(why)),
            };
            if assembled.token_count > assembled.usable {
                return Ok(Err(ContextRefusal::Overflow(format!(
                    "{OVERFLOW_PREFIX} context::assemble answered ~{} tokens for {} usable",
                    assembled.token_count, assembled.usable
                ))));
            }
            // A window that fit as sent is not echoed back: it is rebuilt here.
            let mut messages =
                assembled.context_of(&window.messages, window.previous.as_ref(), now_ms());
            if messages.is_empty() {
                return Ok(Err(ContextRefusal::Empty));
            }
            let compaction = context::compaction_record(window, &assembled);
            let assembled_tokens = assembled.token_count;
            let usable = assembled.usable;
            let mut changed = false;
            let mut prompt = assembled.system_prompt;
            if !window.late_users.is_empty() {
                changed |= context::rotate(&mut messages, &window.late_users);
            }
            // A cut reply with calls is followed by their patched results instead.
            if window.resume_notice.is_some()
                && messages.last().is_some_and(|m| match m {
                    AgentMessage::Assistant(a) => !a.content.iter().any(|b| {
                        matches!(b, harness_types::message::ContentBlock::FunctionCall { .. })
                    }),
                    _ => false,
                })
            {
                Arc::make_mut(&mut messages)
                    .push(AgentMessage::user_text(context::RESUME_MARKER, now_ms()));
                changed = true;
            }
            // The registry changed since this session last looked: contracts it fetched may be
            // stale. An ephemeral tail message, never persisted; the first sighting only stamps.
            if registry_changed {
                Arc::make_mut(&mut messages).push(AgentMessage::user_text(
                    crate::texts::FUNCTIONS_CHANGED,
                    now_ms(),
                ));
                changed = true;
            }
            // Ephemeral too, on every step until a new session resolves the profile afresh.
            if let Some(text) = &preloaded {
                Arc::make_mut(&mut messages).push(AgentMessage::user_text(text.clone(), now_ms()));
                changed = true;
            }
            if hooked {
                let list = Arc::unwrap_or_clone(messages);
                match self
                    .pre_generate(&pre_generate, rec, prompt, list, tools)
                    .await?
                {
                    Ok((p, m)) => (prompt, messages) = (p, Arc::new(m)),
                    Err(why) => return Ok(Err(why)),
                }
                changed = true;
            }
            // The window knows when every call it holds has its result; the context manager's
            // own list (compacted) and the hooks' are checked.
            if !assembled.unchanged || hooked || window.unresolved_calls {
                changed |= context::patch_orphans(&mut messages, &window.answered);
            }
            if messages.is_empty() {
                return Ok(Err(ContextRefusal::Empty));
            }
            let tokens = if changed {
                self.count_tokens(rec, &messages, prompt.as_deref(), tools)
                    .await?
                    + FRAMING_TOKENS
            } else {
                assembled_tokens - extra
            };
            if tokens <= usable {
                let compaction_usage = compaction.as_ref().and_then(|c| c.usage.clone());
                if let Some(record) = compaction {
                    // Persisted only once the context is final: a crash before this line costs
                    // one more summary, never a message; the id makes a redelivery a no-op.
                    let data = serde_json::to_value(&record)
                        .map_err(|e| HarnessError::internal(e.to_string()))?;
                    failpoint::hit("before_compaction_appended");
                    let id = ids::compaction_entry(&rec.turn_id, rec.step);
                    self.append(custom_append(rec, id, COMPACTION_ENTRY, data))
                        .await?;
                    failpoint::hit("after_compaction_appended");
                }
                // What is held back is prompt the count missed: no room for output either.
                let room = output_room(
                    context_window,
                    tokens + held_back,
                    rec.options.max_output_tokens,
                    catalog.as_deref(),
                );
                return Ok(Ok(Prepared {
                    system_prompt: prompt,
                    messages,
                    tokens,
                    max_output_tokens: room,
                    compaction_usage,
                }));
            }
            let detail = format!(
                "{OVERFLOW_PREFIX} ~{tokens} tokens after {}, {usable} usable",
                if hooked {
                    "pre_generate hooks"
                } else {
                    "final assembly"
                }
            );
            if pass == 1 {
                return Ok(Err(if hooked {
                    ContextRefusal::OverflowAfterHooks(detail)
                } else {
                    ContextRefusal::Overflow(detail)
                }));
            }
            tracing::debug!(session = %rec.session_id, "{detail}; reassembling once");
            extra +=
                tokens.saturating_sub(assembled_tokens.saturating_sub(extra)) + REASSEMBLY_SLACK;
        }
        unreachable!("the assembly loop returns on its second pass")
    }

    /// Leaves the message a `context/message_too_large` refusal names out of later windows of
    /// the session (an `EXCLUDED_ENTRY` custom entry; the id makes a redelivery a no-op).
    async fn exclude_message(&self, rec: &TurnRecord, window: &Window, detail: &str) -> Result<()> {
        let Some(entry_id) = context::too_large_index(detail).and_then(|i| window.entry_ids.get(i))
        else {
            return Ok(());
        };
        self.exclude_entry(rec, entry_id, detail).await
    }

    /// Writes the `EXCLUDED_ENTRY` that leaves `entry_id` out of the session's later windows.
    async fn exclude_entry(&self, rec: &TurnRecord, entry_id: &str, detail: &str) -> Result<()> {
        let id = format!("e_{}_{}_excluded", rec.turn_id, rec.step);
        let data = json!({"entry_id": entry_id, "detail": detail});
        self.append(custom_append(rec, id, context::EXCLUDED_ENTRY, data))
            .await
            .map(|_| ())
    }

    /// After the server refused the prompt as over its window twice: when the latest user
    /// message is most of the prompt (by bytes, which bound tokens), it is what does not fit a
    /// window nobody told the loop, and it is left out of later requests like a message refused
    /// as too large, so the session's next message is not refused with it.
    pub(super) async fn exclude_dominant_message(
        &self,
        rec: &TurnRecord,
        window: &Window,
        request_bytes: u64,
    ) -> Result<()> {
        let Some(at) = window
            .messages
            .iter()
            .rposition(|m| matches!(m, AgentMessage::User(_)))
        else {
            return Ok(());
        };
        let bytes = context::byte_bound(std::slice::from_ref(&window.messages[at]));
        let (Some(entry_id), true) = (window.entry_ids.get(at), bytes * 2 > request_bytes) else {
            return Ok(());
        };
        let detail = format!(
            "context/message_too_large: message {at} of the request (~{bytes} bytes, most of the prompt) was refused by the server as over its window twice; it is left out of later requests: send it shorter or in parts, or tell harness the window (--context-window)"
        );
        self.exclude_entry(rec, entry_id, &detail).await
    }

    /// `context::assemble` on the bus, its errors classified; the small fallback when no
    /// context manager is registered. Transient bus failures are step errors (redelivered).
    async fn call_assemble(
        &self,
        req: AssembleRequestRef<'_>,
    ) -> Result<std::result::Result<AssembleResponse, ContextRefusal>> {
        let timeout = std::time::Duration::from_millis(self.config().context_timeout_ms);
        let answer = match self.inner.bus.local_handler("context::assemble") {
            // In-process: the history is shared, nothing is serialized.
            Some(local) => harness_bus::local::invoke::<AssembleResponse>(
                local.as_ref(),
                "context::assemble",
                Box::new(req.local()),
                harness_bus::CallContext::default(),
                timeout,
            )
            .await
            .map(Ok),
            None => {
                let payload = serde_json::to_value(&req)
                    .map_err(|e| HarnessError::internal(e.to_string()))?;
                self.inner
                    .bus
                    .call("context::assemble", payload, Some(timeout))
                    .await
                    .map(|v| {
                        serde_json::from_value(v).map_err(|e| {
                            ContextRefusal::Manager(format!(
                                "context::assemble answered an unexpected shape: {e}"
                            ))
                        })
                    })
            }
        };
        match answer {
            Ok(parsed) => Ok(parsed),
            Err(e) if e.is_not_found() => {
                Ok(context::fallback(req.owned()).map_err(ContextRefusal::Overflow))
            }
            Err(e)
                if e.code == "context/overflow"
                    || e.code == "context/message_too_large"
                    || e.message.contains(OVERFLOW_PREFIX) =>
            {
                Ok(Err(ContextRefusal::Overflow(e.message)))
            }
            Err(e) if e.code == "context/summarizer" => {
                Ok(Err(ContextRefusal::Compaction(e.message)))
            }
            Err(e) if e.is_transient_dependency() => Err(e.into_harness()),
            Err(e) => Ok(Err(ContextRefusal::Manager(e.to_string()))),
        }
    }

    /// `context::count-tokens` on the bus (the fallback's estimate without a context manager).
    async fn count_tokens(
        &self,
        rec: &TurnRecord,
        messages: &[AgentMessage],
        system_prompt: Option<&str>,
        tools: &[harness_types::router::ToolSpec],
    ) -> Result<u64> {
        let req = CountTokensRequest {
            messages: messages.to_vec(),
            model: ModelRef {
                id: rec.options.model.clone(),
                provider: rec.options.provider.clone(),
            },
            system_prompt: system_prompt.map(str::to_string),
            tools: tools.to_vec(),
        };
        let payload =
            serde_json::to_value(&req).map_err(|e| HarnessError::internal(e.to_string()))?;
        let timeout = std::time::Duration::from_millis(self.config().context_timeout_ms);
        match self
            .inner
            .bus
            .call("context::count-tokens", payload, Some(timeout))
            .await
        {
            Ok(v) => serde_json::from_value::<CountTokensResponse>(v)
                .map(|r| r.tokens)
                .map_err(|e| {
                    HarnessError::dependency(format!(
                        "context::count-tokens answered an unexpected shape: {e}"
                    ))
                }),
            Err(e) if e.is_not_found() => Ok(context::estimate(messages, system_prompt, tools)),
            Err(e) => Err(e.into_harness()),
        }
    }

    /// Whether the session's context may prune aged function results, and where that came
    /// from: the session's own setting (`harness::context-policy {set}`) or the model's
    /// default (see [`context::model_allows_pruning`]).
    pub(crate) async fn prune_allowed(
        &self,
        rec: &TurnRecord,
        catalog: Option<&Value>,
    ) -> Result<(bool, harness_types::context::PolicySource, String)> {
        self.context_policy_of(&rec.session_id, catalog).await
    }

    /// The turn's model as the router's catalog describes it (`None` when it cannot say). In
    /// process the router's own copy is shared: asked on every step, it is neither a JSON
    /// request nor a row serialized again.
    pub(crate) async fn catalog_entry(&self, rec: &TurnRecord) -> Option<Arc<Value>> {
        const ID: &str = "router::models::get";
        let timeout = std::time::Duration::from_millis(self.config().session_timeout_ms);
        if let Some(local) = self.inner.bus.local_handler(ID) {
            let req = ModelRef {
                id: rec.options.model.clone(),
                provider: rec.options.provider.clone(),
            };
            let ctx = harness_bus::CallContext::default();
            return harness_bus::local::invoke(local.as_ref(), ID, Box::new(req), ctx, timeout)
                .await
                .ok();
        }
        let req = json!({"provider": rec.options.provider, "id": rec.options.model});
        self.inner
            .bus
            .call(ID, req, Some(timeout))
            .await
            .ok()
            .map(Arc::new)
    }

    /// The model's context window from its catalog row; for models the router does not know
    /// (or only by a catch-all row), the configured default.
    fn context_window_of(&self, entry: Option<&Value>) -> u64 {
        match entry {
            // A provider's catch-all row is a guess; the configured default is the better one.
            Some(entry) if entry["generic"] != true => entry["context_window"]
                .as_u64()
                .unwrap_or(self.config().default_context_window),
            _ => self.config().default_context_window,
        }
    }
}

/// An [`AssembleRequest`] serialized from what the step already holds: a long history is not
/// copied just to be turned into JSON.
#[derive(serde::Serialize)]
struct AssembleRequestRef<'a> {
    #[serde(skip)]
    shared: &'a std::sync::Arc<Vec<AgentMessage>>,
    #[serde(skip)]
    identities: &'a std::sync::Arc<Vec<u64>>,
    messages: &'a [AgentMessage],
    model: &'a ModelRef,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_prompt: Option<&'a str>,
    tools: &'a [harness_types::router::ToolSpec],
    options: &'a AssembleOptions,
}

impl AssembleRequestRef<'_> {
    /// The in-process form: the history shared, the rest copied (small).
    fn local(&self) -> AssembleCall {
        AssembleCall {
            messages: std::sync::Arc::clone(self.shared),
            identities: Some(std::sync::Arc::clone(self.identities)),
            request: AssembleRequest {
                messages: Vec::new(),
                model: self.model.clone(),
                system_prompt: self.system_prompt.map(str::to_string),
                tools: self.tools.to_vec(),
                options: self.options.clone(),
            },
        }
    }

    fn owned(&self) -> AssembleRequest {
        AssembleRequest {
            messages: self.messages.to_vec(),
            model: self.model.clone(),
            system_prompt: self.system_prompt.map(str::to_string),
            tools: self.tools.to_vec(),
            options: self.options.clone(),
        }
    }
}
