//! The errors of `context::*`, each with the bus code it travels under.

use harness_bus::BusError;
use harness_types::context::OVERFLOW_PREFIX;

#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// Even the compacted history does not fit the budget.
    #[error("{OVERFLOW_PREFIX} {0}")]
    Overflow(String),
    /// The summary could not be written (the router failed, the model answered nothing).
    #[error("context/summarizer: {0}")]
    Summarizer(String),
}

impl ContextError {
    pub fn code(&self) -> &'static str {
        match self {
            ContextError::Overflow(_) => "context/overflow",
            ContextError::Summarizer(_) => "context/summarizer",
        }
    }
}

impl From<ContextError> for BusError {
    fn from(e: ContextError) -> Self {
        BusError::new(e.code(), e.to_string())
    }
}
