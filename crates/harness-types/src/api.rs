//! Requests and responses of the `harness::*` functions, plus the turn events.
//!
//! Shapes stay a compatible superset of the v1.0.6 API reference: fields may be added (optional),
//! never removed or renamed.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::message::AgentMessage;

/// `message` is either a plain string (a user text message) or a full `AgentMessage`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum MessageInput {
    Text(String),
    Message(Box<AgentMessage>),
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SendRequest {
    /// Omit to create a new session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// The incoming message; a string is sugar for a user text message. The role must be `user` or
    /// `custom`. Kept raw here so the role check can name the field before the shape is parsed.
    #[schemars(with = "MessageInput")]
    pub message: Value,
    /// Required when the send creates a session or the session has no prior turn; otherwise
    /// inherited from the previous turn.
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub provider: Option<String>,
    /// Webhook dedupe: a repeated key returns the original `{session_id, turn_id}` and appends
    /// nothing.
    #[serde(default)]
    pub idempotency_key: Option<String>,
    /// Applied when this send creates/ensures the session.
    #[serde(default)]
    pub session: Option<SessionInit>,
    #[serde(default)]
    pub options: Option<SendOptions>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionInit {
    #[serde(default)]
    pub title: Option<String>,
    #[serde(default)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub kind: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SystemPromptStrategy {
    /// Caller prompt is appended to the built-in identity prompt.
    #[default]
    Enrich,
    /// Caller prompt replaces the built-in prompt verbatim.
    Override,
    /// No system prompt at all.
    Disabled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ThinkingLevel {
    Minimal,
    Low,
    Medium,
    High,
    Xhigh,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    Plan,
    Ask,
    Agent,
}

/// How allowed functions reach the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ExposeMode {
    #[default]
    AgentTrigger,
    Native,
}

/// The fail-closed dispatch policy. Absent on the send => every call denied (a plain chat loop).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct FunctionPolicy {
    #[serde(default)]
    pub allow: Vec<String>,
    #[serde(default)]
    pub deny: Vec<String>,
    #[serde(default)]
    pub expose: ExposeMode,
}

/// Free text by default; `json` constrains the final answer to a JSON value.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputContract {
    #[default]
    Text,
    Json {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        schema: Option<Value>,
    },
}

/// Per-send options frozen onto the turn record.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SendOptions {
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub system_prompt_strategy: Option<SystemPromptStrategy>,
    #[serde(default)]
    pub max_turns: Option<u32>,
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    #[serde(default)]
    pub thinking_level: Option<ThinkingLevel>,
    /// Provider-namespaced options; `{}` resets them.
    #[serde(default)]
    pub provider_options: Option<Value>,
    #[serde(default)]
    pub output: Option<OutputContract>,
    /// Nudges an invalid result gets before the turn fails (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_validation_retries: Option<u32>,
    /// The fail-closed dispatch policy; omit to deny every call.
    #[serde(default)]
    pub functions: Option<FunctionPolicy>,
    /// Tracing passthrough.
    #[serde(default)]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub mode: Option<Mode>,
    /// `"lowest"`: the least reasoning the model allows.
    #[serde(default)]
    pub reasoning: Option<String>,
    /// A directory agent profile (`agents/<name>.md`) as the session's whole identity; only on
    /// a session-creating send, never with `system_prompt` / `system_prompt_strategy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// Exact skill names the session's skills index lists; empty = all. Sticky; refused while
    /// the session's turn is active.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skills: Option<Vec<String>>,
    /// This turn's token budget, shared with its sub-agents (input + output, every generation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_total_tokens: Option<u64>,
    /// This turn's spend limit in USD, shared with its sub-agents, priced from the catalog.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
    /// The directory the turn's `fs::*` and `shell::*` calls work in (absolute, existing).
    /// Sticky: later turns of the session keep it until a send names another.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem_root: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SendResponse {
    pub session_id: String,
    pub turn_id: String,
    pub accepted: bool,
    /// True when folded into an in-flight turn (steering).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub merged: Option<bool>,
    /// True when parked in the mid-turn queue until the next step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<bool>,
    /// True when `idempotency_key` matched an earlier send.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deduplicated: Option<bool>,
    /// What `options.reasoning: "lowest"` chose for the model (present when the send named it
    /// and started a turn).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<AppliedReasoning>,
}

