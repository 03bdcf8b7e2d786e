//! The one interpreter of the turn machine's effects.
//!
//! Every shell (`send`, `step`, `stop`, `resolve`, `recover`, a failed step, the reseed after a
//! finalize) reads its inputs, hands the first one to [`Harness::run`] and answers from what the
//! run leaves. The run asks [`machine::next`], carries out the effects in order, feeds the
//! machine the input a stage ends with, and repeats until the machine has nothing more to ask.
//!
//! The run decides when writes are committed: a plain write (the record, a notice, the
//! awaiting status, a user message, what a stage holds back) joins [`Carry::pending`], and the
//! batch is committed as one store write right before the first effect that lets another party
//! look at the session (hooks, calls, events, a barrier) or at the end of the run. A record and
//! its next step always go in one batch; `Finalize` and the assistant entry's pre-append take
//! the batch into their own.
//!
//! A batch that schedules the next step is retried by [`Harness::commit_scheduling`]; for a
//! retry it is built again from the write effects that made it (the run keeps the effects, not
//! a copy of the batch), which is possible while no stage wrote into it on its own.

use harness_types::message::{AgentMessage, AssistantMessage};
use harness_types::session::{AppendRequest, Entry, SessionStatus};
use harness_types::{ids, now_ms, HarnessError};
use serde_json::json;

use crate::harness::{Harness, Result, StepWrites};
use crate::hooks::{Hook, HookPoint};
use crate::locks::SessionGuard;
use crate::machine::{self, Effect, Input};
use crate::record::TurnRecord;
use crate::texts;

/// A refusal of the machine is a bug in a shell, never a reason to write.
pub(crate) fn illegal(e: machine::Illegal) -> HarnessError {
    HarnessError::internal(e.to_string())
}

/// What a run carries from one effect to the next, and what it leaves for its shell.
#[derive(Default)]
pub(crate) struct Carry {
    /// Writes held back to go with the run's next commit. A crash before they are committed
    /// leaves the turn as it was before them (each write is idempotent by its id).
    pub pending: StepWrites,
    /// Whether `pending` holds the record (so a step enqueued now joins its batch).
    record_pending: bool,
    /// The write effects whose writes `pending` holds, in order: what builds the batch again
    /// for a retry, unless `foreign`.
    replay: Vec<Effect>,
    /// `pending` holds writes a stage left there (a stream's last write), which only that
    /// stage could build again.
    foreign: bool,
    /// The post-turn chain, read once per `PostTurn`: it decides whether the batch waits and
    /// is the chain that runs.
    post_turn_hooks: Option<Vec<Hook>>,
    /// The failpoint hit once a record and its next step are committed together.
    pub advance_point: Option<&'static str>,
    /// A send's message, for `AppendUser` and `ParkMessage`.
    pub outgoing: Option<Outgoing>,
    /// The session lock, which `Generate` releases while the model streams.
    pub guard: Option<SessionGuard>,
    /// The transcript a step's context is built from: its first `upto` entries.
    pub entries: std::sync::Arc<Vec<Entry>>,
    pub upto: usize,
    /// The model's answer of this step.
    pub message: Option<AssistantMessage>,
    /// The machine skipped the delivery (stale, duplicate, or no record).
    pub skipped: bool,
    /// A step was enqueued.
    pub enqueued: bool,
    /// How many effects the run carried out.
    pub carried: usize,
}

impl Carry {
    /// A run that holds the session lock (a step, a send).
    pub(crate) fn locked(guard: SessionGuard) -> Carry {
        Carry {
            guard: Some(guard),
            ..Carry::default()
        }
    }

    /// A send's run: its message, and its own failpoint once the message, record and step
    /// are committed.
    pub(crate) fn sending(outgoing: Outgoing) -> Carry {
        Carry {
            advance_point: Some("after_send_persisted"),
            outgoing: Some(outgoing),
            ..Carry::default()
        }
    }

