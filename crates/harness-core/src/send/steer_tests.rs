//! The locked half of a send meeting a running turn (turn machine row T02): the send read no
//! running turn lock-free, and a turn started while it waited for the session lock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness_bus::{Bus, EmbeddedBus};
use harness_router::scripted::{Script, ScriptedProvider};
use harness_router::Router;
use harness_store::{Durability, Store};
use harness_types::api::SendRequest;
use serde_json::{json, Value};

use crate::{Harness, HarnessConfig, TURN_SCOPE};

async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn send(session_id: Option<&str>, text: &str) -> SendRequest {
    SendRequest {
        session_id: session_id.map(str::to_string),
        message: json!(text),
        model: Some("m".into()),
        provider: Some("scripted".into()),
        ..Default::default()
    }
}

async fn record(bus: &EmbeddedBus, session_id: &str) -> Value {
    bus.state_get(TURN_SCOPE, session_id)
        .await
        .unwrap()
        .unwrap_or(Value::Null)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_that_waited_for_the_lock_while_a_turn_started_steers_that_turn() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("t.db"), Durability::Normal).unwrap();
    let bus = EmbeddedBus::new(store.clone()).unwrap();
    let shared: Arc<dyn Bus> = Arc::new(bus.clone());
    let sessions = harness_session::SessionStore::open(store).await.unwrap();
    harness_session::register(shared.as_ref(), &sessions);
    let script =
        json!({"generations": [{"repeat": true, "content": [{"type": "text", "text": "hi"}]}]});
    let router = Router::new();
    router.add_provider(Arc::new(ScriptedProvider::new(
        Script::from_json(&script.to_string()).unwrap(),
        shared.clone(),
    )));
    harness_router::register(shared.as_ref(), &router);
    let h = Harness::new(shared, HarnessConfig::default());
    crate::register(&h);
    h.start().await.unwrap();

    let first = h.send(send(None, "hello")).await.unwrap();
    let sid = first.session_id.clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    while record(&bus, &sid).await["status"] != "completed" {
        assert!(Instant::now() < deadline, "the first turn never ended");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let guard = h.inner.locks.lock(&sid).await;
    let second = tokio::spawn({
        let h = h.clone();
        let req = send(Some(&sid), "second");
        async move { h.send(req).await }
    });
    until("the send waits for the lock", || {
        h.inner.locks.sharers(&sid) >= 2
    })
    .await;
    // Meanwhile a turn starts, as another send or a resumed turn makes one.
    let mut running = record(&bus, &sid).await;
    running["status"] = json!("running");
    running["turn_id"] = json!("t_meanwhile");
    running["step"] = json!(0);
    running["turn_count"] = json!(0);
    running["generated"] = Value::Null;
    bus.state_set(TURN_SCOPE, &sid, running).await.unwrap();
    drop(guard);

    let out = second.await.unwrap().unwrap();
    assert_eq!(out.turn_id, "t_meanwhile", "no second turn");
    assert_eq!((out.merged, out.queued), (Some(true), Some(true)));
    // Parked for the running turn's next step, not appended behind its back.
    let queued = h.queued(&sid).await.unwrap();
    assert_eq!(queued.len(), 1, "{queued:?}");
    let users: Vec<String> = sessions_user_texts(&h, &sid).await;
    assert_eq!(users, ["hello"]);
    assert_eq!(record(&bus, &sid).await["turn_id"], "t_meanwhile");
}

async fn sessions_user_texts(h: &Harness, session_id: &str) -> Vec<String> {
    h.transcript(session_id)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.message {
            Some(harness_types::AgentMessage::User(u)) => {
                Some(harness_types::message::joined_text(&u.content))
            }
            _ => None,
        })
        .collect()
}
