//! Hooks: synchronous functions bound to the loop's five hook points.
//!
//! A binding's config is `{functions?, priority?, timeout_ms?, on_error?}` (unknown fields are
//! rejected at registration). A point's chain runs in ascending priority, then function id; each
//! hook sees the payload as the previous one left it; the first deny or hold ends the chain. A
//! failing or slow hook is a deny (`fail_closed`, the default before something happens) or is
//! skipped (`fail_open`, the default after). A `pre-generate` binding whose metadata carries
//! `inject_prompt` appends that text to the system prompt without calling anything.

use std::time::Duration;

use globset::{Glob, GlobSetBuilder};
use harness_bus::{Binding, TriggerTypeDef};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};

use crate::harness::{Harness, Result};

/// Hook timeouts get this much extra before the loop stops waiting, whatever the callee does.
const HARD_BOUND_EXTRA: Duration = Duration::from_millis(1000);
const DEFAULT_TIMEOUT_MS: u64 = 5000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookPoint {
    PreTurn,
    PreGenerate,
    PostGenerate,
    PreTrigger,
    PostTrigger,
    PostTurn,
}

impl HookPoint {
    pub const ALL: [HookPoint; 6] = [
        HookPoint::PreTurn,
        HookPoint::PreGenerate,
        HookPoint::PostGenerate,
        HookPoint::PreTrigger,
        HookPoint::PostTrigger,
        HookPoint::PostTurn,
    ];

    /// The trigger type id bindings are made for.
    pub fn trigger_type(self) -> &'static str {
        match self {
            HookPoint::PreTurn => "harness::hook::pre-turn",
            HookPoint::PreGenerate => "harness::hook::pre-generate",
            HookPoint::PostGenerate => "harness::hook::post-generate",
            HookPoint::PreTrigger => "harness::hook::pre-trigger",
            HookPoint::PostTrigger => "harness::hook::post-trigger",
            HookPoint::PostTurn => "harness::hook::post-turn",
        }
    }

    /// The `point` field of the hook's input.
    pub fn name(self) -> &'static str {
        match self {
            HookPoint::PreTurn => "pre_turn",
            HookPoint::PreGenerate => "pre_generate",
            HookPoint::PostGenerate => "post_generate",
            HookPoint::PreTrigger => "pre_trigger",
            HookPoint::PostTrigger => "post_trigger",
            HookPoint::PostTurn => "post_turn",
        }
    }

    fn description(self) -> &'static str {
        match self {
            HookPoint::PreTurn => "Synchronous hook: first step of a turn, before any model spend. May veto.",
            HookPoint::PreGenerate => "Synchronous hook: after context assembly, before generation. May extend the system prompt, append messages, or veto.",
            HookPoint::PostGenerate => "Synchronous hook: after the final assistant message update. Observe only.",
            HookPoint::PreTrigger => "Synchronous hook: after the allow/deny policy passes, before the target is invoked. May deny, hold, or rewrite arguments.",
            HookPoint::PostTrigger => "Synchronous hook: after the target returns, before the result is appended. May rewrite content/details/is_error, or hold.",
            HookPoint::PostTurn => "Synchronous hook: when a turn would complete, on its (contract-valid) result. A deny re-prompts the model under the validation budget (retry_prompt verbatim when the binding gives one).",
        }
    }

    /// Before something happens a broken hook must not let it through; after, it must not
    /// undo it.
    fn default_on_error(self) -> OnError {
        match self {
            // A post-turn hook is a gate on the result: broken, it must not wave it through.
            HookPoint::PreTurn
            | HookPoint::PreGenerate
            | HookPoint::PreTrigger
            | HookPoint::PostTurn => OnError::FailClosed,
            HookPoint::PostGenerate | HookPoint::PostTrigger => OnError::FailOpen,
        }
    }

    fn may_hold(self) -> bool {
        matches!(self, HookPoint::PreTrigger | HookPoint::PostTrigger)
    }

    fn may_deny(self) -> bool {
        matches!(
            self,
            HookPoint::PreTurn
                | HookPoint::PreGenerate
                | HookPoint::PreTrigger
                | HookPoint::PostTurn
        )
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    FailClosed,
    FailOpen,
}

