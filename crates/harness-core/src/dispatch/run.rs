//! The shell of the call machine (`harness_machine::call`): one call of a step, or of a
//! resolve, moved from phase to phase by asking the machine and carrying out its effects.
//!
//! What the effects need from each other (the arguments as the hooks left them, the words of
//! a refusal, the target's result) travels in a [`Flight`]; what happens next is always the
//! machine's answer, never decided here.

use std::time::Duration;

use harness_machine::call::{
    self, CallEffect, CallInput, CallPhase, Check, Closing as Close, Gate,
};
use harness_types::message::ContentBlock;
use harness_types::now_ms;
use harness_types::HarnessError;
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

use super::{
    breaker, cap, degraded, origin, policy_refusal, provenance, reconcile, tools, CallEnd, Change,
    Closing, PlannedCall, Policy, Refusal, Run,
};
use crate::failpoint;
use crate::harness::{Harness, Result};
use crate::hooks::{self, Decision, HookPoint};
use crate::record::{CallCheckpoint, HeldResult, Hold, HoldPoint, TurnRecord, Wait};
use crate::texts;

/// One call in the hands of a shell, between two questions to the machine.
pub(crate) struct Flight<'a> {
    pub call: &'a PlannedCall,
    /// Why the step's calls cannot be trusted (the output limit, a broken stream).
    pub cut: Option<&'a str>,
    pub run: Run,
    /// The repairs reconciliation made, as the result's origin records them.
    pub reconciled: Option<Value>,
    /// The words of the refusal the checks or the hooks found.
    refusal: Option<Closing>,
    /// The target's result (as the post-trigger hooks left it), a held one, or a delivered one.
    pub result: Option<HeldResult>,
    /// The hook that holds the call.
    holder: Option<String>,
}

impl<'a> Flight<'a> {
    pub(crate) fn new(call: &'a PlannedCall, cut: Option<&'a str>) -> Flight<'a> {
        Flight {
            call,
            cut,
            run: Run {
                arguments: call.arguments.clone(),
                changes: Vec::new(),
                annotations: Map::new(),
                breaker_key: String::new(),
                after: None,
                grants: Vec::new(),
            },
            reconciled: None,
            refusal: None,
            result: None,
            holder: None,
        }
    }

    fn refuse(&mut self, turn_id: &str, why: Refusal, text: String) -> Refusal {
        self.refusal = Some(Closing::refusal(self.call, turn_id, why, text));
        why
    }
}

pub(crate) fn illegal(e: call::Illegal) -> HarnessError {
    HarnessError::internal(e.to_string())
}

