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
//! * A change the writer appends to the kv log (`kv_log.rs`) touches no `kv` row: the log's
//!   append names its key instead, and the same step drops that key (and what was remembered
//!   absent or empty of it). A value cached from the log has no row until the fold writes it
//!   back, which then tells the cache its row; the fold's own row changes drop nothing.
//!
//! So a read that starts after a write resolved never sees an older value.
//!
//! It also remembers what is *not* there: keys a read found absent and scopes a list found
//! empty (the loop asks for the steering queue and the tombstone of a session on every step,
//! and they are almost always empty). A new row has a rowid nobody knew, so the update hook
//! logs inserted rowids apart; before the batch COMMIT the writer reads their scope and key
//! (in its own transaction, where they are), and the commit step that moves the generation
//! on forgets those keys and scopes. Fills follow the same generation rule as values. Rows
//! never change scope or key (the one upsert leaves both alone), so only inserts add a key.
//!
//! Writes fill it too (write-through), because the loop reads back what it just wrote (the turn
//! record, at the next step) and a read-filled entry never survives its own row's next write.
//! A write made with [`kv_put_cached_in`](crate::kv::kv_put_cached_in) on the writer thread
//! leaves a pending fill (the parsed value it wrote, its rowid, and where the change log stood
//! after its statement). The writer's batch drops pending fills with whatever it rolls back;
//! after the COMMIT, a fill whose row no later statement of the batch touched (the change log
//! says) goes into the cache, in the same step that drops the changed keys.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::Value;

/// Most bytes of cached values (plus keys); oldest entries go first beyond it.
const MAX_BYTES: usize = 2 << 20;

/// Most dropped values waiting for a reader to free them. Every write of a cached row drops
/// the value it replaces, and with write-through fills reads rarely miss, so without a bound
/// they piled up for as long as the process ran (about 11 KB per session written).
const MAX_DROPPED: usize = 256;

/// Most absent keys, and most empty scopes, remembered; past it the set starts over.
const MAX_NEGATIVE: usize = 32 * 1024;

#[derive(Default)]
pub(crate) struct KvCache {
    inner: Mutex<Inner>,
    /// Rowids of `kv` rows changed by the writer since its last commit (the update hook's log).
    changed: Arc<Mutex<Vec<i64>>>,
    /// Rowids of `kv` rows inserted since the writer last resolved them (see the module docs).
    inserted: Arc<Mutex<Vec<i64>>>,
    /// Keys whose new version the writer appended to the kv log since its last commit
    /// (`kv_log.rs`): a log write changes no `kv` row, so the update hook does not see it.
    changed_keys: Mutex<Vec<(String, String)>>,
    /// Write-through fills of the batch in progress (writer thread only), in statement order.
    pending: Mutex<Vec<Fill>>,
    /// The kv log's state (`kv_log.rs`).
    pub(crate) log: crate::kv_log::LogState,
}

/// A value the writer wrote, to be cached if the batch commits with it.
struct Fill {
    key: (String, String),
    /// Length of the changed keys right after the write's append to the kv log: a later entry
    /// with the same key is a later version of it in this batch.
    at_key: usize,
    text_len: usize,
    value: Stored,
}

thread_local! {
    /// The cache of the store whose writer runs on this thread (set when the writer starts).
    static WRITER_CACHE: RefCell<Option<Arc<KvCache>>> = const { RefCell::new(None) };
}

/// Makes the current thread `cache`'s writer: writes made here may leave pending fills.
pub(crate) fn install_writer(cache: Arc<KvCache>) {
    WRITER_CACHE.with(|c| *c.borrow_mut() = Some(cache));
}

