//! The repeated-failure breaker: the third identical call that failed twice with the identical
//! error is answered locally, without running the target again.

use std::collections::BTreeMap;

use harness_types::digest::{canonical, fnv1a_hex};
use serde_json::Value;

use crate::record::FailedCall;

/// Failures before the breaker answers.
pub(crate) const TRIP_AFTER: u32 = 2;

/// The breaker key of a call, on the arguments as the model wrote them.
pub(crate) fn key(function_id: &str, arguments: &Value) -> String {
    fnv1a_hex(format!("{function_id}\u{0}{}", canonical(arguments)).as_bytes())
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
    let error = fnv1a_hex(error_text.as_bytes());
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
        // Keys and error digests are stored in turn records: pinned to harness-types' FNV value.
        assert_eq!(
            key(
                "fs::write",
                &json!({"path": "/a", "opts": {"y": [1, {"b": 2, "a": "é"}], "x": 1}})
            ),
            "acbe195bb0a27786"
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
