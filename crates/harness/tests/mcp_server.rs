//! `harness mcp` as a real process driven by an rmcp client over stdio: the six tools with the
//! schemas of the functions they call, a turn sent and followed to its end, a held call listed
//! and approved, a stop, and a harness error shown as the tool's failure.

use std::time::{Duration, Instant};

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{Peer, RunningService};
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Map, Value};

const BIN: &str = env!("CARGO_BIN_EXE_harness");

struct Client {
    running: RunningService<RoleClient, ()>,
    _dir: tempfile::TempDir,
}

async fn start(script: Value) -> Client {
    let dir = tempfile::tempdir().unwrap();
    let script_path = dir.path().join("script.json");
    std::fs::write(&script_path, script.to_string()).unwrap();
    let fixtures = dir.path().join("fixtures.json");
    std::fs::write(
        &fixtures,
        json!({"functions": [{"id": "fixture::write", "description": "writes",
                              "request_schema": {"type": "object"}, "response": {"written": true}}]})
        .to_string(),
    )
    .unwrap();
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("mcp")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .arg("--script")
        .arg(&script_path)
        .arg("--fixtures")
        .arg(&fixtures)
        .args(["--approve", "fixture::*", "--durability", "normal"])
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("OPENAI_API_KEY");
    let running = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    Client { running, _dir: dir }
}

fn args(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("arguments are an object"),
    }
}

async fn call(peer: &Peer<RoleClient>, tool: &str, arguments: Value) -> CallToolResult {
    peer.call_tool(CallToolRequestParams::new(tool.to_string()).with_arguments(args(arguments)))
        .await
        .unwrap_or_else(|e| panic!("{tool}: {e}"))
}

/// The JSON a successful tool answered (its structured content).
fn value(r: &CallToolResult) -> Value {
    assert_ne!(r.is_error, Some(true), "{r:?}");
    r.structured_content.clone().unwrap_or(Value::Null)
}

/// Polls `status` until the turn `sent` started reaches `status`.
async fn wait_status(peer: &Peer<RoleClient>, sent: &Value, status: &str) -> Value {
    let session_id = sent["session_id"].as_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = value(&call(peer, "status", json!({"session_id": session_id})).await);
        if s["status"] == status && s["turn_id"] == sent["turn_id"] {
            return s;
        }
        assert!(Instant::now() < deadline, "never {status}: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_tools_carry_the_schemas_of_the_functions_they_call() {
    let c = start(json!({"generations": []})).await;
    let tools = c.running.peer().list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "send",
            "status",
            "stop",
            "answer",
            "approvals_list",
            "approvals_decide"
        ]
    );
    let send = &tools[0];
    let props = send.input_schema.get("properties").unwrap();
    assert!(
        props.get("message").is_some() && props.get("session_id").is_some(),
        "{props}"
    );
    let decide = &tools[5];
    let props = decide.input_schema.get("properties").unwrap();
    assert!(
        props.get("digest").is_some() && props.get("decision").is_some(),
        "{props}"
    );
    c.running.cancel().await.unwrap();
}

#[tokio::test]
async fn a_turn_is_sent_followed_and_its_held_call_approved_through_mcp() {
    let script = json!({"generations": [
        {"match": {"last_user_text": "^write"}, "content": [
            {"type": "function_call", "id": "c1", "function_id": "fixture::write", "arguments": {"path": "a.txt"}}]},
        {"match": {"last_user_text": "^hello"}, "content": [{"type": "text", "text": "hi there"}]},
        {"repeat": true, "content": [{"type": "text", "text": "written"}]}
    ]});
    let c = start(script).await;
    let peer = c.running.peer().clone();

    let sent = value(
        &call(
            &peer,
            "send",
            json!({"message": "hello", "provider": "scripted", "model": "m"}),
        )
        .await,
    );
    let sid = sent["session_id"].as_str().unwrap().to_string();
    assert!(sent["turn_id"].is_string(), "{sent}");
    let s = wait_status(&peer, &sent, "completed").await;
    assert_eq!(s["result"], "hi there");

    // A gated call: held, listed with its digest, approved, and the turn completes.
    let sent = value(
        &call(
            &peer,
            "send",
            json!({"session_id": sid, "message": "write it", "provider": "scripted", "model": "m",
                   "options": {"functions": {"allow": ["fixture::*"]}}}),
        )
        .await,
    );
    assert_eq!(sent["session_id"], sid.as_str());
    wait_status(&peer, &sent, "awaiting_functions").await;
    let listed = value(&call(&peer, "approvals_list", json!({"session_id": sid})).await);
    let a = &listed["approvals"][0];
    assert_eq!(a["function_id"], "fixture::write");
    assert_eq!(a["arguments"], json!({"path": "a.txt"}));
    let decided = value(
        &call(
            &peer,
            "approvals_decide",
            json!({"approval_id": a["approval_id"], "decision": "approve", "digest": a["digest"]}),
        )
        .await,
    );
    assert_eq!(decided["status"], "approved", "{decided}");
    let s = wait_status(&peer, &sent, "completed").await;
    assert_eq!(s["result"], "written");

    // `answer` is the session's next message.
    let answered = value(&call(&peer, "answer", json!({"session_id": sid, "text": "blue"})).await);
    assert_eq!(answered["session_id"], sid.as_str());
    assert_ne!(answered["turn_id"], sent["turn_id"]);
    wait_status(&peer, &answered, "completed").await;

    // A harness error is the tool's failure, with its code.
    let bad = call(
        &peer,
        "approvals_decide",
        json!({"approval_id": "nope", "decision": "approve", "digest": "x"}),
    )
    .await;
    assert_eq!(bad.is_error, Some(true));
    let text = serde_json::to_value(&bad.content).unwrap().to_string();
    assert!(text.contains("harness/"), "{text}");
    let bad = call(&peer, "answer", json!({"session_id": sid})).await;
    assert_eq!(bad.is_error, Some(true));

    // Stop answers for a session without a running turn, too.
    let stopped = call(&peer, "stop", json!({"session_id": sid})).await;
    assert_ne!(stopped.is_error, Some(true), "{stopped:?}");
    c.running.cancel().await.unwrap();
}
