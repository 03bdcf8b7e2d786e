//! Transcript writes go to an append-only log (`entry_log`) that the store's fold brings into
//! `entries` in batches: every read answers the same whether an entry's latest version is
//! still in the log, already folded, or one of each, and across a restart.

mod common;

use common::{create, open};
use harness_session::SessionStore;
use harness_types::message::{AgentMessage, AssistantMessage, ContentBlock, Usage};
use harness_types::session::*;
use serde_json::{json, Value};

async fn add(s: &SessionStore, sid: &str, entry_id: &str, message: AgentMessage) -> i64 {
    common::add(s, sid, Some(entry_id), message).await
}

async fn note(s: &SessionStore, sid: &str, entry_id: &str) {
    s.append(AppendRequest {
        session_id: sid.into(),
        message: None,
        custom: Some(CustomEntry {
            custom_type: "note".into(),
            data: json!({"id": entry_id}),
        }),
        entry_id: Some(entry_id.into()),
        origin: None,
    })
    .await
    .unwrap();
}

fn reply(text: &str, cost: f64) -> AgentMessage {
    let mut m = AssistantMessage::ended(vec![ContentBlock::text(text)], "m1", "p1", 1);
    m.usage = Some(Usage {
        cost_usd: Some(cost),
        ..Default::default()
    });
    AgentMessage::Assistant(m)
}

async fn edit(s: &SessionStore, sid: &str, entry_id: &str, text: &str, cost: f64) {
    let usage = Usage {
        cost_usd: Some(cost),
        ..Default::default()
    };
    let r = s.update_message(common::edit(sid, entry_id, text, Some(usage)));
    assert!(r.await.unwrap().updated);
}

/// Every read a client makes of session `sid`, as JSON: pages of two (with and without custom
/// entries), a page after an entry, one entry, the changes from the start and in pages, and
/// the list's summary.
fn reads(s: &SessionStore, sid: &str, one: &str) -> Value {
    let mut pages = Vec::new();
    for include_custom in [true, false] {
        let mut cursor = None;
        loop {
            let page = s
                .messages(&MessagesRequest {
                    session_id: sid.into(),
                    include_custom,
                    limit: Some(2),
                    cursor,
                    after_entry_id: None,
                })
                .unwrap();
            pages.push(serde_json::to_value(&page.messages).unwrap());
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
    }
    let after_one = s
        .messages(&MessagesRequest {
            session_id: sid.into(),
            include_custom: true,
            limit: None,
            cursor: None,
            after_entry_id: Some(one.into()),
        })
        .unwrap();
    let changes = |after, limit| {
        s.changes(&ChangesRequest {
            session_id: sid.into(),
            after,
            limit,
        })
        .unwrap()
    };
    let all = changes(None, None);
    let first = changes(None, Some(2));
    let rest = changes(Some(first.mark), None);
    let list = s.list(&ListRequest::default()).unwrap();
    let summary = list.sessions.iter().find(|m| m.session_id == sid).unwrap();
    json!({
        "pages": pages,
        "after_one": after_one.messages,
        "one": s.entry(sid, one).unwrap(),
        "changes": all.entries,
        "mark": all.mark,
        "paged": [first.entries, rest.entries],
        "summary": [summary.preview, summary.model, summary.cost_usd],
    })
}

/// Versions in the log, not folded yet.
fn logged(s: &SessionStore) -> i64 {
    s.store()
        .read(|c| Ok(c.query_row("SELECT COUNT(*) FROM entry_log", [], |r| r.get(0))?))
        .unwrap()
}

/// The ids of a session's entries, custom ones included, in order.
fn entry_ids(s: &SessionStore, sid: &str) -> Vec<String> {
    s.all_entries(sid, true)
        .unwrap()
        .into_iter()
        .map(|e| e.entry_id)
        .collect()
}

fn texts(v: &Value) -> Vec<String> {
    v["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let m = &e["message"];
            if m.is_null() {
                format!("custom:{}", e["custom"]["data"]["id"].as_str().unwrap())
            } else {
                m["content"][0]["text"].as_str().unwrap().to_string()
            }
        })
        .collect()
}

