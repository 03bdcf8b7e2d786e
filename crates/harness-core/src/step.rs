//! One durable step (`harness::turn`): the shell around the turn machine.
//!
//! The step feeds [`machine::next`] what it finds and carries out what the machine answers, in
//! order. Its stages are effects: `Prepare` (drain steering, first-step event, pre-turn hooks),
//! `Generate` (context → pre-generate hooks → pre-append the assistant entry → stream with the
//! session lock released → post-generate hooks), `ResumeAtCalls` (a redelivered step re-reads
//! the answer it recorded) and `DispatchCalls`; each ends by feeding the machine its next input.

use std::sync::Arc;

use harness_types::api::{TurnStartedEvent, TurnStatus, TurnStepPayload, TurnStepResult};
use harness_types::context::{
    AssembleCall, AssembleOptions, AssembleRequest, AssembleResponse, CountTokensRequest,
    CountTokensResponse, ModelRef, COMPACTION_ENTRY, OVERFLOW_PREFIX,
};
use harness_types::message::{AgentMessage, AssistantMessage, StopReason};
use harness_types::router::ChatRequest;
use harness_types::session::{AppendRequest, Entry, SessionStatus};
use harness_types::{ids, now_ms, HarnessError};
use serde_json::{json, Value};

use crate::context::{self, Window};
use crate::dispatch::{plan_calls, Dispatched};
use crate::failpoint;
use crate::harness::{Harness, Result, StepWrites};
use crate::hooks::{self, Decision, HookPoint};
use crate::locks::SessionGuard;
use crate::machine::{self, CallRef, ContextRefusal, Effect, Finished, Input};
use crate::output;
use crate::prompt;
use crate::record::TurnRecord;
use crate::stream::Generation;
use tokio_util::sync::CancellationToken;

/// Tokens reserved for request framing.
const FRAMING_TOKENS: u64 = 64;

