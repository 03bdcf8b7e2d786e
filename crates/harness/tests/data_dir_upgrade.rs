//! Data directories outlive versions: one written by an earlier harness opens in place and keeps
//! everything, and a clean stop leaves a directory holding what it stores.
//!
//! `fixtures/data_dir_030ad11` is a data directory `harness serve` wrote at commit 030ad11 (the
//! bundled demo script: four turns over three sessions, and one state key), stopped by SIGTERM.
//! Its WAL was checkpointed into `harness.db` by SQLite itself, so the fixture is one file.
//! `expected.json` is what that server answered before it stopped: every session's status,
//! transcript and event stream from the start. The fixture is schema 2 (its events indexed by
//! session on every insert, its transcript written to `entries` directly); opening it
//! migrates it to schema 3 (events and entries folded in batches).

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/data_dir_030ad11"
);

/// Whether everything `expected` says is in `actual`: objects key by key (a newer version may
/// add fields), arrays element by element and of the same length, anything else equal.
fn holds(expected: &Value, actual: &Value, at: &str) -> Result<(), String> {
    match (expected, actual) {
        (Value::Object(e), Value::Object(a)) => {
            for (k, v) in e {
                let inner = a
                    .get(k)
                    .ok_or_else(|| format!("{at}.{k}: missing (expected {v})"))?;
                holds(v, inner, &format!("{at}.{k}"))?;
            }
            Ok(())
        }
        (Value::Array(e), Value::Array(a)) => {
            if e.len() != a.len() {
                return Err(format!("{at}: {} items, expected {}", a.len(), e.len()));
            }
            for (i, (ev, av)) in e.iter().zip(a).enumerate() {
                holds(ev, av, &format!("{at}[{i}]"))?;
            }
            Ok(())
        }
        _ if expected == actual => Ok(()),
        _ => Err(format!("{at}: {actual}, expected {expected}")),
    }
}

fn copy_fixture(to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    std::fs::copy(Path::new(FIXTURE).join("harness.db"), to.join("harness.db")).unwrap();
}

fn wal_len(data_dir: &Path) -> u64 {
    std::fs::metadata(data_dir.join("harness.db-wal"))
        .map(|m| m.len())
        .unwrap_or(0)
}

