//! `harness::stop`: durable abort plus cancelling the generation in flight.

use harness_types::api::{StopRequest, StopResponse};
use harness_types::session::SessionStatus;
use serde_json::json;

use crate::finalize::Outcome;
use crate::harness::{Harness, Result};

impl Harness {
    pub async fn stop(&self, req: StopRequest) -> Result<StopResponse> {
        let Some(rec) = self.load_record(&req.session_id).await? else {
            // Nothing to stop; make sure the session does not look busy.
            let _ = self
                .set_status(&req.session_id, SessionStatus::Idle, None)
                .await;
            return Ok(StopResponse { stopping: false });
        };
        if rec.is_terminal() || req.turn_id.as_deref().is_some_and(|t| t != rec.turn_id) {
            return Ok(StopResponse { stopping: false });
        }
        let turn_id = rec.turn_id.clone();
        // First cut the generation (lock-free: the step does not hold the lock while streaming).
        self.fire_signal(&turn_id);
        // The generation in flight, if any, is the one of the current step.
        let request_id = harness_types::ids::request_id(&rec.turn_id, rec.step);
        let _ = self
            .inner
            .bus
            .call(
                "router::abort",
                json!({ "request_id": request_id }),
                Some(std::time::Duration::from_secs(2)),
            )
            .await;
        let _guard = self.inner.locks.lock(&req.session_id).await;
        let Some(mut rec) = self.load_record(&req.session_id).await? else {
            return Ok(StopResponse { stopping: false });
        };
        if rec.turn_id != turn_id {
            return Ok(StopResponse { stopping: false });
        }
        if rec.is_terminal() {
            // The step saw the signal first (mid-call) and finalized the cancel itself.
            let cancelled = rec.status == harness_types::api::TurnStatus::Cancelled;
            drop(_guard);
            if cancelled {
                self.stop_children(&rec).await;
            }
            return Ok(StopResponse {
                stopping: cancelled,
            });
        }
        self.finalize(&mut rec, Outcome::Cancelled).await?;
        self.barrier().await?;
        drop(_guard);
        self.stop_children(&rec).await;
        Ok(StopResponse { stopping: true })
    }

    /// Cascades a stop to the sub-agents this turn started, one session lock at a time (never
    /// while holding the parent's).
    async fn stop_children(&self, rec: &crate::record::TurnRecord) {
        for c in rec.calls.values() {
            if let (Some(session_id), Some(turn_id)) = (&c.child_session_id, &c.child_turn_id) {
                let req = StopRequest {
                    session_id: session_id.clone(),
                    turn_id: Some(turn_id.clone()),
                };
                if let Err(e) = Box::pin(self.stop(req)).await {
                    tracing::warn!(child = %session_id, "cannot stop a sub-agent: {e}");
                }
            }
        }
    }
}
