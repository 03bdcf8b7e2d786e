//! The transition table, row by row, and every pair the machine must refuse.

use super::*;
use crate::record::{CallCheckpoint, Wait};
use harness_types::message::ErrorKind;

fn options() -> TurnOptions {
    TurnOptions {
        model: "m".into(),
        max_turns: 4,
        max_transient_resumes: 1,
        ..TurnOptions::default()
    }
}

fn seed(turn_id: &str) -> Box<Seed> {
    Box::new(Seed {
        session_id: "s".into(),
        turn_id: turn_id.into(),
        options: options(),
        depth: 0,
        parent: None,
        preview: None,
        functions_generation: None,
        now: 1,
    })
}

/// A record in `phase`, turn `t`, step 1 (step 0 for `Ready0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    None,
    Ready0,
    Ready,
    Generated,
    Parked,
    Completed,
    Failed,
    Cancelled,
}

const ALL_AT: [At; 8] = [
    At::None,
    At::Ready0,
    At::Ready,
    At::Generated,
    At::Parked,
    At::Completed,
    At::Failed,
    At::Cancelled,
];

fn record(at: At) -> Option<TurnRecord> {
    let mut r = seeded(*seed("t"));
    r.step = 1;
    r.turn_count = 1;
    match at {
        At::None => return None,
        At::Ready0 => {
            r.step = 0;
            r.turn_count = 0;
        }
        At::Ready => {}
        At::Generated => {
            r.generated = Some(GeneratedStep {
                step: 1,
                error: None,
            });
            r.turn_count = 2;
        }
        At::Parked => {
            r.status = TurnStatus::AwaitingFunctions;
            r.calls.insert(
                "c1".into(),
                CallCheckpoint::Pending {
                    function_id: "f".into(),
                    since: Some(1),
                    timeout_ms: None,
                    wait: Wait::Result,
                },
            );
        }
        At::Completed => r.status = TurnStatus::Completed,
        At::Failed => r.status = TurnStatus::Failed,
        At::Cancelled => r.status = TurnStatus::Cancelled,
    }
    Some(r)
}

fn call(id: &str) -> CallRef {
    CallRef {
        id: id.into(),
        function_id: "f".into(),
    }
}

fn text_answer(step: u64) -> Input {
    Input::GenerationFinished(Box::new(Finished {
        turn_id: "t".into(),
        step,
        error: None,
        text: "hi".into(),
        content: vec![ContentBlock::text("hi")],
        partial: false,
        stopped: false,
        calls: vec![],
        at_length: false,
        seen: Some((Some("e9".into()), Some(3))),
    }))
}

/// Every input kind once, with step-dependent fields for step 1.
fn inputs() -> Vec<Input> {
    vec![
        Input::Send {
            parked: false,
            seed: seed("t2"),
        },
        Input::EnqueueFailed {
            detail: "queue down".into(),
        },
        Input::RecordMissing {
            session_id: "s".into(),
            turn_id: "t".into(),
            step: 1,
            depth: 0,
            session_exists: true,
            now: 1,
        },
        Input::StepDelivered {
            turn_id: "t".into(),
            step: 1,
        },
        Input::Prepared { denied: None },
        Input::ContextRefused(ContextRefusal::Empty),
        Input::StopObserved,
        text_answer(1),
        Input::SteeringChecked {
            waiting: false,
            text: "hi".into(),
        },
        Input::OutputChecked {
            verdict: Ok(json!(1)),
        },
        Input::PostTurnChecked {
            result: json!("hi"),
            denied: None,
        },
        calls_closed(),
        Input::CallSettled,
        Input::StopRequested { turn_id: None },
        Input::Stop { turn_id: None },
        Input::Recover,
        Input::InternalError {
            turn_id: "t".into(),
            detail: "boom".into(),
        },
    ]
}