impl Harness {
    /// Feeds the call machine `input` from `phase` and carries out its effects until no effect
    /// asks for another input. The effects of another shell (the sweep's) are a bug here.
    pub(crate) async fn drive_call(
        &self,
        rec: &mut TurnRecord,
        flight: &mut Flight<'_>,
        mut phase: CallPhase,
        input: CallInput,
        cancel: &CancellationToken,
    ) -> Result<CallEnd> {
        let mut input = Some(input);
        let mut end = CallEnd::Closed;
        while let Some(i) = input.take() {
            let t = call::next(phase, i).map_err(illegal)?;
            phase = t.phase;
            for effect in t.effects {
                match effect {
                    CallEffect::Check => {
                        input = Some(CallInput::Checked(self.check_call(rec, flight).await?))
                    }
                    CallEffect::EndDispatch => end = CallEnd::Cancelled,
                    CallEffect::Skip => end = CallEnd::Skipped,
                    CallEffect::NotResolved => end = CallEnd::NotResolved,
                    CallEffect::Close(why) => self.close_as(rec, flight, why).await?,
                    CallEffect::AnswerSubmit => self.answer_submit(rec, flight.call).await?,
                    CallEffect::AnswerAsk => {
                        let (arguments, key) = (&flight.run.arguments, &flight.run.breaker_key);
                        self.answer_ask(rec, flight.call, arguments, key).await?
                    }
                    CallEffect::RunPreTrigger => {
                        input = Some(CallInput::PreTrigger(self.pre_trigger(rec, flight).await?))
                    }
                    CallEffect::StartChild => {
                        let origin = origin(
                            &rec.turn_id,
                            &flight.run.annotations,
                            flight.reconciled.as_ref(),
                        );
                        let arguments = flight.run.arguments.clone();
                        // Boxed: a child's start can come back to a resolve of this call.
                        let started =
                            Box::pin(self.spawn_from_call(rec, flight.call, arguments, origin))
                                .await?;
                        let waiting = started == CallEnd::Held;
                        if waiting {
                            end = CallEnd::Held;
                        }
                        input = Some(CallInput::ChildStarted { waiting });
                    }
                    CallEffect::Trigger => {
                        let cancelled = !self.trigger(rec, flight, cancel).await?;
                        input = Some(CallInput::TargetEnded { cancelled });
                    }
                    CallEffect::RunPostTrigger => {
                        let held = self.post_trigger(rec, flight).await?;
                        input = Some(CallInput::PostTrigger { held });
                    }
                    CallEffect::Park => {
                        self.park_held(rec, flight, phase).await?;
                        end = CallEnd::Held;
                    }
                    other @ (CallEffect::ReadChild
                    | CallEffect::DeliverTimeout
                    | CallEffect::DeliverOutcome
                    | CallEffect::StopChild) => {
                        return Err(HarnessError::internal(format!(
                            "the call machine asked the dispatch for {other:?}, which only the sweep carries out"
                        )))
                    }
                }
            }
        }
        Ok(end)
    }

    /// Everything checked before the hooks see the call, in order: `submit_result`, a missing
    /// `agent_trigger` target, cut arguments, the wall, provenance, the policy, the breaker;
    /// then reconciliation, and `harness::ask`.
    async fn check_call(&self, rec: &TurnRecord, flight: &mut Flight<'_>) -> Result<Check> {
        let call = flight.call;
        let turn_id = rec.turn_id.clone();
        let cut = flight.cut;
        if call.function_id == crate::output::SUBMIT_RESULT
            && crate::output::json_contract(&rec.options.output).is_some()
            && !degraded(&call.arguments)
            && cut.is_none()
        {
            // The contract's own tool: answered here, never dispatched.
            return Ok(Check::Submit);
        }
        if call.function_id == tools::AGENT_TRIGGER {
            let text = texts::AGENT_TRIGGER_NO_TARGET;
            let why = flight.refuse(&turn_id, Refusal::AgentTriggerNoTarget, text.into());
            return Ok(Check::Refused(why));
        }
        if degraded(&call.arguments) || cut.is_some() {
            // A call that arrived whole but does not parse is malformed, not cut short.
            let text = if cut.is_none() && call.arguments.get("_raw").is_some() {
                texts::arguments_not_json(&call.function_id)
            } else {
                let why = cut.unwrap_or(texts::STREAM_BROKE_MID_CALL);
                texts::arguments_cut_short(&call.function_id, why)
            };
            let why = flight.refuse(&turn_id, Refusal::DegradedArguments, text);
            return Ok(Check::Refused(why));
        }
        if let Some(text) = self.walled(rec, &call.function_id, &call.arguments).await? {
            let why = flight.refuse(&turn_id, Refusal::ControlPlane, text);
            return Ok(Check::Refused(why));
        }
        if let Err(text) = provenance::check(&call.function_id, &call.arguments) {
            let why = flight.refuse(&turn_id, Refusal::ForbiddenEntry, text);
            return Ok(Check::Refused(why));
        }
        if !Policy::new(rec.options.functions.as_ref()).allows(&call.function_id) {
            let text = policy_refusal(&call.function_id);
            let why = flight.refuse(&turn_id, Refusal::PolicyDenied, text);
            return Ok(Check::Refused(why));
        }
        let key = breaker::key(&call.function_id, &call.arguments);
        if breaker::tripped(&rec.failed_calls, &key) {
            let text = texts::repeated_failure(&call.function_id);
            let why = flight.refuse(&turn_id, Refusal::RepeatedFailure, text);
            if let Some(c) = flight.refusal.as_mut() {
                c.details["count"] = json!(breaker::TRIP_AFTER);
            }
            return Ok(Check::Refused(why));
        }
        let (arguments, changes) = self.reconcile(call).await;
        flight.run.arguments = arguments;
        flight.run.changes = changes;
        flight.run.breaker_key = key;
        if call.function_id == crate::ask::ASK {
            // Answered here: never dispatched, and no hook is consulted.
            return Ok(Check::Ask);
        }
        Ok(Check::Run)
    }

