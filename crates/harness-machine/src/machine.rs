//! The turn as one pure state machine: `record + input → record + effects`.
//!
//! Nothing here does I/O or awaits. The shells (`send`, `step`, `stop`, `resolve`, the sweep and
//! the recovery at start) gather an [`Input`], ask [`next`], and carry out the [`Effect`]s in the
//! order given; the stages of a step (prepare, generate, dispatch) are effects too, and each
//! ends by feeding the machine its next input. Every transition of a turn record is in the table
//! below and nowhere else.
//!
//! # Phases
//!
//! The stored [`TurnStatus`] has five values; the machine reads one more distinction off the
//! record ([`Phase`]): a running step either still has to ask the model (`Ready`) or already
//! recorded the model's answer (`Generated`: a redelivered step resumes at its calls and never
//! asks again, since a second answer could call different functions).
//!
//! # Transition table
//!
//! `Advance` = step + 1, status `running`, effects `SaveRecord, EnqueueStep`.
//! `Finish(x)` = the terminal status `x` with its reason on the record, effect `Finalize`.
//!
//! | row | phase | input | next phase | effects |
//! |---|---|---|---|---|
//! | T01 | none, or terminal | `Send` | Ready (new turn) | `AppendUser`¹, `SaveRecord`, `EnqueueStep` |
//! | T02 | Ready, Generated | `Send` | same | `ParkMessage`¹ (steering for the next step) |
//! | T03 | Parked | `Send` | Parked | `AppendUser`¹ (the next generation sees it) |
//! | T04 | Ready (step 0) | `EnqueueFailed` | Failed | `Finalize` |
//! | T05 | none | `RecordMissing` (session known) | Failed (`turn_record_lost`) | `Finalize` |
//! | T06 | none | `RecordMissing` (session unknown) | none | `Skip` |
//! | T07 | any | `StepDelivered` for another turn or step | same | `Skip` |
//! | T08 | terminal | `StepDelivered` | same | `RepeatTerminalEffects`, `Skip` |
//! | T09 | Parked | `StepDelivered` | Parked | `Skip` |
//! | T10 | Ready, aborted | `StepDelivered` | Cancelled | `Finalize` |
//! | T11 | Ready | `StepDelivered` | Ready | `Prepare` |
//! | T12 | Generated | `StepDelivered` | Generated | `ResumeAtCalls` |
//! | T13 | Ready | `Prepared` (pre-turn denied) | Failed (`pre_turn_denied`) | `Finalize` |
//! | T14 | Ready | `Prepared`, `max_turns` used up | Ready | `NoteMaxTurns`, `PostTurn` |
//! | T15 | Ready | `PostTurnChecked`, passed | Completed (`max_turns`) | `Finalize` |
//! | T16 | Ready | `PostTurnChecked`, denied | Failed (`output_contract_invalid`) | `Finalize` |
//! | T17 | Ready | `Prepared` | Ready | `Generate` |
//! | T18 | Ready | `ContextRefused` | Failed (overflow, empty, pre-generate denied, budget, compaction failed, context manager failed) | `Finalize` |
//! | T19 | Ready | `StopObserved` | Cancelled | `Finalize` |
//! | T20 | Ready, Generated | `GenerationFinished`, aborted or stopped | Cancelled | `CloseOpenCalls`, `Finalize` |
//! | T21 | Ready, Generated | `GenerationFinished`, error after partial output, resumable | Running (Advance) | `NoteResume`, Advance |
//! | T22 | Ready, Generated | `GenerationFinished`, error | Failed (the provider's class) | `Finalize` |
//! | T23 | Ready, Generated | `GenerationFinished`, calls | Generated | [`NoteRecovered`], `DispatchCalls` |
//! | T24 | Ready, Generated | `GenerationFinished`, text only | Generated | [`NoteRecovered`], `CheckSteering` |
//! | T25 | Generated | `SteeringChecked` (waiting) | Running (Advance) | Advance |
//! | T26 | Generated | `SteeringChecked` (none), text contract | Generated | `PostTurn` (the text) |
//! | T27 | Generated | `SteeringChecked` (none), JSON contract | Generated | `ValidateOutput` |
//! | T28 | Generated | `OutputChecked`, valid | Generated | `PostTurn` (the value) |
//! | T29 | Generated | `OutputChecked` invalid, or `PostTurnChecked` denied, retries left | Running (Advance) | `NoteNudge`, Advance |
//! | T30 | Generated | the same, no retry left | Failed (`output_contract_invalid`, raw kept) | `Finalize` |
//! | T31 | Generated | `PostTurnChecked`, passed | Completed (the result) | `Finalize` |
//! | T32 | Generated | `CallsClosed`, stopped | Cancelled | `CloseOpenCalls`, `Finalize` |
//! | T33 | Generated | `CallsClosed`, some pending | Parked | `SaveRecord`, `SetAwaiting` |
//! | T34 | Generated | `CallsClosed`, all closed, a result submitted | Generated | `ValidateOutput` |
//! | T35 | Generated | `CallsClosed`, all closed, an ask accepted | Generated | `CheckSteering` |
//! | T36 | Generated | `CallsClosed`, all closed | Running (Advance) | Advance |
//! | T37 | Parked | `CallSettled`, none pending | Running (Advance) | Advance |
//! | T38 | Parked | `CallSettled`, some pending | Parked | — |
//! | T39 | Running, Parked | `StopRequested` | same | `AbortGeneration` |
//! | T40 | Running, Parked | `Stop` | Cancelled | `CloseOpenCalls`, `Finalize`, `Barrier`, `StopChildren` |
//! | T41 | terminal, or another turn named | `Stop`, `StopRequested` | same | — |
//! | T42 | Running | `Recover` | same | `EnqueueStep` |
//! | T43 | Parked | `Recover` | Parked | `CloseInterrupted` (then `CallSettled`) |
//! | T44 | Running, Parked | `InternalError` | Failed (`turn_internal`) | `Finalize` |
//! | T45 | none | `Stop`, `StopRequested` | none | — |
//! | T46 | none | `GenerationFinished` (the record vanished) | none | `Skip` |
//! | T47 | any | `GenerationFinished` of another turn or step, or terminal | same | `Skip` |
//! | T49 | Ready, Generated | `CallSettled` (the step that parked it parks or advances) | same | — |
//! | T50 | terminal | `Recover` | same | — |
//! | T51 | terminal, or another turn | `InternalError` | same | — |
//!
//! ¹ unless the send already parked the message on its lock-free path.
//!
//! There is no T48: a settle of an ended turn cannot happen. Every shell that settles a call
//! (resolve, the sweep through it, recovery) holds the session lock and settles only calls of
//! a turn that has not ended, and settling a call never ends a turn; so `CallSettled` on an
//! ended turn, or on no record, is refused like any pair outside the table.
//!
//! Every other pair is illegal: [`next`] refuses it with [`Illegal`] and leaves the record as it
//! was (the shells treat that as a bug to report, never as a reason to write).

