//! An MCP `tools/call` result → the value a harness function answers (§4.11).
//!
//! Works on the MCP wire shape (`{content: [...], structuredContent, isError}`, blocks tagged
//! `text | image | audio | resource | resource_link`), so the mapping follows the protocol's
//! JSON rather than one SDK version's Rust types. The answer is `{content, is_error}` with
//! harness content blocks, which the loop's result normalization takes as they are, plus
//! `structured_content` when the server sent one (it lands in the result's `details`).
//!
//! Harness content has text and image blocks only, so: an image stays an image; an embedded
//! resource becomes its text (headed by its URI), or an image when it is an image blob; audio,
//! other blobs and resource links become a line saying what was there, never raw base64 the
//! model cannot read.

use serde_json::{json, Map, Value};

/// The harness answer for one MCP call result (wire JSON).
pub fn from_wire(result: &Value) -> Value {
    let is_error = result
        .get("isError")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let mut blocks: Vec<Value> = result
        .get("content")
        .and_then(Value::as_array)
        .map(|items| items.iter().map(block).collect())
        .unwrap_or_default();
    let structured = result.get("structuredContent").filter(|v| !v.is_null());
    if blocks.is_empty() {
        blocks.push(text(match structured {
            Some(v) => v.to_string(),
            None => "(the tool returned no content)".to_string(),
        }));
    }
    let mut out = Map::new();
    out.insert("content".into(), Value::Array(blocks));
    out.insert("is_error".into(), Value::Bool(is_error));
    if let Some(v) = structured {
        out.insert("structured_content".into(), v.clone());
    }
    Value::Object(out)
}

/// An error answer the model reads (the server is down, the call timed out, ...).
pub fn error(message: impl Into<String>) -> Value {
    json!({"content": [text(message.into())], "is_error": true})
}

fn text(s: String) -> Value {
    json!({"type": "text", "text": s})
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn block(b: &Value) -> Value {
    match str_of(b, "type") {
        Some("text") => text(str_of(b, "text").unwrap_or_default().to_string()),
        Some("image") => match (str_of(b, "data"), str_of(b, "mimeType")) {
            (Some(data), Some(mime)) => json!({"type": "image", "data": data, "mime": mime}),
            _ => text(format!("[an image block without data or mimeType: {b}]")),
        },
        Some("audio") => text(format!(
            "[audio ({}), {} base64 characters, not shown]",
            str_of(b, "mimeType").unwrap_or("unknown type"),
            str_of(b, "data").map(str::len).unwrap_or(0)
        )),
        Some("resource") => resource(b.get("resource").unwrap_or(&Value::Null)),
        Some("resource_link") => {
            let mut line = format!(
                "[resource link: {} <{}>",
                str_of(b, "name").unwrap_or("(unnamed)"),
                str_of(b, "uri").unwrap_or("")
            );
            if let Some(mime) = str_of(b, "mimeType") {
                line.push_str(&format!(" ({mime})"));
            }
            if let Some(d) = str_of(b, "description") {
                line.push_str(&format!(": {d}"));
            }
            line.push(']');
            text(line)
        }
        _ => text(b.to_string()),
    }
}

fn resource(r: &Value) -> Value {
    let uri = str_of(r, "uri").unwrap_or("");
    let mime = str_of(r, "mimeType");
    if let Some(t) = str_of(r, "text") {
        return text(format!("resource <{uri}>:\n{t}"));
    }
    match (str_of(r, "blob"), mime) {
        (Some(data), Some(m)) if m.starts_with("image/") => {
            json!({"type": "image", "data": data, "mime": m})
        }
        (Some(data), m) => text(format!(
            "[resource <{uri}> ({}): {} base64 characters of binary, not shown]",
            m.unwrap_or("unknown type"),
            data.len()
        )),
        (None, _) => text(format!("[resource <{uri}> without content]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Block shapes as the MCP specification (2025-06-18, "Tool Result") writes them.
    #[test]
    fn every_block_kind_maps_to_text_or_image() {
        let wire = json!({
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png"},
                {"type": "audio", "data": "UklGRg==", "mimeType": "audio/wav"},
                {"type": "resource", "resource": {"uri": "file:///a.txt", "mimeType": "text/plain", "text": "body"}},
                {"type": "resource", "resource": {"uri": "file:///p.png", "mimeType": "image/png", "blob": "AAAA"}},
                {"type": "resource", "resource": {"uri": "file:///z.bin", "mimeType": "application/zip", "blob": "AAAAAAAA"}},
                {"type": "resource_link", "uri": "file:///main.rs", "name": "main.rs", "mimeType": "text/x-rust", "description": "entry"}
            ],
            "isError": false
        });
        let out = from_wire(&wire);
        assert_eq!(
            out,
            json!({"content": [
                {"type": "text", "text": "hello"},
                {"type": "image", "data": "iVBORw0KGgo=", "mime": "image/png"},
                {"type": "text", "text": "[audio (audio/wav), 8 base64 characters, not shown]"},
                {"type": "text", "text": "resource <file:///a.txt>:\nbody"},
                {"type": "image", "data": "AAAA", "mime": "image/png"},
                {"type": "text", "text": "[resource <file:///z.bin> (application/zip): 8 base64 characters of binary, not shown]"},
                {"type": "text", "text": "[resource link: main.rs <file:///main.rs> (text/x-rust): entry]"}
            ], "is_error": false})
        );
        // The loop reads these as harness content blocks.
        let blocks: Vec<harness_types::message::ContentBlock> =
            serde_json::from_value(out["content"].clone()).unwrap();
        assert_eq!(blocks.len(), 7);
    }

    #[test]
    fn errors_and_structured_results_are_kept() {
        let out = from_wire(&json!({"content": [{"type": "text", "text": "no"}], "isError": true}));
        assert_eq!(out["is_error"], true);
        let out = from_wire(&json!({"content": [], "structuredContent": {"n": 3}}));
        assert_eq!(
            out["content"],
            json!([{"type": "text", "text": "{\"n\":3}"}])
        );
        assert_eq!(out["structured_content"], json!({"n": 3}));
        assert_eq!(out["is_error"], false);
        let out = from_wire(&json!({"content": []}));
        assert_eq!(out["content"][0]["text"], "(the tool returned no content)");
    }
}