/// The `config` of a `harness::hook::<point>` binding.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HookBindingConfig {
    /// Target globs (pre/post-trigger); absent or empty = every function.
    #[serde(default)]
    pub functions: Option<Vec<String>>,
    /// Lower runs first (default 0).
    #[serde(default)]
    pub priority: Option<i64>,
    /// Default 5000.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Default: fail_closed for pre-* and post-turn, fail_open for post-generate and post-trigger.
    #[serde(default)]
    pub on_error: Option<OnError>,
    /// Post-turn: the re-prompt after this hook denies, verbatim (`{reason}` and `{value}` are
    /// replaced); default: the validation nudge.
    #[serde(default)]
    pub retry_prompt: Option<String>,
}

pub(crate) fn trigger_types() -> Vec<TriggerTypeDef> {
    HookPoint::ALL
        .into_iter()
        .map(|p| TriggerTypeDef {
            id: p.trigger_type().into(),
            description: p.description().into(),
            config_schema: serde_json::to_value(schemars::schema_for!(HookBindingConfig))
                .unwrap_or(Value::Null),
            validate: Some(std::sync::Arc::new(|config: &Value| {
                let c: HookBindingConfig =
                    serde_json::from_value(config.clone()).map_err(|e| e.to_string())?;
                for g in c.functions.iter().flatten() {
                    Glob::new(g).map_err(|e| format!("functions: invalid glob '{g}': {e}"))?;
                }
                Ok(())
            })),
        })
        .collect()
}

/// One bound hook, ordered for its chain.
#[derive(Clone, Debug)]
pub(crate) struct Hook {
    pub function_id: String,
    pub priority: i64,
    pub timeout: Duration,
    pub on_error: OnError,
    functions: Option<Vec<String>>,
    pub inject_prompt: Option<String>,
    pub retry_prompt: Option<String>,
}

impl Hook {
    fn from_binding(point: HookPoint, b: &Binding) -> Option<Hook> {
        let c: HookBindingConfig = serde_json::from_value(b.config.clone()).ok()?;
        Some(Hook {
            function_id: b.function_id.clone(),
            priority: c.priority.unwrap_or(0),
            timeout: Duration::from_millis(c.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS)),
            on_error: c.on_error.unwrap_or(point.default_on_error()),
            functions: c.functions.filter(|f| !f.is_empty()),
            retry_prompt: c.retry_prompt,
            inject_prompt: b
                .metadata
                .get("inject_prompt")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    fn applies_to(&self, function_id: Option<&str>) -> bool {
        let (Some(globs), Some(id)) = (&self.functions, function_id) else {
            return true;
        };
        let mut b = GlobSetBuilder::new();
        for g in globs {
            match Glob::new(g) {
                Ok(g) => {
                    b.add(g);
                }
                Err(_) => return false,
            }
        }
        b.build().is_ok_and(|set| set.is_match(id))
    }

    /// The chain position; a release resumes strictly after the holder's.
    pub(crate) fn order_key(&self) -> (i64, &str) {
        (self.priority, &self.function_id)
    }
}

/// What a chain decided.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Decision {
    Continue,
    Deny(String),
    /// `holder` is the function id of the hook that held.
    Hold(String),
}

/// The result of running a chain: its decision, the payload as mutated, and the annotations.
#[derive(Clone, Debug)]
pub(crate) struct ChainOutcome {
    pub decision: Decision,
    pub payload: Value,
    pub annotations: Map<String, Value>,
    /// Static `inject_prompt` texts (pre-generate).
    pub injected: Vec<String>,
    /// The denying hook's `retry_prompt` (post-turn).
    pub retry_prompt: Option<String>,
}

/// What a hook may decide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
enum HookDecision {
    #[default]
    Continue,
    Deny,
    Hold,
}

/// A hook's answer: `null`, or `{decision?, reason?, mutations?, annotations?}`.
#[derive(Debug, Default, Deserialize)]
struct HookAnswer {
    #[serde(default)]
    decision: HookDecision,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    mutations: Option<Value>,
    #[serde(default)]
    annotations: Option<Map<String, Value>>,
}

impl HookAnswer {
    fn parse(hook: &str, v: Value) -> std::result::Result<HookAnswer, String> {
        if v.is_null() {
            return Ok(HookAnswer::default());
        }
        serde_json::from_value(v)
            .map_err(|e| crate::texts::hook_answer_invalid(hook, &e.to_string()))
    }
}

/// Applies one hook's `mutations` to the payload the next hook will see.
fn apply_mutations(point: HookPoint, payload: &mut Value, mutations: &Value) {
    let Some(m) = mutations.as_object() else {
        return;
    };
    match point {
        HookPoint::PreGenerate => {
            if let Some(p) = m.get("system_prompt").filter(|p| p.is_string()) {
                payload["generate"]["system_prompt"] = p.clone();
            }
            if let Some(extra) = m.get("append_messages").and_then(Value::as_array) {
                if let Some(list) = payload["generate"]["messages"].as_array_mut() {
                    list.extend(extra.iter().cloned());
                }
            }
        }
        HookPoint::PreTrigger => {
            if let Some(a) = m.get("arguments") {
                payload["call"]["arguments"] = a.clone();
            }
        }
        HookPoint::PostTrigger => {
            for key in ["content", "details", "is_error"] {
                if let Some(v) = m.get(key) {
                    payload["result"][key] = v.clone();
                }
            }
        }
        HookPoint::PreTurn | HookPoint::PostGenerate | HookPoint::PostTurn => {}
    }
}

impl Harness {
    /// The hooks bound to `point`, in chain order.
    pub(crate) async fn hooks(&self, point: HookPoint) -> Result<Vec<Hook>> {
        let bindings = self
            .inner
            .bus
            .bindings(point.trigger_type())
            .await
            .map_err(|e| e.into_harness())?;
        let mut hooks: Vec<Hook> = bindings
            .iter()
            .filter_map(|b| Hook::from_binding(point, b))
            .collect();
        hooks.sort_by(|a, b| a.order_key().cmp(&b.order_key()));
        Ok(hooks)
    }

