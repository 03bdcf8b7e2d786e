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
/// runs two. Then on the store's writer thread, as one of its writes: the writer allocates
/// what it caches and logs, and its free pages stayed in the resident set otherwise (0.1 to
/// 1 MB at a reading).
pub(crate) async fn release_free_memory(host: &dyn Host, store: Option<&harness_store::Store>) {
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
    if let Some(store) = store {
        // A failed write only leaves the writer's pages where they were.
        let _ = store
            .write(move |_| {
                release();
                Ok(())
            })
            .await;
    }
}

/// Longest the reading waits for the store to settle.
const SETTLE_CAP: Duration = Duration::from_secs(5);

/// Waits until the store's writer has had its idle moment: after 500 ms without writes it folds
/// the event tail and the logs (their in-memory indexes included) and empties the WAL, which
/// its truncation counter shows. So every reading sees the store as an idle server holds it,
/// whichever point of the fold cycle the last session's writes left it at (up to a whole tail
/// of unfolded events otherwise, which moved the figure by a few hundred bytes a session).
async fn settle_store(store: &harness_store::Store) {
    let before = store.stats().wal_truncations;
    let deadline = Instant::now() + SETTLE_CAP;
    while store.stats().wal_truncations == before {
        if Instant::now() >= deadline {
            // Read anyway (a reader kept the WAL, or nothing was left to truncate), but not
            // silently: this reading may hold part of a fold's tail.
            progress!(
                "  the store had no idle moment within {} s: reading it as it is",
                SETTLE_CAP.as_secs()
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The process's memory once so many sessions were filled, read after the allocators gave
/// their free pages back.
#[derive(Clone, Copy)]
pub(crate) struct Reading {
    pub(crate) sessions: usize,
    /// Resident set.
    pub(crate) rss: u64,
    /// SQLite's own heap (every connection's page cache, statements, schema): the share of the
    /// RSS the store's connections hold.
    pub(crate) sqlite_heap: i64,
}

impl Reading {
    pub(crate) async fn settled(
        host: &dyn Host,
        store: Option<&harness_store::Store>,
        sessions: usize,
    ) -> Reading {
        match store {
            Some(store) => settle_store(store).await,
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
        release_free_memory(host, store).await;
        trim_heap();
        Reading {
            sessions,
            rss: rss_bytes().unwrap_or(0),
            sqlite_heap: harness_store::Store::sqlite_heap_bytes(),
        }
    }

    /// What the resident set grew by per session filled since `earlier` (0 if it shrank).
    fn bytes_per_session_since(&self, earlier: &Reading) -> f64 {
        let grown = self.rss.saturating_sub(earlier.rss) as f64;
        per(grown, self.sessions.saturating_sub(earlier.sessions) as f64)
    }
}

/// Readings before the first session, after half of them, and after the last.
pub(crate) struct IdleRam {
    pub(crate) before: Reading,
    pub(crate) half: Reading,
    pub(crate) after: Reading,
}

impl IdleRam {
    /// Sessions filled (each with one completed turn).
    pub(crate) fn sessions(&self) -> usize {
        self.after.sessions
    }

    /// RSS growth per session over all of them.
    pub(crate) fn bytes_per_session(&self) -> f64 {
        self.after.bytes_per_session_since(&self.before)
    }

    /// The same over the second half only.
    pub(crate) fn marginal_bytes(&self) -> f64 {
        self.after.bytes_per_session_since(&self.half)
    }
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
    let before = Reading::settled(at.host, rig.store(), 0).await;
    let cap_end = Instant::now() + plan.idle_cap;
    let first_half = plan.idle_sessions / 2;
    let made_half = fill_sessions(&d, first_half, plan.idle_cap).await?;
    rig.queue_idle().await?;
    let half = Reading::settled(at.host, rig.store(), made_half).await;
    let left = cap_end.saturating_duration_since(Instant::now());
    let made_rest = fill_sessions(&d, plan.idle_sessions - first_half, left).await?;
    rig.queue_idle().await?;
    let after = Reading::settled(at.host, rig.store(), made_half + made_rest).await;
    rig.close().await;
    let out = IdleRam {
        before,
        half,
        after,
    };
    if out.sessions() < plan.idle_sessions {
        progress!("  time cap reached: measured {} sessions", out.sessions());
    }
    progress!(
        "  = {:.0} B per idle session ({} sessions)",
        out.bytes_per_session(),
        out.sessions()
    );
    Ok(out)
}
