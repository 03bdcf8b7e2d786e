//! The harness's own MCP server (`server.rs`, served without rmcp's server side) against a real
//! rmcp client, and against raw JSON-RPC lines for what no well-behaved client sends. Its tools
//! call a recording `Caller` here; `crates/harness/tests/mcp_server.rs` drives the real binary.

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness_mcp::server::{
    CallFuture, Caller, HarnessServer, MAX_BYTES_IN_FLIGHT, MAX_IN_FLIGHT, SERVER_NAME,
};
use rmcp::model::{CallToolRequestParams, CallToolResult, ProtocolVersion};
use rmcp::service::Peer;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, DuplexStream, Lines};
use tokio::sync::{Notify, Semaphore};

fn send_schema() -> Value {
    json!({"type": "object", "properties": {"message": {"type": "string"}, "session_id": {"type": "string"}},
           "required": ["message"]})
}

/// Answers like a runtime without the approval gate; records every call; `harness::send` waits
/// for `release` when `hold_send` is set. `harness::status` waits for a permit of `gate` when
/// there is one, counted in `in_flight` meanwhile; for session "panic" it panics.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<(String, Value)>>,
    hold_send: bool,
    release: Notify,
    gate: Option<Semaphore>,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
}

impl Caller for Recorder {
    fn call<'a>(&'a self, function_id: &'a str, payload: Value) -> CallFuture<'a> {
        Box::pin(async move {
            self.calls
                .lock()
                .unwrap()
                .push((function_id.to_string(), payload.clone()));
            match function_id {
                "engine::functions::info" => Ok(match payload["function_id"].as_str() {
                    Some("harness::send") => json!({"request_schema": send_schema()}),
                    Some("harness::status" | "harness::stop") => {
                        json!({"request_schema": {"type": "object"}})
                    }
                    _ => Value::Null,
                }),
                "harness::send" => {
                    if self.hold_send {
                        self.release.notified().await;
                    }
                    Ok(
                        json!({"session_id": payload["session_id"].as_str().unwrap_or("s_new"), "turn_id": "t1"}),
                    )
                }
                "harness::status" => {
                    if payload["session_id"] == "panic" {
                        panic!("a handler bug quoting the-secret-argument");
                    }
                    if let Some(gate) = &self.gate {
                        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        self.most_in_flight.fetch_max(now, Ordering::SeqCst);
                        gate.acquire().await.unwrap().forget();
                        self.in_flight.fetch_sub(1, Ordering::SeqCst);
                    }
                    Ok(json!({"status": "completed", "result": "hi"}))
                }
                "harness::stop" => Err("harness/not_found: no session 'nope'".into()),
                other => Err(format!("harness/not_found: {other}")),
            }
        })
    }
}

impl Recorder {
    fn calls_of(&self, function_id: &str) -> Vec<Value> {
        let calls = self.calls.lock().unwrap();
        calls
            .iter()
            .filter(|(f, _)| f == function_id)
            .map(|(_, p)| p.clone())
            .collect()
    }
}

/// The server on one end of two pipes; the other ends for the client.
async fn serve(
    caller: Arc<Recorder>,
) -> (
    DuplexStream,
    DuplexStream,
    tokio::task::JoinHandle<Result<(), harness_mcp::McpError>>,
) {
    let server = HarnessServer::new(caller).await;
    let (client_out, server_in) = tokio::io::duplex(64 * 1024);
    let (server_out, client_in) = tokio::io::duplex(64 * 1024);
    let task = tokio::spawn(server.serve(server_in, server_out));
    (client_out, client_in, task)
}

/// `tools/call` of `tool` with `arguments`, answered (by a result or a tool failure).
async fn call(peer: &Peer<RoleClient>, tool: &'static str, arguments: Value) -> CallToolResult {
    peer.call_tool(CallToolRequestParams::new(tool).with_arguments(args(arguments)))
        .await
        .unwrap_or_else(|e| panic!("{tool}: {e}"))
}

fn args(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => panic!("arguments are an object"),
    }
}

