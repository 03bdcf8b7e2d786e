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
mod run;
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
pub(crate) use run::{illegal as illegal_call, Flight};

/// The function whose call starts a sub-agent instead of reaching a target (`spawn.rs` starts
/// it); here so that dispatch and spawn do not import each other.
pub(crate) const SPAWN: &str = "harness::spawn";

use crate::config::CallReconciliation;
use crate::failpoint;
use crate::harness::{Harness, Result};
use crate::record::{CallCheckpoint, HoldPoint, TurnRecord, Wait};
use crate::texts;
use harness_machine::call::{self, CallEffect, CallInput, CallPhase};

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

/// A target's answer as a call result: content, details, whether it is an error. A failed
/// bus call is an error result naming the bus's code and message (the model reads it).
pub(crate) fn answered(
    outcome: std::result::Result<Value, harness_bus::BusError>,
) -> (Vec<ContentBlock>, Value, bool) {
    match outcome {
        Ok(value) => {
            let (content, is_error) = normalize(&value);
            (content, value, is_error)
        }
        Err(e) => (
            vec![ContentBlock::text(e.to_string())],
            json!({"error": {"code": e.code, "message": e.message}}),
            true,
        ),
    }
}

pub use harness_machine::call::Refusal;

/// What a model reads when the policy refuses its call.
pub(crate) fn policy_refusal(function_id: &str) -> String {
    texts::policy_denied(function_id)
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
    /// The stop signal ended the step's dispatch.
    Cancelled,
    /// Already closed or parked: left as it was.
    Skipped,
    /// A resolve found nothing it could settle.
    NotResolved,
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
    /// Closes a call that recovery found `triggered`, as the call machine says.
    pub(crate) async fn close_interrupted(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
    ) -> Result<()> {
        let phase = CallPhase::of(rec.calls.get(&call.id));
        let mut flight = Flight::new(call, None);
        let never = CancellationToken::new();
        self.drive_call(rec, &mut flight, phase, CallInput::Recover, &never)
            .await
            .map(drop)
    }

    /// The interrupted result of a call found `triggered`: it may have run, once; it never runs
    /// again.
    async fn interrupted(&self, rec: &mut TurnRecord, call: &PlannedCall) -> Result<()> {
        let text = texts::CALL_INTERRUPTED_BY_RESTART;
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
        // Every call is put to the machine: it closes what is open and leaves what is done.
        let open: Vec<(String, CallCheckpoint)> = rec
            .calls
            .iter()
            .map(|(id, c)| (id.clone(), c.clone()))
            .collect();
        let mut closing = Vec::new();
        let stops = |phase: CallPhase| -> Result<bool> {
            let t = call::next(phase, CallInput::Stop).map_err(run::illegal)?;
            Ok(t.effects
                .contains(&CallEffect::Close(call::Closing::Cancelled)))
        };
        for (id, cp) in open {
            if !stops(CallPhase::of(Some(&cp)))? {
                continue;
            }
            let f = cp.function_id().to_string();
            let text = match &cp {
                CallCheckpoint::Triggered { .. } => texts::cancelled_while_running(&f),
                CallCheckpoint::Pending {
                    wait: Wait::Hold(h),
                    ..
                } if h.point == HoldPoint::PostTrigger => texts::stopped_with_result_held(&f),
                CallCheckpoint::Pending {
                    wait: Wait::Hold(h),
                    ..
                } => texts::stopped_while_held(&f, &h.holder),
                CallCheckpoint::Pending {
                    wait: Wait::Child { child, .. },
                    ..
                } => texts::child_stopped_with_turn(&child.session_id),
                CallCheckpoint::Pending { .. } | CallCheckpoint::Done { .. } => {
                    texts::stopped_before_delivery(&f)
                }
            };
            closing.push((id, f, text));
        }
        for c in unreached {
            if !stops(CallPhase::Planned)? {
                continue;
            }
            let text = texts::stopped_before_run(&c.function_id);
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
        // A submitted result is taken after the other calls of its message have run.
        let submits = |c: &&PlannedCall| c.function_id == crate::output::SUBMIT_RESULT;
        let ordered = calls
            .iter()
            .filter(|c| !submits(c))
            .chain(calls.iter().filter(submits));
        for call in ordered {
            let phase = CallPhase::of(rec.calls.get(&call.id));
            let reached = CallInput::Reached {
                stopped: cancel.is_cancelled(),
            };
            let mut flight = Flight::new(call, cut);
            if self
                .drive_call(rec, &mut flight, phase, reached, cancel)
                .await?
                == CallEnd::Cancelled
            {
                return Ok(Dispatched::Cancelled);
            }
        }
        Ok(Dispatched::All)
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
        Some(texts::arguments_mismatch(function_id, &lines.join("; ")))
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
            Err(texts::ASK_NO_HUMAN.to_string())
        } else if rec.ask_step == Some(rec.step) {
            Err(texts::ASK_ONE_PER_STEP.to_string())
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
                    content: vec![ContentBlock::text(texts::ASK_SHOWN)],
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
