//! Anonymous usage announcements (`harness:usage`): the milestones and first failures of a root
//! session, bounded at 9, none for sub-agents, not repeated or lost across a SIGKILL, nothing
//! at all when opted out, and no id or text in any of them. Read back through the operator's
//! audit, `harness::usage::list`.

mod common;

use common::*;
use serde_json::{json, Value};

async fn announcements(server: &Server) -> Vec<Value> {
    server.ok("harness::usage::list", json!({})).await["announcements"]
        .as_array()
        .unwrap()
        .clone()
}

async fn turn(server: &Server, session: &str, text: &str, options: Value) -> Value {
    let mut req =
        json!({"session_id": session, "message": text, "model": "demo", "provider": "scripted"});
    if !options.is_null() {
        req["options"] = options;
    }
    let sent = server.ok("harness::send", req).await;
    server
        .wait_turn(session, sent["turn_id"].as_str().unwrap())
        .await
}

/// `[st]_<32 hex>` (a session or turn id) anywhere in `text`.
fn an_id_in(text: &str) -> Option<String> {
    let b = text.as_bytes();
    (0..b.len().saturating_sub(33)).find_map(|i| {
        let hex = &b[i + 2..i + 34];
        ((b[i] == b's' || b[i] == b't')
            && b[i + 1] == b'_'
            && hex
                .iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c)))
        .then(|| text[i..i + 34].to_string())
    })
}

