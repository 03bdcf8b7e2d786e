//! One durable step (`harness::turn`), top to bottom.
//!
//! generate: guard → drain steering → first-step event → max_turns → context → pre-append the
//! assistant entry → stream (lock released) ; finish: cancel? → failure/resume? → calls →
//! advance or finalize.

use harness_context::{AssembleOptions, AssembleRequest, AssembleResponse, ModelRef};
use harness_types::api::{TurnStartedEvent, TurnStatus, TurnStepPayload, TurnStepResult};
use harness_types::message::{
    AgentMessage, AssistantMessage, ContentBlock, FunctionResultMessage, StopReason,
};
use harness_types::router::ChatRequest;
use harness_types::session::{AppendRequest, Entry, SessionStatus};
use harness_types::{ids, now_ms, HarnessError};
use serde_json::{json, Value};

use crate::dispatch::{plan_calls, Dispatched};
use crate::failpoint;
use crate::finalize::Outcome;
use crate::harness::{Harness, Result};
use crate::hooks::{self, Decision, HookPoint};
use crate::locks::SessionGuard;
use crate::prompt;
use crate::record::{GeneratedStep, TurnRecord};
use crate::stream::Generation;
use tokio_util::sync::CancellationToken;

/// Tokens reserved for request framing.
const FRAMING_TOKENS: u64 = 64;

fn skipped(session_id: &str) -> TurnStepResult {
    TurnStepResult {
        session_id: session_id.to_string(),
        status: TurnStatus::Running,
        next_step: None,
        skipped: true,
    }
}

fn done(rec: &TurnRecord) -> TurnStepResult {
    TurnStepResult {
        session_id: rec.session_id.clone(),
        status: rec.status,
        next_step: (rec.status == TurnStatus::Running).then_some(rec.step),
        skipped: false,
    }
}

/// The model's view of the transcript: messages only, and every function call that has no
/// result anywhere gets a synthetic one right after its assistant message (context copy only).
fn model_messages(entries: &[Entry]) -> Vec<AgentMessage> {
    let messages: Vec<&AgentMessage> = entries.iter().filter_map(|e| e.message.as_ref()).collect();
    let answered: std::collections::HashSet<&str> = messages
        .iter()
        .filter_map(|m| match m {
            AgentMessage::FunctionResult(r) => Some(r.function_call_id.as_str()),
            _ => None,
        })
        .collect();
    let mut out = Vec::with_capacity(messages.len());
    for m in messages {
        out.push(m.clone());
        if let AgentMessage::Assistant(a) = m {
            for b in &a.content {
                if let ContentBlock::FunctionCall {
                    id, function_id, ..
                } = b
                {
                    if !answered.contains(id.as_str()) {
                        out.push(AgentMessage::FunctionResult(FunctionResultMessage {
                            function_call_id: id.clone(),
                            function_id: function_id.clone(),
                            content: vec![ContentBlock::text(
                                "result unknown: the call was interrupted after dispatch; it ran at most once — verify its effect before repeating it",
                            )],
                            details: json!({"error": "interrupted"}),
                            is_error: true,
                            timestamp: a.timestamp,
                        }));
                    }
                }
            }
        }
    }
    out
}

