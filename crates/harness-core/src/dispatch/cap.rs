//! `max_result_bytes`: an oversized function result becomes a short elision marker, at capture
//! time, so the transcript and every later context agree.

use harness_types::message::ContentBlock;
use serde_json::{json, Value};

/// The floor of a non-zero cap.
const FLOOR: usize = 1024;

fn shape(value: &Value) -> String {
    match value {
        Value::Array(a) => format!("an array of {} elements", a.len()),
        Value::Object(o) => format!("an object with {} keys", o.len()),
        Value::String(s) => format!("a {}-char string", s.chars().count()),
        _ => "a value".to_string(),
    }
}

/// Caps a result; returns the replacement `(content, details)` when it was too large.
pub(crate) fn cap(
    max_bytes: usize,
    content: &[ContentBlock],
    details: &Value,
) -> Option<(Vec<ContentBlock>, Value)> {
    if max_bytes == 0 {
        return None;
    }
    let max = max_bytes.max(FLOOR);
    let size = serde_json::to_string(content).map_or(0, |s| s.len())
        + serde_json::to_string(details).map_or(0, |s| s.len());
    if size <= max {
        return None;
    }
    let kb = size.div_ceil(1024);
    let text = format!(
        "<omitted: result was ~{kb} KB ({}); it exceeds the {max}-byte result cap. Ask for less: a filter, a page or a range.>",
        shape(details)
    );
    Some((
        vec![ContentBlock::text(text)],
        json!({"result_capped": {"max_bytes": max}}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_results_pass_and_zero_turns_the_cap_off() {
        let content = vec![ContentBlock::text("x".repeat(5000))];
        assert!(cap(0, &content, &json!(null)).is_none());
        assert!(cap(8192, &content, &json!(null)).is_none());
    }

    #[test]
    fn large_results_become_a_marker_with_their_shape() {
        let details = json!({"rows": vec![1; 3000], "n": 1});
        let content = vec![ContentBlock::text(details.to_string())];
        let (c, d) = cap(10, &content, &details).unwrap();
        let text = c[0].as_text().unwrap();
        assert!(text.starts_with("<omitted: result was ~"), "{text}");
        assert!(text.contains("an object with 2 keys"), "{text}");
        assert_eq!(
            d,
            json!({"result_capped": {"max_bytes": 1024}}),
            "the floor applies"
        );
    }
}
