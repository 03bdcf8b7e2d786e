//! The crate's one error type.

use harness_bus::BusError;
use harness_types::{ErrorCode, HarnessError};

/// What can go wrong in the approval gate. Bad input names the offending field; a failing
/// dependency (state, `harness::function::resolve`) keeps its own code.
#[derive(Debug, thiserror::Error)]
pub enum ApprovalError {
    /// `harness/invalid_request: <field>: <why>`.
    #[error("harness/invalid_request: {field}: {why}")]
    Invalid { field: String, why: String },
    /// A payload that did not parse (the message names the field).
    #[error("{0}")]
    Request(#[from] HarnessError),
    /// A call through the bus failed.
    #[error("{0}")]
    Bus(#[from] BusError),
}

impl ApprovalError {
    pub fn invalid(field: impl Into<String>, why: impl Into<String>) -> Self {
        ApprovalError::Invalid {
            field: field.into(),
            why: why.into(),
        }
    }
}

impl From<ApprovalError> for BusError {
    fn from(e: ApprovalError) -> BusError {
        match e {
            ApprovalError::Invalid { field, why } => BusError::new(
                ErrorCode::InvalidRequest.as_str(),
                format!("{field}: {why}"),
            ),
            ApprovalError::Request(e) => e.into(),
            ApprovalError::Bus(e) => e,
        }
    }
}