/// The effort `reasoning: "lowest"` applies: the model's least effort other than `none`, else
/// `minimal` for a model that only says it thinks, else none at all (the provider decides).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct AppliedReasoning {
    pub thinking_level: Option<ThinkingLevel>,
    /// The provider-native effort name.
    pub reasoning_effort: Option<String>,
}

/// The coarse turn lifecycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    Running,
    AwaitingFunctions,
    Completed,
    Cancelled,
    Failed,
}

impl TurnStatus {
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            TurnStatus::Completed | TurnStatus::Cancelled | TurnStatus::Failed
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::Running => "running",
            TurnStatus::AwaitingFunctions => "awaiting_functions",
            TurnStatus::Completed => "completed",
            TurnStatus::Cancelled => "cancelled",
            TurnStatus::Failed => "failed",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct StatusRequest {
    pub session_id: String,
    /// The full result and the loop's counters; the default (lean) answer truncates a result
    /// whose compact JSON is over 600 characters.
    #[serde(default)]
    pub verbose: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ChildRef {
    pub function_call_id: String,
    pub session_id: String,
    pub turn_id: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StatusReport {
    pub session_id: String,
    pub turn_id: Option<String>,
    pub status: TurnStatus,
    pub step: u64,
    pub turn_count: u32,
    pub max_turns: u32,
    pub depth: u32,
    pub pending_function_calls: Vec<String>,
    pub children: Vec<ChildRef>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    pub result_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    #[serde(default)]
    pub transient_resumes: u32,
    #[serde(default)]
    pub queued: u32,
    /// Why a failed turn failed (absent unless `status` is `failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<TurnFailure>,
    /// True while the session owns an armed one-shot wake (this version arms none).
    #[serde(default)]
    pub expects_wake: bool,
    /// What the latest step sent as the prompt's cacheable surface.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<PromptSurface>,
    /// `verbose` only: nudges used on an invalid result and the limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_retries: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_validation_retries: Option<u32>,
    /// `verbose` only: the transient-failure resumes a turn may use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_transient_resumes: Option<u32>,
}

/// The prompt's cacheable surface as a step sent it: its digest, or why no sections went out.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PromptSurface {
    /// `sha256:<hex>` of the stable prefix sent as `system_sections[0]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_surface_digest: Option<String>,
    /// `disabled` (`prompt_cache_sections: false`), `no_stable_prefix`, or `prefix_rewritten`
    /// (a pre-generate hook replaced the head of the prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_sections_fallback: Option<String>,
}

/// The cause of a failed turn, as `harness chat` shows it: the stable code, where in the turn,
/// and for a provider failure what the provider answered and what a person can do about it.
/// Credentials never appear in any field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TurnFailure {
    /// `router/<code>` (e.g. `router/not_found`) for a provider failure, `harness.<reason>` for
    /// the loop's own.
    pub code: String,
    /// Where the turn failed: `generation`, `context_assembly`, `output_validation`, ...
    pub phase: String,
    /// The provider failure's class (`permanent`, `transient`, `auth_expired`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<crate::message::ErrorKind>,
    #[serde(default)]
    pub retryable: bool,
    /// The HTTP status the provider answered with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_status: Option<u16>,
    /// The provider's own words (its error message or body), bounded and redacted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_message: Option<String>,
    /// The whole diagnostic (status, error type, words, request id), redacted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// What to do about it, where that is known: a base URL missing `/v1`, nothing listening
    /// at the base URL, a model the server does not serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct StopRequest {
    pub session_id: String,
    /// Omit to stop the current turn.
    #[serde(default)]
    pub turn_id: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct StopResponse {
    pub stopping: bool,
}

/// The enqueued `harness::turn` step payload.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TurnStepPayload {
    pub session_id: String,
    pub turn_id: String,
    pub step: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_preview: Option<String>,
    #[serde(default)]
    pub depth: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TurnStepResult {
    pub session_id: String,
    pub status: TurnStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_step: Option<u64>,
    /// True when a redelivered/stale step was acked and dropped.
    #[serde(default)]
    pub skipped: bool,
}

/// Parent link of a child turn.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ParentLink {
    pub session_id: String,
    pub turn_id: String,
    pub function_call_id: String,
}

/// `harness::turn-started`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TurnStartedEvent {
    pub session_id: String,
    pub turn_id: String,
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentLink>,
    pub depth: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_preview: Option<String>,
    /// A sub-agent's `display`, as its spawn named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<crate::directory::Display>,
    /// The display-only parent a spawn called directly named (never with `parent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
}