use harness_types::api::{ParentLink, TurnStatus};
use harness_types::message::ContentBlock;
use serde_json::{json, Value};

use crate::output;
use crate::record::{
    CallState, Failure, FailurePhase, GeneratedStep, GenerationError, TurnOptions, TurnRecord,
    TurnStopReason,
};
use crate::texts;

/// Every row of the table, with what it says (the coverage report lists them).
pub const ROWS: &[(&str, &str)] = &[
    ("T01", "send: a new turn"),
    ("T02", "send while running: parked as steering"),
    ("T03", "send while parked: appended"),
    ("T04", "the first step could not be enqueued"),
    ("T05", "record missing, session known: turn_record_lost"),
    ("T06", "record missing, session unknown: skip"),
    ("T07", "a step of another turn or step: skip"),
    (
        "T08",
        "a step of a terminal turn: repeat its terminal effects",
    ),
    ("T09", "a step while parked: skip"),
    ("T10", "a step of an aborted turn: cancelled"),
    ("T11", "a step: prepare"),
    (
        "T12",
        "a redelivered step that generated: resume at its calls",
    ),
    ("T13", "pre-turn denied"),
    ("T14", "max_turns used up: notice, post-turn"),
    ("T15", "max_turns notice passed: completed"),
    ("T16", "max_turns notice denied: failed"),
    ("T17", "prepared: generate"),
    ("T18", "context refused: failed"),
    ("T19", "stop observed before the generation: cancelled"),
    ("T20", "generation stopped: cancelled"),
    ("T21", "generation cut, resumable: resume"),
    ("T22", "generation failed"),
    ("T23", "generation with calls: dispatch"),
    ("T24", "text-only generation: check steering"),
    ("T25", "steering waits: advance"),
    ("T26", "no steering, text: post-turn"),
    ("T27", "no steering, JSON contract: validate"),
    ("T28", "output valid: post-turn"),
    ("T29", "result refused, retries left: nudge"),
    ("T30", "result refused, no retry left: failed"),
    ("T31", "post-turn passed: completed"),
    ("T32", "calls closed by a stop: cancelled"),
    ("T33", "calls closed, some pending: parked"),
    ("T34", "calls closed, a result submitted: validate"),
    ("T35", "calls closed, an ask accepted: check steering"),
    ("T36", "calls closed: advance"),
    ("T37", "parked, last call settled: advance"),
    ("T38", "parked, a call settled, others pending"),
    ("T39", "stop requested: abort the generation"),
    ("T40", "stop: cancelled"),
    ("T41", "stop of a terminal or another turn: nothing"),
    ("T42", "recovery of a running turn: enqueue its step"),
    ("T43", "recovery of a parked turn: close interrupted calls"),
    ("T44", "internal error: failed"),
    ("T45", "no record: a stop does nothing"),
    ("T46", "no record after the generation: skip"),
    ("T47", "a generation of a stale step or ended turn: skip"),
    ("T49", "a settle while the step runs: nothing"),
    ("T50", "recovery of an ended turn: nothing"),
    (
        "T51",
        "an internal error of an ended or another turn: nothing",
    ),
];

