//! The enqueue route: `harness-turn` on the engine's queue provider (`engine::queue::enqueue`,
//! offered by the separately installed queue worker), FIFO grouped by `session_id`.
//!
//! Against the engine double with its queue-worker model (answering with the shapes recorded
//! from the real queue worker), or against a real engine with `III_BIN=/path/to/iii` and the
//! real queue worker next to it with `III_QUEUE_BIN=/path/to/queue`. Without `III_QUEUE_BIN`
//! a real engine has no queue provider and these tests return at once.
#![cfg(feature = "iii")]

mod iii_engine;
#[path = "common/iii_scenarios.rs"]
mod iii_scenarios;
#[path = "common/scripts.rs"]
mod scripts;

use iii_engine::worker::{Sessions, WorkerProc};
use iii_engine::Engine;
use iii_scenarios::{assert_text_turn, start_worker};
use scripts::*;
use serde_json::{json, Value};

/// The engine with a queue provider, or None when the real engine was given without one.
async fn engine_with_queue_worker() -> Option<Engine> {
    let engine = Engine::start_with_queue_worker().await;
    if engine.is_real() && !engine.has_queue_worker() {
        eprintln!("III_BIN without III_QUEUE_BIN: no queue provider, nothing to test here");
        return None;
    }
    Some(engine)
}

/// The worker took the enqueue route (its log says how it ensured the turn queue).
fn assert_enqueue_route(worker: &WorkerProc) {
    let log = worker.log();
    let line = log
        .lines()
        .find(|l| l.contains("queue ensured on the iii engine") && l.contains("harness-turn"))
        .unwrap_or_else(|| panic!("no queue line in the worker log:\n{log}"));
    assert!(line.contains("Enqueue"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_turn_runs_on_the_queue_worker_and_harness_turn_is_declared_fifo_by_session() {
    let Some(engine) = engine_with_queue_worker().await else {
        return;
    };
    let worker = WorkerProc::start(
        &engine,
        &script(vec![text_gen(None, "Hello over the queue.", 0, true)]),
        &["--queue-mode", "enqueue"],
    )
    .await;
    assert_enqueue_route(&worker);
    // Declared at start in the queue worker's configuration: FIFO grouped by session.
    let config = engine
        .call("configuration::get", json!({"id": "queue"}))
        .await
        .expect("the queue worker's configuration");
    let turn = &config["value"]["queue_configs"]["harness-turn"];
    assert_eq!(turn["type"], "fifo", "{config}");
    assert_eq!(turn["message_group_field"], "session_id", "{config}");
    let deletion = &config["value"]["queue_configs"]["harness-session-deletion"];
    assert_eq!(deletion["message_group_field"], "operation_id", "{config}");

    assert_text_turn(&engine, "s_q_text", "Hello over the queue.").await;
    // The double's queue worker answered only with shapes recorded from the real one.
    if !engine.is_real() {
        assert_eq!(engine.violations(), Vec::<String>::new());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflicting_declaration_stops_the_worker_naming_what_to_set() {
    let Some(engine) = engine_with_queue_worker().await else {
        return;
    };
    // The operator declared harness-turn as a standard queue.
    engine
        .call(
            "queue::define",
            json!({"queue": "harness-turn", "config": {"type": "standard"}}),
        )
        .await
        .expect("queue::define");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("script.json"),
        script(vec![text_gen(None, "x", 0, true)]).to_string(),
    )
    .unwrap();
    let out = std::process::Command::new(iii_engine::worker::BIN)
        .args(["worker", "--engine", &engine.url, "--with", "all"])
        .args([
            "--queue-mode",
            "enqueue",
            "--worker-name",
            "harness-conflict",
        ])
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--script")
        .arg(dir.path().join("script.json"))
        .env("HARNESS_LOG", "warn")
        .output()
        .expect("run the worker");
    assert!(!out.status.success(), "the worker must not start");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("harness-turn") && err.contains("type: standard"),
        "{err}"
    );
    assert!(
        err.contains("type: fifo") && err.contains("message_group_field: session_id"),
        "the error names the block to set: {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_call_on_the_queue_worker_the_call_runs_once_and_is_closed_once() {
    let Some(engine) = engine_with_queue_worker().await else {
        return;
    };
    iii_scenarios::killed_mid_call(
        &engine,
        "s_q_slow",
        &["--queue-mode", "enqueue"],
        assert_enqueue_route,
    )
    .await;
    // What the queue worker did with the delivery in flight (shown with --nocapture).
    eprintln!("queue worker log:\n{}", engine.queue_worker_log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_steps_of_each_session_run_strictly_in_order_while_sessions_interleave() {
    let Some(engine) = engine_with_queue_worker().await else {
        return;
    };
    let fx = Fixtures::new(json!([
        {"id": "f::step", "description": "one step", "response": {"ok": true}, "delay_ms": 150}
    ]));
    let sessions = ["a", "b", "c"];
    let mut gens = Vec::new();
    for s in sessions {
        for n in 1..=3 {
            gens.push(call_gen(
                &format!("^run {s}$"),
                &format!("{s}{n}"),
                "f::step",
                json!({"session": s, "n": n}),
            ));
        }
        gens.push(text_gen(
            Some(&format!("^run {s}$")),
            &format!("{s} done"),
            0,
            false,
        ));
    }
    let worker = start_worker(&engine, &script(gens), &fx, &["--queue-mode", "enqueue"]).await;
    assert_enqueue_route(&worker);
    let mut turns = Vec::new();
    for s in sessions {
        let turn_id = engine
            .send(&format!("s_q_order_{s}"), &format!("run {s}"), &["f::*"])
            .await;
        turns.push((s, turn_id));
    }
    for (s, turn_id) in &turns {
        let session = format!("s_q_order_{s}");
        let entries = engine.completed_transcript(&session, turn_id).await;
        assert_every_call_closed(&entries);
        // user, then (call, result) for steps 1..3 in order, then the text.
        let calls: Vec<String> = entries
            .iter()
            .flat_map(|e| {
                e["message"]["content"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter(|b| b["type"] == "function_call")
            .map(|b| b["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(
            calls,
            vec![format!("{s}1"), format!("{s}2"), format!("{s}3")]
        );
        let roles: Vec<&str> = entries.iter().filter_map(role_of).collect();
        assert_eq!(
            roles,
            vec![
                "user",
                "assistant",
                "function_result",
                "assistant",
                "function_result",
                "assistant",
                "function_result",
                "assistant"
            ],
            "{}",
            render(&entries)
        );
        assert_eq!(text_of(entries.last().unwrap()), format!("{s} done"));
    }
    let ran = invocations(&fx.log());
    for s in sessions {
        for n in 1..=3 {
            assert_eq!(ran.get(&format!("{s}{n}")), Some(&1), "{ran:?}");
        }
    }
    // The fixture log is in execution order: within a session the steps ran 1, 2, 3, and
    // the sessions were not run one after the other (their steps interleave).
    let order: Vec<String> = std::fs::read_to_string(fx.log())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["function_call_id"].as_str().map(str::to_string))
        .collect();
    for s in sessions {
        let mine: Vec<&String> = order.iter().filter(|c| c.starts_with(s)).collect();
        assert_eq!(
            mine,
            vec![&format!("{s}1"), &format!("{s}2"), &format!("{s}3")],
            "{order:?}"
        );
    }
    let first_done = order.iter().position(|c| c == "a3").unwrap();
    assert!(
        order[..first_done].iter().any(|c| !c.starts_with('a')),
        "sessions run in parallel, not one after the other: {order:?}"
    );
}
