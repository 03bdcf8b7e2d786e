//! Wire types of harness.
//!
//! Everything that crosses the bus is defined here, and only here: transcript messages and content
//! blocks ([`message`]), the `context::*` contract ([`context`]), the request/response structs of the `harness::*` functions ([`api`]), the
//! `router::chat` request and its frame vocabulary ([`router`]), the stable `harness/<code>` errors
//! ([`error`]), deterministic entry ids ([`ids`]) and strict payload parsing that names the
//! offending field ([`parse`]).
//!
//! Architecture invariant: this crate does no I/O and knows nothing about buses, stores or the loop.

pub mod api;
pub mod context;
pub mod digest;
pub mod directory;
pub mod error;
pub mod fold;
pub mod ids;
pub mod message;
pub mod parse;
pub mod router;
pub mod session;

pub use error::{ErrorCode, HarnessError};
pub use message::{AgentMessage, ContentBlock, ErrorKind, StopReason, Usage};

/// Milliseconds since the Unix epoch, the timestamp unit of every record and message.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
