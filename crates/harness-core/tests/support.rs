//! An in-process runtime for loop tests: embedded bus, sessions, scripted router, the loop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::{Bus, EmbeddedBus};
use harness_core::{Harness, HarnessConfig};
use harness_router::scripted::{Script, ScriptedProvider};
use harness_router::Router;
use harness_session::SessionStore;
use harness_store::{Durability, Store};
use harness_types::api::{SendRequest, StatusReport, StatusRequest};
use harness_types::session::Entry;
use serde_json::{json, Value};

pub struct Rt {
    pub harness: Harness,
    pub sessions: SessionStore,
    pub store: Store,
    pub bus: EmbeddedBus,
    _dir: tempfile::TempDir,
}

pub async fn runtime(script: Value, config: HarnessConfig) -> Rt {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("t.db"), Durability::Normal).unwrap();
    let bus = EmbeddedBus::new(store.clone()).unwrap();
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    let sessions = SessionStore::open(store.clone()).await.unwrap();
    harness_session::register(shared.as_ref(), &sessions);
    let router = Router::new();
    let script = Script::from_json(&script.to_string()).unwrap();
    router.add_provider(Arc::new(ScriptedProvider::new(script, shared.clone())));
    harness_router::register(shared.as_ref(), &router);
    let harness = Harness::new(shared, config);
    harness_core::register(&harness);
    harness.start().await.unwrap();
    Rt {
        harness,
        sessions,
        store,
        bus,
        _dir: dir,
    }
}

pub fn config() -> HarnessConfig {
    HarnessConfig {
        stream_coalesce_ms: 0,
        ..HarnessConfig::default()
    }
}

pub fn send(message: &str) -> SendRequest {
    SendRequest {
        message: json!(message),
        model: Some("m".into()),
        provider: Some("scripted".into()),
        ..Default::default()
    }
}

impl Rt {
    pub async fn status(&self, session_id: &str) -> Option<StatusReport> {
        self.harness
            .status(StatusRequest {
                session_id: session_id.into(),
                verbose: None,
            })
            .await
            .unwrap()
    }

    /// Waits (with a deadline) until the session's turn `turn_id` is terminal.
    pub async fn wait_terminal(&self, session_id: &str, turn_id: &str) -> StatusReport {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.status(session_id).await {
                if s.turn_id.as_deref() == Some(turn_id) && s.status.is_terminal() {
                    // The terminal side effects (records, event) follow the terminal write.
                    self.completed_events(session_id, turn_id).await;
                    return s;
                }
            }
            assert!(
                Instant::now() < deadline,
                "turn {turn_id} did not end in time"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits (with a deadline) for the turn's `harness::turn-completed`, which is published just
    /// after the terminal record is written; returns every such event of the session.
    pub async fn completed_events(&self, session_id: &str, turn_id: &str) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let events: Vec<Value> = self
                .topics(session_id)
                .into_iter()
                .filter(|(t, p)| t == "harness::turn-completed" && p["turn_id"] == turn_id)
                .map(|(_, p)| p)
                .collect();
            if !events.is_empty() {
                return events;
            }
            assert!(Instant::now() < deadline, "no turn-completed for {turn_id}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub fn entries(&self, session_id: &str) -> Vec<Entry> {
        self.sessions.all_entries(session_id, true).unwrap()
    }

    /// `(role, text)` of every message entry.
    pub fn messages(&self, session_id: &str) -> Vec<(String, String)> {
        self.entries(session_id)
            .into_iter()
            .filter_map(|e| e.message.map(|m| (m.role().to_string(), m.text())))
            .collect()
    }

    pub fn topics(&self, session_id: &str) -> Vec<(String, Value)> {
        self.store
            .events_after(session_id, 0, 10_000)
            .unwrap()
            .into_iter()
            .map(|r| (r.topic, r.payload))
            .collect()
    }
}