/// Which (phase, input) pairs are legal, as the module's table says. `x` = legal, `.` = refused.
/// Columns follow [`inputs`]: Send, EnqueueFailed, RecordMissing, StepDelivered, Prepared,
/// ContextRefused, StopObserved, GenerationFinished, SteeringChecked, OutputChecked,
/// PostTurnChecked, CallsClosed, CallSettled,
/// StopRequested, Stop, Recover, InternalError.
const LEGAL: [(At, &str); 8] = [
    (At::None, "x.x....x.....xx.."),
    (At::Ready0, "xx.xxxxx..x.xxxxx"),
    (At::Ready, "x..xxxxx..x.xxxxx"),
    (At::Generated, "x..x...xxxxxxxxxx"),
    (At::Parked, "x..x........xxxxx"),
    (At::Completed, "x..x...x.....xxxx"),
    (At::Failed, "x..x...x.....xxxx"),
    (At::Cancelled, "x..x...x.....xxxx"),
];

#[test]
fn every_pair_outside_the_table_is_refused_and_every_pair_in_it_is_taken() {
    let inputs = inputs();
    for (at, marks) in LEGAL {
        let marks: Vec<char> = marks.chars().collect();
        assert_eq!(marks.len(), inputs.len(), "{at:?}: one mark per input");
        for (input, mark) in inputs.iter().zip(marks) {
            let out = next(record(at), input.clone());
            match mark {
                'x' => assert!(out.is_ok(), "{at:?} × {}: refused: {out:?}", input.name()),
                _ => {
                    let err = out.expect_err(&format!("{at:?} × {} was taken", input.name()));
                    assert_eq!(err.input, input.name());
                    assert!(err.to_string().starts_with("harness/internal_error:"));
                }
            }
        }
    }
    assert_eq!(LEGAL.len(), ALL_AT.len());
}

fn phase_of(t: &Transition) -> Option<Phase> {
    t.record.as_ref().map(phase)
}

/// One row: from `at`, `input` gives `phase` and exactly `effects`.
fn row(at: At, input: Input, want_phase: Option<Phase>, effects: &[Effect]) -> Transition {
    let name = input.name();
    let t = next(record(at), input).unwrap_or_else(|e| panic!("{at:?} × {name}: {e}"));
    assert_eq!(phase_of(&t), want_phase, "{at:?} × {name}: phase");
    assert_eq!(t.effects, effects, "{at:?} × {name}: effects");
    t
}

#[test]
fn sends_seed_a_turn_steer_a_running_one_and_merge_into_a_parked_one() {
    use Effect::*;
    let new = |parked| Input::Send {
        parked,
        seed: seed("t2"),
    };
    let t = row(
        At::None,
        new(false),
        Some(Phase::Ready),
        &[AppendUser, SaveRecord, EnqueueStep],
    );
    assert_eq!(t.record.unwrap().turn_id, "t2");
    for done in [At::Completed, At::Failed, At::Cancelled] {
        let t = row(
            done,
            new(false),
            Some(Phase::Ready),
            &[AppendUser, SaveRecord, EnqueueStep],
        );
        let r = t.record.unwrap();
        assert_eq!((r.turn_id.as_str(), r.step, r.turn_count), ("t2", 0, 0));
    }
    row(
        At::None,
        new(true),
        Some(Phase::Ready),
        &[SaveRecord, EnqueueStep],
    );
    row(At::Ready, new(false), Some(Phase::Ready), &[ParkMessage]);
    row(
        At::Generated,
        new(false),
        Some(Phase::Generated),
        &[ParkMessage],
    );
    row(At::Ready, new(true), Some(Phase::Ready), &[]);
    let t = row(At::Parked, new(false), Some(Phase::Parked), &[AppendUser]);
    assert_eq!(
        t.record.unwrap().turn_id,
        "t",
        "a merge keeps the running turn"
    );
    row(At::Parked, new(true), Some(Phase::Parked), &[]);
}

