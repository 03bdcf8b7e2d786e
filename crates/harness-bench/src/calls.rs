//! Function-call steps: what one call adds to a step beyond its target, and its fsyncs.

use std::collections::HashSet;
use std::time::Instant;

use anyhow::{bail, Result};
use harness_store::Durability;
use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions};

use crate::plan::Plan;
use crate::probe::{is_store_op, StepSample};
use crate::rig::{At, Rig, ScriptKind, TextSessions, CALL_MESSAGE, NOOP_FN};
use crate::stats::{op_means, p50_of, progress, OpMean, Steps};

/// `max_turns` of a function-call turn: 8 steps that each run one call + the step that ends it.
pub(crate) const FUNCTION_MAX_TURNS: u32 = 8;
/// The shorter turns of the fsync measurement (per-step fsyncs = the slope between the two).
pub(crate) const FUNCTION_SHORT_MAX_TURNS: u32 = 2;

/// One operation's share of a call step, next to its share of the paired text step.
pub(crate) struct OpRow {
    pub(crate) op: String,
    /// Charged as store time.
    pub(crate) store: bool,
    pub(crate) call: OpMean,
    pub(crate) text: OpMean,
}

/// Steps that each run one call, against text steps run alongside; times in µs.
pub(crate) struct Calls {
    /// The call steps (fsync off), whole.
    pub(crate) calls: Steps,
    /// The same steps less their time awaiting the target (`bench::noop`).
    pub(crate) net: Steps,
    /// The paired text steps.
    pub(crate) text: Steps,
    /// Time awaiting the target.
    pub(crate) target_p50: f64,
    /// Slowest (by the call step's mean) first.
    pub(crate) breakdown: Vec<OpRow>,
}

impl Calls {
    /// What one call adds to a step beyond its target: p50(call step − target) − p50(text step).
    pub(crate) fn overhead_p50(&self) -> f64 {
        self.net.whole.p50 - self.text.whole.p50
    }

    /// The same with the store's time also taken out of both.
    pub(crate) fn overhead_loop_p50(&self) -> f64 {
        self.net.outside_store.p50 - self.text.outside_store.p50
    }
}

/// Call steps with fsync on.
pub(crate) struct CallFsyncs {
    /// The whole call step.
    pub(crate) step_p50: f64,
    /// None on iii (no fsync counter: see `Rig::fsyncs`).
    pub(crate) per_step: Option<f64>,
    pub(crate) per_turn: Option<f64>,
    /// Turns of each length measured.
    pub(crate) turns: usize,
}

pub(crate) fn function_options(max_turns: u32) -> Option<SendOptions> {
    Some(SendOptions {
        max_turns: Some(max_turns),
        functions: Some(FunctionPolicy {
            allow: vec!["bench::*".into()],
            deny: vec![],
            expose: ExposeMode::Native,
        }),
        ..SendOptions::default()
    })
}

/// ns the step spent awaiting `bench::noop`, and how many calls of it the step made.
pub(crate) fn target_of(s: &StepSample) -> (u64, u64) {
    s.by_op
        .get(NOOP_FN)
        .map(|(n, ns)| (*ns, *n))
        .unwrap_or((0, 0))
}