    /// The answer's text, for the steering check and the output contract.
    fn answer_text(&self) -> String {
        self.message
            .as_ref()
            .map(|m| harness_types::message::joined_text(&m.content))
            .unwrap_or_default()
    }
}

/// A send's message: what `AppendUser` writes and `ParkMessage` parks.
pub(crate) struct Outgoing {
    pub session_id: String,
    pub message: AgentMessage,
    pub entry_id: String,
    /// The turn this send seeds; the correction goes only before its first message.
    pub new_turn: String,
    /// A changed skills catalog, told as a user-role message before the new turn's message.
    pub correction: Option<String>,
}

/// What an effect leaves for the run.
enum Next {
    /// Nothing: the next effect.
    Go,
    /// The machine's next input.
    Input(Input),
    /// The record as it is now (re-read after the stream) and the next input: the machine
    /// decides the rest on it.
    Reloaded(Box<(Option<TurnRecord>, Input)>),
}

impl Harness {
    /// Feeds the machine `input` for `rec` and carries out what it answers until it has nothing
    /// more to ask; commits what is held back. Answers the record as the run left it.
    pub(crate) async fn run(
        &self,
        rec: Option<TurnRecord>,
        input: Input,
        carry: &mut Carry,
    ) -> Result<Option<TurnRecord>> {
        let mut rec = rec;
        let mut input = Some(input);
        let mut first = true;
        while let Some(i) = input.take() {
            let t = machine::next(rec.take(), i).map_err(illegal)?;
            rec = t.record;
            if let (Some(out), Some(r), true) = (&carry.outgoing, rec.as_mut(), first) {
                // A send's new turn gets its trace context before its record is first written.
                if r.turn_id == out.new_turn {
                    self.seed_trace(r).await;
                }
            }
            first = false;
            for effect in t.effects {
                let Some(r) = rec.as_mut() else {
                    carry.skipped = true;
                    continue;
                };
                let holds = match &effect {
                    Effect::PostTurn { .. } => {
                        let hooks = self.hooks(HookPoint::PostTurn).await?;
                        let unseen = hooks.is_empty();
                        carry.post_turn_hooks = Some(hooks);
                        unseen
                    }
                    other => may_hold_writes(other),
                };
                if !holds {
                    self.flush(carry).await?;
                }
                carry.carried += 1;
                match self.carry_out(r, effect, carry).await? {
                    Next::Go => {}
                    Next::Input(next) => input = Some(next),
                    Next::Reloaded(reloaded) => {
                        let (now, next) = *reloaded;
                        rec = now;
                        input = Some(next);
                        break;
                    }
                }
            }
        }
        // A skipped generation (a stop ended the turn while the model streamed) still leaves
        // its answer in the transcript.
        self.flush(carry).await?;
        Ok(rec)
    }

    /// Commits what the run held back, if anything.
    pub(crate) async fn flush(&self, carry: &mut Carry) -> Result<()> {
        carry.record_pending = false;
        carry.replay.clear();
        carry.foreign = false;
        if carry.pending.is_empty() {
            return Ok(());
        }
        self.commit(std::mem::take(&mut carry.pending))
            .await
            .map(|_| ())
    }