    /// The pre-trigger hooks (a released call: after its holder), with the turn's root stamped
    /// before and after them, and what will run checked again if they changed it.
    async fn pre_trigger(&self, rec: &TurnRecord, flight: &mut Flight<'_>) -> Result<Gate> {
        let call = flight.call;
        let turn_id = rec.turn_id.clone();
        // The turn's root and the session's grants (read now: a revoke holds from the next
        // call), over whatever the model wrote (§4.10); again after the hooks below.
        let released = std::mem::take(&mut flight.run.grants);
        let grants = if crate::fsroot::scoped(&call.function_id) && rec.options.filesystem.is_some()
        {
            let mut g = self.session_grants(&rec.session_id).await?;
            g.extend(
                released
                    .into_iter()
                    .filter(|r| !g.contains(r))
                    .collect::<Vec<_>>(),
            );
            g
        } else {
            Vec::new()
        };
        let mut arguments = std::mem::take(&mut flight.run.arguments);
        crate::fsroot::stamp(
            &call.function_id,
            &mut arguments,
            rec.options.filesystem.as_ref(),
            &grants,
        );
        let mut payload = hooks::envelope(
            HookPoint::PreTrigger,
            &rec.session_id,
            &turn_id,
            rec.step,
            rec.depth,
            rec.options.metadata.as_ref(),
        );
        payload["call"] =
            json!({"id": call.id, "function_id": call.function_id, "arguments": arguments});
        let chain = self
            .run_hooks(
                HookPoint::PreTrigger,
                payload,
                Some(&call.function_id),
                flight.run.after.as_deref(),
            )
            .await?;
        flight.run.annotations.extend(chain.annotations);
        let mut arguments = chain.payload["call"]["arguments"].clone();
        crate::fsroot::stamp(
            &call.function_id,
            &mut arguments,
            rec.options.filesystem.as_ref(),
            &grants,
        );
        let changes: &[Change] = &flight.run.changes;
        flight.reconciled =
            (!changes.is_empty()).then(|| serde_json::to_value(changes).unwrap_or(Value::Null));
        let origin_now =
            |f: &Flight<'_>| origin(&turn_id, &f.run.annotations, f.reconciled.as_ref());
        match chain.decision {
            Decision::Deny(reason) => {
                let text = texts::hook_denied(&call.function_id, &reason);
                flight.refuse(&turn_id, Refusal::HookDenied, text);
                let origin = origin_now(flight);
                if let Some(c) = flight.refusal.as_mut() {
                    c.details["message"] = json!(reason);
                    c.origin = origin;
                }
                return Ok(Gate::Deny);
            }
            Decision::Hold(holder) => {
                flight.holder = Some(holder);
                flight.run.arguments = arguments;
                return Ok(Gate::Hold);
            }
            Decision::Continue => {}
        }
        if call.function_id == super::SPAWN {
            // No target: the loop starts the child itself.
            flight.run.arguments = arguments;
            return Ok(Gate::Spawn);
        }
        // Reconciliation and hooks may have changed the arguments since the check at dispatch (a
        // released hold was never checked with its final arguments): check what will run.
        let unchanged = flight.run.after.is_none() && arguments == call.arguments;
        if !unchanged {
            let refused = match self.walled(rec, &call.function_id, &arguments).await? {
                Some(text) => Some((Refusal::ControlPlane, text)),
                None => provenance::check(&call.function_id, &arguments)
                    .err()
                    .map(|text| (Refusal::ForbiddenEntry, text)),
            };
            if let Some((why, text)) = refused {
                flight.refuse(&turn_id, why, text);
                let origin = origin_now(flight);
                if let Some(c) = flight.refusal.as_mut() {
                    c.origin = origin;
                }
                return Ok(Gate::Refused(why));
            }
        }
        // Who wrote an entry, who owns a binding: the loop's to say, after every hook.
        provenance::mark(
            &call.function_id,
            &mut arguments,
            &rec.session_id,
            &turn_id,
            &call.id,
        );
        flight.run.arguments = arguments;
        Ok(Gate::Run)
    }

