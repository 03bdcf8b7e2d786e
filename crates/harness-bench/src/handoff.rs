//! Step→step handoff (enqueue returned → next step starts), and fsyncs per text step.

use std::sync::atomic::Ordering;
use std::time::Instant;

use anyhow::{bail, Result};
use harness_store::Durability;
use harness_types::api::SendOptions;

use crate::plan::Plan;
use crate::probe::lock;
use crate::rig::{At, Rig, ScriptKind, TextSessions};
use crate::stats::{progress, Percentiles};

/// `max_turns` of a handoff turn: 8 generations + the step that ends the turn = 9 steps.
pub(crate) const HANDOFF_MAX_TURNS: u32 = 8;

/// Times in µs.
pub(crate) struct Handoff {
    /// A step's enqueue returned → the next step's handler starts.
    pub(crate) step: Percentiles,
    /// The send's enqueue returned → step 0 starts.
    pub(crate) send: Percentiles,
}

pub(crate) async fn handoff(at: At<'_>, plan: &Plan, durability: Durability) -> Result<Handoff> {
    let label = if durability == Durability::Full {
        "on"
    } else {
        "off"
    };
    progress!(
        "step→step handoff ({} turns of {} steps, fsync {label})",
        plan.handoff_turns,
        HANDOFF_MAX_TURNS + 1
    );
    let (rig, d) = Rig::open(at, ScriptKind::Calls, durability).await?;
    let options = || {
        Some(SendOptions {
            max_turns: Some(HANDOFF_MAX_TURNS),
            ..SendOptions::default()
        })
    };
    for _ in 0..3 {
        d.call_turn(options()).await?;
    }
    rig.queue_idle().await?;
    rig.probe.track_handoff.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + plan.handoff_cap;
    for _ in 0..plan.handoff_turns {
        if Instant::now() > deadline {
            break;
        }
        d.call_turn(options()).await?;
    }
    rig.queue_idle().await?;
    rig.probe.track_handoff.store(false, Ordering::Relaxed);
    let step = Percentiles::of(std::mem::take(&mut *lock(&rig.probe.handoff_step_ns)));
    let send = Percentiles::of(std::mem::take(&mut *lock(&rig.probe.handoff_send_ns)));
    if step.samples == 0 {
        bail!("no step→step handoff was measured (did the turns run more than one step?)");
    }
    rig.close().await;
    progress!(
        "  = step→step handoff {step}; send→step 0 p50 {:.2} ms ({} samples)",
        send.p50 / 1e3,
        step.samples
    );
    Ok(Handoff { step, send })
}

/// fsyncs of one-step text turns at concurrency 1.
pub(crate) struct Fsyncs {
    pub(crate) turns: usize,
    /// From the send's answer to the queue idle again (the step and its ack), per turn.
    pub(crate) per_step: f64,
    /// The send's own, per turn.
    pub(crate) per_send: f64,
}

pub(crate) async fn fsyncs(at: At<'_>, plan: &Plan) -> Result<Fsyncs> {
    progress!(
        "fsyncs per text step ({} turns, concurrency 1, fsync on)",
        plan.fsync_turns
    );
    let (rig, d) = Rig::open(at, ScriptKind::Text, Durability::Full).await?;
    d.text_loop(Instant::now() + plan.fsync_cap, 10).await?;
    rig.queue_idle().await?;
    let (mut in_send, mut in_step, mut turns) = (0u64, 0u64, 0usize);
    let mut sessions = TextSessions::default();
    let deadline = Instant::now() + plan.fsync_cap;
    while turns < plan.fsync_turns && Instant::now() < deadline {
        let s0 = rig.fsyncs().unwrap_or(0);
        let turn_id = sessions.send(&d).await?;
        let s1 = rig.fsyncs().unwrap_or(0);
        d.probe.wait(&turn_id).await?;
        rig.queue_idle().await?;
        let s2 = rig.fsyncs().unwrap_or(0);
        in_send += s1 - s0;
        in_step += s2 - s1;
        turns += 1;
    }
    rig.close().await;
    let n = turns.max(1) as f64;
    Ok(Fsyncs {
        turns,
        per_step: in_step as f64 / n,
        per_send: in_send as f64 / n,
    })
}
