//! The kv write log: every `kv` change made on the writer is appended to `kv_log` instead of
//! updating its row in place, and a fold brings `kv` up to date in batches.
//!
//! Why: `kv` is keyed by scope and key, and the loop's turn record (~1.5 KiB, written twice a
//! step) is keyed by session, so every commit rewrote one leaf of `kv` per session it touched:
//! 1.7 of a step's 6 WAL pages at 200 sessions. An append goes to the log's right edge, which
//! the commit's other appends share; the fold rewrites each key's leaf once for thousands of
//! versions, in key order.
//!
//! Who finds what:
//!
//! * **The writer** finds a key's newest logged version through `temp.kv_log_at` (scope, key →
//!   log id), a TEMP table of its own connection: memory only, no WAL, and rolled back with the
//!   batch or an op's savepoint, so a write reads what earlier writes of its batch logged.
//! * **Readers** (other connections, no TEMP table) take the key's newest *committed* log id
//!   from [`LogState::latest`] (filled after each COMMIT, before the kv cache's generation
//!   moves on and before the batch's writes are answered) before they open their read
//!   transaction, then read that log row in it. A row no
//!   longer there was folded before the transaction began, so `kv` holds it (or something
//!   newer). A key with no id had nothing logged when the read began: `kv` is current.
//! * **A deletion** is a logged version too (a NULL value), so a crash between it and the fold
//!   cannot bring an older logged version back.
//!
//! The fold runs as a part of the events fold (every 32,768 events, after 500 ms without
//! writes, at close) and when the log reaches [`FOLD_ROWS`] versions; a log a killed process
//! left is folded at the next open. Log ids come from a counter of the writer's, so they never
//! repeat within a process (the table is emptied by each fold, and a plain rowid would start
//! over).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use rusqlite::{Connection, OptionalExtension};

use crate::cache::KvCache;
use crate::error::StoreError;

/// Logged versions after which the writer folds at its next commit.
pub(crate) const FOLD_ROWS: usize = 4096;

/// The writer connection's index of the log (see the module docs).
pub(crate) const TEMP_INDEX: &str = "CREATE TEMP TABLE IF NOT EXISTS kv_log_at(
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    id INTEGER NOT NULL,
    PRIMARY KEY(scope, key)
) WITHOUT ROWID";

/// What readers and the writer share of the log.
#[derive(Default)]
pub(crate) struct LogState {
    /// Each logged key's newest committed log id, by scope and key (looked up by `&str`, no
    /// key built per read; a scope's keys without a walk of the others).
    latest: Mutex<HashMap<String, HashMap<String, i64>>>,
    /// The next log id.
    next_id: AtomicI64,
    /// Versions appended since the last fold (rolled-back ones included: a fold comes early).
    rows: AtomicUsize,
}

impl LogState {
    fn latest(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, i64>>> {
        self.latest.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes `id` as the newest committed version of `scope`/`key`.
    fn publish(&self, scope: String, key: String, id: i64) {
        self.latest().entry(scope).or_default().insert(key, id);
    }

    /// The newest committed log id of `scope`/`key`, if it has an unfolded version.
    pub(crate) fn id_of(&self, scope: &str, key: &str) -> Option<i64> {
        self.latest().get(scope)?.get(key).copied()
    }

    /// The unfolded keys of `scope` with their newest committed log ids.
    pub(crate) fn ids_in(&self, scope: &str) -> Vec<(String, i64)> {
        self.latest().get(scope).map_or_else(Vec::new, |keys| {
            keys.iter().map(|(k, id)| (k.clone(), *id)).collect()
        })
    }

    /// Whether the writer should fold at its next commit.
    pub(crate) fn due(&self) -> bool {
        self.rows.load(Ordering::Relaxed) >= FOLD_ROWS
    }

    /// Whether anything was logged since the last fold.
    pub(crate) fn is_empty(&self) -> bool {
        self.rows.load(Ordering::Relaxed) == 0
    }
}

/// A version as the log holds it: the value's JSON text, or None for a deletion.
pub(crate) type Version = Option<String>;

/// Appends a version of `scope`/`key` on the writer's connection; readers see it once the
/// batch commits.
pub(crate) fn append(
    conn: &Connection,
    cache: &Arc<KvCache>,
    scope: &str,
    key: &str,
    text: Option<&str>,
) -> Result<(), StoreError> {
    let log = &cache.log;
    let id = log.next_id.fetch_add(1, Ordering::Relaxed);
    conn.prepare_cached(
        "INSERT INTO kv_log(id, scope, key, value, updated_at) VALUES (?1, ?2, ?3, ?4, ?5)",
    )?
    .execute((id, scope, key, text, harness_types::now_ms()))?;
    conn.prepare_cached(
        "INSERT INTO temp.kv_log_at(scope, key, id) VALUES (?1, ?2, ?3)
         ON CONFLICT(scope, key) DO UPDATE SET id = excluded.id",
    )?
    .execute((scope, key, id))?;
    log.rows.fetch_add(1, Ordering::Relaxed);
    cache.key_changed(scope, key);
    let (shared, scope, key) = (cache.clone(), scope.to_string(), key.to_string());
    if !crate::after_commit(move || shared.log.publish(scope, key, id)) {
        return Err(StoreError::Invalid(
            "the kv log is written by the store's writer only".into(),
        ));
    }
    Ok(())
}

/// The newest logged version of `scope`/`key` that `conn` sees, or None when it has none: on
/// the writer's connection (`writer`) through its index of the log, this batch's versions
/// included; on another, by a scan of the log.
pub(crate) fn latest_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    writer: bool,
) -> Result<Option<Version>, StoreError> {
    let sql = if writer {
        "SELECT l.value FROM temp.kv_log_at t JOIN kv_log l ON l.id = t.id
         WHERE t.scope = ?1 AND t.key = ?2"
    } else {
        "SELECT value FROM kv_log WHERE scope = ?1 AND key = ?2 ORDER BY id DESC LIMIT 1"
    };
    one_version(conn, sql, (scope, key))
}

/// The logged version `id` of `scope`/`key`, read on a reader's connection; None when the
/// fold took it (`kv` has it then).
pub(crate) fn version_at(
    conn: &Connection,
    id: i64,
    scope: &str,
    key: &str,
) -> Result<Option<Version>, StoreError> {
    one_version(
        conn,
        "SELECT value FROM kv_log WHERE id = ?1 AND scope = ?2 AND key = ?3",
        (id, scope, key),
    )
}

/// The version the one row `sql` selects holds, if it selects one.
fn one_version(
    conn: &Connection,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<Option<Version>, StoreError> {
    Ok(conn
        .prepare_cached(sql)?
        .query_row(params, |r| r.get::<_, Option<String>>(0))
        .optional()?)
}

/// Brings `kv` up to date with every key's newest logged version, in key order, and empties
/// the log, inside the caller's write (the writer's). Readers stop looking in the log for
/// what it folded once the write commits.
pub(crate) fn fold_in(conn: &Connection, cache: &Arc<KvCache>) -> Result<(), StoreError> {
    let Some(upto) = conn
        .prepare_cached("SELECT MAX(id) FROM kv_log")?
        .query_row([], |r| r.get::<_, Option<i64>>(0))?
    else {
        return Ok(());
    };
    let mark = cache.change_mark();
    let rowids = write_back(conn)?;
    cache.unchange_since(mark);
    let rows = cache.log.rows.load(Ordering::Relaxed);
    let shared = cache.clone();
    if !crate::after_commit(move || {
        shared.log.latest().retain(|_, keys| {
            keys.retain(|_, id| *id > upto);
            !keys.is_empty()
        });
        shared.rows_written_back(rowids);
        let _ = shared
            .log
            .rows
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                Some(n.saturating_sub(rows))
            });
    }) {
        return Err(StoreError::Invalid(
            "the kv log is folded by the store's writer only".into(),
        ));
    }
    Ok(())
}