/// Records a write-through fill for the batch in progress; a no-op off a writer thread.
pub(crate) fn pend_fill(scope: &str, key: &str, text_len: usize, value: Stored) {
    WRITER_CACHE.with(|c| {
        if let Some(cache) = c.borrow().as_ref() {
            cache.pend(scope, key, text_len, value);
        }
    });
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
    /// Values the writer dropped from the cache, freed by the next reader that looks it up:
    /// the writer thread, which every session waits on, does not pay for the frees. Bounded
    /// ([`MAX_DROPPED`]): with no reader about, the writer frees them after all.
    dropped: Vec<Stored>,
    /// Keys a read found absent, and scopes a list found empty, since no insert says otherwise.
    absent: HashSet<(String, String)>,
    empty: HashSet<String>,
}

/// [`KvCache::lookup`]'s answer.
pub(crate) enum Lookup {
    Hit(Stored),
    /// A read since the last insert of the key found it absent.
    Absent,
    Unknown,
}

/// The keys of the rows a batch inserted, read by the writer before its COMMIT.
pub(crate) enum Inserted {
    Keys(Vec<(String, String)>),
    /// They could not be read: every negative entry goes.
    Unknown,
}

impl Default for Inserted {
    fn default() -> Self {
        Inserted::Keys(Vec::new())
    }
}

/// The writer thread's cache, if the current thread is a store's writer.
pub(crate) fn writer_cache() -> Option<Arc<KvCache>> {
    WRITER_CACHE.with(|c| c.borrow().clone())
}

/// A cached value, in the form its writer or first reader had it: a hit costs a clone, which
/// is cheaper than parsing the text again.
#[derive(Clone)]
pub(crate) enum Stored {
    Parsed(Arc<Value>),
    /// The JSON text, for readers that parse into their own type (the turn record): they skip
    /// the `Value` tree, whose building and freeing cost more than the parse itself.
    Text(Arc<str>),
}

struct Cached {
    /// The `kv` row it was read from (None: from the kv log, or a logged write).
    rowid: Option<i64>,
    value: Stored,
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

    /// Where the update hook records inserted `kv` rowids.
    pub(crate) fn insert_log(&self) -> Arc<Mutex<Vec<i64>>> {
        self.inserted.clone()
    }

    /// The scope and key of every row inserted since the last call that is still there, read
    /// on the writer's connection inside the batch transaction. A row inserted and deleted in
    /// the batch is gone and changed nothing.
    pub(crate) fn inserted_keys(&self, conn: &rusqlite::Connection) -> Inserted {
        let rowids = std::mem::take(&mut *lock(&self.inserted));
        let mut keys = Vec::with_capacity(rowids.len());
        if rowids.is_empty() {
            return Inserted::Keys(keys);
        }
        let Ok(mut stmt) = conn.prepare_cached("SELECT scope, key FROM kv WHERE rowid = ?1") else {
            return Inserted::Unknown;
        };
        for rowid in rowids {
            match stmt.query_row([rowid], |r| Ok((r.get(0)?, r.get(1)?))) {
                Ok(key) => keys.push(key),
                Err(rusqlite::Error::QueryReturnedNoRows) => {}
                Err(_) => return Inserted::Unknown,
            }
        }
        Inserted::Keys(keys)
    }

    /// Whether a list since the last insert into `scope` found it empty.
    pub(crate) fn is_empty_scope(&self, scope: &str) -> bool {
        lock(&self.inner).empty.contains(scope)
    }

    /// Remembers that a read that began at `generation` found no `key` (see [`KvCache::fill`]).
    pub(crate) fn fill_absent(&self, generation: u64, scope: &str, key: &str) {
        let k = (scope.to_string(), key.to_string());
        let mut inner = lock(&self.inner);
        if inner.generation != generation {
            return;
        }
        if inner.absent.len() >= MAX_NEGATIVE {
            inner.absent.clear();
        }
        inner.absent.insert(k);
    }

    /// Remembers that a list that began at `generation` found `scope` empty.
    pub(crate) fn fill_empty(&self, generation: u64, scope: &str) {
        let mut inner = lock(&self.inner);
        if inner.generation != generation {
            return;
        }
        if inner.empty.len() >= MAX_NEGATIVE {
            inner.empty.clear();
        }
        inner.empty.insert(scope.to_string());
    }