impl Harness {
    /// Runs one step. Stale and duplicate deliveries are acknowledged and dropped.
    pub async fn step(&self, payload: TurnStepPayload) -> Result<TurnStepResult> {
        let sid = payload.session_id.clone();
        let guard = self.inner.locks.lock(&sid).await;
        let Some(mut rec) = self.load_record(&sid).await? else {
            return self.end_lost_turn(&payload).await;
        };
        if rec.turn_id != payload.turn_id || rec.step != payload.step {
            return Ok(skipped(&sid));
        }
        if rec.is_terminal() {
            // A crash between the terminal write and the event: publish again (deduplicated).
            self.repeat_terminal_effects(&rec).await?;
            return Ok(skipped(&sid));
        }
        if rec.status != TurnStatus::Running {
            return Ok(skipped(&sid));
        }
        if rec.abort {
            return self
                .finalize(&mut rec, Outcome::Cancelled)
                .await
                .map(|_| done(&rec));
        }
        if let Some(generated) = rec.generated.clone().filter(|g| g.step == rec.step) {
            // Redelivered after the model had answered: resume at the calls, never re-ask.
            let entry_id = ids::assistant_entry(&rec.turn_id, rec.step);
            let message = self
                .transcript(&sid)
                .await?
                .into_iter()
                .find(|e| e.entry_id == entry_id)
                .and_then(|e| match e.message {
                    Some(AgentMessage::Assistant(m)) => Some(m),
                    _ => None,
                })
                .ok_or_else(|| {
                    HarnessError::state(format!(
                        "entry_id: '{entry_id}' is missing after its generation was recorded"
                    ))
                })?;
            let generation = Generation {
                message,
                error: generated.error,
            };
            let cancel = self.signal(&rec.turn_id);
            return self.finish(&payload, guard, generation, cancel, None).await;
        }
        // A step redelivered mid-generation finds its assistant entry already there: it rebuilds
        // the context it had (everything before that entry) and leaves newly queued steering
        // for the next step, which the steering check below then schedules.
        let entry_id = ids::assistant_entry(&rec.turn_id, rec.step);
        let mut entries = self.transcript(&sid).await?;
        match entries.iter().position(|e| e.entry_id == entry_id) {
            Some(at) => entries.truncate(at),
            None => {
                if self.drain_queue(&sid, &rec.turn_id).await? > 0 {
                    entries = self.transcript(&sid).await?;
                }
            }
        }
        self.set_status(&sid, SessionStatus::Working, Some("preparing context"))
            .await?;
        if rec.step == 0 && rec.turn_count == 0 {
            self.emit_turn_started(TurnStartedEvent {
                session_id: sid.clone(),
                turn_id: rec.turn_id.clone(),
                timestamp: now_ms(),
                parent: rec.parent.clone(),
                depth: rec.depth,
                message_preview: rec.message_preview.clone(),
            })
            .await?;
            let env = hooks::envelope(
                HookPoint::PreTurn,
                &sid,
                &rec.turn_id,
                rec.step,
                rec.depth,
                rec.options.metadata.as_ref(),
            );
            if let Decision::Deny(reason) = self
                .run_hooks(HookPoint::PreTurn, env, None, None)
                .await?
                .decision
            {
                self.finalize(
                    &mut rec,
                    Outcome::failed(
                        "harness.pre_turn_denied",
                        "pre_turn",
                        "A hook refused to start this turn.",
                        Some(format!("pre_turn hook denied: {reason}")),
                    ),
                )
                .await?;
                return Ok(done(&rec));
            }
        }
        if rec.turn_count >= rec.options.max_turns {
            let text = format!(
                "max_turns ({}) reached; ending the turn.",
                rec.options.max_turns
            );
            self.append_custom(
                &sid,
                ids::max_turns_entry(&rec.turn_id),
                "notice",
                json!({"reason": "max_turns", "message": text}),
                &rec.turn_id,
            )
            .await?;
            rec.stop_reason = Some("max_turns".into());
            self.finalize(&mut rec, Outcome::Completed(json!(text)))
                .await?;
            return Ok(done(&rec));
        }

        // Context.
        let new_watermark = entries.last().map(|e| e.entry_id.clone());
        let mut messages = model_messages(&entries);
        // The registry changed since this session last looked: contracts it fetched may be stale.
        // An ephemeral tail message, never persisted; the first sighting only stamps.
        let live = self.functions_generation();
        if rec.functions_generation.is_some_and(|seen| seen != live)
            && rec
                .options
                .functions
                .as_ref()
                .is_some_and(|p| !p.allow.is_empty())
        {
            messages.push(AgentMessage::user_text(
                "[harness] The set of registered functions changed since your last step: contracts you fetched earlier may be stale. \
                 Re-read a function's schema with engine::functions::info before calling it again.",
                now_ms(),
            ));
        }
        let seen_generation = Some(live);
        let system_prompt = prompt::for_step(
            rec.options.system_prompt.as_deref(),
            &sid,
            rec.options.functions.as_ref(),
        );
        let tools = self.tool_surface(&rec).await?;
        let assembled = match self
            .assemble(&rec, messages, system_prompt, tools.clone())
            .await
        {
            Ok(a) => a,
            Err(overflow) => {
                self.finalize(
                    &mut rec,
                    Outcome::failed(
                        "harness.context_overflow",
                        "context_assembly",
                        "The conversation no longer fits the model's context window.",
                        Some(overflow),
                    ),
                )
                .await?;
                return Ok(done(&rec));
            }
        };
        if assembled.messages.is_empty() {
            self.finalize(
                &mut rec,
                Outcome::failed(
                    "harness.empty_context",
                    "context_assembly",
                    "There was nothing to send to the model.",
                    None,
                ),
            )
            .await?;
            return Ok(done(&rec));
        }
        let (system_prompt, messages) = match self.pre_generate(&rec, assembled, &tools).await? {
            Ok(prepared) => prepared,
            Err(outcome) => {
                self.finalize(&mut rec, outcome).await?;
                return Ok(done(&rec));
            }
        };
        let cancel = self.signal(&rec.turn_id);
        if cancel.is_cancelled() {
            self.finalize(&mut rec, Outcome::Cancelled).await?;
            return Ok(done(&rec));
        }

        // The assistant entry exists before the first token, so a replay reuses it.
        self.append(AppendRequest {
            session_id: sid.clone(),
            message: Some(AgentMessage::Assistant(AssistantMessage {
                content: vec![],
                model: rec.options.model.clone(),
                provider: rec.options.provider.clone().unwrap_or_default(),
                stop_reason: StopReason::End,
                usage: None,
                error_kind: None,
                error_message: None,
                native_stop_reason: None,
                warnings: None,
                timestamp: now_ms(),
            })),
            custom: None,
            entry_id: Some(entry_id.clone()),
            origin: Some(json!({"turn_id": rec.turn_id})),
        })
        .await?;
        failpoint::hit("after_assistant_appended");
        let request_id = ids::request_id(&rec.turn_id, rec.step);
        // Not persisted here: `stop` derives the request id from `(turn_id, step)`, so the step
        // saves a store round trip; the next record write carries it for status readers.
        rec.stream_request_id = Some(request_id.clone());
        let mut extras = serde_json::Map::new();
        if self.config().prompt_cache_sections {
            if let Some(Value::Object(sections)) = prompt::cache_sections(
                rec.options.system_prompt.as_deref(),
                system_prompt.as_deref(),
            ) {
                extras.extend(sections);
            }
        }
        if let Some(r) = &rec.options.reasoning {
            extras.insert("reasoning".into(), json!(r));
        }
        let extras = Value::Object(extras);
        let req = ChatRequest {
            request_id,
            session_id: Some(sid.clone()),
            model: rec.options.model.clone(),
            provider: rec.options.provider.clone(),
            system_prompt,
            messages,
            tools,
            thinking_level: rec.options.thinking_level,
            max_output_tokens: rec.options.max_output_tokens,
            provider_options: rec.options.provider_options.clone(),
            response_format: None,
        };

        // Generate with the lock released, so `stop` can land mid-stream.
        drop(guard);
        let generation = self
            .generate(req, extras, &sid, &entry_id, cancel.clone())
            .await;
        if let Ok(g) = &generation {
            let mut env = hooks::envelope(
                HookPoint::PostGenerate,
                &sid,
                &rec.turn_id,
                rec.step,
                rec.depth,
                rec.options.metadata.as_ref(),
            );
            env["generated"] = json!({ "message": g.message });
            // Observe only: what the hooks answer is ignored, and so are their failures.
            let _ = self
                .run_hooks(HookPoint::PostGenerate, env, None, None)
                .await;
        }
        let guard: SessionGuard = self.inner.locks.lock(&sid).await;
        let generation = generation?;
        self.finish(
            &payload,
            guard,
            generation,
            cancel,
            Some((new_watermark, seen_generation)),
        )
        .await
    }

