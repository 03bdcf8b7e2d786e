//! What every in-process loop test starts from: a store in a temporary directory, the embedded
//! bus over it, and the session store with `session::*` registered; then the loop itself. The
//! test crates of harness-approval, harness-mcp and harness-router include this file by
//! `#[path]`, so a change to how the stack is opened is made once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::{Bus, EmbeddedBus};
use harness_core::{Harness, HarnessConfig};
use harness_router::scripted::{Script, ScriptedProvider};
use harness_session::SessionStore;
use harness_store::{Durability, Store};
use harness_types::api::{StatusReport, StatusRequest};
use serde_json::{json, Value};

pub struct Embedded {
    pub store: Store,
    pub bus: EmbeddedBus,
    pub shared: Arc<dyn Bus>,
    pub sessions: SessionStore,
    /// Holds the database; dropped last by whoever keeps it.
    pub dir: tempfile::TempDir,
}

pub async fn embedded() -> Embedded {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("t.db"), Durability::Normal).unwrap();
    let bus = EmbeddedBus::new(store.clone()).unwrap();
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    let sessions = SessionStore::open(store.clone()).await.unwrap();
    harness_session::register(shared.as_ref(), &sessions);
    Embedded {
        store,
        bus,
        shared,
        sessions,
        dir,
    }
}

/// A scripted generation that answers a user text matching `matcher` with one function call.
pub fn call_gen(matcher: &str, id: &str, function_id: &str, arguments: Value) -> Value {
    json!({"match": {"last_user_text": matcher},
           "content": [{"type": "function_call", "id": id, "function_id": function_id, "arguments": arguments}]})
}

/// A scripted generation that answers every request with `text`.
pub fn text_gen(text: &str) -> Value {
    json!({"repeat": true, "content": [{"type": "text", "text": text}]})
}

/// The scripted provider answering from `script` (a `{"generations": [...]}` value).
pub fn scripted(script: &Value, shared: &Arc<dyn Bus>) -> ScriptedProvider {
    let script = Script::from_json(&script.to_string()).unwrap();
    ScriptedProvider::new(script, shared.clone())
}

/// The loop's configuration in tests: frames are not coalesced, so a test sees each one, and
/// the loop's own sweep is bound to a moment no test reaches. At its default (a cron binding,
/// each minute at second 0) it ran parked turns on behind a test that sweeps itself and counts
/// what its sweep did, and such a test failed whenever it crossed a minute.
pub fn config() -> HarnessConfig {
    HarnessConfig {
        stream_coalesce_ms: 0,
        sweep_expression: NO_CRON_SWEEP.into(),
        ..HarnessConfig::default()
    }
}

/// A cron expression for a moment no test reaches (midnight of 1 January).
pub const NO_CRON_SWEEP: &str = "0 0 0 1 1 *";

/// The loop on `shared` with `config`, its functions registered, started.
pub async fn start_loop(shared: Arc<dyn Bus>, config: HarnessConfig) -> Harness {
    let harness = Harness::new(shared, config);
    harness_core::register(&harness);
    harness.start().await.unwrap();
    harness
}

/// `harness::status` of the session; `None` before its first turn.
pub async fn status(harness: &Harness, session_id: &str) -> Option<StatusReport> {
    harness
        .status(StatusRequest {
            session_id: session_id.into(),
            verbose: None,
        })
        .await
        .unwrap()
}

/// Polls `harness::status` until turn `turn_id` of `session_id` is terminal (30 s at most).
pub async fn wait_turn_end(harness: &Harness, session_id: &str, turn_id: &str) -> StatusReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = status(harness, session_id).await;
        if let Some(s) =
            s.filter(|s| s.turn_id.as_deref() == Some(turn_id) && s.status.is_terminal())
        {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "turn {turn_id} did not end in time"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
