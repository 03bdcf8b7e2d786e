//! Each phase on a tiny budget gives sane numbers.

use std::collections::HashMap;

use harness_store::Durability;

use super::{percentiles, positive, Bench, SERIAL};
use crate::plan::Plan;
use crate::rig::NOOP_FN;

#[test]
fn the_reference_measures_a_positive_fsync_and_commit() {
    let _serial = SERIAL.blocking_lock();
    let dir = tempfile::tempdir().unwrap();
    let r = crate::reference::measure(dir.path()).unwrap();
    positive("fsync_us", r.fsync_us);
    positive("commit_us", r.commit_us);
    positive("commit_nosync_us", r.commit_nosync_us);
    positive("serial_fsyncs_per_sec", r.serial_fsyncs_per_sec());
    // It cleans up after itself: the bench directory holds no reference files afterwards.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sessions_each_cost_some_bytes_and_not_a_megabyte() {
    let bench = Bench::with(Plan {
        // Enough sessions that their memory stands out of the page granularity of the RSS.
        idle_sessions: 300,
        ..Plan::tiny()
    })
    .await;
    let ram = bench.run(crate::idle::idle_ram).await;
    assert_eq!(
        ram.sessions(),
        bench.plan.idle_sessions,
        "the time cap cut the fill"
    );
    let bytes = ram.bytes_per_session();
    positive("idle bytes per session", bytes);
    assert!(bytes < 1024.0 * 1024.0, "{bytes} B per idle session");
    assert!(ram.after.rss > ram.before.rss);
    assert!(ram.after.sqlite_heap > 0, "SQLite's heap was not read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_overhead_is_the_step_less_its_store_time() {
    let bench = Bench::new().await;
    let o = bench.run(crate::overhead::overhead).await;
    let steps = &o.steps;
    assert_eq!(steps.count(), bench.plan.overhead_steps);
    percentiles("overhead", &steps.outside_store);
    percentiles("step", &steps.whole);
    positive("store p50", steps.store.p50);
    assert!(
        steps.outside_store.p50 <= steps.whole.p50,
        "overhead p50 {} above the whole step's {}",
        steps.outside_store.p50,
        steps.whole.p50
    );
    positive("store ops per step", steps.store_ops);
    let empty_commit = o.empty_commit.as_ref().unwrap();
    positive("empty commit p50", empty_commit.back_to_back.p50);
    positive("empty commit after idle p50", empty_commit.after_idle.p50);
    positive("wall per turn", o.wall_per_turn_us);
    assert!(o.cpu_per_turn_us.is_finite() && o.cpu_per_turn_us >= 0.0);
    // Store operations and the loop's timed calls are told apart, and both are seen.
    assert!(o
        .store_breakdown
        .iter()
        .all(|(op, _)| crate::probe::is_store_op(op)));
    assert!(o
        .loop_breakdown
        .iter()
        .all(|(op, _)| !crate::probe::is_store_op(op)));
    assert!(
        o.loop_breakdown.iter().any(|(op, _)| op == "router::chat"),
        "no router::chat in {:?}",
        o.loop_breakdown
    );
    assert!(!o.store_breakdown.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoffs_are_measured_with_fsync_on_and_off() {
    let bench = Bench::new().await;
    let plan = &bench.plan;
    for durability in [Durability::Full, Durability::Normal] {
        let h = bench
            .run(async |at, plan| crate::handoff::handoff(at, plan, durability).await)
            .await;
        // Every measured turn hands off between each of its steps.
        let per_turn = crate::handoff::HANDOFF_MAX_TURNS as usize;
        assert!(
            h.step.samples >= plan.handoff_turns * per_turn,
            "{} handoffs over {} turns",
            h.step.samples,
            plan.handoff_turns
        );
        percentiles("handoff", &h.step);
        // The send's step 0 may start before the send's task sees its enqueue return (the
        // queue wakes on the commit, before the writer answers): 0 then, never negative.
        assert!(h.send.samples > 0, "no send handoff measured");
        assert!(
            h.send.p50.is_finite() && h.send.p50 >= 0.0,
            "send handoff = {}",
            h.send.p50
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_text_step_and_its_send_each_fsync() {
    let bench = Bench::new().await;
    let f = bench.run(crate::handoff::fsyncs).await;
    assert_eq!(f.turns, bench.plan.fsync_turns);
    positive("fsyncs per text step", f.per_step);
    positive("fsyncs per send", f.per_send);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_step_runs_its_target_once() {
    let bench = Bench::new().await;
    let c = bench.run(crate::calls::function_calls).await;
    let steps = c.calls.count();
    assert!(steps >= bench.plan.function_steps, "{steps} call steps");
    assert!(c.text.count() > 0);
    percentiles("call step", &c.calls.whole);
    positive("target", c.target_p50);
    positive("call step less its target", c.net.whole.p50);
    positive("paired text step", c.text.whole.p50);
    let noop = c
        .breakdown
        .iter()
        .find(|r| r.op == NOOP_FN)
        .expect("the target in the breakdown");
    assert_eq!(
        noop.call.calls, 1.0,
        "a measured call step calls its target once"
    );
    assert_eq!(noop.text.calls, 0.0, "a text step calls no target");
    assert!(!noop.store);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_call_step_costs_fsyncs() {
    let bench = Bench::new().await;
    let f = bench.run(crate::calls::call_fsyncs).await;
    positive("call step with fsync on", f.step_p50);
    assert!(f.turns >= bench.plan.function_fsync_turns);
    positive("fsyncs per function turn", f.per_turn.unwrap());
    assert!(f.per_step.unwrap().is_finite());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_and_short_sessions_both_step_and_assemble() {
    let bench = Bench::new().await;
    let l = bench.run(crate::long_session::long_session).await;
    assert_eq!(l.long.count(), bench.plan.long_turns);
    positive("short step", l.short.whole.p50);
    positive("long step", l.long.whole.p50);
    positive("short overhead", l.short.outside_store.p50);
    positive("long overhead", l.long.outside_store.p50);
    positive("step ratio", l.step_ratio());
    positive("overhead ratio", l.overhead_ratio());
    positive("assemble on 10 entries", l.assemble.short_p50);
    positive("assemble on long sessions", l.assemble.long_p50);
    positive("assemble on summarized ones", l.assemble.summarized_p50);
    positive("summarized assemble ratio", l.summarized_assemble_ratio());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_cell_counts_steps_fsyncs_and_wal_pages_by_table() {
    let bench = Bench::new().await;
    let cell = bench
        .run(async |at, plan| crate::throughput::throughput(at, plan, 10, true).await)
        .await;
    assert!(cell.steps >= 10, "{} steps by 10 sessions", cell.steps);
    positive("steps/s", cell.rate());
    positive("fsyncs per step", cell.fsyncs_per_step().unwrap());
    let store = cell.store.as_ref().unwrap();
    let stats = &store.stats;
    assert!(stats.commits > 0 && stats.writes >= stats.commits);
    assert!(stats.wal_frames > 0);
    assert!(stats.writer_busy_ns > 0);
    let by_table = store.by_table.as_ref().expect("WAL pages by table");
    assert!(by_table.frame_bytes > 0);
    // The tables' pages account for the cell's WAL pages. Not to the page: the count by table
    // is read a moment after the store's counter, and a queue ack may commit in between.
    let (sum, total) = (by_table.pages() as f64, stats.wal_frames as f64);
    assert!(
        (sum - total).abs() <= total * 0.05 + 2.0,
        "pages by table sum to {sum}, the WAL grew by {total}"
    );

    let figures = cell.store_json();
    let wal_pages = figures["wal_pages"].as_f64().unwrap();
    positive("WAL pages per step", wal_pages);
    positive("WAL bytes per step", figures["wal_bytes"].as_f64().unwrap());
    let per_table: HashMap<String, f64> =
        serde_json::from_value(figures["wal_pages_by_table"].clone()).unwrap();
    let per_table: f64 = per_table.values().sum();
    assert!(
        (per_table - wal_pages).abs() <= wal_pages * 0.05 + 0.01,
        "per-table pages per step sum to {per_table}, WAL pages per step are {wal_pages}"
    );
    let writer = cell.writer_json();
    let busy = writer["busy"].as_f64().unwrap();
    assert!(busy > 0.0 && busy.is_finite(), "writer busy share {busy}");
    assert!(writer["checkpoint"].as_f64().unwrap() <= busy);
    // fsync on: the barriers' fsyncs took some of the cell, and one runs at a time.
    let syncer = writer["syncer_busy"].as_f64().unwrap();
    assert!(syncer > 0.0 && syncer <= 1.05, "syncer busy share {syncer}");
}
