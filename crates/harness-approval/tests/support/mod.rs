//! An in-process runtime with the approval gate: embedded bus, sessions, scripted router, the
//! loop (the setup of `harness-core/tests/support.rs`), plus `harness_approval::install`.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness_bus::{Bus, CallContext, EmbeddedBus, FunctionDef};
use harness_core::{Harness, HarnessConfig};
use harness_router::Router;
use harness_session::SessionStore;
use harness_store::Store;
use harness_types::api::{StatusReport, TurnStatus};
use harness_types::message::FunctionResultMessage;
use harness_types::session::Entry;
use harness_types::AgentMessage;
use serde_json::{json, Value};

#[path = "../../../harness-core/tests/support/embedded.rs"]
mod embedded;
#[allow(unused_imports)] // each test binary uses a different part of it
pub use embedded::{call_gen, text_gen};
use embedded::{embedded, scripted, Embedded};

pub struct Rt {
    pub harness: Harness,
    pub sessions: SessionStore,
    pub store: Store,
    pub bus: EmbeddedBus,
    pub shared: Arc<dyn Bus>,
    pub approvals: harness_approval::Approvals,
    _dir: tempfile::TempDir,
}

pub async fn runtime(script: Value, approve: &[&str]) -> Rt {
    let Embedded {
        store,
        bus,
        shared,
        sessions,
        dir,
    } = embedded().await;
    let router = Router::new();
    router.add_provider(Arc::new(scripted(&script, &shared)));
    harness_router::register(shared.as_ref(), &router);
    harness_tools::register(shared.as_ref(), &harness_tools::Tools::default());
    harness_directory::register(
        shared.as_ref(),
        &harness_directory::Directory::new(dir.path().join("directory")),
    );
    let harness = Harness::new(
        shared.clone(),
        HarnessConfig {
            stream_coalesce_ms: 0,
            // These tests look at the exact arguments a held call runs with: no root stamped.
            default_filesystem_root: Some("off".into()),
            ..HarnessConfig::default()
        },
    );
    harness_core::register(&harness);
    let approvals = harness_approval::install(
        shared.clone(),
        approve.iter().map(|s| s.to_string()).collect(),
    )
    .await
    .unwrap();
    harness.start().await.unwrap();
    Rt {
        harness,
        sessions,
        store,
        bus,
        shared,
        approvals,
        _dir: dir,
    }
}

/// A `harness::send` payload that allows every function.
pub fn send_allowing(text: &str, session_id: Option<&str>) -> Value {
    let mut v = json!({"message": text, "model": "m", "provider": "scripted",
                       "options": {"functions": {"allow": ["*"]}}});
    if let Some(s) = session_id {
        v["session_id"] = json!(s);
    }
    v
}

/// The string `field` of every element of the JSON array `list`, in order.
pub fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("an array: {list}"));
    items.iter().map(|e| e[field].as_str().unwrap()).collect()
}

/// What a registered target saw, one entry per run.
pub type Seen = Arc<Mutex<Vec<Value>>>;

impl Rt {
    pub async fn call(&self, function_id: &str, payload: Value) -> Result<Value, String> {
        self.bus
            .call(function_id, payload, None)
            .await
            .map_err(|e| e.to_string())
    }

    pub async fn ok(&self, function_id: &str, payload: Value) -> Value {
        match self.call(function_id, payload.clone()).await {
            Ok(v) => v,
            Err(e) => panic!("{function_id} {payload}: {e}"),
        }
    }

    pub async fn err(&self, function_id: &str, payload: Value) -> String {
        match self.call(function_id, payload.clone()).await {
            Ok(v) => panic!("{function_id} {payload} should fail, answered {v}"),
            Err(e) => e,
        }
    }

    /// Sends and returns `(session_id, turn_id)`.
    pub async fn send(&self, payload: Value) -> (String, String) {
        let r = self.ok("harness::send", payload).await;
        (
            r["session_id"].as_str().unwrap().to_string(),
            r["turn_id"].as_str().unwrap().to_string(),
        )
    }

    /// The stored record of the approval `a` (as `approval::list` showed it).
    pub async fn stored(&self, a: &Value) -> Value {
        let id = a["approval_id"].as_str().unwrap();
        self.shared
            .state_get(harness_approval::SCOPE, id)
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("no record of {id}"))
    }

    /// Registers a target that records its arguments.
    pub fn target(&self, id: &str) -> Seen {
        let seen: Seen = Default::default();
        let log = seen.clone();
        self.bus.register_function(
            FunctionDef::new(id, "test target"),
            Arc::new(move |p: Value, _ctx: CallContext| {
                log.lock().unwrap().push(p);
                async move { Ok(json!({"ok": true})) }
            }),
        );
        seen
    }

    /// Registers a pre-trigger hook function that counts its calls and answers `answer`.
    pub fn hook(&self, id: &str, answer: Value) -> Arc<AtomicUsize> {
        let n = Arc::new(AtomicUsize::new(0));
        let count = n.clone();
        self.bus.register_function(
            FunctionDef::new(id, "test hook"),
            Arc::new(move |_p: Value, _ctx: CallContext| {
                count.fetch_add(1, Ordering::SeqCst);
                let a = answer.clone();
                async move { Ok(a) }
            }),
        );
        n
    }

    pub async fn status(&self, session_id: &str) -> Option<StatusReport> {
        embedded::status(&self.harness, session_id).await
    }

    /// Polls (with a deadline) until the session's turn reaches `status`.
    pub async fn wait_status(&self, session_id: &str, status: TurnStatus) -> StatusReport {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.status(session_id).await;
            if let Some(s) = s.as_ref().filter(|s| s.status == status) {
                return s.clone();
            }
            assert!(
                Instant::now() < deadline,
                "session never reached {status:?}; last {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Polls (with a deadline) until turn `turn_id` is terminal.
    pub async fn wait_terminal(&self, session_id: &str, turn_id: &str) -> StatusReport {
        embedded::wait_turn_end(&self.harness, session_id, turn_id).await
    }

    pub fn entries(&self, session_id: &str) -> Vec<Entry> {
        self.sessions.all_entries(session_id, true).unwrap()
    }

    pub fn results(&self, session_id: &str) -> Vec<(FunctionResultMessage, Option<Value>)> {
        self.entries(session_id)
            .into_iter()
            .filter_map(|e| match e.message {
                Some(AgentMessage::FunctionResult(f)) => Some((f, e.origin)),
                _ => None,
            })
            .collect()
    }

    /// The pending approvals of a session.
    pub async fn pending(&self, session_id: &str) -> Vec<Value> {
        self.ok("approval::list", json!({"session_id": session_id}))
            .await["approvals"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    pub async fn gate_bindings(&self) -> Vec<harness_bus::Binding> {
        self.shared
            .bindings(harness_approval::PRE_TRIGGER)
            .await
            .unwrap()
            .into_iter()
            .filter(|b| b.function_id == harness_approval::GATE)
            .collect()
    }
}
