//! The write-ahead copy of the state this worker wrote: the last value per key, with when it
//! was acknowledged, kept in a SQLite file beside the worker (`iii-write-ahead.db` in its data
//! dir), so a worker killed together with the engine still knows, once started again, what the
//! engine may have lost in its 5 s flush window.
//!
//! Each row is committed before the write is reported done (WAL, `synchronous=NORMAL`: it
//! survives the process being killed; an operating-system crash may lose the last rows, as it
//! would the engine's own file).

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use harness_types::now_ms;
use rusqlite::{params, Connection};
use serde_json::Value;

use crate::error::IiiError;

/// One remembered write: `(scope, key)` and the value as stored (null: deleted).
pub(crate) type Row = ((String, String), Value);

pub(crate) struct Journal {
    conn: Mutex<Connection>,
    window: Duration,
    writes: std::sync::atomic::AtomicU64,
}

impl Journal {
    /// Opens (or creates) the file; without a path the copy lives in memory only.
    pub(crate) fn open(path: Option<&Path>, window: Duration) -> Result<Journal, IiiError> {
        let fail = |e: rusqlite::Error| IiiError::Journal {
            path: path
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| ":memory:".into()),
            why: e.to_string(),
        };
        let conn = match path {
            Some(p) => Connection::open(p),
            None => Connection::open_in_memory(),
        }
        .map_err(fail)?;
        conn.busy_timeout(Duration::from_secs(5)).map_err(fail)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(fail)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(fail)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS write_ahead (
                scope TEXT NOT NULL,
                key TEXT NOT NULL,
                at_ms INTEGER NOT NULL,
                value TEXT NOT NULL,
                PRIMARY KEY (scope, key)
            )",
        )
        .map_err(fail)?;
        Ok(Journal {
            conn: Mutex::new(conn),
            window,
            writes: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Remembers the last write of a key (pruning what left the window now and then).
    pub(crate) fn record(&self, scope: &str, key: &str, value: &Value) {
        let now = now_ms();
        let conn = self.conn.lock().expect("journal lock");
        let n = self
            .writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if n % 1024 == 1023 {
            let _ = conn.execute(
                "DELETE FROM write_ahead WHERE at_ms < ?1",
                params![now - self.window.as_millis() as i64],
            );
        }
        if let Err(e) = conn.execute(
            // REPLACE deletes the old row and inserts anew: the rowid follows the write order.
            "INSERT OR REPLACE INTO write_ahead (scope, key, at_ms, value) VALUES (?1, ?2, ?3, ?4)",
            params![scope, key, now, value.to_string()],
        ) {
            tracing::error!(
                scope,
                key,
                "the write-ahead copy could not keep a write: {e}"
            );
        }
    }

    /// The writes of the window, oldest first.
    pub(crate) fn recent(&self) -> Vec<Row> {
        let since = now_ms() - self.window.as_millis() as i64;
        let conn = self.conn.lock().expect("journal lock");
        let _ = conn.execute("DELETE FROM write_ahead WHERE at_ms < ?1", params![since]);
        let mut stmt = match conn
            .prepare("SELECT scope, key, value FROM write_ahead WHERE at_ms >= ?1 ORDER BY rowid")
        {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("the write-ahead copy cannot be read: {e}");
                return Vec::new();
            }
        };
        let rows = stmt.query_map(params![since], |r| {
            Ok((
                (r.get::<_, String>(0)?, r.get::<_, String>(1)?),
                r.get::<_, String>(2)?,
            ))
        });
        match rows {
            Ok(rows) => rows
                .filter_map(Result::ok)
                .filter_map(|(k, v)| serde_json::from_str(&v).ok().map(|v| (k, v)))
                .collect(),
            Err(e) => {
                tracing::error!("the write-ahead copy cannot be read: {e}");
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_last_write_per_key_survives_reopening_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("wa.db");
        {
            let j = Journal::open(Some(&path), Duration::from_secs(30)).unwrap();
            j.record("s", "a", &json!({"v": 1}));
            j.record("s", "b", &json!({"v": 2}));
            j.record("s", "a", &json!({"v": 3}));
            j.record("t", "a", &Value::Null);
        }
        let j = Journal::open(Some(&path), Duration::from_secs(30)).unwrap();
        assert_eq!(
            j.recent(),
            vec![
                (("s".into(), "b".into()), json!({"v": 2})),
                (("s".into(), "a".into()), json!({"v": 3})),
                (("t".into(), "a".into()), Value::Null),
            ]
        );
    }

    #[test]
    fn writes_older_than_the_window_are_forgotten() {
        let j = Journal::open(None, Duration::from_millis(0)).unwrap();
        j.record("s", "a", &json!(1));
        std::thread::sleep(Duration::from_millis(5));
        assert!(j.recent().is_empty());
    }
}
