//! How big each phase is: the full run, `--quick`, and what the flags change.

use std::time::Duration;

use harness_router::bench::FrameLatencyOptions;

use crate::BenchArgs;

/// Entries of the long sessions of the long-session phase (before their turns).
const LONG_ENTRIES: usize = 1_000;

/// Phase sizes.
pub(crate) struct Plan {
    pub(crate) idle_sessions: usize,
    pub(crate) idle_cap: Duration,
    pub(crate) overhead_steps: usize,
    pub(crate) overhead_cap: Duration,
    pub(crate) store_writes: usize,
    pub(crate) handoff_turns: usize,
    pub(crate) handoff_cap: Duration,
    pub(crate) fsync_turns: usize,
    pub(crate) fsync_cap: Duration,
    /// Call steps sampled (fsync off) and the time cap of that part.
    pub(crate) function_steps: usize,
    pub(crate) function_cap: Duration,
    /// Turns of each length for the fsyncs per function step, and the time cap of that part.
    pub(crate) function_fsync_turns: usize,
    pub(crate) function_fsync_cap: Duration,
    pub(crate) router: FrameLatencyOptions,
    pub(crate) cell_warmup: Duration,
    pub(crate) cell: Duration,
    /// Measured turns on each of the short and the long sessions, and the time cap.
    pub(crate) long_turns: usize,
    /// Entries of the long sessions (the short ones have 10).
    pub(crate) long_entries: usize,
    pub(crate) long_cap: Duration,
}

impl Plan {
    pub(crate) fn new(args: &BenchArgs) -> Plan {
        let mut p = if args.quick {
            Plan {
                idle_sessions: 2_000,
                idle_cap: Duration::from_secs(6),
                // ~0.7 s of steps: at 300 (0.15 s) one slow moment of a shared machine moved
                // the p50 by a third (93–122 µs over four runs against 86–94 µs at 1,500).
                overhead_steps: 1_500,
                overhead_cap: Duration::from_secs(3),
                store_writes: 300,
                handoff_turns: 30,
                handoff_cap: Duration::from_secs(2),
                fsync_turns: 60,
                fsync_cap: Duration::from_secs(2),
                function_steps: 160,
                function_cap: Duration::from_secs(3),
                function_fsync_turns: 8,
                function_fsync_cap: Duration::from_secs(2),
                router: FrameLatencyOptions {
                    frames: 300,
                    warmup: 50,
                    requests: 20,
                },
                cell_warmup: Duration::from_millis(200),
                cell: Duration::from_millis(1200),
                long_turns: 40,
                long_entries: LONG_ENTRIES,
                long_cap: Duration::from_secs(4),
            }
        } else {
            Plan {
                idle_sessions: 10_000,
                idle_cap: Duration::from_secs(60),
                overhead_steps: 3_000,
                overhead_cap: Duration::from_secs(20),
                store_writes: 2_000,
                handoff_turns: 200,
                handoff_cap: Duration::from_secs(10),
                fsync_turns: 500,
                fsync_cap: Duration::from_secs(10),
                function_steps: 2_000,
                function_cap: Duration::from_secs(20),
                function_fsync_turns: 40,
                function_fsync_cap: Duration::from_secs(10),
                router: FrameLatencyOptions::default(),
                cell_warmup: Duration::from_millis(500),
                cell: Duration::from_secs(5),
                long_turns: 300,
                long_entries: LONG_ENTRIES,
                long_cap: Duration::from_secs(20),
            }
        };
        if let Some(n) = args.idle_sessions {
            p.idle_sessions = n.max(2);
            // A count asked for is measured whole: a busy machine fills 10,000 sessions in
            // 20-40 s, and a figure over a tenth of them is not the figure asked for.
            p.idle_cap = p.idle_cap.max(Duration::from_millis(12 * n as u64));
        }
        if let Some(s) = args.cell_secs {
            p.cell = Duration::from_secs_f64(s.max(0.1));
        }
        p
    }
}

#[cfg(test)]
impl Plan {
    /// Every phase at a few samples: the sizes the bench's own tests run it at.
    pub(crate) fn tiny() -> Plan {
        let cap = Duration::from_secs(20);
        Plan {
            idle_sessions: 40,
            idle_cap: cap,
            overhead_steps: 20,
            overhead_cap: cap,
            store_writes: 20,
            handoff_turns: 3,
            handoff_cap: cap,
            fsync_turns: 6,
            fsync_cap: cap,
            function_steps: 16,
            function_cap: cap,
            function_fsync_turns: 2,
            function_fsync_cap: cap,
            router: FrameLatencyOptions {
                frames: 20,
                warmup: 5,
                requests: 3,
            },
            cell_warmup: Duration::from_millis(20),
            cell: Duration::from_millis(150),
            long_turns: 4,
            long_entries: 60,
            long_cap: cap,
        }
    }
}
