//! The workspace's digests, each in one place because what they produce is stored or compared
//! across processes and builds: SHA-256 (over `ring`, which TLS already links) for approval argument
//! digests and ids and prompt cache digests; FNV-1a for short stable keys (the failure breaker's
//! ledger, hashed tool names, queue shards, scripted replies); the canonical JSON both digest.

use serde_json::{Map, Value};

/// The SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Lowercase hex of the SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// FNV-1a, 64 bit. Not std's hasher: that one is seeded per process, and these values must be the
/// same in every process and every build.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// [`fnv1a`] as 16 lowercase hex digits.
pub fn fnv1a_hex(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a(bytes))
}

/// The value with the keys of every object sorted (arrays keep their order), so equal values
/// print as equal text whatever order their keys arrived in (the workspace's `serde_json` keeps
/// insertion order).
pub fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                out.insert(k.clone(), canonical(&map[k]));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn known_sha256() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(hex(&sha256(b"abc")), sha256_hex(b"abc"));
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    // The reference values are FNV-1a 64 as its authors publish it (offset basis, "a"), and a
    // breaker key computed outside Rust: stored ledgers and hashed names depend on them.
    #[test]
    fn known_fnv1a() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a_hex(b"a"), "af63dc4c8601ec8c");
        assert_eq!(fnv1a_hex(b"boom"), "cd2fd39bc6b0130a");
        let args = json!({"path": "/a", "opts": {"y": [1, {"b": 2, "a": "é"}], "x": 1}});
        let key = format!("fs::write\u{0}{}", canonical(&args));
        assert_eq!(fnv1a_hex(key.as_bytes()), "acbe195bb0a27786");
    }

    #[test]
    fn canonical_sorts_keys_at_every_depth_and_keeps_array_order() {
        let a = json!({"path": "/a", "opts": {"y": [1, {"b": 2, "a": "é"}], "x": 1}});
        assert_eq!(
            canonical(&a).to_string(),
            r#"{"opts":{"x":1,"y":[1,{"a":"é","b":2}]},"path":"/a"}"#
        );
        let b: Value = serde_json::from_str(
            r#"{"opts": {"x": 1, "y": [1, {"a": "é", "b": 2}]}, "path": "/a"}"#,
        )
        .unwrap();
        assert_eq!(canonical(&a), canonical(&b));
        assert_ne!(
            canonical(&json!([2, 1])).to_string(),
            canonical(&json!([1, 2])).to_string()
        );
    }
}
