//! The repeated-failure breaker: the third identical call that failed twice with the identical
//! error is answered locally, without running the target again.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::record::FailedCall;

/// Failures before the breaker answers.
pub(crate) const TRIP_AFTER: u32 = 2;

/// FNV-1a, 64 bit: a stable digest (std's hasher is randomly seeded per process).
pub(crate) fn digest(text: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in text.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// JSON with object keys sorted at every level, so equal values have equal text.
pub(crate) fn canonical(value: &Value) -> String {
    fn sort(v: &Value) -> Value {
        match v {
            Value::Object(m) => {
                let sorted: BTreeMap<&String, Value> =
                    m.iter().map(|(k, v)| (k, sort(v))).collect();
                Value::Object(sorted.into_iter().map(|(k, v)| (k.clone(), v)).collect())
            }
            Value::Array(a) => Value::Array(a.iter().map(sort).collect()),
            other => other.clone(),
        }
    }
    sort(value).to_string()
}

/// The breaker key of a call, on the arguments as the model wrote them.
pub(crate) fn key(function_id: &str, arguments: &Value) -> String {
    digest(&format!("{function_id}\u{0}{}", canonical(arguments)))
}

pub(crate) fn tripped(ledger: &BTreeMap<String, FailedCall>, key: &str) -> bool {
    ledger.get(key).is_some_and(|f| f.count >= TRIP_AFTER)
}

/// Records a target's outcome: a failure counts up while the error stays the same; a success
/// clears the key.
pub(crate) fn record(
    ledger: &mut BTreeMap<String, FailedCall>,
    key: &str,
    failed: bool,
    error_text: &str,
) {
    if !failed {
        ledger.remove(key);
        return;
    }
    let error = digest(error_text);
    match ledger.get_mut(key) {
        Some(f) if f.error == error => f.count += 1,
        _ => {
            ledger.insert(key.to_string(), FailedCall { error, count: 1 });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn trips_after_two_identical_failures_only() {
        let mut l = BTreeMap::new();
        let k = key("a::b", &json!({"x": 1, "y": [1, 2]}));
        assert_eq!(
            k,
            key("a::b", &json!({"y": [1, 2], "x": 1})),
            "key order does not matter"
        );
        record(&mut l, &k, true, "boom");
        assert!(!tripped(&l, &k));
        record(&mut l, &k, true, "other error");
        assert!(!tripped(&l, &k), "a different error restarts the count");
        record(&mut l, &k, true, "other error");
        assert!(tripped(&l, &k));
        record(&mut l, &k, false, "");
        assert!(!tripped(&l, &k), "a success clears it");
    }
}
