//! Loop overhead per step (the step minus its store time), and the empty-commit yardstick.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use harness_store::Durability;

use crate::plan::Plan;
use crate::probe::is_store_op;
use crate::rig::{At, Rig, ScriptKind};
use crate::stats::{cpu_time_us, op_means, progress, OpMean, Percentiles, Steps};

/// Text steps at concurrency 1, fsync off; times in µs.
pub(crate) struct Overhead {
    /// The steps sampled; the loop overhead is the step outside the store.
    pub(crate) steps: Steps,
    /// One empty commit of the embedded store (None on iii: the loop's store is the engine).
    pub(crate) empty_commit: Option<EmptyCommits>,
    /// Process CPU time (all threads) per turn of the measured run, send and ack included.
    pub(crate) cpu_per_turn_us: f64,
    /// Wall time per turn of the measured run (send → turn-completed, back to back).
    pub(crate) wall_per_turn_us: f64,
    /// Per operation, slowest first; store operations (subtracted from the overhead) and timed
    /// loop calls (part of it) apart.
    pub(crate) store_breakdown: Vec<(String, OpMean)>,
    pub(crate) loop_breakdown: Vec<(String, OpMean)>,
}

pub(crate) async fn overhead(at: At<'_>, plan: &Plan) -> Result<Overhead> {
    progress!(
        "loop overhead per step ({} text steps, concurrency 1, fsync off)",
        plan.overhead_steps
    );
    let (rig, d) = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    d.text_loop(Instant::now() + plan.overhead_cap, 50).await?;
    let ((turns, cpu_us, run_wall), samples) = rig
        .sampled(async {
            let (cpu0, t0) = (cpu_time_us(), Instant::now());
            let deadline = Instant::now() + plan.overhead_cap;
            let turns = d.text_loop(deadline, plan.overhead_steps as u64).await?;
            Ok((turns, cpu_time_us().saturating_sub(cpu0), t0.elapsed()))
        })
        .await?;
    if samples.is_empty() {
        bail!("no step was measured");
    }
    let (mut store_breakdown, mut loop_breakdown): (Vec<_>, Vec<_>) = op_means(&samples)
        .into_iter()
        .partition(|(op, _)| is_store_op(op));
    store_breakdown.sort_by(|a, b| b.1.us.total_cmp(&a.1.us));
    loop_breakdown.sort_by(|a, b| b.1.us.total_cmp(&a.1.us));
    // One empty commit, as a yardstick for the store's part (embedded only).
    let empty_commit = match rig.store() {
        Some(store) => Some(empty_commits(store, plan.store_writes).await?),
        None => None,
    };
    let out = Overhead {
        steps: Steps::of(&samples),
        empty_commit,
        cpu_per_turn_us: cpu_us as f64 / turns.max(1) as f64,
        wall_per_turn_us: run_wall.as_secs_f64() * 1e6 / turns.max(1) as f64,
        store_breakdown,
        loop_breakdown,
    };
    rig.close().await;
    progress!(
        "  = loop overhead {}; whole step {}",
        out.steps.outside_store,
        out.steps.whole
    );
    Ok(out)
}

/// Empty commits back to back, and each after 1 ms of idleness.
pub(crate) struct EmptyCommits {
    pub(crate) back_to_back: Percentiles,
    pub(crate) after_idle: Percentiles,
}

/// `n` empty commits back to back, then `n / 4` after 1 ms of idleness each (the writer thread
/// and the waiting worker are parked and must be woken, as between the store calls of a step).
async fn empty_commits(store: &harness_store::Store, n: usize) -> Result<EmptyCommits> {
    let mut writes = Vec::with_capacity(n);
    for _ in 0..n {
        writes.push(empty_commit_ns(store).await?);
    }
    let mut idle_writes = Vec::with_capacity(n / 4);
    for _ in 0..n / 4 {
        tokio::time::sleep(Duration::from_millis(1)).await;
        idle_writes.push(empty_commit_ns(store).await?);
    }
    Ok(EmptyCommits {
        back_to_back: Percentiles::of(writes),
        after_idle: Percentiles::of(idle_writes),
    })
}

/// One empty commit of the store, timed.
async fn empty_commit_ns(store: &harness_store::Store) -> Result<u64> {
    let t = Instant::now();
    store
        .write(|_| Ok(()))
        .await
        .map_err(|e| anyhow!("store write: {e}"))?;
    Ok(t.elapsed().as_nanos() as u64)
}
