//! The stable `harness/<code>: <message>` errors.
//!
//! Consumers match on the code prefix, so codes never change once shipped. Messages name the
//! offending field and, where it helps, its value.

use std::fmt;

/// A stable error code. `as_str` gives the wire form `harness/<code>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    InvalidRequest,
    InvalidMessageRole,
    NotFound,
    FunctionNotFound,
    SpawnDepthExceeded,
    SpawnFanoutExceeded,
    Dependency,
    ContextOverflow,
    State,
    Timeout,
    Internal,
    /// The session id names a deleted session (its tombstone): ids are never reused.
    SessionDeleted,
    /// The store's disk (or quota) is full: the write was not kept. Reads still work, and
    /// writes succeed again by themselves once space returns.
    StorageFull,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 13] = [
        ErrorCode::InvalidRequest,
        ErrorCode::InvalidMessageRole,
        ErrorCode::NotFound,
        ErrorCode::FunctionNotFound,
        ErrorCode::SpawnDepthExceeded,
        ErrorCode::SpawnFanoutExceeded,
        ErrorCode::Dependency,
        ErrorCode::ContextOverflow,
        ErrorCode::State,
        ErrorCode::Timeout,
        ErrorCode::Internal,
        ErrorCode::SessionDeleted,
        ErrorCode::StorageFull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "harness/invalid_request",
            ErrorCode::InvalidMessageRole => "harness/invalid_message_role",
            ErrorCode::NotFound => "harness/not_found",
            ErrorCode::FunctionNotFound => "harness/function_not_found",
            ErrorCode::SpawnDepthExceeded => "harness/spawn_depth_exceeded",
            ErrorCode::SpawnFanoutExceeded => "harness/spawn_fanout_exceeded",
            ErrorCode::Dependency => "harness/dependency",
            ErrorCode::ContextOverflow => "harness/context_overflow",
            ErrorCode::State => "harness/state",
            ErrorCode::Timeout => "harness/timeout",
            ErrorCode::Internal => "harness/internal",
            ErrorCode::SessionDeleted => "harness/session_deleted",
            ErrorCode::StorageFull => "harness/storage_full",
        }
    }

    pub fn parse(code: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == code)
    }

    /// The HTTP status an error with this code maps to on the HTTP API.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidRequest
            | ErrorCode::InvalidMessageRole
            | ErrorCode::SpawnDepthExceeded
            | ErrorCode::SpawnFanoutExceeded
            | ErrorCode::ContextOverflow => 400,
            ErrorCode::NotFound | ErrorCode::FunctionNotFound => 404,
            ErrorCode::Timeout => 504,
            ErrorCode::Dependency => 503,
            // Gone for good: the caller must pick another id, retrying cannot help.
            ErrorCode::SessionDeleted => 410,
            // 507 Insufficient Storage: the server, not the request, is at fault, and the same
            // request succeeds later.
            ErrorCode::StorageFull => 507,
            ErrorCode::State | ErrorCode::Internal => 500,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error that crosses the bus: a stable code and a message naming the offending input.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct HarnessError {
    pub code: ErrorCode,
    pub message: String,
}

impl HarnessError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        HarnessError {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::InvalidRequest, message)
    }

    /// `harness/invalid_request: <field>: <why>`.
    pub fn invalid_field(field: &str, why: impl fmt::Display) -> Self {
        Self::new(ErrorCode::InvalidRequest, format!("{field}: {why}"))
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::NotFound, message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Internal, message)
    }

    pub fn state(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::State, message)
    }

    pub fn dependency(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Dependency, message)
    }

    /// Parses the wire form `"harness/<code>: <message>"`; an unknown prefix becomes `internal`
    /// with the whole text as message, so nothing is lost.
    pub fn from_wire(text: &str) -> Self {
        if let Some((code, message)) = text.split_once(": ") {
            if let Some(code) = ErrorCode::parse(code) {
                return HarnessError::new(code, message);
            }
        }
        HarnessError::internal(text)
    }
}

/// An error and its causes, `: `-separated: what a user reads of a failed request (reqwest keeps
/// the OS's words, "Connection refused", two sources down).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with an optional cause, to build a chain of any length.
    #[derive(Debug)]
    struct Link(&'static str, Option<Box<Link>>);

    impl fmt::Display for Link {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Link {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|l| l as &(dyn std::error::Error + 'static))
        }
    }

    #[test]
    fn an_error_chain_names_every_cause_in_order() {
        let refused = Link("Connection refused", None);
        assert_eq!(error_chain(&refused), "Connection refused");
        let chain = Link(
            "error sending request",
            Some(Box::new(Link(
                "client error (Connect)",
                Some(Box::new(refused)),
            ))),
        );
        assert_eq!(
            error_chain(&chain),
            "error sending request: client error (Connect): Connection refused"
        );
    }

    #[test]
    fn wire_form_round_trips_for_every_code() {
        for code in ErrorCode::ALL {
            let e = HarnessError::new(code, "session_id: unknown session 's1'");
            assert_eq!(HarnessError::from_wire(&e.to_string()), e);
        }
    }

    #[test]
    fn unknown_prefix_keeps_the_whole_text() {
        let e = HarnessError::from_wire("router/provider_unavailable: down");
        assert_eq!(e.code, ErrorCode::Internal);
        assert_eq!(e.message, "router/provider_unavailable: down");
    }
}
