//! Scoped JSON key/value state (`kv` table).
//!
//! The `*_in` helpers take a bare connection so callers can combine KV changes with other writes
//! in one atomic `Store::write` closure; the `Store::kv_*` methods are the one-shot versions.

use std::sync::Arc;

use rusqlite::{Connection, OptionalExtension};
use serde_json::Value;

use crate::cache::{Lookup, Stored};
use crate::error::StoreError;
use crate::store::Store;

/// Reads one value, the kv log's versions included (see `kv_log.rs`): on the writer (inside a
/// `Store::write` closure) through its index of the log, this batch's versions too; on another
/// connection (`Store::read`) by a scan of the log, which is short (`Store::kv_get` knows where
/// to look and does not scan).
pub fn kv_get_in(conn: &Connection, scope: &str, key: &str) -> Result<Option<Value>, StoreError> {
    let text: Option<String> =
        match crate::kv_log::latest_in(conn, scope, key, logging().is_some())? {
            Some(version) => version,
            None => row_text(conn, scope, key)?,
        };
    text.map(|t| serde_json::from_str(&t).map_err(StoreError::from))
        .transpose()
}

fn row_text(conn: &Connection, scope: &str, key: &str) -> Result<Option<String>, StoreError> {
    Ok(conn
        .prepare_cached("SELECT value FROM kv WHERE scope = ?1 AND key = ?2")?
        .query_row((scope, key), |r| r.get(0))
        .optional()?)
}

/// The writer's cache when the current thread is a store's writer, which logs its kv changes
/// (`kv_log.rs`); None elsewhere (a bare connection writes `kv` in place).
fn logging() -> Option<Arc<crate::cache::KvCache>> {
    crate::cache::writer_cache()
}

/// Upserts one value; returns the previous value.
pub fn kv_set_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    value: &Value,
) -> Result<Option<Value>, StoreError> {
    let old = kv_get_in(conn, scope, key)?;
    kv_put_in(conn, scope, key, value)?;
    Ok(old)
}

/// Upserts one value without reading the previous one (one statement instead of two).
pub fn kv_put_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    value: &Value,
) -> Result<(), StoreError> {
    kv_put_text_in(conn, scope, key, &serde_json::to_string(value)?)
}

/// [`kv_put_in`] with the value already serialised (by the caller, off the writer thread).
/// `text` must be JSON: readers parse it.
pub fn kv_put_text_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    text: &str,
) -> Result<(), StoreError> {
    upsert_in(conn, scope, key, text)
}

/// [`kv_put_text_in`] that also caches `value` (what `text` says) once the writer's batch
/// commits with this write (see `cache.rs`). Off the writer thread it is `kv_put_text_in`.
pub fn kv_put_cached_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    text: &str,
    value: &Arc<Value>,
) -> Result<(), StoreError> {
    put_cached_in(conn, scope, key, text, Stored::Parsed(value.clone()))
}

/// [`kv_put_cached_in`] of a value given only as its JSON text, which the cache keeps as text
/// (for [`Store::kv_get_text`]). The caller serialised the text; only a test build checks it.
pub fn kv_put_text_cached_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    text: &Arc<str>,
) -> Result<(), StoreError> {
    debug_assert!(
        serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok(),
        "the text written to {scope}/{key} is not JSON"
    );
    put_cached_in(conn, scope, key, text, Stored::Text(text.clone()))
}

fn put_cached_in(
    conn: &Connection,
    scope: &str,
    key: &str,
    text: &str,
    stored: Stored,
) -> Result<(), StoreError> {
    upsert_in(conn, scope, key, text)?;
    crate::cache::pend_fill(scope, key, text.len(), stored);
    Ok(())
}

/// The one write of a value: appended to the kv log on the writer, an upsert elsewhere (a
/// bare connection, which no cache reads through).
fn upsert_in(conn: &Connection, scope: &str, key: &str, text: &str) -> Result<(), StoreError> {
    if let Some(cache) = logging() {
        return crate::kv_log::append(conn, &cache, scope, key, Some(text));
    }
    conn.prepare_cached(
        "INSERT INTO kv(scope, key, value, updated_at) VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT(scope, key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
    )?
    .execute((scope, key, text, harness_types::now_ms()))?;
    Ok(())
}