/// What the machine reads off a record besides its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Running; this step has not asked the model yet.
    Ready,
    /// Running; this step recorded the model's answer (its calls may still be open).
    Generated,
    /// Awaiting functions: nothing runs until a pending call settles.
    Parked,
    Completed,
    Failed,
    Cancelled,
}

pub fn phase(rec: &TurnRecord) -> Phase {
    match rec.status {
        TurnStatus::Running if rec.generated.as_ref().is_some_and(|g| g.step == rec.step) => {
            Phase::Generated
        }
        TurnStatus::Running => Phase::Ready,
        TurnStatus::AwaitingFunctions => Phase::Parked,
        TurnStatus::Completed => Phase::Completed,
        TurnStatus::Failed => Phase::Failed,
        TurnStatus::Cancelled => Phase::Cancelled,
    }
}

/// A new turn, as `harness::send` (or a spawn) asks for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Seed {
    pub session_id: String,
    pub turn_id: String,
    pub options: TurnOptions,
    pub depth: u32,
    pub parent: Option<ParentLink>,
    pub preview: Option<String>,
    /// The registry generation the session's previous turn saw.
    pub functions_generation: Option<u64>,
    pub now: i64,
}

/// Why the context could not be sent.
#[derive(Clone, Debug, PartialEq)]
pub enum ContextRefusal {
    /// `context::assemble` could not fit the history (its diagnostic).
    Overflow(String),
    /// Nothing to send.
    Empty,
    /// A pre-generate hook denied the generation (its reason).
    Denied(String),
    /// What the pre-generate hooks left no longer fits (the diagnostic).
    OverflowAfterHooks(String),
    /// The generation's reservation would exceed the turn's budget (the diagnostic).
    Budget(String),
    /// The history had to be compacted and its summary could not be written (the
    /// summarizer's error: the provider's, not the conversation's fault).
    Compaction(String),
    /// The context manager refused the request or answered something unreadable (a bug or a
    /// version mismatch, not a long conversation).
    Manager(String),
}

/// A function call of the model's answer, as the step planned it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRef {
    pub id: String,
    pub function_id: String,
}

/// How one generation ended, as the stream folded it.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub turn_id: String,
    pub step: u64,
    /// The provider's failure, if the generation failed.
    pub error: Option<GenerationError>,
    /// The text the model produced (joined text blocks).
    pub text: String,
    /// The content, for a partial result that has no text.
    pub content: Vec<ContentBlock>,
    /// Whether anything was streamed before a failure.
    pub partial: bool,
    /// The stream ended aborted, or the stop signal fired.
    pub stopped: bool,
    /// The function calls of the answer, in order.
    pub calls: Vec<CallRef>,
    /// The answer stopped at the output limit (its last call's arguments may be cut).
    pub at_length: bool,
    /// What the step saw when it built the context: the last entry and the registry generation.
    pub seen: Option<(Option<String>, Option<u64>)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A user message for this session, taken under the session lock. `parked`: the send's
    /// lock-free path already put it in the steering queue. `seed` is the turn to start if no
    /// turn runs.
    Send { parked: bool, seed: Box<Seed> },
    /// The first step of a new turn could not be enqueued.
    EnqueueFailed { detail: String },
    /// A step was delivered and the session has no turn record at all.
    RecordMissing {
        session_id: String,
        turn_id: String,
        step: u64,
        depth: u32,
        session_exists: bool,
        now: i64,
    },
    /// A step `(turn_id, step)` was delivered.
    StepDelivered { turn_id: String, step: u64 },
    /// The step drained steering and ran the pre-turn hooks (`denied`: a hook's reason).
    Prepared { denied: Option<String> },
    /// The context could not be sent.
    ContextRefused(ContextRefusal),
    /// The stop signal fired before the generation started.
    StopObserved,
    /// The generation ended (on the record as it is after the stream: a stop may have landed).
    GenerationFinished(Box<Finished>),
    /// Whether steering messages wait (asked after a text-only answer).
    SteeringChecked { waiting: bool, text: String },
    /// The post-turn hooks ran on the result the turn would complete with (`denied`: the
    /// first deny's reason and the denying binding's `retry_prompt`).
    PostTurnChecked {
        result: Value,
        denied: Option<(String, Option<String>)>,
    },
    /// The step's result checked against the output contract: the value, or why it was not
    /// accepted and the raw value.
    OutputChecked {
        verdict: Result<Value, (String, Value)>,
    },
    /// Every call of the step was taken as far as it goes; a stop leaves `unreached` the calls
    /// it never got to.
    CallsClosed {
        stopped: bool,
        unreached: Vec<CallRef>,
    },
    /// A pending call was closed (resolve, the sweep, a child's end, recovery).
    CallSettled,
    /// `harness::stop`, before taking the session lock: cut the stream.
    StopRequested { turn_id: Option<String> },
    /// `harness::stop`, under the session lock.
    Stop { turn_id: Option<String> },
    /// The process (re)started and found this record.
    Recover,
    /// A step failed on an unexpected error.
    InternalError { turn_id: String, detail: String },
}

