//! Closing the function calls of a step, at most once each.
//!
//! The pipeline of one call, in content order (each early exit appends a result and marks the
//! call done):
//! 1. checkpoint: `done`/`pending` → skip; `triggered` (the process died while the target ran)
//!    → the "interrupted" error result, never a second run;
//! 2. `agent_trigger` with no target; degraded (cut) arguments → refused, never executed;
//! 3. the fail-closed policy (before anything else sees the call);
//! 4. the repeated-failure breaker;
//! 5. argument reconciliation;
//! 6. checkpoint `triggered`, durably; run the target (racing the stop signal); normalize;
//! 7. discovery filtering, breaker ledger, repair note, result cap; append under the call's
//!    deterministic entry id; checkpoint `done`.

mod bindings;
mod breaker;
mod cap;
pub(crate) mod policy;
pub mod provenance;
mod reconcile;
pub(crate) mod tools;
pub mod wall;

use std::time::Duration;

use harness_types::api::ExposeMode;
use harness_types::message::{AgentMessage, ContentBlock, FunctionResultMessage};
use harness_types::session::AppendRequest;
use harness_types::{ids, now_ms};
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;

pub(crate) use policy::Policy;
pub use reconcile::Change;

use crate::config::CallReconciliation;
use crate::failpoint;
use crate::harness::{Harness, Result};
use crate::hooks::{self, Decision, HookPoint};
use crate::record::{CallCheckpoint, CallState, HoldPoint, TurnRecord, Wait};

/// One call as the model wrote it, unwrapped from `agent_trigger` when needed.
#[derive(Clone, Debug)]
pub(crate) struct PlannedCall {
    pub id: String,
    pub function_id: String,
    pub arguments: Value,
    /// The `agent_trigger` description: what the model meant to do (the judge's context).
    pub intent: Option<String>,
}

/// How a step's dispatch ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Dispatched {
    /// Every call is closed.
    All,
    /// The stop signal fired; the calls not reached are left for the finalizer.
    Cancelled,
}

pub(crate) fn plan_calls(content: &[ContentBlock], expose: ExposeMode) -> Vec<PlannedCall> {
    content
        .iter()
        .filter_map(|b| match b {
            ContentBlock::FunctionCall {
                id,
                function_id,
                arguments,
            } => Some(unwrap_call(id, function_id, arguments, expose)),
            _ => None,
        })
        .collect()
}

/// §4.3: the target is `arguments.function`; a string payload is parsed leniently (kept only if
/// it is an object); a missing payload hoists the other keys; truncation markers travel along.
fn unwrap_call(id: &str, function_id: &str, arguments: &Value, expose: ExposeMode) -> PlannedCall {
    if function_id != tools::AGENT_TRIGGER && expose == ExposeMode::Native {
        return PlannedCall {
            id: id.into(),
            function_id: function_id.into(),
            arguments: arguments.clone(),
            intent: None,
        };
    }
    let target = arguments
        .get("function")
        .and_then(Value::as_str)
        .filter(|t| !t.is_empty())
        .unwrap_or(function_id);
    let mut payload = match arguments.get("payload") {
        Some(Value::String(s)) => lenient_object(s).unwrap_or(json!({})),
        Some(p) => p.clone(),
        None => {
            let mut hoisted = arguments.as_object().cloned().unwrap_or_default();
            hoisted.remove("function");
            hoisted.remove("description");
            Value::Object(hoisted)
        }
    };
    for marker in ["_partial", "_raw"] {
        if let (Some(m), Some(obj)) = (arguments.get(marker), payload.as_object_mut()) {
            obj.insert(marker.into(), m.clone());
        }
    }
    PlannedCall {
        id: id.into(),
        function_id: target.into(),
        arguments: payload,
        intent: arguments
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
    }
}

/// The first JSON value in `text`, if it is an object.
fn lenient_object(text: &str) -> Option<Value> {
    let start = text.find('{')?;
    let mut stream = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
    stream.next()?.ok().filter(Value::is_object)
}

fn degraded(arguments: &Value) -> bool {
    match arguments.as_object() {
        Some(obj) => obj.contains_key("_partial") || obj.contains_key("_raw"),
        None => true,
    }
}

