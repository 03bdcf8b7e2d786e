//! `session::changes`: a cached reader sees exactly the entries appended or updated after its
//! mark, and transcripts written before change marks existed still read in full.

mod common;

use harness_session::SessionStore;
use harness_types::message::AgentMessage;
use harness_types::session::*;

async fn open(dir: &std::path::Path) -> SessionStore {
    common::open(&dir.join("t.db")).await
}

/// A store with the session "s" and a neighbour "other", whose changes must never show in s's.
async fn open_with_neighbour(dir: &std::path::Path) -> SessionStore {
    let s = open(dir).await;
    for sid in ["s", "other"] {
        create(&s, sid).await;
    }
    s
}

async fn append(s: &SessionStore, sid: &str, entry_id: &str, text: &str) {
    let message = AgentMessage::user_text(text, 1);
    common::add(s, sid, Some(entry_id), message).await;
}

async fn create(s: &SessionStore, sid: &str) {
    common::create(s, sid, serde_json::json!({})).await;
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
    create(&s, "s").await;
    create(&s, "other").await;
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
    s.update_message(edit("s", "e1", "edited")).await.unwrap();
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
    create(&s, "s").await;
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

fn edit(sid: &str, entry_id: &str, text: &str) -> UpdateMessageRequest {
    common::edit(sid, entry_id, text, None)
}

/// What SQLite holds: every entry changed after `after`, in change order. The transcript is
/// the materialized `entries` overlaid with the latest version of each entry in `entry_log`
/// (what the next fold will write there).
fn in_sqlite(path: &std::path::Path, sid: &str, after: i64) -> Vec<(String, i64, String)> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut stmt = conn
        .prepare(
            "WITH logged AS (
                 SELECT seq, entry_id, revision, body, id AS chg FROM entry_log l
                 WHERE session_id = ?1
                   AND id = (SELECT MAX(id) FROM entry_log WHERE session_id = ?1 AND seq = l.seq)
             )
             SELECT entry_id, revision, body FROM (
                 SELECT entry_id, revision, body, chg FROM entries
                 WHERE session_id = ?1 AND seq NOT IN (SELECT seq FROM logged)
                 UNION ALL SELECT entry_id, revision, body, chg FROM logged
             ) WHERE chg > ?2 ORDER BY chg",
        )
        .unwrap();
    stmt.query_map(rusqlite::params![sid, after], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?))
    })
    .unwrap()
    .map(Result::unwrap)
    .collect()
}

fn as_rows(r: &ChangesResponse) -> Vec<(String, i64, String)> {
    r.entries
        .iter()
        .map(|e| {
            (
                e.entry_id.clone(),
                e.revision,
                serde_json::to_string(e.message.as_ref().unwrap()).unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_reader_after_its_first_read_is_answered_from_memory_as_sqlite_would() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let s = open_with_neighbour(dir.path()).await;
    append(&s, "s", "e0", "zero").await;
    append(&s, "s", "e1", "one").await;
    // The first read comes from SQLite; from its mark on the writes are kept in memory.
    let first = changes(&s, "s", None, None);
    assert_eq!(ids(&first), ["e0", "e1"]);
    let mut mark = first.mark;
    for round in 0..5 {
        append(&s, "s", &format!("n{round}"), "new").await;
        // An entry updated twice since the mark is answered once, as it is now.
        s.update_message(edit("s", "e1", &format!("edit {round}a")))
            .await
            .unwrap();
        s.update_message(edit("s", "e1", &format!("edit {round}b")))
            .await
            .unwrap();
        append(&s, "other", &format!("o{round}"), "elsewhere").await;
        let delta = changes(&s, "s", Some(mark), None);
        assert_eq!(
            as_rows(&delta),
            in_sqlite(&path, "s", mark),
            "round {round}"
        );
        assert_eq!(ids(&delta), [format!("n{round}").as_str(), "e1"]);
        assert!(delta.mark > mark);
        mark = delta.mark;
        assert!(changes(&s, "s", Some(mark), None).entries.is_empty());
    }
    // Paged from memory too.
    for i in 0..5 {
        append(&s, "s", &format!("p{i}"), "page").await;
    }
    let p1 = changes(&s, "s", Some(mark), Some(3));
    assert!(p1.more);
    let p2 = changes(&s, "s", Some(p1.mark), Some(3));
    assert!(!p2.more);
    assert_eq!(
        [ids(&p1), ids(&p2)].concat(),
        ["p0", "p1", "p2", "p3", "p4"]
    );

    // A change made behind the store's back (another process, which the store does not
    // support) is not seen by a reader answered from memory: proof that it is. (Folded first,
    // so that the row changed is the one readers take.)
    s.store().fold_events().await.unwrap();
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute(
        "UPDATE entries SET revision = 99, chg = 1 << 60 WHERE session_id = 's' AND entry_id = 'e0'",
        [],
    )
    .unwrap();
    assert!(changes(&s, "s", Some(p2.mark), None).entries.is_empty());
    // A reader from further back than the memory holds reads SQLite, and sees it.
    let all = changes(&s, "s", None, None);
    assert_eq!(all.entries.last().unwrap().revision, 99);
}

#[tokio::test]
async fn a_deleted_session_is_not_answered_from_memory() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path()).await;
    let create = || CreateRequest {
        session_id: Some("s".into()),
        ..Default::default()
    };
    s.create(create()).await.unwrap();
    append(&s, "s", "e0", "zero").await;
    let first = changes(&s, "s", None, None);
    assert!(changes(&s, "s", Some(first.mark), None).entries.is_empty());
    s.delete(DeleteRequest {
        session_id: "s".into(),
    })
    .await
    .unwrap();
    let gone = s.changes(&ChangesRequest {
        session_id: "s".into(),
        after: Some(first.mark),
        limit: None,
    });
    assert!(gone.is_err(), "{gone:?}");
    // Made again: only what the new session holds.
    s.create(create()).await.unwrap();
    append(&s, "s", "again", "new life").await;
    assert_eq!(ids(&changes(&s, "s", Some(first.mark), None)), ["again"]);
    assert_eq!(ids(&changes(&s, "s", None, None)), ["again"]);
}

/// A reader racing a writer ends with exactly the transcript, whichever of them is first at
/// each step (the memory is opened from reads that a write may overtake).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_racing_writes_ends_with_the_transcript() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path()).await;
    create(&s, "s").await;
    let writer = {
        let s = s.clone();
        tokio::spawn(async move {
            for i in 0..200 {
                append(&s, "s", &format!("e{i}"), "text").await;
                if i % 3 == 0 {
                    s.update_message(edit("s", &format!("e{}", i / 2), &format!("v{i}")))
                        .await
                        .unwrap();
                }
            }
        })
    };
    let mut seen = std::collections::BTreeMap::new();
    let mut mark = None;
    let mut reads = 0;
    loop {
        let done = writer.is_finished();
        let page = changes(&s, "s", mark, None);
        for e in page.entries {
            seen.insert(e.entry_id.clone(), (e.revision, e.message));
        }
        mark = Some(page.mark);
        reads += 1;
        if done {
            break;
        }
        tokio::task::yield_now().await;
    }
    writer.await.unwrap();
    let all = changes(&s, "s", None, None);
    let expected: std::collections::BTreeMap<_, _> = all
        .entries
        .into_iter()
        .map(|e| (e.entry_id.clone(), (e.revision, e.message)))
        .collect();
    assert_eq!(seen.len(), 200);
    assert_eq!(seen, expected, "after {reads} reads");
}

