//! Requests and responses of the transcript store (`session::*`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::message::{AgentMessage, ContentBlock, StopReason, Usage};

/// Coarse session status, a projection of the turn status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SessionStatus {
    Idle,
    Working,
    Done,
    Error,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionMeta {
    pub session_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    #[serde(default)]
    pub metadata: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub status: SessionStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_reason: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
    /// `session::list` only: the first 80 characters of the first user message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<String>,
    /// `session::list` only: model and provider of the latest assistant message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// `session::list` only: the spawning session of a sub-agent (from its metadata).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    /// `session::list` only: the summed `usage.cost_usd` of the session and its sub-agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
pub struct CreateRequest {
    /// Use this id instead of minting one (fails if it exists).
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct CreateResponse {
    pub session_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct EnsureRequest {
    pub session_id: String,
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct EnsureResponse {
    pub meta: SessionMeta,
    pub created: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SessionRef {
    pub session_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct GetResponse {
    pub meta: SessionMeta,
}

/// A model-invisible record entry (`error`, `notice`, `recovery`, ...).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CustomEntry {
    pub custom_type: String,
    #[serde(default)]
    pub data: Value,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AppendRequest {
    pub session_id: String,
    /// Exactly one of `message` and `custom`.
    #[serde(default)]
    pub message: Option<AgentMessage>,
    #[serde(default)]
    pub custom: Option<CustomEntry>,
    /// Idempotency: appending an existing id is a no-op that returns the original entry.
    #[serde(default)]
    pub entry_id: Option<String>,
    #[serde(default)]
    pub origin: Option<Value>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AppendResponse {
    pub entry_id: String,
    pub seq: i64,
    /// False when the entry id already existed (nothing written).
    pub appended: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct UpdateMessageRequest {
    pub session_id: String,
    pub entry_id: String,
    /// Wholesale replacement of the message content.
    pub content: Vec<ContentBlock>,
    #[serde(default)]
    pub usage: Option<Usage>,
    #[serde(default)]
    pub stop_reason: Option<StopReason>,
    /// Extra assistant fields to set (`error_kind`, `error_message`, `native_stop_reason`).
    #[serde(default)]
    pub details: Option<Value>,
    #[serde(default)]
    pub origin: Option<Value>,
    #[serde(default)]
    pub expected_revision: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct UpdateMessageResponse {
    pub updated: bool,
    pub revision: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct MessagesRequest {
    pub session_id: String,
    #[serde(default)]
    pub include_custom: bool,
    /// Page size, 1..=500 (default 500).
    #[serde(default)]
    pub limit: Option<u32>,
    /// Opaque cursor from a previous page.
    #[serde(default)]
    pub cursor: Option<String>,
    /// Only entries after this one.
    #[serde(default)]
    pub after_entry_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct Entry {
    pub entry_id: String,
    pub seq: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<AgentMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom: Option<CustomEntry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Value>,
    pub revision: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct MessagesResponse {
    pub messages: Vec<Entry>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// `session::changes`: the entries appended or updated after a change mark, oldest change first.
/// A reader that keeps the transcript in memory asks only for what changed since it last looked,
/// so its cost follows the new entries, not the session's length.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChangesRequest {
    pub session_id: String,
    /// The `mark` of a previous answer; absent = from the beginning (every entry).
    #[serde(default)]
    pub after: Option<i64>,
    /// Page size, 1..=500 (default 500).
    #[serde(default)]
    pub limit: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ChangesResponse {
    /// Each entry as it is now, in the order of its latest change (not `seq` order). An entry
    /// updated twice since `after` appears once.
    pub entries: Vec<Entry>,
    /// Pass as `after` next time: every change up to it is in this answer or an earlier one.
    /// Marks only grow, and are never reused (not even across sessions).
    pub mark: i64,
    /// More changes than `limit`: ask again from `mark`.
    #[serde(default)]
    pub more: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SetStatusRequest {
    pub session_id: String,
    pub status: SessionStatus,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SetStatusResponse {
    /// False when the status and reason were already these (no event fired).
    pub changed: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
pub struct ListRequest {
    #[serde(default)]
    pub limit: Option<u32>,
    #[serde(default)]
    pub cursor: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ListResponse {
    pub sessions: Vec<SessionMeta>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// `session::delete`: removes a session and its whole transcript.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteRequest {
    pub session_id: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct DeleteResponse {
    /// False when there was no such session (a repeated delete).
    pub deleted: bool,
}