    /// Checkpoints the call `triggered`, durably, then runs its target racing the stop signal.
    /// Returns false when the stop won (the target may still be running).
    async fn trigger(
        &self,
        rec: &mut TurnRecord,
        flight: &mut Flight<'_>,
        cancel: &CancellationToken,
    ) -> Result<bool> {
        let call = flight.call;
        // Checkpoint before the side effect, durably: after a crash this call never runs again.
        let cp = CallCheckpoint::Triggered {
            function_id: call.function_id.clone(),
            breaker_key: Some(flight.run.breaker_key.clone()),
        };
        rec.calls.insert(call.id.clone(), cp);
        self.save_record(rec).await?;
        self.barrier().await?;
        failpoint::hit("after_call_triggered");
        let metadata = json!({"function_call_id": call.id, "session_id": rec.session_id, "turn_id": rec.turn_id});
        let invoke = self.inner.bus.call_with_metadata(
            &call.function_id,
            flight.run.arguments.clone(),
            Some(Duration::from_millis(self.config().dispatch_timeout_ms)),
            metadata,
        );
        let outcome = tokio::select! {
            outcome = invoke => Some(outcome),
            _ = cancel.cancelled() => None,
        };
        failpoint::hit("after_call_target");
        let Some(outcome) = outcome else {
            return Ok(false);
        };
        let policy = Policy::new(rec.options.functions.as_ref());
        let outcome = match outcome {
            Ok(value) => Ok(self
                .filter_discovery(&call.function_id, &policy, value)
                .await),
            failed => failed,
        };
        let (content, details, is_error) = super::answered(outcome);
        breaker::record(
            &mut rec.failed_calls,
            &flight.run.breaker_key,
            is_error,
            &serde_json::to_string(&content).unwrap_or_default(),
        );
        flight.result = Some(HeldResult {
            content,
            details,
            is_error,
        });
        Ok(true)
    }

    /// The post-trigger hooks (they may rewrite the result, or hold it), then the repair note,
    /// the schema diagnosis of a failure and the result cap. Returns whether a hook holds it.
    async fn post_trigger(&self, rec: &mut TurnRecord, flight: &mut Flight<'_>) -> Result<bool> {
        let call = flight.call;
        let HeldResult {
            content,
            details,
            is_error,
        } = flight.result.take().unwrap_or(HeldResult {
            content: Vec::new(),
            details: Value::Null,
            is_error: false,
        });
        let arguments = &flight.run.arguments;
        let mut payload = hooks::envelope(
            HookPoint::PostTrigger,
            &rec.session_id,
            &rec.turn_id,
            rec.step,
            rec.depth,
            rec.options.metadata.as_ref(),
        );
        payload["call"] =
            json!({"id": call.id, "function_id": call.function_id, "arguments": arguments});
        payload["result"] = json!({"function_call_id": call.id, "function_id": call.function_id, "content": content, "is_error": is_error, "details": details});
        let chain = self
            .run_hooks(
                HookPoint::PostTrigger,
                payload,
                Some(&call.function_id),
                None,
            )
            .await?;
        flight.run.annotations.extend(chain.annotations);
        let result = &chain.payload["result"];
        let mut content: Vec<ContentBlock> =
            serde_json::from_value(result["content"].clone()).unwrap_or(content);
        let mut details = result["details"].clone();
        let is_error = result["is_error"].as_bool().unwrap_or(is_error);

        let changes = &flight.run.changes;
        if !changes.is_empty() {
            let fresh: Vec<String> = changes
                .iter()
                .map(|c| format!("{}{}", call.function_id, c.path))
                .filter(|k| !rec.noted_repairs.contains(k))
                .collect();
            if !fresh.is_empty() && !call.function_id.starts_with("engine::functions::") {
                if let Some(text) = reconcile::note(changes) {
                    content.push(ContentBlock::text(text));
                }
                rec.noted_repairs.extend(fresh);
            }
        }
        if is_error {
            if let Some(note) = self
                .diagnosis(rec, &call.function_id, &flight.run.arguments)
                .await
            {
                content.push(ContentBlock::text(note));
            }
        }
        if let Some((c, d)) = cap::cap(self.config().max_result_bytes, &content, &details) {
            content = c;
            details = d;
        }
        flight.result = Some(HeldResult {
            content,
            details,
            is_error,
        });
        // The target ran; a held result waits for the holder's decision and is appended on
        // release, never produced by a second run.
        Ok(match chain.decision {
            Decision::Hold(holder) => {
                flight.holder = Some(holder);
                true
            }
            _ => false,
        })
    }