    /// Forgets the negative entries `inserted` contradicts (a batch whose COMMIT failed).
    pub(crate) fn forget(&self, inserted: &Inserted) {
        lock(&self.inner).forget(inserted);
    }

    /// Records that a version of `scope`/`key` was appended to the kv log (writer thread).
    pub(crate) fn key_changed(&self, scope: &str, key: &str) {
        lock(&self.changed_keys).push((scope.to_string(), key.to_string()));
    }

    /// Where the rowid change and insert logs stand: a mark to [`KvCache::unchange_since`].
    pub(crate) fn change_mark(&self) -> (usize, usize) {
        (lock(&self.changed).len(), lock(&self.inserted).len())
    }

    /// Forgets the row changes and inserts logged since `mark`: the kv log's fold writes into
    /// `kv` the versions readers already see (from the log, or cached from it), so what it
    /// changes must not empty the cache of every key it folds, and the keys it inserts were
    /// forgotten as absent when their logged versions committed (nor need the writer read
    /// each one back before the COMMIT).
    pub(crate) fn unchange_since(&self, mark: (usize, usize)) {
        lock(&self.changed).truncate(mark.0);
        lock(&self.inserted).truncate(mark.1);
    }

    /// The kv log's fold wrote these keys back into `kv` rows (after its COMMIT): a cached
    /// value of one, which no row held, is keyed by its row from now on, so that a later
    /// change of the row invalidates it like any other.
    pub(crate) fn rows_written_back(&self, rows: crate::kv_log::WrittenBack) {
        let mut inner = lock(&self.inner);
        for (k, rowid) in rows {
            if let Some(cached) = inner.entries.get_mut(&k) {
                if cached.rowid.is_none() {
                    cached.rowid = Some(rowid);
                    inner.by_rowid.insert(rowid, k);
                }
            }
        }
    }

    /// How many fills are pending: a mark to [`KvCache::drop_pending_since`].
    pub(crate) fn pending_mark(&self) -> usize {
        lock(&self.pending).len()
    }

    /// Forgets the fills of writes that were rolled back (those pending since `mark`).
    pub(crate) fn drop_pending_since(&self, mark: usize) {
        lock(&self.pending).truncate(mark);
    }

    fn pend(&self, scope: &str, key: &str, text_len: usize, value: Stored) {
        if cost(scope, key, text_len) > MAX_BYTES / 8 {
            return;
        }
        let at_key = lock(&self.changed_keys).len();
        lock(&self.pending).push(Fill {
            key: (scope.to_string(), key.to_string()),
            at_key,
            text_len,
            value,
        });
    }

    /// Taken before a read that may [`KvCache::fill`] the cache.
    pub(crate) fn generation(&self) -> u64 {
        lock(&self.inner).generation
    }

    /// What the cache knows of `key`: its value, that it is absent, or nothing. One lock and
    /// one key for all three answers (a miss is followed by a SQLite read).
    pub(crate) fn lookup(&self, scope: &str, key: &str) -> Lookup {
        // The tuple key needs owned strings (two small allocations, which a hit repays many
        // times over); they are made before the lock, which every step's reads share.
        let k = (scope.to_string(), key.to_string());
        let mut inner = lock(&self.inner);
        let found = match inner.entries.get(&k) {
            Some(c) => Lookup::Hit(c.value.clone()),
            None if inner.absent.contains(&k) => Lookup::Absent,
            None => Lookup::Unknown,
        };
        let dropped = std::mem::take(&mut inner.dropped);
        drop(inner);
        drop(dropped);
        found
    }

    /// Caches what a read that began at `generation` returned, unless a kv change was committed
    /// since (the value may be older than that change).
    pub(crate) fn fill(
        &self,
        generation: u64,
        scope: &str,
        key: &str,
        rowid: Option<i64>,
        text_len: usize,
        value: Stored,
    ) {
        let size = cost(scope, key, text_len);
        if size > MAX_BYTES / 8 {
            return;
        }
        let k = (scope.to_string(), key.to_string());
        let mut inner = lock(&self.inner);
        let dropped = std::mem::take(&mut inner.dropped);
        if inner.generation != generation {
            drop(inner);
            drop(dropped);
            return;
        }
        let mut evicted = Vec::new();
        inner.insert(k, Cached { rowid, value, size }, &mut evicted);
        drop(inner);
        drop(dropped);
        drop(evicted);
    }

