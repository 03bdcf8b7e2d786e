//! `harness::status`: a point-in-time view of a session's turn.

use harness_types::api::{StatusReport, StatusRequest};

use crate::harness::{Harness, Result};

impl Harness {
    /// `None` for a session with no turn record.
    pub async fn status(&self, req: StatusRequest) -> Result<Option<StatusReport>> {
        let Some(rec) = self.load_record(&req.session_id).await? else {
            return Ok(None);
        };
        let queued = self.queued(&req.session_id).await?.len() as u32;
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
            result: rec.result.clone(),
            result_error: rec.result_error.clone(),
            stop_reason: rec.stop_reason.map(|r| r.as_str().to_string()),
            transient_resumes: rec.transient_resumes,
            queued,
            failure: rec.api_failure(),
        }))
    }
}
