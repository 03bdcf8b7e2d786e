//! One durable step (`harness::turn`): the shell around the turn machine, and the stages the
//! interpreter (`interpret.rs`) runs for it.
//!
//! The shell reads the record under the session lock and hands the delivery to the machine.
//! The stages are effects: `Prepare` (drain steering, first-step event, pre-turn hooks),
//! `Generate` (context, in `step/assemble.rs` → pre-append the assistant entry → stream with the
//! session lock released → post-generate hooks), `ResumeAtCalls` (a redelivered step re-reads
//! the answer it recorded) and `DispatchCalls`; each ends with the machine's next input.

use harness_types::api::{TurnStartedEvent, TurnStatus, TurnStepPayload, TurnStepResult};
use harness_types::message::{AgentMessage, AssistantMessage, StopReason};
use harness_types::router::ChatRequest;
use harness_types::session::{AppendRequest, SessionStatus};
use harness_types::{ids, now_ms, HarnessError};
use serde_json::{json, Value};

use crate::context;
use crate::dispatch::{plan_calls, Dispatched};
use crate::first_write::FirstWrite;
use crate::harness::{Harness, Result, StepWrites};
use crate::hooks::{self, Decision, HookPoint};
use crate::interpret::Carry;
use crate::machine::{CallRef, ContextRefusal, Finished, Input};
use crate::output;
use crate::prompt;
use crate::record::TurnRecord;
use crate::stream::Generation;
use tokio_util::sync::CancellationToken;

mod assemble;

