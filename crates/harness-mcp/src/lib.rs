//! MCP for the harness, both ways.
//!
//! * [`McpHub`] — the client side: every server of the `mcp_servers` configuration (a stdio
//!   child process or a streamable HTTP endpoint) has its tools registered on the bus as
//!   `mcp::<server>::<tool>`, with the tool's input schema and description, so the loop offers
//!   and dispatches them like any other function, under the same deny-by-default policy and
//!   the same control-plane wall. Modules: `config` (the key, checked), `names` (tool name →
//!   function id), `client` (one supervised server: connect, list, follow list changes,
//!   reconnect), `content` (an MCP result → harness content blocks, §4.11).
//! * [`server`] — the harness served as an MCP server (`harness mcp`): send, status, stop,
//!   answer, approvals list/decide, each a call of the existing `harness::*` / `approval::*`
//!   function through a [`server::Caller`].
//!
//! Built on the official Rust SDK, `rmcp`.

mod client;
pub mod config;
pub mod content;
mod error;
mod hub;
pub mod names;
pub mod server;

pub use client::{Backoff, ServerStatus};
pub use config::{parse_servers, ServerSpec, Transport};
pub use error::McpError;
pub use hub::McpHub;

/// rustls needs one process-wide crypto provider; ring is the one the workspace links.
pub(crate) fn ensure_tls_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err means another part of the process installed one first: that one is used.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
