//! The errors of the built-in functions, each with a stable `tools/<code>` (bad arguments keep
//! the loop's `harness/invalid_request`).

use harness_bus::{BusCode, BusError};
use harness_types::HarnessError;

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    /// Arguments that do not parse, named by field.
    #[error("{0}")]
    Invalid(HarnessError),
    /// The turn has no filesystem root, so no fs/shell call can run.
    #[error("this turn has no filesystem root: send `options.filesystem_root` or set `default_filesystem_root` in the configuration")]
    NoRoot,
    /// A path that leaves the root (`..`, a symlink, an absolute path elsewhere).
    #[error("{field}: '{path}' is outside the filesystem root")]
    OutsideRoot { field: &'static str, path: String },
    /// The harness's own data directory or configuration.
    #[error("{field}: '{path}' belongs to the harness (its data directory or configuration) and is never reachable")]
    Protected { field: &'static str, path: String },
    #[error("{field}: '{path}' does not exist")]
    NotFound { field: &'static str, path: String },
    #[error("{field}: '{path}': {why}")]
    Io {
        field: &'static str,
        path: String,
        why: String,
    },
    /// `fs::edit`: `old` is absent, or present more than once without `replace_all`.
    #[error("{0}")]
    Match(String),
    #[error("{0}")]
    Timeout(String),
    /// `web::fetch`: an address a model may not reach.
    #[error("{0}")]
    AddressRefused(String),
    #[error("{0}")]
    Fetch(String),
    /// `shell::exec` on a kernel that cannot confine it, and the operator has not accepted
    /// running unconfined.
    #[error("shell::exec refused: the kernel cannot confine commands ({0}); set shell_exec_unconfined: true in the configuration to run them unconfined")]
    SandboxUnavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl ToolError {
    pub fn code(&self) -> &'static str {
        match self {
            ToolError::Invalid(_) => "harness/invalid_request",
            ToolError::NoRoot => "tools/no_filesystem_root",
            ToolError::OutsideRoot { .. } => "tools/outside_root",
            ToolError::Protected { .. } => "tools/protected_path",
            ToolError::NotFound { .. } => "tools/not_found",
            ToolError::Io { .. } => "tools/io",
            ToolError::Match(_) => "tools/no_unique_match",
            ToolError::Timeout(_) => "tools/timeout",
            ToolError::AddressRefused(_) => "tools/address_refused",
            ToolError::Fetch(_) => "tools/fetch_failed",
            ToolError::SandboxUnavailable(_) => "harness/sandbox_unavailable",
            ToolError::Internal(_) => "tools/internal",
        }
    }

    pub fn invalid(field: &str, why: impl std::fmt::Display) -> ToolError {
        ToolError::Invalid(HarnessError::invalid_field(field, why.to_string()))
    }
}

impl From<HarnessError> for ToolError {
    fn from(e: HarnessError) -> Self {
        ToolError::Invalid(e)
    }
}

impl From<ToolError> for BusError {
    fn from(e: ToolError) -> Self {
        match e {
            ToolError::Invalid(h) => h.into(),
            other => BusError::new(BusCode::Other(other.code().to_string()), other.to_string()),
        }
    }
}

pub type Result<T> = std::result::Result<T, ToolError>;
