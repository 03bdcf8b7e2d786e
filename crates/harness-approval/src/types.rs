//! Wire shapes of the `approval::*` functions and the durable record.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where an approval stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ApprovalStatus {
    /// Waiting for a decision; the call is held.
    Pending,
    /// Approved: the call was released to run.
    Approved,
    /// Denied: the call was closed with a denial the model sees.
    Denied,
    /// The turn ended (stopped, failed, superseded) before anyone decided.
    Expired,
}

impl ApprovalStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalStatus::Pending => "pending",
            ApprovalStatus::Approved => "approved",
            ApprovalStatus::Denied => "denied",
            ApprovalStatus::Expired => "expired",
        }
    }
}

/// One approval, as stored (state scope [`crate::SCOPE`], key `approval_id`) and listed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ApprovalRecord {
    pub approval_id: String,
    pub session_id: String,
    pub turn_id: String,
    pub function_call_id: String,
    pub function_id: String,
    /// The arguments exactly as the gate was shown them (what runs on approval).
    pub arguments: Value,
    /// `sha256:<hex>` of the canonical `{arguments, function_id}`; a decision must quote it.
    pub digest: String,
    /// Unix ms.
    pub created_at: i64,
    pub status: ApprovalStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decided_at: Option<i64>,
    /// The approver's reason (deny), or why it expired.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What `harness::function::resolve` answered for the decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<bool>,
}

/// The `harness::hook::pre-trigger` input the gate reads (other envelope fields are ignored).
#[derive(Clone, Debug, Deserialize, JsonSchema)]
pub struct GateInput {
    pub session_id: String,
    /// Empty for `harness::function::trigger` calls made outside a turn.
    #[serde(default)]
    pub turn_id: String,
    pub call: GateCall,
}

#[derive(Clone, Debug, Deserialize, JsonSchema)]
pub struct GateCall {
    pub id: String,
    pub function_id: String,
    #[serde(default)]
    pub arguments: Value,
}

/// The gate's hook answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct GateAnswer {
    /// `hold` (waiting for a decision), `continue` (already approved), `deny`.
    pub decision: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Merged into the origin of the call's result entry: `{approval_id}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<Value>,
}

/// `approval::list`.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListRequest {
    /// Only this session's approvals.
    #[serde(default)]
    pub session_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ListResponse {
    /// Pending approvals of live turns, oldest first.
    pub approvals: Vec<ApprovalRecord>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Decision {
    Approve,
    Deny,
}

/// `approval::decide`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DecideRequest {
    pub approval_id: String,
    pub decision: Decision,
    /// The `digest` of the approval as it was shown; a different one is refused.
    pub digest: String,
    /// Shown to the model with a denial; kept on the record either way.
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DecideResponse {
    pub decided: bool,
    pub approval_id: String,
    /// `approved` or `denied`.
    pub status: ApprovalStatus,
    /// From `harness::function::resolve`: false when the call was already settled.
    pub resolved: bool,
    /// From `harness::function::resolve`: true when the parked turn runs again.
    pub turn_resumed: bool,
}

/// `approval::prune`: forget decided (or expired) approvals decided before a cutoff.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PruneRequest {
    /// Approvals decided at least this long ago (ms) go; pending ones always stay.
    pub older_than_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PruneResponse {
    pub pruned: usize,
}