fn milestones(list: &[Value]) -> Vec<u64> {
    list.iter()
        .filter(|a| a["event"] == "harness_session_progress")
        .map(|a| a["milestone"].as_u64().unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_root_turns_announce_the_six_milestones_with_the_trees_totals() {
    let server = Server::start(&script(vec![text_gen(None, "noted", 0, true)]), &[]).await;
    let mut at_fifty = None;
    for i in 1..=60 {
        let s = turn(&server, "s_progress", &format!("note {i}"), Value::Null).await;
        assert_eq!(s["status"], "completed");
        if i == 50 {
            at_fifty = Some(
                server
                    .ok("harness::metrics", json!({"root_session_id": "s_progress"}))
                    .await["totals"]
                    .clone(),
            );
        }
    }
    let list = announcements(&server).await;
    assert_eq!(milestones(&list), vec![1, 2, 5, 10, 25, 50], "{list:#?}");
    assert_eq!(list.len(), 6);
    let mut previous = 0;
    for a in &list {
        // One generation per turn here: the tree's turn count is the milestone itself.
        let turns = a["totals"]["turns"].as_u64().unwrap();
        assert_eq!(turns, a["milestone"].as_u64().unwrap(), "{a}");
        assert!(turns >= previous);
        previous = turns;
        assert_eq!(a["provider"], "scripted");
        assert_eq!(a["model"], "demo");
    }
    let fifty = at_fifty.unwrap();
    let last = &list[5]["totals"];
    for k in ["turns", "function_calls", "input_tokens", "output_tokens"] {
        assert_eq!(last[k], fifty[k], "{k}: {last} vs harness::metrics {fifty}");
    }
    // No id, no text.
    let dump = serde_json::to_string(&list).unwrap();
    for needle in ["s_progress", "note ", "noted"] {
        assert!(!dump.contains(needle), "'{needle}' in an announcement");
    }
    assert_eq!(an_id_in(&dump), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_failure_outcome_is_announced_once_and_sub_agents_add_nothing() {
    let fx = Fixtures::new(json!([{"id": "fx::look", "response": {"seen": "secret-result"}}]));
    let script = script(vec![
        json!({"match": {"last_user_text": "^break"},
               "error": {"kind": "permanent", "message": "refused"}, "repeat": true}),
        json!({"match": {"last_user_text": "^dawdle"}, "delay_ms": 5000, "repeat": true,
               "content": [{"type": "text", "text": "too late"}]}),
        json!({"match": {"last_user_text": "^loop"}, "repeat": true,
               "content": [{"type": "function_call", "id": "c1", "function_id": "fx::look",
                            "arguments": {"path": "/secret/path"}}]}),
        json!({"match": {"last_user_text": "^delegate"},
               "content": [{"type": "function_call", "id": "s1", "function_id": "harness::spawn",
                            "arguments": {"task": "child work"}}]}),
        text_gen(Some("^child work"), "child done", 0, true),
        text_gen(None, "fine", 0, true),
    ]);
    let extra = fx.args();
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let server = Server::start(&script, &extra).await;
    let sid = "s_outcomes";
    for _ in 0..2 {
        let s = turn(&server, sid, "break it", Value::Null).await;
        assert_eq!(s["status"], "failed");
        let sent = server
            .ok(
                "harness::send",
                json!({"session_id": sid, "message": "dawdle", "model": "demo", "provider": "scripted"}),
            )
            .await;
        wait_for("the slow generation", WAIT, || async {
            (server.status(sid).await["status"] == "running").then_some(())
        })
        .await;
        server.ok("harness::stop", json!({"session_id": sid})).await;
        let s = server
            .wait_turn(sid, sent["turn_id"].as_str().unwrap())
            .await;
        assert_eq!(s["status"], "cancelled");
        let s = turn(
            &server,
            sid,
            "loop forever",
            json!({"max_turns": 1, "functions": {"allow": ["fx::*"], "expose": "native"}}),
        )
        .await;
        assert_eq!(s["status"], "completed", "{s}");
    }
    let list = announcements(&server).await;
    let failed: Vec<(&str, &str)> = list
        .iter()
        .filter(|a| a["event"] == "harness_turn_failed")
        .map(|a| {
            (
                a["outcome"].as_str().unwrap(),
                a["failure_class"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        failed,
        vec![
            ("failed", "provider_permanent"),
            ("cancelled", "stopped"),
            ("max_turns", "max_turns")
        ],
        "{list:#?}"
    );
    // Six root turns: milestones 1, 2 and 5.
    assert_eq!(milestones(&list), vec![1, 2, 5]);
    assert_eq!(list.len(), 6);
    let dump = serde_json::to_string(&list).unwrap();
    for needle in [
        sid,
        "fx::look",
        "/secret/path",
        "secret-result",
        "break it",
        "dawdle",
    ] {
        assert!(!dump.contains(needle), "'{needle}' in an announcement");
    }

    // A sub-agent's turn announces nothing of its own: its root's first turn is the only one.
    let s = turn(
        &server,
        "s_delegating",
        "delegate it",
        json!({"functions": {"allow": ["harness::spawn"], "expose": "native"}}),
    )
    .await;
    assert_eq!(s["status"], "completed");
    let tree = server
        .ok(
            "harness::session-tree",
            json!({"session_id": "s_delegating"}),
        )
        .await;
    assert_eq!(tree["children"].as_array().unwrap().len(), 1, "{tree}");
    let after = announcements(&server).await;
    let new: Vec<&Value> = after.iter().skip(list.len()).collect();
    assert_eq!(new.len(), 1, "{new:#?}");
    assert_eq!(new[0]["milestone"], 1);
    // The child's generation is in its root's totals.
    assert_eq!(new[0]["totals"]["turns"], 3, "{}", new[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkill_after_the_terminal_write_neither_loses_nor_repeats_a_milestone() {
    let mut server = Server::start(&script(vec![text_gen(None, "ok", 0, true)]), &[]).await;
    server.set_env("HARNESS_FAILPOINT", Some("after_finalize_persisted:1"));
    server.restart().await;
    let sent = server
        .ok(
            "harness::send",
            json!({"session_id": "s_crash", "message": "one", "model": "demo", "provider": "scripted"}),
        )
        .await;
    let deadline = std::time::Instant::now() + WAIT;
    while !server.exited() {
        assert!(
            std::time::Instant::now() < deadline,
            "the failpoint did not fire"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    server.set_env("HARNESS_FAILPOINT", None);
    server.start_again().await;
    server
        .wait_turn("s_crash", sent["turn_id"].as_str().unwrap())
        .await;
    // The redelivered step finds the turn over and finishes what the crash cut short.
    wait_for("milestone 1 after the restart", WAIT, || async {
        (milestones(&announcements(&server).await) == vec![1]).then_some(())
    })
    .await;
    turn(&server, "s_crash", "two", Value::Null).await;
    turn(&server, "s_crash", "three", Value::Null).await;
    assert_eq!(milestones(&announcements(&server).await), vec![1, 2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_opt_out_gives_no_announcement_and_no_row() {
    let config = tempfile::tempdir().unwrap();
    let file = config.path().join("harness.yaml");
    std::fs::write(&file, "usage_reporting: false\n").unwrap();
    let file = file.display().to_string();
    for (var, value, flags) in [
        ("III_TELEMETRY_ENABLED", "false", vec![]),
        ("III_TELEMETRY_ENABLED", "0", vec![]),
        ("HARNESS_TELEMETRY_ENABLED", "false", vec![]),
        ("HARNESS_TELEMETRY_ENABLED", "0", vec![]),
        // `usage_reporting: false` in the config file.
        (
            "HARNESS_TELEMETRY_ENABLED",
            "true",
            vec!["--config", file.as_str()],
        ),
    ] {
        let mut server = Server::start(&script(vec![text_gen(None, "ok", 0, true)]), &flags).await;
        server.set_env(var, Some(value));
        server.restart().await;
        for t in ["one", "two", "three"] {
            turn(&server, "s_private", t, Value::Null).await;
        }
        assert_eq!(
            announcements(&server).await,
            Vec::<Value>::new(),
            "{var}={value} {flags:?}"
        );
        let row = server
            .ok(
                "state::get",
                json!({"scope": "harness_usage", "key": "s_private"}),
            )
            .await;
        assert!(row.is_null(), "{var}={value}: a harness_usage row: {row}");
    }
    // The control: the same three turns without an opt-out announce milestones 1 and 2.
    let server = Server::start(&script(vec![text_gen(None, "ok", 0, true)]), &[]).await;
    for t in ["one", "two", "three"] {
        turn(&server, "s_public", t, Value::Null).await;
    }
    assert_eq!(milestones(&announcements(&server).await), vec![1, 2]);
    let row = server
        .ok(
            "state::get",
            json!({"scope": "harness_usage", "key": "s_public"}),
        )
        .await;
    assert_eq!(row["milestones"], json!([1, 2]), "{row}");
}