/// Deletes one value; returns it if it existed.
pub fn kv_delete_in(
    conn: &Connection,
    scope: &str,
    key: &str,
) -> Result<Option<Value>, StoreError> {
    let old = kv_get_in(conn, scope, key)?;
    if old.is_some() {
        match logging() {
            Some(cache) => crate::kv_log::append(conn, &cache, scope, key, None)?,
            None => {
                conn.prepare_cached("DELETE FROM kv WHERE scope = ?1 AND key = ?2")?
                    .execute((scope, key))?;
            }
        }
    }
    Ok(old)
}

impl Store {
    /// The latest committed value, from the cache of recent reads when it has it (see
    /// `cache.rs`: a read after a resolved write always sees that write).
    pub fn kv_get(&self, scope: &str, key: &str) -> Result<Option<Value>, StoreError> {
        Ok(self
            .kv_get_shared(scope, key)?
            .map(|v| Arc::try_unwrap(v).unwrap_or_else(|v| Value::clone(&v))))
    }

    /// [`Store::kv_get`] without the copy: a cached value is shared, not cloned.
    pub fn kv_get_shared(&self, scope: &str, key: &str) -> Result<Option<Arc<Value>>, StoreError> {
        self.kv_get_as(
            scope,
            key,
            |stored| match stored {
                Stored::Parsed(value) => Ok(value),
                Stored::Text(text) => Ok(Arc::new(serde_json::from_str(&text)?)),
            },
            |text| {
                let value: Arc<Value> = Arc::new(serde_json::from_str(&text)?);
                Ok((Stored::Parsed(value.clone()), value))
            },
        )
    }

    /// The latest committed value as its JSON text, for a reader that parses it into its own
    /// type; cached as text when a read fills the cache, and served from either form.
    pub fn kv_get_text(&self, scope: &str, key: &str) -> Result<Option<Arc<str>>, StoreError> {
        self.kv_get_as(
            scope,
            key,
            |stored| match stored {
                Stored::Text(text) => Ok(text),
                Stored::Parsed(value) => Ok(serde_json::to_string(&*value)?.into()),
            },
            |text| {
                let text: Arc<str> = text.into();
                Ok((Stored::Text(text.clone()), text))
            },
        )
    }

    /// A key's value in the form `hit` makes of the cached one, or else read from SQLite and
    /// made by `read` into the form to cache and the answer (see `cache.rs` for when a read
    /// may fill the cache).
    fn kv_get_as<R>(
        &self,
        scope: &str,
        key: &str,
        hit: impl FnOnce(Stored) -> Result<R, StoreError>,
        read: impl FnOnce(String) -> Result<(Stored, R), StoreError>,
    ) -> Result<Option<R>, StoreError> {
        let cache = self.kv_cache();
        match cache.lookup(scope, key) {
            Lookup::Hit(stored) => return hit(stored).map(Some),
            Lookup::Absent => return Ok(None),
            Lookup::Unknown => {}
        }
        let generation = cache.generation();
        let Some((rowid, text)) = self.kv_read_text(scope, key)? else {
            cache.fill_absent(generation, scope, key);
            return Ok(None);
        };
        let len = text.len();
        let (stored, answer) = read(text)?;
        cache.fill(generation, scope, key, rowid, len, stored);
        Ok(Some(answer))
    }

    /// A key's committed text and its `kv` row (None: the kv log's version), read past the
    /// cache; None when the key is absent.
    fn kv_read_text(
        &self,
        scope: &str,
        key: &str,
    ) -> Result<Option<(Option<i64>, String)>, StoreError> {
        // Before the read transaction begins (see `kv_log.rs`: who finds what).
        let logged = self.kv_cache().log.id_of(scope, key);
        let row: Option<(Option<i64>, Option<String>)> = self.read(|c| {
            if let Some(id) = logged {
                if let Some(version) = crate::kv_log::version_at(c, id, scope, key)? {
                    return Ok(Some((None, version)));
                }
            }
            Ok(
                c.prepare_cached("SELECT rowid, value FROM kv WHERE scope = ?1 AND key = ?2")?
                    .query_row((scope, key), |r| Ok((Some(r.get(0)?), Some(r.get(1)?))))
                    .optional()?,
            )
        })?;
        Ok(match row {
            Some((rowid, Some(text))) => Some((rowid, text)),
            _ => None,
        })
    }