/// `harness::turn-completed`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TurnCompletedEvent {
    pub session_id: String,
    pub turn_id: String,
    pub status: TurnStatus,
    pub terminal: bool,
    pub timestamp: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<ParentLink>,
    /// Why a failed turn failed (absent unless `status` is `failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure: Option<TurnFailure>,
    /// A sub-agent's `display`, as its spawn named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<crate::directory::Display>,
    /// The context snapshot at the end of the turn: the prompt surface its last step sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context: Option<PromptSurface>,
    /// The display-only parent a spawn called directly named (never with `parent`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
}

/// Binding config shared by both turn-event types.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TurnEventFilter {
    /// Only events of this session.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Only events of children of this session.
    #[serde(default)]
    pub parent_session_id: Option<String>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ResolveAction {
    /// Supply the call's result.
    #[default]
    Deliver,
    /// Release a hook-held call through the rest of the trigger pipeline.
    Execute,
}

/// Internal: settle a pending call's result (or release a held call) and resume the parked turn.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct ResolveRequest {
    pub session_id: String,
    pub turn_id: String,
    pub function_call_id: String,
    /// `deliver` (default) supplies the result; `execute` releases a hook-held call through the
    /// remaining trigger pipeline.
    #[serde(default)]
    pub action: Option<ResolveAction>,
    #[serde(default)]
    pub content: Option<Vec<crate::message::ContentBlock>>,
    #[serde(default)]
    pub is_error: Option<bool>,
    #[serde(default)]
    pub details: Option<Value>,
    /// `execute` only: extra filesystem roots (absolute, existing directories) the released
    /// call may reach, for this call alone, next to the session's own grants.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fs_scope: Option<ReleaseFsScope>,
}

/// One-shot filesystem grants of a released call.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseFsScope {
    #[serde(default)]
    pub grants: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct ResolveResponse {
    /// False when the call is unknown, already done, or (execute) not held.
    pub resolved: bool,
    /// True when this resolve re-enqueued the turn.
    pub turn_resumed: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct TriggerCall {
    pub id: String,
    pub function_id: String,
    #[serde(default)]
    pub arguments: Value,
}

/// Internal: run the dispatch pipeline for one already-unwrapped call.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct FunctionTriggerRequest {
    pub session_id: String,
    pub call: TriggerCall,
}

/// The answer of `harness::function::trigger`: the call's result, or (a hook holds it) a
/// pending answer, as the v1.0.6 reference's `anyOf` pair.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum FunctionTriggerResponse {
    Result(TriggerResultResponse),
    Pending(TriggerPendingResponse),
}

/// The call ran (or was refused before it could): its result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TriggerResultResponse {
    pub function_call_id: String,
    pub function_id: String,
    pub content: Vec<crate::message::ContentBlock>,
    pub is_error: bool,
    pub details: Value,
    pub duration_ms: u64,
}

/// A pre-trigger hook holds the call; `harness::function::resolve` settles it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TriggerPendingResponse {
    pub function_call_id: String,
    pub function_id: String,
    /// Always true.
    pub pending: bool,
    /// How long the hold may last before the sweep settles it; null: a hook hold never expires.
    pub pending_timeout_ms: Option<u64>,
    /// The hook function that holds it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_by: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
