//! Errors crossing the bus.

use std::fmt;

use harness_types::{ErrorCode, HarnessError};

/// The code of a [`BusError`]. Its text (what crosses a wire and what older records hold) is
/// unchanged: `function_not_found`, `timeout`, `not_connected`, `invocation_stopped`,
/// `harness/<code>`; codes from other namespaces (`router/...`, an engine's own) pass through
/// untouched as [`BusCode::Other`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BusCode {
    /// No function with that id is registered (yet).
    FunctionNotFound,
    /// The callee did not answer in time.
    Timeout,
    /// The link to the engine is down.
    NotConnected,
    /// The engine stopped the invocation.
    InvocationStopped,
    /// A `harness/<code>` error.
    Harness(ErrorCode),
    /// Any other namespace's code, verbatim.
    Other(String),
}

impl BusCode {
    pub fn parse(code: &str) -> BusCode {
        match code {
            "function_not_found" => BusCode::FunctionNotFound,
            "timeout" => BusCode::Timeout,
            "not_connected" => BusCode::NotConnected,
            "invocation_stopped" => BusCode::InvocationStopped,
            other => match ErrorCode::parse(other) {
                Some(c) => BusCode::Harness(c),
                None => BusCode::Other(other.to_string()),
            },
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            BusCode::FunctionNotFound => "function_not_found",
            BusCode::Timeout => "timeout",
            BusCode::NotConnected => "not_connected",
            BusCode::InvocationStopped => "invocation_stopped",
            BusCode::Harness(c) => c.as_str(),
            BusCode::Other(s) => s,
        }
    }
}

impl fmt::Display for BusCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for BusCode {
    fn from(s: &str) -> Self {
        BusCode::parse(s)
    }
}

impl From<String> for BusCode {
    fn from(s: String) -> Self {
        BusCode::parse(&s)
    }
}

impl PartialEq<&str> for BusCode {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl serde::Serialize for BusCode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for BusCode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Ok(BusCode::parse(&s))
    }
}

/// An error returned by a call: a code and a message.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct BusError {
    pub code: BusCode,
    pub message: String,
}

impl BusError {
    pub fn new(code: impl Into<BusCode>, message: impl Into<String>) -> Self {
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
        BusError::new(BusCode::Harness(ErrorCode::Internal), message)
    }

    pub fn is_not_found(&self) -> bool {
        self.code == BusCode::FunctionNotFound
    }

    /// Errors worth retrying in place: the callee is (re)starting or the link dropped.
    pub fn is_transient_dependency(&self) -> bool {
        match &self.code {
            BusCode::FunctionNotFound
            | BusCode::NotConnected
            | BusCode::Timeout
            | BusCode::InvocationStopped => true,
            // An iii engine's answer when the callee's connection died before the engine could
            // hand it the call (it never ran): the function is about to vanish or be taken
            // over by another worker.
            BusCode::Other(code) => code == "channel_send_failed",
            BusCode::Harness(_) => false,
        }
    }

    /// The error as a `harness/<code>` error: harness codes are kept, anything else becomes
    /// `harness/dependency` (or `function_not_found` / `timeout`) with the original text.
    pub fn into_harness(self) -> HarnessError {
        match self.code {
            BusCode::Harness(code) => HarnessError::new(code, self.message),
            BusCode::FunctionNotFound => {
                HarnessError::new(ErrorCode::FunctionNotFound, self.message)
            }
            BusCode::Timeout => HarnessError::new(ErrorCode::Timeout, self.message),
            other => HarnessError::dependency(format!("{other}: {}", self.message)),
        }
    }
}

impl From<HarnessError> for BusError {
    fn from(e: HarnessError) -> Self {
        BusError::new(BusCode::Harness(e.code), e.message)
    }
}

impl From<harness_store::StoreError> for BusError {
    fn from(e: harness_store::StoreError) -> Self {
        // A full disk keeps its kind (HTTP 507, retry later); it is no fault of the state.
        match e.classified() {
            harness_store::StoreError::Full(reason) => {
                BusError::new(BusCode::Harness(ErrorCode::StorageFull), reason)
            }
            other => BusError::new(BusCode::Harness(ErrorCode::State), other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_keep_their_text_both_ways() {
        for text in [
            "function_not_found",
            "timeout",
            "not_connected",
            "invocation_stopped",
            "harness/invalid_request",
            "router/rate_limited",
        ] {
            let code = BusCode::parse(text);
            assert_eq!(code.as_str(), text);
            assert_eq!(
                serde_json::to_value(&code).unwrap(),
                serde_json::json!(text)
            );
            let back: BusCode = serde_json::from_value(serde_json::json!(text)).unwrap();
            assert_eq!(back, code);
        }
        assert_eq!(
            BusCode::parse("harness/invalid_request"),
            BusCode::Harness(ErrorCode::InvalidRequest)
        );
        assert!(matches!(BusCode::parse("router/x"), BusCode::Other(_)));
        let e = BusError::new("timeout", "slow");
        assert!(e.is_transient_dependency());
        assert_eq!(e.to_string(), "timeout: slow");
    }

    #[test]
    fn a_full_disk_crosses_the_bus_as_storage_full() {
        let e = BusError::from(harness_store::StoreError::Full(
            "database or disk is full".into(),
        ));
        assert_eq!(e.code, BusCode::Harness(ErrorCode::StorageFull));
        assert_eq!(e.into_harness().code.http_status(), 507);
        let e = BusError::from(harness_store::StoreError::Closed);
        assert_eq!(e.code, BusCode::Harness(ErrorCode::State));
    }

    #[test]
    fn a_call_the_engine_could_not_hand_to_a_dying_worker_is_retried() {
        assert!(BusError::new("channel_send_failed", "channel closed").is_transient_dependency());
        assert!(!BusError::new("router/x", "no").is_transient_dependency());
        assert!(!BusError::new("harness/invalid_request", "no").is_transient_dependency());
    }
}