/// With nothing in memory (a restart), a reader from any mark is answered by SQLite through the
/// session's events, and gets what the entries' own marks say changed after it, page by page.
/// The layout before that indexed `(session_id, chg)`; opening it drops the index.
#[tokio::test]
async fn after_a_restart_every_mark_reads_what_changed_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = open_with_neighbour(dir.path()).await;
        for i in 0..6 {
            append(&s, "s", &format!("e{i}"), "text").await;
            append(&s, "other", &format!("e{i}"), "same ids elsewhere").await;
            s.update_message(edit("s", &format!("e{}", i / 2), &format!("v{i}")))
                .await
                .unwrap();
        }
        // A session deleted and made again: the old incarnation's events name entry ids the
        // new one reuses, and must not bring them back.
        s.delete(DeleteRequest {
            session_id: "s".into(),
        })
        .await
        .unwrap();
        create(&s, "s").await;
        for i in 0..4 {
            append(&s, "s", &format!("e{i}"), "again").await;
        }
        s.update_message(edit("s", "e1", "edited again"))
            .await
            .unwrap();
        append(&s, "s", "last", "text").await;
    }
    rusqlite::Connection::open(&path)
        .unwrap()
        .execute_batch("CREATE INDEX entries_by_change ON entries (session_id, chg)")
        .unwrap();

    let s = open(dir.path()).await;
    let index: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row(
            "SELECT count(*) FROM sqlite_schema WHERE name = 'entries_by_change'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(index, 0, "the old change index is dropped at open");
    let top: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("SELECT max(id) FROM events", [], |r| r.get(0))
        .unwrap();
    for after in 0..=top {
        // A fresh store each time, so no read is answered from memory.
        let fresh = open(dir.path()).await;
        let mut got = Vec::new();
        let mut mark = after;
        loop {
            let page = changes(&fresh, "s", Some(mark), Some(2));
            got.extend(as_rows(&page));
            assert!(page.mark >= mark);
            mark = page.mark;
            if !page.more {
                break;
            }
        }
        assert_eq!(got, in_sqlite(&path, "s", after), "after {after}");
    }
    assert_eq!(
        ids(&changes(&s, "s", Some(0), None)),
        ["e0", "e2", "e3", "e1", "last"]
    );
}

/// Anyone may publish an event on a session's topics (the bus's `publish`): one that names an
/// entry without being that entry's change brings nothing back from SQLite.
#[tokio::test]
async fn an_event_published_by_someone_else_is_not_a_change() {
    let dir = tempfile::tempdir().unwrap();
    {
        let s = open(dir.path()).await;
        create(&s, "s").await;
        append(&s, "s", "e0", "zero").await;
    }
    let s = open(dir.path()).await;
    let mark = changes(&s, "s", None, None).mark;
    for payload in [
        serde_json::json!({"session_id": "s", "entry_id": "e0", "seq": 1}),
        serde_json::json!({"session_id": "s", "entry_id": 7}),
        serde_json::json!({"session_id": "s"}),
    ] {
        s.store()
            .append_event(Some("s"), "session::message-added", &payload, None)
            .await
            .unwrap();
    }
    // A fresh store: nothing is answered from memory.
    let fresh = open(dir.path()).await;
    assert!(changes(&fresh, "s", Some(mark), None).entries.is_empty());
    assert_eq!(ids(&changes(&fresh, "s", Some(0), None)), ["e0"]);
}
