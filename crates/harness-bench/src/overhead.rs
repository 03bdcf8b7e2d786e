//! Loop overhead per step (the step minus its store time), and the empty-commit yardstick.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use harness_store::Durability;

use crate::plan::Plan;
use crate::probe::{is_store_op, lock};
use crate::rig::{At, Rig, ScriptKind};
use crate::stats::{cpu_time_us, op_means, percentile_us, progress, sorted};

/// Text steps at concurrency 1, fsync off; times in µs.
pub(crate) struct Overhead {
    /// Steps sampled.
    pub(crate) steps: usize,
    /// The step less its time awaiting the store.
    pub(crate) overhead_p50: f64,
    pub(crate) overhead_p99: f64,
    /// The whole step.
    pub(crate) step_p50: f64,
    pub(crate) step_p99: f64,
    /// Time awaiting the store, and the store operations awaited, per step.
    pub(crate) store_p50: f64,
    pub(crate) store_ops_per_step: f64,
    /// One empty commit of the embedded store (None on iii: the loop's store is the engine).
    pub(crate) store_write_p50: Option<f64>,
    pub(crate) store_write_idle_p50: Option<f64>,
    /// Process CPU time (all threads) per turn of the measured run, send and ack included.
    pub(crate) cpu_per_turn_us: f64,
    /// Wall time per turn of the measured run (send → turn-completed, back to back).
    pub(crate) wall_per_turn_us: f64,
    /// Per operation: calls per step and mean µs per step, slowest first; store operations
    /// (subtracted from the overhead) and timed loop calls (part of it) apart.
    pub(crate) store_breakdown: Vec<(String, f64, f64)>,
    pub(crate) loop_breakdown: Vec<(String, f64, f64)>,
}

pub(crate) async fn overhead(at: At<'_>, plan: &Plan) -> Result<Overhead> {
    progress(&format!(
        "loop overhead per step ({} text steps, concurrency 1, fsync off)",
        plan.overhead_steps
    ));
    let rig = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    let d = rig.driver();
    d.text_loop(Instant::now() + plan.overhead_cap, 50).await?;
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(true, Ordering::Relaxed);
    let (cpu0, t0) = (cpu_time_us(), Instant::now());
    let turns = d
        .text_loop(
            Instant::now() + plan.overhead_cap,
            plan.overhead_steps as u64,
        )
        .await?;
    let (cpu1, run_wall) = (cpu_time_us(), t0.elapsed());
    rig.queue_idle().await?;
    rig.probe.sample_steps.store(false, Ordering::Relaxed);
    let samples = std::mem::take(&mut *lock(&rig.probe.steps));
    if samples.is_empty() {
        bail!("no step was measured");
    }
    let over = sorted(
        samples
            .iter()
            .map(|s| s.wall_ns.saturating_sub(s.store_ns))
            .collect(),
    );
    let wall = sorted(samples.iter().map(|s| s.wall_ns).collect());
    let store = sorted(samples.iter().map(|s| s.store_ns).collect());
    let ops: u64 = samples.iter().map(|s| s.store_ops).sum();
    let (mut store_breakdown, mut loop_breakdown) = (Vec::new(), Vec::new());
    for (op, (n, us)) in op_means(&samples) {
        let row = (op.clone(), n, us);
        if is_store_op(&op) {
            store_breakdown.push(row);
        } else {
            loop_breakdown.push(row);
        }
    }
    store_breakdown.sort_by(|a, b| b.2.total_cmp(&a.2));
    loop_breakdown.sort_by(|a, b| b.2.total_cmp(&a.2));
    // One empty commit, as a yardstick for the store's part (embedded only).
    let (store_write_p50, store_write_idle_p50) = match rig.store() {
        Some(store) => {
            let (writes, idle_writes) = store_writes(store, plan.store_writes).await?;
            (
                Some(percentile_us(&writes, 0.5)),
                Some(percentile_us(&idle_writes, 0.5)),
            )
        }
        None => (None, None),
    };
    let out = Overhead {
        steps: samples.len(),
        overhead_p50: percentile_us(&over, 0.5),
        overhead_p99: percentile_us(&over, 0.99),
        step_p50: percentile_us(&wall, 0.5),
        step_p99: percentile_us(&wall, 0.99),
        store_p50: percentile_us(&store, 0.5),
        store_ops_per_step: ops as f64 / samples.len() as f64,
        store_write_p50,
        store_write_idle_p50,
        cpu_per_turn_us: cpu1.saturating_sub(cpu0) as f64 / turns.max(1) as f64,
        wall_per_turn_us: run_wall.as_secs_f64() * 1e6 / turns.max(1) as f64,
        store_breakdown,
        loop_breakdown,
    };
    rig.close().await;
    progress(&format!(
        "  = loop overhead p50 {:.2} ms p99 {:.2} ms; whole step p50 {:.2} ms p99 {:.2} ms",
        out.overhead_p50 / 1e3,
        out.overhead_p99 / 1e3,
        out.step_p50 / 1e3,
        out.step_p99 / 1e3
    ));
    Ok(out)
}

/// `n` empty commits back to back, then `n / 4` after 1 ms of idleness each (the writer thread
/// and the waiting worker are parked and must be woken, as between the store calls of a step);
/// sorted ns.
async fn store_writes(store: &harness_store::Store, n: usize) -> Result<(Vec<u64>, Vec<u64>)> {
    let mut writes = Vec::with_capacity(n);
    for _ in 0..n {
        writes.push(empty_commit_ns(store).await?);
    }
    let mut idle_writes = Vec::with_capacity(n / 4);
    for _ in 0..n / 4 {
        tokio::time::sleep(Duration::from_millis(1)).await;
        idle_writes.push(empty_commit_ns(store).await?);
    }
    Ok((sorted(writes), sorted(idle_writes)))
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