    /// The finish phase: runs under the session lock, on the durable record as it is now (a
    /// stop may have finalized it while the model streamed).
    async fn finish(
        &self,
        payload: &TurnStepPayload,
        _guard: SessionGuard,
        generation: Generation,
        cancel: CancellationToken,
        seen: Option<(Option<String>, Option<u64>)>,
    ) -> Result<TurnStepResult> {
        let sid = payload.session_id.clone();
        let Some(mut rec) = self.load_record(&sid).await? else {
            return Ok(skipped(&sid));
        };
        if rec.turn_id != payload.turn_id || rec.step != payload.step || rec.is_terminal() {
            return Ok(skipped(&sid));
        }
        if rec.generated.as_ref().map(|g| g.step) != Some(rec.step) {
            if let Some((watermark, generation)) = seen {
                rec.watermark_entry_id = watermark;
                rec.functions_generation = generation;
            }
            rec.turn_count += 1;
            rec.generated = Some(GeneratedStep {
                step: rec.step,
                error: generation.error.clone(),
            });
        }
        if rec.abort
            || cancel.is_cancelled()
            || generation.message.stop_reason == StopReason::Aborted
        {
            self.finalize(&mut rec, Outcome::Cancelled).await?;
            return Ok(done(&rec));
        }
        if let Some(err) = &generation.error {
            let partial = generation.has_partial();
            if partial {
                let text = harness_types::message::joined_text(&generation.message.content);
                rec.result = Some(if text.trim().is_empty() {
                    json!(generation.message.content)
                } else {
                    json!(text)
                });
            }
            if partial
                && err.kind.retryable()
                && rec.transient_resumes < rec.options.max_transient_resumes
                && rec.turn_count < rec.options.max_turns
            {
                self.begin_resume(&mut rec, &err.message).await?;
                return self.advance(&mut rec).await.map(|_| done(&rec));
            }
            let outcome = Outcome::generation_failed(
                err,
                &rec.options.model,
                rec.options.provider.as_deref(),
                partial,
            );
            self.finalize(&mut rec, outcome).await?;
            return Ok(done(&rec));
        }
        if rec.transient_resumes > 0 {
            self.append_custom(
                &sid,
                ids::recovery_entry(&rec.turn_id, rec.transient_resumes, "recovered"),
                "recovery",
                json!({"status": "recovered", "attempt": rec.transient_resumes, "max_attempts": rec.options.max_transient_resumes, "phase": "generation", "timestamp": now_ms()}),
                &rec.turn_id,
            )
            .await?;
        }
        let expose = rec
            .options
            .functions
            .as_ref()
            .map(|p| p.expose)
            .unwrap_or_default();
        let calls = plan_calls(&generation.message.content, expose);
        if !calls.is_empty() {
            let cut = (generation.message.stop_reason == StopReason::Length)
                .then_some("the reply hit the output limit");
            if self.dispatch_calls(&mut rec, &calls, cut, &cancel).await? == Dispatched::Cancelled {
                self.finalize(&mut rec, Outcome::Cancelled).await?;
                return Ok(done(&rec));
            }
            if rec.has_pending() {
                // Parked: no step is held; a resolve of the last pending call resumes the turn.
                rec.status = TurnStatus::AwaitingFunctions;
                self.save_record(&mut rec).await?;
                self.set_status(&sid, SessionStatus::Working, Some("awaiting functions"))
                    .await?;
                return Ok(done(&rec));
            }
            return self.advance(&mut rec).await.map(|_| done(&rec));
        }
        if !self.queued(&sid).await?.is_empty() {
            // Steering arrived while the model was answering: it gets to react.
            return self.advance(&mut rec).await.map(|_| done(&rec));
        }
        let text = harness_types::message::joined_text(&generation.message.content);
        self.finalize(&mut rec, Outcome::Completed(json!(text)))
            .await?;
        Ok(done(&rec))
    }

