//! Pruning: shortening aged, oversized function results in the assembled copy.
//!
//! A result the model has already answered twice past is rarely read again whole, yet it keeps
//! costing its full size at every step. Where the session's context policy allows it, such a
//! result is cut to its beginning and a marker saying how big it was and that calling the
//! function again brings it back. The transcript is never touched.

use harness_types::message::{AgentMessage, ContentBlock};

use crate::count::Counter;

/// A result becomes prunable once this many assistant messages follow it.
pub const AGED_AFTER_ANSWERS: usize = 2;
/// Results at or under this many tokens stay whole.
pub const OVERSIZED_TOKENS: u64 = 1_024;
/// Characters of a pruned result that stay in context.
const KEPT_CHARS: usize = 400;

/// The text that replaces a pruned result.
pub fn pruned_text(tokens: u64, head: &str) -> String {
    format!(
        "[pruned from the context: this result was about {tokens} tokens and is older than the latest exchanges; \
         its beginning follows. Call the function again if you need all of it.]\n{head}"
    )
}

/// Prunes `messages` in place; returns how many results were shortened.
pub fn prune(messages: &mut [AgentMessage], counter: &Counter) -> u32 {
    let mut answers_after = 0usize;
    let mut pruned = 0;
    for m in messages.iter_mut().rev() {
        if matches!(m, AgentMessage::Assistant(_)) {
            answers_after += 1;
            continue;
        }
        if answers_after < AGED_AFTER_ANSWERS || !matches!(m, AgentMessage::FunctionResult(_)) {
            continue;
        }
        let tokens = counter.message(m);
        if tokens <= OVERSIZED_TOKENS {
            continue;
        }
        if let AgentMessage::FunctionResult(r) = m {
            let text = harness_types::message::joined_text(&r.content);
            let head: String = text.chars().take(KEPT_CHARS).collect();
            r.content = vec![ContentBlock::text(pruned_text(tokens, &head))];
            pruned += 1;
        }
    }
    pruned
}

#[cfg(test)]
mod tests {
    use super::*;
    use harness_types::context::ModelRef;

    fn call(id: &str) -> AgentMessage {
        crate::fixtures::assistant(Some(id))
    }

    use crate::fixtures::result;

    #[test]
    fn only_aged_oversized_results_are_pruned() {
        let big = "z".repeat(20_000);
        let mut history = vec![
            AgentMessage::user_text("go", 0),
            call("a"),
            result("a", big.clone()), // aged (3 answers after), big: pruned
            call("b"),
            result("b", "small"), // aged but small: kept
            call("c"),
            result("c", big.clone()), // one answer after: too recent
            call("d"),
            result("d", big.clone()), // the latest: kept
        ];
        let counter = Counter::new(&ModelRef {
            id: "local".into(),
            provider: None,
        });
        assert_eq!(prune(&mut history, &counter), 1);
        let text = |m: &AgentMessage| harness_types::message::joined_text(m.content());
        assert!(
            text(&history[2]).starts_with("[pruned from the context"),
            "{}",
            text(&history[2])
        );
        assert!(text(&history[2]).len() < 1_000);
        assert_eq!(text(&history[4]), "small");
        assert_eq!(text(&history[6]), big);
        assert_eq!(text(&history[8]), big);
        // The call ids are untouched: every call still has its result.
        assert!(
            matches!(&history[2], AgentMessage::FunctionResult(r) if r.function_call_id == "a")
        );
    }
}
