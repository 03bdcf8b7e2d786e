//! Deferred calls: resolving a parked call (`harness::function::resolve`), the pending-call
//! sweep (`harness::sweep-pending`), and the pipeline for one call from a trusted caller
//! (`harness::function::trigger`).

use std::time::Instant;

use harness_types::api::*;
use harness_types::message::ContentBlock;
use harness_types::{now_ms, HarnessError};
use serde_json::{json, Value};

use harness_machine::call::{self, CallEffect, CallInput, CallPhase, Resolution};

use crate::dispatch::{self, CallEnd, Flight, PlannedCall, Policy, Refusal};
use crate::harness::{Harness, Result};
use crate::hooks::{self, Decision, HookPoint};
use crate::interpret::Carry;
use crate::machine::Input;
use crate::record::{CallCheckpoint, CallState, HeldResult, TurnRecord, Wait};
use crate::texts;
use crate::TURN_SCOPE;

fn not_resolved() -> ResolveResponse {
    ResolveResponse {
        resolved: false,
        turn_resumed: false,
    }
}

impl Harness {
    pub async fn resolve(&self, req: ResolveRequest) -> Result<ResolveResponse> {
        let _guard = self.inner.locks.lock(&req.session_id).await;
        // One-shot roots for a released call: checked before anything is looked at.
        let released = match &req.fs_scope {
            Some(_) if req.action != Some(ResolveAction::Execute) => {
                return Err(HarnessError::invalid_field(
                    "fs_scope",
                    "only with action 'execute': it widens the released call's roots",
                ))
            }
            Some(scope) => scope
                .grants
                .iter()
                .enumerate()
                .map(|(i, g)| {
                    crate::fsroot::explicit(&format!("fs_scope.grants[{i}]"), g).map(|r| r.root)
                })
                .collect::<std::result::Result<Vec<_>, _>>()?,
            None => Vec::new(),
        };
        let Some(mut rec) = self.load_record(&req.session_id).await? else {
            return Ok(not_resolved());
        };
        if rec.turn_id != req.turn_id || rec.is_terminal() {
            return Ok(not_resolved());
        }
        let checkpoint = rec.calls.get(&req.function_call_id).cloned();
        let phase = CallPhase::of(checkpoint.as_ref());
        let call = PlannedCall {
            id: req.function_call_id.clone(),
            function_id: checkpoint
                .as_ref()
                .map(|c| c.function_id().to_string())
                .unwrap_or_default(),
            arguments: checkpoint
                .as_ref()
                .and_then(|c| c.hold())
                .map(|h| h.arguments.clone())
                .unwrap_or(Value::Null),
            intent: None,
        };
        let mut flight = Flight::new(&call, None);
        let action = match req.action.unwrap_or_default() {
            ResolveAction::Deliver => Resolution::Deliver,
            ResolveAction::Execute => Resolution::Execute,
        };
        if let Some(CallCheckpoint::Pending { wait, .. }) = checkpoint {
            let annotations = match wait {
                Wait::Hold(hold) => {
                    flight.run.arguments = hold.arguments;
                    flight.reconciled = hold.reconciled;
                    // A released pre-trigger hold runs from the holder on, with its repairs;
                    // a post-trigger one appends the result it kept.
                    flight.run.changes = flight
                        .reconciled
                        .clone()
                        .and_then(|r| serde_json::from_value(r).ok())
                        .unwrap_or_default();
                    flight.run.breaker_key = hold.breaker_key.unwrap_or_default();
                    flight.run.after = Some(hold.holder);
                    flight.run.grants = released;
                    flight.result = hold.result;
                    hold.annotations
                }
                Wait::Child { origin, .. } => origin,
                Wait::Result => None,
            };
            if let Some(Value::Object(m)) = annotations {
                flight.run.annotations = m;
            }
        }
        if action == Resolution::Deliver {
            flight.result = Some(HeldResult {
                content: req
                    .content
                    .clone()
                    .unwrap_or_else(|| vec![ContentBlock::text("")]),
                details: req.details.clone().unwrap_or(Value::Null),
                is_error: req.is_error.unwrap_or(false),
            });
        }
        // Only a release that reaches the target races the turn's stop signal: the signal is
        // taken (and so registered) for that alone.
        let cancel = if reaches_target(phase, action) {
            self.signal(&rec.turn_id)
        } else {
            tokio_util::sync::CancellationToken::new()
        };
        let input = CallInput::Resolve(action);
        match self
            .drive_call(&mut rec, &mut flight, phase, input, &cancel)
            .await?
        {
            CallEnd::NotResolved => return Ok(not_resolved()),
            CallEnd::Held => {
                self.barrier().await?;
                return Ok(ResolveResponse {
                    resolved: true,
                    turn_resumed: false,
                });
            }
            CallEnd::Closed | CallEnd::Cancelled | CallEnd::Skipped => {}
        }
        let resumed = self.resume_if_settled(&rec).await?;
        self.barrier().await?;
        Ok(ResolveResponse {
            resolved: true,
            turn_resumed: resumed,
        })
    }