    async fn carry_out(
        &self,
        r: &mut TurnRecord,
        effect: Effect,
        carry: &mut Carry,
    ) -> Result<Next> {
        if write(r, &effect, carry.outgoing.as_ref(), &mut carry.pending)? {
            if effect == Effect::SaveRecord {
                carry.record_pending = true;
            }
            if !carry.foreign {
                carry.replay.push(effect);
            }
            return Ok(Next::Go);
        }
        let stage = matches!(
            effect,
            Effect::Prepare { .. }
                | Effect::Generate
                | Effect::ResumeAtCalls
                | Effect::DispatchCalls { .. }
        );
        let next = match effect {
            Effect::Skip => {
                carry.skipped = true;
                Next::Go
            }
            // The stages of a step (`step.rs`).
            Effect::Prepare { first_step } => {
                Next::Input(self.prepare(r, first_step, carry).await?)
            }
            Effect::Generate => {
                let (now, next) = Box::pin(self.generate_stage(r, carry)).await?;
                Next::Reloaded(Box::new((now, next)))
            }
            Effect::ResumeAtCalls => Next::Input(self.resume_at_calls(r, carry).await?),
            // Boxed: a call may spawn a sub-agent, whose send runs this interpreter again.
            Effect::DispatchCalls { cut } => {
                Next::Input(Box::pin(self.dispatch_stage(r, cut, carry)).await?)
            }
            Effect::PostTurn { result } => {
                let hooks = match carry.post_turn_hooks.take() {
                    Some(hooks) => hooks,
                    None => self.hooks(HookPoint::PostTurn).await?,
                };
                Next::Input(self.post_turn(r, result, &hooks).await?)
            }
            Effect::ValidateOutput => Next::Input(Input::OutputChecked {
                verdict: crate::output::verdict(r, &carry.answer_text()),
            }),
            Effect::CheckSteering => Next::Input(Input::SteeringChecked {
                waiting: !self.queued(&r.session_id).await?.is_empty(),
                text: carry.answer_text(),
            }),
            Effect::EnqueueStep => {
                self.enqueue(r, carry).await?;
                Next::Go
            }
            Effect::ParkMessage => {
                let out = outgoing(carry.outgoing.as_ref())?;
                self.park(&out.session_id, out.message.clone(), &out.entry_id)
                    .await?;
                Next::Go
            }
            Effect::Finalize => {
                carry.record_pending = false;
                carry.replay.clear();
                carry.foreign = false;
                let held = std::mem::take(&mut carry.pending);
                self.finalize_after(r, held).await?;
                Next::Go
            }
            Effect::RepeatTerminalEffects => {
                self.repeat_terminal_effects(r).await?;
                Next::Go
            }
            Effect::Barrier => {
                self.barrier().await?;
                Next::Go
            }
            // Calls and signals.
            Effect::AbortGeneration => {
                self.fire_signal(&r.turn_id);
                // The generation in flight, if any, is the one of the current step.
                let request_id = ids::request_id(&r.turn_id, r.step);
                let _ = self
                    .inner
                    .bus
                    .call(
                        "router::abort",
                        json!({ "request_id": request_id }),
                        Some(std::time::Duration::from_secs(2)),
                    )
                    .await;
                Next::Go
            }
            Effect::StopChildren => {
                self.stop_children(r).await;
                Next::Go
            }
            Effect::CloseOpenCalls { unreached } => {
                self.close_open_calls(r, unreached).await?;
                Next::Go
            }
            Effect::CloseInterrupted(calls) => {
                self.close_interrupted_calls(r, calls).await?;
                // The calls are settled: the machine says whether the turn runs on.
                Next::Input(Input::CallSettled)
            }
            // Carried out by `write` above.
            Effect::SaveRecord
            | Effect::AppendUser
            | Effect::NoteMaxTurns
            | Effect::NoteResume { .. }
            | Effect::NoteRecovered { .. }
            | Effect::NoteNudge { .. }
            | Effect::SetAwaiting => Next::Go,
        };
        if stage {
            // A stage may have committed the batch, or added writes of its own to it.
            carry.replay.clear();
            carry.foreign = !carry.pending.is_empty();
        }
        Ok(next)
    }

