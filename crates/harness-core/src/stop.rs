//! `harness::stop`: durable abort plus cancelling the generation in flight.

use harness_types::api::{StopRequest, StopResponse};
use harness_types::session::SessionStatus;

use crate::harness::{Harness, Result};
use crate::machine::{self, Effect, Input};
use crate::step::illegal;
use harness_types::api::TurnStatus;

impl Harness {
    pub async fn stop(&self, req: StopRequest) -> Result<StopResponse> {
        let Some(rec) = self.load_record(&req.session_id).await? else {
            // Nothing to stop; make sure the session does not look busy.
            let _ = self
                .set_status(&req.session_id, SessionStatus::Idle, None)
                .await;
            return Ok(StopResponse { stopping: false });
        };
        // First cut the generation, lock-free: the step does not hold the lock while streaming.
        let turn_id = rec.turn_id.clone();
        let input = Input::StopRequested {
            turn_id: req.turn_id.clone(),
        };
        let t = machine::next(Some(rec), input).map_err(illegal)?;
        let Some(mut rec) = t.record else {
            return Ok(StopResponse { stopping: false });
        };
        if t.effects.is_empty() {
            return Ok(StopResponse { stopping: false });
        }
        for effect in t.effects {
            self.apply(&mut rec, effect).await?;
        }
        let guard = self.inner.locks.lock(&req.session_id).await;
        let Some(rec) = self.load_record(&req.session_id).await? else {
            return Ok(StopResponse { stopping: false });
        };
        if rec.turn_id != turn_id {
            return Ok(StopResponse { stopping: false });
        }
        if rec.is_terminal() {
            // The step saw the signal first (mid-call) and finalized the cancel itself.
            let cancelled = rec.status == TurnStatus::Cancelled;
            drop(guard);
            if cancelled {
                self.stop_children(&rec).await;
            }
            return Ok(StopResponse {
                stopping: cancelled,
            });
        }
        let t = machine::next(
            Some(rec),
            Input::Stop {
                turn_id: Some(turn_id),
            },
        )
        .map_err(illegal)?;
        let Some(mut rec) = t.record else {
            return Ok(StopResponse { stopping: false });
        };
        for effect in t.effects {
            if effect == Effect::StopChildren {
                // Never while holding the parent's lock.
                self.stop_children(&rec).await;
                continue;
            }
            self.apply(&mut rec, effect).await?;
        }
        drop(guard);
        Ok(StopResponse { stopping: true })
    }

    /// Cascades a stop to the sub-agents this turn started, one session lock at a time (never
    /// while holding the parent's).
    pub(crate) async fn stop_children(&self, rec: &crate::record::TurnRecord) {
        for c in rec.calls.values() {
            if let Some(child) = c.child() {
                let session_id = &child.session_id;
                let req = StopRequest {
                    session_id: session_id.clone(),
                    turn_id: Some(child.turn_id.clone()),
                };
                if let Err(e) = Box::pin(self.stop(req)).await {
                    tracing::warn!(child = %session_id, "cannot stop a sub-agent: {e}");
                }
            }
        }
    }
}