pub struct SweepRequest {
    /// Ignored (cron passthrough).
    #[serde(default)]
    pub scheduled_at: Option<Value>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SweepResponse {
    pub ok: bool,
    /// Pending calls settled by this sweep.
    pub resolved: u32,
}

/// Options of a sub-agent. Its policy is intersected with the parent's: narrow, never escalate.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnOptions {
    /// Intersected with the parent policy — narrow, never escalate.
    #[serde(default)]
    pub functions: Option<FunctionPolicy>,
    /// Capped at the parent's remaining turn budget.
    #[serde(default)]
    pub max_turns: Option<u32>,
    /// Fan-out guard for the child's own spawns.
    #[serde(default)]
    pub max_children: Option<u32>,
    #[serde(default)]
    pub mode: Option<Mode>,
    /// The child's deliverable: text / json / json+schema.
    #[serde(default)]
    pub output: Option<OutputContract>,
    /// Parent-side wait guard for this child.
    #[serde(default)]
    pub pending_timeout_ms: Option<u64>,
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub system_prompt_strategy: Option<SystemPromptStrategy>,
    #[serde(default)]
    pub thinking_level: Option<ThinkingLevel>,
    /// Fire and forget: the call answers with the child's ids at once instead of waiting for its
    /// result; the outcome is published on `harness::turn-completed`.
    #[serde(default)]
    pub detach: Option<bool>,
    /// Let the child spawn and send on its own (otherwise it is a leaf).
    #[serde(default)]
    pub orchestrator: Option<bool>,
    /// Exact skill names the child's skills index lists; empty or omitted = all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skills: Option<Vec<String>>,
    /// The child's working root (absolute); default: the parent's. From a turn it must lie
    /// under the parent's root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem_root: Option<String>,
    /// Nudges an invalid result gets before the child's turn fails (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_validation_retries: Option<u32>,
    /// The child's output cap per generation (default: the parent's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
}

/// Spawn a sub-agent in a child session.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnRequest {
    /// The child's goal — its opening user message.
    #[schemars(with = "MessageInput")]
    pub task: Value,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub provider: Option<String>,
    /// Spawn into an existing session of the caller's own tree; default: create fresh.
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub options: Option<SpawnOptions>,
    /// A directory agent profile as the child's whole identity (omitted: the parent turn's
    /// profile, unless `options.system_prompt` sheds it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<String>,
    /// How clients show the sub-agent: stored on the child session's metadata
    /// (`subagent_display`), shown by `harness::session-tree`, carried on its turn events. The
    /// name (trimmed, 1 to 48 characters) titles a newly created child session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<SpawnDisplay>,
    /// For a spawn called directly (no parent turn): a display-only parent. The child is listed
    /// under it (`harness::session-tree`) and its turn events name it as `parent_session_id`;
    /// it is no parent link: nothing waits for the child, stops it or inherits from it. From a
    /// turn it is ignored: the parent is always the calling turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
}

/// A spawn's `display`: `icon` from the closed set (anything else fails the spawn); `color`
/// from the closed set, anything else shown as `neutral`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SpawnDisplay {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub icon: Option<crate::directory::Icon>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub color: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SpawnResponse {
    pub child_session_id: String,
    pub child_turn_id: String,
    /// True when the task went to an existing session of the caller's own tree (its own
    /// session, or a sub-agent it started) instead of a new one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reused: Option<bool>,
}

/// `harness::ask`: questions with discrete options, shown to the user as a card; the answer is
/// the user's next message.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AskRequest {
    /// 1 to 4 questions.
    pub questions: Vec<AskQuestion>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AskQuestion {
    /// 1 to 16 characters, one line.
    pub header: String,
    /// Not empty.
    pub question: String,
    /// Default false.
    #[serde(default)]
    pub multi_select: Option<bool>,
    /// 2 to 4 options; the UI adds a free-text "Other", so do not include one.
    pub options: Vec<AskOption>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AskOption {
    /// 1 to 80 characters, one line, unique within its question.
    pub label: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

/// Never produced: `harness::ask` is answered by the turn loop itself.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct AskResponse {
    pub status: String,
    pub question_id: String,
}

/// `harness::session-tree` and `harness::metrics` name the tree by its root.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionTreeRequest {
    pub session_id: String,
}

/// One session of a tree and its sub-agents' sessions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionTreeNode {
    pub session_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    pub depth: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// The session's current (or last) turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn_status: Option<TurnStatus>,
    /// A sub-agent's `display`, as its spawn named it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<crate::directory::Display>,
    pub children: Vec<SessionTreeNode>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MetricsRequest {
    pub root_session_id: String,
}

