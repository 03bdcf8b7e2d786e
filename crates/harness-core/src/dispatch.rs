//! Closing the function calls of a step, at most once each.
//!
//! Per call, in content order: a checkpoint already `done` is skipped; one found `triggered`
//! (the process died while the target ran) is never run again and gets the "interrupted" error
//! result; degraded arguments are refused; the fail-closed policy is applied; otherwise the call
//! is checkpointed `triggered` durably, the target runs, and its result is appended under the
//! call's deterministic entry id before the checkpoint becomes `done`.

use std::time::{Duration, Instant};

use globset::{Glob, GlobSet, GlobSetBuilder};
use harness_types::api::FunctionPolicy;
use harness_types::message::{AgentMessage, ContentBlock, FunctionResultMessage};
use harness_types::session::AppendRequest;
use harness_types::{ids, now_ms};
use serde_json::{json, Value};

use crate::harness::{Harness, Result};
use crate::record::{CallCheckpoint, CallState, TurnRecord};

/// A compiled dispatch policy. Absent, an empty allow list, or any invalid glob deny everything;
/// a deny match beats an allow match; `*` spans `::`.
pub(crate) struct Policy {
    allow: Option<GlobSet>,
    deny: Option<GlobSet>,
}

fn compile(globs: &[String]) -> Option<GlobSet> {
    let mut b = GlobSetBuilder::new();
    for g in globs {
        b.add(Glob::new(g).ok()?);
    }
    b.build().ok()
}

impl Policy {
    pub(crate) fn new(p: Option<&FunctionPolicy>) -> Policy {
        let deny_all = Policy {
            allow: None,
            deny: None,
        };
        let Some(p) = p else { return deny_all };
        if p.allow.is_empty() {
            return deny_all;
        }
        match (compile(&p.allow), compile(&p.deny)) {
            (Some(allow), Some(deny)) => Policy {
                allow: Some(allow),
                deny: Some(deny),
            },
            _ => deny_all,
        }
    }

    pub(crate) fn allows(&self, function_id: &str) -> bool {
        match (&self.allow, &self.deny) {
            (Some(allow), Some(deny)) => allow.is_match(function_id) && !deny.is_match(function_id),
            _ => false,
        }
    }
}

/// One call as the model wrote it, unwrapped from `agent_trigger` when needed.
pub(crate) struct PlannedCall {
    pub id: String,
    pub function_id: String,
    pub arguments: Value,
}

pub(crate) fn plan_calls(content: &[ContentBlock]) -> Vec<PlannedCall> {
    content
        .iter()
        .filter_map(|b| match b {
            ContentBlock::FunctionCall {
                id,
                function_id,
                arguments,
            } => Some(unwrap_call(id, function_id, arguments)),
            _ => None,
        })
        .collect()
}

fn unwrap_call(id: &str, function_id: &str, arguments: &Value) -> PlannedCall {
    if function_id != "agent_trigger" {
        return PlannedCall {
            id: id.into(),
            function_id: function_id.into(),
            arguments: arguments.clone(),
        };
    }
    let target = arguments
        .get("function")
        .and_then(Value::as_str)
        .unwrap_or("agent_trigger");
    let mut payload = match arguments.get("payload") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .unwrap_or(json!({})),
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
    }
}

fn degraded(arguments: &Value) -> bool {
    match arguments.as_object() {
        Some(obj) => obj.contains_key("_partial") || obj.contains_key("_raw"),
        None => true,
    }
}