    /// Called by the writer after a COMMIT, before answering the batch's writes: drops every
    /// key whose row a statement touched since the previous call, and every negative entry the
    /// batch's `inserted` rows contradict.
    /// Then puts in the batch's pending fills that no later statement of the batch overwrote.
    pub(crate) fn committed(&self, inserted: &Inserted) {
        let changed = std::mem::take(&mut *lock(&self.changed));
        let changed_keys = std::mem::take(&mut *lock(&self.changed_keys));
        let fills = std::mem::take(&mut *lock(&self.pending));
        if changed.is_empty()
            && changed_keys.is_empty()
            && matches!(inserted, Inserted::Keys(k) if k.is_empty())
        {
            return;
        }
        let mut inner = lock(&self.inner);
        // In the same critical section as the generation moving on: a negative fill from a
        // read that began before the COMMIT either landed already (and goes here) or is refused.
        inner.forget(inserted);
        inner.generation += 1;
        for &rowid in &changed {
            if let Some(k) = inner.by_rowid.remove(&rowid) {
                inner.drop_entry(&k);
            }
        }
        // A logged version (or deletion) is a new value of its key, and may be its first.
        for k in &changed_keys {
            inner.drop_entry(k);
            inner.empty.remove(&k.0);
            if !inner.absent.is_empty() {
                inner.absent.remove(k);
            }
        }
        // Where each key last changed in the batch: a fill made before that was overwritten
        // (one pass, not a search of the rest of the batch per fill).
        let last_key: HashMap<&(String, String), usize> = changed_keys
            .iter()
            .enumerate()
            .map(|(i, k)| (k, i))
            .collect();
        let mut evicted = Vec::new();
        for fill in fills {
            if last_key.get(&fill.key).is_some_and(|&i| i >= fill.at_key) {
                continue;
            }
            let size = cost(&fill.key.0, &fill.key.1, fill.text_len);
            // In no row until the fold writes it back (see `rows_written_back`).
            let cached = Cached {
                rowid: None,
                value: fill.value,
                size,
            };
            inner.insert(fill.key, cached, &mut evicted);
        }
        // Freed by the next reader, not by the writer (see `Inner::dropped`).
        inner.dropped.append(&mut evicted);
        let overflow = if inner.dropped.len() > MAX_DROPPED {
            std::mem::take(&mut inner.dropped)
        } else {
            Vec::new()
        };
        drop(inner);
        drop(overflow);
    }

    /// Dropped values waiting to be freed.
    #[cfg(test)]
    fn dropped_len(&self) -> usize {
        lock(&self.inner).dropped.len()
    }
}

impl Inner {
    /// Drops `k`'s cached value (freed by the next reader).
    fn drop_entry(&mut self, k: &(String, String)) {
        if let Some(gone) = self.entries.remove(k) {
            if let Some(rowid) = gone.rowid {
                self.by_rowid.remove(&rowid);
            }
            self.bytes -= gone.size;
            self.dropped.push(gone.value);
        }
    }

    fn forget(&mut self, inserted: &Inserted) {
        let Inserted::Keys(keys) = inserted else {
            self.absent.clear();
            self.empty.clear();
            return;
        };
        for (scope, key) in keys {
            self.empty.remove(scope);
            if !self.absent.is_empty() {
                self.absent.remove(&(scope.clone(), key.clone()));
            }
        }
    }

