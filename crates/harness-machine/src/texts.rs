//! The words the loop writes for a person or the model to read: failure summaries of a turn,
//! notices and markers appended to the transcript, results that stand in for a call, refusals.
//!
//! One home, so one thing is said one way: a sentence written twice drifts (the provider's
//! error sentences once read differently in the router and in a turn's failure). Texts that are
//! stored in transcripts or records, or asserted by tests and conformance, are kept byte for
//! byte. Codes, phases and statuses are not here: they are machine-read, not prose.
//!
//! Pure (no I/O), so the machine and core's shells both use it; core re-exports it as
//! `harness_core::texts`.

use harness_types::message::ErrorKind;

// ---- Failure summaries of a turn (`Failure::summary`), one per way a turn fails ----

/// The store lost the record of a running turn.
pub const TURN_RECORD_LOST: &str =
    "The turn's state was lost by the store, so the turn was ended; send the message again to continue.";
/// The turn's first step could not be enqueued.
pub const TURN_UNSCHEDULABLE: &str = "The turn could not be scheduled.";
/// A pre-turn hook vetoed the turn.
pub const PRE_TURN_DENIED: &str = "A hook refused to start this turn.";
/// The context is over the model's window, before or after the pre-generate hooks: the same
/// sentence as a provider's refusal of the window ([`provider_failure`]).
pub const CONTEXT_OVERFLOW: &str = "The conversation no longer fits the model's context window.";
/// The assembled context was empty.
pub const EMPTY_CONTEXT: &str = "There was nothing to send to the model.";
/// A pre-generate hook vetoed the generation.
pub const PRE_GENERATE_DENIED: &str = "A hook refused this generation.";
/// The budget preflight refused the next generation.
pub const BUDGET_EXCEEDED: &str = "The turn's budget would be exceeded by its next generation.";
/// Compaction was needed and its summary failed.
pub const COMPACTION_FAILED: &str =
    "The conversation had to be summarized to fit and the summary could not be written.";
/// The context manager failed.
pub const CONTEXT_MANAGER_FAILED: &str =
    "The context manager could not assemble this conversation.";
/// A step ended on an error of the harness itself.
pub const TURN_INTERNAL: &str = "The turn stopped on an internal error.";
/// The result was refused by the output contract or a post-turn hook, with no retry left.
pub const OUTPUT_CONTRACT_INVALID: &str = "The result did not satisfy the output contract.";

/// The public sentence of a provider error kind: the router's error `message` and the summary
/// of a turn that failed on it. Defined beside the router's wire types (the router does not
/// depend on the machine); named here so every text of the loop is found in this module.
pub fn provider_failure(kind: ErrorKind) -> &'static str {
    harness_types::router::error_summary(kind)
}

// ---- Why a hook decided as it did (the reasons the failures and refusals above carry) ----

/// The reason of a hook that denied without giving one.
pub const HOOK_DENIED: &str = "denied by hook";

/// A fail-closed hook that failed (`why`: its error) denies with this reason.
pub fn hook_failed(function: &str, why: &str) -> String {
    format!("hook {function} failed: {why}")
}

/// Why a hook failed: it did not answer within its timeout.
pub fn hook_timed_out(timeout_ms: u128) -> String {
    format!("timed out after {timeout_ms} ms")
}

/// Why a hook failed: its answer is not a hook answer.
pub fn hook_answer_invalid(hook: &str, error: &str) -> String {
    format!("hook {hook} answered an invalid answer: {error}")
}

/// The `detail` of a failure a pre-turn hook caused.
pub fn pre_turn_denied_detail(reason: &str) -> String {
    format!("pre_turn hook denied: {reason}")
}

/// The `detail` of a failure a pre-generate hook caused.
pub fn pre_generate_denied_detail(reason: &str) -> String {
    format!("pre_generate hook denied: {reason}")
}

/// Why a result was refused when a post-turn hook denied it.
pub fn post_turn_refused(reason: &str) -> String {
    format!("a post_turn hook refused the result: {reason}")
}

/// The `detail` of a turn whose record the store lost.
pub fn turn_record_lost_detail(step: u64, turn_id: &str) -> String {
    format!("no turn record for this session at step {step} of turn {turn_id}")
}

