//! `harness::status`: a point-in-time view of a session's turn.

use harness_types::api::{StatusReport, StatusRequest};
use serde_json::Value;

use crate::harness::{Harness, Result};

/// A lean status shows a result whose compact JSON is longer than this as a truncated string.
const LEAN_RESULT_CHARS: usize = 600;

/// The lean form of a result: itself when short, else its first characters (the string's
/// own text, or the compact JSON of anything else) and a note saying how to get it whole.
fn lean_result(result: Value) -> Value {
    let compact = result.to_string();
    if compact.chars().count() <= LEAN_RESULT_CHARS {
        return result;
    }
    let text = match &result {
        Value::String(s) => s.as_str(),
        _ => compact.as_str(),
    };
    let head: String = text.chars().take(LEAN_RESULT_CHARS).collect();
    Value::String(format!(
        "{head} …(truncated; use verbose: true for the full result)"
    ))
}

impl Harness {
    /// `None` for a session with no turn record.
    pub async fn status(&self, req: StatusRequest) -> Result<Option<StatusReport>> {
        let Some(rec) = self.load_record(&req.session_id).await? else {
            return Ok(None);
        };
        let queued = self.queued(&req.session_id).await?.len() as u32;
        let verbose = req.verbose == Some(true);
        // Before the first step the surface is what the frozen prompt will send.
        let context = rec.prompt_surface.clone().or_else(|| {
            let stable = rec.options.stable_prefix();
            let enabled = self.config().prompt_cache_sections;
            let digest = stable
                .map(|s| format!("sha256:{}", harness_types::digest::sha256_hex(s.as_bytes())));
            Some(crate::prompt::surface(enabled, stable, digest.as_deref()))
        });
        Ok(Some(StatusReport {
            session_id: rec.session_id.clone(),
            turn_id: Some(rec.turn_id.clone()),
            status: rec.status,
            step: rec.step,
            turn_count: rec.turn_count,
            max_turns: rec.options.max_turns,
            depth: rec.depth,
            pending_function_calls: rec.open_calls(),
            children: rec
                .calls
                .iter()
                .filter_map(|(id, c)| {
                    let child = c.child()?;
                    Some(harness_types::api::ChildRef {
                        function_call_id: id.clone(),
                        session_id: child.session_id.clone(),
                        turn_id: child.turn_id.clone(),
                    })
                })
                .collect(),
            result: match rec.result.clone() {
                Some(r) if !verbose => Some(lean_result(r)),
                other => other,
            },
            result_error: rec.result_error.clone(),
            stop_reason: rec.stop_reason.map(|r| r.as_str().to_string()),
            transient_resumes: rec.transient_resumes,
            queued,
            failure: rec.api_failure(),
            expects_wake: false,
            context,
            validation_retries: verbose.then_some(rec.validation_retries),
            max_validation_retries: verbose.then(|| {
                rec.options
                    .max_validation_retries
                    .unwrap_or(self.config().max_validation_retries)
            }),
            max_transient_resumes: verbose.then_some(rec.options.max_transient_resumes),
        }))
    }
}
