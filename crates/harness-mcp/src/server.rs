//! The harness served as an MCP server (`harness mcp`): what an operator's editor or another
//! agent uses to drive it.
//!
//! Six tools, each one call of a function the harness already has, with that function's own
//! request schema (read from `engine::functions::info`, so the two never drift):
//!
//! | tool | function |
//! |---|---|
//! | `send` | `harness::send` |
//! | `status` | `harness::status` |
//! | `stop` | `harness::stop` |
//! | `answer` | `harness::send` with the answer as the session's next message (how a `harness::ask` card is answered) |
//! | `approvals_list` | `approval::list` |
//! | `approvals_decide` | `approval::decide` |
//!
//! This is the operator's side of the wall (like the HTTP API): the client of this server
//! decides approvals and sends messages. Nothing here is offered to a model: the loop's
//! dispatch never reaches these tools, and they reach the loop only through the functions
//! named above, whose own checks apply.
//!
//! The protocol is served here rather than by rmcp's server side (which would link a second
//! `schemars` into the binary): newline-delimited JSON-RPC 2.0 over stdin/stdout, the
//! `initialize` lifecycle, `ping`, `tools/list` and `tools/call`, with rmcp's `model` types for
//! every parameter and result. Requests are answered concurrently, each as soon as it is done,
//! up to [`MAX_IN_FLIGHT`] at once.
//!
//! `server/discover` belongs to the stateless revision (2026-07-28), which has no `initialize`;
//! every version this server answers (up to `ProtocolVersion::LATEST_WITH_INITIALIZE`) has the
//! handshake and no such method. A client that opens with it is told the method does not exist
//! (-32601), which is how that revision's clients learn to fall back to `initialize`.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;

use futures::FutureExt;

use rmcp::model::{
    CallToolRequestParams, CallToolResult, ContentBlock, ErrorCode, Implementation,
    InitializeRequestParams, ListToolsResult, ProtocolVersion, ServerCapabilities, ServerConfig,
    Tool, ToolsCapability,
};
use rmcp::ErrorData;
use serde_json::{json, Map, Value};
use tokio::io::{AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, Semaphore};

use crate::error::McpError;

/// The name this server gives in its handshake. The MCP client refuses a server of this name,
/// so configuring `harness mcp` as an MCP server cannot hand a model the operator's tools.
pub const SERVER_NAME: &str = "harness";

/// The longest request line read; a longer one is answered as an invalid request and skipped.
pub const MAX_LINE: usize = 16 * 1024 * 1024;

/// Requests answered at once. Past it the server reads no further request until one is done,
/// so a client that floods it is held back by its own pipe instead of growing this process. A
/// client (an editor, an agent) has a few calls out at a time, and each is one short function
/// call (`send` starts a turn and returns): 32 is well above that use, and 32 answers in memory
/// are nothing.
pub const MAX_IN_FLIGHT: usize = 32;

/// Request bytes held by the requests in flight (each holds its line's length until its answer
/// is queued). [`MAX_IN_FLIGHT`] alone would let 32 requests of [`MAX_LINE`] each hold half a
/// GiB; this keeps a client sending large ones to a few at a time.
pub const MAX_BYTES_IN_FLIGHT: usize = 64 * 1024 * 1024;

/// The unit of [`MAX_BYTES_IN_FLIGHT`]'s semaphore (its permits are counted in `u32`).
const BYTE_PERMIT: usize = 1024;

/// Answers waiting for the writer. A request holds its slot until its answer is queued, so this
/// only lets the requests finish while the writer is busy; as many as can be in flight.
const ANSWERS_QUEUED: usize = MAX_IN_FLIGHT;

/// Boxed future of a [`Caller`].
pub type CallFuture<'a> = Pin<Box<dyn Future<Output = Result<Value, String>> + Send + 'a>>;

/// Where the tools' functions are called: the in-process bus, or a running server over HTTP.
/// An error is the `harness/<code>: <message>` text.
pub trait Caller: Send + Sync + 'static {
    fn call<'a>(&'a self, function_id: &'a str, payload: Value) -> CallFuture<'a>;
}

/// One tool and the function it calls.
struct Mapping {
    tool: &'static str,
    function: &'static str,
    description: &'static str,
}