#[test]
fn a_turn_that_cannot_be_scheduled_fails_with_its_reason() {
    let t = row(
        At::Ready0,
        Input::EnqueueFailed {
            detail: "queue down".into(),
        },
        Some(Phase::Failed),
        &[Effect::Finalize],
    );
    let f = t.record.unwrap().failure.unwrap();
    assert_eq!(
        (f.code.as_str(), f.phase, f.detail.as_deref()),
        (
            "harness.turn_unschedulable",
            FailurePhase::Scheduling,
            Some("queue down")
        )
    );
}

#[test]
fn a_delivered_step_is_guarded_then_prepared_or_resumed() {
    use Effect::*;
    let deliver = |turn: &str, step| Input::StepDelivered {
        turn_id: turn.into(),
        step,
    };
    row(At::Ready, deliver("t", 0), Some(Phase::Ready), &[Skip]);
    row(At::Ready, deliver("other", 1), Some(Phase::Ready), &[Skip]);
    for done in [At::Completed, At::Failed, At::Cancelled] {
        let t = next(record(done), deliver("t", 1)).unwrap();
        assert_eq!(t.effects, [RepeatTerminalEffects, Skip], "{done:?}");
    }
    row(At::Parked, deliver("t", 1), Some(Phase::Parked), &[Skip]);
    row(
        At::Ready0,
        deliver("t", 0),
        Some(Phase::Ready),
        &[Prepare { first_step: true }],
    );
    row(
        At::Ready,
        deliver("t", 1),
        Some(Phase::Ready),
        &[Prepare { first_step: false }],
    );
    row(
        At::Generated,
        deliver("t", 1),
        Some(Phase::Generated),
        &[ResumeAtCalls],
    );
    let mut aborted = record(At::Ready).unwrap();
    aborted.abort = true;
    let t = next(Some(aborted), deliver("t", 1)).unwrap();
    assert_eq!(
        (phase_of(&t), t.effects),
        (Some(Phase::Cancelled), vec![Finalize])
    );
}

#[test]
fn a_missing_record_fails_the_turn_only_when_the_session_exists() {
    let missing = |session_exists| Input::RecordMissing {
        session_id: "s".into(),
        turn_id: "t".into(),
        step: 3,
        depth: 1,
        session_exists,
        now: 1,
    };
    let t = row(
        At::None,
        missing(true),
        Some(Phase::Failed),
        &[Effect::Finalize],
    );
    let r = t.record.unwrap();
    assert_eq!((r.session_id.as_str(), r.step, r.depth), ("s", 3, 1));
    assert_eq!(r.failure.unwrap().code, "harness.turn_record_lost");
    row(At::None, missing(false), None, &[Effect::Skip]);
}

#[test]
fn preparation_ends_in_a_denial_max_turns_or_a_generation() {
    use Effect::*;
    let t = row(
        At::Ready0,
        Input::Prepared {
            denied: Some("no".into()),
        },
        Some(Phase::Failed),
        &[Finalize],
    );
    let f = t.record.unwrap().failure.unwrap();
    assert_eq!(
        (f.code.as_str(), f.phase),
        ("harness.pre_turn_denied", FailurePhase::PreTurn)
    );
    row(
        At::Ready,
        Input::Prepared { denied: None },
        Some(Phase::Ready),
        &[Generate],
    );
    let mut spent = record(At::Ready).unwrap();
    spent.turn_count = 4;
    let t = next(Some(spent), Input::Prepared { denied: None }).unwrap();
    let text = json!("max_turns (4) reached; ending the turn.");
    assert_eq!(
        t.effects,
        [
            NoteMaxTurns,
            PostTurn {
                result: text.clone()
            }
        ]
    );
    let gate = |denied| Input::PostTurnChecked {
        result: text.clone(),
        denied,
    };
    let passed = next(t.record.clone(), gate(None)).unwrap();
    assert_eq!(passed.effects, [Finalize]);
    let r = passed.record.unwrap();
    assert_eq!(r.status, TurnStatus::Completed);
    assert_eq!(r.stop_reason, Some(TurnStopReason::MaxTurns));
    assert_eq!(r.result, Some(text.clone()));
    let denied = next(t.record, gate(Some(("no".into(), None)))).unwrap();
    assert_eq!(denied.effects, [Finalize]);
    let f = denied.record.unwrap().failure.unwrap();
    assert_eq!(f.code, "harness.output_contract_invalid");
}

