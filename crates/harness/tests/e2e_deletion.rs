//! A session tree deletion killed half-way (SIGKILL of `harness serve` right after one member was
//! deleted) resumes on restart: every member deleted once, children first, nothing left behind.

mod common;

use common::*;
use serde_json::{json, Value};

fn two_spawns() -> Value {
    json!({"match": {"last_user_text": "^plan the trip"},
    "content": [
        {"type": "function_call", "id": "s1", "function_id": "harness::spawn", "arguments": {"task": "find flights to Oslo"}},
        {"type": "function_call", "id": "s2", "function_id": "harness::spawn", "arguments": {"task": "find hotels in Oslo"}}
    ]})
}

/// Polls `harness::delete-session-tree-status` until the operation is no longer deleting.
async fn deletion_ended(server: &Server, operation_id: &str) -> Value {
    wait_for("the deletion to end", WAIT, || async {
        let s = server
            .ok(
                "harness::delete-session-tree-status",
                json!({ "operation_id": operation_id }),
            )
            .await;
        (s["status"] != "deleting").then_some(s)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_killed_between_two_members_resumes_and_deletes_each_once() {
    let script = script(vec![
        two_spawns(),
        text_gen(Some("^find flights"), "Flight AB123", 0, true),
        text_gen(Some("^find hotels"), "Hotel Fjord", 0, true),
        text_gen(None, "Booked", 0, true),
    ]);
    let mut server = Server::start(&script, &[]).await;
    let root = "s_trip";
    server
        .ok(
            "harness::send",
            json!({"session_id": root, "message": "plan the trip", "model": "m", "provider": "scripted",
                   "options": {"functions": {"allow": ["harness::spawn"], "expose": "native"}}}),
        )
        .await;
    wait_for("the trip to be planned", WAIT, || async {
        let s = server.status(root).await;
        (!s.is_null() && is_terminal(&s)).then_some(s)
    })
    .await;
    let tree = server
        .ok("harness::session-tree", json!({"session_id": root}))
        .await;
    let mut members: Vec<String> = tree["children"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["session_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(members.len(), 2, "{tree}");
    members.push(root.to_string());

    // Kill the process right after the second member is deleted, before that is recorded.
    server.kill();
    server.set_env("HARNESS_FAILPOINT", Some("after_member_deleted:2"));
    server.start_again().await;
    // The answer races the failpoint (the step starts at once): it may never arrive.
    let operation_id = format!(
        "delete_{}",
        harness_types::digest::sha256_hex(root.as_bytes())
    );
    if let Some(op) = server
        .try_ok("harness::delete-session-tree", json!({"session_id": root}))
        .await
    {
        assert_eq!(op["status"], "deleting", "{op}");
        assert_eq!(op["attempt"], 1);
        assert_eq!(op["operation_id"], operation_id);
    }
    server.wait_killed_at("after_member_deleted").await;

    server.set_env("HARNESS_FAILPOINT", None);
    server.start_again().await;
    let done = deletion_ended(&server, &operation_id).await;
    assert_eq!(done["status"], "completed", "{done}");
    assert_eq!(done["attempt"], 1, "a resumed attempt keeps its number");
    let deleted: Vec<String> = done["deleted_session_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_string())
        .collect();
    assert_eq!(deleted.len(), 3, "each member once: {deleted:?}");
    assert_eq!(
        deleted.last().map(String::as_str),
        Some(root),
        "the root last"
    );
    for m in &members {
        assert!(deleted.contains(m), "{m} missing from {deleted:?}");
        let got = server.ok("session::get", json!({"session_id": m})).await;
        assert!(got.is_null(), "{m} still there: {got}");
        assert!(server.status(m).await.is_null(), "{m}'s turn record");
    }
    // The ids stay taken.
    let e = server
        .err(
            "harness::send",
            json!({"session_id": root, "message": "hello", "model": "m", "provider": "scripted"}),
        )
        .await;
    assert!(e.message.contains("not reusable"), "{}", e.message);
    // A repeat after the restart is the same completed operation.
    let again = server
        .ok("harness::delete-session-tree", json!({"session_id": root}))
        .await;
    assert_eq!(again, done);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_sessions_id_is_refused_with_410_naming_the_tombstone() {
    let script = script(vec![text_gen(None, "Hi", 0, true)]);
    let server = Server::start(&script, &[]).await;
    let sid = "s_gone";
    let sent = server.send(Some(sid), "hello").await;
    server
        .wait_turn(sid, sent["turn_id"].as_str().unwrap())
        .await;
    let op = server
        .ok("harness::delete-session-tree", json!({"session_id": sid}))
        .await;
    let operation_id = op["operation_id"].as_str().unwrap().to_string();
    let done = deletion_ended(&server, &operation_id).await;
    assert_eq!(done["status"], "completed", "{done}");

    let year = {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        // Close enough to name the year of the tombstone, which was written moments ago.
        1970 + secs / 31_556_952
    };
    for (function_id, payload) in [
        (
            "harness::send",
            json!({"session_id": sid, "message": "again", "model": "m", "provider": "scripted"}),
        ),
        (
            "harness::spawn",
            json!({"session_id": sid, "task": "again", "model": "m", "provider": "scripted"}),
        ),
    ] {
        let e = server.err(function_id, payload).await;
        assert_eq!(e.status, 410, "{function_id}: {e:?}");
        assert_eq!(e.code, "harness/session_deleted", "{function_id}: {e:?}");
        assert!(
            e.message.starts_with(&format!(
                "session_id: session '{sid}' was deleted at {year}-"
            )),
            "{function_id}: {}",
            e.message
        );
        assert!(e.message.contains(&operation_id), "{}", e.message);
        assert!(e.message.contains("not reusable"), "{}", e.message);
    }
    // A fresh id still works.
    server.send(None, "hello").await;
}