/// A step's context, ready to send.
struct Prepared {
    system_prompt: Option<String>,
    messages: Arc<Vec<AgentMessage>>,
    /// Its token count.
    tokens: u64,
    /// See [`output_room`].
    max_output_tokens: Option<u32>,
    /// What a compaction's summary cost, when this step wrote one.
    compaction_usage: Option<harness_types::message::Usage>,
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
const REASSEMBLY_SLACK: u64 = 256;

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

impl Harness {
    /// Runs one step. Stale and duplicate deliveries are acknowledged and dropped.
    pub async fn step(&self, payload: TurnStepPayload) -> Result<TurnStepResult> {
        let sid = payload.session_id.clone();
        let mut guard = Some(self.inner.locks.lock(&sid).await);
        let rec = self.load_record(&sid).await?;
        let input = match &rec {
            Some(_) => Input::StepDelivered {
                turn_id: payload.turn_id.clone(),
                step: payload.step,
            },
            None => Input::RecordMissing {
                session_id: sid.clone(),
                turn_id: payload.turn_id.clone(),
                step: payload.step,
                depth: payload.depth,
                session_exists: self.session_exists(&sid).await?,
                now: now_ms(),
            },
        };
        if rec.is_none() {
            tracing::warn!(session = %sid, turn = %payload.turn_id, "a step found no turn record");
        }
        let mut ctx = StepCtx::default();
        let mut rec = rec;
        let mut input = Some(input);
        let mut skipped_delivery = false;
        while let Some(i) = input.take() {
            let t = machine::next(rec.take(), i).map_err(illegal)?;
            rec = t.record;
            let mut effects = t.effects.into_iter().peekable();
            let mut reloaded = None;
            while let Some(effect) = effects.next() {
                let advancing =
                    effect == Effect::SaveRecord && effects.peek() == Some(&Effect::EnqueueStep);
                let Some(r) = rec.as_mut() else {
                    skipped_delivery = true;
                    continue;
                };
                if !self.may_hold_writes(&effect).await? {
                    self.flush(&mut ctx).await?;
                }
                match effect {
                    Effect::Skip => skipped_delivery = true,
                    Effect::Prepare { first_step } => {
                        input = Some(self.prepare(r, first_step, &mut ctx).await?);
                    }
                    Effect::Generate => {
                        let (now, next) = self.generate_stage(r, &mut guard, &mut ctx).await?;
                        reloaded = Some(now);
                        input = Some(next);
                    }
                    Effect::ResumeAtCalls => {
                        input = Some(self.resume_at_calls(r, &mut ctx).await?);
                    }
                    Effect::DispatchCalls { cut } => {
                        let message = ctx.message.as_ref().ok_or_else(|| {
                            HarnessError::internal("dispatch without a generation")
                        })?;
                        let expose = r.options.expose();
                        let calls = plan_calls(&message.content, expose);
                        let cancel = self.signal(&r.turn_id);
                        let stopped = self.dispatch_calls(r, &calls, cut, &cancel).await?
                            == Dispatched::Cancelled;
                        let unreached = calls
                            .iter()
                            .filter(|c| !r.calls.contains_key(&c.id))
                            .map(|c| CallRef {
                                id: c.id.clone(),
                                function_id: c.function_id.clone(),
                            })
                            .collect();
                        input = Some(Input::CallsClosed { stopped, unreached });
                    }
                    Effect::PostTurn { result } => {
                        input = Some(self.post_turn(r, result).await?);
                    }
                    Effect::ValidateOutput => {
                        let text = ctx
                            .message
                            .as_ref()
                            .map(|m| harness_types::message::joined_text(&m.content))
                            .unwrap_or_default();
                        input = Some(Input::OutputChecked {
                            verdict: output::verdict(r, &text),
                        });
                    }
                    Effect::CheckSteering => {
                        let waiting = !self.queued(&sid).await?.is_empty();
                        let text = ctx
                            .message
                            .as_ref()
                            .map(|m| harness_types::message::joined_text(&m.content))
                            .unwrap_or_default();
                        input = Some(Input::SteeringChecked { waiting, text });
                    }
                    Effect::Finalize => {
                        let held = std::mem::take(&mut ctx.pending);
                        self.finalize_after(r, held).await?;
                    }
                    Effect::SaveRecord if advancing => {
                        // The record and its next step go as one batch with what the step held
                        // back (one commit instead of three).
                        effects.next();
                        let mut batch = std::mem::take(&mut ctx.pending);
                        batch.save_record(r)?;
                        batch.enqueue_step(r)?;
                        self.commit(batch).await?;
                        failpoint::hit("after_advance_persisted");
                    }
                    other => self.apply(r, other).await?,
                }
                if let Some(now) = reloaded.take() {
                    // The machine decides the rest on the record as the stream left it.
                    rec = now;
                    break;
                }
            }
        }
        // A skipped generation (a stop ended the turn while the model streamed) still leaves
        // its answer in the transcript.
        self.flush(&mut ctx).await?;
        Ok(match rec {
            Some(r) if !skipped_delivery => done(&r),
            _ => skipped(&sid),
        })
    }

    /// Whether `effect` may run while the step still holds writes back (`StepCtx::pending`):
    /// effects that only read the step's own state, and the post-turn gate when no hook sees
    /// it. Anything that lets another party look at the session (hooks, calls, events), or
    /// writes on its own, runs after they are committed; `Finalize` and an advance take them
    /// into their own batch.
    async fn may_hold_writes(&self, effect: &Effect) -> Result<bool> {
        Ok(match effect {
            Effect::Skip
            | Effect::CheckSteering
            | Effect::ValidateOutput
            | Effect::Finalize
            | Effect::SaveRecord
            | Effect::Prepare { .. }
            | Effect::Generate => true,
            Effect::PostTurn { .. } => self.hooks(HookPoint::PostTurn).await?.is_empty(),
            _ => false,
        })
    }

    /// Commits what the step held back, if anything.
    async fn flush(&self, ctx: &mut StepCtx) -> Result<()> {
        if ctx.pending.is_empty() {
            return Ok(());
        }
        self.commit(std::mem::take(&mut ctx.pending))
            .await
            .map(|_| ())
    }

