//! A local HTTP server that replays provider wire formats, and helpers to drive the router.
//!
//! The server is a raw `TcpListener`: each request gets the next scripted reply — an SSE body sent
//! as HTTP/1.1 chunks (with pauses, a cut connection, or a hang until the client goes away) or a
//! plain body with any status and headers — and is recorded (method, path, headers, JSON body)
//! so a test can assert exactly what the adapter sent.

#![allow(dead_code)]

pub mod recorded;

#[path = "../../../harness-core/tests/support/embedded.rs"]
pub mod embedded;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness_bus::CallContext;
use harness_router::providers::{HttpOptions, ProviderConfig, ProviderKind};
use harness_router::retry::RetryPolicy;
use harness_router::Router;
use harness_types::message::{
    AgentMessage, AssistantMessage, ContentBlock, FunctionResultMessage, StopReason,
};
use harness_types::router::{ChatAck, ChatRequest, Frame, ToolSpec};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

pub const KEY: &str = "sk-test-0123456789abcdef";

/// One piece of a streamed reply.
#[derive(Clone, Debug)]
pub enum Step {
    /// Raw SSE text, written as one HTTP chunk.
    Send(String),
    Sleep(u64),
    /// Close the connection mid-body (no terminating chunk).
    Cut,
    /// Send nothing more; keep the connection until the client drops it.
    Hang,
}

/// `event: <name>` + `data: <json>`.
pub fn ev(name: &str, data: Value) -> Step {
    Step::Send(format!("event: {name}\ndata: {data}\n\n"))
}

/// A bare `data:` line (Chat Completions).
pub fn data(v: Value) -> Step {
    Step::Send(format!("data: {v}\n\n"))
}

pub fn raw(s: &str) -> Step {
    Step::Send(s.to_string())
}

#[derive(Clone, Debug)]
pub enum Reply {
    Stream(Vec<Step>),
    Status {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
}

pub fn status(status: u16, headers: &[(&'static str, &str)], body: Value) -> Reply {
    Reply::Status {
        status,
        headers: headers.iter().map(|(k, v)| (*k, v.to_string())).collect(),
        body: body.to_string(),
    }
}

pub use recorded::Request as Recorded;

pub struct Mock {
    pub url: String,
    pub requests: Arc<Mutex<Vec<Recorded>>>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
}

impl Mock {
    pub async fn start(replies: Vec<Reply>) -> Mock {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let requests = Arc::new(Mutex::new(Vec::new()));
        let replies = Arc::new(Mutex::new(VecDeque::from(replies)));
        let (r, q) = (requests.clone(), replies.clone());
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let (r, q) = (r.clone(), q.clone());
                tokio::spawn(async move {
                    let _ = serve(sock, r, q).await;
                });
            }
        });
        Mock {
            url,
            requests,
            replies,
        }
    }

    pub fn push(&self, reply: Reply) {
        self.replies.lock().unwrap().push_back(reply);
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.requests.lock().unwrap().clone()
    }

    pub fn bodies(&self) -> Vec<Value> {
        self.requests().into_iter().map(|r| r.body).collect()
    }
}

async fn serve(
    mut sock: TcpStream,
    requests: Arc<Mutex<Vec<Recorded>>>,
    replies: Arc<Mutex<VecDeque<Reply>>>,
) -> std::io::Result<()> {
    let Some(req) = recorded::read_request(&mut sock).await? else {
        return Ok(());
    };
    requests.lock().unwrap().push(req);
    let reply = replies
        .lock()
        .unwrap()
        .pop_front()
        .unwrap_or(Reply::Status {
            status: 500,
            headers: vec![],
            body: r#"{"error":{"message":"the mock has no more replies"}}"#.into(),
        });
    match reply {
        Reply::Status {
            status,
            headers,
            body,
        } => {
            let mut head = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
                body.len()
            );
            for (k, v) in headers {
                head.push_str(&format!("{k}: {v}\r\n"));
            }
            head.push_str("\r\n");
            sock.write_all(head.as_bytes()).await?;
            sock.write_all(body.as_bytes()).await?;
        }
        Reply::Stream(steps) => {
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n")
                .await?;
            for step in steps {
                match step {
                    Step::Send(s) => {
                        sock.write_all(format!("{:x}\r\n{s}\r\n", s.len()).as_bytes())
                            .await?;
                    }
                    Step::Sleep(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                    Step::Cut => {
                        sock.shutdown().await?;
                        return Ok(());
                    }
                    Step::Hang => {
                        let mut b = [0u8; 64];
                        let _ =
                            tokio::time::timeout(Duration::from_secs(30), sock.read(&mut b)).await;
                        return Ok(());
                    }
                }
            }
            sock.write_all(b"0\r\n\r\n").await?;
        }
    }
    sock.flush().await?;
    Ok(())
}

/// Fast retries for tests.
pub fn http() -> HttpOptions {
    HttpOptions {
        retry: RetryPolicy {
            max_attempts: 3,
            base_delay_ms: 10,
            max_delay_ms: 40,
            max_total_wait_ms: 5_000,
        },
        idle_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
    }
}

