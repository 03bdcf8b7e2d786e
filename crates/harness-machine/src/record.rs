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
    /// Token and spend limits, shared with sub-agents through one ledger.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    /// Nudges an invalid result gets (None: the default, 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_validation_retries: Option<u32>,
    /// None = deny every call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions: Option<FunctionPolicy>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    #[serde(default)]
    pub max_transient_resumes: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    /// Where the turn's `fs::*` and `shell::*` calls work (None: they are refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<FsRoot>,
    /// The agent profile frozen into `system_prompt` (sticky with the prompt).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<FrozenAgent>,
    /// The skills the index lists (None = all); sticky.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skills: Option<Vec<String>>,
    /// Where the layers of `system_prompt` end (absent on records written before layers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_shape: Option<PromptShape>,
    /// The operating mode whose paragraph heads `system_prompt` (None: agent, no paragraph);
    /// sticky with the prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<harness_types::api::Mode>,
    /// A sub-agent's display, as its spawn named it (normalized).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<harness_types::directory::Display>,
    /// The display-only parent a spawn called directly named (never with a parent link).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_parent_session_id: Option<String>,
    /// The skills index the session was last told about, when a correction followed the
    /// frozen one (None: the index frozen in `system_prompt` is the latest it knows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skills_seen: Option<String>,
    /// This turn's own spawn fan-out (`options.max_children` of its spawn), under the
    /// configured `max_children`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_children: Option<u32>,
}

/// Byte offsets into the frozen prompt: the identity (built-in, directory or profile) ends at
/// `base_len`; the skills index follows it up to `stable_len`, the cacheable prefix; what
/// comes after it (the caller's `enrich` text) is per session.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptShape {
    pub base_len: usize,
    pub stable_len: usize,
}

/// What a session froze of the agent profile it runs under.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FrozenAgent {
    pub name: String,
    /// The `extends` chain, root first.
    #[serde(default)]
    pub chain: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display: Option<harness_types::directory::Display>,
    /// The digest of each preloaded function's contract as frozen into the prompt
    /// (`unavailable` for one the registry did not list): what the stale notice compares.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub contracts: BTreeMap<String, String>,
}

impl TurnOptions {
    /// The cacheable prefix of the frozen prompt: up to the end of the skills index, or the
    /// whole prompt for a record without layers.
    pub fn stable_prefix(&self) -> Option<&str> {
        let prompt = self.system_prompt.as_deref()?;
        match self.prompt_shape {
            Some(shape) => prompt.get(..shape.stable_len).or(Some(prompt)),
            None => Some(prompt),
        }
    }

    /// How allowed functions reach the model (the policy's, or the default).
    pub fn expose(&self) -> harness_types::api::ExposeMode {
        self.functions
            .as_ref()
            .map(|p| p.expose)
            .unwrap_or_default()
    }
}

/// How much reasoning to ask of the model, beyond its thinking level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reasoning {
    /// The least reasoning the model allows.
    Lowest,
}

impl Reasoning {
    /// The send option's value, named by field when it is not one.
    pub fn parse(value: &str) -> Option<Reasoning> {
        match value {
            "lowest" => Some(Reasoning::Lowest),
            _ => None,
        }
    }

    /// The value as the send option and `router::chat` spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Reasoning::Lowest => "lowest",
        }
    }
}

/// The state of a call, as the checkpoint's variant says it.
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

/// The hook point that holds a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldPoint {
    /// Before the target ran: a release resumes the pre-trigger chain after the holder.
    PreTrigger,
    /// After the target ran: a release appends the kept result, never a second run.
    PostTrigger,
}

/// A hook's hold on a call.
#[derive(Clone, Debug, PartialEq)]
pub struct Hold {
    /// The function id of the hook that held.
    pub holder: String,
    pub point: HoldPoint,
    /// The arguments as mutated up to and including the holder.
    pub arguments: Value,
    /// A post-trigger hold keeps the target's result: a release appends it, never re-runs.
    pub result: Option<HeldResult>,
    /// Repairs made before the hold (they go into the result's origin).
    pub reconciled: Option<Value>,
    /// Hook annotations gathered before the hold.
    pub annotations: Option<Value>,
    /// The breaker key of the call as the model wrote it.
    pub breaker_key: Option<String>,
}

