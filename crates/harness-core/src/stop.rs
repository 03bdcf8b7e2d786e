//! `harness::stop`: durable abort plus cancelling the generation in flight.

use harness_types::api::{StopRequest, StopResponse, TurnStatus};
use harness_types::session::SessionStatus;

use crate::harness::{Harness, Result};
use crate::interpret::Carry;
use crate::machine::Input;

impl Harness {
    pub async fn stop(&self, req: StopRequest) -> Result<StopResponse> {
        let not_stopping = Ok(StopResponse { stopping: false });
        // First cut the generation, lock-free: the step does not hold the lock while streaming.
        let rec = self.load_record(&req.session_id).await?;
        let turn_id = rec.as_ref().map(|r| r.turn_id.clone());
        let mut carry = Carry::default();
        let input = Input::StopRequested {
            turn_id: req.turn_id.clone(),
        };
        let after = self.run(rec, input, &mut carry).await?;
        let Some(turn_id) = turn_id.filter(|_| carry.carried > 0) else {
            if after.is_none() {
                // Nothing to stop; make sure the session does not look busy.
                let _ = self
                    .set_status(&req.session_id, SessionStatus::Idle, None)
                    .await;
            }
            return not_stopping;
        };
        let mut carry = Carry::locked(self.inner.locks.lock(&req.session_id).await);
        let rec = self.load_record(&req.session_id).await?;
        let input = Input::Stop {
            turn_id: Some(turn_id.clone()),
        };
        let after = self.run(rec, input, &mut carry).await?;
        if carry.carried > 0 {
            return Ok(StopResponse { stopping: true });
        }
        // The machine left it alone: the record is gone, another turn runs, or the turn ended.
        // The step may have seen the signal first (mid-call) and finalized the cancel itself.
        drop(carry);
        let Some(rec) = after.filter(|r| r.turn_id == turn_id && r.status == TurnStatus::Cancelled)
        else {
            return not_stopping;
        };
        self.stop_children(&rec).await;
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