/// The call steps against their paired text steps (fsync off).
pub(crate) async fn function_calls(at: At<'_>, plan: &Plan) -> Result<Calls> {
    let n = FUNCTION_MAX_TURNS as usize;
    progress!(
        "function-call steps ({} call steps in turns of {n} calls + paired text steps, concurrency 1, fsync off)",
        plan.function_steps
    );
    let (rig, d) = Rig::open(at, ScriptKind::Calls, Durability::Normal).await?;
    d.call_turn(function_options(FUNCTION_MAX_TURNS)).await?;
    d.text_loop(Instant::now() + plan.function_cap, 20).await?;
    let (mut call_turns, mut text_turns) = (HashSet::new(), HashSet::new());
    let mut texts = TextSessions::default();
    let deadline = Instant::now() + plan.function_cap;
    let ((), samples) = rig
        .sampled(async {
            while call_turns.len() * n < plan.function_steps && Instant::now() < deadline {
                call_turns.insert(d.call_turn(function_options(FUNCTION_MAX_TURNS)).await?);
                for _ in 0..n {
                    let turn_id = texts.send(&d).await?;
                    d.probe.wait(&turn_id).await?;
                    text_turns.insert(turn_id);
                }
            }
            Ok(())
        })
        .await?;
    rig.close().await;
    // The steps that ran exactly one call (not the step that ends the turn on max_turns), and
    // the paired text steps.
    let (calls, text): (Vec<StepSample>, Vec<StepSample>) = samples
        .into_iter()
        .filter(|s| {
            (call_turns.contains(&s.turn_id) && target_of(s).1 == 1)
                || text_turns.contains(&s.turn_id)
        })
        .partition(|s| call_turns.contains(&s.turn_id));
    if calls.is_empty() || text.is_empty() {
        bail!(
            "no function-call step was measured ({} call steps, {} text steps): did {NOOP_FN} run?",
            calls.len(),
            text.len()
        );
    }
    let (call_ops, text_ops) = (op_means(&calls), op_means(&text));
    let mut breakdown: Vec<OpRow> = call_ops
        .keys()
        .chain(text_ops.keys())
        .collect::<HashSet<_>>()
        .into_iter()
        .map(|op| OpRow {
            op: op.clone(),
            store: is_store_op(op),
            call: call_ops.get(op).copied().unwrap_or_default(),
            text: text_ops.get(op).copied().unwrap_or_default(),
        })
        .collect();
    breakdown.sort_by(|a, b| b.call.us.total_cmp(&a.call.us));
    Ok(Calls {
        calls: Steps::of(&calls),
        net: Steps::less(&calls, |s| target_of(s).0),
        text: Steps::of(&text),
        target_p50: p50_of(&calls, |s| target_of(s).0),
        breakdown,
    })
}

/// A fresh fsync-on runtime alternating turns of [`FUNCTION_MAX_TURNS`] and of
/// [`FUNCTION_SHORT_MAX_TURNS`] call steps: fsyncs per call step are the slope between the two.
pub(crate) async fn call_fsyncs(at: At<'_>, plan: &Plan) -> Result<CallFsyncs> {
    progress!(
        "fsyncs per function step ({} turns each of {FUNCTION_MAX_TURNS} and {FUNCTION_SHORT_MAX_TURNS} calls, concurrency 1, fsync on)",
        plan.function_fsync_turns
    );
    let (rig, d) = Rig::open(at, ScriptKind::Calls, Durability::Full).await?;
    for len in [FUNCTION_MAX_TURNS, FUNCTION_SHORT_MAX_TURNS] {
        d.call_turn(function_options(len)).await?;
    }
    rig.settle().await?;
    // Per length: (turns, fsyncs after the send).
    let mut totals = [(0usize, 0u64); 2];
    let mut fsync_turns = HashSet::new();
    let deadline = Instant::now() + plan.function_fsync_cap;
    let ((), samples) = rig
        .sampled(async {
            while totals.iter().any(|t| t.0 < plan.function_fsync_turns)
                && Instant::now() < deadline
            {
                for (i, len) in [FUNCTION_MAX_TURNS, FUNCTION_SHORT_MAX_TURNS]
                    .into_iter()
                    .enumerate()
                {
                    let (_, turn_id) = d
                        .send_message(None, CALL_MESSAGE, function_options(len))
                        .await?;
                    // The send has fsynced before it answered: counting starts here.
                    let s1 = rig.fsyncs();
                    d.probe.wait(&turn_id).await?;
                    rig.settle().await?;
                    totals[i].0 += 1;
                    if let (Some(s1), Some(s2)) = (s1, rig.fsyncs()) {
                        totals[i].1 += s2 - s1;
                    }
                    fsync_turns.insert(turn_id);
                }
            }
            Ok(())
        })
        .await?;
    rig.close().await;
    let mean = |(turns, fsyncs): (usize, u64)| fsyncs as f64 / turns.max(1) as f64;
    let (long, short) = (mean(totals[0]), mean(totals[1]));
    let iii = at.mode.is_iii();
    let fsync_calls: Vec<StepSample> = samples
        .into_iter()
        .filter(|s| fsync_turns.contains(&s.turn_id) && target_of(s).1 == 1)
        .collect();
    Ok(CallFsyncs {
        step_p50: p50_of(&fsync_calls, |s| s.wall_ns),
        per_step: (!iii)
            .then(|| (long - short) / (FUNCTION_MAX_TURNS - FUNCTION_SHORT_MAX_TURNS) as f64),
        per_turn: (!iii).then_some(long),
        turns: totals[0].0.min(totals[1].0),
    })
}
