//! One function call's life as a pure state machine: `phase + input → phase + effects`.
//!
//! A call of the model's answer is checked, passed through the pre-trigger hooks, checkpointed
//! `triggered`, run, passed through the post-trigger hooks and closed with a result entry — or
//! refused, held by a hook, left waiting for a child turn or a delivered result, cancelled by a
//! stop, timed out by the sweep, or found interrupted by a restart. harness-core's dispatch,
//! resolve, sweep, stop and recovery ask [`next`] what to do with a call and carry out the
//! [`CallEffect`]s in order; the effects that run something (checks, hooks, the target) end by
//! feeding the machine the next [`CallInput`].
//!
//! # Phases
//!
//! Four phases are stored as the call's checkpoint on the turn record ([`CallCheckpoint`]):
//! `Triggered`, the three pending waits (`Held`, `Child`, `AwaitingResult`) and `Done`; no
//! checkpoint is `Planned`. `Admitted` (the hooks are next) and `Ran` (the target answered, the
//! post-trigger hooks are next) last only while one shell holds the call: nothing else can see a
//! call in them, so only that shell's inputs are legal there.
//!
//! # Transition table
//!
//! | row | phase | input | next phase | effects |
//! |---|---|---|---|---|
//! | C01 | Planned | `Reached` | Planned | `Check` |
//! | C02 | Planned | `Reached`, stop signalled | Planned | `EndDispatch` |
//! | C03 | Triggered | `Reached` | Done | `Close(Interrupted)` |
//! | C04 | Held, Child, AwaitingResult, Done | `Reached` | same | `Skip` |
//! | C05 | Planned | `Checked(Refused)` | Done | `Close(Refused)` |
//! | C06 | Planned | `Checked(Submit)` | Done | `AnswerSubmit` |
//! | C07 | Planned | `Checked(Ask)` | Done | `AnswerAsk` |
//! | C08 | Planned | `Checked(Run)` | Admitted | `RunPreTrigger` |
//! | C09 | Admitted | `PreTrigger(Deny)` | Done | `Close(Refused(HookDenied))` |
//! | C10 | Admitted | `PreTrigger(Hold)` | Held(pre) | `Park` |
//! | C11 | Admitted | `PreTrigger(Spawn)` | Admitted | `StartChild` |
//! | C12 | Admitted | `PreTrigger(Refused)` (what runs, checked again) | Done | `Close(Refused)` |
//! | C13 | Admitted | `PreTrigger(Run)` | Triggered | `Trigger` |
//! | C14 | Admitted | `ChildStarted`, answered at once | Done | — (the spawn wrote the result) |
//! | C15 | Admitted | `ChildStarted`, waiting | Child | — (the spawn parked it) |
//! | C16 | Triggered | `TargetEnded`, stop signalled | Done | `Close(Cancelled)`, `EndDispatch` |
//! | C17 | Triggered | `TargetEnded` | Ran | `RunPostTrigger` |
//! | C18 | Ran | `PostTrigger`, held | Held(post) | `Park` |
//! | C19 | Ran | `PostTrigger` | Done | `Close(Result)` |
//! | C20 | Held, Child, AwaitingResult | `Resolve(Deliver)` | Done | `Close(Delivered)` |
//! | C21 | Held(post) | `Resolve(Execute)` | Done | `Close(HeldResult)` |
//! | C22 | Held(pre) | `Resolve(Execute)` | Admitted | `RunPreTrigger` (after the holder) |
//! | C23 | Child, AwaitingResult | `Resolve(Execute)` | same | `NotResolved` |
//! | C24 | Planned, Triggered, Done | `Resolve` | same | `NotResolved` |
//! | C25 | Held | `Swept` | Held | — (a hook hold never expires) |
//! | C26 | AwaitingResult | `Swept`, expired | AwaitingResult | `DeliverTimeout` |
//! | C27 | AwaitingResult | `Swept`, not expired | AwaitingResult | — |
//! | C28 | Child | `Swept` | Child | `ReadChild` |
//! | C29 | Child | `ChildRead`, the child's turn settled | Child | `DeliverOutcome` |
//! | C30 | Child | `ChildRead`, still running, expired | Child | `DeliverTimeout`, `StopChild` |
//! | C31 | Child | `ChildRead`, still running | Child | — |
//! | C32 | Planned, Triggered, Done | `Swept` | same | — (nothing pending) |
//! | C33 | Planned, Triggered, Held, Child, AwaitingResult | `Stop` | Done | `Close(Cancelled)` |
//! | C34 | Done | `Stop` | Done | — |
//! | C35 | Triggered | `Recover` | Done | `Close(Interrupted)` |
//!
//! A `Deliver…` effect is carried out as a `Resolve(Deliver)` of the call (row C20), under the
//! session's lock. Every other pair is illegal: [`next`] refuses it with [`Illegal`].

