//! A session's status, kept off its `sessions` row between folds. Every step sets the status
//! twice (working, then done), and an `UPDATE` of the row dirtied a leaf of `sessions` in
//! almost every commit (1.2 WAL pages a commit at 200 busy sessions). The change is recorded
//! by the event `set-status` inserts anyway; the row catches up in the store's fold.
//!
//! * **The writer** keeps the latest unfolded status of each session in a TEMP table of its
//!   own connection: it writes no WAL page, yet rolls back with the batch and its savepoints,
//!   so a `set-status` later in the same batch compares against it.
//! * **Readers** overlay the row with [`StatusLog`], the latest *committed* unfolded status of
//!   each session, filled after each COMMIT (before the write is answered) and emptied after
//!   the fold that wrote those statuses into the rows commits. A reader takes the overlay
//!   before it reads the row: the overlay it took is never older than the row it then reads
//!   was when it took it. (A read racing a delete and a create again under the same id can
//!   put the deleted session's last status on the new row, once.)
//! * **A killed process** leaves its unfolded statuses only in the events. `status_fold`
//!   holds the event id up to which the rows are complete; at open, the latest status event
//!   of each session above it is written into its row (unless the session was deleted after
//!   it), and the mark moves to the log's end.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use harness_store::{last_event_id_in, latest_by_session_in, StoreError};
use harness_types::session::{SessionMeta, SessionStatus};
use rusqlite::{params, Connection, OptionalExtension};

use super::{parse_status, status_str};
use crate::topics;

/// The fold's own mark (one row), in the database.
pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS status_fold (
    name TEXT PRIMARY KEY,
    upto INTEGER NOT NULL
) WITHOUT ROWID;
";

/// The writer's unfolded statuses, on its own connection (see the module docs).
pub(super) const WRITER_TAIL: &str = "
CREATE TEMP TABLE IF NOT EXISTS session_status (
    session_id TEXT PRIMARY KEY,
    status TEXT NOT NULL,
    status_reason TEXT,
    updated_at INTEGER NOT NULL
) WITHOUT ROWID;
";

/// The writer's unfolded statuses into the rows, in key order, and the tail starts over.
const FOLD: &str = "
UPDATE sessions SET status = t.status, status_reason = t.status_reason,
    updated_at = MAX(sessions.updated_at, t.updated_at)
    FROM temp.session_status AS t WHERE sessions.session_id = t.session_id;
DELETE FROM temp.session_status;
";

/// A status not yet in its session's row.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Pending {
    pub(crate) status: SessionStatus,
    pub(crate) reason: Option<String>,
    pub(crate) updated_at: i64,
}

impl Pending {
    /// Puts this status on `meta`, read from its row.
    pub(crate) fn apply(self, meta: &mut SessionMeta) {
        meta.status = self.status;
        meta.status_reason = self.reason;
        meta.updated_at = meta.updated_at.max(self.updated_at);
    }
}

/// The readers' overlay (see the module docs); one per store.
#[derive(Default)]
pub(crate) struct StatusLog {
    pending: Mutex<HashMap<String, Pending>>,
}

impl StatusLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pending>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The latest committed status of `session_id` that its row does not hold yet.
    pub(crate) fn get(&self, session_id: &str) -> Option<Pending> {
        self.lock().get(session_id).cloned()
    }

    /// After the COMMIT of a write that changed the status (on the writer thread).
    fn publish(self: &Arc<Self>, session_id: &str, pending: Option<Pending>) {
        let log = self.clone();
        let session = session_id.to_string();
        let queued = harness_store::after_commit(move || {
            let mut map = log.lock();
            match pending {
                Some(p) => map.insert(session, p),
                None => map.remove(&session),
            };
        });
        debug_assert!(queued, "statuses are written by the store's writer only");
    }
}

/// The status the writer sees for `session_id` inside its transaction: its unfolded one, or
/// the row's (None: no such session).
pub(super) fn current_in_writer(
    conn: &Connection,
    session_id: &str,
) -> Result<Option<(SessionStatus, Option<String>)>, StoreError> {
    if let Some(p) = pending_in_writer(conn, session_id)? {
        return Ok(Some((p.status, p.reason)));
    }
    Ok(conn
        .prepare_cached("SELECT status, status_reason FROM sessions WHERE session_id = ?1")?
        .query_row([session_id], |r| {
            Ok((parse_status(&r.get::<_, String>(0)?), r.get(1)?))
        })
        .optional()?)
}

