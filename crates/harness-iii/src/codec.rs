//! Pure payload transformations: the engine's decoration, and keys carried inside state values.

use serde_json::{Map, Value};

/// Fields the engine inserts into routed object payloads.
const DECORATION: &[&str] = &["_caller_worker_id"];

/// The field that carries a state value's key (the engine's `state::list` answers values only).
pub const STATE_KEY_FIELD: &str = "_harness_key";
const STATE_VALUE_FIELD: &str = "_harness_value";

/// Removes the engine's decoration from a routed payload (top level of an object only).
pub fn strip_decoration(mut payload: Value) -> Value {
    if let Value::Object(map) = &mut payload {
        for field in DECORATION {
            map.remove(*field);
        }
    }
    payload
}

/// The value as stored: an object gets its key inside; anything else is wrapped.
pub fn wrap_state(key: &str, value: Value) -> Value {
    match value {
        Value::Object(mut map) => {
            map.insert(STATE_KEY_FIELD.into(), Value::String(key.into()));
            Value::Object(map)
        }
        other => {
            let mut map = Map::new();
            map.insert(STATE_KEY_FIELD.into(), Value::String(key.into()));
            map.insert(STATE_VALUE_FIELD.into(), other);
            Value::Object(map)
        }
    }
}

/// The stored value read back: `(key, value)`; the key is None for a value some other writer
/// stored without one.
pub fn unwrap_state(stored: Value) -> (Option<String>, Value) {
    let stored = strip_decoration(stored);
    match stored {
        Value::Object(mut map) => {
            let key = match map.remove(STATE_KEY_FIELD) {
                Some(Value::String(k)) => Some(k),
                _ => None,
            };
            if key.is_some() && map.len() == 1 && map.contains_key(STATE_VALUE_FIELD) {
                let v = map.remove(STATE_VALUE_FIELD).unwrap_or(Value::Null);
                return (key, v);
            }
            (key, Value::Object(map))
        }
        other => (None, other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn state_values_round_trip_with_their_keys() {
        for v in [
            json!({"a": 1}),
            json!(3),
            json!("s"),
            json!([1, 2]),
            json!(null),
            json!({}),
        ] {
            let (k, back) = unwrap_state(wrap_state("k1", v.clone()));
            assert_eq!((k.as_deref(), back), (Some("k1"), v));
        }
        // An object that happens to hold the value field is not unwrapped by mistake.
        let odd = json!({"_harness_value": 1, "x": 2});
        assert_eq!(unwrap_state(wrap_state("k", odd.clone())).1, odd);
        // A foreign value has no key.
        assert_eq!(unwrap_state(json!({"x": 1})), (None, json!({"x": 1})));
    }

    #[test]
    fn decoration_is_removed_from_objects_only() {
        assert_eq!(
            strip_decoration(json!({"_caller_worker_id": "w", "a": 1})),
            json!({"a": 1})
        );
        assert_eq!(strip_decoration(json!([1])), json!([1]));
        assert_eq!(
            strip_decoration(json!({"a": {"_caller_worker_id": "kept"}})),
            json!({"a": {"_caller_worker_id": "kept"}})
        );
    }
}
