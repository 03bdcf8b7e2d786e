//! Strict payload parsing that names the offending field.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::HarnessError;

/// What kind of JSON value `v` is, as an error message names it ("an array").
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Deserializes a function payload. A failure becomes `harness/invalid_request: <path>: <why>`,
/// where `<path>` is the field that failed (`options.max_turns`, `message.content[0].text`).
///
/// Engine decorations (top-level keys starting with `_`, such as `_caller_worker_id`) are removed
/// first, so strict types still accept payloads routed through an engine.
pub fn parse_payload<T: DeserializeOwned>(payload: Value) -> Result<T, HarnessError> {
    if !payload.is_object() {
        // serde would take an array as a struct's fields in order: never what a caller meant.
        return Err(HarnessError::invalid(format!(
            "payload: must be a JSON object (got {})",
            json_kind(&payload)
        )));
    }
    let payload = strip_engine_fields(payload);
    // Read as it is first: a payload is almost always well formed, and tracking the path costs
    // an allocation per key passed (a few % of a step, on every call). Only a refused payload
    // is read again, to name the field.
    if let Ok(parsed) = T::deserialize(&payload) {
        return Ok(parsed);
    }
    serde_path_to_error::deserialize::<_, T>(payload).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner().to_string();
        // serde_json appends " at line L column C" to some messages; on a Value it is noise.
        let inner = inner
            .split(" at line ")
            .next()
            .unwrap_or(inner.as_str())
            .to_string();
        let root = path == "." || path.is_empty();
        // A missing field is reported on its parent; name the field itself.
        if let Some(name) = inner
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next())
        {
            let field = if root {
                name.to_string()
            } else {
                format!("{path}.{name}")
            };
            return HarnessError::invalid(format!("{field}: missing field `{name}`"));
        }
        if root {
            HarnessError::invalid(format!("payload: {inner}"))
        } else {
            HarnessError::invalid(format!("{path}: {inner}"))
        }
    })
}

/// Removes top-level `_`-prefixed keys added by an engine.
pub fn strip_engine_fields(payload: Value) -> Value {
    match payload {
        Value::Object(mut map) => {
            map.retain(|k, _| !k.starts_with('_'));
            Value::Object(map)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Inner {
        n: u32,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Outer {
        name: String,
        inner: Option<Inner>,
    }

    #[test]
    fn errors_name_the_nested_field() {
        let err = parse_payload::<Outer>(json!({"name": "x", "inner": {"n": "five"}})).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("harness/invalid_request: inner.n: invalid type"),
            "{err}"
        );
    }

    #[test]
    fn missing_fields_are_named() {
        let err = parse_payload::<Outer>(json!({})).unwrap_err();
        assert_eq!(err.message, "name: missing field `name`");
        let err = parse_payload::<Outer>(json!({"name": "x", "inner": {}})).unwrap_err();
        assert_eq!(err.message, "inner.n: missing field `n`");
    }

    #[test]
    fn non_object_payloads_are_refused() {
        let err = parse_payload::<Outer>(json!(["x", null])).unwrap_err();
        assert_eq!(err.message, "payload: must be a JSON object (got an array)");
    }

    #[test]
    fn engine_decoration_is_tolerated() {
        let ok = parse_payload::<Outer>(json!({"name": "x", "_caller_worker_id": "w"}));
        assert!(ok.is_ok());
    }
}