#[test]
fn a_refused_context_fails_with_the_matching_code_and_phase() {
    let cases = [
        (
            ContextRefusal::Overflow("big".into()),
            "harness.context_overflow",
            FailurePhase::ContextAssembly,
        ),
        (
            ContextRefusal::Empty,
            "harness.empty_context",
            FailurePhase::ContextAssembly,
        ),
        (
            ContextRefusal::Denied("no".into()),
            "harness.pre_generate_denied",
            FailurePhase::PreGenerate,
        ),
        (
            ContextRefusal::OverflowAfterHooks("big".into()),
            "harness.context_overflow",
            FailurePhase::PreGenerate,
        ),
        (
            ContextRefusal::Budget("spent".into()),
            "harness.budget_exceeded",
            FailurePhase::BudgetPreflight,
        ),
        (
            ContextRefusal::Compaction("rate limited".into()),
            "harness.context_compaction_failed",
            FailurePhase::ContextAssembly,
        ),
        (
            ContextRefusal::Manager("bad shape".into()),
            "harness.context_manager_failed",
            FailurePhase::ContextAssembly,
        ),
    ];
    for (why, code, phase) in cases {
        let retryable = matches!(why, ContextRefusal::Compaction(_));
        let t = row(
            At::Ready,
            Input::ContextRefused(why),
            Some(Phase::Failed),
            &[Effect::Finalize],
        );
        let f = t.record.unwrap().failure.unwrap();
        assert_eq!((f.code.as_str(), f.phase), (code, phase));
        assert_eq!(f.retryable, retryable, "{code}");
    }
    row(
        At::Ready,
        Input::StopObserved,
        Some(Phase::Cancelled),
        &[Effect::Finalize],
    );
}

fn answer(f: impl FnOnce(&mut Finished)) -> Input {
    let Input::GenerationFinished(mut finished) = text_answer(1) else {
        unreachable!()
    };
    f(&mut finished);
    Input::GenerationFinished(finished)
}

fn provider_error(kind: ErrorKind) -> Option<GenerationError> {
    Some(GenerationError {
        code: "router/x".into(),
        kind,
        message: "cut".into(),
        provider: Default::default(),
    })
}

/// Step `step`'s generation, ended by a provider error of `kind` after some output.
fn cut_answer(step: u64, kind: ErrorKind) -> Input {
    answer(|f| {
        f.step = step;
        f.error = provider_error(kind);
        f.partial = true;
    })
}

/// Every call of the step closed, none of them stopped.
fn calls_closed() -> Input {
    Input::CallsClosed {
        stopped: false,
        unreached: vec![],
    }
}

#[test]
fn a_finished_generation_is_recorded_once_then_decided() {
    use Effect::*;
    let t = row(
        At::Ready,
        text_answer(1),
        Some(Phase::Generated),
        &[CheckSteering],
    );
    let r = t.record.unwrap();
    assert_eq!(r.turn_count, 2, "a generation counts once");
    assert_eq!(r.watermark_entry_id.as_deref(), Some("e9"));
    assert_eq!(r.functions_generation, Some(3));
    // Replayed after a crash: already recorded, not counted again.
    let t = row(
        At::Generated,
        text_answer(1),
        Some(Phase::Generated),
        &[CheckSteering],
    );
    assert_eq!(t.record.unwrap().turn_count, 2);
    // Stale or after a stop landed mid-stream.
    row(At::Ready, text_answer(0), Some(Phase::Ready), &[Skip]);
    row(
        At::Cancelled,
        text_answer(1),
        Some(Phase::Cancelled),
        &[Skip],
    );
    row(At::None, text_answer(1), None, &[Skip]);

    row(
        At::Ready,
        answer(|f| {
            f.stopped = true;
            f.calls = vec![call("c1")];
        }),
        Some(Phase::Cancelled),
        &[
            CloseOpenCalls {
                unreached: vec![call("c1")],
            },
            Finalize,
        ],
    );
    row(
        At::Ready,
        answer(|f| f.calls = vec![call("c1")]),
        Some(Phase::Generated),
        &[DispatchCalls { cut: None }],
    );
    row(
        At::Ready,
        answer(|f| {
            f.calls = vec![call("c1")];
            f.at_length = true;
        }),
        Some(Phase::Generated),
        &[DispatchCalls {
            cut: Some("the reply hit the output limit"),
        }],
    );
    let mut resumed = record(At::Ready).unwrap();
    resumed.transient_resumes = 1;
    let t = next(Some(resumed), text_answer(1)).unwrap();
    assert_eq!(t.effects, [NoteRecovered { attempt: 1 }, CheckSteering]);
}