// ---- Paragraphs of the system prompt ----

/// The system-prompt paragraph of `mode: plan`.
pub const MODE_PLAN: &str = "Operating mode: plan. Do not change anything in this turn. Investigate with functions that only read, then answer with a numbered plan: the steps you would take, the functions you would call and what each would change. The user approves the plan before anything is done.";

/// The system-prompt paragraph of `mode: ask`.
pub const MODE_ASK: &str = "Operating mode: ask. Answer the user's question directly and briefly. Use functions only to look things up; change nothing and start no work beyond the answer.";

/// The policy aid of a turn whose policy allows no function.
pub const DISPATCH_DISABLED: &str =
    "Function dispatch is entirely disabled this turn — do not call any function.";

// ---- Notices and results the loop appends for the model ----

/// The notice (and the result a post-turn hook sees) when a turn used up `max_turns`.
pub fn max_turns_reached(max_turns: u32) -> String {
    format!("max_turns ({max_turns}) reached; ending the turn.")
}

/// Why the calls of a reply cut at its output limit were not run.
pub const CUT_AT_OUTPUT_LIMIT: &str = "the reply hit the output limit";
/// Why a call's arguments are incomplete when the reply was not cut at its limit.
pub const STREAM_BROKE_MID_CALL: &str = "the stream broke mid-call";

/// The re-prompt after a refused result (`error`: why it was refused).
pub fn output_nudge(error: &str) -> String {
    format!(
        "Your previous result was not accepted: {error}. Please provide a corrected result that satisfies the required output contract."
    )
}

/// The description of the `submit_result` tool of a fallback-mode contract.
pub const SUBMIT_RESULT_DESCRIPTION: &str = "Submit this turn's final result. Call it exactly once, when the work is done: its arguments ARE the result and must satisfy the schema.";

/// Why a fallback-mode turn's answer was refused: it never called `submit_result`.
pub const NO_SUBMIT: &str =
    "this turn must produce its result by calling submit_result; no submit_result call was made";

/// Why a native-mode answer was refused: its text is not JSON.
pub fn result_not_json(error: &str) -> String {
    format!("result is not valid JSON: {error}")
}

/// Why a result was refused by the contract's schema (`errors`: each failed rule).
pub fn result_schema_failed(errors: &str) -> String {
    format!("result failed schema validation: {errors}")
}

/// Why a contract could not be checked at all: its schema does not compile.
pub fn contract_schema_invalid(error: &str) -> String {
    format!("the output contract's schema is invalid: {error}")
}

/// The marker after a cut text-only reply on the step that resumes it: the provider must not be
/// handed a trailing assistant message to continue, and the instructions themselves are in the
/// system prompt, so this says only what it is. (For the model; `harness chat` tells a person
/// the same with its own line, `[the reply above was cut off; resumed:]`, because the person
/// sees the resumed text arrive and the model does not need to be told it is not the user.)
pub const RESUME_MARKER: &str =
    "[harness: automatic resume of the reply above, which was cut off; not a message from the user]";

/// The `summary` of a transient recovery entry, while the cut reply is resumed.
pub const RECOVERING_SUMMARY: &str =
    "The provider stopped mid-answer; resuming from the partial reply.";

/// The system-prompt notice of the step that resumes a reply the provider ended early.
pub fn resume_notice(reason: &str) -> String {
    format!(
        "Harness note (from the harness, not the user; do not quote it): the provider ended your previous \
         reply early ({reason}). That partial reply is the last assistant message. Continue from it and \
         give the complete answer, incorporating the partial reply. Do not repeat function calls that \
         already have successful results."
    )
}

/// The result that `ask::user` answers the model with once the card is shown.
pub const ASK_SHOWN: &str = "The questions are now shown to the user as a card of options. Their answer arrives as their next message. Do not repeat the questions in text. End your turn now.";

/// Why `harness::ask` was refused: no person is attached to answer (a sub-agent or a
/// structured-output turn).
pub const ASK_NO_HUMAN: &str = "harness::ask needs a human to answer and none is attached to this turn (sub-agent or structured-output turn); report blocked with your question instead";
/// Why a second `harness::ask` in one step was refused.
pub const ASK_ONE_PER_STEP: &str =
    "only one harness::ask per step; put all your questions (up to 4) in one call";
