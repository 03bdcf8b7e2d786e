//! A session's status lives in its `set-status` event and the writer's memory until the store's
//! fold writes it into the `sessions` row: every read answers the same before and after the
//! fold, across a clean restart, and after a SIGKILL that left statuses unfolded.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};

use common::{create, open};
use harness_session::SessionStore;
use harness_types::session::*;
use serde_json::json;

async fn set(s: &SessionStore, sid: &str, status: SessionStatus, reason: Option<&str>) -> bool {
    s.set_status(SetStatusRequest {
        session_id: sid.into(),
        status,
        reason: reason.map(Into::into),
    })
    .await
    .unwrap()
    .changed
}

fn status(s: &SessionStore, sid: &str) -> (SessionStatus, Option<String>) {
    let meta = s.get(sid).unwrap().expect("session");
    (meta.status, meta.status_reason)
}

/// The row itself, as the fold left it.
fn row_status(s: &SessionStore, sid: &str) -> String {
    s.store()
        .read(|c| {
            Ok(c.query_row(
                "SELECT status FROM sessions WHERE session_id = ?1",
                [sid],
                |r| r.get(0),
            )?)
        })
        .unwrap()
}

#[tokio::test]
async fn a_status_reads_the_same_unfolded_folded_and_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let s = open(&path).await;
    create(&s, "a", json!({})).await;
    let created = s.get("a").unwrap().unwrap().updated_at;

    assert!(set(&s, "a", SessionStatus::Working, Some("preparing context")).await);
    assert_eq!(
        status(&s, "a"),
        (SessionStatus::Working, Some("preparing context".into()))
    );
    assert!(s.get("a").unwrap().unwrap().updated_at >= created);
    // The same status again changes nothing, answered against the unfolded one.
    assert!(!set(&s, "a", SessionStatus::Working, Some("preparing context")).await);
    // Not written into the row: that is the fold's.
    assert_eq!(row_status(&s, "a"), "idle");

    s.store().fold_events().await.unwrap();
    assert_eq!(row_status(&s, "a"), "working");
    assert_eq!(
        status(&s, "a"),
        (SessionStatus::Working, Some("preparing context".into()))
    );
    assert!(!set(&s, "a", SessionStatus::Working, Some("preparing context")).await);

    assert!(set(&s, "a", SessionStatus::Done, None).await);
    assert_eq!(status(&s, "a"), (SessionStatus::Done, None));
    // Ensure answers with the status its write sees.
    let ensured = s
        .ensure(EnsureRequest {
            session_id: "a".into(),
            title: None,
            metadata: None,
            kind: None,
        })
        .await
        .unwrap();
    assert_eq!(ensured.meta.status, SessionStatus::Done);
    let listed = s.list(&ListRequest::default()).unwrap();
    assert_eq!(listed.sessions[0].status, SessionStatus::Done);

    // A status change of a session that does not exist is refused, as before.
    let missing = s
        .set_status(SetStatusRequest {
            session_id: "nope".into(),
            status: SessionStatus::Working,
            reason: None,
        })
        .await;
    assert!(missing.is_err());

    s.store().close();
    drop(s);
    let s = open(&path).await;
    assert_eq!(status(&s, "a"), (SessionStatus::Done, None));
    assert_eq!(row_status(&s, "a"), "done");
}

/// A deleted session's unfolded status goes with it: created again under the same id it is
/// idle, before and after the fold, and after a restart that catches up from the events.
#[tokio::test]
async fn a_deleted_session_leaves_no_status_behind() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let s = open(&path).await;
    create(&s, "a", json!({})).await;
    set(&s, "a", SessionStatus::Error, Some("boom")).await;
    let deleted = s
        .delete(DeleteRequest {
            session_id: "a".into(),
        })
        .await
        .unwrap();
    assert!(deleted.deleted);
    create(&s, "a", json!({})).await;
    assert_eq!(status(&s, "a"), (SessionStatus::Idle, None));
    s.store().fold_events().await.unwrap();
    assert_eq!(status(&s, "a"), (SessionStatus::Idle, None));
    s.store().close();
    drop(s);

    // What a process killed after a status change, a delete and a create again leaves
    // unfolded: the events (the create has none) and a new idle row.
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "INSERT INTO events(session_id, topic, payload, at_ms) VALUES
               ('a', 'session::status-changed', '{\"session_id\":\"a\",\"status\":\"working\",\"reason\":null}', 1),
               ('a', 'session::deleted', '{\"session_id\":\"a\"}', 2);
             INSERT INTO events(session_id, topic, payload, at_ms) VALUES
               ('b', 'session::status-changed', '{\"session_id\":\"b\",\"status\":\"working\",\"reason\":\"r\"}', 3);
             INSERT INTO sessions (session_id, metadata, status, created_at, updated_at)
               VALUES ('b', '{}', 'idle', 1, 1);",
        )
        .unwrap();
    }
    let s = open(&path).await;
    assert_eq!(status(&s, "a"), (SessionStatus::Idle, None));
    assert_eq!(status(&s, "b"), (SessionStatus::Working, Some("r".into())));
}

const CHILD_ENV: &str = "HARNESS_SESSION_STATUS_CHILD_DB";
const SESSIONS: usize = 8;

/// The child's body; a no-op when run as an ordinary test. Sessions `s0`..`s7`, each set to a
/// new status (reason `n`, counting up) over and over, every resolved change printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let s = open(path.as_ref()).await;
    for i in 0..SESSIONS {
        create(&s, &format!("s{i}"), json!({})).await;
    }
    let mut tasks = Vec::new();
    for i in 0..SESSIONS {
        let s = s.clone();
        tasks.push(tokio::spawn(async move {
            let sid = format!("s{i}");
            for n in 1u64.. {
                let status = if n % 2 == 1 {
                    SessionStatus::Working
                } else {
                    SessionStatus::Done
                };
                assert!(set(&s, &sid, status, Some(&n.to_string())).await);
                println!("set {sid} {n}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// SIGKILL mid-stream: every status change the child saw resolve is found at the next start
/// (or a later one of the same session's, committed before it died).
#[test]
fn sigkill_loses_no_resolved_status() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("status.db");
    let mut child = common::spawn_child("status_child", CHILD_ENV, &db);
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut last: HashMap<String, u64> = HashMap::new();
    let mut seen = 0;
    for line in stdout.lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("set ") {
            let (sid, n) = rest.split_once(' ').unwrap();
            last.insert(sid.to_string(), n.parse().unwrap());
            seen += 1;
        }
        // Well past the events' fold size, so some statuses are folded and some are not.
        if seen == 12_000 {
            child.kill().unwrap();
        }
    }
    child.wait().unwrap();
    assert!(seen >= 12_000, "child died early after {seen} changes");

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let s = open(&db).await;
        for (sid, n) in &last {
            let (got, reason) = status(&s, sid);
            let got_n: u64 = reason.expect("a reason").parse().unwrap();
            assert!(got_n >= *n, "{sid}: status {got_n} after {n} was reported");
            let want = if got_n % 2 == 1 {
                SessionStatus::Working
            } else {
                SessionStatus::Done
            };
            assert_eq!(got, want, "{sid}: status and reason from one change");
        }
    });
}
