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

/// A worker of `script` serving the fixture functions of `fx`, started with `extra` besides.
pub async fn start_worker(
    engine: &Engine,
    script: &Value,
    fx: &Fixtures,
    extra: &[&str],
) -> WorkerProc {
    let mut args = fx.args();
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    WorkerProc::start(engine, script, &args).await
}

/// Sends "do the work" to `session`, allowed `slow::*` (the model of [`slow_work_script`] calls
/// `slow::work` as `c1`), and waits until `fx`'s log shows the call running; returns the turn id.
pub async fn start_slow_work(engine: &Engine, fx: &Fixtures, session: &str) -> String {
    let turn_id = engine.send(session, "do the work", &["slow::*"]).await;
    let log = fx.log();
    wait_until("the call to start", || {
        invocations(&log).get("c1") == Some(&1)
    })
    .await;
    turn_id
}

/// Sends "hi" to `session` of a worker whose model answers `reply`: the turn completes with
/// `reply` as its result, and the transcript is the user's message and that reply.
pub async fn assert_text_turn(engine: &Engine, session: &str, reply: &str) {
    let status = engine.send_and_wait(session, "hi", &[]).await;
    assert_eq!(status["status"], "completed", "{status}");
    assert_eq!(status["result"], reply);
    let entries = engine.transcript(session, false).await;
    assert_eq!(entries.len(), 2, "{}", render(&entries));
    assert_eq!(
        (role_of(&entries[1]), text_of(&entries[1]).as_str()),
        (Some("assistant"), reply)
    );
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
    let mut worker = start_worker(engine, &slow_work_script(vec![]), &fx, args).await;
    started(&worker);
    let turn_id = start_slow_work(engine, &fx, session).await;
    worker.kill();
    worker.restart().await;
    let entries = engine.completed_transcript(session, &turn_id).await;
    assert_slow_work_interrupted(&fx, &entries);
    let users = user_texts(&entries).len();
    assert_eq!(users, 1, "{}", render(&entries));
    entries
}