/// §4.11: a JSON string → one text block; an object with a content block array → those blocks;
/// anything else → its compact JSON. `is_error` comes from the value.
fn normalize(value: &Value) -> (Vec<ContentBlock>, bool) {
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

impl Harness {
    async fn close_call(
        &self,
        rec: &mut TurnRecord,
        call: &PlannedCall,
        content: Vec<ContentBlock>,
        details: Value,
        is_error: bool,
    ) -> Result<()> {
        let entry_id = ids::call_result_entry(&rec.turn_id, &call.id);
        self.append(AppendRequest {
            session_id: rec.session_id.clone(),
            message: Some(AgentMessage::FunctionResult(FunctionResultMessage {
                function_call_id: call.id.clone(),
                function_id: call.function_id.clone(),
                content,
                details,
                is_error,
                timestamp: now_ms(),
            })),
            custom: None,
            entry_id: Some(entry_id.clone()),
            origin: Some(json!({"turn_id": rec.turn_id})),
        })
        .await?;
        rec.calls.insert(
            call.id.clone(),
            CallCheckpoint {
                state: CallState::Done,
                function_id: Some(call.function_id.clone()),
                entry_id: Some(entry_id),
            },
        );
        self.save_record(rec).await
    }

    fn refuse(text: String, error: &str, call: &PlannedCall) -> (Vec<ContentBlock>, Value) {
        (
            vec![ContentBlock::text(text.clone())],
            json!({"error": error, "function_id": call.function_id, "message": text}),
        )
    }

    /// Runs the calls of one assistant message. `cut` names why the message's calls cannot be
    /// trusted (`length`, a broken stream) when it was cut short.
    pub(crate) async fn dispatch_calls(
        &self,
        rec: &mut TurnRecord,
        calls: &[PlannedCall],
        cut: Option<&str>,
    ) -> Result<()> {
        let policy = Policy::new(rec.options.functions.as_ref());
        for call in calls {
            match rec.calls.get(&call.id).map(|c| c.state) {
                Some(CallState::Done) | Some(CallState::Pending) => continue,
                Some(CallState::Triggered) => {
                    let text = "interrupted: executed at most once, result unknown (restart during execution); \
                                verify its effect before repeating it"
                        .to_string();
                    let (content, details) = Self::refuse(text, "interrupted", call);
                    self.close_call(rec, call, content, details, true).await?;
                    continue;
                }
                None => {}
            }
            if call.function_id == "agent_trigger" {
                let (content, details) = Self::refuse(
                    "agent_trigger needs a target: call it as {\"function\": \"<function id>\", \"payload\": {…}}".into(),
                    "agent_trigger_no_target",
                    call,
                );
                self.close_call(rec, call, content, details, true).await?;
                continue;
            }
            if degraded(&call.arguments) || cut.is_some() {
                let why = cut.unwrap_or("the stream broke");
                let (content, details) = Self::refuse(
                    format!("function {} was not run: its arguments were cut short ({why}); send the call again complete", call.function_id),
                    "degraded_arguments",
                    call,
                );
                self.close_call(rec, call, content, details, true).await?;
                continue;
            }
            if !policy.allows(&call.function_id) {
                let (content, details) = Self::refuse(
                    format!(
                        "function {} is not permitted by this agent's dispatch policy (no allow-glob match or a deny-glob match)",
                        call.function_id
                    ),
                    "policy_denied",
                    call,
                );
                self.close_call(rec, call, content, details, true).await?;
                continue;
            }
            // Checkpoint before the side effect, durably: after a crash this call is never run again.
            rec.calls.insert(
                call.id.clone(),
                CallCheckpoint {
                    state: CallState::Triggered,
                    function_id: Some(call.function_id.clone()),
                    entry_id: None,
                },
            );
            self.save_record(rec).await?;
            self.barrier().await?;
            let started = Instant::now();
            let outcome = self
                .inner
                .bus
                .call(
                    &call.function_id,
                    call.arguments.clone(),
                    Some(Duration::from_millis(self.inner.config.dispatch_timeout_ms)),
                )
                .await;
            let (content, details, is_error) = match outcome {
                Ok(value) => {
                    let (content, is_error) = normalize(&value);
                    (content, value, is_error)
                }
                Err(e) => (
                    vec![ContentBlock::text(e.to_string())],
                    json!({"error": {"code": e.code, "message": e.message}}),
                    true,
                ),
            };
            tracing::debug!(call = %call.id, function = %call.function_id, ms = started.elapsed().as_millis() as u64, "call finished");
            self.close_call(rec, call, content, details, is_error)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy::new(Some(&FunctionPolicy {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }))
    }

    #[test]
    fn policy_truth_table() {
        assert!(!Policy::new(None).allows("a::b"));
        assert!(!policy(&[], &[]).allows("a::b"));
        assert!(policy(&["*"], &[]).allows("shell::fs::read"));
        assert!(policy(&["shell::*"], &[]).allows("shell::fs::read"));
        assert!(!policy(&["shell::*"], &[]).allows("fs::read"));
        assert!(!policy(&["shell::*"], &["shell::fs::*"]).allows("shell::fs::read"));
        assert!(!policy(&["shell::*", "[bad"], &[]).allows("shell::x"));
    }

    #[test]
    fn agent_trigger_unwraps_string_payloads_and_hoists_keys() {
        let c = unwrap_call(
            "c",
            "agent_trigger",
            &json!({"function": "a::b", "payload": "{\"x\": 1}"}),
        );
        assert_eq!(
            (c.function_id.as_str(), c.arguments.clone()),
            ("a::b", json!({"x": 1}))
        );
        let c = unwrap_call(
            "c",
            "agent_trigger",
            &json!({"function": "a::b", "description": "d", "x": 2}),
        );
        assert_eq!(c.arguments, json!({"x": 2}));
        let c = unwrap_call(
            "c",
            "agent_trigger",
            &json!({"function": "a::b", "payload": {}, "_partial": true}),
        );
        assert!(degraded(&c.arguments));
    }

    #[test]
    fn normalization() {
        assert_eq!(normalize(&json!("hi")).0, vec![ContentBlock::text("hi")]);
        let (c, e) =
            normalize(&json!({"content": [{"type": "text", "text": "x"}], "is_error": true}));
        assert_eq!((c, e), (vec![ContentBlock::text("x")], true));
        assert_eq!(
            normalize(&json!({"a": 1})).0,
            vec![ContentBlock::text("{\"a\":1}")]
        );
    }
}
