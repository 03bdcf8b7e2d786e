//! The report as one JSON object (`harness bench --json`): the keys are what later runs and
//! issues compare, so they only ever grow.

use anyhow::Result;
use serde_json::{json, Map, Value};

use super::{opt, Report, III_NOTES};
use crate::rig::Mode;
use crate::stats::{per, round1, round3, OpMean};

impl Report<'_> {
    pub(crate) fn json(&self) -> Result<Value> {
        let mut report = self.head_json();
        for part in [
            self.calls_json(),
            self.router_json()?,
            self.long_json(),
            self.reference_json(),
            self.idle_json(),
            json!({
                "targets_met": self.targets().iter().map(|t| (t.key.to_string(), json!(t.met))).collect::<Map<String, Value>>(),
                "method": METHOD.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<Map<String, Value>>(),
            }),
        ] {
            if let (Some(obj), Value::Object(part)) = (report.as_object_mut(), part) {
                obj.extend(part);
            }
        }
        Ok(report)
    }

    /// Where it ran, the loop's overhead, the handoffs and the per-cell figures.
    fn head_json(&self) -> Value {
        let r = &self.results;
        let (over, hand, hand_nofsync) = (&r.over.steps, &r.hand, &r.hand_nofsync);
        let fs_steps = &r.text_fsyncs;
        let cells = r.cell_figures();
        let empty_commit = r.over.empty_commit.as_ref();
        let mode = self.mode;
        json!({
            "mode": if mode.is_iii() { "iii" } else { "in-process" },
            "engine": match mode { Mode::Iii(url) => json!(url), Mode::Embedded => Value::Null },
            "notes": if mode.is_iii() { json!(III_NOTES) } else { json!([]) },
            "build": self.build(),
            "quick": self.quick,
            "cores": self.cores(),
            "data_fs": self.fs,
            "elapsed_s": round1(r.elapsed),
            "overhead_us_p50": round1(over.outside_store.p50),
            "overhead_us_p99": round1(over.outside_store.p99),
            "step_us_p50": round1(over.whole.p50),
            "step_us_p99": round1(over.whole.p99),
            "store_us_p50": round1(over.store.p50),
            "store_ops_per_step": round1(over.store_ops),
            "store_write_us_p50": opt(empty_commit.map(|c| c.back_to_back.p50), round1),
            "store_write_idle_us_p50": opt(empty_commit.map(|c| c.after_idle.p50), round1),
            "overhead_steps": over.count(),
            "store_breakdown": breakdown_json(&r.over.store_breakdown),
            "loop_breakdown": breakdown_json(&r.over.loop_breakdown),
            "handoff_us_p50": round1(hand.step.p50),
            "handoff_us_p99": round1(hand.step.p99),
            "handoff_nofsync_us_p50": round1(hand_nofsync.step.p50),
            "handoff_nofsync_us_p99": round1(hand_nofsync.step.p99),
            "send_handoff_us_p50": round1(hand.send.p50),
            "handoff_samples": hand.step.samples,
            "steps_per_sec": cells.steps_per_sec,
            "cpu_us_per_step": cells.cpu_per_step,
            "turn_us_c1": r.over.wall_per_turn_us.round(),
            "turn_cpu_us_c1": r.over.cpu_per_turn_us.round(),
            "fsyncs_per_text_step": opt(fs_steps.as_ref().map(|f| f.per_step), round3),
            "fsyncs_per_send": opt(fs_steps.as_ref().map(|f| f.per_send), round3),
            "fsyncs_per_step": cells.fsyncs_per_step,
            "store_commits_per_step": cells.commits_per_step,
            "store_writer": cells.store_writer,
            "fsync_turns": fs_steps.as_ref().map(|f| f.turns),
        })
    }

    fn calls_json(&self) -> Value {
        let calls = &self.results.calls;
        let (call, text) = (&calls.calls, &calls.text);
        let fsync = &self.results.call_fsyncs;
        json!({
            "call_step_us_p50": round1(call.whole.p50),
            "call_step_us_p99": round1(call.whole.p99),
            "call_overhead_us_p50": round1(calls.overhead_p50()),
            "call_overhead_loop_us_p50": round1(calls.overhead_loop_p50()),
            "call_target_us_p50": round1(calls.target_p50),
            "call_text_step_us_p50": round1(text.whole.p50),
            "call_store_us_p50": round1(call.store.p50),
            "call_text_store_us_p50": round1(text.store.p50),
            "call_store_ops_per_step": round1(call.store_ops),
            "call_text_store_ops_per_step": round1(text.store_ops),
            "call_steps": call.count(),
            "call_text_steps": text.count(),
            "call_step_fsync_us_p50": round1(fsync.step_p50),
            "call_breakdown": calls.breakdown.iter().map(|r| (r.op.clone(), json!({
                "store": r.store,
                "per_step": round1(r.call.calls),
                "us_per_step": round1(r.call.us),
                "text_per_step": round1(r.text.calls),
                "text_us_per_step": round1(r.text.us),
            }))).collect::<Map<String, Value>>(),
            "fsyncs_per_function_step": opt(fsync.per_step, round3),
            "fsyncs_per_function_turn": opt(fsync.per_turn, round3),
            "function_fsync_turns": fsync.per_turn.map(|_| fsync.turns),
        })
    }

    fn router_json(&self) -> Result<Value> {
        let router = &self.results.router;
        Ok(json!({
            "router_frame_us_p50": round1(router.per_frame_us.p50),
            "router_frame_us_p99": round1(router.per_frame_us.p99),
            "router_frame_added_us_p50": round1(router.added_per_frame_p50_us),
            "router_socket_us_p50": round1(router.socket_baseline_us.p50),
            "router_socket_us_p99": round1(router.socket_baseline_us.p99),
            "router_request_us_p50": round1(router.per_request_us.p50),
            "router_request_us_p99": round1(router.per_request_us.p99),
            "router_frames": router.per_frame_us.samples,
            "router_requests": router.per_request_us.samples,
            "router_latency": serde_json::to_value(router)?,
        }))
    }

    fn long_json(&self) -> Value {
        let long = &self.results.long;
        json!({
            "long_session_step_ratio": round3(long.step_ratio()),
            "long_session_overhead_ratio": round3(long.overhead_ratio()),
            "long_session_step_us_p50": round1(long.long.whole.p50),
            "short_session_step_us_p50": round1(long.short.whole.p50),
            "long_session_overhead_us_p50": round1(long.long.outside_store.p50),
            "short_session_overhead_us_p50": round1(long.short.outside_store.p50),
            "long_session_samples": long.long.count(),
            "assemble_us_p50_10": round1(long.assemble.short_p50),
            "assemble_us_p50_1000": round1(long.assemble.long_p50),
            "assemble_us_p50_1000_summarized": round1(long.assemble.summarized_p50),
            "assemble_summarized_ratio": round3(long.summarized_assemble_ratio()),
        })
    }

    /// The physical reference, and every time against what SQLite alone needs for one commit
    /// without its fsync (CPU), or against one fsync (disk); rates against one fsync after
    /// another. Same run, same directory.
    fn reference_json(&self) -> Value {
        let r = &self.results;
        let (over, calls, reference) = (&r.over.steps, &r.calls, &r.reference);
        let commit = reference.commit_nosync_us;
        let fsync_us = reference.fsync_us;
        let rate_vs_fsync = |c: usize| r.rate(c, true) * fsync_us / 1e6;
        let empty_commit_p50 = r
            .over
            .empty_commit
            .as_ref()
            .map_or(0.0, |c| c.back_to_back.p50);
        let ratios = [
            (
                "overhead_us_p50_per_sqlite_commit",
                per(over.outside_store.p50, commit),
            ),
            ("step_us_p50_per_sqlite_commit", per(over.whole.p50, commit)),
            (
                "store_us_p50_per_sqlite_commit",
                per(over.store.p50, commit),
            ),
            (
                "store_write_us_p50_per_sqlite_commit",
                per(empty_commit_p50, commit),
            ),
            (
                "turn_cpu_us_c1_per_sqlite_commit",
                per(r.over.cpu_per_turn_us, commit),
            ),
            ("handoff_us_p50_per_fsync", per(r.hand.step.p50, fsync_us)),
            (
                "handoff_nofsync_us_p50_per_sqlite_commit",
                per(r.hand_nofsync.step.p50, commit),
            ),
            (
                "call_step_us_p50_per_sqlite_commit",
                per(calls.calls.whole.p50, commit),
            ),
            (
                "call_step_fsync_us_p50_per_fsync",
                per(r.call_fsyncs.step_p50, fsync_us),
            ),
            ("steps_per_sec_1_fsync_per_fsync_rate", rate_vs_fsync(1)),
            ("steps_per_sec_10_fsync_per_fsync_rate", rate_vs_fsync(10)),
            ("steps_per_sec_200_fsync_per_fsync_rate", rate_vs_fsync(200)),
            (
                "long_session_step_us_p50_per_sqlite_commit",
                per(r.long.long.whole.p50, commit),
            ),
        ];
        json!({
            "reference": {
                "fsync_us_p50": round1(reference.fsync_us),
                "sqlite_commit_us_p50": round1(reference.commit_us),
                "sqlite_commit_nosync_us_p50": round1(reference.commit_nosync_us),
                "serial_fsyncs_per_sec": reference.serial_fsyncs_per_sec().round(),
            },
            "ratios": ratios.iter().map(|(k, v)| (k.to_string(), json!(round3(*v)))).collect::<Map<String, Value>>(),
        })
    }

    fn idle_json(&self) -> Value {
        let ram = &self.results.ram;
        json!({
            "idle_session_bytes": ram.bytes_per_session().round(),
            "idle_session_marginal_bytes": ram.marginal_bytes().round(),
            "idle_sessions": ram.sessions(),
            "idle_rss_before_bytes": ram.before.rss,
            "idle_rss_after_bytes": ram.after.rss,
            "idle_sqlite_heap_before_bytes": ram.before.sqlite_heap,
            "idle_sqlite_heap_after_bytes": ram.after.sqlite_heap,
        })
    }
}

