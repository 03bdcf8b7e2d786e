//! `harness::stop`: durable abort plus cancelling the generation in flight.

use harness_types::api::{StopRequest, StopResponse, TurnStatus};
use harness_types::session::SessionStatus;

use crate::harness::{Harness, Result};
use crate::interpret::Carry;
use crate::machine::Input;

impl Harness {
    pub async fn stop(&self, req: StopRequest) -> Result<StopResponse> {
        let not_stopping = Ok(StopResponse { stopping: false });
        let Some(rec) = self.load_record(&req.session_id).await? else {
            // Nothing to stop; make sure the session does not look busy.
            let _ = self
                .set_status(&req.session_id, SessionStatus::Idle, None)
                .await;
            return not_stopping;
        };
        // First cut the generation, lock-free: the step does not hold the lock while streaming.
        let turn_id = rec.turn_id.clone();
        let mut carry = Carry::default();
        let input = Input::StopRequested {
            turn_id: req.turn_id.clone(),
        };
        self.run(Some(rec), input, &mut carry).await?;
        if carry.carried == 0 {
            return not_stopping;
        }
        let mut carry = Carry::locked(self.inner.locks.lock(&req.session_id).await);
        let Some(rec) = self.load_record(&req.session_id).await? else {
            return not_stopping;
        };
        if rec.turn_id != turn_id {
            return not_stopping;
        }
        if rec.is_terminal() {
            // The step saw the signal first (mid-call) and finalized the cancel itself.
            let cancelled = rec.status == TurnStatus::Cancelled;
            drop(carry);
            if cancelled {
                self.stop_children(&rec).await;
            }
            return Ok(StopResponse {
                stopping: cancelled,
            });
        }
        let input = Input::Stop {
            turn_id: Some(turn_id),
        };
        self.run(Some(rec), input, &mut carry).await?;
        Ok(StopResponse { stopping: true })
    }

    /// Cascades a stop to the sub-agents this turn started, one session lock at a time.
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
