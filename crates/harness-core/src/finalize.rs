//! Finalizers: every turn ends in exactly one terminal status, with a durable record of why and
//! one `harness::turn-completed` event.
//!
//! Order matters: the terminal record is written first; everything after it (status, event,
//! error record) is idempotent and re-run by a redelivered step that finds the record terminal,
//! so a crash between the writes loses nothing and duplicates nothing.

use harness_types::api::{TurnCompletedEvent, TurnStatus};
use harness_types::message::ErrorKind;
use harness_types::session::SessionStatus;
use harness_types::{ids, now_ms};
use serde_json::{json, Value};

use crate::harness::{Harness, Result};
use crate::record::{Failure, TurnRecord};
use crate::send::new_record;
use crate::stream::GenerationError;

pub(crate) enum Outcome {
    Completed(Value),
    Failed(Failure),
    Cancelled,
}

impl Outcome {
    pub(crate) fn failed(
        code: &str,
        phase: &str,
        summary: &str,
        detail: Option<String>,
    ) -> Outcome {
        Outcome::Failed(Failure {
            code: code.into(),
            phase: phase.into(),
            summary: summary.into(),
            detail,
            retryable: false,
            kind: None,
        })
    }

    pub(crate) fn generation_failed(
        err: &GenerationError,
        _model: &str,
        _provider: Option<&str>,
        _partial: bool,
    ) -> Outcome {
        let summary = match err.kind {
            ErrorKind::AuthExpired => "The provider rejected the credentials.",
            ErrorKind::RateLimited => "The provider is rate limiting requests; try again shortly.",
            ErrorKind::ContextOverflow => "The conversation is too long for the model.",
            ErrorKind::Transient => "The provider failed temporarily.",
            ErrorKind::Permanent => "The provider rejected this request.",
        };
        Outcome::Failed(Failure {
            code: err.code.clone(),
            phase: "generation".into(),
            summary: summary.into(),
            detail: Some(err.message.clone()),
            retryable: err.kind.retryable(),
            kind: Some(err.kind.as_str().into()),
        })
    }
}

impl Harness {
    pub(crate) async fn finalize(&self, rec: &mut TurnRecord, outcome: Outcome) -> Result<()> {
        // Steering rows still parked are delivered to the transcript; never dropped.
        let drained = self.drain_queue(&rec.session_id, &rec.turn_id).await?;
        match outcome {
            Outcome::Completed(result) => {
                rec.status = TurnStatus::Completed;
                rec.result = Some(result);
                rec.result_error = None;
            }
            Outcome::Failed(f) => {
                rec.status = TurnStatus::Failed;
                rec.result_error = Some(f.summary.clone());
                rec.failure = Some(f);
            }
            Outcome::Cancelled => {
                rec.status = TurnStatus::Cancelled;
                rec.abort = true;
            }
        }
        self.terminal_records(rec).await?;
        self.save_record(rec).await?;
        crate::failpoint::hit("after_finalize_persisted");
        self.clear_signal(&rec.turn_id);
        self.after_terminal(rec).await?;
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

    /// The durable record of why a turn ended (error record, stop notice). Written before the
    /// terminal status, so whoever sees the status can read the reason; idempotent.
    /// For a redelivered step that finds its record terminal: a crash may have cut the side
    /// effects short, so they run again (each is idempotent).
    pub(crate) async fn repeat_terminal_effects(&self, rec: &TurnRecord) -> Result<()> {
        self.terminal_records(rec).await?;
        self.after_terminal(rec).await
    }

    async fn terminal_records(&self, rec: &TurnRecord) -> Result<()> {
        let sid = &rec.session_id;
        match rec.status {
            TurnStatus::Failed => {
                let f = failure_of(rec);
                self.append_custom(
                    sid,
                    ids::error_entry(&rec.turn_id),
                    "error",
                    json!({"status": "error", "summary": f.summary, "code": f.code, "phase": f.phase,
                           "class": f.kind.as_ref().map(|k| format!("llm.{k}")), "detail": f.detail,
                           "retryable": f.retryable, "model": rec.options.model, "provider": rec.options.provider,
                           "partial_result_available": rec.result.is_some(),
                           "recovery": {"attempted": rec.transient_resumes > 0, "max_attempts": rec.options.max_transient_resumes,
                                        "outcome": if rec.transient_resumes > 0 { "exhausted" } else { "not_attempted" }},
                           "artifacts": {"session_id": sid, "turn_id": rec.turn_id}, "timestamp": now_ms()}),
                    &rec.turn_id,
                )
                .await?;
            }
            TurnStatus::Cancelled => {
                self.append_custom(
                    sid,
                    ids::stopped_entry(&rec.turn_id),
                    "notice",
                    json!({"reason": "stopped", "message": "stopped by user."}),
                    &rec.turn_id,
                )
                .await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// The idempotent side effects after the terminal write: session status and the
    /// `harness::turn-completed` event (deduplicated by turn).
    async fn after_terminal(&self, rec: &TurnRecord) -> Result<()> {
        let sid = &rec.session_id;
        let reason = match rec.status {
            TurnStatus::Failed => {
                let summary = failure_of(rec).summary;
                self.set_status(sid, SessionStatus::Error, Some(&summary))
                    .await?;
                Some(summary)
            }
            TurnStatus::Cancelled => {
                self.set_status(sid, SessionStatus::Done, Some("stopped"))
                    .await?;
                Some("stopped by user.".to_string())
            }
            _ => {
                self.set_status(sid, SessionStatus::Done, None).await?;
                rec.stop_reason.clone()
            }
        };
        self.emit_turn_completed(TurnCompletedEvent {
            session_id: sid.clone(),
            turn_id: rec.turn_id.clone(),
            status: rec.status,
            terminal: true,
            timestamp: now_ms(),
            result: rec.result.clone(),
            result_error: rec.result_error.clone(),
            reason,
            parent: rec.parent.clone(),
        })
        .await
    }

    async fn reseed(&self, prev: &TurnRecord) -> Result<()> {
        let mut rec = new_record(
            &prev.session_id,
            &ids::new_turn_id(),
            prev.options.clone(),
            prev.depth,
            prev.parent.clone(),
            None,
        );
        self.save_record(&mut rec).await?;
        self.enqueue_step(&rec).await
    }
}

fn failure_of(rec: &TurnRecord) -> Failure {
    rec.failure.clone().unwrap_or(Failure {
        code: "harness.turn_internal".into(),
        phase: "execution".into(),
        summary: rec.result_error.clone().unwrap_or_default(),
        detail: None,
        retryable: false,
        kind: None,
    })
}
