//! The directory against the real binary: `serve` reads profiles and skills from
//! `directory/` in its data dir, and `harness chat --agent NAME` starts a session under one.

mod common;

use common::{run_cli, script, text_gen, Server};
use serde_json::{json, Value};

fn write(root: &std::path::Path, rel: &str, text: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, text).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_agent_runs_a_new_session_under_the_profile() {
    let server = Server::start(&script(vec![text_gen(None, "arr", 0, true)]), &[]).await;
    let root = server.data_dir().join("directory");
    write(
        &root,
        "agents/pirate.md",
        "---\ndescription: talks like a pirate\nmodel: pirate-model\nprovider: scripted\nskills: [knots]\n---\nTalk like a pirate.",
    );
    write(
        &root,
        "skills/knots/SKILL.md",
        "---\nname: knots\ndescription: Sailor's knots.\n---\nBowline first.",
    );
    let listed = server.ok("directory::agents::list", json!({})).await;
    assert_eq!(listed["agents"][0]["name"], "pirate");

    let url = server.url();
    let (code, out, err) = tokio::task::spawn_blocking(move || {
        run_cli(&["chat", "--url", &url, "--agent", "pirate", "-m", "ahoy"])
    })
    .await
    .unwrap();
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("arr"), "{out}");

    let sessions = server.ok("session::list", json!({})).await;
    let sid = sessions["sessions"][0]["session_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{sessions}"))
        .to_string();
    let preview = server
        .ok("harness::system-prompt::get", json!({"session_id": sid}))
        .await;
    assert_eq!(
        preview["layers"][0]["label"],
        "session (frozen at send): agent profile pirate"
    );
    let prompt = preview["system_prompt"].as_str().unwrap();
    assert!(
        prompt.starts_with(
            "Talk like a pirate.\n\n<preloaded_skills>\n<skill name=\"knots\">\nBowline first."
        ),
        "{prompt}"
    );
    // The reply came from the profile's model: chat sent none of its own.
    let messages = server
        .ok("session::messages", json!({"session_id": sid}))
        .await
        .to_string();
    assert!(
        messages.contains("\"model\":\"pirate-model\""),
        "{messages}"
    );

    // A profile that does not resolve stops the chat before anything is sent.
    let url = server.url();
    let (code, _, err) = tokio::task::spawn_blocking(move || {
        run_cli(&["chat", "--url", &url, "--agent", "ghost", "-m", "hi"])
    })
    .await
    .unwrap();
    assert_eq!(code, 1);
    assert!(
        err.contains("--agent ghost")
            && err.contains("agent profile 'ghost' is not in the directory"),
        "{err}"
    );
    let sessions: Value = server.ok("session::list", json!({})).await;
    assert_eq!(sessions["sessions"].as_array().map(Vec::len), Some(1));
}
