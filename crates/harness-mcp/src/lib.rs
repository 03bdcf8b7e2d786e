//! MCP for the harness, both ways.
//!
//! * [`McpHub`] — the client side: every server of the `mcp_servers` configuration (a stdio
//!   child process or a streamable HTTP endpoint) has its tools registered on the bus as
//!   `mcp::<server>::<tool>`, with the tool's input schema and description, so the loop offers
//!   and dispatches them like any other function, under the same deny-by-default policy and
//!   the same control-plane wall. Modules: `config` (the key, checked), `names` (tool name →
//!   function id), `client` (one supervised server: connect, list, follow list changes,
//!   reconnect), `content` (an MCP result → harness content blocks, §4.11), `http` (the
//!   streamable HTTP transport's requests, over the workspace's reqwest).
//! * [`server`] — the harness served as an MCP server (`harness mcp`): send, status, stop,
//!   answer, approvals list/decide, each a call of the existing `harness::*` / `approval::*`
//!   function through a [`server::Caller`].
//!
//! Built on the official Rust SDK, `rmcp`: its client and transports, and its model types on
//! both sides. Not its server side (`server` serves the protocol itself) nor its reqwest client,
//! which would put a second `schemars` and a second `reqwest` into the binary; the tests' fixture
//! server is a real rmcp server all the same (feature `fixture`, on in test builds only).

mod client;
pub mod config;
pub mod content;
mod error;
mod http;
mod hub;
pub mod names;
pub mod server;

pub use client::{Backoff, ServerStatus};
pub use config::{parse_servers, ServerSpec, Transport};
pub use error::McpError;
pub use hub::McpHub;
