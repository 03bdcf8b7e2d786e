//! Finalizers: every turn ends in exactly one terminal status, with a durable record of why and
//! one `harness::turn-completed` event.
//!
//! Order matters: the terminal record is written first; everything after it (status, event,
//! error record) is idempotent and re-run by a redelivered step that finds the record terminal,
//! so a crash between the writes loses nothing and duplicates nothing.

use harness_types::api::{TurnCompletedEvent, TurnStatus};
use harness_types::session::SessionStatus;
use harness_types::{ids, now_ms};
use serde_json::json;

use crate::harness::{Harness, Result, StepWrites};
use crate::interpret::Carry;
use crate::machine::{Input, Seed};
use crate::record::{Failure, TurnRecord};
use crate::texts;
use crate::transcript::TranscriptOnce;

impl Harness {
    /// Carries out `Effect::Finalize` for a record the machine made terminal, with `held` (the
    /// writes the run held back) at the head of its batch.
    pub(crate) async fn finalize_after(
        &self,
        rec: &mut TurnRecord,
        held: StepWrites,
    ) -> Result<()> {
        // Steering rows still parked are delivered to the transcript, never dropped: first in
        // the batch, with the reason, the terminal record, the session status and the event. On
        // the embedded bus one transaction, elsewhere in this order (each idempotent, and a
        // redelivered step that finds the record terminal repeats what follows it).
        // The held writes' head (the step's assistant entry, when its pre-append joined this
        // batch) was due before anything parked now: it stays ahead of the rows.
        let (mut batch, held) = held.split_head();
        let drained = self
            .drain_into(&rec.session_id, &rec.turn_id, &mut batch)
            .await?;
        batch.extend(held);
        let closings = self
            .inner
            .closings
            .lock()
            .expect("closings lock")
            .remove(&rec.turn_id);
        // Only what this record says it closed (a leftover of a failed attempt is not).
        let closed = |req: &&harness_types::session::AppendRequest| {
            rec.calls.values().any(|c| {
                matches!(c, crate::record::CallCheckpoint::Done { entry_id: Some(e), .. }
                    if Some(e) == req.entry_id.as_ref())
            })
        };
        for req in closings.iter().flatten().filter(closed) {
            batch.append(req.clone())?;
        }
        terminal_records(&mut batch, rec)?;
        batch.save_record(rec)?;
        let event = after_terminal(&mut batch, rec)?;
        self.record_turn_event(&mut batch, &event);
        self.commit(batch).await?;
        crate::failpoint::hit("after_finalize_persisted");
        let mut transcript = TranscriptOnce::default();
        self.observe_finished(rec, &mut transcript).await;
        self.announce_usage(rec, &mut transcript).await;
        self.clear_signal(&rec.turn_id);
        if made_bindings(rec) {
            self.end_turn_bindings(&rec.session_id, &rec.turn_id).await;
        }
        self.fan_out_turn_event(event).await?;
        self.answer_parent(rec).await;
        // A send that parked its message just before the terminal write saw a running turn and
        // answered `merged`: drain again so it is never stranded.
        let drained = drained + self.drain_queue(&rec.session_id, &rec.turn_id).await?;
        // What arrived while the turn was ending gets its own turn (never after a cancel).
        if drained > 0 && rec.status != TurnStatus::Cancelled {
            self.reseed(rec).await?;
        }
        Ok(())
    }

    /// For a redelivered step that finds its record terminal: a crash may have cut the side
    /// effects short (on a bus without transactions), so they run again (each is idempotent).
    pub(crate) async fn repeat_terminal_effects(&self, rec: &TurnRecord) -> Result<()> {
        let mut batch = StepWrites::default();
        terminal_records(&mut batch, rec)?;
        let event = after_terminal(&mut batch, rec)?;
        self.record_turn_event(&mut batch, &event);
        self.commit(batch).await?;
        // A crash after the terminal write may have cut this short; it knows the turn.
        self.announce_usage(rec, &mut TranscriptOnce::default())
            .await;
        if made_bindings(rec) {
            self.end_turn_bindings(&rec.session_id, &rec.turn_id).await;
        }
        self.fan_out_turn_event(event).await
    }