/// Why `harness::ask` called outside a model turn was refused.
pub const ASK_OUTSIDE_A_TURN: &str =
    "harness::ask only works inside an agent turn: call it from a model turn, not directly";

/// What a turn that a stop ended says of itself (the session's end reason and message).
pub const STOPPED_BY_USER: &str = "stopped by user.";

/// To a parent's session: the operator deleted its sub-agent `session_id` (and `below` sessions
/// under it).
pub fn subagent_deleted(session_id: &str, below: usize) -> String {
    let under = if below > 0 {
        format!(" and the {below} sub-agent session(s) under it")
    } else {
        String::new()
    };
    format!(
        "[harness] The operator deleted sub-agent session {session_id}{under}. Its transcript and any result it had not returned are gone; do not wait for it."
    )
}

/// The contracts preloaded into a session's frozen system prompt no longer match the registry
/// (`changed`: each function and how). Says which; [`FUNCTIONS_CHANGED`] is the general notice
/// about contracts the model fetched itself, of which the loop keeps no list.
pub fn preloaded_contracts_stale(changed: &str) -> String {
    format!(
        "[harness] Preloaded function contracts in your system prompt are stale: {changed}. Read the current schema with engine::functions::info before calling them."
    )
}

/// The registry changed since the session's last step.
pub const FUNCTIONS_CHANGED: &str = "[harness] The set of registered functions changed since your last step: contracts you fetched earlier may be stale. \
     Re-read a function's schema with engine::functions::info before calling it again.";

/// The skills catalog changed since the frozen prompt listed it (`changes`: added, changed,
/// removed).
pub fn skills_changed(changes: &str) -> String {
    format!(
        "[harness] The skills catalog changed since your system prompt listed it: {changes}. Read a skill with directory::skills::get {{\"name\": \"<name>\"}}; a removed one is gone."
    )
}

/// A call's arguments break its function's schema (`problems`: one per field).
pub fn arguments_mismatch(function_id: &str, problems: &str) -> String {
    format!(
        "[harness] The arguments of {function_id} do not match its schema: {problems}. Fix these fields before calling it again."
    )
}

// ---- Results that stand in for a call the loop closed itself ----

/// A call with no result in the context whose run was interrupted after dispatch (see
/// [`CALL_INTERRUPTED_BY_RESTART`] for the stored result).
pub const CALL_INTERRUPTED: &str = "result unknown: the call was interrupted after dispatch; it ran at most once — verify its effect before repeating it";
/// A call whose result compaction left out of the assembled context.
pub const CALL_ELIDED: &str = "result elided from the assembled context (compaction): the call ran and its result is in the transcript; \
     the summary above carries what mattered — call it again if you need the details";
/// A call of a reply that was cut off before it could be dispatched.
pub const CALL_NEVER_DISPATCHED: &str = "not executed: the reply was cut off before this call could be dispatched, so it never ran — issue it again if it is still needed";

/// The stored result of a call found `triggered` after a restart: it ran at most once. Says
/// what [`CALL_INTERRUPTED`] says, in other words, and stays so: this one is written to the
/// transcript, that one only patches an assembled context, and the behaviour spec quotes each
/// (clients and conformance match on them).
pub const CALL_INTERRUPTED_BY_RESTART: &str =
    "interrupted: executed at most once, result unknown (restart during execution); \
     verify its effect before repeating it";

/// `agent_trigger` called without naming the function to run.
pub const AGENT_TRIGGER_NO_TARGET: &str = "agent_trigger needs a target: call it as {\"function\": \"<function id>\", \"description\": \"…\", \"payload\": {…}}";

/// `function`'s arguments arrived whole but are not JSON.
pub fn arguments_not_json(function: &str) -> String {
    format!(
        "function {function} was not run: its arguments are not valid JSON (a string with a raw line break or tab, an unclosed quote, ...); send the call again as one JSON object"
    )
}

/// `function`'s arguments were cut short (`why`: by the output limit or a broken stream).
pub fn arguments_cut_short(function: &str, why: &str) -> String {
    format!(
        "function {function} was not run: its arguments were cut short ({why}); send the complete call again"
    )
}

