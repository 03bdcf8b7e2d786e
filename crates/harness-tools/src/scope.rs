//! The filesystem scope the loop stamps onto every `fs::*` and `shell::*` call.
//!
//! The loop removes whatever `fs_scope` a model wrote and puts the turn's own there (before and
//! after the pre-trigger hooks), so the value a function reads here is the operator's, never the
//! model's. A call without one ran in a turn without a root: it is refused.

use std::path::PathBuf;

use harness_types::parse::parse_payload;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{Result, ToolError};

/// The argument the loop stamps.
pub const FIELD: &str = "fs_scope";

/// Where the root came from: the send/spawn that named it, or the configured default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Boundary {
    Workspace,
    ConfiguredRoots,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsScope {
    /// Absolute path of the root.
    pub root: PathBuf,
    /// Extra directories granted to the session (`harness::filesystem::grant`): absolute paths
    /// under them resolve there, each confined like the root.
    #[serde(default)]
    pub grants: Vec<PathBuf>,
    pub boundary: Boundary,
}

/// Splits a call's payload into its stamped scope and the function's own arguments (parsed
/// strictly: an unknown field is refused by name).
pub fn split<T: DeserializeOwned>(mut payload: Value) -> Result<(Option<FsScope>, T)> {
    let scope = match payload.as_object_mut().and_then(|m| m.remove(FIELD)) {
        None | Some(Value::Null) => None,
        Some(v) => {
            Some(serde_json::from_value::<FsScope>(v).map_err(|e| ToolError::invalid(FIELD, e))?)
        }
    };
    let args = parse_payload(payload)?;
    Ok((scope, args))
}