/// Counters over a session or a tree. A token or cost sum is present only when every assistant
/// message counted reported that field.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MetricsCounters {
    pub turns: u64,
    pub function_calls: u64,
    pub function_call_errors: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost_usd: Option<f64>,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct SessionMetrics {
    pub session_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session_id: Option<String>,
    pub depth: u32,
    #[serde(flatten)]
    pub counters: MetricsCounters,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct MetricsTotals {
    pub sessions: u64,
    #[serde(flatten)]
    pub counters: MetricsCounters,
}

#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
pub struct MetricsResponse {
    pub root_session_id: String,
    /// True only when every session of the tree exists and its turn has ended; totals are zero
    /// otherwise.
    pub complete: bool,
    pub totals: MetricsTotals,
    pub by_session: Vec<SessionMetrics>,
    /// The trace summary of the tree, read from its transcripts by the rules the OTLP export
    /// builds spans with (so it is there without any exporter).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traces: Option<TracesSummary>,
}

/// `harness::metrics` `traces`: one trace per root turn (a sub-agent's turns are spans of its
/// parent's trace).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct TracesSummary {
    pub trace_count: u64,
    pub span_count: u64,
    pub error_span_count: u64,
    /// Sum over the root session's turns, first to last recorded moment.
    pub duration_ms: u64,
    pub by_session: Vec<SessionTraces>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SessionTraces {
    pub session_id: String,
    /// Turns of this session (each a turn span).
    pub turns: u64,
    pub span_count: u64,
    pub error_span_count: u64,
    pub duration_ms: u64,
}

/// `harness::system-prompt::get`: preview the layers of a system prompt without a model call.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SystemPromptGetRequest {
    /// The session whose frozen prompt and runtime context to show.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Resolve these prompt fields fresh instead of reading the session's frozen prompt.
    #[serde(default)]
    pub selected_prompt: Option<SelectedPrompt>,
    /// Only the embedded default identity, consulting nothing else.
    #[serde(default)]
    pub default_only: Option<bool>,
}

/// The prompt fields of a send, for a preview.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SelectedPrompt {
    #[serde(default)]
    pub system_prompt: Option<String>,
    #[serde(default)]
    pub system_prompt_strategy: Option<SystemPromptStrategy>,
    #[serde(default)]
    pub agent: Option<String>,
    #[serde(default)]
    pub skills: Option<Vec<String>>,
    /// The operating mode (`plan` and `ask` head the identity with their paragraph).
    #[serde(default)]
    pub mode: Option<Mode>,
}

/// Which part of the prompt a layer is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PromptLayerKind {
    /// The identity embedded in the binary.
    BuiltIn,
    /// The directory's `system-prompts/default.md`, which replaces the built-in identity.
    DirectoryIdentity,
    /// An agent profile's resolved prompt (preloaded functions and skills included).
    Agent,
    /// The caller's own prompt text (`enrich` or `override`).
    Selected,
    /// The session's prompt as frozen at its last send.
    Frozen,
    /// The names-and-descriptions skills index.
    SkillsIndex,
    /// Session id, working directory and the policy aid, appended at every step.
    RuntimeContext,
    /// A pre-generate binding's static `inject_prompt` text, appended at every step after the
    /// runtime context.
    Injected,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PromptLayer {
    pub kind: PromptLayerKind,
    pub label: String,
    pub text: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct SystemPromptGetResponse {
    pub layers: Vec<PromptLayer>,
    /// The prompt as a step would send it (None: prompt disabled).
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// The cacheable prefix of `system_prompt`.
    #[serde(default)]
    pub stable_prefix: Option<String>,
    /// `sha256:<hex>` of `stable_prefix`.
    #[serde(default)]
    pub surface_digest: Option<String>,
}

/// `harness::delete-session-tree`: delete a session and every sub-agent session under it.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteTreeRequest {
    /// The root of the subtree; its parent and siblings stay.
    pub session_id: String,
    /// Which attempt this request is: 1 (the default) for the first; after a failed attempt n,
    /// exactly n + 1 retries it. A repeat of a running or completed deletion returns it as is.
    #[serde(default)]
    pub attempt: Option<u32>,
}

/// `harness::delete-session-tree-status`.
#[derive(Clone, Debug, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeleteTreeStatusRequest {
    pub operation_id: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum DeletionStatus {
    Deleting,
    Completed,
    Failed,
}

/// A subtree deletion as its callers see it (the response, the status and the event payload).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DeletionSnapshot {
    /// `delete_<sha256 hex of the root session id>`: one operation per root, ever.
    pub operation_id: String,
    pub attempt: u32,
    pub session_id: String,
    pub status: DeletionStatus,
    /// Sessions deleted so far, children before their parents.
    pub deleted_session_ids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Filter of a `harness::session-tree-deletion` binding.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeletionEventFilter {
    #[serde(default)]
    pub session_id: Option<String>,
    #[serde(default)]
    pub operation_id: Option<String>,
}