#[tokio::test]
async fn a_transcript_reads_the_same_in_the_log_folded_and_half_way() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let s = open(&path).await;
    create(&s, "a", json!({})).await;
    create(&s, "child", json!({"parent_session_id": "a"})).await;
    add(&s, "a", "u1", AgentMessage::user_text("first question", 1)).await;
    add(&s, "a", "r1", reply("draft", 0.5)).await;
    note(&s, "a", "n1").await;
    edit(&s, "a", "r1", "answer", 1.0).await;
    add(&s, "child", "c1", reply("sub", 0.25)).await;

    // Everything is in the log.
    assert_eq!(logged(&s), 5);
    let unfolded = reads(&s, "a", "r1");
    assert_eq!(texts(&unfolded), ["first question", "custom:n1", "answer"]);
    assert_eq!(unfolded["one"]["revision"], json!(1));
    assert_eq!(
        unfolded["summary"],
        json!(["first question", "m1", 1.25]),
        "preview, latest model, cost of the tree"
    );
    assert_eq!(unfolded["after_one"].as_array().unwrap().len(), 1);

    s.store().fold_events().await.unwrap();
    assert_eq!(reads(&s, "a", "r1"), unfolded, "folded");

    // Half way: the folded reply is edited again and more comes, in the log.
    edit(&s, "a", "r1", "better answer", 2.0).await;
    add(&s, "a", "u2", AgentMessage::user_text("second", 2)).await;
    add(&s, "a", "r2", reply("more", 0.5)).await;
    add(&s, "child", "c2", reply("sub2", 0.25)).await;
    assert_eq!(logged(&s), 4);
    let half = reads(&s, "a", "r1");
    assert_eq!(
        texts(&half),
        [
            "first question",
            "custom:n1",
            "better answer",
            "second",
            "more"
        ]
    );
    assert_eq!(half["one"]["revision"], json!(2));
    assert_eq!(half["summary"], json!(["first question", "m1", 3.0]));
    let seqs: Vec<i64> = half["pages"].as_array().unwrap()[0..3]
        .iter()
        .flat_map(|p| {
            p.as_array()
                .unwrap()
                .iter()
                .map(|e| e["seq"].as_i64().unwrap())
        })
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4, 5]);

    s.store().fold_events().await.unwrap();
    assert_eq!(reads(&s, "a", "r1"), half, "folded again");

    // A restart finds the same (the store folds what is left when it closes).
    edit(&s, "a", "r2", "more, edited", 0.75).await;
    let before = reads(&s, "a", "r1");
    s.store().close();
    drop(s);
    let s = open(&path).await;
    assert_eq!(reads(&s, "a", "r1"), before, "after a restart");
}

/// Appends of one session committed in one batch still number on from each other, and an
/// append is idempotent on its entry id while its first version is in the log.
#[tokio::test]
async fn appends_in_one_batch_number_on() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir.path().join("t.db")).await;
    create(&s, "a", json!({})).await;
    let mut appends = tokio::task::JoinSet::new();
    for i in 0..20 {
        let s = s.clone();
        appends.spawn(async move {
            add(
                &s,
                "a",
                &format!("e{i}"),
                AgentMessage::user_text(format!("m{i}"), 1),
            )
            .await
        });
    }
    let mut seqs = appends.join_all().await;
    seqs.sort();
    assert_eq!(seqs, (1..=20).collect::<Vec<i64>>());
    let again = add(&s, "a", "e7", AgentMessage::user_text("ignored", 1)).await;
    let e7 = s.entry("a", "e7").unwrap().unwrap();
    assert_eq!(again, e7.seq);
    assert_eq!(s.all_entries("a", true).unwrap().len(), 20);
}

