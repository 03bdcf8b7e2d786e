//! What a model writes into a transcript is marked as written by a call, and never passes for
//! the user's or the system's words.
//!
//! `session::append` is the one way a model writes an entry (`session::update-message` is
//! walled). The loop checks the entry before the call runs and, right before the target runs
//! (after every hook), overwrites what the model could use to pass its entry off as another's:
//! `origin` becomes `{written_by: {turn_id, function_call_id, function_id, session_id}}`, and
//! `entry_id` becomes one of the loop's own (`w_<turn>_<call>`), which no id the loop writes
//! for itself (`e_…`) can equal, so a model cannot take the id of a result or a reply that is
//! still to come. A model's binding gets its owner the same way (`wall::BINDING_OWNER`).

use serde_json::{json, Value};

use super::wall;

pub(crate) const APPEND: &str = "session::append";

/// The origin key that marks an entry written by a function call.
pub const WRITTEN_BY: &str = "written_by";

/// Roles a function call may not write: they would read as the user's or the system's own words.
const FORBIDDEN_ROLES: &[&str] = &["user", "system", "developer"];

/// Custom entry types the loop reads back to shape what a model sees (a forged compaction
/// record would replace the history with a summary of the model's making).
const LOOP_CUSTOM_TYPES: &[&str] = &[harness_types::context::COMPACTION_ENTRY];

/// The refusal a model reads for an entry it may not write, naming the field.
pub(crate) fn check(function_id: &str, arguments: &Value) -> Result<(), String> {
    if function_id != APPEND {
        return Ok(());
    }
    let role = arguments
        .pointer("/message/role")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if FORBIDDEN_ROLES.contains(&role.trim().to_ascii_lowercase().as_str()) {
        return Err(format!(
            "harness/invalid_request: message.role: a function call may not write a '{role}' message; \
             an entry a model appends is marked as written by its call and is never the user's or the \
             system's words (append it with role 'assistant', or as a custom entry)"
        ));
    }
    for pointer in ["/custom/custom_type", "/message/custom_type"] {
        let kind = arguments
            .pointer(pointer)
            .and_then(Value::as_str)
            .unwrap_or_default();
        if LOOP_CUSTOM_TYPES.contains(&kind) {
            let field = pointer.trim_start_matches('/').replace('/', ".");
            return Err(format!(
                "harness/invalid_request: {field}: '{kind}' entries are the loop's own; a function call may not write one"
            ));
        }
    }
    Ok(())
}

/// The entry id of what call `call_id` of turn `turn_id` appends.
pub(crate) fn entry_id(turn_id: &str, call_id: &str) -> String {
    format!("w_{turn_id}_{}", harness_types::ids::san(call_id))
}

/// Overwrites what marks a call's writes as the loop's record of who made them: an appended
/// entry's origin and id, a binding's owner.
pub(crate) fn mark(
    function_id: &str,
    arguments: &mut Value,
    session_id: &str,
    turn_id: &str,
    call_id: &str,
) {
    let Some(args) = arguments.as_object_mut() else {
        return;
    };
    let caller = json!({
        "turn_id": turn_id,
        "function_call_id": call_id,
        "function_id": function_id,
        "session_id": session_id,
    });
    match function_id {
        APPEND => {
            args.insert("origin".into(), json!({ WRITTEN_BY: caller }));
            args.insert("entry_id".into(), json!(entry_id(turn_id, call_id)));
        }
        "engine::register_trigger" => {
            args.insert("metadata".into(), json!({ wall::BINDING_OWNER: caller }));
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_and_system_roles_are_refused_naming_the_field() {
        for role in ["user", "system", "User", " SYSTEM"] {
            let args = json!({"session_id": "s", "message": {"role": role, "content": []}});
            let text = check(APPEND, &args).unwrap_err();
            assert!(
                text.starts_with("harness/invalid_request: message.role:"),
                "{text}"
            );
        }
        let ok = json!({"session_id": "s", "message": {"role": "assistant", "content": []}});
        assert_eq!(check(APPEND, &ok), Ok(()));
        let forged =
            json!({"session_id": "s", "custom": {"custom_type": "compaction", "data": {}}});
        assert!(check(APPEND, &forged)
            .unwrap_err()
            .contains("custom.custom_type"));
        // Only session::append is looked at.
        assert_eq!(
            check("notes::add", &json!({"message": {"role": "user"}})),
            Ok(())
        );
    }

    #[test]
    fn the_loop_overwrites_origin_entry_id_and_owner() {
        let mut args = json!({"session_id": "s", "message": {"role": "assistant"},
                              "origin": {"written_by": {"turn_id": "forged"}}, "entry_id": "e_t1_c9"});
        mark(APPEND, &mut args, "s", "t1", "fc 1");
        assert_eq!(
            args["origin"],
            json!({"written_by": {"turn_id": "t1", "function_call_id": "fc 1",
                                  "function_id": "session::append", "session_id": "s"}})
        );
        assert_eq!(args["entry_id"], "w_t1_fc~201");
        let mut binding = json!({"trigger_type": "queue", "function_id": "a::b",
                                 "metadata": {"harness_owner": {"session_id": "victim"}}});
        mark("engine::register_trigger", &mut binding, "s", "t1", "c2");
        assert_eq!(binding["metadata"]["harness_owner"]["session_id"], "s");
        assert_eq!(binding["metadata"]["harness_owner"]["turn_id"], "t1");
    }
}