    /// Caches `k`, evicting the oldest entries beyond [`MAX_BYTES`] into `evicted`.
    fn insert(&mut self, k: (String, String), cached: Cached, evicted: &mut Vec<Stored>) {
        let (rowid, size) = (cached.rowid, cached.size);
        let replaced = self.entries.insert(k.clone(), cached);
        let fresh = replaced.is_none();
        if let Some(old) = replaced {
            if let Some(old_rowid) = old.rowid.filter(|&r| Some(r) != rowid) {
                self.by_rowid.remove(&old_rowid);
            }
            self.bytes -= old.size;
            evicted.push(old.value);
        }
        if let Some(rowid) = rowid {
            self.by_rowid.insert(rowid, k.clone());
        }
        // A rewrite keeps the key's place: pushing it again made `order` grow with every write
        // of a hot key (a turn record is written several times a turn), and the clean-up below
        // then ran at every insert.
        if fresh {
            self.order.push_back(k);
        }
        self.bytes += size;
        while self.bytes > MAX_BYTES {
            let Some(oldest) = self.order.pop_front() else {
                break;
            };
            if let Some(gone) = self.entries.remove(&oldest) {
                if let Some(rowid) = gone.rowid {
                    self.by_rowid.remove(&rowid);
                }
                self.bytes -= gone.size;
                evicted.push(gone.value);
            }
        }
        let stale_order = self.order.len() > 4 * self.entries.len() + 64;
        if stale_order {
            // Keys dropped by invalidation pile up in `order` (and a key cached again after one
            // stands there twice): keep each live key once, at its first place.
            let entries = &self.entries;
            let mut seen = HashSet::with_capacity(entries.len());
            let live: VecDeque<_> = self
                .order
                .iter()
                .filter(|k| entries.contains_key(*k) && seen.insert(*k))
                .cloned()
                .collect();
            self.order = live;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// One write-through write of `scope`/`key` committed.
    fn write(cache: &KvCache, key: &str, n: u64) {
        // The kv log's append names the key; the fill is left after it.
        cache.key_changed("s", key);
        cache.pend("s", key, 8, Stored::Parsed(Arc::new(json!({"n": n}))));
        cache.committed(&Inserted::default());
    }

    /// A key written again and again does not pile up in the eviction order, so an insert's
    /// cost does not grow with the number of writes before it.
    #[test]
    fn a_hot_key_rewritten_does_not_pile_up_in_the_eviction_order() {
        let cache = KvCache::default();
        for n in 0..10_000 {
            write(&cache, "turn", n);
        }
        assert_eq!(cache.get("s", "turn").unwrap()["n"], 9_999);
        // Each commit drops the changed row and caches it again, so the key may stand in the
        // order more than once between clean-ups, but never more than the clean-up's bound.
        let inner = lock(&cache.inner);
        assert_eq!(inner.entries.len(), 1);
        assert!(inner.order.len() <= 4 + 64 + 1, "{}", inner.order.len());
    }

    impl KvCache {
        fn get(&self, scope: &str, key: &str) -> Option<Arc<Value>> {
            match self.lookup(scope, key) {
                Lookup::Hit(Stored::Parsed(value)) => Some(value),
                Lookup::Hit(Stored::Text(text)) => {
                    Some(Arc::new(serde_json::from_str(&text).unwrap()))
                }
                Lookup::Absent | Lookup::Unknown => None,
            }
        }
    }

    #[test]
    fn values_replaced_by_writes_are_freed_when_nobody_reads() {
        let cache = KvCache::default();
        for n in 0..10 * MAX_DROPPED as u64 {
            write(&cache, "k", n);
            assert!(
                cache.dropped_len() <= MAX_DROPPED,
                "{}",
                cache.dropped_len()
            );
        }
        assert_eq!(
            *cache.get("s", "k").unwrap(),
            json!({"n": 10 * MAX_DROPPED as u64 - 1})
        );
    }

    #[test]
    fn a_read_that_hits_frees_what_the_writer_dropped() {
        let cache = KvCache::default();
        for n in 0..3 {
            write(&cache, "k", n);
        }
        assert!(cache.dropped_len() > 0);
        assert_eq!(*cache.get("s", "k").unwrap(), json!({"n": 2}));
        assert_eq!(cache.dropped_len(), 0);
    }
}