/// The I/O a transition asks for, carried out by the shell in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Append the send's message to the transcript.
    AppendUser,
    /// Put the send's message in the steering queue for the next step.
    ParkMessage,
    /// Write the record.
    SaveRecord,
    /// Enqueue the record's current step.
    EnqueueStep,
    /// The terminal writes, in their crash-safe order (drain, reason, record, status, event,
    /// parent, reseed): `finalize.rs`.
    Finalize,
    /// A delivered step found its turn ended: publish the terminal side effects again (each is
    /// idempotent), in case a crash cut them short.
    RepeatTerminalEffects,
    /// Acknowledge the delivery as stale or duplicate.
    Skip,
    /// Stage: drain steering, mark the session working, first-step event and pre-turn hooks.
    Prepare { first_step: bool },
    /// Stage: context, pre-generate hooks, the streamed generation.
    Generate,
    /// Stage: the redelivered step re-reads the answer it recorded and closes its calls.
    ResumeAtCalls,
    /// Stage: close every call of the answer (`cut`: why its arguments may be incomplete).
    DispatchCalls { cut: Option<&'static str> },
    /// Ask whether steering messages wait.
    CheckSteering,
    /// Check the step's result against the output contract.
    ValidateOutput,
    /// The nudge after a result the contract or a post-turn hook refused (`attempt` from 1).
    NoteNudge { attempt: u32, text: String },
    /// Run the post-turn hooks on the result the turn would complete with.
    PostTurn { result: Value },
    /// The `max_turns` notice in the transcript.
    NoteMaxTurns,
    /// The recovery record and the nudge of a transient resume (`attempt` from 1).
    NoteResume { attempt: u32, reason: String },
    /// The recovery record after a resumed generation succeeded.
    NoteRecovered { attempt: u32 },
    /// The session shows "awaiting functions".
    SetAwaiting,
    /// Cut the generation in flight (signal and `router::abort`).
    AbortGeneration,
    /// Make everything so far durable before answering.
    Barrier,
    /// Stop the sub-agents this turn started.
    StopChildren,
    /// Close calls left `triggered` by a crash with the interrupted result (they ran at most
    /// once).
    CloseInterrupted(Vec<String>),
    /// A stop closes every call still open (pending, held, triggered) and every call of the
    /// answer it never reached, each with a cancelled error result saying what happened to it,
    /// so no function call is left without a result.
    CloseOpenCalls { unreached: Vec<CallRef> },
}

/// A transition: the record as it now is (`None`: there is none) and what to do.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    pub record: Option<TurnRecord>,
    pub effects: Vec<Effect>,
    /// The row of the table that decided it.
    pub row: &'static str,
}

/// An input the record's phase does not accept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("harness/internal_error: the turn machine refuses {input} in phase {phase:?}")]
pub struct Illegal {
    pub phase: Option<Phase>,
    pub input: &'static str,
}

impl Input {
    fn name(&self) -> &'static str {
        match self {
            Input::Send { .. } => "Send",
            Input::EnqueueFailed { .. } => "EnqueueFailed",
            Input::RecordMissing { .. } => "RecordMissing",
            Input::StepDelivered { .. } => "StepDelivered",
            Input::Prepared { .. } => "Prepared",
            Input::ContextRefused(_) => "ContextRefused",
            Input::StopObserved => "StopObserved",
            Input::GenerationFinished(_) => "GenerationFinished",
            Input::SteeringChecked { .. } => "SteeringChecked",
            Input::OutputChecked { .. } => "OutputChecked",
            Input::PostTurnChecked { .. } => "PostTurnChecked",
            Input::CallsClosed { .. } => "CallsClosed",
            Input::CallSettled => "CallSettled",
            Input::StopRequested { .. } => "StopRequested",
            Input::Stop { .. } => "Stop",
            Input::Recover => "Recover",
            Input::InternalError { .. } => "InternalError",
        }
    }
}

