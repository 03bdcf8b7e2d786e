//! A bounded cache of recently read `kv` values, so that the loop's repeated point reads (the
//! turn record, two or three times a step) skip SQLite.
//!
//! Why it pays: a reader connection's page cache is emptied whenever the database changed since
//! its last read, which under load is every read, so each `kv_get` re-reads every page on its
//! path (a `pread` each). Why it is safe:
//!
//! * Only readers fill it, with what a read transaction returned, and only if no kv change was
//!   committed since just before that read began ([`KvCache::generation`]).
//! * Only the writer empties it: an update hook on the writer connection records the rowid of
//!   every `kv` row any statement inserts, updates or deletes (raw SQL included), and after the
//!   batch COMMIT, before any write of the batch is answered, every cached key with one of those
//!   rowids is dropped and the generation moves on. A rolled-back change is dropped too, which is
//!   only a miss.
//!
//! So a read that starts after a write resolved never sees an older value. Absent keys are not
//! cached (a new key has a rowid nobody knows yet).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

/// Most bytes of cached values (plus keys); oldest entries go first beyond it.
const MAX_BYTES: usize = 2 << 20;

#[derive(Default)]
pub(crate) struct KvCache {
    inner: Mutex<Inner>,
    /// Rowids of `kv` rows changed by the writer since its last commit (the update hook's log).
    changed: Arc<Mutex<Vec<i64>>>,
}

#[derive(Default)]
struct Inner {
    entries: HashMap<(String, String), Cached>,
    by_rowid: HashMap<i64, (String, String)>,
    /// Insertion order, for eviction; may name keys already dropped.
    order: VecDeque<(String, String)>,
    bytes: usize,
    /// Moves on at every commit that changed `kv`.
    generation: u64,
    /// Values the writer dropped from the cache, freed by the next reader that fills it: the
    /// writer thread, which every session waits on, does not pay for the frees.
    dropped: Vec<Arc<Value>>,
}

/// The value parsed: a hit costs a clone, which is cheaper than parsing the text again.
struct Cached {
    rowid: i64,
    value: Arc<Value>,
    /// What it counts against [`MAX_BYTES`] (its stored text's length plus the key's).
    size: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A parsed value takes a few times its text; the bound is on the text.
fn cost(scope: &str, key: &str, text_len: usize) -> usize {
    scope.len() + key.len() + 3 * text_len + 64
}

impl KvCache {
    /// Where the writer connection's update hook records changed `kv` rowids.
    pub(crate) fn change_log(&self) -> Arc<Mutex<Vec<i64>>> {
        self.changed.clone()
    }

    /// Taken before a read that may [`KvCache::fill`] the cache.
    pub(crate) fn generation(&self) -> u64 {
        lock(&self.inner).generation
    }

    pub(crate) fn get(&self, scope: &str, key: &str) -> Option<Arc<Value>> {
        // The tuple key needs owned strings; a miss costs two small allocations, a hit saves
        // a read transaction and a parse.
        lock(&self.inner)
            .entries
            .get(&(scope.to_string(), key.to_string()))
            .map(|c| c.value.clone())
    }

    /// Caches what a read that began at `generation` returned, unless a kv change was committed
    /// since (the value may be older than that change).
    pub(crate) fn fill(
        &self,
        generation: u64,
        scope: &str,
        key: &str,
        rowid: i64,
        text_len: usize,
        value: Arc<Value>,
    ) {
        let size = cost(scope, key, text_len);
        if size > MAX_BYTES / 8 {
            return;
        }
        let mut inner = lock(&self.inner);
        let dropped = std::mem::take(&mut inner.dropped);
        if inner.generation != generation {
            drop(inner);
            drop(dropped);
            return;
        }
        let k = (scope.to_string(), key.to_string());
        if let Some(old) = inner
            .entries
            .insert(k.clone(), Cached { rowid, value, size })
        {
            inner.by_rowid.remove(&old.rowid);
            inner.bytes -= old.size;
        }
        inner.by_rowid.insert(rowid, k.clone());
        inner.order.push_back(k);
        inner.bytes += size;
        while inner.bytes > MAX_BYTES {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(gone) = inner.entries.remove(&oldest) {
                inner.by_rowid.remove(&gone.rowid);
                inner.bytes -= gone.size;
            }
        }
        let stale_order = inner.order.len() > 4 * inner.entries.len() + 64;
        if stale_order {
            // Keys dropped by invalidation pile up in `order`: keep only live ones.
            let entries = &inner.entries;
            let live: VecDeque<_> = inner
                .order
                .iter()
                .filter(|k| entries.contains_key(*k))
                .cloned()
                .collect();
            inner.order = live;
        }
        drop(inner);
        drop(dropped);
    }

    /// Called by the writer after a COMMIT, before answering the batch's writes: drops every
    /// key whose row a statement touched since the previous call.
    pub(crate) fn committed(&self) {
        let changed = std::mem::take(&mut *lock(&self.changed));
        if changed.is_empty() {
            return;
        }
        let mut inner = lock(&self.inner);
        inner.generation += 1;
        for rowid in changed {
            if let Some(k) = inner.by_rowid.remove(&rowid) {
                if let Some(gone) = inner.entries.remove(&k) {
                    inner.bytes -= gone.size;
                    inner.dropped.push(gone.value);
                }
            }
        }
    }
}