/// `max_turns: 1` is one generation: a cut one and its resume are that one, so the resumed
/// step is asked for, not stopped at `max_turns`.
#[test]
fn a_resume_is_part_of_the_generation_it_finishes() {
    use Effect::*;
    let mut cut = record(At::Ready).unwrap();
    std::sync::Arc::make_mut(&mut cut.options).max_turns = 1;
    cut.turn_count = 0;
    let t = next(Some(cut), cut_answer(1, ErrorKind::Transient)).unwrap();
    assert!(matches!(t.effects[0], NoteResume { attempt: 1, .. }));
    let r = t.record.unwrap();
    assert_eq!((r.turn_count, r.transient_resumes), (0, 1));
    let t = next(Some(r), Input::Prepared { denied: None }).unwrap();
    assert_eq!(t.effects, [Generate]);
    let r = t.record.unwrap();
    let t = next(
        Some(r),
        answer(|f| {
            f.step = 2;
        }),
    )
    .unwrap();
    assert_eq!(t.effects, [NoteRecovered { attempt: 1 }, CheckSteering]);
    assert_eq!(t.record.unwrap().turn_count, 1);
}

#[test]
fn a_failed_generation_resumes_once_after_partial_output_and_fails_otherwise() {
    use Effect::*;
    let t = row(
        At::Ready,
        cut_answer(1, ErrorKind::Transient),
        Some(Phase::Ready),
        &[
            NoteResume {
                attempt: 1,
                reason: "cut".into(),
            },
            SaveRecord,
            EnqueueStep,
        ],
    );
    let r = t.record.unwrap();
    assert_eq!((r.step, r.transient_resumes), (2, 1));
    assert_eq!(r.result, Some(json!("hi")), "the partial text is kept");
    // The budget is spent: the second transient failure fails the turn.
    let t = next(Some(r), cut_answer(2, ErrorKind::Transient)).unwrap();
    assert_eq!(t.effects, [Finalize]);
    let f = t.record.unwrap().failure.unwrap();
    assert_eq!(
        (f.phase, f.kind, f.retryable),
        (FailurePhase::Generation, Some(ErrorKind::Transient), true)
    );
    // No output: nothing to resume from.
    let t = row(
        At::Ready,
        answer(|f| f.error = provider_error(ErrorKind::Transient)),
        Some(Phase::Failed),
        &[Finalize],
    );
    assert_eq!(t.record.unwrap().result, None);
    // Not retryable.
    let t = row(
        At::Ready,
        cut_answer(1, ErrorKind::AuthExpired),
        Some(Phase::Failed),
        &[Finalize],
    );
    assert_eq!(
        t.record.unwrap().result_error.as_deref(),
        Some("The provider rejected the credentials.")
    );
}

