//! An in-process runtime (embedded bus, sessions, scripted router, the loop) with an MCP hub
//! whose servers are real processes: the fixture server this crate builds.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::{Bus, EmbeddedBus};
use harness_core::Harness;
use harness_mcp::{Backoff, McpHub, ServerSpec, ServerStatus, Transport};
use harness_router::Router;
use harness_session::SessionStore;
use harness_types::api::StatusReport;
use harness_types::message::FunctionResultMessage;
use harness_types::AgentMessage;
use serde_json::{json, Value};

#[path = "../../../harness-core/tests/support/embedded.rs"]
mod embedded;
pub use embedded::text_gen;
use embedded::{config, embedded, scripted, start_loop, wait_turn_end};

pub const FIXTURE: &str = env!("CARGO_BIN_EXE_harness-mcp-fixture");

/// Retries come fast in tests; the production default starts at 250 ms.
pub const FAST: Backoff = Backoff {
    first: Duration::from_millis(50),
    max: Duration::from_millis(400),
};

pub fn fixture(name: &str, env: &[(&str, &str)]) -> ServerSpec {
    ServerSpec {
        name: name.into(),
        transport: Transport::Stdio {
            command: FIXTURE.into(),
            args: vec![],
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            cwd: None,
        },
        call_timeout: Duration::from_secs(20),
    }
}

pub struct Rt {
    pub harness: Harness,
    pub sessions: SessionStore,
    pub bus: EmbeddedBus,
    pub hub: McpHub,
    _dir: tempfile::TempDir,
}

pub async fn runtime(script: Value, servers: Vec<ServerSpec>) -> Rt {
    let e = embedded().await;
    let router = Router::new();
    router.add_provider(Arc::new(scripted(&script, &e.shared)));
    harness_router::register(e.shared.as_ref(), &router);
    let harness = start_loop(e.shared.clone(), config()).await;
    let hub = McpHub::new(e.shared, FAST);
    hub.apply(servers).await;
    Rt {
        harness,
        sessions: e.sessions,
        bus: e.bus,
        hub,
        _dir: e.dir,
    }
}

/// A runtime whose model answers "hi" to everything, with the MCP `servers`.
pub async fn saying_hi(servers: Vec<ServerSpec>) -> Rt {
    runtime(json!({"generations": [text_gen("hi")]}), servers).await
}

pub fn call_gen(matcher: &str, calls: Vec<(&str, &str, Value)>) -> Value {
    let content: Vec<Value> = calls
        .into_iter()
        .map(|(id, f, args)| json!({"type": "function_call", "id": id, "function_id": f, "arguments": args}))
        .collect();
    json!({"match": {"last_user_text": matcher}, "content": content})
}

pub fn send(text: &str, allow: &[&str]) -> Value {
    json!({"message": text, "model": "m", "provider": "scripted",
           "options": {"functions": {"allow": allow}}})
}

/// Polls `f` until it gives `Some`, for at most 30 s.
pub async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

impl Rt {
    pub fn server(&self, name: &str) -> ServerStatus {
        self.hub
            .status()
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("no server {name}"))
    }

    /// Waits until `name` has failed: its status with the error recorded.
    pub async fn failed(&self, name: &str) -> ServerStatus {
        eventually(&format!("{name} failed"), || {
            Some(self.server(name)).filter(|s| s.last_error.is_some())
        })
        .await
    }

    /// Waits until `name` is connected with its tools registered.
    pub async fn connected(&self, name: &str) -> ServerStatus {
        eventually(&format!("{name} connected"), || {
            Some(self.server(name)).filter(|s| s.connected && !s.functions.is_empty())
        })
        .await
    }

    pub async fn call(&self, function_id: &str, payload: Value) -> Value {
        self.bus
            .call(function_id, payload, None)
            .await
            .unwrap_or_else(|e| panic!("{function_id}: {e}"))
    }

    /// Sends and waits for the turn to end; `(session_id, status)`.
    pub async fn run_turn(&self, payload: Value) -> (String, StatusReport) {
        let r = self.call("harness::send", payload).await;
        let sid = r["session_id"].as_str().unwrap().to_string();
        let tid = r["turn_id"].as_str().unwrap().to_string();
        let s = wait_turn_end(&self.harness, &sid, &tid).await;
        (sid, s)
    }

    pub fn results(&self, session_id: &str) -> Vec<FunctionResultMessage> {
        self.sessions
            .all_entries(session_id, true)
            .unwrap()
            .into_iter()
            .filter_map(|e| match e.message {
                Some(AgentMessage::FunctionResult(f)) => Some(f),
                _ => None,
            })
            .collect()
    }

    pub fn result(&self, session_id: &str, call_id: &str) -> FunctionResultMessage {
        self.results(session_id)
            .into_iter()
            .find(|r| r.function_call_id == call_id)
            .unwrap_or_else(|| panic!("no result for {call_id}"))
    }

    pub fn function_ids(&self) -> Vec<String> {
        self.bus
            .function_defs()
            .into_iter()
            .map(|d| d.function_id)
            .collect()
    }
}

pub fn sigkill(pid: u32) {
    // SAFETY: kill(2) on a pid this test's hub spawned.
    let rc = unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert_eq!(rc, 0, "kill {pid}");
}
