//! Helpers shared by the store's test files.

#![allow(dead_code)] // each test binary uses a different part of it

use harness_store::Store;

/// The keys of a kv scope, in the store's order.
pub fn kv_keys(store: &Store, scope: &str) -> Vec<String> {
    store
        .kv_list(scope)
        .unwrap()
        .into_iter()
        .map(|(k, _)| k)
        .collect()
}