/// §4.11: a JSON string → one text block; an object with a content block array → those blocks;
/// anything else → its compact JSON. `is_error` comes from the value.
pub(crate) fn normalize(value: &Value) -> (Vec<ContentBlock>, bool) {
    let is_error = value
        .get("is_error")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if let Value::String(s) = value {
        return (vec![ContentBlock::text(s.clone())], false);
    }
    if let Some(blocks) = value
        .get("content")
        .and_then(|c| serde_json::from_value::<Vec<ContentBlock>>(c.clone()).ok())
        .filter(|b| !b.is_empty())
    {
        return (blocks, is_error);
    }
    (vec![ContentBlock::text(value.to_string())], is_error)
}

/// Why a call was closed without a result of its target: the `details.error` the model and
/// the transcript read (the serde names are the strings earlier versions wrote).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// Found `triggered` after a restart: it may have run, once; it never runs again.
    Interrupted,
    /// `agent_trigger` without a target function.
    AgentTriggerNoTarget,
    /// Its arguments were cut short (stream broke, output limit).
    DegradedArguments,
    /// The dispatch policy does not allow it.
    PolicyDenied,
    /// It failed twice with these arguments and the same error.
    RepeatedFailure,
    /// A pre-trigger hook denied it.
    HookDenied,
    /// A stop landed while the target ran.
    Cancelled,
    /// A `submit_result` value the output contract refused.
    InvalidResult,
    /// The control-plane wall: no model may call it, whatever its policy says.
    ControlPlane,
    /// A pending call waited past its timeout.
    PendingTimeout,
    /// A waiting spawn's child can no longer be followed.
    ChildLost,
    /// An entry a function call may not write (a user or system message, a loop record).
    ForbiddenEntry,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Interrupted => "interrupted",
            Refusal::AgentTriggerNoTarget => "agent_trigger_no_target",
            Refusal::DegradedArguments => "degraded_arguments",
            Refusal::PolicyDenied => "policy_denied",
            Refusal::RepeatedFailure => "repeated_failure",
            Refusal::HookDenied => "hook_denied",
            Refusal::Cancelled => "cancelled",
            Refusal::InvalidResult => "invalid_result",
            Refusal::ControlPlane => "control_plane",
            Refusal::PendingTimeout => "pending_timeout",
            Refusal::ChildLost => "child_lost",
            Refusal::ForbiddenEntry => "forbidden_entry",
        }
    }
}

/// What a model reads when the policy refuses its call.
pub(crate) fn policy_refusal(function_id: &str) -> String {
    format!(
        "function {function_id} is not permitted by this agent's dispatch policy (no allow-glob match or a deny-glob match)"
    )
}

/// How the dispatch answers a model that calls `function_id` under `policy`, before it looks at
/// the arguments: `Ok(true)` runs it, `Ok(false)` runs it once its arguments pass the wall (a
/// state scope, a session, a binding), `Err` is the refusal the model reads.
pub fn model_verdict(
    policy: Option<&harness_types::api::FunctionPolicy>,
    function_id: &str,
) -> std::result::Result<bool, String> {
    if wall::operator_only(function_id) {
        return Err(wall::refusal(function_id, "operator only"));
    }
    if !Policy::new(policy).allows(function_id) {
        return Err(policy_refusal(function_id));
    }
    let by_arguments = function_id.starts_with("state::")
        || function_id.starts_with("session::")
        || function_id == "engine::register_trigger"
        || function_id == "harness::status";
    Ok(!by_arguments)
}

/// How one call's run ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CallEnd {
    Closed,
    Held,
    Cancelled,
}

/// What a call runs with once it passed the checks before the hooks.
pub(crate) struct Run {
    pub arguments: Value,
    pub changes: Vec<Change>,
    pub annotations: Map<String, Value>,
    pub breaker_key: String,
    /// A released call resumes the pre-trigger chain strictly after this hook.
    pub after: Option<String>,
    /// One-shot roots a release granted this call, next to the session's grants.
    pub grants: Vec<String>,
}

/// A result ready to append.
struct Closing {
    content: Vec<ContentBlock>,
    details: Value,
    is_error: bool,
    origin: Value,
}

impl Closing {
    fn refusal(call: &PlannedCall, turn_id: &str, error: Refusal, text: String) -> Closing {
        Closing {
            content: vec![ContentBlock::text(text.clone())],
            details: json!({"error": error, "function_id": call.function_id, "message": text}),
            is_error: true,
            origin: json!({"turn_id": turn_id}),
        }
    }
}

