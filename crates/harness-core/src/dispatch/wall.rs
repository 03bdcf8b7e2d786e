//! The control-plane wall: what no model may call, whatever its allow list says.
//!
//! A model is untrusted input. The functions that drive the loop, decide its approvals or change
//! its bindings belong to the operator (the HTTP API, the chat, trusted bindings); a model's call
//! to one of them is refused here, after the policy and before anything else sees the call. Some
//! walls depend only on the function id (and such functions are never offered or listed to a
//! model); the rest depend on the arguments: a state scope the harness owns, a session outside
//! the caller's own tree, a binding on one of the harness's own trigger types.
//!
//! **No model reaches a model.** The only generations a turn causes are its own (the step's
//! `router::chat`, under its budget and record) and its sub-agents' (`harness::spawn`). So every
//! function that generates is walled: `router::chat`, `context::*` (assembly runs a summarizer
//! generation on the operator's key; only `context::count-tokens`, which counts, is left) and
//! `judge::*` (reconciliation's judge) by id; and, so that a generating function nobody listed
//! here is walled too, any function whose registered request schema has a top-level `model` or
//! `provider` property ([`takes_a_model`]). That rule fails closed: a function that merely
//! names a model without generating is refused until it is listed in [`READS_MODELS`], which
//! holds only the catalog readers (`router::models::*`), the token counter and the loop's own
//! path (`harness::spawn`, whose child turn is budgeted and recorded like any turn). The
//! schema rule needs the registry, so it is checked at dispatch and when tools and discovery
//! answers are built, not in [`operator_only`].
//!
//! **No model's binding outlives its turn.** `engine::register_trigger` from a model is refused
//! for `cron` (a timer fires outside any turn, forever) and for the harness's own trigger types;
//! its target must pass the model's own policy and this wall and must not depend on arguments
//! the wall would have to check (`state::*`, `session::*`, a binding), nor work in a
//! filesystem root. The loop records the binding's owner (session, turn, call) in its
//! metadata, over whatever the model wrote, and removes it when the turn ends, when the session
//! is deleted, and at start-up when its turn is no longer live (`dispatch/bindings.rs`).
//!
//! **No model rewrites history.** `session::update-message` replaces an entry's content in
//! place, whoever wrote it (the user's own message included), so it is the operator's; what a
//! model appends with `session::append` is marked with the call that wrote it and can never
//! be a user or system message (`dispatch/provenance.rs`).
//!
//! `directory::*` readers are not walled: they only read operator-written profiles, skills and
//! prompts (entry names are checked never to be paths). Its writers (`create`, `update`) are:
//! a model must never rewrite its own identity, profiles or skills, whatever its allow list.
//! `harness::system-prompt::get` is walled with the rest of `harness::*`: it reads any
//! session's frozen prompt.

use harness_types::api::FunctionPolicy;
use serde_json::Value;

/// The `harness::*` functions a model may call (each still under its policy and, for spawn,
/// the leaf wall of the sub-agent policy).
const MODEL_HARNESS_FUNCTIONS: &[&str] = &["harness::spawn", "harness::ask", "harness::status"];

/// State scopes (by prefix) that belong to the harness and its siblings: turn records, steering
/// queues, idempotency rows, approvals, bindings, router assignments.
const OWNED_SCOPES: &[&str] = &["harness", "approvals", "engine_", "router_", "session"];

/// Functions whose request names a model or provider without causing a generation a turn did
/// not budget: catalog readers, the token counter, and the loop's own spawn.
pub const READS_MODELS: &[&str] = &[
    "router::models::list",
    "router::models::get",
    "router::models::supports",
    "context::count-tokens",
    "harness::spawn",
];

/// Trigger types a model may never bind: a timer fires outside any turn, on its own.
const TIMER_TRIGGERS: &[&str] = &["cron"];

/// The metadata key of a binding a model made, naming its owner (written by the loop).
pub const BINDING_OWNER: &str = "harness_owner";

/// Functions only an operator may call, by id alone.
pub fn operator_only(function_id: &str) -> bool {
    if function_id.starts_with("harness::") {
        return !MODEL_HARNESS_FUNCTIONS.contains(&function_id);
    }
    if function_id.starts_with("context::") {
        return !READS_MODELS.contains(&function_id);
    }
    function_id.starts_with("approval::")
        || function_id.starts_with("judge::")
        || directory_writer(function_id)
        || function_id.starts_with("engine::registered-triggers::")
        || matches!(
            function_id,
            // Unbinding could remove a hook that guards every session (the approval gate).
            "engine::unregister_trigger"
                // Sessions are created by spawns; the list is every tree's.
                | "session::list"
                | "session::create"
                // Deleting goes through harness::delete-session-tree (cancel, wait, clean up).
                | "session::delete"
                // Rewrites any entry in place, the user's own words included.
                | "session::update-message"
                // The loop's own generations: aborting one cuts another session's turn, and a
                // model calling a model bypasses the turn's budget and record.
                | "router::chat"
                | "router::abort"
        )
}