    /// Runs the pre-generate chain: it may replace the system prompt, append messages (never
    /// persisted) or deny the generation; static `inject_prompt` texts are appended to the prompt.
    async fn pre_generate(
        &self,
        rec: &TurnRecord,
        assembled: AssembleResponse,
        tools: &[harness_types::router::ToolSpec],
    ) -> Result<std::result::Result<(Option<String>, Vec<AgentMessage>), Outcome>> {
        if self.hooks(HookPoint::PreGenerate).await?.is_empty() {
            return Ok(Ok((assembled.system_prompt, assembled.messages)));
        }
        let expose = rec
            .options
            .functions
            .as_ref()
            .map(|p| p.expose)
            .unwrap_or_default();
        let mut env = hooks::envelope(
            HookPoint::PreGenerate,
            &rec.session_id,
            &rec.turn_id,
            rec.step,
            rec.depth,
            rec.options.metadata.as_ref(),
        );
        env["generate"] = json!({"system_prompt": assembled.system_prompt, "messages": assembled.messages,
                                 "model": rec.options.model, "provider": rec.options.provider, "tools": tools, "expose": expose});
        let chain = self
            .run_hooks(HookPoint::PreGenerate, env, None, None)
            .await?;
        if let Decision::Deny(reason) = chain.decision {
            return Ok(Err(Outcome::failed(
                "harness.pre_generate_denied",
                "pre_generate",
                "A hook refused this generation.",
                Some(format!("pre_generate hook denied: {reason}")),
            )));
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
                assembled.messages
            }
        };
        let tokens =
            harness_context::count_tokens(&messages, prompt.as_deref(), tools) + FRAMING_TOKENS;
        if tokens > assembled.usable {
            return Ok(Err(Outcome::failed(
                "harness.context_overflow",
                "pre_generate",
                "The conversation no longer fits the model's context window.",
                Some(format!(
                    "context/overflow: ~{tokens} tokens after pre_generate hooks, {} usable",
                    assembled.usable
                )),
            )));
        }
        Ok(Ok((prompt, messages)))
    }

    /// A step whose session has no turn record at all: on a store that can lose recent writes
    /// (an iii engine's), the record of a live turn vanished. Never rebuild it from the
    /// transcript (that could run calls again): end the turn with a durable failure the user can
    /// read instead.
    async fn end_lost_turn(&self, payload: &TurnStepPayload) -> Result<TurnStepResult> {
        let sid = payload.session_id.clone();
        let session: Option<harness_types::session::GetResponse> = self
            .call("session::get", &json!({"session_id": sid}))
            .await?;
        if session.is_none() {
            return Ok(skipped(&sid));
        }
        let mut rec = crate::send::new_record(
            &sid,
            &payload.turn_id,
            Default::default(),
            payload.depth,
            None,
            None,
        );
        rec.step = payload.step;
        tracing::warn!(session = %sid, turn = %payload.turn_id, "the turn record is missing; ending the turn as failed");
        self.finalize(
            &mut rec,
            Outcome::failed(
                "harness.turn_record_lost",
                "execution",
                "The turn's state was lost by the store, so the turn was ended; send the message again to continue.",
                Some(format!("no turn record for session '{sid}' at step {} of turn {}", payload.step, payload.turn_id)),
            ),
        )
        .await?;
        Ok(done(&rec))
    }

    /// Persists `step + 1` and enqueues it.
    pub(crate) async fn advance(&self, rec: &mut TurnRecord) -> Result<()> {
        rec.step += 1;
        rec.status = TurnStatus::Running;
        self.save_record(rec).await?;
        failpoint::hit("after_advance_persisted");
        self.enqueue_step(rec).await
    }

    async fn begin_resume(&self, rec: &mut TurnRecord, reason: &str) -> Result<()> {
        let k = rec.transient_resumes + 1;
        let sid = rec.session_id.clone();
        self.append_custom(
            &sid,
            ids::recovery_entry(&rec.turn_id, k, "recovering"),
            "recovery",
            json!({"status": "recovering", "summary": "The provider stopped mid-answer; resuming from the partial reply.", "detail": reason,
                   "phase": "generation", "attempt": k, "max_attempts": rec.options.max_transient_resumes,
                   "partial_result_available": true, "timestamp": now_ms()}),
            &rec.turn_id,
        )
        .await?;
        let nudge = format!(
            "The provider/router ended transiently after streaming the previous partial response: {reason}. \
             Resume from the transcript and return the complete deliverable, incorporating the previous partial \
             response. Do not repeat function calls that already have successful results."
        );
        self.append(AppendRequest {
            session_id: sid,
            message: Some(AgentMessage::user_text(nudge, now_ms())),
            custom: None,
            entry_id: Some(ids::transient_resume_entry(&rec.turn_id, k)),
            origin: Some(json!({"turn_id": rec.turn_id, "recovery": true})),
        })
        .await?;
        rec.transient_resumes = k;
        Ok(())
    }

    /// `context::assemble` when a context manager is registered, the raw history otherwise.
    async fn assemble(
        &self,
        rec: &TurnRecord,
        messages: Vec<AgentMessage>,
        system_prompt: Option<String>,
        tools: Vec<harness_types::router::ToolSpec>,
    ) -> std::result::Result<AssembleResponse, String> {
        let req = AssembleRequest {
            messages,
            model: ModelRef {
                id: rec.options.model.clone(),
                provider: rec.options.provider.clone(),
            },
            system_prompt,
            tools,
            options: AssembleOptions {
                request_overhead_tokens: FRAMING_TOKENS,
                context_window: self.context_window(rec).await,
                max_output_tokens: rec.options.max_output_tokens.unwrap_or(0) as u64,
            },
        };
        let payload = serde_json::to_value(&req).map_err(|e| e.to_string())?;
        match self
            .inner
            .bus
            .call(
                "context::assemble",
                payload,
                Some(std::time::Duration::from_millis(
                    self.config().session_timeout_ms,
                )),
            )
            .await
        {
            Ok(v) => serde_json::from_value(v)
                .map_err(|e| format!("context::assemble answered an unexpected shape: {e}")),
            Err(e) if e.is_not_found() => harness_context::assemble(req),
            Err(e) => Err(e.to_string()),
        }
    }

    /// The model's context window from the router's catalog; for models it does not know (or
    /// only by a catch-all row), the configured default.
    async fn context_window(&self, rec: &TurnRecord) -> u64 {
        let req = json!({"provider": rec.options.provider, "id": rec.options.model});
        match self
            .inner
            .bus
            .call(
                "router::models::get",
                req,
                Some(std::time::Duration::from_millis(
                    self.config().session_timeout_ms,
                )),
            )
            .await
        {
            // A provider's catch-all row is a guess; the configured default is the better one.
            Ok(entry) if entry["generic"] != true => entry["context_window"]
                .as_u64()
                .unwrap_or(self.config().default_context_window),
            Ok(_) => self.config().default_context_window,
            Err(_) => self.config().default_context_window,
        }
    }

    /// Fails the current turn of a session after an unexpected step error.
    pub(crate) async fn fail_turn(
        &self,
        payload: &TurnStepPayload,
        err: &HarnessError,
    ) -> Result<()> {
        let _guard = self.inner.locks.lock(&payload.session_id).await;
        let Some(mut rec) = self.load_record(&payload.session_id).await? else {
            return Ok(());
        };
        if rec.turn_id != payload.turn_id || rec.is_terminal() {
            return Ok(());
        }
        self.finalize(
            &mut rec,
            Outcome::failed(
                "harness.turn_internal",
                "execution",
                "The turn stopped on an internal error.",
                Some(err.to_string()),
            ),
        )
        .await
    }
}
