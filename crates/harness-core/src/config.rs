//! Loop configuration, with the README's shipped defaults.

use serde::{Deserialize, Serialize};

/// How malformed call arguments are repaired before dispatch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallReconciliation {
    /// Dispatch as written.
    Off,
    /// Lossless repairs only: stringified JSON the schema rejects is parsed.
    Coerce,
    /// Coerce, then ask `judge::evaluate` (when registered) about misnamed keys, off-enum values
    /// and unknown arguments.
    #[default]
    Judge,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HarnessConfig {
    /// Generate-step cap per turn when a send names none.
    pub default_max_turns: u32,
    /// Recovery generations after a stream failed with partial output.
    pub max_transient_resumes: u32,
    /// Minimum interval between streamed `update-message` writes (0 = every frame).
    pub stream_coalesce_ms: u64,
    /// Outer budget of one `router::chat`.
    pub router_timeout_ms: u64,
    /// Budget of `session::*`, `state::*` and `context::*` calls.
    pub session_timeout_ms: u64,
    /// Budget of one function target call.
    pub dispatch_timeout_ms: u64,
    /// Context window assumed for models the catalog does not know.
    pub default_context_window: u64,
    /// Steps of different sessions running at once.
    pub queue_concurrency: usize,
    /// A step not finished within this time is redelivered.
    pub step_visibility_timeout_ms: u64,
    /// Function results larger than this (serialized content + details) are replaced by an
    /// elision marker; 0 turns the cap off, values below 1024 count as 1024.
    pub max_result_bytes: usize,
    pub call_reconciliation: CallReconciliation,
    /// A pending call (not a hook hold: those never expire) older than this gets a timeout
    /// result from the sweep.
    pub default_pending_timeout_ms: u64,
    /// 6-field cron expression of the pending-call sweep.
    pub sweep_expression: String,
    /// Send the frozen prompt prefix as its own cacheable section (+ digest) on `router::chat`.
    pub prompt_cache_sections: bool,
    /// Sub-agent depth budget.
    pub max_depth: u32,
    /// Child sessions one turn may create.
    pub max_children: u32,
}

impl Default for HarnessConfig {
    fn default() -> Self {
        HarnessConfig {
            default_max_turns: 16,
            max_transient_resumes: 1,
            stream_coalesce_ms: 150,
            router_timeout_ms: 620_000,
            session_timeout_ms: 10_000,
            dispatch_timeout_ms: 300_000,
            default_context_window: 200_000,
            queue_concurrency: 256,
            step_visibility_timeout_ms: 900_000,
            max_result_bytes: 262_144,
            call_reconciliation: CallReconciliation::Judge,
            default_pending_timeout_ms: 1_800_000,
            sweep_expression: "0 * * * * *".into(),
            prompt_cache_sections: true,
            max_depth: 3,
            max_children: 8,
        }
    }
}
