//! Errors crossing the bus.

use harness_types::{ErrorCode, HarnessError};

/// An error returned by a call: a code (`harness/invalid_request`, `function_not_found`,
/// `timeout`, `router/...`) and a message. Codes from other namespaces pass through untouched.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct BusError {
    pub code: String,
    pub message: String,
}

impl BusError {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        BusError {
            code: code.into(),
            message: message.into(),
        }
    }

    pub fn function_not_found(function_id: &str) -> Self {
        BusError::new(
            "function_not_found",
            format!("no function '{function_id}' is registered"),
        )
    }

    pub fn timeout(function_id: &str, ms: u64) -> Self {
        BusError::new(
            "timeout",
            format!("{function_id} did not answer within {ms} ms"),
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        BusError::new(ErrorCode::Internal.as_str(), message)
    }

    pub fn is_not_found(&self) -> bool {
        self.code == "function_not_found"
    }

    /// Errors worth retrying in place: the callee is (re)starting or the link dropped.
    pub fn is_transient_dependency(&self) -> bool {
        matches!(
            self.code.as_str(),
            "function_not_found" | "not_connected" | "timeout" | "invocation_stopped"
        )
    }

    /// The error as a `harness/<code>` error: harness codes are kept, anything else becomes
    /// `harness/dependency` (or `function_not_found` / `timeout`) with the original text.
    pub fn into_harness(self) -> HarnessError {
        if let Some(code) = ErrorCode::parse(&self.code) {
            return HarnessError::new(code, self.message);
        }
        match self.code.as_str() {
            "function_not_found" => HarnessError::new(ErrorCode::FunctionNotFound, self.message),
            "timeout" => HarnessError::new(ErrorCode::Timeout, self.message),
            _ => HarnessError::dependency(format!("{}: {}", self.code, self.message)),
        }
    }
}

impl From<HarnessError> for BusError {
    fn from(e: HarnessError) -> Self {
        BusError::new(e.code.as_str(), e.message)
    }
}

impl From<harness_store::StoreError> for BusError {
    fn from(e: harness_store::StoreError) -> Self {
        BusError::new(ErrorCode::State.as_str(), e.to_string())
    }
}