/// A fresh `running` record at step 0.
pub fn seeded(seed: Seed) -> TurnRecord {
    TurnRecord {
        turn_id: seed.turn_id,
        session_id: seed.session_id,
        status: TurnStatus::Running,
        step: 0,
        turn_count: 0,
        depth: seed.depth,
        message_preview: seed.preview,
        abort: false,
        watermark_entry_id: None,
        stream_request_id: None,
        prompt_surface: None,
        options: std::sync::Arc::new(seed.options),
        calls: Default::default(),
        parent: seed.parent,
        result: None,
        result_error: None,
        failure: None,
        transient_resumes: 0,
        stop_reason: None,
        generated: None,
        functions_generation: seed.functions_generation,
        failed_calls: Default::default(),
        noted_repairs: Vec::new(),
        ask_step: None,
        output_mode: None,
        validation_retries: 0,
        submitted: None,
        spent: Default::default(),
        trace: None,
        created_at: seed.now,
        updated_at: seed.now,
    }
}

fn failure(code: &str, phase: FailurePhase, summary: &str, detail: Option<String>) -> Failure {
    Failure {
        code: code.into(),
        phase,
        summary: summary.into(),
        detail,
        retryable: false,
        kind: None,
        provider: Default::default(),
    }
}

/// The failure of a generation the provider ended with an error.
pub fn generation_failure(err: &GenerationError) -> Failure {
    let summary = texts::provider_failure(err.kind);
    Failure {
        code: err.code.clone(),
        phase: FailurePhase::Generation,
        summary: summary.into(),
        detail: Some(err.message.clone()),
        retryable: err.kind.retryable(),
        kind: Some(err.kind),
        provider: err.provider.clone(),
    }
}

fn complete(mut rec: TurnRecord, result: Value) -> TurnRecord {
    rec.status = TurnStatus::Completed;
    rec.result = Some(result);
    rec.result_error = None;
    rec
}

fn fail(mut rec: TurnRecord, f: Failure) -> TurnRecord {
    rec.status = TurnStatus::Failed;
    rec.result_error = Some(f.summary.clone());
    rec.failure = Some(f);
    rec
}

fn cancel(mut rec: TurnRecord) -> TurnRecord {
    rec.status = TurnStatus::Cancelled;
    rec.abort = true;
    rec
}

fn advance(mut rec: TurnRecord, mut effects: Vec<Effect>) -> Transition {
    rec.step += 1;
    rec.status = TurnStatus::Running;
    effects.extend([Effect::SaveRecord, Effect::EnqueueStep]);
    to(rec, effects)
}

fn to(rec: TurnRecord, effects: Vec<Effect>) -> Transition {
    Transition {
        record: Some(rec),
        effects,
        row: "",
    }
}

/// `t`, decided by table row `row`.
fn at(row: &'static str, mut t: Transition) -> Transition {
    t.row = row;
    t
}

fn finish(rec: TurnRecord) -> Transition {
    to(rec, vec![Effect::Finalize])
}

fn stay(rec: TurnRecord) -> Transition {
    to(rec, vec![])
}

fn skip(rec: Option<TurnRecord>) -> Transition {
    Transition {
        record: rec,
        effects: vec![Effect::Skip],
        row: "",
    }
}

/// The one transition function. `rec` is the session's turn record as the shell read it (under
/// the session lock, except for `Send`'s lock-free probe and `StopRequested`).
pub fn next(rec: Option<TurnRecord>, input: Input) -> Result<Transition, Illegal> {
    let t = decide(rec, input)?;
    crate::coverage::hit("turn", t.row);
    Ok(t)
}