    /// A pending call was settled: the turn machine says whether the parked turn runs its next
    /// step (its record and step are one write). Returns whether a step was enqueued.
    pub(crate) async fn resume_if_settled(&self, rec: &TurnRecord) -> Result<bool> {
        let mut carry = Carry::default();
        carry.advance_point = Some("after_advance_persisted");
        self.run(Some(rec.clone()), Input::CallSettled, &mut carry)
            .await
            .inspect_err(|e| {
                // Its calls are closed and its record still parked (or, on a bus that writes a
                // batch one by one, running without its step): the recovery at the next start
                // runs it on (T43 then T37, or T42).
                tracing::error!(session = %rec.session_id, turn = %rec.turn_id, "a settled turn could not run on: {e}");
            })?;
        Ok(carry.enqueued)
    }

    /// A parked turn whose calls are all closed, read again under the session's lock: the turn
    /// machine runs it on (T37). Returns whether a step was enqueued.
    async fn run_on_settled(&self, session_id: &str) -> Result<bool> {
        let _guard = self.inner.locks.lock(session_id).await;
        match self.load_record(session_id).await? {
            Some(rec) if rec.status == TurnStatus::AwaitingFunctions && all_closed(&rec) => {
                self.resume_if_settled(&rec).await
            }
            _ => Ok(false),
        }
    }

    /// Settles pending calls past their timeout (hook holds never expire). Returns how many.
    pub async fn sweep_pending(&self, _req: SweepRequest) -> Result<SweepResponse> {
        // Retention rides on the sweep; a failed prune is retried by the next one.
        if let Err(e) = self.prune_idempotency().await {
            tracing::warn!("idempotency prune failed: {e}");
        }
        // Every record, read and parsed once for both the prune and the settling below.
        let records: Vec<(String, TurnRecord)> = self
            .state_list(TURN_SCOPE)
            .await?
            .into_iter()
            .filter_map(|(k, v)| serde_json::from_value(v).ok().map(|r| (k, r)))
            .collect();
        if let Err(e) = self.prune_scratch(&records).await {
            tracing::warn!("scratch prune failed: {e}");
        }
        let now = now_ms();
        let mut resolved = 0;
        // Set when a settled turn's advance fails again: the store is refusing writes, so the
        // other settled turns wait for the next sweep instead of each paying the retries
        // (seconds apiece) while the expired calls below wait behind them.
        let mut store_refusing = false;
        for (session_id, rec) in records {
            if rec.status != TurnStatus::AwaitingFunctions {
                continue;
            }
            if all_closed(&rec) {
                // Its advance could not be written past the retries: it runs on here rather
                // than at the next start.
                if store_refusing {
                    continue;
                }
                if let Err(e) = self.run_on_settled(&session_id).await {
                    tracing::warn!(session = %session_id, "a settled turn still cannot run on: {e}");
                    store_refusing = true;
                }
                continue;
            }
            for (call_id, cp) in &rec.calls {
                let (since, timeout_ms) = match cp {
                    CallCheckpoint::Pending {
                        since, timeout_ms, ..
                    } => (*since, *timeout_ms),
                    _ => (None, None),
                };
                let timeout = timeout_ms.unwrap_or(self.config().default_pending_timeout_ms) as i64;
                let expired = now - since.unwrap_or(now) >= timeout;
                let phase = CallPhase::of(Some(cp));
                let mut effects = call::next(phase, CallInput::Swept { expired })
                    .map_err(dispatch::illegal_call)?
                    .effects;
                let child = cp.child();
                if effects.first() == Some(&CallEffect::ReadChild) {
                    let Some(child) = child else { continue };
                    // A waiting spawn follows its child's record first; past its wait guard it
                    // is answered once with a timeout and the child is stopped (its late
                    // result then finds the call closed and changes nothing).
                    let settled = self
                        .child_settlement(
                            &child.session_id,
                            Some(child.turn_id.as_str()).filter(|t| !t.is_empty()),
                        )
                        .await?;
                    let read = CallInput::ChildRead {
                        settled: settled.is_some(),
                        expired,
                    };
                    effects = call::next(phase, read)
                        .map_err(dispatch::illegal_call)?
                        .effects;
                    if let Some((content, is_error, details)) = settled {
                        if effects.contains(&CallEffect::DeliverOutcome) {
                            let delivered = self
                                .deliver_pending(
                                    &session_id,
                                    &rec.turn_id,
                                    call_id,
                                    content,
                                    is_error,
                                    details,
                                )
                                .await?;
                            resolved += u32::from(delivered);
                        }
                        continue;
                    }
                }
                for effect in effects {
                    match (effect, child) {
                        (CallEffect::DeliverTimeout, Some(child)) => {
                            let content = vec![ContentBlock::text(texts::child_timed_out(
                                &child.session_id,
                                timeout,
                            ))];
                            let details = json!({"error": Refusal::PendingTimeout, "child_session_id": child.session_id,
                                   "child_turn_id": child.turn_id});
                            let delivered = self
                                .deliver_pending(&session_id, &rec.turn_id, call_id, content, true, details)
                                .await?;
                            resolved += u32::from(delivered);
                        }
                        (CallEffect::DeliverTimeout, None) => {
                            let content =
                                vec![ContentBlock::text(texts::pending_timed_out(timeout))];
                            let details = json!({"error": Refusal::PendingTimeout});
                            let delivered = self
                                .deliver_pending(&session_id, &rec.turn_id, call_id, content, true, details)
                                .await?;
                            resolved += u32::from(delivered);
                        }
                        (CallEffect::StopChild, Some(child)) => {
                            let stop = StopRequest {
                                session_id: child.session_id.clone(),
                                turn_id: Some(child.turn_id.clone()).filter(|t| !t.is_empty()),
                            };
                            if let Err(e) = self.stop(stop).await {
                                tracing::warn!(child = %child.session_id, "cannot stop a timed-out sub-agent: {e}");
                            }
                        }
                        (other, _) => {
                            return Err(HarnessError::internal(format!(
                                "the call machine asked the sweep for {other:?}, which it cannot carry out for call {call_id}"
                            )))
                        }
                    }
                }
            }
        }
        Ok(SweepResponse { ok: true, resolved })
    }