/// A call's result as the post-trigger hooks left it, kept by a post-trigger hold until its
/// release appends it (stored as `held_result`: `{content, details, is_error}`).
#[derive(Clone, Debug, PartialEq)]
pub struct HeldResult {
    pub content: Vec<harness_types::message::ContentBlock>,
    pub details: Value,
    pub is_error: bool,
}

impl HeldResult {
    /// Read the way every earlier version read it back: what is missing or unreadable is
    /// empty content, null details, not an error.
    pub fn from_stored(v: &Value) -> HeldResult {
        HeldResult {
            content: serde_json::from_value(v["content"].clone()).unwrap_or_default(),
            details: v["details"].clone(),
            is_error: v["is_error"].as_bool().unwrap_or(false),
        }
    }

    pub fn to_stored(&self) -> Value {
        serde_json::json!({"content": self.content, "details": self.details, "is_error": self.is_error})
    }
}

/// A `harness::spawn` call's child turn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChildLink {
    pub session_id: String,
    pub turn_id: String,
}

/// What a pending call waits for.
#[derive(Clone, Debug, PartialEq)]
pub enum Wait {
    /// A hook holds it until `harness::function::resolve` releases or answers it.
    Hold(Box<Hold>),
    /// A spawn waits for its child's turn to end; `origin` goes on the result entry.
    Child {
        child: ChildLink,
        origin: Option<Value>,
    },
    /// A delivered result, and nothing else.
    Result,
}

/// The per-call checkpoint on the turn record: one variant per state.
///
/// Stored in the flat shape older versions wrote (`{"state": ..., "held_by": ...}`), so a record
/// written by any version reads back: [`wire::Checkpoint`] is that shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(from = "wire::Checkpoint", into = "wire::Checkpoint")]
pub enum CallCheckpoint {
    /// Durably marked before the target runs: seen after a restart, the call may have run once.
    Triggered {
        function_id: String,
        breaker_key: Option<String>,
    },
    /// Parked.
    Pending {
        function_id: String,
        /// When it parked (ms).
        since: Option<i64>,
        /// How long a delivered result may take before the sweep answers for it.
        timeout_ms: Option<u64>,
        wait: Wait,
    },
    /// Its result is in the transcript under `entry_id`.
    Done {
        function_id: String,
        entry_id: Option<String>,
        /// A spawn's child stays known (status, the stop cascade, the fan-out count).
        child: Option<ChildLink>,
    },
}

impl CallCheckpoint {
    pub fn state(&self) -> CallState {
        match self {
            CallCheckpoint::Triggered { .. } => CallState::Triggered,
            CallCheckpoint::Pending { .. } => CallState::Pending,
            CallCheckpoint::Done { .. } => CallState::Done,
        }
    }

    pub fn function_id(&self) -> &str {
        match self {
            CallCheckpoint::Triggered { function_id, .. }
            | CallCheckpoint::Pending { function_id, .. }
            | CallCheckpoint::Done { function_id, .. } => function_id,
        }
    }

    /// The sub-agent this call started, waiting or done.
    pub fn child(&self) -> Option<&ChildLink> {
        match self {
            CallCheckpoint::Pending {
                wait: Wait::Child { child, .. },
                ..
            }
            | CallCheckpoint::Done {
                child: Some(child), ..
            } => Some(child),
            _ => None,
        }
    }

    /// The hook hold of a pending call.
    pub fn hold(&self) -> Option<&Hold> {
        match self {
            CallCheckpoint::Pending {
                wait: Wait::Hold(h),
                ..
            } => Some(h),
            _ => None,
        }
    }
}

/// The stored shape of a checkpoint: flat, every field optional, as older versions wrote it.
pub mod wire {
    use serde::{Deserialize, Serialize};
    use serde_json::Value;

