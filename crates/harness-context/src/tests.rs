use harness_types::context::{AssembleOptions, ModelRef, PreviousSummary};
use harness_types::message::AgentMessage;

use super::*;

fn req(messages: Vec<AgentMessage>, window: u64) -> AssembleRequest {
    AssembleRequest {
        messages,
        model: ModelRef {
            id: "local".into(),
            provider: None,
        },
        system_prompt: Some("be brief".into()),
        tools: vec![],
        options: AssembleOptions {
            request_overhead_tokens: 64,
            context_window: window,
            ..AssembleOptions::default()
        },
    }
}

fn call(id: &str) -> AgentMessage {
    crate::fixtures::assistant(Some(id))
}

fn result(id: &str, chars: usize) -> AgentMessage {
    crate::fixtures::result(id, "r".repeat(chars))
}

#[tokio::test]
async fn fits_and_counts_prompt_and_overhead() {
    let out = assemble(
        None,
        req(vec![AgentMessage::user_text("hello there", 0)], 1000),
    )
    .await
    .unwrap();
    // Nothing changed: the answer says so instead of echoing the history back.
    assert!(out.unchanged && out.messages.is_empty());
    // "hello there" = 11 chars / 3.8 → 3, + 4 per message; "be brief" → 3 + 4; + 64.
    assert_eq!(out.token_count, 3 + 4 + 3 + 4 + 64);
    assert!(!out.applied.compacted);
}

#[tokio::test]
async fn overflow_without_a_summarizer_is_a_clean_error() {
    // Each message fits alone (~267 tokens of 429), the three together do not.
    let history = vec![
        AgentMessage::user_text("x".repeat(1000), 0),
        AgentMessage::user_text("y".repeat(1000), 0),
        AgentMessage::user_text("z".repeat(1000), 0),
    ];
    let err = assemble(None, req(history, 500)).await.unwrap_err();
    assert!(matches!(err, ContextError::Overflow(_)), "{err}");
    assert!(err.to_string().starts_with("context/overflow:"), "{err}");
}

#[tokio::test]
async fn a_message_that_alone_cannot_fit_is_named_with_its_size_and_the_window() {
    let history = vec![
        AgentMessage::user_text("hello", 0),
        AgentMessage::user_text("x".repeat(4000), 0),
    ];
    let err = assemble(None, req(history, 500)).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, ContextError::MessageTooLarge { index: 1, .. }),
        "{err}"
    );
    assert_eq!(err.code(), "context/message_too_large");
    // 4,000 characters / 3.8 = 1,053 tokens + 4 of framing.
    assert!(
        text.contains("~1057 tokens") && text.contains("500-token window"),
        "{text}"
    );
    assert_eq!(crate::too_large_index(&text), Some(1));
    assert_eq!(
        crate::too_large_index("context/overflow: message 1 of"),
        None
    );
}

#[tokio::test]
async fn dense_digits_are_counted_a_token_each() {
    // 3,000 digits: what llama-cpp-python counted 3,001 tokens (recorded), not 3,000 / 3.8.
    let digits: String = (0..3000)
        .map(|i| char::from(b'0' + (i % 10) as u8))
        .collect();
    let err = assemble(None, req(vec![AgentMessage::user_text(digits, 0)], 2048))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("~3004 tokens"), "{err}");
}

#[tokio::test]
async fn pruning_makes_room_before_compaction() {
    let mut history = vec![AgentMessage::user_text("go", 0)];
    for i in 0..6 {
        history.push(call(&format!("c{i}")));
        history.push(result(&format!("c{i}"), 8_000));
    }
    // Six results of ~2,100 tokens each do not fit 8k; pruned, the four aged ones shrink (the two latest stay whole).
    let mut r = req(history.clone(), 8_000);
    let err = assemble(None, r.clone()).await.unwrap_err();
    assert!(matches!(err, ContextError::Overflow(_)));
    r.options.prune_function_results = true;
    let out = assemble(None, r).await.unwrap();
    assert_eq!(out.applied.pruned_results, 4);
    assert!(!out.applied.compacted && !out.unchanged);
    assert!(out.token_count <= out.usable);
    assert_eq!(out.messages.len(), history.len());
}

#[tokio::test]
async fn a_previous_summary_is_reused_after_the_opening_message() {
    let mut r = req(
        vec![
            AgentMessage::user_text("open", 0),
            AgentMessage::user_text("latest", 0),
        ],
        10_000,
    );
    r.options.previous_summary = Some(PreviousSummary {
        summary: "facts so far".into(),
        summarized_head_tokens: 500,
    });
    let prev = r.options.previous_summary.clone();
    let sent = std::sync::Arc::new(r.messages.clone());
    let mut out = assemble(None, r).await.unwrap();
    assert!(out.applied.reused_summary && !out.applied.compacted);
    // It fit with the summary put back: the caller's own list is used, not echoed.
    assert!(out.unchanged && out.messages.is_empty());
    let context = out.context_of(&sent, prev.as_ref(), 0);
    let texts: Vec<String> = context.iter().map(|m| m.text()).collect();
    assert_eq!(texts[0], "open");
    assert!(texts[1].starts_with(compact::SUMMARY_HEADER) && texts[1].ends_with("facts so far"));
    assert_eq!(texts[2], "latest");
}