    /// Runs the chain of `point` on `payload`. `after` resumes a released chain strictly after
    /// that hook (`None` = from the start); `function_id` filters trigger hooks by their globs.
    pub(crate) async fn run_hooks(
        &self,
        point: HookPoint,
        payload: Value,
        function_id: Option<&str>,
        after: Option<&str>,
    ) -> Result<ChainOutcome> {
        let hooks = self.hooks(point).await?;
        self.run_chain(point, &hooks, payload, function_id, after)
            .await
    }

    /// [`Harness::run_hooks`] over `hooks`, the chain of `point` its caller already read.
    pub(crate) async fn run_chain(
        &self,
        point: HookPoint,
        hooks: &[Hook],
        payload: Value,
        function_id: Option<&str>,
        after: Option<&str>,
    ) -> Result<ChainOutcome> {
        let start = match after {
            None => 0,
            Some(holder) => match hooks.iter().position(|h| h.function_id == holder) {
                Some(i) => i + 1,
                // The holder is no longer bound: nothing after it can be placed; run none.
                None => hooks.len(),
            },
        };
        let mut out = ChainOutcome {
            decision: Decision::Continue,
            payload,
            annotations: Map::new(),
            injected: vec![],
            retry_prompt: None,
        };
        for hook in hooks.iter().skip(start) {
            if !hook.applies_to(function_id) {
                continue;
            }
            if point == HookPoint::PreGenerate {
                if let Some(text) = &hook.inject_prompt {
                    out.injected.push(text.clone());
                    continue;
                }
            }
            let started = self.marking().then(crate::trace::now_us);
            let call = self.inner.bus.call(
                &hook.function_id,
                out.payload.clone(),
                Some(hook.timeout + HARD_BOUND_EXTRA),
            );
            let answer = match tokio::time::timeout(hook.timeout, call).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(crate::texts::hook_timed_out(hook.timeout.as_millis())),
            };
            // The hook's span (`crate::trace`), with what its answer decided.
            let mark = |decision: &'static str| {
                if let Some(start_us) = started {
                    self.mark_hook(
                        &out.payload,
                        crate::trace::HookFacts {
                            point: point.name(),
                            function_id: hook.function_id.clone(),
                            decision,
                            start_us,
                            end_us: crate::trace::now_us(),
                        },
                    );
                }
            };
            // A hook's answer is parsed strictly: an answer that is not a decision this loop
            // knows is a failure of that hook, handled by its `on_error` rule like any other.
            // Post-generate hooks only observe: what they answer is not read.
            let answer = match answer {
                Ok(_) if point == HookPoint::PostGenerate => {
                    mark("observed");
                    continue;
                }
                other => other.and_then(|v| HookAnswer::parse(&hook.function_id, v)),
            };
            let answer = match answer {
                Ok(a) => a,
                Err(why) => {
                    mark("failed");
                    match hook.on_error {
                        OnError::FailOpen => {
                            tracing::warn!(hook = %hook.function_id, point = point.name(), "hook failed, skipped (fail_open): {why}");
                            continue;
                        }
                        OnError::FailClosed => {
                            out.decision =
                                Decision::Deny(crate::texts::hook_failed(&hook.function_id, &why));
                            out.retry_prompt = hook.retry_prompt.clone();
                            return Ok(out);
                        }
                    }
                }
            };
            mark(match answer.decision {
                HookDecision::Deny if point.may_deny() => "deny",
                HookDecision::Hold if point.may_hold() => "hold",
                _ => "continue",
            });
            if let Some(notes) = answer.annotations {
                out.annotations.extend(notes);
            }
            if let Some(m) = &answer.mutations {
                // A holding hook's mutations apply too: the call is parked as it rewrote it.
                if answer.decision != HookDecision::Deny {
                    apply_mutations(point, &mut out.payload, m);
                }
            }
            match answer.decision {
                HookDecision::Deny if point.may_deny() => {
                    let reason = answer
                        .reason
                        .unwrap_or_else(|| crate::texts::HOOK_DENIED.into());
                    out.decision = Decision::Deny(reason);
                    out.retry_prompt = hook.retry_prompt.clone();
                    return Ok(out);
                }
                HookDecision::Hold if point.may_hold() => {
                    out.decision = Decision::Hold(hook.function_id.clone());
                    return Ok(out);
                }
                _ => {}
            }
        }
        Ok(out)
    }
}