    use super::{CallCheckpoint, CallState, ChildLink, HeldResult, Hold, HoldPoint, Wait};

    #[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
    pub struct Checkpoint {
        pub state: Option<CallState>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub function_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub entry_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub held_by: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub held_point: Option<HoldPoint>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub held_arguments: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub held_result: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub pending_at: Option<i64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub pending_timeout_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub reconciled: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub annotations: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub breaker_key: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub child_session_id: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub child_turn_id: Option<String>,
    }

    fn child(w: &Checkpoint) -> Option<ChildLink> {
        Some(ChildLink {
            session_id: w.child_session_id.clone()?,
            turn_id: w.child_turn_id.clone().unwrap_or_default(),
        })
    }

    impl From<Checkpoint> for CallCheckpoint {
        fn from(w: Checkpoint) -> CallCheckpoint {
            let function_id = w.function_id.clone().unwrap_or_default();
            // A record without a state is the oldest shape of a dispatched call: it may have
            // run, so it reads as triggered (never as a call that can run again).
            match w.state.unwrap_or(CallState::Triggered) {
                CallState::Triggered => CallCheckpoint::Triggered {
                    function_id,
                    breaker_key: w.breaker_key,
                },
                CallState::Done => CallCheckpoint::Done {
                    child: child(&w),
                    function_id,
                    entry_id: w.entry_id,
                },
                CallState::Pending => {
                    let wait = match (&w.held_by, child(&w)) {
                        (Some(holder), _) => Wait::Hold(Box::new(Hold {
                            holder: holder.clone(),
                            point: w.held_point.unwrap_or(HoldPoint::PreTrigger),
                            arguments: w.held_arguments.clone().unwrap_or(Value::Null),
                            result: w.held_result.as_ref().map(HeldResult::from_stored),
                            reconciled: w.reconciled.clone(),
                            annotations: w.annotations.clone(),
                            breaker_key: w.breaker_key.clone(),
                        })),
                        (None, Some(child)) => Wait::Child {
                            child,
                            origin: w.annotations.clone(),
                        },
                        (None, None) => Wait::Result,
                    };
                    CallCheckpoint::Pending {
                        function_id,
                        since: w.pending_at,
                        timeout_ms: w.pending_timeout_ms,
                        wait,
                    }
                }
            }
        }
    }

    impl From<CallCheckpoint> for Checkpoint {
        fn from(c: CallCheckpoint) -> Checkpoint {
            let mut w = Checkpoint {
                state: Some(c.state()),
                function_id: Some(c.function_id().to_string()),
                ..Checkpoint::default()
            };
            match c {
                CallCheckpoint::Triggered { breaker_key, .. } => w.breaker_key = breaker_key,
                CallCheckpoint::Done {
                    entry_id, child, ..
                } => {
                    w.entry_id = entry_id;
                    if let Some(c) = child {
                        w.child_session_id = Some(c.session_id);
                        w.child_turn_id = Some(c.turn_id);
                    }
                }
                CallCheckpoint::Pending {
                    since,
                    timeout_ms,
                    wait,
                    ..
                } => {
                    w.pending_at = since;
                    w.pending_timeout_ms = timeout_ms;
                    match wait {
                        Wait::Hold(h) => {
                            w.held_by = Some(h.holder);
                            w.held_point = Some(h.point);
                            w.held_arguments = Some(h.arguments);
                            w.held_result = h.result.as_ref().map(HeldResult::to_stored);
                            w.reconciled = h.reconciled;
                            w.annotations = h.annotations;
                            w.breaker_key = h.breaker_key;
                        }
                        Wait::Child { child, origin } => {
                            w.child_session_id = Some(child.session_id);
                            w.child_turn_id = Some(child.turn_id);
                            w.annotations = origin;
                        }
                        Wait::Result => {}
                    }
                }
            }
            w
        }
    }
}

/// A provider failure of one generation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GenerationError {
    pub code: String,
    pub kind: harness_types::message::ErrorKind,
    pub message: String,
    /// What the provider answered, and what to do about it (see [`Failure`]).
    #[serde(flatten)]
    pub provider: ProviderAnswer,
}

