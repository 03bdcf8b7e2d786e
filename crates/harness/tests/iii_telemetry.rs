//! Observability of `harness worker` on the in-test engine double: the usage announcements are
//! published on the engine's durable `harness:usage` topic with the payloads the worker's own
//! audit lists, and `--metrics-listen` serves the worker's Prometheus registry.
#![cfg(feature = "iii")]

mod iii_engine;
#[path = "common/scripts.rs"]
mod scripts;

use std::net::TcpListener;
use std::time::{Duration, Instant};

use iii_engine::worker::{WorkerProc, WAIT};
use iii_engine::Engine;
use scripts::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_publishes_usage_on_the_engine_topic_and_serves_its_metrics() {
    let engine = Engine::start().await;
    if engine.is_real() {
        println!("skipped on a real engine: the publishes are read inside the double");
        return;
    }
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let _worker = WorkerProc::start(
        &engine,
        &script(vec![text_gen(None, "ok", 0, true)]),
        &["--metrics-listen", &listen],
    )
    .await;
    for text in ["one", "two", "three"] {
        let s = engine.send_and_wait("s_worker_usage", text, &[]).await;
        assert_eq!(s["status"], "completed", "{s}");
    }
    let published: Vec<Value> = engine
        .received()
        .into_iter()
        .filter(|m| {
            m["type"] == "invokefunction"
                && m["function_id"] == "iii::durable::publish"
                && m["data"]["topic"] == "harness:usage"
        })
        .map(|m| m["data"]["data"].clone())
        .collect();
    let listed = engine.ok("harness::usage::list", json!({})).await["announcements"].clone();
    assert_eq!(Value::Array(published.clone()), listed);
    let milestones: Vec<&Value> = published.iter().map(|a| &a["milestone"]).collect();
    assert_eq!(milestones, vec![&json!(1), &json!(2)], "{published:#?}");

    let client = reqwest::Client::new();
    let deadline = Instant::now() + WAIT;
    let body = loop {
        let body = client
            .get(format!("http://{listen}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        if body.contains("harness_turns_completed_total{reason=\"none\",status=\"completed\"} 3") {
            break body;
        }
        assert!(Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        body.contains("harness_usage_announcements_total{event=\"harness_session_progress\"} 2"),
        "{body}"
    );
}