const MAPPINGS: [Mapping; 6] = [
    Mapping {
        tool: "send",
        function: "harness::send",
        description: "Send a message to a session (created when new). Starts a turn, or steers the running one. Returns session_id and turn_id; follow the turn with status.",
    },
    Mapping {
        tool: "status",
        function: "harness::status",
        description: "The session's current turn: status, result, pending function calls, error.",
    },
    Mapping {
        tool: "stop",
        function: "harness::stop",
        description: "Cancel the session's running turn (and its sub-agents).",
    },
    Mapping {
        tool: "answer",
        function: "harness::send",
        description: "Answer the question card a turn ended on (harness::ask): the text is the session's next message, one line per question.",
    },
    Mapping {
        tool: "approvals_list",
        function: "approval::list",
        description: "Function calls held for a person's approval, with their exact arguments and digest.",
    },
    Mapping {
        tool: "approvals_decide",
        function: "approval::decide",
        description: "Approve or deny one held call; give the digest approvals_list showed, so the decision binds to those exact arguments.",
    },
];

fn answer_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "session_id": {"type": "string", "description": "The session whose turn asked."},
            "text": {"type": "string", "description": "The answer, one line per question."}
        },
        "required": ["session_id", "text"],
        "additionalProperties": false
    })
}

/// The server: its tool list is fixed when it starts.
pub struct HarnessServer {
    caller: Arc<dyn Caller>,
    tools: Vec<Tool>,
}

impl HarnessServer {
    /// Reads each target function's schema through `caller`; a target that is not registered
    /// (no approval gate on a worker without it) leaves its tool out.
    pub async fn new(caller: Arc<dyn Caller>) -> HarnessServer {
        let mut tools = Vec::new();
        for m in &MAPPINGS {
            let schema = if m.tool == "answer" {
                Some(answer_schema())
            } else {
                match caller
                    .call(
                        "engine::functions::info",
                        json!({"function_id": m.function}),
                    )
                    .await
                {
                    Ok(Value::Null) => None,
                    Ok(info) => Some(
                        info.get("request_schema")
                            .filter(|s| s.is_object())
                            .cloned()
                            .unwrap_or_else(|| json!({"type": "object"})),
                    ),
                    Err(e) => {
                        tracing::warn!(tool = m.tool, "cannot describe {}: {e}", m.function);
                        None
                    }
                }
            };
            let Some(Value::Object(schema)) = schema else {
                continue;
            };
            tools.push(Tool::new(m.tool, m.description, Arc::new(schema)));
        }
        HarnessServer { caller, tools }
    }

    /// The names of the tools offered.
    pub fn tool_names(&self) -> Vec<String> {
        self.tools.iter().map(|t| t.name.to_string()).collect()
    }

    /// Serves over this process's stdin/stdout until the client goes away.
    pub async fn serve_stdio(self) -> Result<(), McpError> {
        self.serve(tokio::io::stdin(), tokio::io::stdout()).await
    }

    /// Serves one client: a JSON-RPC message per line in, one per line out, until `input`
    /// ends. Requests still running then are answered before this returns. A client that does
    /// not read its answers is not read either once [`MAX_IN_FLIGHT`] requests wait on it.
    pub async fn serve<R, W>(self, input: R, output: W) -> Result<(), McpError>
    where
        R: AsyncRead + Unpin + Send,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let server = Arc::new(self);
        let (tx, mut rx) = mpsc::channel::<Value>(ANSWERS_QUEUED);
        let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let bytes = Arc::new(Semaphore::new(MAX_BYTES_IN_FLIGHT / BYTE_PERMIT));
        let writer = tokio::spawn(async move {
            let mut output = output;
            while let Some(message) = rx.recv().await {
                let mut line = serde_json::to_vec(&message).unwrap_or_default();
                line.push(b'\n');
                output.write_all(&line).await?;
                output.flush().await?;
            }
            Ok::<(), std::io::Error>(())
        });
        let mut input = BufReader::new(input);
        let mut running = tokio::task::JoinSet::new();
        let read = loop {
            while running.try_join_next().is_some() {}
            let line = match next_line(&mut input, MAX_LINE).await {
                Ok(Some(line)) => line,
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            let weight = match &line {
                Line::Text(text) => text.len().div_ceil(BYTE_PERMIT).max(1),
                Line::TooLong => 1,
            };
            let message = match line {
                Line::TooLong => Err(ErrorData::invalid_request(
                    format!("a message longer than {MAX_LINE} bytes"),
                    None,
                )),
                Line::Text(text) if text.iter().all(u8::is_ascii_whitespace) => continue,
                Line::Text(text) => serde_json::from_slice::<Value>(&text)
                    .map_err(|e| ErrorData::parse_error(format!("not JSON: {e}"), None)),
            };
            let incoming = match message.and_then(Incoming::read) {
                Ok(incoming) => incoming,
                Err(e) => {
                    let _ = tx.send(reply(Value::Null, Err(e))).await;
                    continue;
                }
            };
            if let Incoming::Request { id, method, params } = incoming {
                // Never closed, so this only waits for a slot.
                let Ok(slot) = slots.clone().acquire_owned().await else {
                    break Ok(());
                };
                // At most MAX_LINE / BYTE_PERMIT, well below the semaphore's size.
                let Ok(held) = bytes.clone().acquire_many_owned(weight as u32).await else {
                    break Ok(());
                };
                let (server, tx) = (server.clone(), tx.clone());
                running.spawn(async move {
                    let answer = AssertUnwindSafe(server.answer(&method, params))
                        .catch_unwind()
                        .await
                        .unwrap_or_else(|_| {
                            // The panic's text went to stderr with the panic; it may quote the
                            // request, so the client is told only that it failed.
                            tracing::error!(method, "harness mcp: a request panicked");
                            Err(ErrorData::internal_error(
                                format!("{method}: the server failed while answering"),
                                None,
                            ))
                        });
                    let _ = tx.send(reply(id, answer)).await;
                    drop((slot, held));
                });
            }
            // Notifications (initialized, cancelled, progress) and answers to requests this
            // server never sends need nothing from it.
        };
        while running.join_next().await.is_some() {}
        drop(tx);
        let written = writer
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
        read.and(written).map_err(|e| McpError::Request {
            server: SERVER_NAME.into(),
            message: e.to_string(),
        })
    }