fn text(r: &CallToolResult) -> String {
    serde_json::to_value(&r.content).unwrap().to_string()
}

#[tokio::test]
async fn an_rmcp_client_completes_the_handshake_lists_and_calls_the_tools() {
    let caller = Arc::new(Recorder::default());
    let (to_server, from_server, task) = serve(caller.clone()).await;
    let client = ().serve((from_server, to_server)).await.unwrap();
    let peer = client.peer().clone();

    let info = peer.peer_info().unwrap();
    assert_eq!(info.server_info.as_ref().unwrap().name, SERVER_NAME);
    assert!(info.capabilities.tools.is_some());
    // The client asked for the newest version, which has no handshake: the newest that has one.
    assert_eq!(
        info.protocol_version,
        ProtocolVersion::LATEST_WITH_INITIALIZE
    );

    // No approval gate registered: its two tools are left out.
    let tools = peer.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(names, ["send", "status", "stop", "answer"]);
    assert_eq!(
        Value::Object((*tools[0].input_schema).clone()),
        send_schema()
    );

    let status = call(&peer, "status", json!({"session_id": "s1"})).await;
    assert_ne!(status.is_error, Some(true));
    assert_eq!(
        status.structured_content,
        Some(json!({"status": "completed", "result": "hi"}))
    );
    assert_eq!(
        caller.calls_of("harness::status"),
        [json!({"session_id": "s1"})]
    );

    // A harness refusal is the tool's failure, its text the harness error.
    let stop = call(&peer, "stop", json!({"session_id": "nope"})).await;
    assert_eq!(stop.is_error, Some(true));
    assert!(
        text(&stop).contains("harness/not_found: no session 'nope'"),
        "{stop:?}"
    );

    // `answer` is the session's next message; without its text it is refused before any call.
    let answer = call(&peer, "answer", json!({"session_id": "s1", "text": "blue"})).await;
    assert_eq!(answer.structured_content.unwrap()["session_id"], "s1");
    assert_eq!(
        caller.calls_of("harness::send"),
        [json!({"session_id": "s1", "message": "blue"})]
    );
    let incomplete = call(&peer, "answer", json!({"session_id": "s1"})).await;
    assert_eq!(incomplete.is_error, Some(true));
    assert!(text(&incomplete).contains("harness/invalid_request"));
    assert_eq!(caller.calls_of("harness::send").len(), 1);

    // A tool that is not offered is a protocol error, not a call.
    let e = peer
        .call_tool(CallToolRequestParams::new("approvals_list"))
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("approval::list is not registered"),
        "{e}"
    );
    let e = peer
        .call_tool(CallToolRequestParams::new("rm_rf"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("unknown tool 'rm_rf'"), "{e}");

    client.cancel().await.unwrap();
    // The client went away: the server returns.
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the server ends with its input")
        .unwrap()
        .unwrap();
}

/// A raw JSON-RPC client: one line out, one line in.
struct Raw {
    out: DuplexStream,
    lines: Lines<BufReader<DuplexStream>>,
}

impl Raw {
    async fn send(&mut self, line: &str) {
        self.out.write_all(line.as_bytes()).await.unwrap();
        self.out.write_all(b"\n").await.unwrap();
    }

    async fn next(&mut self) -> Value {
        let line = tokio::time::timeout(Duration::from_secs(10), self.lines.next_line())
            .await
            .expect("an answer")
            .unwrap()
            .expect("a line");
        serde_json::from_str(&line).unwrap()
    }
}

async fn raw(
    caller: Arc<Recorder>,
) -> (
    Raw,
    tokio::task::JoinHandle<Result<(), harness_mcp::McpError>>,
) {
    let (out, input, task) = serve(caller).await;
    (
        Raw {
            out,
            lines: BufReader::new(input).lines(),
        },
        task,
    )
}

