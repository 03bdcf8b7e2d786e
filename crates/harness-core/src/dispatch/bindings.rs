//! The bindings a model made (`engine::register_trigger` through its turn) end with that turn.
//!
//! The loop writes the owner into the binding's metadata (`wall::BINDING_OWNER`) when it runs
//! the call, so the binding itself says whose it is, on the embedded bus and on an engine alike,
//! and no separate row can disagree with it. The loop removes a turn's bindings when the turn
//! ends (finalize), a session's when the session is deleted, and at start-up every one whose
//! turn is no longer live: a crash between a binding and its turn's end leaves none behind.

use serde_json::{json, Value};

use super::wall::BINDING_OWNER;
use crate::harness::{Harness, Result};

/// A binding a model made, and who made it.
#[derive(Debug, Clone)]
pub(crate) struct ModelBinding {
    pub id: String,
    pub session_id: String,
    pub turn_id: String,
}

/// The model-made bindings in an `engine::registered-triggers::list` answer (the embedded bus
/// answers `triggers`, an engine `registered_triggers`).
fn owned(listed: &Value) -> Vec<ModelBinding> {
    ["triggers", "registered_triggers"]
        .iter()
        .filter_map(|k| listed.get(*k).and_then(Value::as_array))
        .flatten()
        .filter_map(|b| {
            let owner = b.get("metadata")?.get(BINDING_OWNER)?;
            Some(ModelBinding {
                id: b.get("id")?.as_str()?.to_string(),
                session_id: owner.get("session_id")?.as_str()?.to_string(),
                turn_id: owner.get("turn_id")?.as_str()?.to_string(),
            })
        })
        .collect()
}

impl Harness {
    /// Every binding a model made, with its owner.
    pub(crate) async fn model_bindings(&self) -> Result<Vec<ModelBinding>> {
        let listed: Value = self
            .call(
                "engine::registered-triggers::list",
                &json!({"include_internal": true}),
            )
            .await?;
        Ok(owned(&listed))
    }

    /// Removes the bindings `which` selects; each removal is idempotent.
    pub(crate) async fn remove_model_bindings(
        &self,
        which: impl Fn(&ModelBinding) -> bool,
    ) -> Result<usize> {
        let mut removed = 0;
        for b in self
            .model_bindings()
            .await?
            .into_iter()
            .filter(|b| which(b))
        {
            let _: Value = self
                .call("engine::unregister_trigger", &json!({"id": b.id}))
                .await?;
            tracing::info!(binding = %b.id, session = %b.session_id, turn = %b.turn_id, "removed a model's binding");
            removed += 1;
        }
        Ok(removed)
    }

    /// The bindings of a turn that ended.
    pub(crate) async fn end_turn_bindings(&self, session_id: &str, turn_id: &str) {
        let removed = self
            .remove_model_bindings(|b| b.session_id == session_id && b.turn_id == turn_id)
            .await;
        if let Err(e) = removed {
            // The start-up sweep removes it if this does not.
            tracing::warn!(session = %session_id, turn = %turn_id, "could not remove a model's bindings: {e}");
        }
    }

    /// At start-up: every model-made binding whose turn is no longer live (ended, replaced by
    /// another, or its session gone).
    pub(crate) async fn sweep_model_bindings(&self) -> Result<usize> {
        let mut dead = Vec::new();
        for b in self.model_bindings().await? {
            let live = self
                .load_record(&b.session_id)
                .await?
                .is_some_and(|r| r.turn_id == b.turn_id && !r.is_terminal());
            if !live {
                dead.push(b.id);
            }
        }
        self.remove_model_bindings(|b| dead.contains(&b.id)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bindings_with_an_owner_are_the_models() {
        let listed = json!({"triggers": [
            {"id": "trg_1", "trigger_type": "cron", "function_id": "harness::sweep-pending", "metadata": {}},
            {"id": "trg_2", "trigger_type": "q", "function_id": "a::b",
             "metadata": {"harness_owner": {"session_id": "s1", "turn_id": "t1"}}}
        ]});
        let found = owned(&listed);
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].id.as_str(), found[0].session_id.as_str()),
            ("trg_2", "s1")
        );
        let engine = json!({"registered_triggers": [
            {"id": "x", "metadata": {"harness_owner": {"session_id": "s", "turn_id": "t"}}}
        ]});
        assert_eq!(owned(&engine).len(), 1);
    }
}