    /// A new turn for messages that were drained into the transcript as the last one ended:
    /// a send whose message is already there.
    async fn reseed(&self, prev: &TurnRecord) -> Result<()> {
        let seed = Seed {
            session_id: prev.session_id.clone(),
            turn_id: ids::new_turn_id(),
            options: (*prev.options).clone(),
            depth: prev.depth,
            parent: prev.parent.clone(),
            preview: None,
            functions_generation: None,
            now: now_ms(),
        };
        let input = Input::Send {
            parked: true,
            seed: Box::new(seed),
        };
        // Boxed: a run may finalize, and finalizing may reseed.
        Box::pin(self.run(Some(prev.clone()), input, &mut Carry::default())).await?;
        Ok(())
    }
}

/// The durable record of why a turn ended (error record, stop notice), written with the
/// terminal status so whoever sees the status can read the reason; idempotent by entry id.
fn terminal_records(batch: &mut StepWrites, rec: &TurnRecord) -> Result<()> {
    let sid = &rec.session_id;
    match rec.status {
        TurnStatus::Failed => {
            let f = failure_of(rec);
            batch.append_custom(
                rec,
                ids::error_entry(&rec.turn_id),
                "error",
                json!({"status": "error", "summary": f.summary, "code": f.code, "phase": f.phase,
                       "class": f.kind.map(|k| format!("llm.{}", k.as_str())), "detail": f.detail,
                       "retryable": f.retryable, "model": rec.options.model, "provider": rec.options.provider,
                       "provider_status": f.provider.provider_status, "provider_message": f.provider.provider_message,
                       "hint": f.provider.hint,
                       "partial_result_available": rec.result.is_some(),
                       "recovery": {"attempted": rec.transient_resumes > 0, "max_attempts": rec.options.max_transient_resumes,
                                    "outcome": if rec.transient_resumes > 0 { "exhausted" } else { "not_attempted" }},
                       "artifacts": {"session_id": sid, "turn_id": rec.turn_id}, "timestamp": now_ms()}),
            )
        }
        TurnStatus::Cancelled => batch.append_custom(
            rec,
            ids::stopped_entry(&rec.turn_id),
            "notice",
            json!({"reason": "stopped", "message": texts::STOPPED_BY_USER}),
        ),
        _ => Ok(()),
    }
}

/// The session status after the terminal write, and the `harness::turn-completed` event
/// (deduplicated by turn) the caller records.
fn after_terminal(batch: &mut StepWrites, rec: &TurnRecord) -> Result<TurnCompletedEvent> {
    let sid = &rec.session_id;
    let reason = match rec.status {
        TurnStatus::Failed => {
            let summary = failure_of(rec).summary;
            batch.set_status(sid, SessionStatus::Error, Some(&summary))?;
            Some(summary)
        }
        TurnStatus::Cancelled => {
            batch.set_status(sid, SessionStatus::Done, Some("stopped"))?;
            Some(texts::STOPPED_BY_USER.to_string())
        }
        _ => {
            batch.set_status(sid, SessionStatus::Done, None)?;
            rec.stop_reason.map(|r| r.as_str().to_string())
        }
    };
    Ok(TurnCompletedEvent {
        session_id: sid.clone(),
        turn_id: rec.turn_id.clone(),
        status: rec.status,
        terminal: true,
        timestamp: now_ms(),
        result: rec.result.clone(),
        result_error: rec.result_error.clone(),
        reason,
        parent: rec.parent.clone(),
        failure: rec.api_failure(),
        display: rec.options.display.clone(),
        context: rec.prompt_surface.clone(),
        parent_session_id: rec.options.display_parent_session_id.clone(),
    })
}

/// Whether the turn's model asked for a binding (its bindings end with the turn; the start-up
/// sweep catches one a crash left).
fn made_bindings(rec: &TurnRecord) -> bool {
    rec.calls
        .values()
        .any(|c| c.function_id() == "engine::register_trigger")
}

fn failure_of(rec: &TurnRecord) -> Failure {
    rec.failure_cause()
}
