//! The crate's one error type.

/// What can go wrong between the harness and an MCP server.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// A configuration entry that cannot be used; `key` is the dotted path
    /// (`mcp_servers.<name>.<field>`).
    #[error("harness/invalid_config: {key}: {message}")]
    Config { key: String, message: String },
    /// The server could not be started or did not complete the MCP handshake.
    #[error("mcp server '{server}' did not start: {message}")]
    Start { server: String, message: String },
    /// The server must not be connected at all (it would hand a model the control plane).
    #[error("mcp server '{server}' refused: {message}")]
    Refused { server: String, message: String },
    /// A request to a running server failed (transport closed, protocol error).
    #[error("mcp server '{server}': {message}")]
    Request { server: String, message: String },
}

impl McpError {
    pub(crate) fn config(key: impl Into<String>, message: impl Into<String>) -> Self {
        McpError::Config {
            key: key.into(),
            message: message.into(),
        }
    }
}