    /// The effects every shell carries out the same way.
    pub(crate) async fn apply(&self, rec: &mut TurnRecord, effect: Effect) -> Result<()> {
        match effect {
            Effect::SaveRecord => self.save_record(rec).await,
            Effect::EnqueueStep => self.enqueue_step(rec).await,
            Effect::Finalize => self.finalize(rec).await,
            Effect::RepeatTerminalEffects => self.repeat_terminal_effects(rec).await,
            Effect::NoteMaxTurns => {
                let text = machine::max_turns_text(rec.options.max_turns);
                self.append_custom(
                    &rec.session_id,
                    ids::max_turns_entry(&rec.turn_id),
                    "notice",
                    json!({"reason": "max_turns", "message": text}),
                    &rec.turn_id,
                )
                .await
                .map(|_| ())
            }
            Effect::NoteResume { attempt, reason } => {
                self.note_resume(rec, attempt, &reason).await
            }
            Effect::NoteRecovered { attempt } => self
                .append_custom(
                    &rec.session_id,
                    ids::recovery_entry(&rec.turn_id, attempt, "recovered"),
                    context::RECOVERY_ENTRY,
                    json!({"status": "recovered", "attempt": attempt, "max_attempts": rec.options.max_transient_resumes, "phase": "generation", "timestamp": now_ms()}),
                    &rec.turn_id,
                )
                .await
                .map(|_| ()),
            Effect::NoteNudge { attempt, text } => self
                .append(AppendRequest {
                    session_id: rec.session_id.clone(),
                    message: Some(AgentMessage::user_text(text, now_ms())),
                    custom: None,
                    entry_id: Some(ids::nudge_entry(&rec.turn_id, attempt)),
                    origin: Some(json!({"turn_id": rec.turn_id, "validation": true})),
                })
                .await
                .map(|_| ()),
            Effect::SetAwaiting => {
                self.set_status(
                    &rec.session_id,
                    SessionStatus::Working,
                    Some("awaiting functions"),
                )
                .await
            }
            Effect::Barrier => self.barrier().await,
            Effect::AbortGeneration => {
                self.fire_signal(&rec.turn_id);
                // The generation in flight, if any, is the one of the current step.
                let request_id = ids::request_id(&rec.turn_id, rec.step);
                let _ = self
                    .inner
                    .bus
                    .call(
                        "router::abort",
                        json!({ "request_id": request_id }),
                        Some(std::time::Duration::from_secs(2)),
                    )
                    .await;
                Ok(())
            }
            Effect::StopChildren => {
                self.stop_children(rec).await;
                Ok(())
            }
            Effect::CloseOpenCalls { unreached } => self.close_open_calls(rec, unreached).await,
            Effect::CloseInterrupted(ids) => {
                for id in ids {
                    let function_id = rec
                        .calls
                        .get(&id)
                        .map(|c| c.function_id().to_string())
                        .unwrap_or_default();
                    let call = crate::dispatch::PlannedCall {
                        id,
                        function_id,
                        arguments: Value::Null,
                        intent: None,
                    };
                    self.close_interrupted(rec, &call).await?;
                }
                Ok(())
            }
            other => Err(HarnessError::internal(format!(
                "the turn machine asked this shell for {other:?}, which only another shell carries out"
            ))),
        }
    }

