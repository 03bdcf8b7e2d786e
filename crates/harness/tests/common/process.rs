//! What the handle of a `harness serve` (common/mod.rs) and of a `harness worker`
//! (iii_engine/worker.rs) share: killing the process, finding it dead, and reading a session's
//! transcript and turn status over whatever answers the calls ([`Sessions`]).

use std::future::Future;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// How long a test waits for something that should take a few seconds at most.
pub const WAIT: Duration = Duration::from_secs(60);

/// A session's transcript and turns, read through whatever answers `harness::status` and
/// `session::messages` for the handle (HTTP for `serve`, the engine for a `worker`).
#[allow(async_fn_in_trait)] // implemented and called by these tests only
pub trait Sessions {
    /// The session's `harness::status`.
    async fn status(&self, session_id: &str) -> Value;

    /// One page of `session::messages` for `request`.
    async fn messages(&self, request: Value) -> Value;

    /// Every entry of a session's transcript, oldest first (pages through the cursor).
    async fn transcript(&self, session_id: &str, include_custom: bool) -> Vec<Value> {
        transcript(session_id, include_custom, |req| self.messages(req)).await
    }

    /// Polls `harness::status` until turn `turn_id` is terminal; returns the status.
    async fn wait_turn(&self, session_id: &str, turn_id: &str) -> Value {
        wait_turn(turn_id, WAIT, || self.status(session_id)).await
    }

    /// Waits for turn `turn_id` to end, which must be as completed; returns the session's
    /// transcript (messages only).
    async fn completed_transcript(&self, session_id: &str, turn_id: &str) -> Vec<Value> {
        let status = self.wait_turn(session_id, turn_id).await;
        assert_eq!(status["status"], "completed", "{status}");
        self.transcript(session_id, false).await
    }
}

/// SIGKILL, then reap. Nothing of the process survives: no graceful shutdown runs.
pub fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill(); // SIGKILL on unix
        let _ = c.wait();
    }
}

/// True once the process has exited on its own (a failpoint killed it); reaps it.
pub fn exited(child: &mut Option<Child>) -> bool {
    match child.as_mut() {
        None => true,
        Some(c) => match c.try_wait().expect("try_wait") {
            Some(_) => {
                *child = None;
                true
            }
            None => false,
        },
    }
}

/// Every entry of a session's transcript, oldest first: `session::messages` asked through
/// `call` page by page along the cursor.
pub async fn transcript<F, Fut>(session_id: &str, include_custom: bool, call: F) -> Vec<Value>
where
    F: Fn(Value) -> Fut,
    Fut: Future<Output = Value>,
{
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut req =
            json!({"session_id": session_id, "include_custom": include_custom, "limit": 100});
        if let Some(c) = &cursor {
            req["cursor"] = json!(c);
        }
        let page = call(req).await;
        out.extend(page["messages"].as_array().cloned().unwrap_or_default());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return out,
        }
    }
}

/// True for a `harness::status` answer whose turn has ended.
pub fn is_terminal(status: &Value) -> bool {
    matches!(
        status["status"].as_str(),
        Some("completed" | "failed" | "cancelled")
    )
}

/// Polls `status` (a session's `harness::status`) until turn `turn_id` is terminal, failing
/// after `wait`; returns that status.
pub async fn wait_turn<F, Fut>(turn_id: &str, wait: Duration, status: F) -> Value
where
    F: Fn() -> Fut,
    Fut: Future<Output = Value>,
{
    let deadline = Instant::now() + wait;
    loop {
        let s = status().await;
        if s["turn_id"] == json!(turn_id) && is_terminal(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "turn {turn_id} not terminal within {wait:?}; last status {s}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
