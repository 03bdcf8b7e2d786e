//! The errors of `context::*`, each with the bus code it travels under.

use harness_bus::BusError;
use harness_types::context::OVERFLOW_PREFIX;
// The wording a loop reads back lives with the `context::*` contract.
pub use harness_types::context::{too_large_index, MESSAGE_TOO_LARGE_PREFIX};

#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// Even the compacted history does not fit the budget.
    #[error("{OVERFLOW_PREFIX} {0}")]
    Overflow(String),
    /// The summary could not be written (the router failed, the model answered nothing).
    #[error("context/summarizer: {0}")]
    Summarizer(String),
    /// One message alone cannot fit the window, whatever is summarized around it.
    #[error("{MESSAGE_TOO_LARGE_PREFIX} message {index} of the request needs ~{tokens} tokens but model '{model}' has a {window}-token window ({usable} usable with the system prompt, tools and output reserved); it is left out of later requests: send it shorter or in parts")]
    MessageTooLarge {
        /// Its index in the request's messages.
        index: usize,
        tokens: u64,
        model: String,
        window: u64,
        usable: u64,
    },
}

impl ContextError {
    pub fn code(&self) -> &'static str {
        match self {
            ContextError::Overflow(_) => "context/overflow",
            ContextError::Summarizer(_) => "context/summarizer",
            ContextError::MessageTooLarge { .. } => "context/message_too_large",
        }
    }
}

impl From<ContextError> for BusError {
    fn from(e: ContextError) -> Self {
        BusError::new(e.code(), e.to_string())
    }
}