    /// The answer to one request: its result, or the JSON-RPC error.
    async fn answer(&self, method: &str, params: Option<Value>) -> Result<Value, ErrorData> {
        fn params_of<T: serde::de::DeserializeOwned>(
            params: Option<Value>,
        ) -> Result<T, ErrorData> {
            serde_json::from_value(params.unwrap_or_else(|| json!({})))
                .map_err(|e| ErrorData::invalid_params(format!("params: {e}"), None))
        }
        let result = match method {
            "initialize" => {
                let client: InitializeRequestParams = params_of(params)?;
                let info = self
                    .info()
                    .with_protocol_version(negotiate(&client.protocol_version));
                serde_json::to_value(info)
            }
            "ping" => Ok(json!({})),
            "tools/list" => {
                serde_json::to_value(ListToolsResult::with_all_items(self.tools.clone()))
            }
            "tools/call" => {
                let request: CallToolRequestParams = params_of(params)?;
                let arguments = request.arguments.unwrap_or_default();
                let result = match self.run(&request.name, arguments).await? {
                    Err(e) => CallToolResult::error(vec![ContentBlock::text(e)]),
                    Ok(value) => {
                        let text = serde_json::to_string_pretty(&value).unwrap_or_default();
                        let mut r = CallToolResult::success(vec![ContentBlock::text(text)]);
                        if value.is_object() {
                            r.structured_content = Some(value);
                        }
                        r
                    }
                };
                serde_json::to_value(result)
            }
            other => {
                return Err(ErrorData::new(
                    ErrorCode::METHOD_NOT_FOUND,
                    format!("method '{other}' is not served here"),
                    None,
                ))
            }
        };
        result.map_err(|e| ErrorData::internal_error(e.to_string(), None))
    }

