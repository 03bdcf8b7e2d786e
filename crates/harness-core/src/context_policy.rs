//! `harness::context-policy`: whether a session's context may prune aged function results.
//!
//! The default is the model's: where the router's catalog prices cache reads, the provider
//! keeps the prompt prefix cached, and pruning rewrites that prefix (each prune pays a cache
//! write and loses the cached reads), so it is off; elsewhere it is on. An operator can set it
//! per session (a row in [`POLICY_SCOPE`]); `null` returns the session to the model's default.
//! A model never reaches this function (the control-plane wall), nor the state row.

use harness_types::context::{ContextPolicyRequest, ContextPolicyResponse, PolicySource};
use harness_types::HarnessError;
use serde_json::{json, Value};

use crate::context::POLICY_SCOPE;
use crate::harness::{Harness, Result};

/// The model's default, from its catalog row (`None`: the router does not know it).
pub(crate) fn model_allows_pruning(catalog: Option<&Value>) -> (bool, String) {
    match catalog.and_then(|c| c["pricing"]["cache_read"].as_f64()) {
        Some(_) => (
            false,
            "the provider caches this model's prompt prefix (its catalog row prices cache reads): pruning would rewrite the cached prefix".into(),
        ),
        None => (
            true,
            "the model's provider keeps no priced prompt cache, so shortening aged results costs nothing".into(),
        ),
    }
}

impl Harness {
    /// The session's pruning permission: its own setting, else the model's default.
    pub(crate) async fn context_policy_of(
        &self,
        session_id: &str,
        catalog: Option<&Value>,
    ) -> Result<(bool, PolicySource, String)> {
        let row = self.state_get(POLICY_SCOPE, session_id).await?;
        if let Some(allowed) = row
            .as_ref()
            .and_then(|r| r["prune_function_results"].as_bool())
        {
            return Ok((
                allowed,
                PolicySource::Session,
                "set for this session with harness::context-policy".into(),
            ));
        }
        let (allowed, reason) = model_allows_pruning(catalog);
        Ok((allowed, PolicySource::Model, reason))
    }

    /// `harness::context-policy`.
    pub async fn context_policy(&self, req: ContextPolicyRequest) -> Result<ContextPolicyResponse> {
        let record = match &req.session_id {
            Some(sid) => self.load_record(sid).await?,
            None => None,
        };
        let (model, provider) = match (&req.model, &record) {
            (Some(m), _) => (m.clone(), req.provider.clone()),
            (None, Some(r)) => (r.options.model.clone(), r.options.provider.clone()),
            (None, None) => {
                return Err(HarnessError::invalid_field(
                    "model",
                    "name the destination model, or a session_id with a turn",
                ))
            }
        };
        if let Some(set) = &req.set {
            let Some(sid) = &req.session_id else {
                return Err(HarnessError::invalid_field(
                    "set",
                    "setting a policy needs the session_id it is for",
                ));
            };
            let bus = &self.inner.bus;
            match set.prune_function_results {
                Some(allowed) => bus
                    .state_set(
                        POLICY_SCOPE,
                        sid,
                        json!({"prune_function_results": allowed}),
                    )
                    .await
                    .map_err(|e| e.into_harness())?,
                None => bus
                    .state_delete(POLICY_SCOPE, sid)
                    .await
                    .map_err(|e| e.into_harness())?,
            }
        }
        let catalog = self
            .inner
            .bus
            .call(
                "router::models::get",
                json!({"provider": provider, "id": model}),
                Some(std::time::Duration::from_millis(
                    self.config().session_timeout_ms,
                )),
            )
            .await
            .ok();
        let (prune, source, reason) = match &req.session_id {
            Some(sid) => self.context_policy_of(sid, catalog.as_ref()).await?,
            None => {
                let (p, r) = model_allows_pruning(catalog.as_ref());
                (p, PolicySource::Model, r)
            }
        };
        Ok(ContextPolicyResponse {
            model,
            provider,
            prune_function_results: prune,
            source,
            reason,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_priced_prompt_cache_turns_pruning_off_by_default() {
        let cached = json!({"pricing": {"input": 3.0, "output": 15.0, "cache_read": 0.3}});
        assert!(!model_allows_pruning(Some(&cached)).0);
        let uncached = json!({"pricing": {"input": 0.1, "output": 0.2}});
        assert!(model_allows_pruning(Some(&uncached)).0);
        assert!(model_allows_pruning(None).0);
    }
}
