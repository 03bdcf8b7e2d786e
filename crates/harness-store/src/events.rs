//! Append-only event log (`events` table) with an optional dedupe key, plus a wake-up signal.
//!
//! Subscribers get a `tokio::sync::watch::Receiver<i64>` holding the latest committed event id.
//! A watch (rather than a broadcast) because subscribers only need "something new up to id N"
//! and then page with [`Store::events_after`]: it is one shared slot (no per-message allocation),
//! it can never lag or drop (a slow reader just sees the newest id), and it coalesces bursts.

use rusqlite::Connection;
use serde_json::Value;

use crate::error::StoreError;
use crate::store::Store;

/// One row of the log.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EventRow {
    pub id: i64,
    pub session_id: Option<String>,
    pub topic: String,
    pub payload: Value,
    pub at_ms: i64,
}

/// Inserts an event inside a caller's write. Returns `None` when `dedupe_key` is already
/// present (the event was recorded before: idempotent retries). Call [`Store::notify_events`]
/// after the write resolves so subscribers learn of it.
pub fn insert_event_in(
    conn: &Connection,
    session_id: Option<&str>,
    topic: &str,
    payload: &Value,
    dedupe_key: Option<&str>,
) -> Result<Option<i64>, StoreError> {
    let text = serde_json::to_string(payload)?;
    insert_event_text_in(conn, session_id, topic, &text, dedupe_key)
}

/// [`insert_event_in`] with the payload already serialised (by the caller, off the writer
/// thread). `text` must be JSON: readers parse it.
pub fn insert_event_text_in(
    conn: &Connection,
    session_id: Option<&str>,
    topic: &str,
    text: &str,
    dedupe_key: Option<&str>,
) -> Result<Option<i64>, StoreError> {
    // ON CONFLICT(dedupe_key) rather than INSERT OR IGNORE: only a duplicate key is ignored,
    // any other constraint failure is still an error. The WHERE names the partial index.
    let changed = conn
        .prepare_cached(
            "INSERT INTO events(session_id, topic, payload, dedupe_key, at_ms)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(dedupe_key) WHERE dedupe_key IS NOT NULL DO NOTHING",
        )?
        .execute((session_id, topic, text, dedupe_key, harness_types::now_ms()))?;
    Ok((changed > 0).then(|| conn.last_insert_rowid()))
}

/// `+?1`, not `?1`: SQLite (3.54) re-prepares a statement that orders by an index whose
/// leading column is compared with a bare bound parameter every time that parameter is bound
/// again, and the statement cache rebinds on every use. The unary plus keeps the index (same
/// plan, no sort) without the re-preparation. The same holds for every `col = +?N … ORDER BY`
/// of the store and the transcript.
const EVENTS_AFTER: &str = "SELECT id, session_id, topic, payload, at_ms FROM events
                 WHERE session_id = +?1 AND id > ?2 ORDER BY id";

pub(crate) fn max_event_id(conn: &Connection) -> Result<i64, StoreError> {
    Ok(conn
        .prepare_cached("SELECT COALESCE(MAX(id), 0) FROM events")?
        .query_row([], |r| r.get(0))?)
}

impl Store {
    /// Appends one event (committed when it resolves) and wakes subscribers.
    pub async fn append_event(
        &self,
        session_id: Option<&str>,
        topic: &str,
        payload: &Value,
        dedupe_key: Option<&str>,
    ) -> Result<Option<i64>, StoreError> {
        let session_id = session_id.map(str::to_string);
        let topic = topic.to_string();
        let text = serde_json::to_string(payload)?;
        let dedupe_key = dedupe_key.map(str::to_string);
        let id = self
            .write_replayable(move |c| {
                insert_event_text_in(
                    c,
                    session_id.as_deref(),
                    &topic,
                    &text,
                    dedupe_key.as_deref(),
                )
            })
            .await?;
        if let Some(id) = id {
            self.publish_event_id(id);
        }
        Ok(id)
    }

    /// Wakes subscribers after events were inserted with [`insert_event_in`] inside a caller's
    /// write (call it once that write has resolved).
    pub fn notify_events(&self) {
        match self.last_event_id() {
            Ok(id) => self.publish_event_id(id),
            Err(e) => tracing::warn!(error = %e, "harness-store: cannot read the last event id"),
        }
    }

    /// Wakes subscribers after a caller's write that inserted event `id` with
    /// [`insert_event_in`] has resolved: [`Store::notify_events`] without reading the log.
    pub fn notify_event(&self, id: i64) {
        self.publish_event_id(id);
    }

    /// A receiver whose value is the latest committed event id; `changed()` fires on new events.
    pub fn subscribe_events(&self) -> tokio::sync::watch::Receiver<i64> {
        self.events_sender().subscribe()
    }

    /// Up to `limit` events of a session with `id > after_id`, oldest first (cursor paging).
    pub fn events_after(
        &self,
        session_id: &str,
        after_id: i64,
        limit: usize,
    ) -> Result<Vec<EventRow>, StoreError> {
        self.read(|c| {
            let mut stmt = c.prepare_cached(EVENTS_AFTER)?;
            // No `LIMIT ?`: SQLite re-prepares a statement whose bound LIMIT value changes, and
            // the statement cache clears bindings between uses, so a bound LIMIT would re-prepare
            // on every call. Rows stream in index order; stopping early reads nothing more.
            // (And `+?1` in EVENTS_AFTER, for the same reason.)
            let rows = stmt.query_map((session_id, after_id), |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Option<String>>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })?;
            let mut out = Vec::new();
            for row in rows.take(limit) {
                let (id, session_id, topic, payload, at_ms) = row?;
                out.push(EventRow {
                    id,
                    session_id,
                    topic,
                    payload: serde_json::from_str(&payload)?,
                    at_ms,
                });
            }
            Ok(out)
        })
    }

    /// Highest committed event id (0 when the log is empty).
    pub fn last_event_id(&self) -> Result<i64, StoreError> {
        self.read(max_event_id)
    }

    /// Raises the watched id (never lowers it: concurrent publishers may finish out of order).
    fn publish_event_id(&self, id: i64) {
        self.events_sender().send_if_modified(|current| {
            if id > *current {
                *current = id;
                true
            } else {
                false
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Durability;
    use rusqlite::StatementStatus;

    /// Paging with changing page sizes reuses the cached statement as prepared: nothing in it
    /// (a bound LIMIT, say) makes SQLite compile it again on every call.
    #[tokio::test]
    async fn paging_never_reprepares() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("e.db"), Durability::Normal).unwrap();
        for i in 0..5 {
            store
                .append_event(Some("s"), "t", &serde_json::json!({ "i": i }), None)
                .await
                .unwrap();
        }
        for (session, after, limit) in [("s", 0, 2), ("s", 2, 10), ("x", 0, 1), ("s", 300, 3)] {
            let page = store.events_after(session, after, limit).unwrap();
            assert!(page.len() <= limit);
        }
        assert_eq!(store.events_after("s", 0, 2).unwrap().len(), 2);
        let reprepared = store
            .read(|c| {
                Ok(c.prepare_cached(EVENTS_AFTER)?
                    .get_status(StatementStatus::RePrepare))
            })
            .unwrap();
        assert_eq!(reprepared, 0);
    }
}
