//! Scenarios the iii end-to-end suites run on more than one queue route.

#![allow(dead_code)] // Each suite uses some of these.

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::iii_engine::worker::{Sessions, WorkerProc, WAIT};
use crate::iii_engine::Engine;
use crate::scripts::*;

pub async fn wait_until<F: FnMut() -> bool>(what: &str, mut f: F) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A worker (started with `args` beside the fixtures') is SIGKILLed while its one call runs and
/// started again: the turn completes, the call ran exactly once and its result is closed once,
/// as interrupted, and the user's message is there once. `started` checks the worker before
/// the send. Answers the transcript.
pub async fn killed_mid_call(
    engine: &Engine,
    session: &str,
    args: &[&str],
    started: impl FnOnce(&WorkerProc),
) -> Vec<Value> {
    let fx = slow_work(10_000);
    let extra = fx.args();
    let mut extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    extra.extend(args);
    let mut worker = WorkerProc::start(engine, &slow_work_script(vec![]), &extra).await;
    started(&worker);
    let sent = engine.send(session, "do the work", &["slow::*"]).await;
    let turn_id = sent["turn_id"].as_str().unwrap().to_string();
    let log = fx.log();
    wait_until("the fixture log to show the call", || {
        invocations(&log).get("c1") == Some(&1)
    })
    .await;
    worker.kill();
    worker.restart().await;
    let entries = engine.completed_transcript(session, &turn_id).await;
    assert_slow_work_interrupted(&fx, &entries);
    let users = user_texts(&entries).len();
    assert_eq!(users, 1, "{}", render(&entries));
    entries
}
