//! `harness mcp` as a real process driven by an rmcp client over stdio: the six tools with the
//! schemas of the functions they call, a turn sent and followed to its end, a held call listed
//! and approved, a stop, and a harness error shown as the tool's failure. With `--url`: the tools
//! of a running server, and a start refused, naming the URL and the cause, when no harness
//! answers there.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{Peer, RunningService};
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Map, Value};

mod common;

use common::{assert_contains_all, free_port, run_cli, script, BIN};

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

/// A server that takes calls only with `TOKEN`.
const TOKEN: &str = "the-right-token";

/// `harness serve` with `--token TOKEN` (common::Server cannot: its readiness check carries no
/// token), once it serves; its URL.
async fn locked_server(dir: &std::path::Path) -> (common::KillOnDrop, String) {
    std::fs::write(dir.join("script.json"), script(vec![]).to_string()).unwrap();
    let port = free_port();
    let log = dir.join("serve.log");
    let child = std::process::Command::new(BIN)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--token",
            TOKEN,
        ])
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--script")
        .arg(dir.join("script.json"))
        .env_remove("HARNESS_TOKEN")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut child = common::KillOnDrop(child);
    let url = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + common::WAIT;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(&format!("harness serving on {url}")) {
            return (child, url);
        }
        assert!(child.0.try_wait().unwrap().is_none(), "exited: {text}");
        assert!(Instant::now() < deadline, "never served: {text}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn with_url_it_fronts_a_running_server_with_its_token() {
    let dir = tempfile::tempdir().unwrap();
    let (_server, url) = locked_server(dir.path()).await;
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.args(["mcp", "--url", &url, "--token", TOKEN])
        .env_remove("HARNESS_TOKEN");
    let running = ().serve(TokioChildProcess::new(cmd).unwrap()).await.unwrap();
    let tools = running.peer().list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert!(
        names.contains(&"send") && names.contains(&"status"),
        "{names:?}"
    );
    running.cancel().await.unwrap();

    // A wrong token is refused at start, with the server's own code.
    let (code, _, stderr) = run_cli(&["mcp", "--url", &url, "--token", "a-wrong-token"]);
    assert_ne!(code, 0, "started anyway; stderr:\n{stderr}");
    assert_contains_all(&stderr, &["harness/unauthorized: ", &url]);
}

/// `harness mcp --url` toward `url` (which carries a user, a password and a key in its query):
/// it must refuse to start, and its words must show neither of the three.
fn refused_start(url: &str) -> String {
    let (code, stdout, stderr) = run_cli(&["mcp", "--url", url]);
    assert_ne!(code, 0, "started anyway; stderr:\n{stderr}");
    assert!(stdout.is_empty(), "stdout is the protocol's: {stdout}");
    for secret in ["operator", "hunter2", "k-secret-2"] {
        assert!(!stderr.contains(secret), "{secret} shown: {stderr}");
    }
    stderr
}

fn with_secrets(port: u16) -> String {
    format!("http://operator:hunter2@127.0.0.1:{port}/?key=k-secret-2")
}

#[test]
fn with_url_and_nothing_listening_it_refuses_to_start_naming_the_url_and_the_refusal() {
    let port = free_port();
    let stderr = refused_start(&with_secrets(port));
    assert_contains_all(
        &stderr,
        &[
            "harness/dependency: ",
            &format!("http://127.0.0.1:{port}"),
            "refused",
        ],
    );
}

#[test]
fn with_url_and_a_server_that_never_answers_it_refuses_to_start_on_a_timeout() {
    // The kernel completes the connection (the backlog); nothing ever reads or answers it.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let stderr = refused_start(&with_secrets(port));
    assert_contains_all(
        &stderr,
        &["harness/timeout: ", &format!("http://127.0.0.1:{port}")],
    );
    drop(silent);
}

#[test]
fn with_url_and_a_server_that_is_not_a_harness_it_refuses_to_start() {
    let other = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = other.local_addr().unwrap().port();
    let answering = std::thread::spawn(move || {
        let (mut conn, _) = other.accept().unwrap();
        let mut request = [0u8; 4096];
        let _ = conn.read(&mut request);
        conn.write_all(
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nConnection: close\r\n\r\nnot found",
        )
        .unwrap();
    });
    let stderr = refused_start(&with_secrets(port));
    assert_contains_all(
        &stderr,
        &[
            "harness/dependency: ",
            &format!("http://127.0.0.1:{port}"),
            "404",
            "not JSON",
        ],
    );
    answering.join().unwrap();
}
