//! Function-call steps: what one call adds to a step beyond its target, and its fsyncs.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{bail, Result};
use harness_store::Durability;
use harness_types::api::{ExposeMode, FunctionPolicy, SendOptions};

use crate::plan::Plan;
use crate::probe::{is_store_op, lock, StepSample};
use crate::rig::{At, Rig, ScriptKind, CALL_MESSAGE, NOOP_FN, TURNS_PER_SESSION};
use crate::stats::{op_means, p50_of, percentile_us, progress, sorted};

/// `max_turns` of a function-call turn: 8 steps that each run one call + the step that ends it.
pub(crate) const FUNCTION_MAX_TURNS: u32 = 8;
/// The shorter turns of the fsync measurement (per-step fsyncs = the slope between the two).
pub(crate) const FUNCTION_SHORT_MAX_TURNS: u32 = 2;

/// paired text step.
pub(crate) struct OpRow {
    pub(crate) op: String,
    /// Charged as store time.
    pub(crate) store: bool,
    /// Calls and mean µs per call step.
    pub(crate) call_n: f64,
    pub(crate) call_us: f64,
    /// Calls and mean µs per paired text step.
    pub(crate) text_n: f64,
    pub(crate) text_us: f64,
}

/// Steps that each run one call, against text steps run alongside; times in µs.
pub(crate) struct Calls {
    /// Call steps and paired text steps measured (fsync off).
    pub(crate) steps: usize,
    pub(crate) text_steps: usize,
    /// The whole call step.
    pub(crate) step_p50: f64,
    pub(crate) step_p99: f64,
    /// Time awaiting the target (`bench::noop`).
    pub(crate) target_p50: f64,
    /// p50 of (call step − its target time).
    pub(crate) net_p50: f64,
    pub(crate) text_step_p50: f64,
    /// p50 of (step − target − store) for call steps, (step − store) for text steps.
    pub(crate) loop_p50: f64,
    pub(crate) text_loop_p50: f64,
    /// Time awaiting the store, and the store operations, per call step and per text step.
    pub(crate) store_p50: f64,
    pub(crate) text_store_p50: f64,
    pub(crate) store_ops_per_step: f64,
    pub(crate) text_store_ops_per_step: f64,
    /// Slowest (by the call step's mean) first.
    pub(crate) breakdown: Vec<OpRow>,
    /// Whole call step with fsync on.
    pub(crate) fsync_step_p50: f64,
    /// None on iii (no fsync counter: see `Rig::fsyncs`).
    pub(crate) fsyncs_per_step: Option<f64>,
    pub(crate) fsyncs_per_turn: Option<f64>,
    /// Turns of each length in the fsync measurement.
    pub(crate) fsync_turns: usize,
}

impl Calls {
    /// What one call adds to a step beyond its target: p50(call step − target) − p50(text step).
    pub(crate) fn overhead_p50(&self) -> f64 {
        self.net_p50 - self.text_step_p50
    }