/// The input envelope every hook receives.
pub(crate) fn envelope(
    point: HookPoint,
    session_id: &str,
    turn_id: &str,
    step: u64,
    depth: u32,
    metadata: Option<&Value>,
) -> Value {
    let mut v = json!({"point": point.name(), "session_id": session_id, "turn_id": turn_id, "step": step, "depth": depth});
    if let Some(m) = metadata {
        v["metadata"] = m.clone();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binding_configs_reject_unknown_fields_and_bad_values() {
        let validate = trigger_types()[0].validate.clone().unwrap();
        assert!(validate(&json!({})).is_ok());
        assert!(validate(&json!({"functions": ["shell::*"], "priority": -5, "timeout_ms": 100, "on_error": "fail_open"})).is_ok());
        assert!(validate(&json!({"priority": 1, "colour": "red"}))
            .unwrap_err()
            .contains("colour"));
        assert!(validate(&json!({"on_error": "sometimes"})).is_err());
        assert!(validate(&json!({"functions": ["[bad"]}))
            .unwrap_err()
            .contains("invalid glob"));
    }

    #[test]
    fn defaults_depend_on_the_point() {
        let b = |config: Value| Binding {
            id: "b".into(),
            trigger_type: String::new(),
            function_id: "h".into(),
            config,
            metadata: json!({}),
        };
        assert_eq!(
            Hook::from_binding(HookPoint::PreTrigger, &b(json!({})))
                .unwrap()
                .on_error,
            OnError::FailClosed
        );
        assert_eq!(
            Hook::from_binding(HookPoint::PostTrigger, &b(json!({})))
                .unwrap()
                .on_error,
            OnError::FailOpen
        );
        let h =
            Hook::from_binding(HookPoint::PreTrigger, &b(json!({"functions": ["fs::*"]}))).unwrap();
        assert!(h.applies_to(Some("fs::write")) && !h.applies_to(Some("net::get")));
    }

    #[test]
    fn mutations_thread_through_the_payload() {
        let mut p = json!({"call": {"arguments": {"a": 1}}});
        apply_mutations(
            HookPoint::PreTrigger,
            &mut p,
            &json!({"arguments": {"a": 2}}),
        );
        assert_eq!(p["call"]["arguments"], json!({"a": 2}));
        let mut p = json!({"generate": {"system_prompt": "s", "messages": [1]}});
        apply_mutations(
            HookPoint::PreGenerate,
            &mut p,
            &json!({"system_prompt": "t", "append_messages": [2]}),
        );
        assert_eq!(
            p["generate"],
            json!({"system_prompt": "t", "messages": [1, 2]})
        );
    }
}