use serde::{Deserialize, Serialize};

use crate::record::{CallCheckpoint, HoldPoint, Wait};

/// Where a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallPhase {
    /// In the model's answer, no checkpoint yet.
    Planned,
    /// Passed the checks (or released by its holder): the pre-trigger hooks run next.
    Admitted,
    /// Checkpointed before its target runs: after a restart, it ran at most once.
    Triggered,
    /// The target answered: the post-trigger hooks run next.
    Ran,
    /// Pending: a hook holds it at this point.
    Held(HoldPoint),
    /// Pending: a spawn waits for its child's turn.
    Child,
    /// Pending: it waits for a delivered result.
    AwaitingResult,
    Done,
}

impl CallPhase {
    /// The stored phase of a call, from its checkpoint on the turn record.
    pub fn of(checkpoint: Option<&CallCheckpoint>) -> CallPhase {
        match checkpoint {
            None => CallPhase::Planned,
            Some(CallCheckpoint::Triggered { .. }) => CallPhase::Triggered,
            Some(CallCheckpoint::Done { .. }) => CallPhase::Done,
            Some(CallCheckpoint::Pending { wait, .. }) => match wait {
                Wait::Hold(h) => CallPhase::Held(h.point),
                Wait::Child { .. } => CallPhase::Child,
                Wait::Result => CallPhase::AwaitingResult,
            },
        }
    }

    fn pending(self) -> bool {
        matches!(
            self,
            CallPhase::Held(_) | CallPhase::Child | CallPhase::AwaitingResult
        )
    }
}

/// Why a call was closed without a result of its target: the `details.error` the model and
/// the transcript read (the serde names are the strings earlier versions wrote).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// Found `triggered` after a restart: it may have run, once; it never runs again.
    Interrupted,
    /// `agent_trigger` without a target function.
    AgentTriggerNoTarget,
    /// Its arguments were cut short (stream broke, output limit).
    DegradedArguments,
    /// The dispatch policy does not allow it.
    PolicyDenied,
    /// It failed twice with these arguments and the same error.
    RepeatedFailure,
    /// A pre-trigger hook denied it.
    HookDenied,
    /// A stop landed while the target ran.
    Cancelled,
    /// A `submit_result` value the output contract refused.
    InvalidResult,
    /// The control-plane wall: no model may call it, whatever its policy says.
    ControlPlane,
    /// A pending call waited past its timeout.
    PendingTimeout,
    /// A waiting spawn's child can no longer be followed.
    ChildLost,
    /// An entry a function call may not write (a user or system message, a loop record).
    ForbiddenEntry,
}

