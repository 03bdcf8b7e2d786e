//! The one fold of a generation's frames into content blocks, shared by the router (the partial
//! answer it keeps for a failure) and the loop (the assistant entry it writes as frames arrive), so
//! both always agree on what a stream said.

use serde_json::{json, Value};

use crate::message::ContentBlock;
use crate::router::Frame;

/// Folds content frames into a list of blocks. A function call's arguments arrive as JSON text in
/// pieces; until `functioncall_end` the call holds `{"_partial": true}`, so a stream that breaks
/// mid-call can never leave a call that would run.
#[derive(Clone, Debug, Default)]
pub struct FrameFold {
    args_text: String,
}

impl FrameFold {
    /// Applies `frame` to `content`; true when the blocks changed. Frames that carry no content
    /// (`start`, `usage`, `ping`, the terminal ones) and argument pieces (they show only once the
    /// call ends) change nothing.
    pub fn apply(&mut self, content: &mut Vec<ContentBlock>, frame: &Frame) -> bool {
        match frame {
            Frame::TextStart => content.push(ContentBlock::text("")),
            Frame::TextDelta { delta } => match content.last_mut() {
                Some(ContentBlock::Text { text }) => text.push_str(delta),
                _ => content.push(ContentBlock::text(delta.clone())),
            },
            Frame::ThinkingStart => content.push(ContentBlock::Thinking {
                text: String::new(),
                signature: None,
            }),
            Frame::ThinkingDelta { delta } => match content.last_mut() {
                Some(ContentBlock::Thinking { text, .. }) => text.push_str(delta),
                _ => content.push(ContentBlock::Thinking {
                    text: delta.clone(),
                    signature: None,
                }),
            },
            Frame::ThinkingEnd { signature } => match content.last_mut() {
                Some(ContentBlock::Thinking { signature: s, .. }) => *s = signature.clone(),
                _ => return false,
            },
            Frame::FunctionCallStart { id, function_id } => {
                self.args_text.clear();
                content.push(ContentBlock::FunctionCall {
                    id: id.clone(),
                    function_id: function_id.clone(),
                    arguments: json!({"_partial": true}),
                });
            }
            Frame::FunctionCallDelta { delta } => {
                self.args_text.push_str(delta);
                return false;
            }
            Frame::FunctionCallEnd => {
                let Some(ContentBlock::FunctionCall { arguments, .. }) = content.last_mut() else {
                    return false;
                };
                *arguments = if self.args_text.trim().is_empty() {
                    json!({})
                } else {
                    // Text that is not JSON is kept as it came, for the model to see and fix.
                    serde_json::from_str::<Value>(&self.args_text)
                        .unwrap_or_else(|_| json!({"_raw": self.args_text.clone()}))
                };
            }
            _ => return false,
        }
        true
    }

    /// Bytes of argument text streamed for a call that has not ended (a usage estimate counts them).
    pub fn pending_args_len(&self) -> usize {
        self.args_text.len()
    }

    /// Forgets a call's argument text (a retried request starts clean).
    pub fn clear(&mut self) {
        self.args_text.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fold(frames: &[Frame]) -> (Vec<ContentBlock>, Vec<bool>) {
        let mut f = FrameFold::default();
        let mut content = Vec::new();
        let changed = frames.iter().map(|x| f.apply(&mut content, x)).collect();
        (content, changed)
    }

    #[test]
    fn text_thinking_and_a_call_fold_into_three_blocks() {
        let (content, changed) = fold(&[
            Frame::ThinkingStart,
            Frame::ThinkingDelta { delta: "hm".into() },
            Frame::ThinkingEnd {
                signature: Some("sig".into()),
            },
            Frame::TextDelta {
                delta: "Hel".into(),
            },
            Frame::TextDelta { delta: "lo".into() },
            Frame::FunctionCallStart {
                id: "c1".into(),
                function_id: "fs::read".into(),
            },
            Frame::FunctionCallDelta {
                delta: "{\"path\":".into(),
            },
            Frame::FunctionCallDelta {
                delta: "\"a\"}".into(),
            },
            Frame::FunctionCallEnd,
            Frame::Ping,
        ]);
        assert_eq!(
            changed,
            [true, true, true, true, true, true, false, false, true, false]
        );
        assert_eq!(
            content,
            vec![
                ContentBlock::Thinking {
                    text: "hm".into(),
                    signature: Some("sig".into())
                },
                ContentBlock::text("Hello"),
                ContentBlock::FunctionCall {
                    id: "c1".into(),
                    function_id: "fs::read".into(),
                    arguments: json!({"path": "a"}),
                },
            ]
        );
    }

    #[test]
    fn a_call_cut_before_its_end_stays_partial_and_bad_json_is_kept_raw() {
        let start = Frame::FunctionCallStart {
            id: "c1".into(),
            function_id: "f".into(),
        };
        let (cut, _) = fold(&[
            start.clone(),
            Frame::FunctionCallDelta { delta: "{".into() },
        ]);
        assert!(
            matches!(&cut[0], ContentBlock::FunctionCall { arguments, .. }
            if arguments == &json!({"_partial": true}))
        );
        let (raw, _) = fold(&[
            start.clone(),
            Frame::FunctionCallDelta {
                delta: "{oops".into(),
            },
            Frame::FunctionCallEnd,
        ]);
        assert!(
            matches!(&raw[0], ContentBlock::FunctionCall { arguments, .. }
            if arguments == &json!({"_raw": "{oops"}))
        );
        let (empty, _) = fold(&[start, Frame::FunctionCallEnd]);
        assert!(
            matches!(&empty[0], ContentBlock::FunctionCall { arguments, .. }
            if arguments == &json!({}))
        );
    }

    #[test]
    fn ends_without_their_block_change_nothing() {
        let (content, changed) = fold(&[
            Frame::ThinkingEnd { signature: None },
            Frame::FunctionCallEnd,
        ]);
        assert!(content.is_empty());
        assert_eq!(changed, [false, false]);
    }
}