/// `http://127.0.0.1:<port>/v1` on a port the system handed out and nothing listens on any more.
pub fn nothing_listening() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}/v1", listener.local_addr().unwrap())
}

/// A router with one provider of `kind` named `id`, pointed at `mock`.
pub fn router(
    mock: &Mock,
    id: &str,
    kind: ProviderKind,
    base_suffix: &str,
    key: Option<&str>,
) -> Router {
    let router = Router::new();
    let cfg =
        ProviderConfig::new(id, kind, &format!("{}{base_suffix}", mock.url), key).with_http(http());
    router.add_provider(cfg.build());
    router
}

pub fn request(provider: &str, model: &str, messages: Vec<AgentMessage>) -> ChatRequest {
    ChatRequest {
        session_id: Some("s_1".into()),
        provider: Some(provider.into()),
        system_prompt: Some("You are terse.".into()),
        ..ChatRequest::new("t_1:0", model, messages)
    }
}

pub fn user(text: &str) -> AgentMessage {
    AgentMessage::user_text(text, 1)
}

pub fn add_tool() -> ToolSpec {
    ToolSpec {
        name: "math::add".into(),
        description: "Add two numbers.".into(),
        parameters: json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}),
    }
}

pub fn result(call_id: &str, text: &str) -> AgentMessage {
    AgentMessage::FunctionResult(FunctionResultMessage {
        function_call_id: call_id.into(),
        function_id: "math::add".into(),
        content: vec![ContentBlock::text(text)],
        details: Value::Null,
        is_error: false,
        timestamp: 2,
    })
}

/// The string `field` of every element of the JSON array `list`, in order.
pub fn strings<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    let items = list
        .as_array()
        .unwrap_or_else(|| panic!("an array: {list}"));
    items.iter().map(|e| e[field].as_str().unwrap()).collect()
}

/// The frame kinds a streamed reply must give: `head` (the `start` frame and
/// whatever a provider sends before its first block), then each `(block, pieces)`
/// as `<block>_start`, one `<block>_delta` per piece and `<block>_end`, then the
/// ending every provider gives a finished reply: `usage`, `stop`, `done`.
pub fn stream_kinds(head: &[&str], blocks: &[(&str, usize)]) -> Vec<String> {
    let mut kinds: Vec<String> = head.iter().map(|k| k.to_string()).collect();
    for (block, pieces) in blocks {
        kinds.push(format!("{block}_start"));
        kinds.extend((0..*pieces).map(|_| format!("{block}_delta")));
        kinds.push(format!("{block}_end"));
    }
    kinds.extend(["usage", "stop", "done"].map(String::from));
    kinds
}

pub struct Run {
    pub frames: Vec<Frame>,
    pub ack: ChatAck,
}

