//! What can go wrong reading the directory, each naming the file and field at fault.

use harness_types::{ErrorCode, HarnessError};

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DirectoryError {
    /// A file the directory holds is malformed: `agents/a.md: model: invalid type …`.
    #[error("{file}: {field}: {message}")]
    BadFile {
        file: String,
        field: String,
        message: String,
    },
    /// An entry that does not exist.
    #[error("{kind} '{name}' is not in the directory")]
    NotFound { kind: &'static str, name: String },
    /// An `extends` chain that comes back to a profile it already passed.
    #[error("agents/{name}.md: extends: cycle {chain}")]
    Cycle { name: String, chain: String },
    /// A name that is not a plain file stem (a path, `..`, empty).
    #[error("name: '{0}' is not an entry name (letters, digits, '.', '_' and '-', not starting with '.')")]
    BadName(String),
    #[error("{file}: cannot be read: {message}")]
    Io { file: String, message: String },
    /// A write request's own field is wrong (not the file it would write).
    #[error("{field}: {message}")]
    Invalid { field: String, message: String },
}

impl DirectoryError {
    /// `file` (relative to the directory) is malformed at `field`.
    pub fn bad_file(file: &str, field: &str, message: impl Into<String>) -> Self {
        DirectoryError::BadFile {
            file: file.to_string(),
            field: field.to_string(),
            message: message.into(),
        }
    }
}

impl From<DirectoryError> for HarnessError {
    fn from(e: DirectoryError) -> Self {
        let code = match &e {
            DirectoryError::NotFound { .. } => ErrorCode::NotFound,
            DirectoryError::Io { .. } => ErrorCode::Dependency,
            _ => ErrorCode::InvalidRequest,
        };
        HarnessError::new(code, e.to_string())
    }
}
