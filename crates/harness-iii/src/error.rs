//! Errors of the iii adapter (connecting, ensuring the engine's pieces), and the mapping of the
//! SDK's errors onto bus errors.

use harness_bus::BusError;

#[derive(Debug, thiserror::Error)]
pub enum IiiError {
    #[error("cannot register with the iii engine at {url}: {why}")]
    Connect { url: String, why: String },
    #[error("the write-ahead copy at {path}: {why}")]
    Journal { path: String, why: String },
    #[error("the iii engine at {url} lacks {what}")]
    Missing { url: String, what: String },
}

/// An SDK error as a bus error: remote codes pass through (`function_not_found`,
/// `invocation_stopped`, `harness/…`), a local timeout is `timeout`, a dropped link
/// `not_connected` (both transient for the loop).
pub(crate) fn from_sdk(function_id: &str, timeout_ms: u64, e: iii_sdk::Error) -> BusError {
    match e {
        iii_sdk::Error::Remote { code, message, .. } => BusError::new(code, message),
        iii_sdk::Error::Timeout => BusError::timeout(function_id, timeout_ms),
        iii_sdk::Error::NotConnected => BusError::new(
            "not_connected",
            format!("{function_id}: the iii engine is not connected"),
        ),
        other => BusError::new("iii_error", format!("{function_id}: {other}")),
    }
}

/// A bus error as the error a handler answers with: the code is kept on the wire.
pub(crate) fn to_sdk(e: BusError) -> iii_sdk::Error {
    iii_sdk::Error::Remote {
        code: e.code.to_string(),
        message: e.message,
        stacktrace: None,
    }
}