/// A process killed with versions in the log finds them at the next start (folded then).
#[tokio::test]
async fn versions_left_in_the_log_by_a_killed_process_are_found() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    {
        let s = open(&path).await;
        create(&s, "a", json!({})).await;
        add(&s, "a", "r1", reply("draft", 0.5)).await;
        s.store().close();
    }
    // What a write killed before the next fold leaves: the change's event and its version.
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute(
            "INSERT INTO events(session_id, topic, payload, at_ms)
             VALUES ('a', 'session::message-updated', '{\"entry_id\":\"r1\"}', 1)",
            [],
        )
        .unwrap();
        let id = conn.last_insert_rowid();
        let body = serde_json::to_string(&reply("kept", 0.5)).unwrap();
        conn.execute(
            "INSERT INTO entry_log (id, session_id, seq, entry_id, kind, body, revision)
             VALUES (?1, 'a', 1, 'r1', 'message', ?2, 1)",
            rusqlite::params![id, body],
        )
        .unwrap();
        // And an append (seq 2) that only the log holds.
        conn.execute(
            "INSERT INTO events(session_id, topic, payload, at_ms)
             VALUES ('a', 'session::message-added', '{\"entry_id\":\"k2\"}', 2)",
            [],
        )
        .unwrap();
        let id = conn.last_insert_rowid();
        let body = serde_json::to_string(&AgentMessage::user_text("logged only", 2)).unwrap();
        conn.execute(
            "INSERT INTO entry_log (id, session_id, seq, entry_id, kind, body, revision)
             VALUES (?1, 'a', 2, 'k2', 'message', ?2, 0)",
            rusqlite::params![id, body],
        )
        .unwrap();
    }
    let s = open(&path).await;
    let r1 = s.entry("a", "r1").unwrap().unwrap();
    assert_eq!(r1.revision, 1);
    let AgentMessage::Assistant(m) = r1.message.unwrap() else {
        panic!("not a reply")
    };
    assert_eq!(m.content, vec![ContentBlock::text("kept")]);
    assert!(s.entry("a", "k2").unwrap().is_some());
    // And the writer numbers on from both: the append after seq 2, the update from revision 1.
    assert_eq!(
        add(&s, "a", "u3", AgentMessage::user_text("next", 1)).await,
        3
    );
    edit(&s, "a", "r1", "edited", 0.5).await;
    assert_eq!(s.entry("a", "r1").unwrap().unwrap().revision, 2);
    let ids = entry_ids(&s, "a");
    assert_eq!(ids, vec!["r1", "k2", "u3"]);
}

/// A deleted session's versions in the log go with it: a session created again under the same
/// id starts empty, and a fold does not bring the old entries back.
#[tokio::test]
async fn a_deleted_session_leaves_nothing_in_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir.path().join("t.db")).await;
    create(&s, "a", json!({})).await;
    add(&s, "a", "old", AgentMessage::user_text("old", 1)).await;
    s.store().fold_events().await.unwrap();
    // One folded entry and one still in the log.
    add(&s, "a", "old2", AgentMessage::user_text("old2", 1)).await;
    let deleted = s
        .delete(DeleteRequest {
            session_id: "a".into(),
        })
        .await
        .unwrap();
    assert!(deleted.deleted);
    create(&s, "a", json!({})).await;
    assert_eq!(
        add(&s, "a", "new", AgentMessage::user_text("new", 1)).await,
        1
    );
    s.store().fold_events().await.unwrap();
    let ids = entry_ids(&s, "a");
    assert_eq!(ids, ["new"]);
}

/// Session "a" with 20 rounds of a question, a reply and its edit, `neighbours` other sessions
/// adding an entry each round in between: read before and after the fold, the same.
async fn many_unfolded_versions_read_the_same_folded(neighbours: usize) {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir.path().join("t.db")).await;
    create(&s, "a", json!({})).await;
    for n in 0..neighbours {
        create(&s, &format!("b{n}"), json!({})).await;
    }
    for i in 0..20 {
        add(
            &s,
            "a",
            &format!("u{i}"),
            AgentMessage::user_text(format!("q{i}"), 1),
        )
        .await;
        for n in 0..neighbours {
            let sid = format!("b{n}");
            add(&s, &sid, &format!("x{i}"), AgentMessage::user_text("b", 1)).await;
        }
        add(&s, "a", &format!("r{i}"), reply("draft", 0.5)).await;
        edit(&s, "a", &format!("r{i}"), &format!("a{i}"), 0.25).await;
    }
    assert_eq!(logged(&s), 20 * (3 + neighbours as i64));
    let unfolded = reads(&s, "a", "r7");
    let want: Vec<String> = (0..20)
        .flat_map(|i| [format!("q{i}"), format!("a{i}")])
        .collect();
    assert_eq!(texts(&unfolded), want);
    assert_eq!(unfolded["summary"], json!(["q0", "m1", 5.0]));
    s.store().fold_events().await.unwrap();
    assert_eq!(logged(&s), 0);
    assert_eq!(reads(&s, "a", "r7"), unfolded);
}

/// More unfolded events than are looked up one by one, dense in their span (one neighbour):
/// found by one scan of the log over the span.
#[tokio::test]
async fn a_session_with_many_unfolded_versions_reads_the_same_folded() {
    many_unfolded_versions_read_the_same_folded(1).await;
}