impl Refusal {
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Interrupted => "interrupted",
            Refusal::AgentTriggerNoTarget => "agent_trigger_no_target",
            Refusal::DegradedArguments => "degraded_arguments",
            Refusal::PolicyDenied => "policy_denied",
            Refusal::RepeatedFailure => "repeated_failure",
            Refusal::HookDenied => "hook_denied",
            Refusal::Cancelled => "cancelled",
            Refusal::InvalidResult => "invalid_result",
            Refusal::ControlPlane => "control_plane",
            Refusal::PendingTimeout => "pending_timeout",
            Refusal::ChildLost => "child_lost",
            Refusal::ForbiddenEntry => "forbidden_entry",
        }
    }
}

/// What the checks before the hooks found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// Refused before anything ran (cut arguments, the wall, the policy, the breaker …).
    Refused(Refusal),
    /// The output contract's own `submit_result`: answered by the loop.
    Submit,
    /// `harness::ask`: answered by the loop.
    Ask,
    /// On to the pre-trigger hooks.
    Run,
}

/// What the pre-trigger hooks decided, with what will run checked again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Deny,
    Hold,
    /// A refusal of the arguments as the hooks left them.
    Refused(Refusal),
    /// `harness::spawn`: no target, the loop starts the child.
    Spawn,
    Run,
}

/// How `harness::function::resolve` settles a pending call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// Run the held call (a pre-trigger hold), or append its kept result (post-trigger).
    Execute,
    /// Close it with the result the resolver gives.
    Deliver,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallInput {
    /// The step's dispatch reached the call; `stopped`: the stop signal had fired.
    Reached {
        stopped: bool,
    },
    Checked(Check),
    PreTrigger(Gate),
    /// The spawn's child started; `waiting`: the call waits for it (else it was answered).
    ChildStarted {
        waiting: bool,
    },
    /// The target answered, or (`cancelled`) the stop signal won the race with it.
    TargetEnded {
        cancelled: bool,
    },
    /// The post-trigger hooks ran; `held`: a hook holds the result.
    PostTrigger {
        held: bool,
    },
    Resolve(Resolution),
    /// The sweep looked at the call; `expired`: it waited past its timeout.
    Swept {
        expired: bool,
    },
    /// The sweep read a waiting spawn's child: `settled` (ended, or lost) or still running.
    ChildRead {
        settled: bool,
        expired: bool,
    },
    /// A stop closes what the turn left open.
    Stop,
    /// The process restarted and found the turn parked.
    Recover,
}

/// Which result closes a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Closing {
    /// An error result that names the refusal; the target never ran.
    Refused(Refusal),
    /// The target's result, as the post-trigger hooks left it.
    Result,
    /// The result a post-trigger hold kept, released: the target does not run again.
    HeldResult,
    /// The result a resolver delivered.
    Delivered,
    /// It may have run once before a restart; its result is unknown.
    Interrupted,
    /// A stop closed it (what the text says depends on how far it got).
    Cancelled,
}

/// The I/O a transition asks for, carried out by the shell in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallEffect {
    /// Run the checks before the hooks, then feed `Checked`.
    Check,
    /// End the step's dispatch: the stop closes what is left.
    EndDispatch,
    /// Leave the call as it is (closed, or parked by an earlier delivery of the step).
    Skip,
    /// Append the result entry and checkpoint the call `done`.
    Close(Closing),
    AnswerSubmit,
    AnswerAsk,
    /// Run the pre-trigger hooks (a released call: after its holder), then feed `PreTrigger`.
    RunPreTrigger,
    /// Start the spawn's child, then feed `ChildStarted`.
    StartChild,
    /// Checkpoint `triggered` durably, run the target racing the stop signal, feed
    /// `TargetEnded`.
    Trigger,
    /// Run the post-trigger hooks, then feed `PostTrigger`.
    RunPostTrigger,
    /// Checkpoint the call pending, with what the phase says it waits for.
    Park,
    /// Read the waiting spawn's child record, then feed `ChildRead`.
    ReadChild,
    /// Deliver the timeout's error result (through resolve).
    DeliverTimeout,
    /// Deliver the child's outcome (through resolve).
    DeliverOutcome,
    /// Stop the child of a spawn that stopped waiting for it.
    StopChild,
    /// The resolve answers `resolved: false`.
    NotResolved,
}