    /// `EnqueueStep`. With the record in the batch, record and step are one commit (then the
    /// run's advance failpoint); without it, the step alone. Both go through
    /// [`Harness::commit_scheduling`], which builds the batch again from the run's write
    /// effects for a retry. A batch holding a stage's own writes (a step that advances right
    /// after its generation) cannot be built again: it is tried once, and its failure fails
    /// the step, as before there were retries here.
    ///
    /// A send's joined batch is tried once: if it fails, the message and record are written
    /// apart (a full disk answers here, at once) and the step alone is retried. A send whose
    /// step cannot be queued fails its new turn instead of leaving a `running` record no step
    /// will ever pick up.
    async fn enqueue(&self, r: &mut TurnRecord, carry: &mut Carry) -> Result<()> {
        let joined = std::mem::take(&mut carry.record_pending);
        let replay = std::mem::take(&mut carry.replay);
        let mut first = match joined {
            true => std::mem::take(&mut carry.pending),
            false => {
                self.flush(carry).await?;
                StepWrites::default()
            }
        };
        first.enqueue_step(r)?;
        let sid = r.session_id.clone();
        let out = carry.outgoing.as_ref();
        let tried = if !joined {
            self.commit_scheduling(&sid, first, || StepWrites::step(r))
                .await
        } else if out.is_some() || carry.foreign {
            self.commit(first).await.map(|_| ())
        } else {
            self.commit_scheduling(&sid, first, || rebuild(r, &replay, out, true))
                .await
        };
        let e = match tried {
            Ok(()) => {
                carry.enqueued = true;
                if let (true, Some(point)) = (joined, carry.advance_point) {
                    crate::failpoint::hit(point);
                }
                return Ok(());
            }
            Err(e) if out.is_none() => return Err(e),
            Err(e) if !joined => return self.unscheduled(r, e).await,
            Err(e) => e,
        };
        tracing::debug!(session = %sid, "the send's batch with its step failed, writing it apart: {e}");
        self.commit(rebuild(r, &replay, out, false)?).await?;
        if let Some(point) = carry.advance_point {
            crate::failpoint::hit(point);
        }
        let step = StepWrites::step(r)?;
        match self
            .commit_scheduling(&sid, step, || StepWrites::step(r))
            .await
        {
            Ok(()) => {
                carry.enqueued = true;
                Ok(())
            }
            Err(e) => self.unscheduled(r, e).await,
        }
    }

    /// A send whose first step cannot be queued: the machine fails its new turn (T04).
    async fn unscheduled(&self, r: &TurnRecord, e: HarnessError) -> Result<()> {
        let input = Input::EnqueueFailed {
            detail: e.to_string(),
        };
        Box::pin(self.run(Some(r.clone()), input, &mut Carry::default())).await?;
        self.barrier().await?;
        Err(e)
    }
}

/// Whether `effect` may run while the run still holds writes back: the plain writes that join
/// the batch and effects that only read the run's own state. Anything that lets another party
/// look at the session (hooks, calls, events), or writes on its own, runs after the batch is
/// committed; `Finalize` and the `Generate` stage take the batch into their own. (`PostTurn`
/// holds them when no hook sees it: the run decides that with the chain it reads.)
fn may_hold_writes(effect: &Effect) -> bool {
    matches!(
        effect,
        Effect::Skip
            | Effect::CheckSteering
            | Effect::ValidateOutput
            | Effect::Finalize
            | Effect::SaveRecord
            | Effect::EnqueueStep
            | Effect::AppendUser
            | Effect::NoteMaxTurns
            | Effect::NoteResume { .. }
            | Effect::NoteRecovered { .. }
            | Effect::NoteNudge { .. }
            | Effect::SetAwaiting
            | Effect::Prepare { .. }
            | Effect::Generate
    )
}

