//! The one error type of the crate.

/// The wire code of [`StoreError::Full`] (`harness_types::ErrorCode::StorageFull`): its text
/// leads the error's message, so a caller that only keeps the text keeps the kind too.
pub const STORAGE_FULL: &str = "harness/storage_full";

/// Everything that can go wrong in the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sqlite: {0}")]
    Sqlite(rusqlite::Error),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("io: {0}")]
    Io(std::io::Error),
    /// The disk or the quota is full (SQLITE_FULL, ENOSPC, EDQUOT): the write, or the batch it
    /// was in, was not kept. Nothing acknowledged is lost; writes succeed again once space
    /// returns.
    #[error("harness/storage_full: {0}")]
    Full(String),
    /// The store was closed, or its writer/syncer thread is gone: the call did not run.
    #[error("store is closed")]
    Closed,
    /// Another process has the database open (see `lock.rs`): one process per database.
    #[error(
        "harness/store_in_use: {path} is open in {holder}; one process per data directory: stop \
         it first, or talk to it over its API (e.g. `harness chat --url`)"
    )]
    InUse { path: String, holder: String },
    /// The database was written by a newer harness (a higher schema version than this build
    /// knows): opening it could lose what the newer layout keeps elsewhere, so it is left as is.
    #[error(
        "harness/store_too_new: {path} holds store schema {found} and this harness reads up to \
         {supported}; run the harness that wrote it (or a newer one); this one did not change it"
    )]
    TooNew {
        path: String,
        found: i64,
        supported: i64,
    },
    /// Misuse or a batch-level failure (e.g. the batch COMMIT failed, a write closure panicked).
    #[error("{0}")]
    Invalid(String),
}

impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        StoreError::Sqlite(e).classified()
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io(e).classified()
    }
}

/// Whether an OS error says the disk or the quota is full.
pub(crate) fn io_is_full(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

/// Whether SQLite says the disk is full (it maps ENOSPC on its writes to SQLITE_FULL).
pub(crate) fn sqlite_is_full(e: &rusqlite::Error) -> bool {
    e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull)
}

impl StoreError {
    /// Whether this is [`StoreError::Full`] (or an error that [`StoreError::classified`] turns
    /// into it).
    pub fn is_full(&self) -> bool {
        match self {
            StoreError::Full(_) => true,
            StoreError::Sqlite(e) => sqlite_is_full(e),
            StoreError::Io(e) => io_is_full(e),
            _ => false,
        }
    }

    /// The error with a full disk named as [`StoreError::Full`], whichever way it was built
    /// (a crate may wrap a SQLite error in `Sqlite` itself).
    pub fn classified(self) -> StoreError {
        match self {
            StoreError::Sqlite(e) if sqlite_is_full(&e) => StoreError::Full(e.to_string()),
            StoreError::Io(e) if io_is_full(&e) => StoreError::Full(e.to_string()),
            other => other,
        }
    }
}