impl Harness {
    /// Closes a call found `triggered` after a restart: it may have run, once; it never runs
    /// again.
    pub(crate) async fn close_interrupted(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
    ) -> Result<()> {
        let text =
            "interrupted: executed at most once, result unknown (restart during execution); \
                    verify its effect before repeating it";
        // The interrupted result belongs to the generation that made the call: the model hears
        // of it in a generation not counted against `max_turns` (so `max_turns: 1` is not ended
        // unheard), taken from the recovery budget so a call that brings the process down every
        // time cannot loop. Before the close, which persists it with the call's state.
        if rec.transient_resumes < rec.options.max_transient_resumes && rec.turn_count > 0 {
            rec.turn_count -= 1;
            rec.transient_resumes += 1;
        }
        let turn_id = rec.turn_id.clone();
        self.close_call(
            rec,
            call,
            Closing::refusal(call, &turn_id, Refusal::Interrupted, text.into()),
        )
        .await
    }

    /// Appends a call's result and marks it done (resolve uses it for settled pending calls).
    pub(crate) async fn append_result(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        content: Vec<ContentBlock>,
        details: Value,
        is_error: bool,
        origin: Value,
    ) -> Result<()> {
        self.close_call(
            rec,
            call,
            Closing {
                content,
                details,
                is_error,
                origin,
            },
        )
        .await
    }

    async fn close_call(&self, rec: &mut TurnRecord, call: &PlannedCall, c: Closing) -> Result<()> {
        self.append_closing(rec, call, c).await?;
        self.save_record(rec).await?;
        failpoint::hit("after_call_done");
        Ok(())
    }

    /// Closes every call a stop leaves open, with a cancelled error result that says what
    /// happened to it. The checkpoints change in memory only: the finalizer's record write
    /// carries them, and a crash before it re-appends nothing (the entry ids are deterministic).
    pub(crate) async fn close_open_calls(
        &self,
        rec: &mut TurnRecord,
        unreached: Vec<crate::machine::CallRef>,
    ) -> Result<()> {
        let turn_id = rec.turn_id.clone();
        let open: Vec<(String, CallCheckpoint)> = rec
            .calls
            .iter()
            .filter(|(_, c)| c.state() != CallState::Done)
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect();
        let mut closing = Vec::new();
        for (id, cp) in open {
            let f = cp.function_id().to_string();
            let text = match &cp {
                CallCheckpoint::Triggered { .. } => format!(
                    "function {f} was cancelled by a stop while it ran; the target may still be running and its effects are unknown, not undone"
                ),
                CallCheckpoint::Pending { wait: Wait::Hold(h), .. } if h.point == HoldPoint::PostTrigger => format!(
                    "function {f} ran, but the turn was stopped before its held result was released; its effects are not undone"
                ),
                CallCheckpoint::Pending { wait: Wait::Hold(h), .. } => format!(
                    "function {f} was not run: the turn was stopped while {} held the call", h.holder
                ),
                CallCheckpoint::Pending { wait: Wait::Child { child, .. }, .. } => format!(
                    "the sub-agent in session {} was stopped with this turn; its work is unfinished", child.session_id
                ),
                CallCheckpoint::Pending { .. } | CallCheckpoint::Done { .. } => format!(
                    "function {f} was cancelled: the turn was stopped before its result was delivered"
                ),
            };
            closing.push((id, f, text));
        }
        for c in unreached {
            let text = format!(
                "function {} was not run: the turn was stopped first",
                c.function_id
            );
            closing.push((c.id, c.function_id, text));
        }
        // Written with the finalizer's batch (see `Inner::closings`), marked done here.
        let mut appends = Vec::with_capacity(closing.len());
        for (id, function_id, text) in closing {
            let call = PlannedCall {
                id,
                function_id,
                arguments: Value::Null,
                intent: None,
            };
            let c = Closing::refusal(&call, &turn_id, Refusal::Cancelled, text);
            appends.push(closing_entry(rec, &call, c));
        }
        self.inner
            .closings
            .lock()
            .expect("closings lock")
            .insert(turn_id, appends);
        failpoint::hit("after_calls_closed");
        Ok(())
    }

    /// Appends a call's result and marks its checkpoint done, in memory.
    async fn append_closing(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        c: Closing,
    ) -> Result<()> {
        let req = closing_entry(rec, call, c);
        self.append(req).await?;
        failpoint::hit("after_call_result_appended");
        Ok(())
    }

    /// The request schema of a function, if the registry knows one.
    async fn request_schema(&self, function_id: &str) -> Option<Value> {
        let info: Value = self
            .call(
                "engine::functions::info",
                &json!({"function_id": function_id}),
            )
            .await
            .ok()?;
        info.get("request_schema")
            .filter(|s| s.is_object())
            .cloned()
    }

