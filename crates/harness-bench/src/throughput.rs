//! Durable steps/s per concurrency and durability, with what the store's writer did meanwhile
//! (commits, write ops, WAL pages by table, busy time).

use std::time::Instant;

use anyhow::Result;
use harness_store::{Durability, StoreStats};
use serde_json::{json, Map, Value};

use crate::plan::Plan;
use crate::rig::{run_workers, At, Rig, ScriptKind};
use crate::stats::{cpu_time_us, per, progress, round3};

/// The concurrencies of the throughput cells (each with fsync on and off).
pub(crate) const CONCURRENCIES: [usize; 3] = [1, 10, 200];

pub(crate) struct Cell {
    pub(crate) concurrency: usize,
    pub(crate) fsync: bool,
    pub(crate) steps: u64,
    pub(crate) secs: f64,
    /// None on iii.
    pub(crate) fsyncs: Option<u64>,
    /// What the store's writer did during the cell (None on iii).
    pub(crate) store: Option<StoreDelta>,
    pub(crate) cpu_us: u64,
}

/// What the store's writer did during a cell.
pub(crate) struct StoreDelta {
    /// The store's counters over the cell: transactions committed and the write ops run in
    /// them (how well the writer groups the steps' writes), WAL pages written, and the
    /// writer's busy time and the part of it in its own checkpoints.
    pub(crate) stats: StoreStats,
    /// The WAL pages by the table or index they belong to (None if the count failed).
    pub(crate) by_table: Option<harness_store::WalPages>,
}

/// The counters `s1` has over `s0`, as a [`StoreStats`] of their own.
pub(crate) fn since(s0: StoreStats, s1: StoreStats) -> StoreStats {
    StoreStats {
        commits: s1.commits.saturating_sub(s0.commits),
        writes: s1.writes.saturating_sub(s0.writes),
        fsyncs: s1.fsyncs.saturating_sub(s0.fsyncs),
        wal_frames: s1.wal_frames.saturating_sub(s0.wal_frames),
        writer_busy_ns: s1.writer_busy_ns.saturating_sub(s0.writer_busy_ns),
        writer_checkpoint_ns: s1
            .writer_checkpoint_ns
            .saturating_sub(s0.writer_checkpoint_ns),
        wal_truncations: s1.wal_truncations.saturating_sub(s0.wal_truncations),
        syncer_busy_ns: s1.syncer_busy_ns.saturating_sub(s0.syncer_busy_ns),
        linger_waits: s1.linger_waits.saturating_sub(s0.linger_waits),
        linger_answered: s1.linger_answered.saturating_sub(s0.linger_answered),
    }
}

impl Cell {
    pub(crate) fn rate(&self) -> f64 {
        per(self.steps as f64, self.secs)
    }

    /// `n` per step of the cell, rounded to 3 decimals.
    fn per_step(&self, n: u64) -> Value {
        json!(round3(n as f64 / self.steps.max(1) as f64))
    }

    /// fsyncs per step, sends included (None on iii).
    pub(crate) fn fsyncs_per_step(&self) -> Option<f64> {
        self.fsyncs.map(|f| f as f64 / self.steps.max(1) as f64)
    }

    /// The store's commits, write ops and WAL pages and bytes per step, with the pages by
    /// table or index (`store_commits_per_step.<concurrency>`; null on iii).
    pub(crate) fn store_json(&self) -> Value {
        let Some(d) = &self.store else {
            return Value::Null;
        };
        let (stats, by_table) = (&d.stats, d.by_table.as_ref());
        let frame_bytes = by_table.map_or(0, |t| t.frame_bytes);
        let tables: Map<String, Value> = by_table
            .map(|t| {
                t.by_table
                    .iter()
                    .map(|(name, n)| (name.clone(), self.per_step(*n)))
                    .collect()
            })
            .unwrap_or_default();
        json!({
            "commits": self.per_step(stats.commits),
            "writes": self.per_step(stats.writes),
            "wal_pages": self.per_step(stats.wal_frames),
            "wal_bytes": by_table.map(|_| self.per_step(stats.wal_frames * frame_bytes)),
            "wal_pages_by_table": by_table.map(|_| Value::Object(tables)),
            "linger_waits": self.per_step(stats.linger_waits),
            "linger_answered": self.per_step(stats.linger_answered),
        })
    }

    /// The share of the cell's wall time the store's writer was busy, and in its own
    /// checkpoints (`store_writer.<concurrency>`; null on iii).
    pub(crate) fn writer_json(&self) -> Value {
        let Some(d) = &self.store else {
            return Value::Null;
        };
        let share = |ns: u64| json!(round3(ns as f64 / 1e9 / self.secs.max(1e-9)));
        json!({
            "busy": share(d.stats.writer_busy_ns),
            "checkpoint": share(d.stats.writer_checkpoint_ns),
            "syncer_busy": share(d.stats.syncer_busy_ns),
        })
    }
}

pub(crate) async fn throughput(
    at: At<'_>,
    plan: &Plan,
    concurrency: usize,
    fsync: bool,
) -> Result<Cell> {
    progress!(
        "durable steps/s at {concurrency} sessions, fsync {} ({:.1} s)",
        if fsync { "on" } else { "off" },
        plan.cell.as_secs_f64()
    );
    let durability = if fsync {
        Durability::Full
    } else {
        Durability::Normal
    };
    let (rig, d) = Rig::open(at, ScriptKind::Text, durability).await?;
    run_workers(&d, concurrency, Instant::now() + plan.cell_warmup, u64::MAX).await?;
    rig.queue_idle().await?;
    let f0 = rig.fsyncs();
    if let Some(store) = rig.store() {
        store.record_wal_pages(true);
    }
    let s0 = rig.store().map(|s| s.stats());
    let cpu0 = cpu_time_us();
    let start = Instant::now();
    let steps = run_workers(&d, concurrency, start + plan.cell, u64::MAX).await?;
    let secs = start.elapsed().as_secs_f64();
    let cpu_us = cpu_time_us().saturating_sub(cpu0);
    // Before the queue drains, so the writer's busy time covers the same span as `secs`.
    let s1 = rig.store().map(|s| s.stats());
    let by_table = rig.store().and_then(|s| {
        let pages = s.wal_pages_by_table();
        s.record_wal_pages(false);
        pages
            .map_err(|e| progress!("  WAL pages by table: {e}"))
            .ok()
    });
    rig.queue_idle().await?;
    let fsyncs = rig.fsyncs().zip(f0).map(|(f1, f0)| f1 - f0);
    let store = s0.zip(s1).map(|(s0, s1)| StoreDelta {
        stats: since(s0, s1),
        by_table,
    });
    rig.close().await;
    Ok(Cell {
        concurrency,
        fsync,
        steps,
        secs,
        fsyncs,
        store,
        cpu_us,
    })
}

/// Every cell: each concurrency with fsync on, then off.
pub(crate) async fn cells(at: At<'_>, plan: &Plan) -> Result<Vec<Cell>> {
    let mut cells = Vec::new();
    for c in CONCURRENCIES {
        for fsync in [true, false] {
            cells.push(throughput(at, plan, c, fsync).await?);
        }
    }
    Ok(cells)
}