/// `directory::<kind>::create|update`: the writers of the operator's directory.
fn directory_writer(function_id: &str) -> bool {
    function_id.starts_with("directory::")
        && (function_id.ends_with("::create") || function_id.ends_with("::update"))
}

/// Whether a function's request schema says it takes a model or a provider (see the module
/// docs): such a function may generate, so a model may not call it unless it is listed in
/// [`READS_MODELS`].
pub fn takes_a_model(function_id: &str, request_schema: Option<&Value>) -> bool {
    if READS_MODELS.contains(&function_id) {
        return false;
    }
    request_schema
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object)
        .is_some_and(|p| p.contains_key("model") || p.contains_key("provider"))
}

/// The refusal of a function [`takes_a_model`] says generates.
pub(crate) fn generates_refusal(function_id: &str) -> String {
    refusal(
        function_id,
        "it takes a model or a provider: a model's calls cause no generation beyond its own turn and its sub-agents",
    )
}

/// What a call names that the wall looks at, beyond its id.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Nothing more to check.
    Free,
    /// The call reaches this session: allowed only inside the caller's own tree.
    Session(String),
    /// A binding: its target must not take a model either (checked with the registry).
    Binding(String),
}

/// The refusal a model reads for a call the wall stops.
pub(crate) fn refusal(function_id: &str, why: &str) -> String {
    format!(
        "function {function_id} is part of the harness's control plane ({why}); a model cannot call it, whatever its allow list says"
    )
}

/// Checks what can be decided from the call alone, for a model whose turn has `policy`. `Ok`
/// says what still has to be checked with I/O; `Err` is the reason for a refusal.
pub(crate) fn check(
    policy: Option<&FunctionPolicy>,
    function_id: &str,
    arguments: &Value,
) -> Result<Reach, String> {
    if operator_only(function_id) {
        return Err(refusal(function_id, "operator only"));
    }
    let str_arg = |key: &str| arguments.get(key).and_then(Value::as_str);
    if function_id.starts_with("state::") {
        let scope = str_arg("scope").unwrap_or_default();
        if OWNED_SCOPES.iter().any(|p| scope.starts_with(p)) {
            return Err(refusal(
                function_id,
                &format!("scope '{scope}' belongs to the harness"),
            ));
        }
        return Ok(Reach::Free);
    }
    if function_id == "engine::register_trigger" {
        return binding(policy, arguments).map(Reach::Binding);
    }
    if function_id.starts_with("session::") || function_id == "harness::status" {
        return match str_arg("session_id") {
            Some(id) => Ok(Reach::Session(id.to_string())),
            None => Err(refusal(
                function_id,
                "it names no session of this agent's tree",
            )),
        };
    }
    Ok(Reach::Free)
}

/// A model's binding: its trigger type and its target (see the module docs). `Ok` is the target.
fn binding(policy: Option<&FunctionPolicy>, arguments: &Value) -> Result<String, String> {
    const ID: &str = "engine::register_trigger";
    let str_arg = |key: &str| arguments.get(key).and_then(Value::as_str);
    let trigger_type = str_arg("trigger_type").unwrap_or_default();
    if trigger_type.starts_with("harness::") {
        return Err(refusal(
            ID,
            &format!("trigger type '{trigger_type}' is the harness's own"),
        ));
    }
    if TIMER_TRIGGERS.contains(&trigger_type) {
        return Err(refusal(
            ID,
            &format!(
                "a '{trigger_type}' binding fires outside any turn; a model's bindings end with its turn"
            ),
        ));
    }
    let target = str_arg("function_id").unwrap_or_default();
    if operator_only(target) || target.starts_with("harness::") {
        return Err(refusal(ID, &format!("a binding may not call '{target}'")));
    }
    // A binding's calls run outside any turn, so no root is stamped on them: a model's
    // binding to a filesystem or shell function would carry a scope of its own making.
    if crate::fsroot::scoped(target) {
        return Err(refusal(
            ID,
            &format!("a binding may not call '{target}', which works in a turn's filesystem root"),
        ));
    }
    match crate::dispatch::model_verdict(policy, target) {
        Ok(true) => Ok(target.to_string()),
        // The trigger writes the payload, after this check: nothing could check its arguments.
        Ok(false) => Err(refusal(
            ID,
            &format!(
                "a binding may not call '{target}', whose calls the wall checks by their arguments"
            ),
        )),
        Err(_) => Err(refusal(
            ID,
            &format!(
                "a binding's target '{target}' is not permitted by this agent's dispatch policy"
            ),
        )),
    }
}

#[cfg(test)]
mod tests;