    /// Stage `Prepare`: steering, the working status, the first step's event and pre-turn
    /// hooks.
    async fn prepare(
        &self,
        rec: &mut TurnRecord,
        first_step: bool,
        ctx: &mut StepCtx,
    ) -> Result<Input> {
        let sid = rec.session_id.clone();
        // A step redelivered mid-generation finds its assistant entry already there: it rebuilds
        // the context it had (everything before that entry) and leaves newly queued steering
        // for the next step, which the steering check then schedules.
        let entry_id = ids::assistant_entry(&rec.turn_id, rec.step);
        // Shared with the transcript cache, never copied: a step on a long session costs its
        // new entries, not its history.
        let mut entries = self.transcript_shared(&sid).await?;
        let mut upto = entries.len();
        // The entry is the last one or close to it when it exists: search from the end.
        match entries.iter().rposition(|e| e.entry_id == entry_id) {
            Some(at) => upto = at,
            None => {
                if self.drain_queue(&sid, &rec.turn_id).await? > 0 {
                    entries = self.transcript_shared(&sid).await?;
                    upto = entries.len();
                }
            }
        }
        ctx.entries = entries;
        ctx.upto = upto;
        // The status and, on the first step, the turn-started event: one write.
        let mut batch = StepWrites::default();
        batch.set_status(&sid, SessionStatus::Working, Some("preparing context"))?;
        let started = first_step.then(|| TurnStartedEvent {
            session_id: sid.clone(),
            turn_id: rec.turn_id.clone(),
            timestamp: now_ms(),
            parent: rec.parent.clone(),
            depth: rec.depth,
            message_preview: rec.message_preview.clone(),
            display: rec.options.display.clone(),
            parent_session_id: rec.options.display_parent_session_id.clone(),
        });
        if let Some(ev) = &started {
            self.record_turn_event(&mut batch, ev);
        }
        // Nobody looks before the assistant entry is written (no pre-turn hook, no binding of
        // the event): the status and the event go with that entry's batch.
        let observed = match &started {
            Some(_) => {
                !self.hooks(HookPoint::PreTurn).await?.is_empty()
                    || self.has_bindings(crate::topics::TURN_STARTED).await
            }
            None => false,
        };
        if !observed {
            ctx.pending.extend(batch);
            return Ok(Input::Prepared { denied: None });
        }
        self.flush(ctx).await?;
        self.commit(batch).await?;
        let Some(ev) = started else {
            return Ok(Input::Prepared { denied: None });
        };
        self.fan_out_turn_event(ev).await?;
        let env = hooks::envelope(
            HookPoint::PreTurn,
            &sid,
            &rec.turn_id,
            rec.step,
            rec.depth,
            rec.options.metadata.as_ref(),
        );
        let denied = match self
            .run_hooks(HookPoint::PreTurn, env, None, None)
            .await?
            .decision
        {
            Decision::Deny(reason) => Some(reason),
            _ => None,
        };
        Ok(Input::Prepared { denied })
    }