#[test]
fn count_tokens_uses_the_family_counter() {
    let out = count_tokens(&CountTokensRequest {
        messages: vec![AgentMessage::user_text("hello world", 0)],
        model: ModelRef {
            id: "gpt-4o".into(),
            provider: Some("openai".into()),
        },
        system_prompt: None,
        tools: vec![],
    });
    assert_eq!(out.counter, "tiktoken:o200k_base");
    assert_eq!(out.tokens, 2 + count::PER_MESSAGE_OVERHEAD);
    assert_eq!(out.correction, 1.0);
}

/// With identities, a message seen before at the same place with the same identity is not
/// counted again; a new identity is counted afresh; sessions do not share counts.
#[tokio::test]
async fn counts_are_reused_by_message_identity_within_a_session() {
    let history = |last: &str| {
        vec![
            AgentMessage::user_text("open", 0),
            AgentMessage::user_text("x".repeat(380), 0),
            AgentMessage::user_text(last, 0),
        ]
    };
    let run = |messages: Vec<AgentMessage>, ids: Option<Vec<u64>>, session: &str| {
        let mut r = req(Vec::new(), 100_000);
        r.options.lease_key = Some(session.into());
        async move {
            assemble_known(None, &messages, ids.as_deref(), r)
                .await
                .unwrap()
                .token_count
        }
    };
    let short = run(history("hi"), Some(vec![1, 2, 3]), "s_counts_a").await;
    assert_eq!(short, run(history("hi"), None, "s_counts_a").await);
    // The last message grew and has a new identity: counted afresh.
    let long = "y".repeat(3_800);
    let grown = run(history(&long), Some(vec![1, 2, 4]), "s_counts_a").await;
    assert_eq!(grown, run(history(&long), None, "s_counts_a").await);
    assert!(grown >= short + 900, "{grown} vs {short}");
    // An identity is the caller's promise that the message is unchanged: the count of the
    // message it named is what is used (which is how the reuse shows).
    assert_eq!(
        run(history("hi"), Some(vec![1, 2, 4]), "s_counts_a").await,
        grown
    );
    // Another session never sees these counts.
    assert_eq!(
        run(history("hi"), Some(vec![1, 2, 4]), "s_counts_b").await,
        short
    );
}

/// A history that fits as sent is answered from its counts (`unchanged`); the same history
/// through the full assembly (a custom message makes it not as sent) counts the same tokens
/// with the same usage correction, the summary and the calibrating reply included.
#[tokio::test]
async fn a_fit_answered_from_counts_matches_the_full_assembly() {
    use harness_types::message::{AssistantMessage, ContentBlock, CustomMessage, Usage};
    let answered = AgentMessage::Assistant(AssistantMessage {
        usage: Some(Usage {
            input: Some(1_900),
            ..Usage::default()
        }),
        ..AssistantMessage::ended(vec![ContentBlock::text("ok")], "m", "p", 0)
    });
    let history = vec![
        AgentMessage::user_text("x".repeat(3_800), 0),
        answered,
        AgentMessage::user_text("y".repeat(380), 0),
    ];
    let summarized = |messages: Vec<AgentMessage>| {
        let mut r = req(messages, 100_000);
        r.options.previous_summary = Some(PreviousSummary {
            summary: "z".repeat(760),
            summarized_head_tokens: 500,
        });
        r
    };
    let fast = assemble(None, summarized(history.clone())).await.unwrap();
    let mut with_custom = history;
    with_custom.push(AgentMessage::Custom(CustomMessage {
        custom_type: "note".into(),
        content: vec![ContentBlock::text("not for the model")],
        display: None,
        details: None,
        timestamp: 0,
    }));
    let full = assemble(None, summarized(with_custom)).await.unwrap();
    assert!(fast.unchanged && !full.unchanged);
    assert_eq!(full.messages.len(), 4);
    assert_eq!(fast.token_count, full.token_count);
    assert_eq!(
        fast.applied.initial_token_count,
        full.applied.initial_token_count
    );
    assert!(fast.applied.reused_summary && full.applied.reused_summary);
    let correction = fast.correction.unwrap();
    assert_eq!(Some(correction), full.correction);
    // The reply's usage calibrated both (1,900 reported for ~1,300 counted).
    assert!(correction > 1.2, "{correction}");
}
