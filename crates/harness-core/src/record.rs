//! The durable turn record: one per session, in state scope `harness_turn`.
//!
//! Unknown or absent optional fields deserialize with defaults, so records written by an older
//! version are read back.

use std::collections::BTreeMap;

use harness_types::api::{FunctionPolicy, OutputContract, ParentLink, ThinkingLevel, TurnStatus};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Options frozen when the turn is created; a merged send never changes them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TurnOptions {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// The resolved system prompt (None = no prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    pub max_turns: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking_level: Option<ThinkingLevel>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_options: Option<Value>,
    #[serde(default)]
    pub output: OutputContract,
    /// None = deny every call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions: Option<FunctionPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub max_transient_resumes: u32,
    /// `"lowest"`: the least reasoning the model allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallState {
    /// Checkpointed before the target runs; never run again once seen after a restart.
    #[serde(alias = "dispatched")]
    Triggered,
    /// Parked: waiting for a hook release or a delivered result.
    Pending,
    Done,
}

/// The per-call checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallCheckpoint {
    pub state: CallState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entry_id: Option<String>,
    /// The hook that holds this pending call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
    /// `pre_trigger` or `post_trigger`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_point: Option<String>,
    /// The arguments as mutated up to and including the holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_arguments: Option<Value>,
    /// A post-trigger hold keeps the target's result: a release appends it, never re-runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_at: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_timeout_ms: Option<u64>,
    /// Repairs made before the hold (they go into the result's origin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconciled: Option<Value>,
    /// Hook annotations gathered before the hold.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<Value>,
    /// The breaker key of the call as the model wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker_key: Option<String>,
    /// A `harness::spawn` call's child.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_session_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub child_turn_id: Option<String>,
}

impl CallCheckpoint {
    pub fn new(state: CallState, function_id: &str) -> CallCheckpoint {
        CallCheckpoint {
            state,
            function_id: Some(function_id.to_string()),
            entry_id: None,
            held_by: None,
            held_point: None,
            held_arguments: None,
            held_result: None,
            pending_at: None,
            pending_timeout_ms: None,
            reconciled: None,
            annotations: None,
            breaker_key: None,
            child_session_id: None,
            child_turn_id: None,
        }
    }
}

/// A provider failure of one generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationError {
    pub code: String,
    pub kind: harness_types::message::ErrorKind,
    pub message: String,
}

/// Marks that step `step` finished generating, so a redelivered step resumes at its calls
/// instead of asking the model again (a second answer could call different functions).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GeneratedStep {
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<GenerationError>,
}

/// The breaker ledger entry of one call key in this turn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FailedCall {
    /// Digest of the target's error output.
    pub error: String,
    pub count: u32,
}

/// Why a turn failed: what the error record and `turn-completed` carry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// `harness.<reason>` or the router's code.
    pub code: String,
    pub phase: String,
    /// One public sentence.
    pub summary: String,
    /// The raw diagnostic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default)]
    pub retryable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    pub turn_id: String,
    pub session_id: String,
    pub status: TurnStatus,
    pub step: u64,
    #[serde(default)]
    pub turn_count: u32,
    #[serde(default)]
    pub depth: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_preview: Option<String>,
    #[serde(default)]
    pub abort: bool,
    /// Last entry seen when the latest generation's context was built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watermark_entry_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_request_id: Option<String>,
    pub options: TurnOptions,
    #[serde(default)]
    pub calls: BTreeMap<String, CallCheckpoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentLink>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
    #[serde(default)]
    pub transient_resumes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generated: Option<GeneratedStep>,
    /// The function-registry generation this turn last saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions_generation: Option<u64>,
    /// Repeated-failure breaker ledger, reset on each new turn.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failed_calls: BTreeMap<String, FailedCall>,
    /// Repairs already noted this turn (the same repair is noted once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub noted_repairs: Vec<String>,
    #[serde(default)]
    pub created_at: i64,
    #[serde(default)]
    pub updated_at: i64,
}

impl TurnRecord {
    pub fn is_terminal(&self) -> bool {
        self.status.is_terminal()
    }

    pub fn has_pending(&self) -> bool {
        self.calls.values().any(|c| c.state == CallState::Pending)
    }

    /// Ids of calls still `triggered` or `pending`.
    pub fn open_calls(&self) -> Vec<String> {
        self.calls
            .iter()
            .filter(|(_, c)| c.state != CallState::Done)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// First 30 characters of the triggering user text, whitespace collapsed.
pub fn message_preview(text: &str) -> Option<String> {
    let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if collapsed.is_empty() {
        None
    } else {
        Some(collapsed.chars().take(30).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_old_record_still_reads() {
        let rec: TurnRecord = serde_json::from_value(serde_json::json!({
            "turn_id": "t_1", "session_id": "s", "status": "running", "step": 2,
            "options": {"model": "m", "max_turns": 4},
            "calls": {"c1": {"state": "dispatched"}}
        }))
        .unwrap();
        assert_eq!(rec.calls["c1"].state, CallState::Triggered);
        assert_eq!(rec.open_calls(), vec!["c1".to_string()]);
    }

    #[test]
    fn preview_collapses_whitespace_and_cuts_at_30_chars() {
        assert_eq!(
            message_preview("  hello\n\n world  ").as_deref(),
            Some("hello world")
        );
        assert_eq!(
            message_preview(&"é".repeat(40)).unwrap().chars().count(),
            30
        );
        assert_eq!(message_preview("   "), None);
    }
}