    async fn reconcile(&self, call: &PlannedCall) -> (Value, Vec<Change>) {
        let mode = self.config().call_reconciliation;
        if mode == CallReconciliation::Off {
            return (call.arguments.clone(), vec![]);
        }
        let Some(schema) = self.request_schema(&call.function_id).await else {
            return (call.arguments.clone(), vec![]);
        };
        let (args, mut changes) = reconcile::coerce(&schema, &call.arguments);
        if mode != CallReconciliation::Judge
            || reconcile::violations(&schema, &args).is_none_or(|v| v.is_empty())
        {
            return (args, changes);
        }
        match self.ask_judge(call, &schema, &args).await {
            Some((fixed, judged)) => {
                changes.extend(judged);
                (fixed, changes)
            }
            None => (args, changes),
        }
    }

    /// Layer B: asks `judge::evaluate` (when registered and not paused) about what coerce could
    /// not settle; keeps its repairs only if the arguments then validate. Fail-open.
    async fn ask_judge(
        &self,
        call: &PlannedCall,
        schema: &Value,
        args: &Value,
    ) -> Option<(Value, Vec<Change>)> {
        if self.judge_paused() {
            return None;
        }
        let found = reconcile::issues(schema, args);
        if found.is_empty() {
            return None;
        }
        let req = reconcile::judge_request(
            &call.function_id,
            call.intent.as_deref(),
            schema,
            args,
            &found,
        )?;
        let outer = Duration::from_secs(3);
        let response = match tokio::time::timeout(
            outer,
            self.inner.bus.call("judge::evaluate", req, Some(outer)),
        )
        .await
        {
            Ok(Ok(r)) if r["status"] == "ok" => r,
            Ok(Err(e)) if e.is_not_found() || e.code.as_str().contains("invalid_request") => {
                return None
            }
            Ok(Ok(r))
                if r["code"]
                    .as_str()
                    .is_some_and(|c| c.contains("invalid_request")) =>
            {
                return None
            }
            other => {
                tracing::warn!(function = %call.function_id, "judge failed, pausing it for 30 s: {other:?}");
                self.pause_judge();
                return None;
            }
        };
        let (fixed, changes) = reconcile::apply_judgement(args, &found, &response);
        let valid = reconcile::violations(schema, &fixed).is_some_and(|v| v.is_empty());
        (!changes.is_empty() && valid).then_some((fixed, changes))
    }

