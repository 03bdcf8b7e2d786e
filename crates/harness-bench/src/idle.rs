//! RAM per idle session: the resident set a session with one completed turn adds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use harness_store::Durability;

use crate::host::Host;
use crate::plan::Plan;
use crate::rig::{At, Driver, Rig, ScriptKind};
use crate::stats::{per, progress, rss_bytes};

/// Sends in flight while filling the idle sessions.
const IDLE_FILL_CONCURRENCY: usize = 64;

/// Hands freed heap back to the OS, so RSS tracks live memory rather than allocator caches.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub(crate) fn trim_heap() {
    extern "C" {
        fn malloc_trim(pad: usize) -> std::os::raw::c_int;
    }
    // SAFETY: malloc_trim only releases free memory of glibc's own arenas; no pointer is passed.
    unsafe {
        malloc_trim(0);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub(crate) fn trim_heap() {}

/// Runs the host's memory release on every worker of the runtime (each frees what its own
/// thread holds): one task per worker, held at a barrier until all of them ran, so no worker
/// runs two.
pub(crate) async fn release_free_memory(host: &dyn Host) {
    let Some(release) = host.memory_release() else {
        return;
    };
    let workers = tokio::runtime::Handle::current().metrics().num_workers();
    let barrier = Arc::new(std::sync::Barrier::new(workers));
    let tasks: Vec<_> = (0..workers)
        .map(|_| {
            let barrier = barrier.clone();
            tokio::spawn(async move {
                release();
                barrier.wait();
            })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    release();
}

pub(crate) async fn settled_rss(host: &dyn Host) -> u64 {
    tokio::time::sleep(Duration::from_millis(100)).await;
    release_free_memory(host).await;
    trim_heap();
    rss_bytes().unwrap_or(0)
}

pub(crate) struct IdleRam {
    /// Sessions filled (each with one completed turn).
    pub(crate) sessions: usize,
    /// RSS growth over all of them, and over the second half only, per session.
    pub(crate) bytes_per_session: f64,
    pub(crate) marginal_bytes: f64,
    /// RSS before the first session and after the last.
    pub(crate) rss_before: u64,
    pub(crate) rss_after: u64,
    /// SQLite's own heap (every connection's page cache, statements, schema) at the same two
    /// moments: the share of the RSS the store's connections hold.
    pub(crate) sqlite_before: i64,
    pub(crate) sqlite_after: i64,
}

/// Fills `n` sessions (one completed turn each, 64 in flight) until done or `cap` runs out.
pub(crate) async fn fill_sessions(d: &Driver, n: usize, cap: Duration) -> Result<usize> {
    let deadline = Instant::now() + cap;
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..IDLE_FILL_CONCURRENCY.min(n) {
        let d = d.clone();
        let next = next.clone();
        tasks.spawn(async move {
            let mut made = 0usize;
            while (next.fetch_add(1, Ordering::Relaxed) as usize) < n && Instant::now() < deadline {
                d.turn(None, None).await?;
                made += 1;
            }
            anyhow::Ok(made)
        });
    }
    let mut made = 0;
    while let Some(r) = tasks.join_next().await {
        made += r.context("bench worker panicked")??;
    }
    Ok(made)
}

pub(crate) async fn idle_ram(at: At<'_>, plan: &Plan) -> Result<IdleRam> {
    progress!(
        "RAM per idle session ({} sessions, fsync off)",
        plan.idle_sessions
    );
    let (rig, d) = Rig::open(at, ScriptKind::Text, Durability::Normal).await?;
    // Warm-up: the runtime's fixed costs (threads, connections, statement caches) land before the baseline.
    fill_sessions(&d, 100, Duration::from_secs(2)).await?;
    rig.queue_idle().await?;
    let rss_before = settled_rss(at.host).await;
    let sqlite_before = harness_store::Store::sqlite_heap_bytes();
    let cap_end = Instant::now() + plan.idle_cap;
    let half = plan.idle_sessions / 2;
    let made_half = fill_sessions(&d, half, plan.idle_cap).await?;
    rig.queue_idle().await?;
    let rss_half = settled_rss(at.host).await;
    let left = cap_end.saturating_duration_since(Instant::now());
    let made_rest = fill_sessions(&d, plan.idle_sessions - half, left).await?;
    rig.queue_idle().await?;
    let rss_after = settled_rss(at.host).await;
    let sqlite_after = harness_store::Store::sqlite_heap_bytes();
    let sessions = made_half + made_rest;
    if sessions < plan.idle_sessions {
        progress!("  time cap reached: measured {sessions} sessions");
    }
    let grown = |from: u64, to: u64| to.saturating_sub(from) as f64;
    let out = IdleRam {
        sessions,
        bytes_per_session: per(grown(rss_before, rss_after), sessions as f64),
        marginal_bytes: per(grown(rss_half, rss_after), made_rest as f64),
        rss_before,
        rss_after,
        sqlite_before,
        sqlite_after,
    };
    rig.close().await;
    progress!(
        "  = {:.0} B per idle session ({} sessions)",
        out.bytes_per_session,
        out.sessions
    );
    Ok(out)
}