/// The same, sparse in their span (twelve neighbours writing in between): looked up one by
/// one.
#[tokio::test]
async fn a_session_with_many_sparse_unfolded_versions_reads_the_same_folded() {
    many_unfolded_versions_read_the_same_folded(12).await;
}

/// The store folds in parts, one after each of its writes once the event tail is long: a part
/// changes nothing a reader sees; an entry edited after its session's part ran, and one edited
/// before, read at their latest; a session deleted half way stays deleted; and the fold's end
/// leaves in the log only what was written after it began.
#[tokio::test]
async fn a_fold_in_parts_changes_nothing_a_reader_sees() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(&dir.path().join("t.db")).await;
    let sids: Vec<String> = (0..40).map(|i| format!("s{i:02}")).collect();
    for sid in &sids {
        create(&s, sid, json!({})).await;
        add(
            &s,
            sid,
            "u1",
            AgentMessage::user_text(format!("q-{sid}"), 1),
        )
        .await;
        add(&s, sid, "r1", reply("draft", 0.5)).await;
        edit(&s, sid, "r1", &format!("a-{sid}"), 1.0).await;
    }
    // Enough events for the writer to begin a fold after this write (its threshold is
    // 32,768), in sessions that sort between the watched ones (`s00f` after `s00`), so that
    // the ~33 parts of ~1,024 keys each fall between them and reading a watched session stays
    // quick (an idle writer, 500 ms without a write, would fold the rest whole).
    let fillers: Vec<String> = sids.iter().map(|sid| format!("{sid}f")).collect();
    s.store()
        .write(move |c| {
            for i in 0..32_768 {
                let sid = Some(fillers[i % 40].as_str());
                harness_store::insert_event_in(c, sid, "filler", &json!(i), None)?;
            }
            Ok(())
        })
        .await
        .unwrap();
    let watched = ["s00", "s01", "s20", "s39"];
    let snapshot = |s: &SessionStore| watched.map(|w| reads(s, w, "r1"));
    let materialized = |s: &SessionStore, sid: &str| -> Option<String> {
        let sid = sid.to_string();
        s.store()
            .read(move |c| {
                Ok(c.query_row(
                    "SELECT body FROM entries WHERE session_id = ?1 AND entry_id = 'r1'",
                    [sid],
                    |r| r.get(0),
                )
                .ok())
            })
            .unwrap()
    };
    let mut before = snapshot(&s);
    let (mut writes, mut extra) = (0, 0);
    let (mut edited, mut deleted, mut moved) = (false, false, None);
    // Until the mark has moved and the folded versions have left the log: the appends that
    // drove the parts, the two edits and s20's new entry are all it holds then.
    while moved.is_none() || logged(&s) != writes as i64 + 3 {
        assert!(
            writes < 200,
            "{} events unfolded",
            s.store().unfolded_events()
        );
        // One write of a session no one watches: the writer runs the fold's next part after it.
        let x = format!("x{writes}");
        add(&s, "s10", &x, AgentMessage::user_text("x", 1)).await;
        writes += 1;
        assert_eq!(
            snapshot(&s),
            before,
            "a part changed a read ({writes} writes)"
        );
        if !edited && materialized(&s, "s00").is_some_and(|row| row.contains("a-s00")) {
            // The first sessions' part has run, the last session's not yet.
            assert_eq!(materialized(&s, "s39"), None);
            edit(&s, "s00", "r1", "edited after its part", 2.0).await;
            edit(&s, "s39", "r1", "edited before its part", 2.0).await;
            edited = true;
            extra += 2;
        } else if edited && !deleted {
            let gone = s.delete(DeleteRequest {
                session_id: "s20".into(),
            });
            assert!(gone.await.unwrap().deleted);
            create(&s, "s20", json!({})).await;
            add(&s, "s20", "r1", reply("new", 0.5)).await;
            deleted = true;
            extra += 3;
        }
        if moved.is_none() && s.store().unfolded_events() < 1_000 {
            moved = Some(writes + extra);
        }
        before = snapshot(&s);
    }
    assert!(edited && deleted);
    // Each write ran one part.
    let parts = moved.unwrap();
    assert!(parts >= 10, "the mark moved after {parts} parts");
    assert_eq!(texts(&before[0]), ["q-s00", "edited after its part"]);
    assert_eq!(texts(&before[1]), ["q-s01", "a-s01"]);
    assert_eq!(texts(&before[2]), ["new"]);
    assert_eq!(texts(&before[3]), ["q-s39", "edited before its part"]);
    s.store().fold_events().await.unwrap();
    assert_eq!(logged(&s), 0);
    assert_eq!(snapshot(&s), before, "folded whole");
    assert_eq!(entry_ids(&s, "s20"), ["r1"]);
}

