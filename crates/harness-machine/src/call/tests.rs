//! The call machine's table, written again as data, checked against [`next`] over every
//! (phase × input): a pair the data lists gives exactly its row, every other pair is refused.

use super::*;
use CallEffect as E;
use CallPhase as P;

const PHASES: [CallPhase; 9] = [
    P::Planned,
    P::Admitted,
    P::Triggered,
    P::Ran,
    P::Held(HoldPoint::PreTrigger),
    P::Held(HoldPoint::PostTrigger),
    P::Child,
    P::AwaitingResult,
    P::Done,
];

fn inputs() -> Vec<CallInput> {
    use CallInput as I;
    let mut all = vec![
        I::Checked(Check::Refused(Refusal::PolicyDenied)),
        I::Checked(Check::Submit),
        I::Checked(Check::Ask),
        I::Checked(Check::Run),
        I::PreTrigger(Gate::Deny),
        I::PreTrigger(Gate::Hold),
        I::PreTrigger(Gate::Refused(Refusal::ControlPlane)),
        I::PreTrigger(Gate::Spawn),
        I::PreTrigger(Gate::Run),
        I::Resolve(Resolution::Execute),
        I::Resolve(Resolution::Deliver),
        I::Stop,
        I::Recover,
    ];
    for b in [false, true] {
        all.extend([
            I::Reached { stopped: b },
            I::ChildStarted { waiting: b },
            I::TargetEnded { cancelled: b },
            I::PostTrigger { held: b },
            I::Swept { expired: b },
            I::ChildRead {
                settled: b,
                expired: false,
            },
            I::ChildRead {
                settled: b,
                expired: true,
            },
        ]);
    }
    all
}

fn pending(p: CallPhase) -> bool {
    matches!(p, P::Held(_) | P::Child | P::AwaitingResult)
}

/// The table of the module docs, row by row: which (phase, input) it takes, and what it gives.
type Row = (
    &'static str,
    fn(CallPhase, CallInput) -> bool,
    fn(CallPhase) -> CallPhase,
    &'static [CallEffect],
);

fn table() -> Vec<Row> {
    use CallInput as I;
    vec![
        (
            "C01",
            |p, i| p == P::Planned && i == I::Reached { stopped: false },
            |_| P::Planned,
            &[E::Check],
        ),
        (
            "C02",
            |p, i| p == P::Planned && i == I::Reached { stopped: true },
            |_| P::Planned,
            &[E::EndDispatch],
        ),
        (
            "C03",
            |p, i| p == P::Triggered && matches!(i, I::Reached { .. }),
            |_| P::Done,
            &[E::Close(Closing::Interrupted)],
        ),
        (
            "C04",
            |p, i| (pending(p) || p == P::Done) && matches!(i, I::Reached { .. }),
            |p| p,
            &[E::Skip],
        ),
        (
            "C05",
            |p, i| p == P::Planned && matches!(i, I::Checked(Check::Refused(_))),
            |_| P::Done,
            &[E::Close(Closing::Refused(Refusal::PolicyDenied))],
        ),
        (
            "C06",
            |p, i| p == P::Planned && i == I::Checked(Check::Submit),
            |_| P::Done,
            &[E::AnswerSubmit],
        ),
        (
            "C07",
            |p, i| p == P::Planned && i == I::Checked(Check::Ask),
            |_| P::Done,
            &[E::AnswerAsk],
        ),
        (
            "C08",
            |p, i| p == P::Planned && i == I::Checked(Check::Run),
            |_| P::Admitted,
            &[E::RunPreTrigger],
        ),
        (
            "C09",
            |p, i| p == P::Admitted && i == I::PreTrigger(Gate::Deny),
            |_| P::Done,
            &[E::Close(Closing::Refused(Refusal::HookDenied))],
        ),
        (
            "C10",
            |p, i| p == P::Admitted && i == I::PreTrigger(Gate::Hold),
            |_| P::Held(HoldPoint::PreTrigger),
            &[E::Park],
        ),
        (
            "C11",
            |p, i| p == P::Admitted && i == I::PreTrigger(Gate::Spawn),
            |_| P::Admitted,
            &[E::StartChild],
        ),
        (
            "C12",
            |p, i| p == P::Admitted && matches!(i, I::PreTrigger(Gate::Refused(_))),
            |_| P::Done,
            &[E::Close(Closing::Refused(Refusal::ControlPlane))],
        ),
        (
            "C13",
            |p, i| p == P::Admitted && i == I::PreTrigger(Gate::Run),
            |_| P::Triggered,
            &[E::Trigger],
        ),
        (
            "C14",
            |p, i| p == P::Admitted && i == I::ChildStarted { waiting: false },
            |_| P::Done,
            &[],
        ),
        (
            "C15",
            |p, i| p == P::Admitted && i == I::ChildStarted { waiting: true },
            |_| P::Child,
            &[],
        ),
        (
            "C16",
            |p, i| p == P::Triggered && i == I::TargetEnded { cancelled: true },
            |_| P::Done,
            &[E::Close(Closing::Cancelled), E::EndDispatch],
        ),
        (
            "C17",
            |p, i| p == P::Triggered && i == I::TargetEnded { cancelled: false },
            |_| P::Ran,
            &[E::RunPostTrigger],
        ),
        (
            "C18",
            |p, i| p == P::Ran && i == I::PostTrigger { held: true },
            |_| P::Held(HoldPoint::PostTrigger),
            &[E::Park],
        ),
        (
            "C19",
            |p, i| p == P::Ran && i == I::PostTrigger { held: false },
            |_| P::Done,
            &[E::Close(Closing::Result)],
        ),
        (
            "C20",
            |p, i| pending(p) && i == I::Resolve(Resolution::Deliver),
            |_| P::Done,
            &[E::Close(Closing::Delivered)],
        ),
        (
            "C21",
            |p, i| p == P::Held(HoldPoint::PostTrigger) && i == I::Resolve(Resolution::Execute),
            |_| P::Done,
            &[E::Close(Closing::HeldResult)],
        ),
        (
            "C22",
            |p, i| p == P::Held(HoldPoint::PreTrigger) && i == I::Resolve(Resolution::Execute),
            |_| P::Admitted,
            &[E::RunPreTrigger],
        ),
        (
            "C23",
            |p, i| {
                matches!(p, P::Child | P::AwaitingResult) && i == I::Resolve(Resolution::Execute)
            },
            |p| p,
            &[E::NotResolved],
        ),
        (
            "C24",
            |p, i| matches!(p, P::Planned | P::Triggered | P::Done) && matches!(i, I::Resolve(_)),
            |p| p,
            &[E::NotResolved],
        ),
        (
            "C25",
            |p, i| matches!(p, P::Held(_)) && matches!(i, I::Swept { .. }),
            |p| p,
            &[],
        ),
        (
            "C26",
            |p, i| p == P::AwaitingResult && i == I::Swept { expired: true },
            |p| p,
            &[E::DeliverTimeout],
        ),
        (
            "C27",
            |p, i| p == P::AwaitingResult && i == I::Swept { expired: false },
            |p| p,
            &[],
        ),
        (
            "C28",
            |p, i| p == P::Child && matches!(i, I::Swept { .. }),
            |p| p,
            &[E::ReadChild],
        ),
        (
            "C29",
            |p, i| p == P::Child && matches!(i, I::ChildRead { settled: true, .. }),
            |p| p,
            &[E::DeliverOutcome],
        ),
        (
            "C30",
            |p, i| {
                p == P::Child
                    && i == I::ChildRead {
                        settled: false,
                        expired: true,
                    }
            },
            |p| p,
            &[E::DeliverTimeout, E::StopChild],
        ),
        (
            "C31",
            |p, i| {
                p == P::Child
                    && i == I::ChildRead {
                        settled: false,
                        expired: false,
                    }
            },
            |p| p,
            &[],
        ),
        (
            "C32",
            |p, i| matches!(p, P::Planned | P::Triggered | P::Done) && matches!(i, I::Swept { .. }),
            |p| p,
            &[],
        ),
        (
            "C33",
            |p, i| (pending(p) || matches!(p, P::Planned | P::Triggered)) && i == I::Stop,
            |_| P::Done,
            &[E::Close(Closing::Cancelled)],
        ),
        ("C34", |p, i| p == P::Done && i == I::Stop, |_| P::Done, &[]),
        (
            "C35",
            |p, i| p == P::Triggered && i == I::Recover,
            |_| P::Done,
            &[E::Close(Closing::Interrupted)],
        ),
    ]
}