/// The breaker refused `function`: the same arguments failed the same way twice.
pub fn repeated_failure(function: &str) -> String {
    format!(
        "function {function} already failed twice with these exact arguments and the same error; it was not run again. \
         Change the arguments or the approach."
    )
}

/// The session's dispatch policy does not allow `function`.
pub fn policy_denied(function: &str) -> String {
    format!(
        "function {function} is not permitted by this agent's dispatch policy (no allow-glob match or a deny-glob match)"
    )
}

/// A spawn call whose arguments do not parse (`why`: the field and the problem).
pub fn spawn_invalid(why: &str) -> String {
    format!("invalid spawn arguments: {why}")
}

/// A spawn past the configured depth.
pub fn spawn_too_deep(depth: u32, max_depth: u32) -> String {
    format!("spawn depth {depth} exceeds max_depth {max_depth}")
}

/// A spawn past the turn's limit of children.
pub fn spawn_fanout(created: u32, max_children: u32) -> String {
    format!("this turn already created {created} sub-agents (max_children {max_children}); consolidate the work or defer it, do not retry")
}

/// A spawn whose child could not be seeded (`error`: why).
pub fn spawn_failed(error: &str) -> String {
    format!("the sub-agent could not start: {error}")
}

/// Appended to a detached spawn's answer when its task went to the caller's own session.
pub const SPAWN_MERGED: &str = " (merged into this session's own turn: the task is a message to yourself, not a separate sub-agent)";
/// Appended to a detached spawn's answer when it reused an existing sub-agent session.
pub const SPAWN_REUSED: &str =
    " (reused an existing sub-agent session: its transcript and linkage are kept)";

/// A stop cancelled `function` while its target ran.
pub fn cancelled_while_running(function: &str) -> String {
    format!(
        "function {function} was cancelled by a stop while it ran; the target may still be running and its effects are unknown, not undone"
    )
}

/// A stop ended the turn while `function`'s result was held after it ran.
pub fn stopped_with_result_held(function: &str) -> String {
    format!(
        "function {function} ran, but the turn was stopped before its held result was released; its effects are not undone"
    )
}

/// A stop ended the turn while `holder` held `function` before it ran.
pub fn stopped_while_held(function: &str, holder: &str) -> String {
    format!("function {function} was not run: the turn was stopped while {holder} held the call")
}

/// A stop ended the turn while it waited for the sub-agent in `session_id`.
pub fn child_stopped_with_turn(session_id: &str) -> String {
    format!(
        "the sub-agent in session {session_id} was stopped with this turn; its work is unfinished"
    )
}

/// A stop ended the turn while `function`'s result was awaited.
pub fn stopped_before_delivery(function: &str) -> String {
    format!(
        "function {function} was cancelled: the turn was stopped before its result was delivered"
    )
}

/// A stop ended the turn before `function` was reached.
pub fn stopped_before_run(function: &str) -> String {
    format!("function {function} was not run: the turn was stopped first")
}

/// A pre-trigger hook denied `function`.
pub fn hook_denied(function: &str, reason: &str) -> String {
    format!("function {function} was denied by a hook: {reason}")
}

/// The sub-agent in `session_id` outlived its call's timeout.
pub fn child_timed_out(session_id: &str, timeout_ms: i64) -> String {
    format!("the sub-agent in session {session_id} did not finish within {timeout_ms} ms; it was stopped")
}

/// A pending call outlived its timeout.
pub fn pending_timed_out(timeout_ms: i64) -> String {
    format!("pending call timed out after {timeout_ms} ms without a result")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind has its sentence, and no two kinds share one: a reader tells them apart.
    #[test]
    fn each_provider_error_kind_reads_differently() {
        let kinds = [
            ErrorKind::AuthExpired,
            ErrorKind::RateLimited,
            ErrorKind::ContextOverflow,
            ErrorKind::Transient,
            ErrorKind::Permanent,
        ];
        let said: std::collections::HashSet<_> =
            kinds.iter().map(|k| provider_failure(*k)).collect();
        assert_eq!(said.len(), kinds.len(), "{said:?}");
        assert!(said.iter().all(|s| s.ends_with('.')), "{said:?}");
        assert_eq!(
            provider_failure(ErrorKind::ContextOverflow),
            CONTEXT_OVERFLOW
        );
    }
}