#[test]
fn after_the_answer_steering_advances_and_silence_completes() {
    use Effect::*;
    let t = row(
        At::Generated,
        Input::SteeringChecked {
            waiting: true,
            text: "hi".into(),
        },
        Some(Phase::Ready),
        &[SaveRecord, EnqueueStep],
    );
    assert_eq!(t.record.unwrap().step, 2);
    let t = row(
        At::Generated,
        Input::SteeringChecked {
            waiting: false,
            text: "hi".into(),
        },
        Some(Phase::Generated),
        &[PostTurn {
            result: json!("hi"),
        }],
    );
    let t = next(
        t.record,
        Input::PostTurnChecked {
            result: json!("hi"),
            denied: None,
        },
    )
    .unwrap();
    assert_eq!(t.effects, [Finalize]);
    assert_eq!(t.record.unwrap().result, Some(json!("hi")));
}

#[test]
fn a_json_contract_validates_then_completes_nudges_or_fails_keeping_the_raw_value() {
    use Effect::*;
    let contract = |mut r: TurnRecord| {
        std::sync::Arc::make_mut(&mut r.options).output =
            harness_types::api::OutputContract::Json { schema: None };
        std::sync::Arc::make_mut(&mut r.options).max_validation_retries = Some(1);
        r
    };
    let generated = contract(record(At::Generated).unwrap());
    let t = next(
        Some(generated.clone()),
        Input::SteeringChecked {
            waiting: false,
            text: "{}".into(),
        },
    )
    .unwrap();
    assert_eq!(t.effects, [ValidateOutput]);
    let t = next(
        Some(generated.clone()),
        Input::OutputChecked {
            verdict: Ok(json!({"a": 1})),
        },
    )
    .unwrap();
    assert_eq!(
        t.effects,
        [PostTurn {
            result: json!({"a": 1})
        }]
    );
    // A post-turn hook's deny spends the same budget, with its retry prompt verbatim.
    let t = next(
        Some(generated.clone()),
        Input::PostTurnChecked {
            result: json!({"a": 1}),
            denied: Some(("too vague".into(), Some("Redo: {reason} ({value})".into()))),
        },
    )
    .unwrap();
    assert_eq!(
        t.effects[0],
        NoteNudge {
            attempt: 1,
            text: "Redo: too vague ({\"a\":1})".into()
        }
    );
    let refused = || Input::OutputChecked {
        verdict: Err(("result is not valid JSON".into(), json!("oops"))),
    };
    let t = next(Some(generated.clone()), refused()).unwrap();
    assert_eq!(
        t.effects,
        [
            NoteNudge {
                attempt: 1,
                text: crate::texts::output_nudge("result is not valid JSON")
            },
            SaveRecord,
            EnqueueStep
        ]
    );
    let mut spent = generated.clone();
    spent.validation_retries = 1;
    let t = next(Some(spent), refused()).unwrap();
    assert_eq!(t.effects, [Finalize]);
    let r = t.record.unwrap();
    let f = r.failure.clone().unwrap();
    assert_eq!(
        (f.code.as_str(), f.phase),
        (
            "harness.output_contract_invalid",
            FailurePhase::OutputValidation
        )
    );
    assert_eq!(r.result, Some(json!("oops")), "the raw value is kept");
    // A result submitted in this step is checked before anything else.
    let mut submitted = generated;
    submitted.submitted = Some(crate::output::Submitted {
        step: 1,
        value: json!({}),
        error: None,
    });
    let t = next(Some(submitted), calls_closed()).unwrap();
    assert_eq!(t.effects, [ValidateOutput]);
}

#[test]
fn closed_calls_cancel_park_or_advance() {
    use Effect::*;
    row(
        At::Generated,
        Input::CallsClosed {
            stopped: true,
            unreached: vec![call("c2")],
        },
        Some(Phase::Cancelled),
        &[
            CloseOpenCalls {
                unreached: vec![call("c2")],
            },
            Finalize,
        ],
    );
    row(
        At::Generated,
        calls_closed(),
        Some(Phase::Ready),
        &[SaveRecord, EnqueueStep],
    );
    let mut held = record(At::Generated).unwrap();
    held.calls = record(At::Parked).unwrap().calls;
    let t = next(Some(held), calls_closed()).unwrap();
    assert_eq!(
        (phase_of(&t), t.effects),
        (Some(Phase::Parked), vec![SaveRecord, SetAwaiting])
    );
}

