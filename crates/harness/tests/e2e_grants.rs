//! Per-session filesystem grants in the real binary: an operator grants a directory outside the
//! turn's root, the model's `fs::read` of a file there works; after a revoke the same read is
//! refused; the data directory can never be granted.

mod common;

use common::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_granted_directory_is_readable_until_it_is_revoked() {
    let root = tempfile::tempdir().unwrap();
    let shared = tempfile::tempdir().unwrap();
    let shared_real = std::fs::canonicalize(shared.path()).unwrap();
    let note = shared_real.join("note.txt");
    std::fs::write(&note, "GRANTED-CONTENT\n").unwrap();
    let read = |id: &str| {
        json!([{"type": "function_call", "id": id, "function_id": "fs::read",
                "arguments": {"path": note.display().to_string()}}])
    };
    let script = script(vec![
        json!({"match": {"last_user_text": "^first"}, "content": read("c1")}),
        json!({"match": {"last_user_text": "^second"}, "content": read("c2")}),
        text_gen(None, "done", 0, true),
    ]);
    let server = Server::start(&script, &[]).await;
    let send = |text: &str| {
        json!({"session_id": "s_grant", "message": text, "model": "m", "provider": "scripted",
               "options": {"functions": {"allow": ["fs::read"], "expose": "native"},
                           "filesystem_root": root.path()}})
    };

    // The data directory (or anything holding it) cannot be granted.
    let e = server
        .err(
            "harness::filesystem::grant",
            json!({"session_id": "s_grant", "path": server.data_dir()}),
        )
        .await;
    assert!(
        e.code == "harness/invalid_request" && e.message.starts_with("path:"),
        "{} {}",
        e.code,
        e.message
    );
    let g = server
        .ok(
            "harness::filesystem::grant",
            json!({"session_id": "s_grant", "path": shared.path()}),
        )
        .await;
    assert_eq!(g["path"], shared_real.display().to_string());

    let sent = server.ok("harness::send", send("first read")).await;
    let status = server
        .wait_turn("s_grant", sent["turn_id"].as_str().unwrap())
        .await;
    assert_eq!(status["status"], "completed", "{status}");
    let results = |entries: &[serde_json::Value]| -> Vec<serde_json::Value> {
        entries
            .iter()
            .filter(|e| e["message"]["role"] == "function_result")
            .cloned()
            .collect()
    };
    let entries = server.transcript("s_grant", false).await;
    let r = results(&entries);
    assert_eq!(r.len(), 1, "{r:?}");
    assert_eq!(r[0]["message"]["is_error"], false, "{}", r[0]);
    assert!(text_of(&r[0]).contains("GRANTED-CONTENT"), "{}", r[0]);

    let info = server
        .ok(
            "harness::filesystem::info",
            json!({"session_id": "s_grant"}),
        )
        .await;
    assert_eq!(info["grants"][0]["path"], shared_real.display().to_string());
    let revoked = server
        .ok(
            "harness::filesystem::revoke",
            json!({"session_id": "s_grant", "path": shared.path()}),
        )
        .await;
    assert_eq!(revoked["revoked"], true);

    let sent = server.ok("harness::send", send("second read")).await;
    let status = server
        .wait_turn("s_grant", sent["turn_id"].as_str().unwrap())
        .await;
    assert_eq!(status["status"], "completed", "{status}");
    let entries = server.transcript("s_grant", false).await;
    let r = results(&entries);
    assert_eq!(r.len(), 2, "{r:?}");
    assert_eq!(r[1]["message"]["is_error"], true, "{}", r[1]);
    assert!(!text_of(&r[1]).contains("GRANTED-CONTENT"), "{}", r[1]);
    assert!(text_of(&r[1]).contains("outside"), "{}", r[1]);
}
