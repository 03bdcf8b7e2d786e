//! A client of the v1.0.6 reference against `harness serve`, over HTTP: a send with
//! `options.mode` and a spawn with `display` complete; the session tree and the turn events show
//! the display; status is lean (a long result truncated) unless verbose; the operator writes the
//! default prompt through the API and the next send freezes it, with no restart.

mod common;

use common::*;
use serde_json::json;

fn long_text() -> String {
    "All clear. ".repeat(80)
}

/// The session's system prompt, as `harness::system-prompt::get` previews it, opens with `prefix`.
async fn assert_prompt_starts(server: &Server, session_id: &str, prefix: &str) {
    let preview = server
        .ok(
            "harness::system-prompt::get",
            json!({"session_id": session_id}),
        )
        .await;
    assert!(
        preview["system_prompt"]
            .as_str()
            .unwrap()
            .starts_with(prefix),
        "{preview}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mode_display_status_and_the_directory_writer_over_http() {
    let server = Server::start(&script(vec![text_gen(None, &long_text(), 0, true)]), &[]).await;

    // A plan-mode send completes; lean status truncates its long result, verbose does not.
    let sent = server
        .ok(
            "harness::send",
            json!({"message": "plan the move", "model": "m", "provider": "scripted",
                   "options": {"mode": "plan"}}),
        )
        .await;
    let sid = sent["session_id"].as_str().unwrap().to_string();
    let lean = server
        .wait_turn(&sid, sent["turn_id"].as_str().unwrap())
        .await;
    assert_eq!(lean["status"], "completed", "{lean}");
    let shown = lean["result"].as_str().unwrap();
    assert!(
        shown.ends_with("…(truncated; use verbose: true for the full result)"),
        "{shown}"
    );
    assert!(lean["context"]["prompt_surface_digest"]
        .as_str()
        .is_some_and(|d| d.starts_with("sha256:")));
    let verbose = server
        .ok(
            "harness::status",
            json!({"session_id": sid, "verbose": true}),
        )
        .await;
    assert_eq!(verbose["result"], json!(long_text()));
    assert_prompt_starts(&server, &sid, "Operating mode: plan.").await;

    // A spawn with a display completes; its tree node and its events carry the display.
    let child = server
        .ok(
            "harness::spawn",
            json!({"task": "look it up", "model": "m", "provider": "scripted",
                   "display": {"name": "Researcher", "icon": "search", "color": "teal"},
                   "options": {"mode": "ask"}}),
        )
        .await;
    let csid = child["child_session_id"].as_str().unwrap().to_string();
    let cturn = child["child_turn_id"].as_str().unwrap().to_string();
    let mut events = server.events(&csid, None).await;
    let seen = events.until_turn_completed(&cturn).await;
    let want = json!({"name": "Researcher", "icon": "search", "color": "teal"});
    for topic in ["harness::turn-started", "harness::turn-completed"] {
        let ev = seen
            .iter()
            .find(|e| e.topic() == topic)
            .unwrap_or_else(|| panic!("{topic}"));
        assert_eq!(ev.payload()["display"], want, "{topic}");
    }
    let tree = server
        .ok("harness::session-tree", json!({"session_id": csid}))
        .await;
    assert_eq!(tree["display"], want, "{tree}");
    assert_eq!(tree["title"], "Researcher");

    // The operator writes the default prompt; the next new session freezes it.
    let written = server
        .ok(
            "directory::system-prompts::create",
            json!({"name": "default", "content": "You are the house identity."}),
        )
        .await;
    assert_eq!(written["created"], true);
    let next = server.send(None, "hello").await;
    let nsid = next["session_id"].as_str().unwrap();
    server
        .wait_turn(nsid, next["turn_id"].as_str().unwrap())
        .await;
    assert_prompt_starts(&server, nsid, "You are the house identity.").await;
    let on_disk = std::fs::read_to_string(
        server
            .data_dir()
            .join("directory/system-prompts/default.md"),
    )
    .unwrap();
    assert_eq!(on_disk, "You are the house identity.");
}