    /// A pending call's result, delivered as a resolve would (under the session's lock, through
    /// the call machine). Returns whether it settled the call.
    async fn deliver_pending(
        &self,
        session_id: &str,
        turn_id: &str,
        call_id: &str,
        content: Vec<ContentBlock>,
        is_error: bool,
        details: Value,
    ) -> Result<bool> {
        let out = self
            .resolve(ResolveRequest {
                session_id: session_id.to_string(),
                turn_id: turn_id.to_string(),
                function_call_id: call_id.to_string(),
                action: Some(ResolveAction::Deliver),
                content: Some(content),
                is_error: Some(is_error),
                details: Some(details),
                fs_scope: None,
            })
            .await?;
        Ok(out.resolved)
    }

    /// What a waiting spawn gets from its child's record: the outcome once the child's turn
    /// ended, `child_lost` when the record is gone or moved on to another turn, nothing while the
    /// child still runs.
    async fn child_settlement(
        &self,
        child_session: &str,
        child_turn: Option<&str>,
    ) -> Result<Option<(Vec<ContentBlock>, bool, Value)>> {
        let lost = |why: &str| {
            Some((
                vec![ContentBlock::text(format!("child_lost: {why}"))],
                true,
                json!({"error": Refusal::ChildLost, "message": why}),
            ))
        };
        let Some(child) = self.load_record(child_session).await? else {
            return Ok(lost(
                "child turn record missing; the sub-agent's outcome is unknown",
            ));
        };
        if child_turn.is_some_and(|t| t != child.turn_id) {
            return Ok(lost(
                "the child session moved on to another turn; the sub-agent's outcome is unknown",
            ));
        }
        if !child.is_terminal() {
            return Ok(None);
        }
        Ok(Some(crate::spawn::child_outcome(&child)))
    }