/// A transition: the call's phase now, what to do, and the table row that decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub phase: CallPhase,
    pub effects: Vec<CallEffect>,
    pub row: &'static str,
}

/// An input the call's phase does not accept.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("harness/internal_error: the call machine refuses {input:?} in phase {phase:?}")]
pub struct Illegal {
    pub phase: CallPhase,
    pub input: CallInput,
}

/// Every row of the table, with what it says (the coverage report lists them).
pub const ROWS: &[(&str, &str)] = &[
    ("C01", "planned, reached: check"),
    ("C02", "planned, reached after a stop: end the dispatch"),
    ("C03", "triggered, reached: interrupted"),
    ("C04", "pending or done, reached: skip"),
    ("C05", "checked: refused"),
    ("C06", "checked: submit_result answered"),
    ("C07", "checked: harness::ask answered"),
    ("C08", "checked: to the pre-trigger hooks"),
    ("C09", "pre-trigger: denied"),
    ("C10", "pre-trigger: held"),
    ("C11", "pre-trigger: a spawn starts its child"),
    ("C12", "pre-trigger: what runs refused on a second check"),
    ("C13", "pre-trigger: triggered"),
    ("C14", "child started: answered at once"),
    ("C15", "child started: waiting for it"),
    ("C16", "target ended: cancelled by a stop"),
    ("C17", "target ended: to the post-trigger hooks"),
    ("C18", "post-trigger: result held"),
    ("C19", "post-trigger: result appended"),
    ("C20", "pending, resolve deliver: delivered"),
    (
        "C21",
        "post-trigger hold, resolve execute: kept result appended",
    ),
    (
        "C22",
        "pre-trigger hold, resolve execute: hooks after the holder",
    ),
    ("C23", "child or result wait, resolve execute: not resolved"),
    ("C24", "not pending, resolve: not resolved"),
    ("C25", "hook hold, swept: left to its holder"),
    ("C26", "result wait, swept past its timeout: timed out"),
    ("C27", "result wait, swept in time: nothing"),
    ("C28", "child wait, swept: read the child"),
    ("C29", "child read, settled: its outcome delivered"),
    (
        "C30",
        "child read, running past the timeout: timed out, child stopped",
    ),
    ("C31", "child read, running: nothing"),
    ("C32", "not pending, swept: nothing"),
    ("C33", "open, stop: cancelled"),
    ("C34", "done, stop: nothing"),
    ("C35", "triggered, recovery: interrupted"),
];

/// The one transition function of a call.
pub fn next(phase: CallPhase, input: CallInput) -> Result<Transition, Illegal> {
    let t = decide(phase, input)?;
    crate::coverage::hit("call", t.row);
    Ok(t)
}