/// The writer's unfolded status of `session_id`, inside its transaction.
pub(super) fn pending_in_writer(
    conn: &Connection,
    session_id: &str,
) -> Result<Option<Pending>, StoreError> {
    Ok(conn
        .prepare_cached(
            "SELECT status, status_reason, updated_at FROM temp.session_status
             WHERE session_id = ?1",
        )?
        .query_row([session_id], |r| {
            Ok(Pending {
                status: parse_status(&r.get::<_, String>(0)?),
                reason: r.get(1)?,
                updated_at: r.get(2)?,
            })
        })
        .optional()?)
}

/// Records a status change inside the writer's transaction (its event is the caller's).
pub(super) fn record_in(
    conn: &Connection,
    log: &Arc<StatusLog>,
    session_id: &str,
    status: SessionStatus,
    reason: Option<&str>,
    updated_at: i64,
) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT OR REPLACE INTO temp.session_status (session_id, status, status_reason, updated_at)
         VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![session_id, status_str(status), reason, updated_at])?;
    log.publish(
        session_id,
        Some(Pending {
            status,
            reason: reason.map(str::to_string),
            updated_at,
        }),
    );
    Ok(())
}

/// Forgets a deleted session's unfolded status, inside the delete's transaction.
pub(super) fn forget_in(
    conn: &Connection,
    log: &Arc<StatusLog>,
    session_id: &str,
) -> Result<(), StoreError> {
    conn.prepare_cached("DELETE FROM temp.session_status WHERE session_id = ?1")?
        .execute([session_id])?;
    log.publish(session_id, None);
    Ok(())
}

/// The store's fold: the unfolded statuses into their rows, the mark to `upto`, and, once
/// that commits, the readers' overlay emptied (every status in it is in a row by then: the
/// writer alone fills it, and not during the fold's own transaction).
pub(super) fn fold_in(
    conn: &Connection,
    log: &Arc<StatusLog>,
    upto: i64,
) -> Result<(), StoreError> {
    conn.execute_batch(FOLD)?;
    set_mark(conn, upto)?;
    let log = log.clone();
    let queued = harness_store::after_commit(move || log.lock().clear());
    debug_assert!(queued, "statuses are folded by the store's writer only");
    Ok(())
}

fn set_mark(conn: &Connection, upto: i64) -> Result<(), StoreError> {
    conn.prepare_cached("INSERT OR REPLACE INTO status_fold (name, upto) VALUES ('status', ?1)")?
        .execute([upto])?;
    Ok(())
}

/// At open, before anything reads a status: what a killed process committed after its last
/// fold, from the events, into the rows.
pub(super) fn recover_in(conn: &Connection) -> Result<(), StoreError> {
    let mark: Option<i64> = conn
        .query_row(
            "SELECT upto FROM status_fold WHERE name = 'status'",
            [],
            |r| r.get(0),
        )
        .optional()?;
    let Some(mark) = mark else {
        // A new store, or one a version that wrote every status into its row left: the rows
        // are complete. From here on the mark is always there (set now, moved by each fold).
        return set_mark(conn, last_event_id_in(conn)?);
    };
    let (latest, upto) =
        latest_by_session_in(conn, mark, &[topics::STATUS_CHANGED, topics::DELETED])?;
    for event in latest {
        // A session deleted after its last status change is gone, or was created again after
        // the delete with the status a new session has.
        if event.topic != topics::STATUS_CHANGED {
            continue;
        }
        let Some(session_id) = event.session_id else {
            continue;
        };
        let status = event
            .payload
            .get("status")
            .and_then(|s| s.as_str())
            .map(parse_status);
        let reason = event.payload.get("reason").and_then(|r| r.as_str());
        if let Some(status) = status {
            conn.prepare_cached(
                "UPDATE sessions SET status = ?2, status_reason = ?3,
                 updated_at = MAX(updated_at, ?4) WHERE session_id = ?1",
            )?
            .execute(params![session_id, status_str(status), reason, event.at_ms])?;
        }
    }
    set_mark(conn, upto)
}
