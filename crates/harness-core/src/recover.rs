//! Recovery at start: the shell that finds turns a crash may have left without a queued step.

use crate::dispatch::PlannedCall;
use crate::harness::{Harness, Result};
use crate::interpret::{illegal, Carry};
use crate::machine::{self, Input};
use crate::record::TurnRecord;
use crate::TURN_SCOPE;

impl Harness {
    /// Hands every turn record to the machine as `Recover`: a running one gets its current step
    /// again, a parked one its interrupted calls closed, an ended one nothing. A crash between
    /// persisting a record and enqueueing its step would otherwise strand the turn; a step that
    /// was in fact still queued runs once and the duplicate is dropped by the stale guard.
    pub(crate) async fn redrive_running(&self) -> Result<()> {
        let records = self.state_list(TURN_SCOPE).await?;
        let mut redriven = 0;
        for (_, value) in records {
            let Ok(rec) = serde_json::from_value::<TurnRecord>(value) else {
                continue;
            };
            // Asked of the listed record first: a turn the machine leaves alone (an ended one)
            // costs no lock and no second read.
            let asks = machine::next(Some(rec.clone()), Input::Recover).map_err(illegal)?;
            if !asks.effects.is_empty() && self.recover(&rec.session_id).await? {
                redriven += 1;
            }
        }
        if redriven > 0 {
            tracing::info!(redriven, "re-enqueued the current step of running turns");
        }
        Ok(())
    }

    /// A turn a crash may have left without a queued step: a running one gets its current step
    /// again; a parked one whose release was cut gets the interrupted result for a call left
    /// `triggered` (it may have run, once) and runs on if nothing is pending. Returns whether a
    /// step was enqueued.
    async fn recover(&self, session_id: &str) -> Result<bool> {
        let mut carry = Carry::locked(self.inner.locks.lock(session_id).await);
        carry.advance_point = Some("after_advance_persisted");
        let Some(rec) = self.load_record(session_id).await? else {
            return Ok(false);
        };
        self.run(Some(rec), Input::Recover, &mut carry).await?;
        Ok(carry.enqueued)
    }

    /// `Effect::CloseInterrupted`: a call a crash left `triggered` may have run (once); the
    /// model hears it was interrupted instead of waiting for a result that never comes.
    pub(crate) async fn close_interrupted_calls(
        &self,
        rec: &mut TurnRecord,
        calls: Vec<String>,
    ) -> Result<()> {
        for id in calls {
            let function_id = rec
                .calls
                .get(&id)
                .map(|c| c.function_id().to_string())
                .unwrap_or_default();
            let call = PlannedCall {
                id,
                function_id,
                arguments: serde_json::Value::Null,
                intent: None,
            };
            self.close_interrupted(rec, &call).await?;
        }
        Ok(())
    }
}