impl Run {
    pub fn kinds(&self) -> Vec<String> {
        self.frames
            .iter()
            .map(|f| {
                serde_json::to_value(f).unwrap()["type"]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect()
    }

    pub fn done(&self) -> AssistantMessage {
        match self.frames.last() {
            Some(Frame::Done { message }) => message.clone(),
            other => panic!("expected done, got {other:?}"),
        }
    }

    /// The error frame: (partial, kind, message).
    pub fn error(&self) -> (AssistantMessage, harness_types::ErrorKind, String) {
        match self.frames.last() {
            Some(Frame::Error {
                error,
                error_kind,
                error_message,
            }) => (error.clone(), *error_kind, error_message.clone()),
            other => panic!("expected error, got {other:?}"),
        }
    }

    /// The error frame of a run that failed transiently: (partial, detail).
    pub fn transient(&self) -> (AssistantMessage, String) {
        let (partial, kind, detail) = self.error();
        assert_eq!(kind, harness_types::ErrorKind::Transient, "{detail}");
        (partial, detail)
    }

    pub fn text(&self) -> String {
        self.frames
            .iter()
            .filter_map(|f| match f {
                Frame::TextDelta { delta } => Some(delta.as_str()),
                _ => None,
            })
            .collect()
    }

    /// The finished reply of a run that called `math::add` with `{"a": 2, "b": 3}` as call
    /// `id`, its last block: the call was announced by a start frame and ended the reply.
    pub fn add_call(&self, id: &str) -> AssistantMessage {
        assert!(
            self.frames.contains(&Frame::FunctionCallStart {
                id: id.into(),
                function_id: "math::add".into()
            }),
            "{:?}",
            self.kinds()
        );
        let m = self.done();
        assert_eq!(m.stop_reason, StopReason::FunctionCall);
        assert_eq!(
            m.content.last(),
            Some(&ContentBlock::FunctionCall {
                id: id.into(),
                function_id: "math::add".into(),
                arguments: json!({"a": 2, "b": 3})
            })
        );
        m
    }

    /// Exactly one terminal frame, and it is last.
    pub fn assert_one_terminal(&self) {
        let n = self.frames.iter().filter(|f| f.is_terminal()).count();
        assert_eq!(n, 1, "{:?}", self.kinds());
        assert!(self.frames.last().unwrap().is_terminal());
    }
}

/// A `harness::send` of `text` to `model` at the `llamacpp` provider, in `session` when given.
pub fn llamacpp_send(
    model: &str,
    session: Option<&str>,
    text: &str,
    options: harness_types::api::SendOptions,
) -> harness_types::api::SendRequest {
    harness_types::api::SendRequest {
        session_id: session.map(str::to_string),
        message: json!(text),
        model: Some(model.into()),
        provider: Some("llamacpp".into()),
        options: Some(options),
        ..Default::default()
    }
}

/// The assistant messages of a session, oldest first.
pub fn replies(
    sessions: &harness_session::SessionStore,
    session_id: &str,
) -> Vec<AssistantMessage> {
    sessions
        .all_entries(session_id, false)
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.message {
            Some(AgentMessage::Assistant(a)) => Some(a),
            _ => None,
        })
        .collect()
}

/// Runs one generation and collects every frame.
pub async fn chat(router: &Router, req: ChatRequest) -> Run {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let ack = router
        .chat(
            req,
            CallContext {
                frames: Some(tx),
                metadata: Value::Null,
            },
        )
        .await;
    let mut frames = Vec::new();
    while let Ok(v) = rx.try_recv() {
        frames.push(serde_json::from_value::<Frame>(v).expect("a valid frame"));
    }
    let run = Run { frames, ack };
    run.assert_one_terminal();
    run
}

/// The loop's two steps of an addition: asks `provider` for 2 + 3 with the add tool, answers
/// the model's call `call_id` with `{"sum":5}`, and asks again as the next step. Checks that the
/// second answer is the mock's "It is 5."; the test then reads the second request's body.
pub async fn add_exchange(router: &Router, provider: &str, model: &str, call_id: &str) {
    let mut req = request(provider, model, vec![user("add 2 and 3")]);
    req.tools = vec![add_tool()];
    let run = chat(router, req.clone()).await;
    let messages = Arc::make_mut(&mut req.messages);
    messages.push(assistant(&run));
    messages.push(result(call_id, "{\"sum\":5}"));
    req.request_id = "t_1:1".into();
    let second = chat(router, req).await;
    assert_eq!(second.done().content, vec![ContentBlock::text("It is 5.")]);
}

/// The messages of [`add_exchange`]'s second request in the chat-completions format, which
/// OpenAI and the servers compatible with it read alike (call `call_1`).
pub fn chat_format_exchange() -> Value {
    json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "Adding.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "math__add", "arguments": "{\"a\":2,\"b\":3}"}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sum\":5}"}
    ])
}

/// The assistant message of a finished run, as the loop stores it.
pub fn assistant(run: &Run) -> AgentMessage {
    AgentMessage::Assistant(run.done())
}

/// An in-process bus with the router's functions registered (for `router::abort` and
/// `router::models::*` through the bus).
pub fn bus_with(router: &Router) -> (harness_bus::EmbeddedBus, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store =
        harness_store::Store::open(&dir.path().join("t.db"), harness_store::Durability::Normal)
            .unwrap();
    let bus = harness_bus::EmbeddedBus::new(store).unwrap();
    harness_router::register(&bus, router);
    (bus, dir)
}

/// Streams `req` through `router::chat` on the bus and calls `router::abort` once the first
/// text delta arrived; checks that the stream then ended within 2 s as an aborted reply, which
/// it returns.
pub async fn abort_mid_stream(router: &Router, req: ChatRequest) -> AssistantMessage {
    use harness_bus::Bus;
    let (bus, _dir) = bus_with(router);
    let request_id = req.request_id.clone();
    let mut call = bus
        .call_streaming(
            "router::chat",
            serde_json::to_value(&req).unwrap(),
            Some(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    // The call runs while its result is polled.
    let result = tokio::spawn(call.result);
    let mut frames = Vec::new();
    let mut aborted_at = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let v = tokio::time::timeout_at(deadline, call.frames.recv())
            .await
            .unwrap_or_else(|_| panic!("frames in time; so far {frames:?}"));
        let Some(v) = v else { break };
        let f: Frame = serde_json::from_value(v).unwrap();
        let is_delta = matches!(f, Frame::TextDelta { .. });
        let terminal = f.is_terminal();
        frames.push(f);
        if is_delta && aborted_at.is_none() {
            aborted_at = Some(std::time::Instant::now());
            let r = bus
                .call(
                    "router::abort",
                    json!({"request_id": request_id}),
                    Some(Duration::from_secs(2)),
                )
                .await
                .unwrap();
            assert_eq!(r, json!({"aborted": true}));
        }
        if terminal {
            break;
        }
    }
    let took = aborted_at.expect("a text delta arrived").elapsed();
    let ack: ChatAck = serde_json::from_value(result.await.unwrap().unwrap()).unwrap();
    assert!(ack.ok);
    assert!(took < Duration::from_secs(2), "{took:?}");
    match frames.last() {
        Some(Frame::Done { message }) if message.stop_reason == StopReason::Aborted => {
            message.clone()
        }
        other => panic!("expected an aborted done, got {other:?}"),
    }
}