    /// Committed (not fsynced) when it resolves; returns the previous value.
    pub async fn kv_set(
        &self,
        scope: &str,
        key: &str,
        value: &Value,
    ) -> Result<Option<Value>, StoreError> {
        let (scope, key, text) = (
            scope.to_string(),
            key.to_string(),
            serde_json::to_string(value)?,
        );
        self.write_replayable(move |c| {
            let old = kv_get_in(c, &scope, &key)?;
            kv_put_text_in(c, &scope, &key, &text)?;
            Ok(old)
        })
        .await
    }

    /// Upserts one value (committed, not fsynced, when it resolves) without reading the
    /// previous one; the value is serialised here, not on the writer thread.
    pub async fn kv_put(&self, scope: &str, key: &str, value: &Value) -> Result<(), StoreError> {
        self.kv_put_through(scope, key, value.clone()).await
    }

    /// [`Store::kv_put`] for an owned value, which the cache keeps once the write commits (the
    /// next read of the key skips SQLite and the parse).
    pub async fn kv_put_through(
        &self,
        scope: &str,
        key: &str,
        value: Value,
    ) -> Result<(), StoreError> {
        let (scope, key, text) = (
            scope.to_string(),
            key.to_string(),
            serde_json::to_string(&value)?,
        );
        let value = Arc::new(value);
        self.write_replayable(move |c| kv_put_cached_in(c, &scope, &key, &text, &value))
            .await
    }

    /// [`Store::kv_put_through`] of a value already serialised as JSON text, cached as text.
    pub async fn kv_put_text_through(
        &self,
        scope: &str,
        key: &str,
        text: Arc<str>,
    ) -> Result<(), StoreError> {
        let (scope, key) = (scope.to_string(), key.to_string());
        self.write_replayable(move |c| kv_put_text_cached_in(c, &scope, &key, &text))
            .await
    }

    /// Committed (not fsynced) when it resolves; returns the removed value.
    pub async fn kv_delete(&self, scope: &str, key: &str) -> Result<Option<Value>, StoreError> {
        let (scope, key) = (scope.to_string(), key.to_string());
        self.write_replayable(move |c| kv_delete_in(c, &scope, &key))
            .await
    }

    /// Every `(key, value)` of a scope, ordered by key (the primary key order: no sort needed).
    /// A scope found empty is remembered until a row is inserted into it (see `cache.rs`).
    pub fn kv_list(&self, scope: &str) -> Result<Vec<(String, Value)>, StoreError> {
        let cache = self.kv_cache();
        if cache.is_empty_scope(scope) {
            return Ok(Vec::new());
        }
        let generation = cache.generation();
        // Before the read transaction begins (see `kv_log.rs`: who finds what).
        let logged = cache.log.ids_in(scope);
        let rows = self.read(|c| {
            let mut stmt =
                c.prepare_cached("SELECT key, value FROM kv WHERE scope = ?1 ORDER BY key")?;
            let rows = stmt.query_map([scope], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
            })?;
            let mut texts = std::collections::BTreeMap::new();
            for row in rows {
                let (key, text) = row?;
                texts.insert(key, text);
            }
            // Newer than the rows: what the log still holds of the scope.
            for (key, id) in logged {
                match crate::kv_log::version_at(c, id, scope, &key)? {
                    Some(Some(text)) => {
                        texts.insert(key, text);
                    }
                    Some(None) => {
                        texts.remove(&key);
                    }
                    None => {}
                }
            }
            let mut out = Vec::with_capacity(texts.len());
            for (key, text) in texts {
                out.push((key, serde_json::from_str(&text)?));
            }
            Ok(out)
        })?;
        if rows.is_empty() {
            cache.fill_empty(generation, scope);
        }
        Ok(rows)
    }
}