/// Per-operation rows as `{op: {per_step, us_per_step}}`.
fn breakdown_json(rows: &[(String, OpMean)]) -> Value {
    rows.iter()
        .map(|(op, mean)| {
            (
                op.clone(),
                json!({"per_step": round1(mean.calls), "us_per_step": round1(mean.us)}),
            )
        })
        .collect::<Map<String, Value>>()
        .into()
}

/// How each figure is measured, said in the report (`method`).
const METHOD: &[(&str, &str)] = &[
    ("overhead", "concurrency 1, fsync off, text steps: step handler wall time minus time awaiting the store (session::*, state::*, enqueue, publish, barrier)"),
    ("handoff", "9-step turns (denied function call until max_turns): previous step's enqueue returned -> next step's handler start; includes the queue ack and, with fsync on, its fsync"),
    ("steps_per_sec", "C sessions, each send -> turn-completed -> send (new session every 20 turns); one text turn = one step; the send is included"),
    ("fsyncs_per_text_step", "concurrency 1, fsync on: fsyncs between send returning and the queue being idle, per turn; the send's own are fsyncs_per_send"),
    ("call_step", "concurrency 1, fsync off: turns of max_turns 8 whose every generation calls the in-process no-op bench::noop (allow bench::*, expose native, a new call id per step); whole step time of the steps that ran one call (the step ending the turn on max_turns left out)"),
    ("call_overhead", "p50(call step - time awaiting the bench::noop bus call) - p50(paired text step: text turns run by the same runtime right after each call turn); call_overhead_loop_us_p50 takes the store's time out of both as well; call_breakdown: per-operation calls and mean us per call step vs per paired text step"),
    ("fsyncs_per_function_step", "fresh runtime, fsync on: turns of 8 and of 2 call steps alternate; fsyncs from send returning to the queue idle and the WAL synced, per turn; (mean 8-call turn - mean 2-call turn) / 6, so the final max_turns step and per-turn costs cancel; fsyncs_per_function_turn is the 8-call turn's total"),
    ("router", "harness_router::bench::frame_latency: local Anthropic-format SSE server; per frame: server writes an event's bytes -> parsed frame out of the router's frame channel, one event in flight (target on its p50, socket included); router_socket_*: the same on a raw TcpStream; router_frame_added_us_p50 = difference of medians; per request: Router::chat -> request read by the server, plus the server's last byte -> the ack"),
    ("idle_session_bytes", "fsync off: (VmRSS after - before) / sessions with one completed turn each; each VmRSS read once the store had its idle moment (its fold and WAL truncation, 500 ms after the last write) and the allocator's free pages went back to the OS (mimalloc collected on every runtime worker and on the store's writer thread, malloc_trim for SQLite's heap); idle_sqlite_heap_*: SQLite's own heap at the same moments"),
    ("long_session_step_ratio", "concurrency 1, fsync off: text steps alternating between sessions of ~10 entries and of ~1,000 (user messages appended through session::append, each session stepped before measuring); p50 whole step on the long sessions / p50 on the short ones; long_session_overhead_ratio the same with store time taken out"),
    ("assemble", "the long-session phase's steps: the context::assemble bus call as the step awaits it (in-process: the typed call, nothing serialized; on an engine: request and answer serialisation included), p50 per step; on sessions of ~10 entries, of ~1,000, and of ~1,000 whose head a compaction record (written through session::append, as the loop writes it) already summarizes, keeping the last 8 entries; assemble_summarized_ratio = summarized / 10-entry"),
    ("reference", "same run, bench directory: fsync_us_p50 = fdatasync after a 4 KiB append; sqlite_commit_us_p50 = one small INSERT committed by bare SQLite (WAL, synchronous=FULL: it fsyncs); sqlite_commit_nosync_us_p50 = the same with synchronous=OFF (its CPU cost); ratios: times per bare commit (CPU) or per fsync (disk), steps/s times the fsync time (steps per fsync's worth of time)"),
];