    /// Checkpoints a held call `pending`, at the point the machine says; the turn parks once
    /// its other calls are closed.
    async fn park_held(
        &self,
        rec: &mut TurnRecord,
        flight: &mut Flight<'_>,
        phase: CallPhase,
    ) -> Result<()> {
        let CallPhase::Held(point) = phase else {
            return Err(HarnessError::internal(format!(
                "the call machine parked a call in phase {phase:?}, which is no hook hold"
            )));
        };
        let hold = Hold {
            holder: flight.holder.take().unwrap_or_default(),
            point,
            arguments: flight.run.arguments.clone(),
            result: match point {
                HoldPoint::PostTrigger => flight.result.take(),
                HoldPoint::PreTrigger => None,
            },
            reconciled: flight.reconciled.clone(),
            annotations: Some(Value::Object(flight.run.annotations.clone())),
            breaker_key: Some(flight.run.breaker_key.clone()),
        };
        let cp = CallCheckpoint::Pending {
            function_id: flight.call.function_id.clone(),
            since: Some(now_ms()),
            timeout_ms: None,
            wait: Wait::Hold(Box::new(hold)),
        };
        rec.calls.insert(flight.call.id.clone(), cp);
        self.save_record(rec).await
    }

    /// Closes the call with the result the machine named.
    async fn close_as(
        &self,
        rec: &mut TurnRecord,
        flight: &mut Flight<'_>,
        why: Close,
    ) -> Result<()> {
        let call = flight.call;
        match why {
            Close::Refused(r) => {
                let closing = flight.refusal.take().ok_or_else(|| {
                    HarnessError::internal(format!(
                        "the call machine refused {} as {r:?} with no words for it",
                        call.id
                    ))
                })?;
                self.close_call(rec, call, closing).await
            }
            Close::Result | Close::HeldResult | Close::Delivered => {
                let result = flight.result.take().unwrap_or(HeldResult {
                    content: Vec::new(),
                    details: Value::Null,
                    is_error: false,
                });
                let origin = origin(
                    &rec.turn_id,
                    &flight.run.annotations,
                    flight.reconciled.as_ref(),
                );
                self.append_result(
                    rec,
                    call,
                    result.content,
                    result.details,
                    result.is_error,
                    origin,
                )
                .await
            }
            Close::Interrupted => self.interrupted(rec, call).await,
            Close::Cancelled => {
                let text = texts::cancelled_while_running(&call.function_id);
                let turn_id = rec.turn_id.clone();
                self.close_call(
                    rec,
                    call,
                    Closing::refusal(call, &turn_id, Refusal::Cancelled, text),
                )
                .await
            }
        }
    }
}
