//! The one error type of the crate.

/// Everything that can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// The store was closed, or its writer/syncer thread is gone: the call did not run.
    #[error("store is closed")]
    Closed,
    /// Another process has the database open (see `lock.rs`): one process per database.
    #[error(
        "harness/store_in_use: {path} is open in {holder}; one process per data directory: stop \
         it first, or talk to it over its API (e.g. `harness chat --url`)"
    )]
    InUse { path: String, holder: String },
    /// Misuse or a batch-level failure (e.g. the batch COMMIT failed, a write closure panicked).
    #[error("{0}")]
    Invalid(String),
}
