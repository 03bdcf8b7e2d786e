//! The digest an approval is bound to, and the deterministic approval id.

use harness_types::digest::{canonical, sha256_hex};
use harness_types::ids::san;
use serde_json::{Map, Value};

/// `sha256:<64 hex>` of the canonical JSON of `{"arguments": …, "function_id": …}`: object keys
/// sorted at every depth, no whitespace, so the same call always gets the same digest whatever
/// order its keys arrived in. The function id is part of it: an approval for `fs::read` with
/// some arguments is not an approval for `fs::delete` with the same ones.
pub fn digest(function_id: &str, arguments: &Value) -> String {
    let mut shown = Map::new();
    shown.insert("arguments".into(), canonical(arguments));
    shown.insert("function_id".into(), Value::String(function_id.into()));
    let text = Value::Object(shown).to_string();
    format!("sha256:{}", sha256_hex(text.as_bytes()))
}

/// The approval id of one call of one turn: `ap_` + 32 hex of a SHA-256 over the injectively
/// escaped `(session_id, turn_id, function_call_id)`. Deterministic, so a re-delivered gate call
/// finds the record it wrote before; including the turn keeps a call id the model reuses in a
/// later turn from meeting an old decision.
pub fn approval_id(session_id: &str, turn_id: &str, function_call_id: &str) -> String {
    // `san` escapes ':', so the joined key is injective.
    let key = format!(
        "{}:{}:{}",
        san(session_id),
        san(turn_id),
        san(function_call_id)
    );
    format!("ap_{}", &sha256_hex(key.as_bytes())[..32])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_does_not_matter_values_do() {
        let a = json!({"path": "/a", "opts": {"x": 1, "y": [1, {"b": 2, "a": 1}]}});
        let b: Value =
            serde_json::from_str(r#"{"opts": {"y": [1, {"a": 1, "b": 2}], "x": 1}, "path": "/a"}"#)
                .unwrap();
        assert_eq!(digest("fs::write", &a), digest("fs::write", &b));
        assert_ne!(
            digest("fs::write", &a),
            digest("fs::write", &json!({"path": "/b"}))
        );
        assert_ne!(digest("fs::write", &a), digest("fs::delete", &a));
        assert_ne!(
            digest("f", &json!({"y": [1, 2]})),
            digest("f", &json!({"y": [2, 1]}))
        );
        assert!(digest("f", &json!(null)).starts_with("sha256:"));
        assert_eq!(digest("f", &json!(null)).len(), "sha256:".len() + 64);
    }

    #[test]
    fn approval_ids_are_injective_over_their_parts() {
        assert_ne!(approval_id("a:b", "c", "d"), approval_id("a", "b:c", "d"));
        assert_ne!(approval_id("s", "t1", "c1"), approval_id("s", "t2", "c1"));
        assert_eq!(approval_id("s", "t", "c"), approval_id("s", "t", "c"));
        assert!(approval_id("s", "t", "c").starts_with("ap_"));
    }
}