/// The keys a fold wrote back, with the `kv` rows they are in now.
pub(crate) type WrittenBack = Vec<((String, String), i64)>;

/// The fold's statements: the newest version of each key in `temp.kv_log_at` written to `kv`
/// (a deletion deletes), then both logs emptied. Returns the rows it wrote, so the cache can
/// key what it holds of them by row from now on.
fn write_back(conn: &Connection) -> Result<WrittenBack, StoreError> {
    // The upsert's SELECT has a WHERE: without one SQLite reads ON CONFLICT's ON as a join
    // constraint.
    let mut stmt = conn.prepare_cached(
        "INSERT INTO kv(scope, key, value, updated_at)
         SELECT l.scope, l.key, l.value, l.updated_at
         FROM temp.kv_log_at t JOIN kv_log l ON l.id = t.id
         WHERE l.value IS NOT NULL ORDER BY l.scope, l.key
         ON CONFLICT(scope, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
         RETURNING scope, key, rowid",
    )?;
    let rows = stmt.query_map([], |r| Ok(((r.get(0)?, r.get(1)?), r.get(2)?)))?;
    let written = rows.collect::<rusqlite::Result<WrittenBack>>()?;
    conn.prepare_cached(
        "DELETE FROM kv WHERE rowid IN (
             SELECT kv.rowid FROM temp.kv_log_at t
             JOIN kv_log l ON l.id = t.id
             JOIN kv ON kv.scope = l.scope AND kv.key = l.key
             WHERE l.value IS NULL)",
    )?
    .execute([])?;
    conn.prepare_cached("DELETE FROM kv_log")?.execute([])?;
    conn.prepare_cached("DELETE FROM temp.kv_log_at")?
        .execute([])?;
    Ok(written)
}

/// At open, on the writer's connection before its thread starts: folds what a killed process
/// left in the log (each key's newest version wins). If that fails, the log stays and is
/// indexed for the writer and for readers, to be folded by the writer's next fold.
pub(crate) fn recover(conn: &Connection, cache: &KvCache) -> Result<(), StoreError> {
    conn.execute_batch(TEMP_INDEX)?;
    let max: Option<i64> = conn.query_row("SELECT MAX(id) FROM kv_log", [], |r| r.get(0))?;
    let Some(max) = max else {
        cache.log.next_id.store(1, Ordering::Relaxed);
        return Ok(());
    };
    cache.log.next_id.store(max + 1, Ordering::Relaxed);
    conn.execute_batch(
        "BEGIN IMMEDIATE;
         INSERT INTO temp.kv_log_at(scope, key, id)
             SELECT scope, key, MAX(id) FROM kv_log GROUP BY scope, key;",
    )?;
    match write_back(conn).and_then(|_| Ok(conn.execute_batch("COMMIT")?)) {
        Ok(()) => {
            tracing::info!("harness-store: folded the kv log a stopped process left");
            Ok(())
        }
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            tracing::warn!(error = %e, "harness-store: kv log fold deferred");
            conn.execute_batch(
                "INSERT INTO temp.kv_log_at(scope, key, id)
                     SELECT scope, key, MAX(id) FROM kv_log GROUP BY scope, key",
            )?;
            let mut stmt = conn.prepare("SELECT scope, key, id FROM temp.kv_log_at")?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
            let mut logged = 0;
            for row in rows {
                let (scope, key, id) = row?;
                cache.log.publish(scope, key, id);
                logged += 1;
            }
            cache.log.rows.store(logged, Ordering::Relaxed);
            Ok(())
        }
    }
}