use assemble::{Prepared, REASSEMBLY_SLACK};

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
        let mut carry = Carry::locked(self.inner.locks.lock(&sid).await);
        carry.advance_point = Some("after_advance_persisted");
        let rec = self.load_record(&sid).await?;
        let input = match &rec {
            Some(_) => Input::StepDelivered {
                turn_id: payload.turn_id.clone(),
                step: payload.step,
            },
            None => {
                tracing::warn!(session = %sid, turn = %payload.turn_id, "a step found no turn record");
                Input::RecordMissing {
                    session_id: sid.clone(),
                    turn_id: payload.turn_id.clone(),
                    step: payload.step,
                    depth: payload.depth,
                    session_exists: self.session_exists(&sid).await?,
                    now: now_ms(),
                }
            }
        };
        Ok(match Box::pin(self.run(rec, input, &mut carry)).await? {
            Some(r) if !carry.skipped => done(&r),
            _ => skipped(&sid),
        })
    }

    /// Fails the current turn of a session after an unexpected step error.
    pub(crate) async fn fail_turn(
        &self,
        payload: &TurnStepPayload,
        err: &HarnessError,
    ) -> Result<()> {
        let mut carry = Carry::locked(self.inner.locks.lock(&payload.session_id).await);
        let Some(rec) = self.load_record(&payload.session_id).await? else {
            return Ok(());
        };
        let input = Input::InternalError {
            turn_id: payload.turn_id.clone(),
            detail: err.to_string(),
        };
        self.run(Some(rec), input, &mut carry).await.map(|_| ())
    }

    /// Stage `DispatchCalls`: closes the calls of the answer; a stop ends the ones not reached.
    pub(crate) async fn dispatch_stage(
        &self,
        r: &mut TurnRecord,
        cut: Option<&str>,
        carry: &mut Carry,
    ) -> Result<Input> {
        let message = carry
            .message
            .as_ref()
            .ok_or_else(|| HarnessError::internal("dispatch without a generation"))?;
        let calls = plan_calls(&message.content, r.options.expose());
        let cancel = self.signal(&r.turn_id);
        let stopped = self.dispatch_calls(r, &calls, cut, &cancel).await? == Dispatched::Cancelled;
        let unreached = calls
            .iter()
            .filter(|c| !r.calls.contains_key(&c.id))
            .map(|c| CallRef {
                id: c.id.clone(),
                function_id: c.function_id.clone(),
            })
            .collect();
        Ok(Input::CallsClosed { stopped, unreached })
    }

    /// Stage `Prepare`: steering, the working status, the first step's event and pre-turn
    /// hooks.
    pub(crate) async fn prepare(
        &self,
        rec: &mut TurnRecord,
        first_step: bool,
        carry: &mut Carry,
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
        carry.entries = entries;
        carry.upto = upto;
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
        // the event): the status and the event go with that entry's batch. The pre-turn chain
        // is read once: whether anybody looks, and what runs.
        let pre_turn = match &started {
            Some(_) => self.hooks(HookPoint::PreTurn).await?,
            None => Vec::new(),
        };
        let observed = match &started {
            Some(_) => !pre_turn.is_empty() || self.has_bindings(crate::topics::TURN_STARTED).await,
            None => false,
        };
        if !observed {
            carry.pending.extend(batch);
            return Ok(Input::Prepared { denied: None });
        }
        self.flush(carry).await?;
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
            .run_chain(HookPoint::PreTurn, &pre_turn, env, None, None)
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
    pub(crate) async fn generate_stage(
        &self,
        rec: &mut TurnRecord,
        carry: &mut Carry,
    ) -> Result<(Option<TurnRecord>, Input)> {
        let sid = rec.session_id.clone();
        let shared = std::mem::take(&mut carry.entries);
        let upto = carry.upto.min(shared.len());
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
        let mut batch = std::mem::take(&mut carry.pending);
        batch.append(AppendRequest {
            session_id: sid.clone(),
            message: Some(AgentMessage::Assistant(AssistantMessage::ended(
                vec![],
                rec.options.model.clone(),
                rec.options.provider.clone().unwrap_or_default(),
                now_ms(),
            ))),
            custom: None,
            entry_id: Some(entry_id.clone()),
            origin: Some(json!({"turn_id": rec.turn_id})),
        })?;
        batch.mark_head();
        batch.fail_after("after_assistant_appended");
        // Held back with the lock (`first_write.rs`) unless it saves the record: the record is
        // read back after the stream, and must be the one this step left.
        let guard = carry
            .guard
            .take()
            .ok_or_else(|| HarnessError::internal("a step generates without its session lock"))?;
        let hold = self.config().first_write_hold_ms;
        let saves_record = batch.saves_record();
        let mut first = FirstWrite::hold(batch, guard, std::time::Duration::from_millis(hold));
        if hold == 0 || saves_record {
            self.release_first(&mut first).await?;
        }
        let request_id = ids::request_id(&rec.turn_id, rec.step);
        // Not persisted here: `stop` derives the request id from `(turn_id, step)`, so the step
        // saves a store round trip; the next record write carries it for status readers.
        rec.stream_request_id = Some(request_id.clone());
        let mut extras = self
            .config()
            .prompt_cache_sections
            .then(|| prompt::cache_sections(rec.options.stable_prefix(), system_prompt.as_deref()))
            .flatten()
            .unwrap_or_default();
        rec.prompt_surface = Some(prompt::surface(
            self.config().prompt_cache_sections,
            rec.options.stable_prefix(),
            extras.surface_digest(),
        ));
        extras.reasoning = rec.options.reasoning.map(|r| r.as_str().to_string());
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

        // Generate with the lock released (once the first write is), so `stop` can land
        // mid-stream.
        let stream = async |req, extras, first: &mut FirstWrite, last: &mut StepWrites| {
            self.generate(req, extras, &sid, &entry_id, cancel.clone(), first, last)
                .await
        };
        let mut generation = stream(req, extras, &mut first, &mut carry.pending).await;
        // The server measured the prompt over its window (our count was low): assembled once
        // more with a quarter of the prompt held back, so the history is compacted (or a message
        // that alone cannot fit refused), and asked again, once. Nothing was streamed.
        if overflowed(&generation) && !cancel.is_cancelled() {
            self.release_first(&mut first).await?;
            let (mut req, extras) = again;
            // What the refused request carried, in bytes (which bound tokens).
            let request_bytes = context::byte_bound(&req.messages)
                + req.system_prompt.as_ref().map_or(0, |p| p.len() as u64)
                + req
                    .tools
                    .iter()
                    .map(|t| (t.description.len() + t.parameters.to_string().len()) as u64)
                    .sum::<u64>();
            carry.guard = Some(self.inner.locks.lock(&sid).await);
            let held_back = context_tokens / 4 + REASSEMBLY_SLACK;
            let retry = self
                .assemble_context(rec, &window, unassembled_prompt, &req.tools, held_back)
                .await?;
            drop(carry.guard.take());
            if let Ok(p) = retry {
                tracing::debug!(session = %sid, "the server refused ~{context_tokens} tokens as over its window; reassembled to ~{}", p.tokens);
                if let Some(usage) = &p.compaction_usage {
                    self.record_spend(rec, usage).await?;
                }
                req.system_prompt = p.system_prompt;
                req.messages = p.messages;
                req.max_output_tokens = p.max_output_tokens;
                generation = stream(req, extras, &mut first, &mut carry.pending).await;
            }
            if overflowed(&generation) {
                carry.guard = Some(self.inner.locks.lock(&sid).await);
                self.exclude_dominant_message(rec, &window, request_bytes)
                    .await?;
                drop(carry.guard.take());
            }
        }
        let post_generate = match &generation {
            Ok(_) => self.hooks(HookPoint::PostGenerate).await?,
            Err(_) => Vec::new(),
        };
        let observed = !post_generate.is_empty();
        // The held write joins the answer's batch, at its head, and the lock held with it
        // stays; a hook that looks, or a failed generation, gets it committed first.
        if observed || generation.is_err() {
            self.release_first(&mut first).await?;
        }
        let joined = first.take();
        if observed {
            // The hooks may read the transcript: the answer is there first.
            self.flush(carry).await?;
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
                .run_chain(HookPoint::PostGenerate, &post_generate, env, None, None)
                .await;
        }
        match joined {
            Some((mut batch, guard)) => {
                batch.extend(std::mem::take(&mut carry.pending));
                carry.pending = batch;
                carry.guard = Some(guard);
            }
            None => carry.guard = Some(self.inner.locks.lock(&sid).await),
        }
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
            carry,
        );
        Ok((now, input))
    }

    /// Stage `ResumeAtCalls`: redelivered after the model had answered; the answer is read back
    /// from its entry, never asked for again.
    pub(crate) async fn resume_at_calls(
        &self,
        rec: &mut TurnRecord,
        carry: &mut Carry,
    ) -> Result<Input> {
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
            carry,
        ))
    }

    /// The post-turn gate: `hooks` (the post-turn chain, read once by the interpreter) see the
    /// result the turn would complete with; the first deny (or a broken fail-closed hook)
    /// refuses it.
    pub(crate) async fn post_turn(
        &self,
        rec: &TurnRecord,
        result: Value,
        hooks: &[hooks::Hook],
    ) -> Result<Input> {
        if hooks.is_empty() {
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
        let chain = self
            .run_chain(HookPoint::PostTurn, hooks, env, None, None)
            .await?;
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
    pub(crate) async fn session_exists(&self, session_id: &str) -> Result<bool> {
        let session: Option<harness_types::session::GetResponse> = self
            .call("session::get", &json!({"session_id": session_id}))
            .await?;
        Ok(session.is_some())
    }
}

/// The machine's input for a generation that ended; keeps the answer for the next stages.
fn finished(
    rec: &TurnRecord,
    generation: Generation,
    cancel: &CancellationToken,
    seen: Option<(Option<String>, Option<u64>)>,
    carry: &mut Carry,
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
    carry.message = Some(message);
    input
}

/// The server refused the prompt as over its window before streaming any of the reply.
fn overflowed(generation: &Result<crate::stream::Generation>) -> bool {
    generation.as_ref().is_ok_and(|g| {
        !g.has_partial()
            && g.error
                .as_ref()
                .is_some_and(|e| e.kind == harness_types::message::ErrorKind::ContextOverflow)
    })
}