#[test]
fn an_accepted_ask_ends_the_step_like_a_text_answer() {
    let mut asked = record(At::Generated).unwrap();
    asked.ask_step = Some(1);
    let t = next(Some(asked.clone()), calls_closed()).unwrap();
    assert_eq!(
        (phase_of(&t), t.effects),
        (Some(Phase::Generated), vec![Effect::CheckSteering])
    );
    // An ask of an earlier step does not end this one.
    asked.ask_step = Some(0);
    let t = next(Some(asked), calls_closed()).unwrap();
    assert_eq!(t.effects, [Effect::SaveRecord, Effect::EnqueueStep]);
}

#[test]
fn a_settled_call_resumes_a_parked_turn_only_when_nothing_is_pending() {
    use Effect::*;
    row(At::Parked, Input::CallSettled, Some(Phase::Parked), &[]);
    let mut settled = record(At::Parked).unwrap();
    settled.calls.insert(
        "c1".into(),
        CallCheckpoint::Done {
            function_id: "f".into(),
            entry_id: None,
            child: None,
        },
    );
    let t = next(Some(settled), Input::CallSettled).unwrap();
    assert_eq!(
        (phase_of(&t), t.effects),
        (Some(Phase::Ready), vec![SaveRecord, EnqueueStep])
    );
    // No shell settles a call of an ended turn (there is no row for it).
    assert!(next(record(At::Completed), Input::CallSettled).is_err());
}

#[test]
fn stop_cuts_the_stream_then_cancels_once() {
    use Effect::*;
    for at in [At::Ready, At::Generated, At::Parked] {
        let t = next(record(at), Input::StopRequested { turn_id: None }).unwrap();
        assert_eq!(t.effects, [AbortGeneration], "{at:?}");
        let t = next(record(at), Input::Stop { turn_id: None }).unwrap();
        assert_eq!(
            (phase_of(&t), t.effects),
            (
                Some(Phase::Cancelled),
                vec![
                    CloseOpenCalls { unreached: vec![] },
                    Finalize,
                    Barrier,
                    StopChildren
                ]
            ),
            "{at:?}"
        );
    }
    for at in [At::Completed, At::Failed, At::Cancelled] {
        assert_eq!(
            next(record(at), Input::Stop { turn_id: None })
                .unwrap()
                .effects,
            []
        );
    }
    let other = Input::Stop {
        turn_id: Some("other".into()),
    };
    row(At::Ready, other, Some(Phase::Ready), &[]);
}

#[test]
fn recovery_redrives_running_turns_and_closes_interrupted_calls_of_parked_ones() {
    use Effect::*;
    row(
        At::Ready,
        Input::Recover,
        Some(Phase::Ready),
        &[EnqueueStep],
    );
    row(
        At::Generated,
        Input::Recover,
        Some(Phase::Generated),
        &[EnqueueStep],
    );
    let mut parked = record(At::Parked).unwrap();
    parked.calls.insert(
        "c0".into(),
        CallCheckpoint::Triggered {
            function_id: "f".into(),
            breaker_key: None,
        },
    );
    let t = next(Some(parked), Input::Recover).unwrap();
    assert_eq!(t.effects, [CloseInterrupted(vec!["c0".into()])]);
    row(At::Failed, Input::Recover, Some(Phase::Failed), &[]);
}

#[test]
fn an_internal_error_fails_the_live_turn_only() {
    let t = row(
        At::Generated,
        Input::InternalError {
            turn_id: "t".into(),
            detail: "boom".into(),
        },
        Some(Phase::Failed),
        &[Effect::Finalize],
    );
    assert_eq!(
        t.record.unwrap().failure.unwrap().code,
        "harness.turn_internal"
    );
    let other = Input::InternalError {
        turn_id: "other".into(),
        detail: "boom".into(),
    };
    row(At::Ready, other, Some(Phase::Ready), &[]);
}