    /// The pipeline for one already-unwrapped call, for trusted callers: the session's policy
    /// (deny-all without a turn record), pre-trigger hooks, the target, post-trigger hooks. Nothing
    /// is written to the transcript; a hold answers `pending: true`.
    pub async fn function_trigger(
        &self,
        req: FunctionTriggerRequest,
    ) -> Result<FunctionTriggerResponse> {
        let rec = self.load_record(&req.session_id).await?;
        let policy = Policy::new(rec.as_ref().and_then(|r| r.options.functions.as_ref()));
        let call = req.call;
        // A refusal is a result that took no time: the target never ran.
        let refuse = |error: &str, text: String| {
            FunctionTriggerResponse::Result(TriggerResultResponse {
                function_call_id: call.id.clone(),
                function_id: call.function_id.clone(),
                content: vec![ContentBlock::text(text.clone())],
                is_error: true,
                details: json!({"error": error, "function_id": call.function_id, "message": text}),
                duration_ms: 0,
            })
        };
        if !policy.allows(&call.function_id) {
            return Ok(refuse(
                Refusal::PolicyDenied.as_str(),
                dispatch::policy_refusal(&call.function_id),
            ));
        }
        let (turn_id, step, depth, metadata) = match &rec {
            Some(r) => (
                r.turn_id.clone(),
                r.step,
                r.depth,
                r.options.metadata.clone(),
            ),
            None => (String::new(), 0, 0, None),
        };
        // A trigger hook's input: the call, with `arguments`, in the session's turn.
        let envelope = |point, arguments: &Value| {
            let mut env = hooks::envelope(
                point,
                &req.session_id,
                &turn_id,
                step,
                depth,
                metadata.as_ref(),
            );
            env["call"] =
                json!({"id": call.id, "function_id": call.function_id, "arguments": arguments});
            env
        };
        let env = envelope(HookPoint::PreTrigger, &call.arguments);
        let chain = self
            .run_hooks(HookPoint::PreTrigger, env, Some(&call.function_id), None)
            .await?;
        match chain.decision {
            Decision::Deny(reason) => {
                return Ok(refuse(
                    Refusal::HookDenied.as_str(),
                    texts::hook_denied(&call.function_id, &reason),
                ))
            }
            Decision::Hold(holder) => {
                return Ok(FunctionTriggerResponse::Pending(TriggerPendingResponse {
                    function_call_id: call.id.clone(),
                    function_id: call.function_id.clone(),
                    pending: true,
                    // Hook holds never expire: the sweep leaves them to their holder.
                    pending_timeout_ms: None,
                    held_by: Some(holder),
                }));
            }
            Decision::Continue => {}
        }
        let arguments = chain.payload["call"]["arguments"].clone();
        let started = Instant::now();
        let outcome = self
            .inner
            .bus
            .call_with_metadata(
                &call.function_id,
                arguments.clone(),
                Some(std::time::Duration::from_millis(
                    self.config().dispatch_timeout_ms,
                )),
                json!({"function_call_id": call.id, "session_id": req.session_id}),
            )
            .await;
        let duration_ms = started.elapsed().as_millis() as u64;
        let (content, details, is_error) = dispatch::answered(outcome);
        let mut env = envelope(HookPoint::PostTrigger, &arguments);
        env["result"] = json!({"function_call_id": call.id, "function_id": call.function_id, "content": content, "is_error": is_error, "details": details});
        let chain = self
            .run_hooks(HookPoint::PostTrigger, env, Some(&call.function_id), None)
            .await?;
        let result = &chain.payload["result"];
        Ok(FunctionTriggerResponse::Result(TriggerResultResponse {
            function_call_id: call.id.clone(),
            function_id: call.function_id.clone(),
            content: serde_json::from_value(result["content"].clone()).unwrap_or(content),
            is_error: result["is_error"].as_bool().unwrap_or(is_error),
            details: result["details"].clone(),
            duration_ms,
        }))
    }
}

/// Whether every call of a parked turn is closed: nothing pending, nothing a restart must
/// close as interrupted.
fn all_closed(rec: &TurnRecord) -> bool {
    rec.calls.values().all(|c| c.state() == CallState::Done)
}

/// Whether resolving a call in `phase` with `action` goes on to its target: the call machine
/// answers by running the pre-trigger chain again (row C22, a pre-trigger hold released). A
/// released post-trigger hold appends the result it kept (C21) and runs nothing.
fn reaches_target(phase: CallPhase, action: Resolution) -> bool {
    call::next(phase, CallInput::Resolve(action))
        .is_ok_and(|t| t.effects.contains(&CallEffect::RunPreTrigger))
}

/// Errors a resolve can raise on bad input (the rest answer `resolved: false`).
pub(crate) fn check_resolve(req: &ResolveRequest) -> std::result::Result<(), HarnessError> {
    if req.function_call_id.is_empty() {
        return Err(HarnessError::invalid_field(
            "function_call_id",
            "must not be empty",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_machine::record::HoldPoint;

    #[test]
    fn only_a_released_pre_trigger_hold_reaches_its_target() {
        use Resolution::{Deliver, Execute};
        let pre = CallPhase::Held(HoldPoint::PreTrigger);
        let post = CallPhase::Held(HoldPoint::PostTrigger);
        assert!(reaches_target(pre, Execute));
        for (phase, action) in [
            (post, Execute),
            (pre, Deliver),
            (post, Deliver),
            (CallPhase::AwaitingResult, Execute),
            (CallPhase::Child, Execute),
            (CallPhase::Done, Execute),
        ] {
            assert!(
                !reaches_target(phase, action),
                "{phase:?} resolved with {action:?} runs nothing"
            );
        }
    }
}
