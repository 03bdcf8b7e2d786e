//! Fenced turn records: how several harness workers on one engine keep a stale worker's write
//! from landing.
//!
//! The engine's state has no compare-and-swap, but `state::update` applies its ops atomically
//! under the store's lock and answers the value after them. So a turn record is stored as one
//! slot per lease epoch, `{"_harness_key": key, "_harness_epoch_<epoch>": record, ...}`: a writer
//! sets only its own epoch's slot, and the record is the newest slot. A worker that took the
//! session over holds a higher epoch (minted by an atomic `increment` on the session's lease
//! row), so a write by the worker it replaced lands in a lower slot nobody reads, and that
//! worker sees the higher slot in the answer and is told its write was refused.

use serde_json::{json, Map, Value};

use crate::codec::STATE_KEY_FIELD;

/// The scope whose values are fenced: the loop's turn records, one key per session.
pub const FENCED_SCOPE: &str = "harness_turn";
/// The per-session lease rows: `{_harness_key, epoch, holder}`.
pub const LEASE_SCOPE: &str = "harness_lease";

const SLOT_PREFIX: &str = "_harness_epoch_";

/// The slot of an epoch (zero-padded so the slots sort as their epochs).
pub fn slot(epoch: u64) -> String {
    format!("{SLOT_PREFIX}{epoch:020}")
}

fn epoch_of(field: &str) -> Option<u64> {
    field.strip_prefix(SLOT_PREFIX)?.parse().ok()
}

/// The epochs present in a stored value, ascending (empty for a value stored unfenced).
pub fn epochs(stored: &Value) -> Vec<u64> {
    let mut out: Vec<u64> = stored
        .as_object()
        .map(|m| m.keys().filter_map(|k| epoch_of(k)).collect())
        .unwrap_or_default();
    out.sort_unstable();
    out
}

/// The record a reader sees: the newest slot, with its epoch. None when the value has no slot.
pub fn newest(stored: &Value) -> Option<(u64, Value)> {
    let epoch = *epochs(stored).last()?;
    Some((epoch, stored[slot(epoch).as_str()].clone()))
}

/// The `state::update` request writing `record` in `epoch`'s slot (and the key beside it, so
/// `state::list`, which answers values only, still tells the key).
pub fn write_request(scope: &str, key: &str, epoch: u64, record: &Value) -> Value {
    json!({"scope": scope, "key": key, "ops": [
        {"type": "set", "path": STATE_KEY_FIELD, "value": key},
        {"type": "set", "path": slot(epoch), "value": record},
    ]})
}

/// The `state::update` request removing the slots of `epochs` (older than the one written).
pub fn prune_request(scope: &str, key: &str, epochs: &[u64]) -> Value {
    let ops: Vec<Value> = epochs
        .iter()
        .map(|e| json!({"type": "remove", "path": slot(*e)}))
        .collect();
    json!({"scope": scope, "key": key, "ops": ops})
}

/// The `state::update` request taking a session's lease: the epoch goes up by one, atomically,
/// whoever else asks at the same moment, so every taker gets its own epoch.
pub fn take_lease_request(session_id: &str, holder: &str) -> Value {
    json!({"scope": LEASE_SCOPE, "key": session_id, "ops": [
        {"type": "increment", "path": "epoch", "by": 1},
        {"type": "set", "path": "holder", "value": holder},
        {"type": "set", "path": STATE_KEY_FIELD, "value": session_id},
    ]})
}

/// What the write-ahead copy and the barrier compare for a fenced key: the epoch and the
/// record of the newest slot (null when there is none). Other slots and their pruning do not
/// change it.
pub fn effective(stored: &Value) -> Value {
    match newest(stored) {
        Some((epoch, record)) => json!({"epoch": epoch, "record": record}),
        None => Value::Null,
    }
}

/// The comparison value of a write of `record` at `epoch` (see [`effective`]).
pub fn written(epoch: u64, record: &Value) -> Value {
    json!({"epoch": epoch, "record": record})
}

/// A fenced value read back as `(key, record)`, or None when it holds no slot.
pub fn read(stored: &Value) -> Option<(Option<String>, Value)> {
    let (_, record) = newest(stored)?;
    let key = stored
        .get(STATE_KEY_FIELD)
        .and_then(Value::as_str)
        .map(str::to_string);
    Some((key, record))
}

/// An empty object (a fenced value whose slots were all removed reads as absent).
pub fn is_empty_slots(stored: &Value) -> bool {
    stored
        .as_object()
        .is_some_and(|m: &Map<String, Value>| m.keys().all(|k| k == STATE_KEY_FIELD))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_slot_is_the_record_whatever_was_written_after_it() {
        let mut stored = json!({"_harness_key": "s"});
        stored[slot(2)] = json!({"step": 5});
        // A stale writer (epoch 1) wrote after the epoch-2 holder: its slot is not read.
        stored[slot(1)] = json!({"step": 9});
        assert_eq!(epochs(&stored), vec![1, 2]);
        assert_eq!(newest(&stored), Some((2, json!({"step": 5}))));
        assert_eq!(read(&stored), Some((Some("s".into()), json!({"step": 5}))));
        assert_eq!(effective(&stored), written(2, &json!({"step": 5})));
        // Epoch 10 sorts after 9 (the slots are zero-padded).
        stored[slot(10)] = json!({"step": 6});
        stored[slot(9)] = json!({"step": 7});
        assert_eq!(newest(&stored).unwrap().0, 10);
    }

    #[test]
    fn an_unfenced_value_has_no_slot() {
        assert_eq!(newest(&json!({"_harness_key": "s", "step": 1})), None);
        assert_eq!(effective(&Value::Null), Value::Null);
        assert!(is_empty_slots(&json!({"_harness_key": "s"})));
        assert!(!is_empty_slots(&json!({"_harness_key": "s", "x": 1})));
    }

    #[test]
    fn requests_use_the_engine_update_ops() {
        let w = write_request("harness_turn", "s", 3, &json!({"a": 1}));
        assert_eq!(w["ops"][1]["type"], "set");
        assert_eq!(w["ops"][1]["path"], slot(3));
        let l = take_lease_request("s", "w1");
        assert_eq!(
            l["ops"][0],
            json!({"type": "increment", "path": "epoch", "by": 1})
        );
        let p = prune_request("harness_turn", "s", &[1, 2]);
        assert_eq!(p["ops"].as_array().unwrap().len(), 2);
        assert_eq!(p["ops"][0]["type"], "remove");
    }
}
