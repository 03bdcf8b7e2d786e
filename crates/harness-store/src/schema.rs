//! Table definitions, created idempotently at open, and the migration from older layouts.

use rusqlite::{Connection, OptionalExtension};

/// Bumped when a migration is needed; stored in `PRAGMA user_version`.
/// 1: `kv` WITHOUT ROWID, `events` AUTOINCREMENT with a UNIQUE `dedupe_key` column.
/// 2: `kv` a rowid table, `events` without AUTOINCREMENT and with a partial dedupe index.
/// 3: no `events_session` index; `events_by_session`, folded in batches (`events.rs`), and
///    `folds`, the mark each fold reached.
/// 4: `kv_log`, where the writer appends kv changes for a fold to write back (`kv_log.rs`).
/// 5: no `events_dedupe` index; `event_keys`, the dedupe keys of folded events (`events.rs`).
pub(crate) const SCHEMA_VERSION: i64 = 5;

// `kv` is a rowid table with a unique (scope, key) index, not WITHOUT ROWID: its values (turn
// records are ~1.3 KiB) are larger than the ~1 KiB a WITHOUT ROWID row keeps on a 4 KiB page, so
// every write of one freed and allocated an overflow page (and touched the free list and page 1)
// and every read followed it. A rowid table keeps up to ~4 KiB in the leaf, and an update that
// leaves scope and key alone does not touch the index.
//
// `queue_messages` uses AUTOINCREMENT on purpose: acked rows are deleted, the newest included,
// and ids must never be reused, so the queue's "rows with id > last seen" rescan can never miss a
// new row.
//
// `events` ids are plain rowids (max + 1): the log is append-only (nothing deletes from it), so
// ids are never reused and event cursors (`after_id`) stay valid forever, without the
// `sqlite_sequence` update AUTOINCREMENT costs on every insert.
//
// `event_keys` holds the dedupe keys of folded events (most events carry none); the keys of the
// events above the fold mark are checked in the writer's memory and written here by the fold, so
// that a commit does not rewrite the right edges of a key index (`events.rs`).
//
// `kv_log` holds kv changes not yet written back to `kv` (NULL value: a deletion), appended
// in id order by the writer and emptied by each fold (`kv_log.rs`).
//
// `events_by_session` is the per-session index of the log, written by folds rather than by each
// insert (`events.rs`); `folds` holds the mark up to which it is complete.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS kv(
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    updated_at INTEGER NOT NULL,
    UNIQUE(scope, key)
);

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
    id INTEGER PRIMARY KEY,
    session_id TEXT,
    topic TEXT NOT NULL,
    payload TEXT NOT NULL,
    dedupe_key TEXT,
    at_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS event_keys(
    dedupe_key TEXT PRIMARY KEY
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS events_by_session(
    session_id TEXT NOT NULL,
    id INTEGER NOT NULL,
    PRIMARY KEY(session_id, id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS kv_log(
    id INTEGER PRIMARY KEY,
    scope TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT,
    updated_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS folds(
    name TEXT PRIMARY KEY,
    upto INTEGER NOT NULL
) WITHOUT ROWID;
";

/// Version 2 (or a fresh store) → 3: the per-session index is built from the whole log in one
/// go, and the old index every insert wrote is dropped — after, so the build reads the log in
/// that index's order instead of sorting every pair in memory. Idempotent.
const TO_V3: &str = "
INSERT OR IGNORE INTO events_by_session(session_id, id)
    SELECT session_id, id FROM events WHERE session_id IS NOT NULL ORDER BY session_id, id;
DROP INDEX IF EXISTS events_session;
INSERT OR REPLACE INTO folds(name, upto) VALUES ('events', (SELECT COALESCE(MAX(id), 0) FROM events));
";

/// Version 4 (or older, after the steps above) → 5: the dedupe keys of the folded events move
/// from the index every insert wrote to `event_keys`; those above the fold mark are read into the
/// writer's memory at open, as a killed process would leave them. Idempotent.
const TO_V5: &str = "
INSERT OR IGNORE INTO event_keys(dedupe_key)
    SELECT dedupe_key FROM events
    WHERE dedupe_key IS NOT NULL AND id <= (SELECT upto FROM folds WHERE name = 'events')
    ORDER BY dedupe_key;
DROP INDEX IF EXISTS events_dedupe;
";

/// Version 1 → 2: both tables are rebuilt under their old names moved aside, rows and ids kept.
/// The old `events_session` index goes first: it keeps its name when its table is renamed, and
/// `CREATE INDEX IF NOT EXISTS` would then skip creating it on the new table.
const FROM_V1: &str = "
DROP INDEX IF EXISTS events_session;
ALTER TABLE kv RENAME TO kv_v1;
ALTER TABLE events RENAME TO events_v1;
";
const FROM_V1_COPY: &str = "
INSERT INTO kv(scope, key, value, updated_at) SELECT scope, key, value, updated_at FROM kv_v1;
DROP TABLE kv_v1;
INSERT INTO events(id, session_id, topic, payload, dedupe_key, at_ms)
    SELECT id, session_id, topic, payload, dedupe_key, at_ms FROM events_v1 ORDER BY id;
DROP TABLE events_v1;
";

fn table_sql(conn: &Connection, name: &str) -> rusqlite::Result<Option<String>> {
    conn.query_row(
        "SELECT sql FROM sqlite_schema WHERE type = 'table' AND name = ?1",
        [name],
        |r| r.get(0),
    )
    .optional()
}

/// Whether the tables are in the version 1 layout (a store written before version 2).
fn is_v1(conn: &Connection) -> rusqlite::Result<bool> {
    let kv = table_sql(conn, "kv")?.unwrap_or_default();
    let events = table_sql(conn, "events")?.unwrap_or_default();
    Ok(kv.to_ascii_uppercase().contains("WITHOUT ROWID")
        || events.to_ascii_uppercase().contains("AUTOINCREMENT"))
}

fn create_in(conn: &Connection) -> rusqlite::Result<()> {
    let version = version(conn)?;
    if is_v1(conn)? {
        tracing::info!("harness-store: migrating the store to schema version {SCHEMA_VERSION}");
        conn.execute_batch(FROM_V1)?;
        conn.execute_batch(SCHEMA)?;
        conn.execute_batch(FROM_V1_COPY)?;
    } else {
        conn.execute_batch(SCHEMA)?;
    }
    if version < 3 {
        if version > 0 {
            tracing::info!("harness-store: indexing the event log by session (schema 3)");
        }
        conn.execute_batch(TO_V3)?;
    }
    if version < 5 {
        if version > 0 {
            tracing::info!("harness-store: moving the event log's dedupe keys (schema 5)");
        }
        conn.execute_batch(TO_V5)?;
    }
    conn.pragma_update(None, "user_version", SCHEMA_VERSION)
}

/// The schema version a database holds (0 when it is new).
pub(crate) fn version(conn: &Connection) -> rusqlite::Result<i64> {
    conn.query_row("PRAGMA user_version", [], |r| r.get(0))
}

/// Creates the tables, migrating an older layout, in one transaction.
pub(crate) fn create(conn: &Connection) -> rusqlite::Result<()> {
    conn.execute_batch("BEGIN IMMEDIATE")?;
    match create_in(conn) {
        Ok(()) => conn.execute_batch("COMMIT"),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}