/// What a provider answered when it failed, and what a person can do about it: carried from
/// the router's error to the turn's failure and on to `harness::status` and `turn-completed`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProviderAnswer {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_status: Option<u16>,
    /// The provider's own words, bounded and redacted by the router.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
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

/// Where in the turn a failure happened (the error record's `phase`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailurePhase {
    /// `harness::send` could not schedule the turn's first step.
    Scheduling,
    PreTurn,
    ContextAssembly,
    PreGenerate,
    Generation,
    /// The result did not satisfy the turn's output contract.
    OutputValidation,
    /// The next generation would exceed the turn's budget.
    BudgetPreflight,
    /// Anything else the loop ran into (an internal error, a lost record).
    Execution,
}

impl FailurePhase {
    pub fn as_str(self) -> &'static str {
        match self {
            FailurePhase::Scheduling => "scheduling",
            FailurePhase::PreTurn => "pre_turn",
            FailurePhase::ContextAssembly => "context_assembly",
            FailurePhase::PreGenerate => "pre_generate",
            FailurePhase::Generation => "generation",
            FailurePhase::OutputValidation => "output_validation",
            FailurePhase::BudgetPreflight => "budget_preflight",
            FailurePhase::Execution => "execution",
        }
    }
}

/// Why a turn that completed stopped early.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnStopReason {
    /// The turn used up `max_turns` generations.
    MaxTurns,
}

impl TurnStopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            TurnStopReason::MaxTurns => "max_turns",
        }
    }
}

/// Why a turn failed: what the error record and `turn-completed` carry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Failure {
    /// `harness.<reason>` or the router's code.
    pub code: String,
    pub phase: FailurePhase,
    /// One public sentence.
    pub summary: String,
    /// The raw diagnostic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default)]
    pub retryable: bool,
    /// The provider's failure class, for generation failures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<harness_types::message::ErrorKind>,
    /// Stored with the record, so the cause reads the same after a restart.
    #[serde(flatten)]
    pub provider: ProviderAnswer,
}

impl Failure {
    /// The failure as the API shows it (`harness::status`, `harness::turn-completed`).
    pub fn to_api(&self) -> harness_types::api::TurnFailure {
        harness_types::api::TurnFailure {
            code: self.code.clone(),
            phase: self.phase.as_str().to_string(),
            kind: self.kind,
            retryable: self.retryable,
            provider_status: self.provider.provider_status,
            provider_message: self.provider.provider_message.clone(),
            detail: self.detail.clone(),
            hint: self.provider.hint.clone(),
        }
    }
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
    /// What the latest step sent as the prompt's cacheable surface (written with the next
    /// record write, like `stream_request_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_surface: Option<harness_types::api::PromptSurface>,
    pub options: std::sync::Arc<TurnOptions>,
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
    pub stop_reason: Option<TurnStopReason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generated: Option<GeneratedStep>,
    /// The function-registry generation this turn last saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub functions_generation: Option<u64>,
    /// Repeated-failure breaker ledger, reset on each new turn.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub failed_calls: BTreeMap<String, FailedCall>,
    /// How a JSON output contract reaches the model, chosen at the first generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_mode: Option<crate::output::OutputMode>,
    /// Nudges spent on results that did not satisfy the output contract.
    #[serde(default)]
    pub validation_retries: u32,
    /// The latest `submit_result` call, as answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted: Option<crate::output::Submitted>,
    /// What this turn's generations used, as the provider reported it (priced from the catalog
    /// where the provider gave no cost).
    #[serde(default, skip_serializing_if = "Spend::is_zero")]
    pub spent: Spend,
    /// The step whose `harness::ask` was accepted: the turn ends on the question, and a
    /// redelivered step still does (and still refuses a second ask).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ask_step: Option<u64>,
    /// Repairs already noted this turn (the same repair is noted once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub noted_repairs: Vec<String>,
    /// The turn's trace context (harness-core's `trace`), set at send only when spans are exported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceCtx>,
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
        self.calls.values().any(|c| c.state() == CallState::Pending)
    }

    /// Why the turn failed: the stored failure, or the loop's own code for a record that
    /// failed without one.
    pub fn failure_cause(&self) -> Failure {
        self.failure.clone().unwrap_or_else(|| Failure {
            code: "harness.turn_internal".into(),
            phase: FailurePhase::Execution,
            summary: self.result_error.clone().unwrap_or_default(),
            detail: None,
            retryable: false,
            kind: None,
            provider: ProviderAnswer::default(),
        })
    }

    /// The cause of a failed turn as the API shows it; `None` unless the turn failed.
    pub fn api_failure(&self) -> Option<harness_types::api::TurnFailure> {
        (self.status == TurnStatus::Failed).then(|| self.failure_cause().to_api())
    }

    /// Ids of calls still `triggered` or `pending`.
    pub fn open_calls(&self) -> Vec<String> {
        self.calls
            .iter()
            .filter(|(_, c)| c.state() != CallState::Done)
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// A turn's token and spend limits (`max_total_tokens`, `max_cost_usd`), shared with its
/// sub-agents through one ledger (harness-core's `budget`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Budget {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_total_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost_usd: Option<f64>,
    /// The turn whose ledger this budget spends from.
    pub ledger: String,
}

