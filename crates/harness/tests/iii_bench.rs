//! `harness bench --iii URL --quick --json` against the in-test engine double (tests/iii_engine):
//! it runs end to end and reports the same keys as the in-process bench, numbers wherever the
//! figure applies on iii and null where it does not (the fsync counts and the store yardstick).
//! Shapes only: the double is not a real engine and the machine varies, so no thresholds.
#![cfg(feature = "iii")]

#[path = "common/bench.rs"]
mod bench;
mod iii_engine;

use std::collections::BTreeSet;

use bench::quick_bench;
use iii_engine::Engine;
use serde_json::Value;

/// The figures the iii mode reports as null (no durability point on the engine).
const NULL_ON_III: &[&str] = &[
    "/store_write_us_p50",
    "/store_write_idle_us_p50",
    "/fsyncs_per_text_step",
    "/fsyncs_per_send",
    "/fsync_turns",
    "/fsyncs_per_function_step",
    "/fsyncs_per_function_turn",
    "/function_fsync_turns",
    "/fsyncs_per_step/1",
    "/fsyncs_per_step/10",
    "/fsyncs_per_step/200",
    "/store_commits_per_step/1",
    "/store_commits_per_step/10",
    "/store_commits_per_step/200",
    "/store_writer/1",
    "/store_writer/10",
    "/store_writer/200",
    "/targets_met/fsyncs_per_text_step",
    "/targets_met/fsyncs_per_function_step",
];

/// Objects whose keys are fixed (the breakdowns list whatever operations ran: not compared).
const FIXED_OBJECTS: &[&str] = &[
    "steps_per_sec",
    "cpu_per_step",
    "fsyncs_per_step",
    "store_commits_per_step",
    "store_writer",
    "targets_met",
    "method",
];

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default()
}

/// Every leaf pointer under `v` (objects descended, arrays and scalars are leaves).
fn leaves(v: &Value, at: String, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(o) => {
            for (k, x) in o {
                leaves(x, format!("{at}/{k}"), out);
            }
        }
        other => out.push((at, other.clone())),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_iii_reports_the_in_process_figures() {
    let engine = Engine::start().await;
    let url = engine.url.clone();
    let iii_dir = tempfile::tempdir().unwrap();
    let emb_dir = tempfile::tempdir().unwrap();
    // The bench process blocks; the engine double runs on this test's runtime meanwhile.
    let (iii, iii_stderr) = {
        let (url, dir) = (url.clone(), iii_dir.path().to_path_buf());
        tokio::task::spawn_blocking(move || quick_bench(&dir, &["--iii", &url]))
            .await
            .expect("bench --iii")
    };
    let (embedded, _) = {
        let dir = emb_dir.path().to_path_buf();
        tokio::task::spawn_blocking(move || quick_bench(&dir, &[]))
            .await
            .expect("bench in-process")
    };
    eprintln!("bench --iii (against the in-test engine double): {iii}");

    assert_eq!(iii["mode"], "iii", "{iii}");
    assert_eq!(iii["engine"], url.as_str(), "{iii}");
    assert!(
        iii["notes"].as_array().is_some_and(|n| !n.is_empty()),
        "{iii}"
    );
    assert_eq!(embedded["mode"], "in-process");
    assert!(iii_stderr.contains(&format!("iii mode: every phase connects to {url}")));
    // The same keys as the in-process report, at the top and in the fixed-shape objects.
    assert_eq!(keys(&iii), keys(&embedded));
    for obj in FIXED_OBJECTS {
        assert_eq!(keys(&iii[obj]), keys(&embedded[obj]), "keys of {obj}");
    }

    // Null exactly where the figure does not apply on iii; elsewhere a number wherever the
    // in-process report has one.
    let mut iii_leaves = Vec::new();
    leaves(&iii, String::new(), &mut iii_leaves);
    for (ptr, v) in &iii_leaves {
        let top = ptr.split('/').nth(1).unwrap_or("");
        if [
            "store_breakdown",
            "loop_breakdown",
            "call_breakdown",
            "router_latency",
        ]
        .contains(&top)
        {
            continue;
        }
        let Some(e) = embedded.pointer(ptr) else {
            panic!("{ptr} is in the iii report but not in the in-process one");
        };
        if NULL_ON_III.contains(&ptr.as_str()) {
            assert!(v.is_null(), "{ptr} = {v} on iii, expected null");
            assert!(!e.is_null(), "{ptr} is null in-process too: {e}");
        } else if e.is_number() {
            assert!(v.is_number(), "{ptr} = {v} on iii, in-process {e}");
        } else if ptr != "/engine" && ptr != "/notes" && ptr != "/mode" {
            assert_eq!(
                std::mem::discriminant(v),
                std::mem::discriminant(e),
                "{ptr}: {v} on iii, {e} in-process"
            );
        }
    }
    // The figures that must have measured something.
    for key in [
        "/overhead_us_p50",
        "/step_us_p50",
        "/handoff_us_p50",
        "/handoff_nofsync_us_p50",
        "/call_step_us_p50",
        "/call_text_step_us_p50",
        "/call_target_us_p50",
        "/router_frame_us_p50",
    ] {
        let x = iii.pointer(key).and_then(Value::as_f64).unwrap_or(0.0);
        assert!(x > 0.0, "{key} = {x} on iii");
    }
    for c in ["1", "10", "200"] {
        for m in ["fsync", "nofsync"] {
            let x = iii["steps_per_sec"][c][m].as_f64().unwrap_or(0.0);
            assert!(x > 0.0, "steps_per_sec.{c}.{m} = {x} on iii");
        }
    }
    for key in [
        "overhead_steps",
        "handoff_samples",
        "call_steps",
        "idle_sessions",
    ] {
        assert!(iii[key].as_u64().unwrap_or(0) > 0, "{key}: {iii}");
    }
    // The call steps went through the engine to bench::noop.
    assert!(iii["call_breakdown"]["bench::noop"]["per_step"].is_number());
    // Nothing left behind in either directory.
    assert_eq!(std::fs::read_dir(iii_dir.path()).unwrap().count(), 0);
    assert_eq!(std::fs::read_dir(emb_dir.path()).unwrap().count(), 0);
}
