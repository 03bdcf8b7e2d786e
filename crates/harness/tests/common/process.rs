//! What the handle of a `harness serve` (common/mod.rs) and of a `harness worker`
//! (iii_engine/worker.rs) share: killing the process, finding it dead, and reading a session's
//! transcript and turn status over whatever answers the calls.

use std::future::Future;
use std::process::Child;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

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