fn decide(rec: Option<TurnRecord>, input: Input) -> Result<Transition, Illegal> {
    let phase_now = rec.as_ref().map(phase);
    let illegal = |input: &Input| Illegal {
        phase: phase_now,
        input: input.name(),
    };
    let Some(rec) = rec else {
        return match input {
            Input::Send { parked, seed } => Ok(at("T01", start(parked, *seed))),
            Input::RecordMissing {
                session_id,
                turn_id,
                step,
                depth,
                session_exists,
                now,
            } => {
                if !session_exists {
                    return Ok(at("T06", skip(None)));
                }
                // A store that can lose recent writes (an iii engine's) lost a live turn's record.
                // It is never rebuilt from the transcript (that could run calls again): the turn
                // ends with a failure the user can read.
                let mut lost = seeded(Seed {
                    session_id,
                    turn_id: turn_id.clone(),
                    options: TurnOptions::default(),
                    depth,
                    parent: None,
                    preview: None,
                    functions_generation: None,
                    now,
                });
                lost.step = step;
                Ok(at(
                    "T05",
                    finish(fail(
                        lost,
                        failure(
                            "harness.turn_record_lost",
                            FailurePhase::Execution,
                            texts::TURN_RECORD_LOST,
                            Some(texts::turn_record_lost_detail(step, &turn_id)),
                        ),
                    )),
                ))
            }
            Input::Stop { .. } | Input::StopRequested { .. } => Ok(Transition {
                record: None,
                effects: vec![],
                row: "T45",
            }),
            // The record vanished while the model streamed: nothing is left to decide on.
            Input::GenerationFinished(_) => Ok(at("T46", skip(None))),
            other => Err(illegal(&other)),
        };
    };
    let phase = phase(&rec);
    let terminal = rec.is_terminal();
    match input {
        Input::Send { parked, seed } => Ok(match phase {
            _ if terminal => at("T01", start(parked, *seed)),
            Phase::Ready | Phase::Generated => at(
                "T02",
                to(
                    rec,
                    if parked {
                        vec![]
                    } else {
                        vec![Effect::ParkMessage]
                    },
                ),
            ),
            _ => at(
                "T03",
                to(
                    rec,
                    if parked {
                        vec![]
                    } else {
                        vec![Effect::AppendUser]
                    },
                ),
            ),
        }),
        Input::EnqueueFailed { detail } if phase == Phase::Ready && rec.step == 0 => Ok(at(
            "T04",
            finish(fail(
                rec,
                failure(
                    "harness.turn_unschedulable",
                    FailurePhase::Scheduling,
                    texts::TURN_UNSCHEDULABLE,
                    Some(detail),
                ),
            )),
        )),
        Input::StepDelivered { turn_id, step } => {
            Ok(if rec.turn_id != turn_id || rec.step != step {
                at("T07", skip(Some(rec)))
            } else if terminal {
                at(
                    "T08",
                    to(rec, vec![Effect::RepeatTerminalEffects, Effect::Skip]),
                )
            } else {
                match phase {
                    Phase::Parked => at("T09", skip(Some(rec))),
                    Phase::Ready if rec.abort => at("T10", finish(cancel(rec))),
                    Phase::Generated => at("T12", to(rec, vec![Effect::ResumeAtCalls])),
                    _ => {
                        let first_step = rec.step == 0 && rec.turn_count == 0;
                        at("T11", to(rec, vec![Effect::Prepare { first_step }]))
                    }
                }
            })
        }
        Input::Prepared { denied } if phase == Phase::Ready => Ok(match denied {
            Some(reason) => at(
                "T13",
                finish(fail(
                    rec,
                    failure(
                        "harness.pre_turn_denied",
                        FailurePhase::PreTurn,
                        texts::PRE_TURN_DENIED,
                        Some(texts::pre_turn_denied_detail(&reason)),
                    ),
                )),
            ),
            None if rec.turn_count >= rec.options.max_turns => {
                let text = texts::max_turns_reached(rec.options.max_turns);
                let mut rec = rec;
                rec.stop_reason = Some(TurnStopReason::MaxTurns);
                let gate = Effect::PostTurn {
                    result: json!(text),
                };
                at("T14", to(rec, vec![Effect::NoteMaxTurns, gate]))
            }
            None => at("T17", to(rec, vec![Effect::Generate])),
        }),
        Input::ContextRefused(why) if phase == Phase::Ready => {
            let f = match why {
                ContextRefusal::Overflow(detail) => failure(
                    "harness.context_overflow",
                    FailurePhase::ContextAssembly,
                    texts::CONTEXT_OVERFLOW,
                    Some(detail),
                ),
                ContextRefusal::Empty => failure(
                    "harness.empty_context",
                    FailurePhase::ContextAssembly,
                    texts::EMPTY_CONTEXT,
                    None,
                ),
                ContextRefusal::Denied(reason) => failure(
                    "harness.pre_generate_denied",
                    FailurePhase::PreGenerate,
                    texts::PRE_GENERATE_DENIED,
                    Some(texts::pre_generate_denied_detail(&reason)),
                ),
                ContextRefusal::OverflowAfterHooks(detail) => failure(
                    "harness.context_overflow",
                    FailurePhase::PreGenerate,
                    texts::CONTEXT_OVERFLOW,
                    Some(detail),
                ),
                ContextRefusal::Budget(detail) => failure(
                    "harness.budget_exceeded",
                    FailurePhase::BudgetPreflight,
                    texts::BUDGET_EXCEEDED,
                    Some(detail),
                ),
                ContextRefusal::Compaction(detail) => Failure {
                    retryable: true,
                    ..failure(
                        "harness.context_compaction_failed",
                        FailurePhase::ContextAssembly,
                        texts::COMPACTION_FAILED,
                        Some(detail),
                    )
                },
                ContextRefusal::Manager(detail) => failure(
                    "harness.context_manager_failed",
                    FailurePhase::ContextAssembly,
                    texts::CONTEXT_MANAGER_FAILED,
                    Some(detail),
                ),
            };
            Ok(at("T18", finish(fail(rec, f))))
        }
        Input::StopObserved if phase == Phase::Ready => Ok(at("T19", finish(cancel(rec)))),
        Input::GenerationFinished(f) => {
            if rec.turn_id != f.turn_id || rec.step != f.step || terminal {
                // A stop finalized the turn while the model streamed, or the step is stale.
                return Ok(at("T47", skip(Some(rec))));
            }
            if !matches!(phase, Phase::Ready | Phase::Generated) {
                return Err(illegal(&Input::GenerationFinished(f)));
            }
            Ok(generation_finished(rec, phase, *f))
        }
        Input::SteeringChecked { waiting, text } if phase == Phase::Generated => Ok(if waiting {
            // Steering arrived while the model was answering: it gets to react.
            at("T25", advance(rec, vec![]))
        } else if output::json_contract(&rec.options.output).is_some() {
            at("T27", to(rec, vec![Effect::ValidateOutput]))
        } else {
            let gate = Effect::PostTurn {
                result: json!(text),
            };
            at("T26", to(rec, vec![gate]))
        }),
        Input::OutputChecked { verdict } if phase == Phase::Generated => Ok(match verdict {
            Ok(result) => at("T28", to(rec, vec![Effect::PostTurn { result }])),
            Err((error, raw)) => {
                let text = texts::output_nudge(&error);
                refused(rec, error, text, raw)
            }
        }),
        Input::PostTurnChecked { result, denied } if phase == Phase::Generated => {
            Ok(match denied {
                None => at("T31", finish(complete(rec, result))),
                Some((reason, retry_prompt)) => {
                    let text = match retry_prompt {
                        Some(p) => p
                            .replace("{reason}", &reason)
                            .replace("{value}", &compact(&result)),
                        None => texts::output_nudge(&reason),
                    };
                    let error = texts::post_turn_refused(&reason);
                    refused(rec, error, text, result)
                }
            })
        }
        // The max_turns notice at the start of a step: there is no generation left to re-prompt.
        Input::PostTurnChecked { result, denied } if phase == Phase::Ready => Ok(match denied {
            None => at("T15", finish(complete(rec, result))),
            Some((reason, _)) => {
                let detail = texts::post_turn_refused(&reason);
                at("T16", finish(contract_failed(rec, detail, result)))
            }
        }),
        Input::CallsClosed { stopped, unreached } if phase == Phase::Generated => Ok(if stopped {
            at(
                "T32",
                to(
                    cancel(rec),
                    vec![Effect::CloseOpenCalls { unreached }, Effect::Finalize],
                ),
            )
        } else if rec.has_pending() {
            let mut rec = rec;
            rec.status = TurnStatus::AwaitingFunctions;
            at(
                "T33",
                to(rec, vec![Effect::SaveRecord, Effect::SetAwaiting]),
            )
        } else if rec.submitted.as_ref().is_some_and(|s| s.step == rec.step) {
            // A submitted result is checked first: it ends the turn or earns a nudge.
            at("T34", to(rec, vec![Effect::ValidateOutput]))
        } else if rec.ask_step == Some(rec.step) {
            // The turn ends on the question, like a text-only answer (steering still advances).
            at("T35", to(rec, vec![Effect::CheckSteering]))
        } else {
            at("T36", advance(rec, vec![]))
        }),
        Input::CallSettled if phase == Phase::Parked => Ok(if rec.has_pending() {
            at("T38", stay(rec))
        } else {
            at("T37", advance(rec, vec![]))
        }),
        // A settle while the step that parked it still runs: that step parks or advances.
        Input::CallSettled if !terminal => Ok(at("T49", stay(rec))),
        Input::StopRequested { turn_id } => {
            Ok(if terminal || turn_id.is_some_and(|t| t != rec.turn_id) {
                at("T41", stay(rec))
            } else {
                at("T39", to(rec, vec![Effect::AbortGeneration]))
            })
        }
        Input::Stop { turn_id } => Ok(if terminal || turn_id.is_some_and(|t| t != rec.turn_id) {
            at("T41", stay(rec))
        } else {
            at(
                "T40",
                to(
                    cancel(rec),
                    vec![
                        Effect::CloseOpenCalls { unreached: vec![] },
                        Effect::Finalize,
                        Effect::Barrier,
                        Effect::StopChildren,
                    ],
                ),
            )
        }),
        Input::Recover => Ok(match phase {
            Phase::Ready | Phase::Generated => at("T42", to(rec, vec![Effect::EnqueueStep])),
            Phase::Parked => {
                let interrupted: Vec<String> = rec
                    .calls
                    .iter()
                    .filter(|(_, c)| c.state() == CallState::Triggered)
                    .map(|(id, _)| id.clone())
                    .collect();
                at("T43", to(rec, vec![Effect::CloseInterrupted(interrupted)]))
            }
            _ => at("T50", stay(rec)),
        }),
        Input::InternalError { turn_id, detail } => Ok(if terminal || rec.turn_id != turn_id {
            at("T51", stay(rec))
        } else {
            at(
                "T44",
                finish(fail(
                    rec,
                    failure(
                        "harness.turn_internal",
                        FailurePhase::Execution,
                        texts::TURN_INTERNAL,
                        Some(detail),
                    ),
                )),
            )
        }),
        other => Err(illegal(&other)),
    }
}