/// Where the SIGKILL test's child keeps its store.
const CHILD_ENV: &str = "HARNESS_ENTRY_LOG_CHILD_DB";

/// The child's body; a no-op when run as an ordinary test. Sessions `s0`..`s7` and 16,000
/// events of other sessions; then, one write at a time, an entry appended and then edited in
/// each session in turn, every resolved write printed. Twelve rounds (24 writes, so 24 fold
/// parts) after the tail reached the fold's size it prints `mid` and waits to be killed, the
/// fold under way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entry_log_child() {
    use std::io::Write;
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let s = open(path.as_ref()).await;
    for i in 0..8 {
        create(&s, &format!("s{i}"), json!({})).await;
    }
    s.store()
        .write(|c| {
            for i in 0..32_384 {
                let sid = format!("f{}", i % 8);
                harness_store::insert_event_in(c, Some(&sid), "filler", &json!(i), None)?;
            }
            Ok(())
        })
        .await
        .unwrap();
    let mut began = None;
    for n in 0u64.. {
        let (sid, id) = (format!("s{}", n % 8), format!("e{n}"));
        add(&s, &sid, &id, reply(&format!("m{n}"), 0.5)).await;
        println!("added {sid} {id}");
        edit(&s, &sid, &id, &format!("m{n} edited"), 1.0).await;
        println!("edited {sid} {id}");
        if began.is_none() && s.store().unfolded_events() >= 32_768 {
            began = Some(n);
        }
        // Mid-fold: a part has written index rows above the mark, which has not moved.
        let written_above = || {
            s.store()
                .read(|c| {
                    Ok(c.query_row(
                        "SELECT EXISTS (SELECT 1 FROM events_by_session
                             WHERE id > (SELECT upto FROM folds WHERE name = 'events'))",
                        [],
                        |r| r.get::<_, bool>(0),
                    )?)
                })
                .unwrap()
        };
        if began.is_some_and(|b| n >= b + 4) && written_above() {
            println!("mid");
            std::io::stdout().flush().unwrap();
            // Killed long before the writer's idle wait (500 ms) would fold the rest whole.
            tokio::time::sleep(std::time::Duration::from_secs(60)).await;
        }
    }
}