#[tokio::test]
async fn malformed_and_unknown_messages_get_json_rpc_errors_and_the_server_goes_on() {
    let (mut c, _task) = raw(Arc::new(Recorder::default())).await;
    let mut expected = VecDeque::from([
        ("not json at all", Value::Null, -32700),
        ("[]", Value::Null, -32600),
        (r#"{"id": 1, "method": "ping"}"#, Value::Null, -32600),
        (
            r#"{"jsonrpc": "2.0", "id": {"x": 1}, "method": "ping"}"#,
            Value::Null,
            -32600,
        ),
        (
            r#"{"jsonrpc": "2.0", "id": 2, "method": "server/discover", "params": {}}"#,
            json!(2),
            -32601,
        ),
        (
            r#"{"jsonrpc": "2.0", "id": "c", "method": "tools/call", "params": {"arguments": {}}}"#,
            json!("c"),
            -32602,
        ),
        (
            r#"{"jsonrpc": "2.0", "id": 3, "method": "initialize", "params": {"protocolVersion": 7}}"#,
            json!(3),
            -32602,
        ),
    ]);
    while let Some((line, id, code)) = expected.pop_front() {
        c.send(line).await;
        let got = c.next().await;
        assert_eq!(got["jsonrpc"], "2.0", "{line}: {got}");
        assert_eq!(got["id"], id, "{line}: {got}");
        assert_eq!(got["error"]["code"], code, "{line}: {got}");
    }
    // Notifications and blank lines are not answered, not even a notification that is not
    // JSON-RPC 2.0: the next line out is the ping's.
    c.send(r#"{"jsonrpc": "2.0", "method": "notifications/initialized"}"#)
        .await;
    c.send(r#"{"method": "notifications/initialized"}"#).await;
    c.send(r#"{"jsonrpc": "1.0", "method": "notifications/cancelled", "params": {}}"#)
        .await;
    c.send("").await;
    c.send(r#"{"jsonrpc": "2.0", "id": "p", "method": "ping"}"#)
        .await;
    assert_eq!(
        c.next().await,
        json!({"jsonrpc": "2.0", "id": "p", "result": {}})
    );
}

#[tokio::test]
async fn initialize_echoes_a_known_version_and_names_its_own_for_any_other() {
    let (mut c, _task) = raw(Arc::new(Recorder::default())).await;
    let init = |id: u32, version: &str| {
        json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "0"}}})
        .to_string()
    };
    for (id, asked, answered) in [
        (1, "2025-06-18", "2025-06-18"),
        (2, "2024-11-05", "2024-11-05"),
        (
            3,
            "2099-01-01",
            ProtocolVersion::LATEST_WITH_INITIALIZE.as_str(),
        ),
        (
            4,
            "1999-01-01",
            ProtocolVersion::LATEST_WITH_INITIALIZE.as_str(),
        ),
    ] {
        c.send(&init(id, asked)).await;
        let got = c.next().await;
        assert_eq!(got["id"], id);
        assert_eq!(got["result"]["protocolVersion"], answered, "{got}");
        assert_eq!(got["result"]["serverInfo"]["name"], SERVER_NAME);
        assert!(got["result"]["capabilities"]["tools"].is_object(), "{got}");
    }
}

#[tokio::test]
async fn a_slow_call_does_not_hold_up_other_requests_and_is_answered_after_input_ends() {
    let caller = Arc::new(Recorder {
        hold_send: true,
        ..Recorder::default()
    });
    let (mut c, task) = raw(caller.clone()).await;
    c.send(r#"{"jsonrpc": "2.0", "id": "slow", "method": "tools/call", "params": {"name": "send", "arguments": {"message": "hi"}}}"#).await;
    c.send(r#"{"jsonrpc": "2.0", "id": "quick", "method": "ping"}"#)
        .await;
    assert_eq!(c.next().await["id"], "quick");
    // The client closes its end while the call is still running: it is answered all the same.
    let Raw { out, mut lines } = c;
    drop(out);
    caller.release.notify_one();
    let line = tokio::time::timeout(Duration::from_secs(10), lines.next_line())
        .await
        .expect("the held answer")
        .unwrap()
        .unwrap();
    let got: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(got["id"], "slow");
    assert_eq!(got["result"]["structuredContent"]["turn_id"], "t1");
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the server ends once the answer is out")
        .unwrap()
        .unwrap();
}

fn status_request(id: impl Into<Value>, session_id: &str) -> String {
    json!({"jsonrpc": "2.0", "id": id.into(), "method": "tools/call",
           "params": {"name": "status", "arguments": {"session_id": session_id}}})
    .to_string()
}

#[tokio::test]
async fn a_request_whose_handler_panics_is_answered_with_an_internal_error() {
    let (mut c, _task) = raw(Arc::new(Recorder::default())).await;
    c.send(&status_request("boom", "panic")).await;
    let got = c.next().await;
    assert_eq!(got["id"], "boom", "{got}");
    assert_eq!(got["error"]["code"], -32603, "{got}");
    assert!(
        !got.to_string().contains("the-secret-argument"),
        "the panic's text stays out of the answer: {got}"
    );
    // The server goes on.
    c.send(&status_request(2, "s1")).await;
    let got = c.next().await;
    assert_eq!(got["id"], 2, "{got}");
    assert_eq!(got["result"]["structuredContent"]["status"], "completed");
}

/// Writes `requests` (held by the caller's gate until released) and waits until `running` of
/// them run at once; checks that no more start, then releases them one at a time and checks
/// that every one is answered once, with the status the caller gives.
async fn flood_and_release(caller: Arc<Recorder>, requests: Vec<String>, running: usize) {
    let flood = requests.len();
    let (Raw { mut out, mut lines }, _task) = raw(caller.clone()).await;
    let writer = tokio::spawn(async move {
        for request in requests {
            out.write_all(request.as_bytes()).await.unwrap();
            out.write_all(b"\n").await.unwrap();
        }
        out
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while caller.in_flight.load(Ordering::SeqCst) < running {
        assert!(
            Instant::now() < deadline,
            "{running} requests never ran at once"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Nothing more starts while the server holds back.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(caller.in_flight.load(Ordering::SeqCst), running);
    let gate = caller.gate.as_ref().unwrap();
    let mut answered = HashSet::new();
    while answered.len() < flood {
        // One request finishes, so one more may start.
        gate.add_permits(1);
        let line = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("an answer")
            .unwrap()
            .expect("a line");
        let got: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(
            got["result"]["structuredContent"]["status"], "completed",
            "{got}"
        );
        let id = got["id"].as_u64().unwrap();
        assert!(answered.insert(id), "{id} answered twice");
    }
    assert_eq!(caller.most_in_flight.load(Ordering::SeqCst), running);
    assert_eq!(caller.in_flight.load(Ordering::SeqCst), 0);
    writer.await.unwrap();
}

fn gated() -> Arc<Recorder> {
    Arc::new(Recorder {
        gate: Some(Semaphore::new(0)),
        ..Recorder::default()
    })
}

/// Many more requests than may run at once, each held until released: no more than
/// MAX_IN_FLIGHT ever run together (the server stops reading meanwhile), and every one is
/// answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_requests_runs_at_most_max_in_flight_at_once_and_is_answered_in_full() {
    let requests = (0..MAX_IN_FLIGHT * 4)
        .map(|i| status_request(i, "s1"))
        .collect();
    flood_and_release(gated(), requests, MAX_IN_FLIGHT).await;
}

/// Large requests are held back by their bytes, not only their number: requests of 5 MiB each
/// (blank space inside the JSON) run at most MAX_BYTES_IN_FLIGHT / 5 MiB at once, far fewer
/// than MAX_IN_FLIGHT, and every one is answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_in_flight_are_bounded_by_their_bytes() {
    const SIZE: usize = 5 * 1024 * 1024;
    let most = MAX_BYTES_IN_FLIGHT / SIZE;
    assert!(most < MAX_IN_FLIGHT);
    let requests = (0..most + 8)
        .map(|i| {
            let request = status_request(i, "s1");
            format!("{{{}{}", " ".repeat(SIZE), &request[1..])
        })
        .collect();
    flood_and_release(gated(), requests, most).await;
}