/// SIGTERM, then waits for the process to exit on its own.
async fn stop_cleanly(server: &mut Server) {
    let status = Command::new("kill")
        .args(["-TERM", &server.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    wait_for("the server to exit after SIGTERM", WAIT, || {
        let gone = server.exited();
        async move { gone.then_some(()) }
    })
    .await;
}

/// The session's events from the start, as many as `n`.
async fn events_from_start(server: &Server, session_id: &str, n: usize) -> Vec<SseEvent> {
    let mut stream = server.events(session_id, Some(0)).await;
    let deadline = Instant::now() + WAIT;
    let mut out = Vec::new();
    while out.len() < n {
        match stream.next_before(deadline).await {
            Some(ev) => out.push(ev),
            None => panic!("{session_id}: {} events of {n} within {WAIT:?}", out.len()),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_030ad11_opens_in_place_and_keeps_everything() {
    let expected: Value =
        serde_json::from_slice(&std::fs::read(Path::new(FIXTURE).join("expected.json")).unwrap())
            .unwrap();
    let mut server = Server::start(
        &script(vec![text_gen(None, "after the upgrade", 0, true)]),
        &[],
    )
    .await;
    server.kill();
    copy_fixture(&server.data_dir());
    server.start_again().await;

    let mut last_id = 0;
    for (session_id, want) in expected["sessions"].as_object().unwrap() {
        let status = server.status(session_id).await;
        holds(&want["status"], &status, &format!("{session_id} status")).unwrap();
        let messages = Value::Array(server.transcript(session_id, true).await);
        holds(
            &want["messages"],
            &messages,
            &format!("{session_id} messages"),
        )
        .unwrap();
        // Same ids, same order, same contents: a client's Last-Event-ID from before the upgrade
        // still means the same place in the stream.
        let want_events = want["events"].as_array().unwrap();
        let events = events_from_start(&server, session_id, want_events.len()).await;
        for (i, (w, got)) in want_events.iter().zip(&events).enumerate() {
            assert_eq!(
                got.event_id(),
                w["id"].as_i64().unwrap(),
                "{session_id} event {i}"
            );
            holds(&w["data"], &got.data, &format!("{session_id} event {i}")).unwrap();
            last_id = last_id.max(got.event_id());
        }
        // Resuming from the middle gives the rest.
        let mid = want_events[want_events.len() / 2]["id"].as_i64().unwrap();
        let mut stream = server.events(session_id, Some(mid)).await;
        let next = stream
            .next_before(Instant::now() + WAIT)
            .await
            .expect("an event after the resume point");
        assert_eq!(
            next.event_id(),
            want_events[want_events.len() / 2 + 1]["id"]
                .as_i64()
                .unwrap()
        );
    }
    let state = server
        .ok("state::get", json!({"scope": "fixture", "key": "k"}))
        .await;
    assert_eq!(state, expected["state"]["fixture"]["k"]);

    // The old sessions go on: a new turn continues the transcript and the event ids.
    let mut stream = server.events("fx-a", Some(last_id)).await;
    let sent = server.send(Some("fx-a"), "after the upgrade?").await;
    let turn_id = sent["turn_id"].as_str().unwrap().to_string();
    let events = stream.until_turn_completed(&turn_id).await;
    assert!(events.iter().all(|e| e.event_id() > last_id));
    let status = server.wait_turn("fx-a", &turn_id).await;
    assert_eq!(status["status"], json!("completed"), "{status}");
    let transcript = server.transcript("fx-a", true).await;
    let before = expected["sessions"]["fx-a"]["messages"].as_array().unwrap();
    assert_eq!(transcript.len(), before.len() + 2);
    holds(
        &Value::Array(before.clone()),
        &Value::Array(transcript[..before.len()].to_vec()),
        "fx-a messages after a new turn",
    )
    .unwrap();
    assert_eq!(text_of(transcript.last().unwrap()), "after the upgrade");

    // And it opens again after a clean stop.
    stop_cleanly(&mut server).await;
    server.start_again().await;
    assert_eq!(server.transcript("fx-a", true).await, transcript);

    // Migrated once to the folded layout (schema 5): the per-insert `events_session` and
    // `events_dedupe` indexes are gone, every event of a session is in `events_by_session` and
    // every dedupe key in `event_keys` up to the fold mark (a clean stop folds all of them), and
    // no entry version or kv version is left in a log.
    stop_cleanly(&mut server).await;
    let db = rusqlite::Connection::open(server.data_dir().join("harness.db")).unwrap();
    let one = |sql: &str| -> i64 { db.query_row(sql, [], |r| r.get(0)).unwrap() };
    assert_eq!(one("PRAGMA user_version"), 5);
    assert_eq!(one("SELECT COUNT(*) FROM kv_log"), 0);
    assert_eq!(
        one("SELECT COUNT(*) FROM sqlite_schema WHERE name = 'events_session'"),
        0
    );
    assert_eq!(
        one("SELECT upto FROM folds WHERE name = 'events'"),
        one("SELECT MAX(id) FROM events")
    );
    assert_eq!(
        one("SELECT COUNT(*) FROM events_by_session"),
        one("SELECT COUNT(*) FROM events WHERE session_id IS NOT NULL")
    );
    assert_eq!(
        one("SELECT COUNT(*) FROM sqlite_schema WHERE name = 'events_dedupe'"),
        0
    );
    assert_eq!(
        one("SELECT COUNT(*) FROM event_keys"),
        one("SELECT COUNT(*) FROM events WHERE dedupe_key IS NOT NULL")
    );
    assert!(one("SELECT COUNT(*) FROM event_keys") > 0);
    assert_eq!(one("SELECT COUNT(*) FROM entry_log"), 0);
    assert!(one("SELECT COUNT(*) FROM entries") > 0);
}

/// Many turns grow the WAL; a clean stop (SIGTERM) copies it into the database and truncates
/// it, and the next start finds every turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_leaves_no_wal_behind() {
    const SESSIONS: usize = 16;
    const TURNS_EACH: usize = 125;
    let mut server = Server::start(&script(vec![text_gen(None, "ok", 0, true)]), &[]).await;
    let mut tasks = Vec::new();
    for s in 0..SESSIONS {
        let api = server.api();
        tasks.push(tokio::spawn(async move {
            let session_id = format!("wal-{s}");
            for _ in 0..TURNS_EACH {
                let req = json!({"message": "go", "session_id": session_id, "model": "m", "provider": "scripted"});
                let sent = api.ok("harness::send", req).await;
                let turn_id = sent["turn_id"].as_str().unwrap().to_string();
                let st = process::wait_turn(&turn_id, WAIT, || {
                    api.ok("harness::status", json!({"session_id": session_id}))
                })
                .await;
                assert_eq!(st["status"], json!("completed"), "{st}");
            }
        }));
    }
    let mut largest = 0;
    while tasks.iter().any(|t| !t.is_finished()) {
        largest = largest.max(wal_len(&server.data_dir()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        largest > 4 << 20,
        "the turns grew the WAL to {largest} bytes"
    );
    stop_cleanly(&mut server).await;
    let left = wal_len(&server.data_dir());
    println!("WAL: {largest} bytes at most during the turns, {left} after the clean stop");
    assert!(
        left <= 4 << 20,
        "{left} bytes of WAL after a clean stop; the server said:\n{}",
        server.log()
    );
    server.start_again().await;
    for s in 0..SESSIONS {
        let transcript = server.transcript(&format!("wal-{s}"), false).await;
        assert_eq!(transcript.len(), 2 * TURNS_EACH, "wal-{s}");
    }
}