    /// Runs the calls of one assistant message. `cut` names why the message's calls cannot be
    /// trusted (the output limit, a broken stream) when it was cut short.
    pub(crate) async fn dispatch_calls(
        &self,
        rec: &mut TurnRecord,
        calls: &[PlannedCall],
        cut: Option<&str>,
        cancel: &CancellationToken,
    ) -> Result<Dispatched> {
        let policy = Policy::new(rec.options.functions.as_ref());
        let turn_id = rec.turn_id.clone();
        // A submitted result is taken after the other calls of its message have run.
        let submits = |c: &&PlannedCall| c.function_id == crate::output::SUBMIT_RESULT;
        let ordered = calls
            .iter()
            .filter(|c| !submits(c))
            .chain(calls.iter().filter(submits));
        for call in ordered {
            match rec.calls.get(&call.id).map(CallCheckpoint::state) {
                Some(CallState::Done) | Some(CallState::Pending) => continue,
                Some(CallState::Triggered) => {
                    self.close_interrupted(rec, call).await?;
                    continue;
                }
                None => {}
            }
            if cancel.is_cancelled() {
                return Ok(Dispatched::Cancelled);
            }
            if call.function_id == crate::output::SUBMIT_RESULT
                && crate::output::json_contract(&rec.options.output).is_some()
                && !degraded(&call.arguments)
                && cut.is_none()
            {
                // The contract's own tool: answered here, never dispatched.
                self.answer_submit(rec, call).await?;
                continue;
            }
            if call.function_id == tools::AGENT_TRIGGER {
                let text = "agent_trigger needs a target: call it as {\"function\": \"<function id>\", \"description\": \"…\", \"payload\": {…}}";
                self.close_call(
                    rec,
                    call,
                    Closing::refusal(call, &turn_id, Refusal::AgentTriggerNoTarget, text.into()),
                )
                .await?;
                continue;
            }
            if degraded(&call.arguments) || cut.is_some() {
                // A call that arrived whole but does not parse is malformed, not cut short.
                let text = if cut.is_none() && call.arguments.get("_raw").is_some() {
                    format!("function {} was not run: its arguments are not valid JSON (a string with a raw line break or tab, an unclosed quote, ...); send the call again as one JSON object", call.function_id)
                } else {
                    let why = cut.unwrap_or("the stream broke mid-call");
                    format!("function {} was not run: its arguments were cut short ({why}); send the complete call again", call.function_id)
                };
                self.close_call(
                    rec,
                    call,
                    Closing::refusal(call, &turn_id, Refusal::DegradedArguments, text),
                )
                .await?;
                continue;
            }
            if let Some(text) = self.walled(rec, &call.function_id, &call.arguments).await? {
                self.close_call(
                    rec,
                    call,
                    Closing::refusal(call, &turn_id, Refusal::ControlPlane, text),
                )
                .await?;
                continue;
            }
            if let Err(text) = provenance::check(&call.function_id, &call.arguments) {
                self.close_call(
                    rec,
                    call,
                    Closing::refusal(call, &turn_id, Refusal::ForbiddenEntry, text),
                )
                .await?;
                continue;
            }
            if !policy.allows(&call.function_id) {
                let text = policy_refusal(&call.function_id);
                self.close_call(
                    rec,
                    call,
                    Closing::refusal(call, &turn_id, Refusal::PolicyDenied, text),
                )
                .await?;
                continue;
            }
            let key = breaker::key(&call.function_id, &call.arguments);
            if breaker::tripped(&rec.failed_calls, &key) {
                let text = format!(
                    "function {} already failed twice with these exact arguments and the same error; it was not run again. \
                     Change the arguments or the approach.",
                    call.function_id
                );
                let mut c = Closing::refusal(call, &turn_id, Refusal::RepeatedFailure, text);
                c.details["count"] = json!(breaker::TRIP_AFTER);
                self.close_call(rec, call, c).await?;
                continue;
            }
            let (arguments, changes) = self.reconcile(call).await;
            if call.function_id == crate::ask::ASK {
                // Answered here: never dispatched, and no hook is consulted.
                self.answer_ask(rec, call, &arguments, &key).await?;
                continue;
            }
            let run = Run {
                arguments,
                changes,
                annotations: Map::new(),
                breaker_key: key,
                after: None,
                grants: Vec::new(),
            };
            if self.run_call(rec, call, run, cancel).await? == CallEnd::Cancelled {
                return Ok(Dispatched::Cancelled);
            }
        }
        Ok(Dispatched::All)
    }
}

impl Harness {
    /// From the pre-trigger chain to the appended result: the part of the pipeline a released
    /// call runs too.
    pub(crate) async fn run_call(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        run: Run,
        cancel: &CancellationToken,
    ) -> Result<CallEnd> {
        let turn_id = rec.turn_id.clone();
        let Run {
            arguments,
            changes,
            mut annotations,
            breaker_key,
            after,
            grants: released,
        } = run;
        // The turn's root and the session's grants (read now: a revoke holds from the next
        // call), over whatever the model wrote (§4.10); again after the hooks below.
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
        let mut arguments = arguments;
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
                after.as_deref(),
            )
            .await?;
        annotations.extend(chain.annotations);
        let mut arguments = chain.payload["call"]["arguments"].clone();
        crate::fsroot::stamp(
            &call.function_id,
            &mut arguments,
            rec.options.filesystem.as_ref(),
            &grants,
        );
        let reconciled =
            (!changes.is_empty()).then(|| serde_json::to_value(&changes).unwrap_or(Value::Null));
        match chain.decision {
            Decision::Deny(reason) => {
                let mut c = Closing::refusal(
                    call,
                    &turn_id,
                    Refusal::HookDenied,
                    format!(
                        "function {} was denied by a hook: {reason}",
                        call.function_id
                    ),
                );
                c.details["message"] = json!(reason);
                c.origin = origin(&turn_id, &annotations, reconciled.as_ref());
                self.close_call(rec, call, c).await?;
                return Ok(CallEnd::Closed);
            }
            Decision::Hold(holder) => {
                let hold = Hold {
                    holder,
                    point: HookPoint::PreTrigger,
                    arguments,
                    result: None,
                    reconciled,
                    annotations,
                    breaker_key,
                };
                return self.park_call(rec, call, hold).await;
            }
            Decision::Continue => {}
        }

