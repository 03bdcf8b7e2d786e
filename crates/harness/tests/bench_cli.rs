//! `harness bench --quick --json` runs end to end and prints one JSON object with the documented
//! keys. Shapes only: the numbers depend on the machine, so no thresholds are asserted.

#[path = "common/bench.rs"]
mod bench;

use bench::quick_bench;
use serde_json::Value;

fn positive(report: &Value, key: &str) -> f64 {
    let v = report
        .pointer(key)
        .unwrap_or_else(|| panic!("missing {key} in {report}"))
        .as_f64()
        .unwrap_or_else(|| panic!("{key} is not a number in {report}"));
    assert!(v > 0.0, "{key} = {v}, expected > 0");
    v
}

#[test]
fn bench_quick_json_prints_every_metric() {
    let dir = tempfile::tempdir().unwrap();
    let (report, _) = quick_bench(dir.path(), &[]);
    assert!(report.is_object());

    for key in [
        "/overhead_us_p50",
        "/overhead_us_p99",
        "/handoff_us_p50",
        "/fsyncs_per_text_step",
    ] {
        positive(&report, key);
    }
    for c in ["1", "10", "200"] {
        for mode in ["fsync", "nofsync"] {
            positive(&report, &format!("/steps_per_sec/{c}/{mode}"));
        }
        // Every step writes (the send's message, the answer, the record): commits and write ops
        // of the store are counted, and a commit holds at least one write op.
        positive(&report, &format!("/store_commits_per_step/{c}/commits"));
        positive(&report, &format!("/store_commits_per_step/{c}/writes"));
        positive(&report, &format!("/store_commits_per_step/{c}/wal_pages"));
        let of = |k: &str| report["store_commits_per_step"][c][k].as_f64().unwrap();
        assert!(of("writes") >= of("commits"), "{report}");
        // A commit writes at least one page.
        assert!(of("wal_pages") >= of("commits"), "{report}");
        // The writer was busy some of the cell and not much more than all of it (a batch that
        // straddles the cell's end counts whole); its checkpoints are part of its busy time.
        positive(&report, &format!("/store_writer/{c}/busy"));
        let writer = |k: &str| report["store_writer"][c][k].as_f64().unwrap();
        assert!(writer("busy") <= 1.1, "{report}");
        assert!(writer("checkpoint") <= writer("busy"), "{report}");
    }
    // The function-call step and the router: present and numbers (differences of medians can be
    // of either sign on a busy machine, so no sign is asserted for those).
    for key in [
        "/call_step_us_p50",
        "/call_step_us_p99",
        "/call_text_step_us_p50",
        "/router_frame_us_p50",
        "/router_frame_us_p99",
        "/router_socket_us_p50",
        "/router_request_us_p50",
    ] {
        positive(&report, key);
    }
    for key in [
        "/call_overhead_us_p50",
        "/call_overhead_loop_us_p50",
        "/call_target_us_p50",
        "/call_step_fsync_us_p50",
        "/fsyncs_per_function_step",
        "/fsyncs_per_function_turn",
        "/router_frame_added_us_p50",
    ] {
        let v = report
            .pointer(key)
            .unwrap_or_else(|| panic!("missing {key} in {report}"));
        assert!(v.is_number(), "{key} = {v}");
    }
    for key in ["fsyncs_per_function_step", "router_frame_us_p50"] {
        assert!(report["targets_met"][key].is_boolean(), "targets_met.{key}");
    }
    assert!(report["call_steps"].as_u64().unwrap_or(0) > 0);
    assert!(report["router_frames"].as_u64().unwrap_or(0) > 0);
    let noop = &report["call_breakdown"]["bench::noop"];
    assert!(noop["per_step"].is_number(), "call_breakdown: {report}");
    // RSS can even shrink between two readings on a busy allocator: a number, not necessarily > 0.
    let idle = report["idle_session_bytes"]
        .as_f64()
        .expect("idle_session_bytes is a number");
    assert!(idle >= 0.0, "idle_session_bytes = {idle}");
    assert!(report["idle_sessions"].as_u64().unwrap_or(0) > 0);
    // The bench left nothing behind in its directory.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Without the `iii` feature, `--iii` fails at once and names the feature (with it, the bench
/// runs against the engine: tests/iii_bench.rs).
#[cfg(not(feature = "iii"))]
#[test]
fn bench_iii_mode_fails_clearly() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_harness"))
        .args(["bench", "--iii", "ws://127.0.0.1:49134"])
        .output()
        .expect("run harness bench");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--features iii"), "{stderr}");
}
