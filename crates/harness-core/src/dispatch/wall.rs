//! The control-plane wall: what no model may call, whatever its allow list says.
//!
//! A model is untrusted input. The functions that drive the loop, decide its approvals or change
//! its bindings belong to the operator (the HTTP API, the chat, trusted bindings); a model's call
//! to one of them is refused here, after the policy and before anything else sees the call. Some
//! walls depend only on the function id (and such functions are never offered or listed to a
//! model); the rest depend on the arguments: a state scope the harness owns, a session outside
//! the caller's own tree, a binding on one of the harness's own trigger types.
//!
//! `directory::*` is not walled: it only reads operator-written profiles, skills and prompts
//! (entry names are checked never to be paths), and has no function that writes, so a model
//! can neither rewrite its identity nor reach the data directory through it.
//! `harness::system-prompt::get` is walled with the rest of `harness::*`: it reads any
//! session's frozen prompt.

use serde_json::Value;

/// The `harness::*` functions a model may call (each still under its policy and, for spawn,
/// the leaf wall of the sub-agent policy).
const MODEL_HARNESS_FUNCTIONS: &[&str] = &["harness::spawn", "harness::ask", "harness::status"];

/// State scopes (by prefix) that belong to the harness and its siblings: turn records, steering
/// queues, idempotency rows, approvals, bindings, router assignments.
const OWNED_SCOPES: &[&str] = &["harness", "approvals", "engine_", "router_", "session"];

/// Functions only an operator may call, by id alone.
pub fn operator_only(function_id: &str) -> bool {
    if function_id.starts_with("harness::") {
        return !MODEL_HARNESS_FUNCTIONS.contains(&function_id);
    }
    function_id.starts_with("approval::")
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
                // The loop's own generations: aborting one cuts another session's turn, and a
                // model calling a model bypasses the turn's budget and record.
                | "router::chat"
                | "router::abort"
        )
}

/// What a call names that the wall looks at, beyond its id.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Nothing more to check.
    Free,
    /// The call reaches this session: allowed only inside the caller's own tree.
    Session(String),
}

/// The refusal a model reads for a call the wall stops.
pub(crate) fn refusal(function_id: &str, why: &str) -> String {
    format!(
        "function {function_id} is part of the harness's control plane ({why}); a model cannot call it, whatever its allow list says"
    )
}

/// Checks what can be decided from the call alone. `Ok` says what still has to be checked with
/// I/O; `Err` is the reason for a refusal.
pub(crate) fn check(function_id: &str, arguments: &Value) -> Result<Reach, String> {
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
        let trigger_type = str_arg("trigger_type").unwrap_or_default();
        if trigger_type.starts_with("harness::") {
            return Err(refusal(
                function_id,
                &format!("trigger type '{trigger_type}' is the harness's own"),
            ));
        }
        let target = str_arg("function_id").unwrap_or_default();
        if operator_only(target) || target.starts_with("harness::") {
            return Err(refusal(
                function_id,
                &format!("a binding may not call '{target}'"),
            ));
        }
        // A binding's calls run outside any turn, so no root is stamped on them: a model's
        // binding to a filesystem or shell function would carry a scope of its own making.
        if crate::fsroot::scoped(target) {
            return Err(refusal(
                function_id,
                &format!(
                    "a binding may not call '{target}', which works in a turn's filesystem root"
                ),
            ));
        }
        return Ok(Reach::Free);
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

#[cfg(test)]
mod tests;