/// A plain write effect's writes, added to `batch`; `false` for any other effect. Apart from
/// `carry_out` so that a retry builds the same writes again from the same effects (each is
/// idempotent by its id).
fn write(
    r: &mut TurnRecord,
    effect: &Effect,
    out: Option<&Outgoing>,
    batch: &mut StepWrites,
) -> Result<bool> {
    match effect {
        Effect::SaveRecord => batch.save_record(r)?,
        Effect::AppendUser => {
            let out = outgoing(out)?;
            if let Some(text) = out
                .correction
                .as_ref()
                .filter(|_| r.turn_id == out.new_turn)
            {
                batch.append(user_append(
                    out,
                    AgentMessage::user_text(text.clone(), now_ms()),
                    &format!("{}_skills", out.entry_id),
                    &r.turn_id,
                ))?;
            }
            batch.append(user_append(
                out,
                out.message.clone(),
                &out.entry_id,
                &r.turn_id,
            ))?;
        }
        Effect::NoteMaxTurns => {
            let text = texts::max_turns_reached(r.options.max_turns);
            batch.append_custom(
                r,
                ids::max_turns_entry(&r.turn_id),
                "notice",
                json!({"reason": "max_turns", "message": text}),
            )?;
        }
        Effect::NoteResume { attempt, reason } => note_resume(batch, r, *attempt, reason)?,
        Effect::NoteRecovered { attempt } => {
            batch.append_custom(
                r,
                ids::recovery_entry(&r.turn_id, *attempt, "recovered"),
                crate::context::RECOVERY_ENTRY,
                json!({"status": "recovered", "attempt": attempt, "max_attempts": r.options.max_transient_resumes, "phase": "generation", "timestamp": now_ms()}),
            )?;
        }
        Effect::NoteNudge { attempt, text } => {
            batch.append(AppendRequest {
                session_id: r.session_id.clone(),
                message: Some(AgentMessage::user_text(text.clone(), now_ms())),
                custom: None,
                entry_id: Some(ids::nudge_entry(&r.turn_id, *attempt)),
                origin: Some(json!({"turn_id": r.turn_id, "validation": true})),
            })?;
        }
        Effect::SetAwaiting => batch.set_status(
            &r.session_id,
            SessionStatus::Working,
            Some("awaiting functions"),
        )?,
        _ => return Ok(false),
    }
    Ok(true)
}

/// The batch `effects` wrote, built again for a retry; with the step when `with_step`.
fn rebuild(
    r: &mut TurnRecord,
    effects: &[Effect],
    out: Option<&Outgoing>,
    with_step: bool,
) -> Result<StepWrites> {
    let mut batch = StepWrites::default();
    for effect in effects {
        write(r, effect, out, &mut batch)?;
    }
    if with_step {
        batch.enqueue_step(r)?;
    }
    Ok(batch)
}

fn outgoing(out: Option<&Outgoing>) -> Result<&Outgoing> {
    out.ok_or_else(|| {
        HarnessError::internal("the turn machine asked a shell without a message to write one")
    })
}

fn user_append(
    out: &Outgoing,
    message: AgentMessage,
    entry_id: &str,
    turn_id: &str,
) -> AppendRequest {
    AppendRequest {
        session_id: out.session_id.clone(),
        message: Some(message),
        custom: None,
        entry_id: Some(entry_id.to_string()),
        origin: Some(json!({ "turn_id": turn_id })),
    }
}

/// The recovery record of transient resume `attempt`. Its notice reaches the model only in the
/// system prompt of the step that resumes (see [`crate::context::resume_notice`]): stored as a
/// user message it read as the user's words, and small models echoed it into replies and
/// function arguments on every later step.
fn note_resume(batch: &mut StepWrites, rec: &TurnRecord, attempt: u32, reason: &str) -> Result<()> {
    let notice = texts::resume_notice(reason);
    batch.append_custom(
        rec,
        ids::recovery_entry(&rec.turn_id, attempt, "recovering"),
        crate::context::RECOVERY_ENTRY,
        json!({"status": "recovering", "summary": texts::RECOVERING_SUMMARY, "detail": reason,
               "phase": "generation", "attempt": attempt, "max_attempts": rec.options.max_transient_resumes,
               "partial_result_available": true, "notice": notice, "timestamp": now_ms()}),
    )
}
