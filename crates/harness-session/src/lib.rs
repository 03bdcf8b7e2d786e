//! The transcript store: `session::*` functions over SQLite.
//!
//! A session is an ordered list of entries; each entry is a transcript message or a
//! model-invisible custom record, with a caller-chosen `entry_id` that makes `append` idempotent
//! (appending an existing id is a no-op that returns the original). Every change also appends an
//! event (`session::message-added`, `session::message-updated`, `session::status-changed`, `session::deleted`) to the
//! store's event log in the same transaction, which is what the HTTP event stream serves.
//!
//! Architecture invariant: the turn loop never touches these tables; it calls the functions.

mod changes;
mod functions;
mod store;

pub use functions::{register, register_transactional};
pub use store::{SessionError, SessionStore};

/// Topics this crate publishes on the event log.
pub mod topics {
    pub const MESSAGE_ADDED: &str = "session::message-added";
    pub const MESSAGE_UPDATED: &str = "session::message-updated";
    pub const STATUS_CHANGED: &str = "session::status-changed";
    pub const DELETED: &str = "session::deleted";
}
