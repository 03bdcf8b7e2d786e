//! `session::changes`: a cached reader sees exactly the entries appended or updated after its
//! mark, and transcripts written before change marks existed still read in full.

use harness_session::SessionStore;
use harness_store::{Durability, Store};
use harness_types::message::{AgentMessage, ContentBlock};
use harness_types::session::*;

async fn open(dir: &std::path::Path) -> SessionStore {
    let store = Store::open(&dir.join("t.db"), Durability::Normal).unwrap();
    SessionStore::open(store).await.unwrap()
}

async fn append(s: &SessionStore, sid: &str, entry_id: &str, text: &str) {
    s.append(AppendRequest {
        session_id: sid.into(),
        message: Some(AgentMessage::user_text(text, 1)),
        custom: None,
        entry_id: Some(entry_id.into()),
        origin: None,
    })
    .await
    .unwrap();
}

fn changes(s: &SessionStore, sid: &str, after: Option<i64>, limit: Option<u32>) -> ChangesResponse {
    s.changes(&ChangesRequest {
        session_id: sid.into(),
        after,
        limit,
    })
    .unwrap()
}

fn ids(r: &ChangesResponse) -> Vec<&str> {
    r.entries.iter().map(|e| e.entry_id.as_str()).collect()
}

#[tokio::test]
async fn a_reader_gets_only_what_changed_after_its_mark() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path()).await;
    s.create(CreateRequest {
        session_id: Some("s".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    s.create(CreateRequest {
        session_id: Some("other".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    for i in 0..3 {
        append(&s, "s", &format!("e{i}"), "hi").await;
    }
    let all = changes(&s, "s", None, None);
    assert_eq!(ids(&all), ["e0", "e1", "e2"]);
    assert!(!all.more);
    let nothing = changes(&s, "s", Some(all.mark), None);
    assert!(nothing.entries.is_empty());
    assert_eq!(nothing.mark, all.mark, "no change keeps the mark");

    // Another session's writes are not this session's changes.
    append(&s, "other", "x", "elsewhere").await;
    assert!(changes(&s, "s", Some(all.mark), None).entries.is_empty());

    // An update and an append: both, the update with its new content, each once.
    s.update_message(UpdateMessageRequest {
        session_id: "s".into(),
        entry_id: "e1".into(),
        content: vec![ContentBlock::text("edited")],
        usage: None,
        stop_reason: None,
        details: None,
        expected_revision: None,
        origin: None,
    })
    .await
    .unwrap();
    append(&s, "s", "e3", "new").await;
    let delta = changes(&s, "s", Some(all.mark), None);
    assert_eq!(ids(&delta), ["e1", "e3"]);
    assert_eq!(delta.entries[0].revision, 1);
    assert!(delta.mark > all.mark);
    // A repeated append (same entry_id) changes nothing.
    append(&s, "s", "e3", "again").await;
    assert!(changes(&s, "s", Some(delta.mark), None).entries.is_empty());

    // Paging: `more` until the last page; the pages add up to every entry once.
    let p1 = changes(&s, "s", None, Some(3));
    assert!(p1.more);
    let p2 = changes(&s, "s", Some(p1.mark), Some(3));
    assert!(!p2.more);
    assert_eq!(p1.entries.len() + p2.entries.len(), 4);
}

#[tokio::test]
async fn unknown_session_and_bad_limit_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path()).await;
    let e = s
        .changes(&ChangesRequest {
            session_id: "nope".into(),
            after: None,
            limit: None,
        })
        .unwrap_err();
    assert!(e.to_string().contains("session_id"), "{e}");
    s.create(CreateRequest {
        session_id: Some("s".into()),
        ..Default::default()
    })
    .await
    .unwrap();
    let e = s
        .changes(&ChangesRequest {
            session_id: "s".into(),
            after: None,
            limit: Some(0),
        })
        .unwrap_err();
    assert!(e.to_string().contains("limit"), "{e}");
}

#[tokio::test]
async fn entries_written_before_change_marks_read_in_full() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        // The transcript tables as they were before `chg`.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, title TEXT, metadata TEXT NOT NULL DEFAULT '{}',
                 kind TEXT, status TEXT NOT NULL DEFAULT 'idle', status_reason TEXT,
                 created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL);
             CREATE TABLE entries (session_id TEXT NOT NULL, seq INTEGER NOT NULL, entry_id TEXT NOT NULL,
                 kind TEXT NOT NULL, body TEXT NOT NULL, origin TEXT, revision INTEGER NOT NULL DEFAULT 0,
                 PRIMARY KEY (session_id, seq)) WITHOUT ROWID;
             CREATE UNIQUE INDEX entries_by_id ON entries (session_id, entry_id);
             INSERT INTO sessions (session_id, created_at, updated_at) VALUES ('s', 1, 1);",
        )
        .unwrap();
        for (seq, id) in [(1, "old1"), (2, "old2")] {
            let body = serde_json::to_string(&AgentMessage::user_text(id, 1)).unwrap();
            conn.execute(
                "INSERT INTO entries (session_id, seq, entry_id, kind, body) VALUES ('s', ?1, ?2, 'message', ?3)",
                rusqlite::params![seq, id, body],
            )
            .unwrap();
        }
    }
    let s = open(dir.path()).await;
    append(&s, "s", "new", "after the upgrade").await;
    let all = changes(&s, "s", None, None);
    assert_eq!(ids(&all), ["old1", "old2", "new"]);
    let p1 = changes(&s, "s", None, Some(1));
    assert_eq!(ids(&p1), ["old1"]);
    assert_eq!(ids(&changes(&s, "s", Some(p1.mark), None)), ["old2", "new"]);
}
