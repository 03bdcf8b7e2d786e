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

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Map, Value};

use crate::error::McpError;

/// The name this server gives in its handshake. The MCP client refuses a server of this name,
/// so configuring `harness mcp` as an MCP server cannot hand a model the operator's tools.
pub const SERVER_NAME: &str = "harness";

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
        let err = |message: String| McpError::Request {
            server: "harness".into(),
            message,
        };
        let running = self
            .serve(rmcp::transport::stdio())
            .await
            .map_err(|e| err(e.to_string()))?;
        running.waiting().await.map_err(|e| err(e.to_string()))?;
        Ok(())
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

impl ServerHandler for HarnessServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(SERVER_NAME, env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Drive a harness agent loop: send a message, follow it with status, answer its questions, decide held function calls.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(self.tools.clone()))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.tools.iter().find(|t| t.name == name).cloned()
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
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
        Ok(result.into())
    }
}
