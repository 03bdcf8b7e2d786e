//! Table definitions, created idempotently at open.

use rusqlite::Connection;

/// Bumped when a migration is needed; stored in `PRAGMA user_version`.
const SCHEMA_VERSION: i64 = 1;

// `queue_messages` and `events` use AUTOINCREMENT on purpose: ids are never reused, even after
// the highest row is deleted, so the queue's "rows with id > last seen" rescan can never miss a
// new row, and event cursors (`after_id`) stay valid forever.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS kv(
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY(scope, key)
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS queue_messages(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    grp TEXT NOT NULL,
    function_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    status TEXT NOT NULL DEFAULT 'ready',
    enqueued_at INTEGER NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS queue_messages_scan ON queue_messages(queue, status, id);

CREATE TABLE IF NOT EXISTS events(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    dedupe_key TEXT UNIQUE,
    at_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS events_session ON events(session_id, id);
";

pub(crate) fn create(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let res = conn
        .execute_batch(SCHEMA)
        .and_then(|_| conn.pragma_update(None, "user_version", SCHEMA_VERSION));
    match res {
        Ok(()) => conn.execute_batch("COMMIT"),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}