        if call.function_id == crate::spawn::SPAWN {
            // No target: the loop starts the child itself.
            let origin = origin(&turn_id, &annotations, reconciled.as_ref());
            return self.spawn_from_call(rec, call, arguments, origin).await;
        }

        // Reconciliation and hooks may have changed the arguments since the check at dispatch (a
        // released hold was never checked with its final arguments): check what will run.
        let unchanged = after.is_none() && arguments == call.arguments;
        if !unchanged {
            let refused = match self.walled(rec, &call.function_id, &arguments).await? {
                Some(text) => Some((Refusal::ControlPlane, text)),
                None => provenance::check(&call.function_id, &arguments)
                    .err()
                    .map(|text| (Refusal::ForbiddenEntry, text)),
            };
            if let Some((why, text)) = refused {
                let mut c = Closing::refusal(call, &turn_id, why, text);
                c.origin = origin(&turn_id, &annotations, reconciled.as_ref());
                self.close_call(rec, call, c).await?;
                return Ok(CallEnd::Closed);
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

        // Checkpoint before the side effect, durably: after a crash this call never runs again.
        let cp = CallCheckpoint::Triggered {
            function_id: call.function_id.clone(),
            breaker_key: Some(breaker_key.clone()),
        };
        rec.calls.insert(call.id.clone(), cp);
        self.save_record(rec).await?;
        self.barrier().await?;
        failpoint::hit("after_call_triggered");
        let metadata =
            json!({"function_call_id": call.id, "session_id": rec.session_id, "turn_id": turn_id});
        let invoke = self.inner.bus.call_with_metadata(
            &call.function_id,
            arguments.clone(),
            Some(Duration::from_millis(self.config().dispatch_timeout_ms)),
            metadata,
        );
        let outcome = tokio::select! {
            outcome = invoke => Some(outcome),
            _ = cancel.cancelled() => None,
        };
        failpoint::hit("after_call_target");
        let Some(outcome) = outcome else {
            let text = format!(
                "function {} was cancelled by a stop while it ran; the target may still be running and its effects are unknown, not undone",
                call.function_id
            );
            self.close_call(
                rec,
                call,
                Closing::refusal(call, &turn_id, Refusal::Cancelled, text),
            )
            .await?;
            return Ok(CallEnd::Cancelled);
        };
        let policy = Policy::new(rec.options.functions.as_ref());
        let (content, details, is_error) = match outcome {
            Ok(value) => {
                let value = self
                    .filter_discovery(&call.function_id, &policy, value)
                    .await;
                let (content, is_error) = normalize(&value);
                (content, value, is_error)
            }
            Err(e) => (
                vec![ContentBlock::text(e.to_string())],
                json!({"error": {"code": e.code, "message": e.message}}),
                true,
            ),
        };
        breaker::record(
            &mut rec.failed_calls,
            &breaker_key,
            is_error,
            &serde_json::to_string(&content).unwrap_or_default(),
        );

        // post-trigger: may rewrite the result, or hold it for a decision.
        let mut payload = hooks::envelope(
            HookPoint::PostTrigger,
            &rec.session_id,
            &turn_id,
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
        annotations.extend(chain.annotations);
        let result = &chain.payload["result"];
        let mut content: Vec<ContentBlock> =
            serde_json::from_value(result["content"].clone()).unwrap_or(content);
        let mut details = result["details"].clone();
        let is_error = result["is_error"].as_bool().unwrap_or(is_error);

        if !changes.is_empty() {
            let fresh: Vec<String> = changes
                .iter()
                .map(|c| format!("{}{}", call.function_id, c.path))
                .filter(|k| !rec.noted_repairs.contains(k))
                .collect();
            if !fresh.is_empty() && !call.function_id.starts_with("engine::functions::") {
                if let Some(text) = reconcile::note(&changes) {
                    content.push(ContentBlock::text(text));
                }
                rec.noted_repairs.extend(fresh);
            }
        }
        if is_error {
            if let Some(note) = self.diagnosis(rec, &call.function_id, &arguments).await {
                content.push(ContentBlock::text(note));
            }
        }
        if let Some((c, d)) = cap::cap(self.config().max_result_bytes, &content, &details) {
            content = c;
            details = d;
        }
        if let Decision::Hold(holder) = chain.decision {
            // The target ran; the result waits for the holder's decision and is appended on
            // release, never produced by a second run.
            let result =
                Some(json!({"content": content, "details": details, "is_error": is_error}));
            let hold = Hold {
                holder,
                point: HookPoint::PostTrigger,
                arguments,
                result,
                reconciled,
                annotations,
                breaker_key,
            };
            return self.park_call(rec, call, hold).await;
        }
        let origin = origin(&turn_id, &annotations, reconciled.as_ref());
        self.append_result(rec, call, content, details, is_error, origin)
            .await?;
        Ok(CallEnd::Closed)
    }
}

impl Harness {
    /// `submit_result`: validates the value; the result says whether it was recorded, and the
    /// step's end checks it against the contract (accept, nudge or fail).
    async fn answer_submit(&self, rec: &mut TurnRecord, call: &PlannedCall) -> Result<()> {
        let turn_id = rec.turn_id.clone();
        let schema = crate::output::json_contract(&rec.options.output).flatten();
        let error = crate::output::validate(schema, &call.arguments).err();
        rec.submitted = Some(crate::output::Submitted {
            step: rec.step,
            value: call.arguments.clone(),
            error: error.clone(),
        });
        let closing = match error {
            None => Closing {
                content: vec![ContentBlock::text("result recorded")],
                details: json!({"recorded": true}),
                is_error: false,
                origin: json!({"turn_id": turn_id}),
            },
            Some(e) => {
                let mut c = Closing::refusal(call, &turn_id, Refusal::InvalidResult, e);
                c.details["recorded"] = json!(false);
                c
            }
        };
        self.close_call(rec, call, closing).await
    }

    /// For a failed call whose arguments still break the target's schema (repair could not fix
    /// them): one note naming the fields and what they expect, once per turn and call pattern.
    async fn diagnosis(
        &self,
        rec: &mut TurnRecord,
        function_id: &str,
        arguments: &Value,
    ) -> Option<String> {
        let schema = self.request_schema(function_id).await?;
        // The stamped `fs_scope` is the loop's, not the model's: it is no field to fix.
        let mut arguments = arguments.clone();
        crate::fsroot::stamp(function_id, &mut arguments, None, &[]);
        let lines = reconcile::diagnose(&schema, &arguments);
        if lines.is_empty() {
            return None;
        }
        let key = format!("diagnosis:{function_id}:{}", lines.join("|"));
        if rec.noted_repairs.contains(&key) {
            return None;
        }
        rec.noted_repairs.push(key);
        Some(format!(
            "[harness] The arguments of {function_id} do not match its schema: {}. Fix these fields before calling it again.",
            lines.join("; ")
        ))
    }

    /// `harness::ask`: refused without a human to answer, twice in a step, or with arguments
    /// that break its limits; accepted, its card is the result and the turn ends on it.
    async fn answer_ask(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        arguments: &Value,
        breaker_key: &str,
    ) -> Result<()> {
        let turn_id = rec.turn_id.clone();
        let no_human = rec.depth > 0
            || matches!(
                rec.options.output,
                harness_types::api::OutputContract::Json { .. }
            );
        let checked = if no_human {
            Err(crate::ask::NO_HUMAN.to_string())
        } else if rec.ask_step == Some(rec.step) {
            Err(crate::ask::ONE_PER_STEP.to_string())
        } else {
            crate::ask::parse(arguments)
        };
        let closing = match checked {
            Err(text) => {
                breaker::record(&mut rec.failed_calls, breaker_key, true, &text);
                // The seed's shape: an error result with null details.
                Closing {
                    content: vec![ContentBlock::text(text)],
                    details: Value::Null,
                    is_error: true,
                    origin: json!({"turn_id": turn_id}),
                }
            }
            Ok(req) => {
                rec.ask_step = Some(rec.step);
                let question_id = call.id.clone();
                Closing {
                    content: vec![ContentBlock::text(crate::ask::SHOWN)],
                    details: crate::ask::card(&req, &question_id, &rec.session_id, &turn_id),
                    is_error: false,
                    origin: json!({"turn_id": turn_id}),
                }
            }
        };
        self.close_call(rec, call, closing).await
    }

    /// The wall's refusal of a model's call, if it stops it (see `wall.rs`).
    pub(crate) async fn walled(
        &self,
        rec: &TurnRecord,
        function_id: &str,
        arguments: &Value,
    ) -> Result<Option<String>> {
        let reach = match wall::check(rec.options.functions.as_ref(), function_id, arguments) {
            Err(text) => return Ok(Some(text)),
            Ok(reach) => reach,
        };
        if self.generates(function_id).await {
            return Ok(Some(wall::generates_refusal(function_id)));
        }
        match reach {
            wall::Reach::Free => Ok(None),
            wall::Reach::Binding(target) => Ok(self.generates(&target).await.then(|| {
                wall::refusal(
                    function_id,
                    &format!(
                        "a binding may not call '{target}', which takes a model or a provider"
                    ),
                )
            })),
            wall::Reach::Session(target) => {
                if self.in_tree(&rec.session_id, &target).await? {
                    Ok(None)
                } else {
                    Ok(Some(wall::refusal(
                        function_id,
                        &format!("session '{target}' is outside this agent's own tree"),
                    )))
                }
            }
        }
    }

    /// Whether the registry says `function_id` takes a model (see `wall::takes_a_model`).
    async fn generates(&self, function_id: &str) -> bool {
        if wall::READS_MODELS.contains(&function_id) {
            return false;
        }
        let schema = self.request_schema(function_id).await;
        wall::takes_a_model(function_id, schema.as_ref())
    }

    /// Whether `target` is `root` or one of its descendants (sub-agents, recursively), read from
    /// the sessions' parent links.
    async fn in_tree(&self, root: &str, target: &str) -> Result<bool> {
        let mut current = target.to_string();
        // Deeper than any depth budget: a cycle or a forged chain ends the walk as "outside".
        for _ in 0..32 {
            if current == root {
                return Ok(true);
            }
            let found: Option<harness_types::session::GetResponse> = self
                .call("session::get", &json!({"session_id": current}))
                .await?;
            let parent = found.and_then(|f| {
                f.meta
                    .metadata
                    .get("parent_session_id")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            });
            match parent {
                Some(p) => current = p,
                None => return Ok(false),
            }
        }
        Ok(false)
    }
}

/// A hook's hold on a call, as checkpointed.
struct Hold {
    holder: String,
    point: HookPoint,
    arguments: Value,
    /// Post-trigger holds keep the target's result.
    result: Option<Value>,
    reconciled: Option<Value>,
    annotations: Map<String, Value>,
    breaker_key: String,
}

impl Harness {
    /// Checkpoints a held call `pending`; the turn parks once its other calls are closed.
    async fn park_call(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        hold: Hold,
    ) -> Result<CallEnd> {
        let point = match hold.point {
            HookPoint::PostTrigger => HoldPoint::PostTrigger,
            _ => HoldPoint::PreTrigger,
        };
        let cp = CallCheckpoint::Pending {
            function_id: call.function_id.clone(),
            since: Some(now_ms()),
            timeout_ms: None,
            wait: Wait::Hold(Box::new(crate::record::Hold {
                holder: hold.holder,
                point,
                arguments: hold.arguments,
                result: hold.result,
                reconciled: hold.reconciled,
                annotations: Some(Value::Object(hold.annotations)),
                breaker_key: Some(hold.breaker_key),
            })),
        };
        rec.calls.insert(call.id.clone(), cp);
        self.save_record(rec).await?;
        Ok(CallEnd::Held)
    }
}

/// A result entry's origin: the turn, hook annotations, repairs.
pub(crate) fn origin(
    turn_id: &str,
    annotations: &Map<String, Value>,
    reconciled: Option<&Value>,
) -> Value {
    let mut o = Map::new();
    o.extend(annotations.clone());
    o.insert("turn_id".into(), json!(turn_id));
    if let Some(r) = reconciled {
        o.insert("reconciled".into(), r.clone());
    }
    Value::Object(o)
}

/// A call's result entry, with its checkpoint marked done in memory (the caller writes the
/// entry before or with the record).
fn closing_entry(rec: &mut TurnRecord, call: &PlannedCall, c: Closing) -> AppendRequest {
    let entry_id = ids::call_result_entry(&rec.turn_id, &call.id);
    // A spawn's child stays known (status, the stop cascade, the fan-out count).
    let child = rec.calls.get(&call.id).and_then(|c| c.child().cloned());
    rec.calls.insert(
        call.id.clone(),
        CallCheckpoint::Done {
            function_id: call.function_id.clone(),
            entry_id: Some(entry_id.clone()),
            child,
        },
    );
    AppendRequest {
        session_id: rec.session_id.clone(),
        message: Some(AgentMessage::FunctionResult(FunctionResultMessage {
            function_call_id: call.id.clone(),
            function_id: call.function_id.clone(),
            content: c.content,
            details: c.details,
            is_error: c.is_error,
            timestamp: now_ms(),
        })),
        custom: None,
        entry_id: Some(entry_id),
        origin: Some(c.origin),
    }
}

#[cfg(test)]
mod tests;