/// A result the contract or a post-turn hook refused: a nudge and another generation while the
/// validation budget lasts, then a failure that keeps the raw value.
fn refused(rec: TurnRecord, error: String, nudge: String, raw: Value) -> Transition {
    let max = rec
        .options
        .max_validation_retries
        .unwrap_or(output::DEFAULT_MAX_VALIDATION_RETRIES);
    if rec.validation_retries < max {
        let mut rec = rec;
        rec.validation_retries += 1;
        let note = Effect::NoteNudge {
            attempt: rec.validation_retries,
            text: nudge,
        };
        return at("T29", advance(rec, vec![note]));
    }
    at("T30", finish(contract_failed(rec, error, raw)))
}

/// The turn fails on its output contract (`detail`: why), keeping the `raw` result refused.
fn contract_failed(rec: TurnRecord, detail: String, raw: Value) -> TurnRecord {
    let mut rec = fail(
        rec,
        failure(
            "harness.output_contract_invalid",
            FailurePhase::OutputValidation,
            texts::OUTPUT_CONTRACT_INVALID,
            Some(detail),
        ),
    );
    rec.result = Some(raw);
    rec
}

fn compact(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A new turn, from no record or a terminal one.
fn start(parked: bool, seed: Seed) -> Transition {
    let rec = seeded(seed);
    let mut effects = Vec::with_capacity(3);
    if !parked {
        effects.push(Effect::AppendUser);
    }
    effects.extend([Effect::SaveRecord, Effect::EnqueueStep]);
    to(rec, effects)
}

fn generation_finished(mut rec: TurnRecord, phase: Phase, f: Finished) -> Transition {
    if phase == Phase::Ready {
        if let Some((watermark, generation)) = f.seen.clone() {
            rec.watermark_entry_id = watermark;
            rec.functions_generation = generation;
        }
        rec.turn_count += 1;
        rec.generated = Some(GeneratedStep {
            step: rec.step,
            error: f.error.clone(),
        });
    }
    if f.stopped {
        let unreached = f
            .calls
            .into_iter()
            .filter(|c| !rec.calls.contains_key(&c.id))
            .collect();
        return at(
            "T20",
            to(
                cancel(rec),
                vec![Effect::CloseOpenCalls { unreached }, Effect::Finalize],
            ),
        );
    }
    if let Some(err) = &f.error {
        if f.partial {
            rec.result = Some(if f.text.trim().is_empty() {
                json!(f.content)
            } else {
                json!(f.text)
            });
        }
        // A resume finishes the generation that was cut, within the same turn: the cut one is
        // not counted, so `max_turns: 1` (one generation) still gets its answer. The resume
        // budget bounds how often that can happen.
        if f.partial
            && err.kind.retryable()
            && rec.transient_resumes < rec.options.max_transient_resumes
        {
            if phase == Phase::Ready {
                rec.turn_count = rec.turn_count.saturating_sub(1);
            }
            rec.transient_resumes += 1;
            let note = Effect::NoteResume {
                attempt: rec.transient_resumes,
                reason: err.message.clone(),
            };
            return at("T21", advance(rec, vec![note]));
        }
        let failed = generation_failure(err);
        return at("T22", finish(fail(rec, failed)));
    }
    let mut effects = Vec::with_capacity(2);
    if rec.transient_resumes > 0 {
        effects.push(Effect::NoteRecovered {
            attempt: rec.transient_resumes,
        });
    }
    let row = if !f.calls.is_empty() {
        let cut = f.at_length.then_some(texts::CUT_AT_OUTPUT_LIMIT);
        effects.push(Effect::DispatchCalls { cut });
        "T23"
    } else {
        effects.push(Effect::CheckSteering);
        "T24"
    };
    at(row, to(rec, effects))
}

#[cfg(test)]
mod tests;
