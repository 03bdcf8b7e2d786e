//! The pure parts: phase sizes from the flags, percentiles, and how the probe names operations.

use std::time::{Duration, Instant};

use crate::calls::target_of;
use crate::plan::Plan;
use crate::probe::{generic_scope, is_store_op, StepSample};
use crate::rig::NOOP_FN;
use crate::stats::{cpu_time_us, percentile_us, rss_bytes, Steps};
use crate::BenchArgs;

use super::SERIAL;

fn args() -> BenchArgs {
    BenchArgs {
        json: false,
        quick: false,
        iii: None,
        dir: None,
        idle_sessions: None,
        cell_secs: None,
    }
}

#[test]
fn quick_runs_every_phase_smaller_than_the_full_run() {
    let full = Plan::new(&args());
    let quick = Plan::new(&BenchArgs {
        quick: true,
        ..args()
    });
    for (name, q, f) in [
        ("idle_sessions", quick.idle_sessions, full.idle_sessions),
        ("overhead_steps", quick.overhead_steps, full.overhead_steps),
        ("handoff_turns", quick.handoff_turns, full.handoff_turns),
        ("fsync_turns", quick.fsync_turns, full.fsync_turns),
        ("function_steps", quick.function_steps, full.function_steps),
        ("long_turns", quick.long_turns, full.long_turns),
    ] {
        assert!(q < f, "{name}: --quick {q}, full {f}");
    }
    assert!(quick.cell < full.cell);
    // The long sessions are as long in both: the ratio judged is the same figure.
    assert_eq!(quick.long_entries, full.long_entries);
}

#[test]
fn an_idle_session_count_asked_for_gets_time_to_fill_it_whole() {
    let plan = Plan::new(&BenchArgs {
        quick: true,
        idle_sessions: Some(10_000),
        ..args()
    });
    assert_eq!(plan.idle_sessions, 10_000);
    assert!(
        plan.idle_cap >= Duration::from_secs(120),
        "{:?}",
        plan.idle_cap
    );
    // Fewer than two leaves no second half to take the marginal figure over.
    let one = Plan::new(&BenchArgs {
        idle_sessions: Some(1),
        ..args()
    });
    assert_eq!(one.idle_sessions, 2);
}

#[test]
fn a_throughput_cell_lasts_at_least_a_tenth_of_a_second() {
    let short = Plan::new(&BenchArgs {
        cell_secs: Some(0.001),
        ..args()
    });
    assert_eq!(short.cell, Duration::from_millis(100));
    let asked = Plan::new(&BenchArgs {
        cell_secs: Some(2.5),
        ..args()
    });
    assert_eq!(asked.cell, Duration::from_millis(2500));
}

#[test]
fn percentiles_take_the_nearest_rank_in_microseconds() {
    let ns: Vec<u64> = (1..=101).map(|i| i * 1000).collect();
    assert_eq!(percentile_us(&ns, 0.5), 51.0);
    assert_eq!(percentile_us(&ns, 0.99), 100.0);
    assert_eq!(percentile_us(&ns, 1.0), 101.0);
    assert_eq!(percentile_us(&ns, 0.0), 1.0);
    assert_eq!(percentile_us(&[], 0.5), 0.0);
    assert_eq!(percentile_us(&[7_500], 0.99), 7.5);
}

/// A step sample of `wall_us` in all, `store_us` of it awaiting the store in `ops` operations,
/// and `target_us` awaiting `bench::noop`.
fn sample(wall_us: u64, store_us: u64, ops: u64, target_us: u64) -> StepSample {
    StepSample {
        turn_id: "t".into(),
        wall_ns: wall_us * 1000,
        store_ns: store_us * 1000,
        store_ops: ops,
        by_op: [(NOOP_FN.to_string(), (1, target_us * 1000))].into(),
    }
}

#[test]
fn steps_are_timed_whole_outside_the_store_and_less_their_target() {
    let samples = [sample(100, 30, 4, 20), sample(300, 50, 6, 40)];
    let steps = Steps::of(&samples);
    assert_eq!(steps.count(), 2);
    assert_eq!((steps.whole.p50, steps.whole.p99), (300.0, 300.0));
    assert_eq!(steps.outside_store.p50, 250.0);
    assert_eq!(steps.store.p50, 50.0);
    assert_eq!(steps.store_ops, 5.0);
    let net = Steps::less(&samples, |s| target_of(s).0);
    assert_eq!(net.whole.p50, 260.0);
    assert_eq!(net.outside_store.p50, 210.0);
    // A step shorter than what is taken out of it counts as nothing, not as a wrapped number.
    let odd = Steps::less(&[sample(10, 30, 1, 20)], |s| target_of(s).0);
    assert_eq!((odd.whole.p50, odd.outside_store.p50), (0.0, 0.0));
    assert_eq!(Steps::of(&[]).count(), 0);
}

#[test]
fn a_session_scope_is_named_once_for_every_session() {
    assert_eq!(
        generic_scope("harness_queue:s_0123abcd4567"),
        "harness_queue:<session>"
    );
    assert_eq!(
        generic_scope("harness_queue:s_0123abcd4567"),
        generic_scope("harness_queue:s_fedcba987654")
    );
    // Not a session id: too short, or not alphanumeric after the prefix.
    assert_eq!(generic_scope("harness:s_abc"), "harness:s_abc");
    assert_eq!(generic_scope("kv:s_0123-abcd-4567"), "kv:s_0123-abcd-4567");
    assert_eq!(generic_scope("harness_usage"), "harness_usage");
}

#[test]
fn store_time_is_what_the_store_answers_and_nothing_else() {
    for op in [
        "session::append",
        "state::get",
        "enqueue",
        "publish",
        "barrier",
        "commit",
        "state_get",
        "state_set",
        "state_delete",
        "state_list harness_queue:<session>",
    ] {
        assert!(is_store_op(op), "{op} is the store's");
    }
    for op in [
        "router::chat",
        "context::assemble",
        "bench::noop",
        "harness::turn",
    ] {
        assert!(!is_store_op(op), "{op} is not the store's");
    }
}

#[test]
fn the_process_reads_its_own_cpu_time_and_resident_set() {
    // Not beside a phase: this spins a core.
    let _serial = SERIAL.blocking_lock();
    let before = cpu_time_us();
    // Work until the kernel's clock-tick count moves (every 10 ms of CPU), or give up.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut spin = 0u64;
    while cpu_time_us() == before && Instant::now() < deadline {
        for _ in 0..100_000 {
            spin = std::hint::black_box(spin.wrapping_add(1));
        }
    }
    assert!(
        cpu_time_us() > before,
        "CPU time did not advance in 10 s of work"
    );
    assert!(rss_bytes().is_some_and(|b| b > 0));
}