    fn info(&self) -> ServerConfig {
        let mut capabilities = ServerCapabilities::default();
        capabilities.tools = Some(ToolsCapability::default());
        ServerConfig::new(capabilities)
            .with_server_info(Implementation::new(SERVER_NAME, env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Drive a harness agent loop: send a message, follow it with status, answer its questions, decide held function calls.",
            )
    }

    /// `Err` = a protocol error (unknown tool); `Ok(Err)` = the harness refused (shown to the
    /// client as the tool's failure).
    async fn run(
        &self,
        tool: &str,
        arguments: Map<String, Value>,
    ) -> Result<Result<Value, String>, ErrorData> {
        let Some(m) = MAPPINGS.iter().find(|m| m.tool == tool) else {
            return Err(ErrorData::invalid_params(
                format!("unknown tool '{tool}'"),
                None,
            ));
        };
        if !self.tools.iter().any(|t| t.name == tool) {
            return Err(ErrorData::invalid_params(
                format!(
                    "tool '{tool}' is not available: {} is not registered",
                    m.function
                ),
                None,
            ));
        }
        let payload = if m.tool == "answer" {
            let field = |k: &str| arguments.get(k).and_then(Value::as_str);
            match (field("session_id"), field("text")) {
                (Some(session_id), Some(text)) => {
                    json!({"session_id": session_id, "message": text})
                }
                _ => {
                    return Ok(Err(
                        "harness/invalid_request: session_id and text are required strings".into(),
                    ))
                }
            }
        } else {
            Value::Object(arguments)
        };
        Ok(self.caller.call(m.function, payload).await)
    }
}

/// The version answered to `initialize`: the client's own when it is a known one that still
/// has the handshake, else the newest that has it (the client then decides whether it can
/// speak that).
fn negotiate(requested: &ProtocolVersion) -> ProtocolVersion {
    if requested.has_initialize() && ProtocolVersion::KNOWN_VERSIONS.contains(requested) {
        requested.clone()
    } else {
        ProtocolVersion::LATEST_WITH_INITIALIZE
    }
}

/// One message from the client, as far as this server cares.
enum Incoming {
    Request {
        id: Value,
        method: String,
        params: Option<Value>,
    },
    /// A notification, or an answer to a request (this server sends none).
    Other,
}

impl Incoming {
    fn read(message: Value) -> Result<Incoming, ErrorData> {
        let Value::Object(mut m) = message else {
            return Err(ErrorData::invalid_request(
                "a message must be one JSON-RPC object (batches are not part of MCP)",
                None,
            ));
        };
        if m.get("jsonrpc").and_then(Value::as_str) != Some("2.0") {
            // A notification is never answered (JSON-RPC 2.0 §4.1), not even to say it is
            // malformed: the client expects no line for it.
            if m.get("method").is_some_and(Value::is_string) && !m.contains_key("id") {
                tracing::debug!("harness mcp: a notification without jsonrpc \"2.0\" ignored");
                return Ok(Incoming::Other);
            }
            return Err(ErrorData::invalid_request("jsonrpc: must be \"2.0\"", None));
        }
        let Some(method) = m.get("method").cloned() else {
            return Ok(Incoming::Other);
        };
        let Value::String(method) = method else {
            return Err(ErrorData::invalid_request("method: must be a string", None));
        };
        let Some(id) = m.remove("id") else {
            return Ok(Incoming::Other);
        };
        if !(id.is_string() || id.is_i64() || id.is_u64()) {
            return Err(ErrorData::invalid_request(
                "id: must be a string or an integer",
                None,
            ));
        }
        Ok(Incoming::Request {
            id,
            method,
            params: m.remove("params"),
        })
    }
}

fn reply(id: Value, answer: Result<Value, ErrorData>) -> Value {
    match answer {
        Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
        Err(error) => json!({"jsonrpc": "2.0", "id": id, "error": error}),
    }
}

enum Line {
    Text(Vec<u8>),
    /// Longer than the limit; what there was of it has been skipped.
    TooLong,
}

/// The next line of `input` (without its `\n`); `None` at the end. A line over `max` bytes is
/// read to its end and dropped, never held in memory.
async fn next_line<R: AsyncBufRead + Unpin>(
    input: &mut R,
    max: usize,
) -> std::io::Result<Option<Line>> {
    let mut line = Vec::new();
    let mut too_long = false;
    loop {
        let available = input.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (too_long, line.is_empty()) {
                (true, _) => Some(Line::TooLong),
                (false, true) => None,
                (false, false) => Some(Line::Text(line)),
            });
        }
        let (take, end) = match available.iter().position(|b| *b == b'\n') {
            Some(at) => (at, true),
            None => (available.len(), false),
        };
        if !too_long && line.len() + take <= max {
            line.extend_from_slice(&available[..take]);
        } else {
            too_long = true;
            line = Vec::new();
        }
        input.consume(take + usize::from(end));
        if end {
            return Ok(Some(if too_long {
                Line::TooLong
            } else {
                Line::Text(line)
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_line_over_the_limit_is_skipped_whole_and_the_next_one_read() {
        // A reader that hands out three bytes at a time, so lines span its buffer.
        let input = b"abc\n0123456789\nxyz\n\nlast".as_slice();
        let mut input = BufReader::with_capacity(3, input);
        let mut got = Vec::new();
        while let Some(line) = next_line(&mut input, 5).await.unwrap() {
            got.push(match line {
                Line::Text(t) => String::from_utf8(t).unwrap(),
                Line::TooLong => "<too long>".into(),
            });
        }
        assert_eq!(got, ["abc", "<too long>", "xyz", "", "last"]);
    }
}