#[test]
fn every_pair_is_taken_by_exactly_its_row_or_refused() {
    let table = table();
    let mut reached = std::collections::BTreeSet::new();
    for phase in PHASES {
        for input in inputs() {
            let rows: Vec<&Row> = table.iter().filter(|r| (r.1)(phase, input)).collect();
            assert!(rows.len() <= 1, "{phase:?} × {input:?} is in two rows");
            match (next(phase, input), rows.first()) {
                (Ok(t), Some((row, _, to, effects))) => {
                    assert_eq!(
                        (t.row, t.phase, t.effects.as_slice()),
                        (*row, to(phase), *effects),
                        "{phase:?} × {input:?}"
                    );
                    reached.insert(t.row);
                }
                (Err(e), None) => assert_eq!((e.phase, e.input), (phase, input)),
                (got, want) => panic!(
                    "{phase:?} × {input:?}: the machine gives {got:?}, the table {:?}",
                    want.map(|r| r.0)
                ),
            }
        }
    }
    let all: std::collections::BTreeSet<&str> = ROWS.iter().map(|r| r.0).collect();
    assert_eq!(reached, all, "every row of the table is taken by some pair");
}

#[test]
fn a_stored_checkpoint_reads_as_its_phase() {
    use crate::record::{CallCheckpoint, ChildLink, Hold};
    let pending = |wait| CallCheckpoint::Pending {
        function_id: "f".into(),
        since: None,
        timeout_ms: None,
        wait,
    };
    let hold = |point| {
        Wait::Hold(Box::new(Hold {
            holder: "h".into(),
            point,
            arguments: serde_json::Value::Null,
            result: None,
            reconciled: None,
            annotations: None,
            breaker_key: None,
        }))
    };
    let child = Wait::Child {
        child: ChildLink {
            session_id: "c".into(),
            turn_id: "t".into(),
        },
        origin: None,
    };
    let cases = [
        (None, P::Planned),
        (
            Some(CallCheckpoint::Triggered {
                function_id: "f".into(),
                breaker_key: None,
            }),
            P::Triggered,
        ),
        (
            Some(pending(hold(HoldPoint::PostTrigger))),
            P::Held(HoldPoint::PostTrigger),
        ),
        (
            Some(pending(hold(HoldPoint::PreTrigger))),
            P::Held(HoldPoint::PreTrigger),
        ),
        (Some(pending(child)), P::Child),
        (Some(pending(Wait::Result)), P::AwaitingResult),
        (
            Some(CallCheckpoint::Done {
                function_id: "f".into(),
                entry_id: None,
                child: None,
            }),
            P::Done,
        ),
    ];
    for (cp, want) in cases {
        assert_eq!(CallPhase::of(cp.as_ref()), want, "{cp:?}");
    }
}
