//! Writes naming a session or an entry that does not exist are refused by field, and a status
//! that does not change is no change (no event).

use harness_session::SessionStore;
use harness_store::{Durability, Store};
use harness_types::ErrorCode;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

fn req<T: DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).unwrap()
}

async fn open() -> (SessionStore, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("s.db"), Durability::Normal).unwrap();
    (SessionStore::open(store).await.unwrap(), dir)
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": [{"type": "text", "text": text}], "timestamp": 1})
}

/// The error's text, after checking it is a `not_found`.
fn not_found(e: harness_session::SessionError) -> String {
    let e = harness_types::HarnessError::from(e);
    assert_eq!(e.code, ErrorCode::NotFound, "{}", e.message);
    e.message
}

async fn create(sessions: &SessionStore, session_id: &str) {
    sessions
        .create(req(json!({ "session_id": session_id })))
        .await
        .unwrap();
}

async fn status_events(sessions: &SessionStore, session_id: &str) -> usize {
    sessions
        .store()
        .events_after(session_id, 0, 1000)
        .unwrap()
        .iter()
        .filter(|e| e.topic == "session::status-changed")
        .count()
}

#[tokio::test]
async fn an_append_to_a_missing_session_is_refused_and_writes_nothing() {
    let (sessions, _dir) = open().await;
    let e = sessions
        .append(req(json!({"session_id": "s_none", "message": user("hi")})))
        .await
        .unwrap_err();
    let text = not_found(e);
    assert!(
        text.contains("session_id") && text.contains("s_none"),
        "{text}"
    );
    assert!(sessions.all_entries("s_none", true).is_err());
    assert!(sessions
        .store()
        .events_after("s_none", 0, 10)
        .unwrap()
        .is_empty());
}

#[tokio::test]
async fn an_update_names_the_missing_session_before_the_missing_entry() {
    let (sessions, _dir) = open().await;
    let update =
        |session: &str| req(json!({"session_id": session, "entry_id": "e_x", "content": []}));
    let text = not_found(sessions.update_message(update("s_none")).await.unwrap_err());
    assert!(text.contains("session_id: no session 's_none'"), "{text}");

    create(&sessions, "s_1").await;
    let text = not_found(sessions.update_message(update("s_1")).await.unwrap_err());
    assert!(text.contains("entry_id: no entry 'e_x'"), "{text}");
}

#[tokio::test]
async fn a_status_set_twice_changes_once_and_a_missing_session_is_refused() {
    let (sessions, _dir) = open().await;
    let set = |session: &str, status: &str, reason: Option<&str>| {
        req(json!({"session_id": session, "status": status, "reason": reason}))
    };
    let text = not_found(
        sessions
            .set_status(set("s_none", "working", None))
            .await
            .unwrap_err(),
    );
    assert!(text.contains("s_none"), "{text}");

    create(&sessions, "s_1").await;
    let first = sessions
        .set_status(set("s_1", "working", Some("a")))
        .await
        .unwrap();
    let again = sessions
        .set_status(set("s_1", "working", Some("a")))
        .await
        .unwrap();
    let reason = sessions
        .set_status(set("s_1", "working", Some("b")))
        .await
        .unwrap();
    let cleared = sessions
        .set_status(set("s_1", "working", None))
        .await
        .unwrap();
    let cleared_again = sessions
        .set_status(set("s_1", "working", None))
        .await
        .unwrap();
    assert_eq!(
        [
            first.changed,
            again.changed,
            reason.changed,
            cleared.changed,
            cleared_again.changed
        ],
        [true, false, true, true, false]
    );
    assert_eq!(status_events(&sessions, "s_1").await, 3);
    let meta = sessions.get("s_1").unwrap().unwrap();
    assert_eq!(
        (
            meta.status_reason,
            serde_json::to_value(meta.status).unwrap()
        ),
        (None, json!("working"))
    );
}

#[tokio::test]
async fn a_sessions_first_and_later_entries_append_in_order() {
    let (sessions, _dir) = open().await;
    create(&sessions, "s_1").await;
    for (i, text) in ["one", "two", "three"].iter().enumerate() {
        let r = sessions
            .append(req(
                json!({"session_id": "s_1", "entry_id": format!("e_{i}"), "message": user(text)}),
            ))
            .await
            .unwrap();
        assert_eq!((r.seq, r.appended), (i as i64 + 1, true));
    }
    let again = sessions
        .append(req(
            json!({"session_id": "s_1", "entry_id": "e_1", "message": user("dup")}),
        ))
        .await
        .unwrap();
    assert_eq!((again.seq, again.appended), (2, false));

    // Folded into `entries`: a repeat is found there, and the next seq follows the folded ones
    // and then the log's.
    sessions.store().fold_events().await.unwrap();
    let append = |entry_id: &str| {
        sessions.append(req(
            json!({"session_id": "s_1", "entry_id": entry_id, "message": user("x")}),
        ))
    };
    let r = append("e_0").await.unwrap();
    assert_eq!((r.seq, r.appended), (1, false), "a folded repeat");
    let r = append("e_3").await.unwrap();
    assert_eq!((r.seq, r.appended), (4, true), "after the folded entries");
    let r = append("e_4").await.unwrap();
    assert_eq!((r.seq, r.appended), (5, true), "after the logged one");
    let r = append("e_3").await.unwrap();
    assert_eq!((r.seq, r.appended), (4, false), "a logged repeat");
}