    /// The same with the store's time also taken out of both.
    pub(crate) fn overhead_loop_p50(&self) -> f64 {
        self.loop_p50 - self.text_loop_p50
    }
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

pub(crate) async fn function_calls(at: At<'_>, plan: &Plan) -> Result<Calls> {
    let n = FUNCTION_MAX_TURNS as usize;
    progress(&format!(
        "function-call steps ({} call steps in turns of {n} calls + paired text steps, concurrency 1, fsync off)",
        plan.function_steps
    ));
    let rig = Rig::open(at, ScriptKind::Calls, Durability::Normal).await?;
    let d = rig.driver();
    d.call_turn(function_options(FUNCTION_MAX_TURNS)).await?;
    d.text_loop(Instant::now() + plan.function_cap, 20).await?;
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    let (mut call_turns, mut text_turns) = (HashSet::new(), HashSet::new());
    let (mut text_session, mut in_session) = (None, 0);
    let deadline = Instant::now() + plan.function_cap;
    while call_turns.len() * n < plan.function_steps && Instant::now() < deadline {
        call_turns.insert(d.call_turn(function_options(FUNCTION_MAX_TURNS)).await?);
        for _ in 0..n {
            let (sid, turn_id) = d.send(text_session.take(), None).await?;
            d.probe.wait(&turn_id).await?;
            text_turns.insert(turn_id);
            in_session += 1;
            if in_session < TURNS_PER_SESSION {
                text_session = Some(sid);
            } else {
                in_session = 0;
            }
        }
    }
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
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
    let wall = sorted(calls.iter().map(|s| s.wall_ns).collect());
    let ops = |v: &[StepSample]| {
        v.iter().map(|s| s.store_ops).sum::<u64>() as f64 / v.len().max(1) as f64
    };
    let (call_ops, text_ops) = (op_means(&calls), op_means(&text));
    let mut breakdown: Vec<OpRow> = call_ops
        .keys()
        .chain(text_ops.keys())
        .collect::<HashSet<_>>()
        .into_iter()
        .map(|op| {
            let (call_n, call_us) = call_ops.get(op).copied().unwrap_or_default();
            let (text_n, text_us) = text_ops.get(op).copied().unwrap_or_default();
            OpRow {
                op: op.clone(),
                store: is_store_op(op),
                call_n,
                call_us,
                text_n,
                text_us,
            }
        })
        .collect();
    breakdown.sort_by(|a, b| b.call_us.total_cmp(&a.call_us));
    let mut out = Calls {
        steps: calls.len(),
        text_steps: text.len(),
        step_p50: percentile_us(&wall, 0.5),
        step_p99: percentile_us(&wall, 0.99),
        target_p50: p50_of(&calls, |s| target_of(s).0),
        net_p50: p50_of(&calls, |s| s.wall_ns.saturating_sub(target_of(s).0)),
        text_step_p50: p50_of(&text, |s| s.wall_ns),
        loop_p50: p50_of(&calls, |s| {
            s.wall_ns
                .saturating_sub(target_of(s).0)
                .saturating_sub(s.store_ns)
        }),
        text_loop_p50: p50_of(&text, |s| s.wall_ns.saturating_sub(s.store_ns)),
        store_p50: p50_of(&calls, |s| s.store_ns),
        text_store_p50: p50_of(&text, |s| s.store_ns),
        store_ops_per_step: ops(&calls),
        text_store_ops_per_step: ops(&text),
        breakdown,
        fsync_step_p50: 0.0,
        fsyncs_per_step: None,
        fsyncs_per_turn: None,
        fsync_turns: 0,
    };

    progress(&format!(
        "fsyncs per function step ({} turns each of {FUNCTION_MAX_TURNS} and {FUNCTION_SHORT_MAX_TURNS} calls, concurrency 1, fsync on)",
        plan.function_fsync_turns
    ));
    let rig = Rig::open(at, ScriptKind::Calls, Durability::Full).await?;
    let d = rig.driver();
    for len in [FUNCTION_MAX_TURNS, FUNCTION_SHORT_MAX_TURNS] {
        d.call_turn(function_options(len)).await?;
    }
    rig.settle().await?;
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    // Per length: (turns, fsyncs after the send).
    let mut totals = [(0usize, 0u64); 2];
    let mut fsync_turns = HashSet::new();
    let deadline = Instant::now() + plan.function_fsync_cap;
    while totals.iter().any(|t| t.0 < plan.function_fsync_turns) && Instant::now() < deadline {
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
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
    rig.close().await;
    let mean = |(turns, fsyncs): (usize, u64)| fsyncs as f64 / turns.max(1) as f64;
    let (long, short) = (mean(totals[0]), mean(totals[1]));
    if !at.mode.is_iii() {
        out.fsyncs_per_turn = Some(long);
        out.fsyncs_per_step =
            Some((long - short) / (FUNCTION_MAX_TURNS - FUNCTION_SHORT_MAX_TURNS) as f64);
    }
    out.fsync_turns = totals[0].0.min(totals[1].0);
    let fsync_calls: Vec<StepSample> = samples
        .into_iter()
        .filter(|s| fsync_turns.contains(&s.turn_id) && target_of(s).1 == 1)
        .collect();
    out.fsync_step_p50 = p50_of(&fsync_calls, |s| s.wall_ns);
    Ok(out)
}