    /// Stage `Generate`: context, pre-generate hooks, the pre-appended assistant entry, the
    /// stream (with the session lock released, so `stop` can land), post-generate hooks. Answers
    /// the record as it is after the stream (re-read under the lock) and the next input.
    async fn generate_stage(
        &self,
        rec: &mut TurnRecord,
        guard: &mut Option<SessionGuard>,
        ctx: &mut StepCtx,
    ) -> Result<(Option<TurnRecord>, Input)> {
        let sid = rec.session_id.clone();
        let shared = std::mem::take(&mut ctx.entries);
        let upto = ctx.upto.min(shared.len());
        let new_watermark = shared[..upto].last().map(|e| e.entry_id.clone());
        let mut window = self.window_of(&sid, &shared, upto, rec.watermark_entry_id.as_deref());
        window.resume_notice = context::resume_notice(&shared[..upto], &rec.turn_id);
        drop(shared);
        let mut system_prompt = prompt::for_step(
            rec.options.system_prompt.as_deref(),
            &sid,
            rec.options.functions.as_ref(),
            prompt::fs_root(rec.options.metadata.as_ref()),
        );
        // The tail, so the cacheable prefix of the prompt stays the same as on other steps.
        if let Some(notice) = &window.resume_notice {
            system_prompt = Some(match system_prompt {
                Some(p) => format!("{p}\n\n{notice}"),
                None => notice.clone(),
            });
        }
        let mut tools = self.tool_surface(rec).await?;
        let mut response_format = None;
        if let Some(schema) = output::json_contract(&rec.options.output) {
            if rec.output_mode.is_none() {
                rec.output_mode = Some(self.output_mode(rec).await);
            }
            match rec.output_mode {
                Some(output::OutputMode::Native) => {
                    response_format = Some(output::response_format(schema));
                }
                _ => tools.push(output::submit_result_tool(schema)),
            }
        }
        // Kept for a reassembly after a server-measured overflow.
        let unassembled_prompt = system_prompt.clone();
        let Prepared {
            system_prompt,
            messages,
            tokens: context_tokens,
            max_output_tokens,
            compaction_usage,
        } = match self
            .assemble_context(rec, &window, system_prompt, &tools, 0)
            .await?
        {
            Ok(prepared) => prepared,
            Err(why) => return Ok((Some(rec.clone()), Input::ContextRefused(why))),
        };
        // The summary was a generation: it counts against the turn's budget like the reply.
        if let Some(usage) = &compaction_usage {
            self.record_spend(rec, usage).await?;
        }
        // Before the provider is called: what this generation could spend must fit the budget.
        if let Err(detail) = self.budget_preflight(rec, context_tokens).await? {
            return Ok((
                Some(rec.clone()),
                Input::ContextRefused(ContextRefusal::Budget(detail)),
            ));
        }
        let cancel = self.signal(&rec.turn_id);
        if cancel.is_cancelled() {
            return Ok((Some(rec.clone()), Input::StopObserved));
        }

        // The assistant entry exists before the first token, so a replay reuses it.
        let entry_id = ids::assistant_entry(&rec.turn_id, rec.step);
        let mut batch = std::mem::take(&mut ctx.pending);
        batch.append(AppendRequest {
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
        })?;
        self.commit(batch).await?;
        failpoint::hit("after_assistant_appended");
        let request_id = ids::request_id(&rec.turn_id, rec.step);
        // Not persisted here: `stop` derives the request id from `(turn_id, step)`, so the step
        // saves a store round trip; the next record write carries it for status readers.
        rec.stream_request_id = Some(request_id.clone());
        let mut extras = serde_json::Map::new();
        let sections = self
            .config()
            .prompt_cache_sections
            .then(|| prompt::cache_sections(rec.options.stable_prefix(), system_prompt.as_deref()))
            .flatten();
        rec.prompt_surface = Some(prompt::surface(
            self.config().prompt_cache_sections,
            rec.options.stable_prefix(),
            sections.as_ref(),
        ));
        if let Some(Value::Object(sections)) = sections {
            extras.extend(sections);
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
            max_output_tokens,
            provider_options: rec.options.provider_options.clone(),
            response_format,
        };

        let again = (req.clone(), extras.clone());

        // Generate with the lock released, so `stop` can land mid-stream.
        drop(guard.take());
        let mut generation = self
            .generate(
                req,
                extras,
                &sid,
                &entry_id,
                cancel.clone(),
                &mut ctx.pending,
            )
            .await;
        // The server measured the prompt over its window (our count was low): assembled once
        // more with a quarter of the prompt held back, so the history is compacted (or a message
        // that alone cannot fit refused), and asked again, once. Nothing was streamed.
        let overflowed = generation.as_ref().is_ok_and(|g| {
            !g.has_partial()
                && g.error
                    .as_ref()
                    .is_some_and(|e| e.kind == harness_types::message::ErrorKind::ContextOverflow)
        });
        if overflowed && !cancel.is_cancelled() {
            let (mut req, extras) = again;
            // What the refused request carried, in bytes (which bound tokens).
            let request_bytes = context::byte_bound(&req.messages)
                + req.system_prompt.as_ref().map_or(0, |p| p.len() as u64)
                + req
                    .tools
                    .iter()
                    .map(|t| (t.description.len() + t.parameters.to_string().len()) as u64)
                    .sum::<u64>();
            *guard = Some(self.inner.locks.lock(&sid).await);
            let held_back = context_tokens / 4 + REASSEMBLY_SLACK;
            let retry = self
                .assemble_context(rec, &window, unassembled_prompt, &req.tools, held_back)
                .await?;
            drop(guard.take());
            if let Ok(p) = retry {
                tracing::debug!(session = %sid, "the server refused ~{context_tokens} tokens as over its window; reassembled to ~{}", p.tokens);
                if let Some(usage) = &p.compaction_usage {
                    self.record_spend(rec, usage).await?;
                }
                req.system_prompt = p.system_prompt;
                req.messages = p.messages;
                req.max_output_tokens = p.max_output_tokens;
                generation = self
                    .generate(
                        req,
                        extras,
                        &sid,
                        &entry_id,
                        cancel.clone(),
                        &mut ctx.pending,
                    )
                    .await;
            }
            let still = generation.as_ref().is_ok_and(|g| {
                !g.has_partial()
                    && g.error.as_ref().is_some_and(|e| {
                        e.kind == harness_types::message::ErrorKind::ContextOverflow
                    })
            });
            if still {
                *guard = Some(self.inner.locks.lock(&sid).await);
                self.exclude_dominant_message(rec, &window, request_bytes)
                    .await?;
                drop(guard.take());
            }
        }
        let observed = match &generation {
            Ok(_) => !self.hooks(HookPoint::PostGenerate).await?.is_empty(),
            Err(_) => false,
        };
        if observed {
            // The hooks may read the transcript: the answer is there first.
            self.flush(ctx).await?;
        }
        if let (Ok(g), true) = (&generation, observed) {
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
        *guard = Some(self.inner.locks.lock(&sid).await);
        let generation = generation?;
        // The record as it is now: a stop may have finalized it while the model streamed. The
        // contract's mode was chosen above and is written with the next record write.
        let mut now = self.load_record(&sid).await?;
        if let Some(n) = now.as_mut() {
            n.output_mode = n.output_mode.or(rec.output_mode);
            n.prompt_surface = rec.prompt_surface.clone();
            // Re-read, the record has not seen the summary's spend yet (only `rec` has).
            if let Some(usage) = &compaction_usage {
                self.record_spend(n, usage).await?;
            }
            if let Some(usage) = &generation.message.usage {
                self.record_spend(n, usage).await?;
            }
        }
        let input = finished(
            rec,
            generation,
            &cancel,
            Some((new_watermark, Some(self.functions_generation()))),
            ctx,
        );
        Ok((now, input))
    }

    /// Stage `ResumeAtCalls`: redelivered after the model had answered; the answer is read back
    /// from its entry, never asked for again.
    async fn resume_at_calls(&self, rec: &mut TurnRecord, ctx: &mut StepCtx) -> Result<Input> {
        let entry_id = ids::assistant_entry(&rec.turn_id, rec.step);
        let message = self
            .transcript(&rec.session_id)
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
        let error = rec.generated.as_ref().and_then(|g| g.error.clone());
        let cancel = self.signal(&rec.turn_id);
        Ok(finished(
            rec,
            Generation { message, error },
            &cancel,
            None,
            ctx,
        ))
    }

    /// The post-turn gate: the hooks see the result the turn would complete with; the first deny
    /// (or a broken fail-closed hook) refuses it.
    async fn post_turn(&self, rec: &TurnRecord, result: Value) -> Result<Input> {
        if self.hooks(HookPoint::PostTurn).await?.is_empty() {
            return Ok(Input::PostTurnChecked {
                result,
                denied: None,
            });
        }
        let mut env = hooks::envelope(
            HookPoint::PostTurn,
            &rec.session_id,
            &rec.turn_id,
            rec.step,
            rec.depth,
            rec.options.metadata.as_ref(),
        );
        env["result"] = result.clone();
        let chain = self.run_hooks(HookPoint::PostTurn, env, None, None).await?;
        let denied = match chain.decision {
            Decision::Deny(reason) => Some((reason, chain.retry_prompt)),
            _ => None,
        };
        Ok(Input::PostTurnChecked { result, denied })
    }

    /// Provider-native structured output where the catalog says the model has it, else the
    /// `submit_result` tool.
    async fn output_mode(&self, rec: &TurnRecord) -> output::OutputMode {
        let Some(provider) = &rec.options.provider else {
            return output::OutputMode::SubmitResult;
        };
        let asked = self
            .inner
            .bus
            .call(
                "router::models::supports",
                json!({"provider": provider, "id": rec.options.model, "capability": "structured_output"}),
                Some(std::time::Duration::from_millis(
                    self.config().session_timeout_ms,
                )),
            )
            .await;
        match asked {
            Ok(v) if v["supported"] == true => output::OutputMode::Native,
            _ => output::OutputMode::SubmitResult,
        }
    }

    /// Whether the session has a transcript (a step without a record may be for a session that
    /// was deleted).
    async fn session_exists(&self, session_id: &str) -> Result<bool> {
        let session: Option<harness_types::session::GetResponse> = self
            .call("session::get", &json!({"session_id": session_id}))
            .await?;
        Ok(session.is_some())
    }

    /// Runs the pre-generate chain: it may replace the system prompt, append messages (never
    /// persisted) or deny the generation; static `inject_prompt` texts are appended to the prompt.
    /// The final budget check is the caller's.
    async fn pre_generate(
        &self,
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
            .run_hooks(HookPoint::PreGenerate, env, None, None)
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

    /// The recovery record of transient resume `attempt`. Its notice reaches the model only in
    /// the system prompt of the step that resumes (see [`context::resume_notice`]): stored as a
    /// user message it read as the user's words, and small models echoed it into replies and
    /// function arguments on every later step.
    async fn note_resume(&self, rec: &TurnRecord, attempt: u32, reason: &str) -> Result<()> {
        let notice = format!(
            "Harness note (from the harness, not the user; do not quote it): the provider ended your previous \
             reply early ({reason}). That partial reply is the last assistant message. Continue from it and \
             give the complete answer, incorporating the partial reply. Do not repeat function calls that \
             already have successful results."
        );
        self.append_custom(
            &rec.session_id,
            ids::recovery_entry(&rec.turn_id, attempt, "recovering"),
            context::RECOVERY_ENTRY,
            json!({"status": "recovering", "summary": "The provider stopped mid-answer; resuming from the partial reply.", "detail": reason,
                   "phase": "generation", "attempt": attempt, "max_attempts": rec.options.max_transient_resumes,
                   "partial_result_available": true, "notice": notice, "timestamp": now_ms()}),
            &rec.turn_id,
        )
        .await?;
        Ok(())
    }

    /// Spec §3.3 step 13, at most two passes: `context::assemble` → persist a compaction →
    /// rotate late user messages → registry notice → `pre_generate` hooks → orphan patch →
    /// final count. A first overflow reassembles once with the difference reserved; a second
    /// one is a clean `harness.context_overflow`. Answers the prompt, the messages and their
    /// token count, or why the context was refused.
    async fn assemble_context(
        &self,
        rec: &TurnRecord,
        window: &Window,
        system_prompt: Option<String>,
        tools: &[harness_types::router::ToolSpec],
        held_back: u64,
    ) -> Result<std::result::Result<Prepared, ContextRefusal>> {
        let catalog = self.catalog_entry(rec).await;
        let context_window = self.context_window_of(catalog.as_ref());
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
        let prune = may_overflow && self.prune_allowed(rec, catalog.as_ref()).await?.0;
        let hooked = !self.hooks(HookPoint::PreGenerate).await?.is_empty();
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
                changed |= context::rotate(Arc::make_mut(&mut messages), &window.late_users);
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
                    "[harness] The set of registered functions changed since your last step: contracts you fetched earlier may be stale. \
                     Re-read a function's schema with engine::functions::info before calling it again.",
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
                match self.pre_generate(rec, prompt, list, tools).await? {
                    Ok((p, m)) => (prompt, messages) = (p, Arc::new(m)),
                    Err(why) => return Ok(Err(why)),
                }
                changed = true;
            }
            // The window knows when every call it holds has its result; the context manager's
            // own list (compacted) and the hooks' are checked.
            if !assembled.unchanged || hooked || window.unresolved_calls {
                changed |= context::patch_orphans(Arc::make_mut(&mut messages), &window.answered);
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
                    self.append_custom(
                        &rec.session_id,
                        ids::compaction_entry(&rec.turn_id, rec.step),
                        COMPACTION_ENTRY,
                        data,
                        &rec.turn_id,
                    )
                    .await?;
                    failpoint::hit("after_compaction_appended");
                }
                // What is held back is prompt the count missed: no room for output either.
                let room = output_room(
                    context_window,
                    tokens + held_back,
                    rec.options.max_output_tokens,
                    catalog.as_ref(),
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
        self.append_custom(
            &rec.session_id,
            format!("e_{}_{}_excluded", rec.turn_id, rec.step),
            context::EXCLUDED_ENTRY,
            json!({"entry_id": entry_id, "detail": detail}),
            &rec.turn_id,
        )
        .await
        .map(|_| ())
    }

    /// After the server refused the prompt as over its window twice: when the latest user
    /// message is most of the prompt (by bytes, which bound tokens), it is what does not fit a
    /// window nobody told the loop, and it is left out of later requests like a message refused
    /// as too large, so the session's next message is not refused with it.
    async fn exclude_dominant_message(
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

    /// The turn's model as the router's catalog describes it (`None` when it cannot say).
    pub(crate) async fn catalog_entry(&self, rec: &TurnRecord) -> Option<Value> {
        let req = json!({"provider": rec.options.provider, "id": rec.options.model});
        let timeout = std::time::Duration::from_millis(self.config().session_timeout_ms);
        self.inner
            .bus
            .call("router::models::get", req, Some(timeout))
            .await
            .ok()
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

    /// Fails the current turn of a session after an unexpected step error.
    pub(crate) async fn fail_turn(
        &self,
        payload: &TurnStepPayload,
        err: &HarnessError,
    ) -> Result<()> {
        let _guard = self.inner.locks.lock(&payload.session_id).await;
        let Some(rec) = self.load_record(&payload.session_id).await? else {
            return Ok(());
        };
        let input = Input::InternalError {
            turn_id: payload.turn_id.clone(),
            detail: err.to_string(),
        };
        let t = machine::next(Some(rec), input).map_err(illegal)?;
        if let Some(mut rec) = t.record {
            for effect in t.effects {
                self.apply(&mut rec, effect).await?;
            }
        }
        Ok(())
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

/// What a step carries from one stage to the next.
#[derive(Default)]
struct StepCtx {
    /// The transcript the context is built from: its first `upto` entries.
    entries: std::sync::Arc<Vec<Entry>>,
    upto: usize,
    /// The model's answer of this step.
    message: Option<AssistantMessage>,
    /// Writes held back to go with the step's next commit: the status of `Prepare` and the
    /// answer's final content. Nothing outside the step can tell (`may_hold_writes`); a crash
    /// before they are committed leaves a step that has not generated yet, which is redone.
    pending: StepWrites,
}

/// The machine's input for a generation that ended; keeps the answer for the next stages.
fn finished(
    rec: &TurnRecord,
    generation: Generation,
    cancel: &CancellationToken,
    seen: Option<(Option<String>, Option<u64>)>,
    ctx: &mut StepCtx,
) -> Input {
    let partial = generation.error.is_some() && generation.has_partial();
    let message = generation.message;
    let expose = rec.options.expose();
    let calls = plan_calls(&message.content, expose)
        .into_iter()
        .map(|c| CallRef {
            id: c.id,
            function_id: c.function_id,
        })
        .collect();
    let input = Input::GenerationFinished(Box::new(Finished {
        turn_id: rec.turn_id.clone(),
        step: rec.step,
        error: generation.error,
        text: harness_types::message::joined_text(&message.content),
        content: message.content.clone(),
        partial,
        stopped: cancel.is_cancelled() || message.stop_reason == StopReason::Aborted,
        calls,
        at_length: message.stop_reason == StopReason::Length,
        seen,
    }));
    ctx.message = Some(message);
    input
}

pub(crate) fn illegal(e: machine::Illegal) -> HarnessError {
    HarnessError::internal(e.to_string())
}