/// SIGKILL in the middle of a fold in parts (some sessions' keys and entries written, the mark
/// not moved): at the next start every entry whose append resolved is there once, at its
/// edited version when the edit resolved, in order; and the index rows the parts wrote above
/// the mark change nothing.
#[test]
fn sigkill_in_a_fold_in_parts_loses_no_resolved_entry() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("log.db");
    let mut child = common::spawn_child("entry_log_child", CHILD_ENV, &db);
    let stdout = BufReader::new(child.stdout.take().unwrap());
    let mut added: Vec<(String, String)> = Vec::new();
    let mut edited = std::collections::HashSet::new();
    let mut mid = false;
    for line in stdout.lines() {
        let line = line.unwrap();
        // The first line follows the test harness's own "test entry_log_child ... ".
        if let Some(at) = line.find("added ") {
            let (sid, id) = line[at + 6..].split_once(' ').unwrap();
            added.push((sid.to_string(), id.to_string()));
        } else if let Some(at) = line.find("edited ") {
            edited.insert(line[at + 7..].split_once(' ').unwrap().1.to_string());
        } else if line.ends_with("mid") {
            mid = true;
            child.kill().unwrap();
        }
    }
    child.wait().unwrap();
    assert!(
        mid,
        "the child died before the fold, after {} entries",
        added.len()
    );

    // Killed mid-fold: the parts wrote index rows above the mark, which did not move.
    let conn = rusqlite::Connection::open(&db).unwrap();
    let count = |sql: &str| -> i64 { conn.query_row(sql, [], |r| r.get(0)).unwrap() };
    let mark = count("SELECT upto FROM folds WHERE name = 'events'");
    let above = count(&format!(
        "SELECT COUNT(*) FROM events_by_session WHERE id > {mark}"
    ));
    assert!(above > 0, "no part had written the index (mark {mark})");
    drop(conn);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let s = open(&db).await;
        let texts = |sid: &str| -> Vec<(String, String)> {
            s.all_entries(sid, true)
                .unwrap()
                .into_iter()
                .map(|e| {
                    let v = serde_json::to_value(&e.message).unwrap();
                    let text = v["content"][0]["text"].as_str().unwrap().to_string();
                    (e.entry_id, text)
                })
                .collect()
        };
        let before: Vec<_> = (0..8).map(|i| texts(&format!("s{i}"))).collect();
        for (i, got) in before.iter().enumerate() {
            let sid = format!("s{i}");
            let want: Vec<&String> = added
                .iter()
                .filter(|(s, _)| *s == sid)
                .map(|(_, id)| id)
                .collect();
            // Every resolved append once, in order (one more whose append committed
            // unreported may follow).
            let ids: Vec<&String> = got.iter().map(|(id, _)| id).collect();
            assert_eq!(&ids[..want.len()], &want[..], "{sid}");
            assert!(ids.len() <= want.len() + 1, "{sid}: {ids:?}");
            for (id, text) in got {
                let n = &id[1..];
                if edited.contains(id) {
                    assert_eq!(text, &format!("m{n} edited"), "{sid} {id}");
                } else {
                    assert!(text.starts_with(&format!("m{n}")), "{sid} {id}: {text}");
                }
            }
        }
        // Each session's event stream once, in order, whichever side of the mark its
        // events' index rows are.
        for (i, got) in before.iter().enumerate() {
            let events = s
                .store()
                .events_after(&format!("s{i}"), 0, 100_000)
                .unwrap();
            assert!(events.windows(2).all(|w| w[0].id < w[1].id), "s{i}");
            let added = events
                .iter()
                .filter(|e| e.topic == "session::message-added")
                .count();
            assert_eq!(added, got.len(), "s{i}");
        }
        // And the same after the next fold, whole.
        s.store().fold_events().await.unwrap();
        let after: Vec<_> = (0..8).map(|i| texts(&format!("s{i}"))).collect();
        assert_eq!(after, before);
    });
}

/// Puts r1's draft version back in session `a`'s log under event id `id`, as a sweep cut short
/// would have left it.
async fn leave_draft(s: &SessionStore, id: i64) {
    s.store()
        .write(move |c| {
            c.execute(
                "INSERT INTO entry_log (id, session_id, seq, entry_id, kind, body, revision)
                 SELECT ?1, session_id, seq, entry_id, kind, REPLACE(body, 'final', 'draft'), 0
                 FROM entries WHERE session_id = 'a' AND entry_id = 'r1'",
                [id],
            )?;
            Ok(())
        })
        .await
        .unwrap();
}

/// A version left in the log at or below the fold mark (a fold that ended and did not finish
/// its sweep: a full disk, a kill) is dead: the entry reads at its newer folded version, before
/// and after a restart, and the next fold's sweep drops the row.
#[tokio::test]
async fn a_dead_version_left_below_the_mark_never_comes_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let s = open(&path).await;
    create(&s, "a", json!({})).await;
    add(&s, "a", "r1", reply("draft", 0.5)).await;
    edit(&s, "a", "r1", "final", 1.0).await;
    s.store().fold_events().await.unwrap();
    assert_eq!(logged(&s), 0);
    // The draft's version again, as an unfinished sweep would have left it: its id is the
    // append's event's, below the mark.
    let first_event = s.store().events_after("a", 0, 10).unwrap()[1].id;
    leave_draft(&s, first_event).await;
    assert_eq!(logged(&s), 1);
    let text = |s: &SessionStore| texts(&reads(s, "a", "r1"));
    assert_eq!(text(&s), ["final"]);

    // A restart does not bring the draft back.
    s.store().close();
    drop(s);
    let s = open(&path).await;
    assert_eq!(text(&s), ["final"], "after a restart");
    assert_eq!(logged(&s), 0);

    // Left again, and a fold of later writes sweeps it.
    leave_draft(&s, first_event).await;
    add(&s, "a", "u2", AgentMessage::user_text("more", 2)).await;
    s.store().fold_events().await.unwrap();
    assert_eq!(logged(&s), 0, "the next fold's sweep drops the dead row");
    assert_eq!(text(&s), ["final", "more"]);
}