/// Tokens and USD spent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Spend {
    #[serde(default)]
    pub tokens: u64,
    #[serde(default)]
    pub cost_usd: f64,
}

impl Spend {
    pub fn is_zero(&self) -> bool {
        self.tokens == 0 && self.cost_usd == 0.0
    }
}

/// Where a root came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum FsBoundary {
    /// Named by the send or spawn that started the work.
    Workspace,
    /// The configuration's `default_filesystem_root`.
    ConfiguredRoots,
}

/// A turn's filesystem root (harness-core's `fsroot` stamps it onto scoped calls).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
pub struct FsRoot {
    /// Absolute, resolved (no symlinks) when it was frozen.
    pub root: String,
    pub boundary: FsBoundary,
}

/// A turn's trace context, stored in its record at send (harness-core's `trace` builds it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceCtx {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits.
    pub turn_span_id: String,
    /// The caller's span (`traceparent`) or the parent turn's spawn span.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_span_id: Option<String>,
    /// The parent came from outside this process tree (a `traceparent` header).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub remote_parent: bool,
    /// Decided once at send: every step and every sub-agent agrees.
    pub sampled: bool,
    pub started_at_ms: i64,
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
        assert_eq!(rec.calls["c1"].state(), CallState::Triggered);
        assert_eq!(rec.open_calls(), vec!["c1".to_string()]);
    }

    #[test]
    fn records_written_by_the_untyped_version_read_as_typed_and_write_back_the_same() {
        // Exactly what the previous version stored: flat checkpoints, string phase and kind.
        let old = serde_json::json!({
            "turn_id": "t_1", "session_id": "s", "status": "awaiting_functions", "step": 1,
            "options": {"model": "m", "max_turns": 4},
            "calls": {
                "held": {"state": "pending", "function_id": "fs::write", "held_by": "approval::gate",
                         "held_point": "post_trigger", "held_arguments": {"path": "a"},
                         "held_result": {"content": [{"type": "text", "text": "ok"}], "details": {"n": 1}, "is_error": true}, "pending_at": 5,
                         "reconciled": [{"path": "/x"}], "annotations": {"k": 1}, "breaker_key": "bk"},
                "child": {"state": "pending", "function_id": "harness::spawn", "child_session_id": "c",
                          "child_turn_id": "ct", "pending_at": 6, "pending_timeout_ms": 100,
                          "annotations": {"turn_id": "t_1"}},
                "done": {"state": "done", "function_id": "harness::spawn", "entry_id": "e",
                         "child_session_id": "c2", "child_turn_id": "ct2"},
                "ran": {"state": "triggered", "function_id": "f", "breaker_key": "k"}
            },
            "failure": {"code": "router/x", "phase": "generation", "summary": "s", "retryable": true, "kind": "rate_limited"},
            "stop_reason": "max_turns"
        });
        let rec: TurnRecord = serde_json::from_value(old.clone()).unwrap();
        let hold = rec.calls["held"].hold().expect("a hook hold");
        assert_eq!(
            (hold.holder.as_str(), hold.point),
            ("approval::gate", HoldPoint::PostTrigger)
        );
        let held = hold.result.as_ref().expect("the kept result");
        assert_eq!(
            (held.content.len(), &held.details, held.is_error),
            (1, &serde_json::json!({"n": 1}), true)
        );
        match &rec.calls["child"] {
            CallCheckpoint::Pending {
                timeout_ms: Some(100),
                wait: Wait::Child { child, origin },
                ..
            } => {
                assert_eq!(
                    (child.session_id.as_str(), child.turn_id.as_str()),
                    ("c", "ct")
                );
                assert!(origin.is_some());
            }
            other => panic!("not a child wait: {other:?}"),
        }
        assert_eq!(rec.calls["done"].child().unwrap().session_id, "c2");
        assert_eq!(rec.calls["ran"].state(), CallState::Triggered);
        let f = rec.failure.clone().unwrap();
        assert_eq!(
            (f.phase, f.kind),
            (
                FailurePhase::Generation,
                Some(harness_types::message::ErrorKind::RateLimited)
            )
        );
        assert_eq!(rec.stop_reason, Some(TurnStopReason::MaxTurns));
        let back = serde_json::to_value(&rec).unwrap();
        assert_eq!(
            back["calls"], old["calls"],
            "checkpoints keep their stored shape"
        );
        assert_eq!(back["failure"], old["failure"]);
        assert_eq!(back["stop_reason"], old["stop_reason"]);
    }

    #[test]
    fn a_held_result_reads_back_the_way_earlier_versions_read_it() {
        let read = |v| HeldResult::from_stored(&v);
        let h = read(serde_json::json!({"is_error": "yes", "content": "not blocks"}));
        assert_eq!(
            h,
            HeldResult {
                content: vec![],
                details: Value::Null,
                is_error: false
            }
        );
        let stored = serde_json::json!({"content": [{"type": "text", "text": "t"}], "details": null, "is_error": true});
        assert_eq!(read(stored.clone()).to_stored(), stored);
    }

    #[test]
    fn a_failures_provider_answer_is_stored_flat_and_shown_on_the_api() {
        let stored = serde_json::json!({
            "code": "router/not_found", "phase": "generation", "summary": "The provider rejected this request.",
            "detail": "HTTP 404: Not Found", "retryable": false, "kind": "permanent",
            "provider_status": 404, "provider_message": "Not Found", "hint": "try /v1"
        });
        let f: Failure = serde_json::from_value(stored.clone()).unwrap();
        assert_eq!(f.provider.provider_status, Some(404));
        assert_eq!(
            serde_json::to_value(&f).unwrap(),
            stored,
            "written back the same"
        );
        let api = f.to_api();
        assert_eq!(
            (api.code.as_str(), api.phase.as_str(), api.provider_status),
            ("router/not_found", "generation", Some(404))
        );
        assert_eq!(api.provider_message.as_deref(), Some("Not Found"));
        assert_eq!(api.hint.as_deref(), Some("try /v1"));
        assert_eq!(api.detail.as_deref(), Some("HTTP 404: Not Found"));

        // A failed record without a stored failure still names a cause; others have none.
        let mut rec: TurnRecord = serde_json::from_value(serde_json::json!({
            "turn_id": "t_1", "session_id": "s", "status": "failed", "step": 1,
            "options": {"model": "m", "max_turns": 4}, "result_error": "lost"
        }))
        .unwrap();
        let api = rec.api_failure().expect("a cause");
        assert_eq!(
            (api.code.as_str(), api.phase.as_str()),
            ("harness.turn_internal", "execution")
        );
        assert_eq!(api.provider_status, None);
        rec.status = TurnStatus::Completed;
        assert_eq!(rec.api_failure(), None);
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
