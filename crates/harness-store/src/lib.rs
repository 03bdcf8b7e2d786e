//! Durable storage for the embedded harness runtime, on one SQLite file in WAL mode.
//!
//! * [`Store`]: a single writer thread that group-commits every queued write into one
//!   transaction (each op in its own savepoint), pooled reader connections, and an explicit
//!   durability [`Store::barrier`] whose fsyncs are shared by everyone waiting at the same time.
//! * [`kv`]: scoped JSON key/value state.
//! * [`queue`]: durable FIFO queues with per-group ordering, retries, dead letters, leases and
//!   redelivery after a crash.
//! * [`events`]: an append-only, dedupable event log with a cheap "something new" signal.
//!
//! The write path is designed for "one fsync per step at most, shared across sessions": a loop
//! step's writes are committed (surviving a process kill) as soon as `write` resolves, and the one
//! `barrier` at the end of the step makes them survive power loss too.

mod cache;
pub mod error;
pub mod events;
pub mod kv;
mod kv_log;
mod lock;
pub mod queue;
mod queue_inbox;
mod schema;
pub mod store;
mod wal_pages;
mod writer;

pub use error::StoreError;
pub use events::{
    insert_event_in, insert_event_text_in, last_event_id_in, latest_by_session_in, EventRow,
    FoldHook, FoldPart,
};
pub use kv::{
    kv_delete_in, kv_get_in, kv_put_cached_in, kv_put_in, kv_put_text_cached_in, kv_put_text_in,
    kv_set_in,
};
pub use lock::Access;
pub use queue::{enqueue_in, enqueue_text_in, QueueConfig, QueueHandler, QueueMessage, Queues};
pub use store::{Durability, Store, StoreStats};
pub use wal_pages::WalPages;
pub use writer::{after_commit, on_rollback, set_idle_release};

/// The connection a [`Store::write`] closure runs on, for crates that build such closures.
pub use rusqlite::Connection;

/// Best-effort text of a panic payload, for error messages.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}