fn decide(phase: CallPhase, input: CallInput) -> Result<Transition, Illegal> {
    use CallEffect as E;
    use CallInput as I;
    use CallPhase as P;
    let to = |phase: CallPhase, row: &'static str, effects: &[CallEffect]| {
        Ok(Transition {
            phase,
            effects: effects.to_vec(),
            row,
        })
    };
    let done = |row: &'static str, closing: Closing| to(P::Done, row, &[E::Close(closing)]);
    match (phase, input) {
        (P::Planned, I::Reached { stopped: false }) => to(phase, "C01", &[E::Check]),
        (P::Planned, I::Reached { stopped: true }) => to(phase, "C02", &[E::EndDispatch]),
        (P::Triggered, I::Reached { .. }) => done("C03", Closing::Interrupted),
        (p, I::Reached { .. }) if p.pending() || p == P::Done => to(p, "C04", &[E::Skip]),

        (P::Planned, I::Checked(Check::Refused(r))) => done("C05", Closing::Refused(r)),
        (P::Planned, I::Checked(Check::Submit)) => to(P::Done, "C06", &[E::AnswerSubmit]),
        (P::Planned, I::Checked(Check::Ask)) => to(P::Done, "C07", &[E::AnswerAsk]),
        (P::Planned, I::Checked(Check::Run)) => to(P::Admitted, "C08", &[E::RunPreTrigger]),

        (P::Admitted, I::PreTrigger(gate)) => match gate {
            Gate::Deny => done("C09", Closing::Refused(Refusal::HookDenied)),
            Gate::Hold => to(P::Held(HoldPoint::PreTrigger), "C10", &[E::Park]),
            Gate::Spawn => to(P::Admitted, "C11", &[E::StartChild]),
            Gate::Refused(r) => done("C12", Closing::Refused(r)),
            Gate::Run => to(P::Triggered, "C13", &[E::Trigger]),
        },
        (P::Admitted, I::ChildStarted { waiting: false }) => to(P::Done, "C14", &[]),
        (P::Admitted, I::ChildStarted { waiting: true }) => to(P::Child, "C15", &[]),

        (P::Triggered, I::TargetEnded { cancelled: true }) => to(
            P::Done,
            "C16",
            &[E::Close(Closing::Cancelled), E::EndDispatch],
        ),
        (P::Triggered, I::TargetEnded { cancelled: false }) => {
            to(P::Ran, "C17", &[E::RunPostTrigger])
        }
        (P::Ran, I::PostTrigger { held: true }) => {
            to(P::Held(HoldPoint::PostTrigger), "C18", &[E::Park])
        }
        (P::Ran, I::PostTrigger { held: false }) => done("C19", Closing::Result),

        (p, I::Resolve(Resolution::Deliver)) if p.pending() => done("C20", Closing::Delivered),
        (P::Held(HoldPoint::PostTrigger), I::Resolve(Resolution::Execute)) => {
            done("C21", Closing::HeldResult)
        }
        (P::Held(HoldPoint::PreTrigger), I::Resolve(Resolution::Execute)) => {
            to(P::Admitted, "C22", &[E::RunPreTrigger])
        }
        (p @ (P::Child | P::AwaitingResult), I::Resolve(Resolution::Execute)) => {
            to(p, "C23", &[E::NotResolved])
        }
        (p @ (P::Planned | P::Triggered | P::Done), I::Resolve(_)) => {
            to(p, "C24", &[E::NotResolved])
        }

        (p @ P::Held(_), I::Swept { .. }) => to(p, "C25", &[]),
        (P::AwaitingResult, I::Swept { expired: true }) => {
            to(P::AwaitingResult, "C26", &[E::DeliverTimeout])
        }
        (P::AwaitingResult, I::Swept { expired: false }) => to(P::AwaitingResult, "C27", &[]),
        (P::Child, I::Swept { .. }) => to(P::Child, "C28", &[E::ReadChild]),
        (P::Child, I::ChildRead { settled: true, .. }) => to(P::Child, "C29", &[E::DeliverOutcome]),
        (
            P::Child,
            I::ChildRead {
                settled: false,
                expired: true,
            },
        ) => to(P::Child, "C30", &[E::DeliverTimeout, E::StopChild]),
        (
            P::Child,
            I::ChildRead {
                settled: false,
                expired: false,
            },
        ) => to(P::Child, "C31", &[]),
        (p @ (P::Planned | P::Triggered | P::Done), I::Swept { .. }) => to(p, "C32", &[]),

        (p, I::Stop) if p.pending() || matches!(p, P::Planned | P::Triggered) => {
            done("C33", Closing::Cancelled)
        }
        (P::Done, I::Stop) => to(P::Done, "C34", &[]),
        (P::Triggered, I::Recover) => done("C35", Closing::Interrupted),

        (phase, input) => Err(Illegal { phase, input }),
    }
}

#[cfg(test)]
mod tests;
